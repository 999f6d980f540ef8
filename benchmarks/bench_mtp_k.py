"""Fast-mode MTP's draft length on the decode engine: plain bf16 AR, mtp at a fixed K, and mtp with the
adaptive controller (K = 0 a plain round; decode_worker/mtp.py), at several concurrencies, in one run.

    OMP_NUM_THREADS=2 python benchmarks/bench_mtp_k.py [--prompts 4] [--new 96] [--k 3] [--concurrency 1,4]

The embedded default model (real MTP acceptance) by default, or --model DIR; fp32 on the CPU. Held-out
stdlib prompts (benchmarks/acceptance_default_model.py). For each concurrency N and mode, N sessions are
prefilled on an ExactEngine, handed over in process (export -> DecodeEngine.load) and decoded together
on one DecodeEngine (threads; concurrent mtp rounds share one chain and one verify pass), eager (no
CUDA graphs: engine-level, not the served figure; bench_serve is that). Per point:
    tok_s              every session's new tokens / the wall time of the decode
    tokens_per_round   mtp: emitted tokens / rounds (m + 1 a round)
    drafts_per_round   mtp: drafts proposed / rounds (the mean K the controller ran)
    identical          every session's tokens equal ExactEngine.generate's (they must)
    vs_bf16            tok_s / the bf16 point's tok_s at the same N
The issue-21 rule this checks: adaptive mtp never falls below plain bf16 AR by more than noise.
Prints one JSON object (benchmarks/report.py).
"""

from __future__ import annotations

import argparse
import datetime
import shlex
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from baton.engine.runner import ModelRunner  # noqa: E402
from baton.engine.speculation import Drafter  # noqa: E402
from baton.loading import load_model, resolve_model_dir  # noqa: E402
from baton.tokenizer import Tokenizer  # noqa: E402
from benchmarks.acceptance_default_model import handoff, heldout_prompts  # noqa: E402
from benchmarks.report import emit, machine  # noqa: E402
from decode_worker.engine import DecodeEngine  # noqa: E402
from prefill_worker.engine import ExactEngine  # noqa: E402

MODES = ("bf16", "mtp-fixed", "mtp-adaptive")


class Counting(Drafter):
    """The model's own drafts, counted."""

    def __init__(self):
        self.calls = 0

    def propose(self, session, i, own):
        self.calls += 1
        return own


def point(lm, exact, prompts, refs, mode: str, n: int, k: int, max_len: int) -> dict:
    r = ModelRunner(lm.model, slots=n, max_len=max_len)
    d = Counting()
    policy = "adaptive" if mode == "mtp-adaptive" else "fixed"
    dec = DecodeEngine({"bf16": r, "mtp": r}, default_engine="bf16", drafter=d, draft_length=policy)
    engine = "bf16" if mode == "bf16" else "mtp"
    chosen = [i % len(prompts) for i in range(n)]
    loaded = [handoff(exact, dec, prompts[i]["ids"], engine)[1:] for i in chosen]
    new = len(refs[0]) - 1

    def one(j):
        sess, first = loaded[j]
        out = [first] + [t for b in dec.decode(sess.id, new, k=k) for t in b]
        return out, sess.rounds, sess.emitted_in_rounds

    t0 = time.perf_counter()
    with ThreadPoolExecutor(n) as ex:
        outs = list(ex.map(one, range(n)))
    wall = time.perf_counter() - t0
    rounds = sum(o[1] for o in outs)
    res = {
        "mode": mode,
        "concurrency": n,
        "tok_s": round(n * new / wall, 2),
        "wall_s": round(wall, 3),
        "identical": all(o[0] == refs[i] for o, i in zip(outs, chosen)),
    }
    if engine == "mtp":
        res["tokens_per_round"] = round(sum(o[2] for o in outs) / rounds, 3)
        res["drafts_per_round"] = round(d.calls / rounds, 3)
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint directory (default: the embedded default model)")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=48)
    p.add_argument("--new", type=int, default=96)
    p.add_argument("--k", type=int, default=3, help="mtp-fixed's K, and the adaptive prior")
    p.add_argument("--concurrency", default="1,4")
    p.add_argument("--runs", type=int, default=1, help="repeats of every point (the best tok_s is kept)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    lm = load_model(a.model, dtype="fp32", mtp=True)
    tok = Tokenizer.from_dir(resolve_model_dir(a.model))
    prompts = heldout_prompts(tok, a.prompt_tokens, a.prompts)
    max_len = a.prompt_tokens + a.new + 32
    exact = ExactEngine(ModelRunner(lm.model, slots=2, max_len=max_len))
    refs = [exact.generate(pr["ids"], a.new + 1) for pr in prompts]  # EOS ignored: fixed lengths
    points = []
    for n in [int(x) for x in a.concurrency.split(",") if x]:
        base = None
        for mode in MODES:
            best = max(
                (point(lm, exact, prompts, refs, mode, n, a.k, max_len) for _ in range(a.runs)),
                key=lambda x: x["tok_s"],
            )
            base = base or best["tok_s"]
            best["vs_bf16"] = round(best["tok_s"] / base, 3)
            points.append(best)
            print(best, file=sys.stderr, flush=True)
    emit(
        {
            "benchmark": "mtp_k",
            "command": "python "
            + shlex.join(["benchmarks/bench_mtp_k.py", *(argv if argv is not None else sys.argv[1:])]),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": machine(torch_threads=torch.get_num_threads()),
            "model": str(resolve_model_dir(a.model)),
            "prompts": [pr["file"] for pr in prompts],
            "new_tokens": a.new,
            "k": a.k,
            "points": points,
        },
        a.out,
    )
    return 0 if all(pt["identical"] for pt in points) else 1


if __name__ == "__main__":
    sys.exit(main())
