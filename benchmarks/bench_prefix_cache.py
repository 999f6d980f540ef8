"""The prefill worker's prefix cache: a long prompt's first token with its first pieces cached, against computed.

    python benchmarks/bench_prefix_cache.py --device cuda --random-init qwen3.5-9b --lengths 16384,32768 \
        --out benchmarks/results/prefix-cache-h200-DATE.json
    python benchmarks/bench_prefix_cache.py --lengths 1024,2048 --chunk 256     # CPU, the default model

In one process, on the prefill worker's engine (prefill_worker.engine.ExactEngine, the code a worker serves,
with its prefix cache: baton/engine/prefix_cache.py). For each length L: a conversation's turn. Prompt A of L
- --tail tokens is prefilled (its pieces cached), then prompt B = A + --tail new tokens (a follow-up turn:
the same history and a new message). B's prefill is timed three ways, each --repeat times (median): cold
(the cache cleared first: every piece computed), warm (A's pieces restored, the rest computed), and on an
engine without a cache. Reports per L: the three times, B's tokens restored and computed, the speed-up, and
whether warm B's first token and every state tensor equal cold B's bitwise (they must: docs/CONTRACTS.md).
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from baton.engine.prefill import PREFILL_CHUNK  # noqa: E402
from baton.engine.runner import ModelRunner  # noqa: E402
from benchmarks.report import emit, header  # noqa: E402
from prefill_worker.engine import ExactEngine  # noqa: E402


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _timed_prefill(e: ExactEngine, ids: list[int], keep: bool = False):
    """-> (seconds to the first token, first token, cached tokens, exported state or None); released unless keep."""
    dev = e.runner.device
    _sync(dev)
    t0 = time.perf_counter()
    s, tok = e.prefill(ids)
    _sync(dev)
    dt = time.perf_counter() - t0
    state = None
    if keep:
        tensors, pos, nxt = e.export(s.id)
        state = {t.name: t.materialize().clone() for t in tensors} | {"pos": pos, "next": nxt}
    cached = s.cached_tokens
    e.release(s.id)
    return dt, tok, cached, state


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a
    )


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--random-init", default=None, help="a random model of this shape (else --model / default)")
    ap.add_argument("--model", default=None, help="a checkpoint directory (default: the embedded model)")
    ap.add_argument("--lengths", default="16384,32768", help="B's prompt lengths, comma-separated")
    ap.add_argument("--tail", type=int, default=512, help="B's new tokens after A (a follow-up turn)")
    ap.add_argument("--chunk", type=int, default=PREFILL_CHUNK, help="prefill piece size (tokens; a multiple of 256)")
    ap.add_argument("--repeat", type=int, default=3, help="timed prefills of each kind (median)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    lengths = [int(x) for x in a.lengths.split(",")]
    if a.random_init:
        from baton.loading import random_model
        from baton.random_init import shape

        lm = random_model(shape(a.random_init), dtype="bf16", device=dev, seed=0, mtp=True)
    else:
        from baton.loading import load_model, resolve_model_dir

        lm = load_model(resolve_model_dir(a.model), dtype="bf16" if dev.type == "cuda" else "fp32", device=dev)
    V, ceiling = lm.cfg.vocab_size, lm.cfg.max_position_embeddings
    if max(lengths) + 64 > ceiling:
        ap.error(f"--lengths: the model's window is {ceiling} tokens")
    max_len = max(lengths) + 64

    def engine(entries: int) -> ExactEngine:
        r = ModelRunner(lm.model, slots=2, max_len=max_len, width=8, checkpoints=True)
        r.prefill_chunk = a.chunk
        return ExactEngine(r, prefix_entries=entries)

    cached_e, plain_e = engine(max(lengths) // a.chunk + 1), engine(0)
    points = []
    for n in lengths:
        b = [(7 * i + 3 * (i // 97) + 1) % V for i in range(n)]  # B; A is its first n - tail tokens
        prompt_a = b[: n - a.tail]
        print(f"bench_prefix_cache: {n} tokens (A {len(prompt_a)}), warming up", file=sys.stderr)
        for e in (cached_e, plain_e):  # compile / autotune every piece shape once
            _timed_prefill(e, b)
        cold, warm, plain, refs = [], [], [], {}
        for _ in range(a.repeat):
            cached_e.prefix.clear()
            dt, cold_tok, _, cold_state = _timed_prefill(cached_e, b, keep=not cold)
            cold.append(dt)
            refs.setdefault("cold", cold_state)
            cached_e.prefix.clear()
            _timed_prefill(cached_e, prompt_a)  # A's pieces cached
            dt, warm_tok, restored, warm_state = _timed_prefill(cached_e, b, keep=not warm)
            warm.append(dt)
            refs.setdefault("warm", warm_state)
            plain.append(_timed_prefill(plain_e, b)[0])
        med = lambda xs: round(statistics.median(xs) * 1e3, 2)  # noqa: E731
        points.append(
            {
                "prompt_tokens": n,
                "restored_tokens": restored,
                "computed_tokens": n - restored,
                "cold_ms": med(cold),
                "warm_ms": med(warm),
                "no_cache_ms": med(plain),
                "speedup": round(statistics.median(cold) / statistics.median(warm), 2),
                "first_token_equal": warm_tok == cold_tok,
                "state_bitwise_equal": _same(refs["warm"], refs["cold"]),
            }
        )
        print(f"  {points[-1]}", file=sys.stderr)
    res = {
        **header(__file__, argv),
        "model": a.random_init or a.model or "default",
        "device": a.device,
        "chunk": a.chunk,
        "tail": a.tail,
        "repeat": a.repeat,
        "cache_gdn_bytes": cached_e.prefix.bytes(),
        "points": points,
    }
    emit(res, a.out)
    return res


if __name__ == "__main__":
    main()
