"""The host's share of one batched MTP round: torch ops per round, and per session of the round.

On CUDA a batched round's passes are captured graphs (one replay each, whatever the batch), so what grows
with its sessions is the host code around them: each torch op there is a dispatch and most are a kernel
launch (~5-10 us of the host each). This counts them, without a GPU: a fused runner of a tiny random
checkpoint (--layers) whose Triton kernels run in Triton's interpreter, one round of B sessions at K
drafts (decode_worker.mtp._round: the chains, the verify pass, the rewind of the cut blocks, the pending
pairs), every aten op counted (a TorchDispatchMode). The passes' own ops (the interpreter's) do not grow
with B, so `ops_per_session`, the slope between the two smallest B, is the host code's. Drafts are the
model's greedy picks over random weights: most blocks are cut, as at a low acceptance.

    python benchmarks/bench_round_ops.py [--sessions 2,8] [--k 3] [--layers 8] [--round mtp|exact]
        [--drafts mtp|bf16] [--out R.json]

--round exact: one exact-mode round instead, each worker's half counted apart: the decode worker's Draft
batch with the last round's verdicts (decode_worker/drafting.py draft_batch, mtp drafts: the verdict rows,
the pending pairs, the chains) and the prefill worker's Verify batch (prefill_worker/verifying.py verify_batch: the
blocks' pass and the rewind of the cut ones), after a first round that leaves every session a verdict:
draft_ops / verify_ops per B and draft_ops_per_session / verify_ops_per_session. Host syncs (a tensor read
back to Python: aten._local_scalar_dense, and .tolist()'s) are in ops_by_kind as any op.

Prints JSON: per B: ops (all, in one round), ops_by_kind (the ten most frequent); ops_per_session; and
o1_tensors (the GDN conv and recurrent tensors and 3 scalars a slot holds: a per-slot snapshot loop
copies each), with o1_tensors_9b for the Qwen3.5-9B shape (24 GDN layers).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import os
import sys
import tempfile
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import tests.interp_shim  # noqa: E402,F401  (the interpreter's numpy fix, before kernels are traced)
from baton.engine.runner import ModelRunner  # noqa: E402
from baton.engine.speculation import GREEDY  # noqa: E402
from baton.loading import load_model  # noqa: E402
from baton.random_checkpoint import make_random_checkpoint  # noqa: E402
from benchmarks.report import emit, machine  # noqa: E402
from decode_worker import drafting, mtp  # noqa: E402
from prefill_worker.verifying import verify_batch  # noqa: E402

GDN_LAYERS_9B = 24  # Qwen3.5-9B: 32 layers, full attention in one of every four


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


class _Session:
    """The fields of a decode worker session that an MTP round reads and writes (decode_worker/engine.py)."""

    def __init__(self, slot: int, runner: ModelRunner, hidden: int):
        p = int(runner.state.position[slot])
        self.slot, self.runner = slot, runner
        self.mtp_pairs_h = torch.zeros(1, hidden)  # (h_{p-1}, t0): the pending pair a round starts from
        self.mtp_pairs_ids = [int(runner.state.next_token[slot])]
        self.mtp_start, self.mtp_h_more = p - 1, []
        self.rounds = self.emitted_in_rounds = 0
        self.round_ends, self.masker = frozenset(), None  # (a plain session: no end tokens, no grammar)


def point(model, cfg, b: int, k: int) -> dict:
    r = ModelRunner(model, slots=b, max_len=256, width=max(8, k + 2), fast=True, checkpoints=True)
    r.enable_batching()
    sessions = []
    for s in range(b):
        r.prefill(s, [5 + s, 6, 7])
        sessions.append(_Session(s, r, cfg.hidden_size))
    eng = type("Engine", (), {"drafter": GREEDY})()
    with _Count() as c:  # (a first round: its lazily made buffers are the same at any B, so the slope holds)
        mtp._round(eng, [(s, k) for s in sessions])
    return {"sessions": b, "ops": sum(c.n.values()), "ops_by_kind": dict(c.n.most_common(10))}


def exact_point(lm, b: int, k: int, engine: str = "mtp") -> dict:
    """One exact-mode round of b sessions drafting with `engine` (mtp, or bf16: the AR drafts that fp8
    drafting runs too) (module doc): the Draft batch's and the Verify batch's ops."""
    from decode_worker.engine import DecodeEngine
    from prefill_worker.engine import ExactEngine

    width = max(8, k + 2)
    pre = ModelRunner(lm.model, slots=b, max_len=256, width=width, fast=True, checkpoints=True)
    pre.enable_batching()
    dr = ModelRunner(lm.model, slots=b, max_len=256, width=width, fast=True, checkpoints=True)
    dr.enable_batching()
    exact = ExactEngine(pre)
    dec = DecodeEngine({"bf16": dr, "mtp": dr}, default_engine="mtp")
    pairs = []
    for i in range(b):
        s, _ = exact.prefill([5 + i, 6, 7, 8])
        tensors, pos, nxt = exact.export(s.id)
        d = dec.load({t.name: t.tensor.clone() for t in tensors}, position=pos, next_token=nxt, engine=engine)
        pairs.append((exact.get(s.id), dec.get(d.id)))
    verdicts = [None] * b

    def round_(count: bool) -> dict:
        drafts = drafting.draft_batch(dec, [(ds, k, v) for (_, ds), v in zip(pairs, verdicts)])
        blocks = [(es, [int(exact.runner.state.next_token[es.slot]), *d], None) for (es, _), d in zip(pairs, drafts)]
        with _Count() as cv:
            got = verify_batch(exact.runner, blocks)
        for i, (m, nxt, *_) in enumerate(got):
            verdicts[i] = (m, nxt)
        return {"verify": cv.n}

    round_(False)  # the first round: no verdicts yet; every session has one for the counted round
    with _Count() as cd:
        drafts = drafting.draft_batch(dec, [(ds, k, v) for (_, ds), v in zip(pairs, verdicts)])
    assert not any(isinstance(d, BaseException) for d in drafts), drafts
    blocks = [(es, [int(exact.runner.state.next_token[es.slot]), *d], None) for (es, _), d in zip(pairs, drafts)]
    with _Count() as cv:
        got = verify_batch(exact.runner, blocks)
    assert not any(isinstance(g, BaseException) for g in got), got
    return {
        "sessions": b,
        "draft_ops": sum(cd.n.values()),
        "verify_ops": sum(cv.n.values()),
        "draft_ops_by_kind": dict(cd.n.most_common(10)),
        "verify_ops_by_kind": dict(cv.n.most_common(10)),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", default="2,8", help="sessions a round (B), comma-separated")
    ap.add_argument("--k", type=int, default=3, help="drafts a session")
    ap.add_argument("--layers", type=int, default=8, help="the tiny model's layers (one in four attention)")
    ap.add_argument("--round", choices=("mtp", "exact"), default="mtp", help="a fast mtp round, or an exact one")
    ap.add_argument("--drafts", choices=("mtp", "bf16"), default="mtp", help="--round exact: the drafting engine")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    d = make_random_checkpoint(Path(tempfile.mkdtemp()) / "m", seed=5, layers=a.layers, hidden=64, vocab=512)
    lm = load_model(d, dtype=torch.float32, device="cpu", mtp=True)
    bs = sorted(int(x) for x in a.sessions.split(","))

    def slope(points, key):
        return (points[1][key] - points[0][key]) / (bs[1] - bs[0]) if len(points) > 1 else None

    if a.round == "exact":
        points = [exact_point(lm, b, a.k, a.drafts) for b in bs]
        extra = {f"{w}_ops_per_session": slope(points, f"{w}_ops") for w in ("draft", "verify")}
    else:
        points = [point(lm.model, lm.cfg, b, a.k) for b in bs]
        extra = {"ops_per_session": slope(points, "ops")}
    emit(
        {
            "benchmark": "bench_round_ops",
            "command": " ".join(["python", "benchmarks/bench_round_ops.py", *(argv or sys.argv[1:])]),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": machine(),
            "k": a.k,
            "layers": a.layers,
            "gdn_layers": len(lm.cfg.gdn_layers),
            "o1_tensors": 2 * len(lm.cfg.gdn_layers) + 3,
            "o1_tensors_9b": 2 * GDN_LAYERS_9B + 3,
            "round": a.round,
            "drafts": a.drafts if a.round == "exact" else "mtp",
            "points": points,
        }
        | extra,
        a.out,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
