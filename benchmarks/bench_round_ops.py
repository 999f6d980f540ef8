"""The host's share of one batched MTP round: torch ops per round, and per session of the round.

On CUDA a batched round's passes are captured graphs (one replay each, whatever the batch), so what grows
with its sessions is the host code around them: each torch op there is a dispatch and most are a kernel
launch (~5-10 us of the host each). This counts them, without a GPU: a fused runner of a tiny random
checkpoint (--layers) whose Triton kernels run in Triton's interpreter, one round of B sessions at K
drafts (decode_worker.mtp._round: the chains, the verify pass, the rewind of the cut blocks, the pending
pairs), every aten op counted (a TorchDispatchMode). The passes' own ops (the interpreter's) do not grow
with B, so `ops_per_session`, the slope between the two smallest B, is the host code's. Drafts are the
model's greedy picks over random weights: most blocks are cut, as at a low acceptance.

    python benchmarks/bench_round_ops.py [--sessions 2,8] [--k 3] [--layers 8] [--out R.json]

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
from decode_worker import mtp  # noqa: E402

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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", default="2,8", help="sessions a round (B), comma-separated")
    ap.add_argument("--k", type=int, default=3, help="drafts a session")
    ap.add_argument("--layers", type=int, default=8, help="the tiny model's layers (one in four attention)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    d = make_random_checkpoint(Path(tempfile.mkdtemp()) / "m", seed=5, layers=a.layers, hidden=64, vocab=512)
    lm = load_model(d, dtype=torch.float32, device="cpu", mtp=True)
    bs = sorted(int(x) for x in a.sessions.split(","))
    points = [point(lm.model, lm.cfg, b, a.k) for b in bs]
    slope = (points[1]["ops"] - points[0]["ops"]) / (bs[1] - bs[0]) if len(points) > 1 else None
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
            "points": points,
            "ops_per_session": slope,
        },
        a.out,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
