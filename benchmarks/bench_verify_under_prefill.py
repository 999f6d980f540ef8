"""Exact mode's Verify latency while a long prompt prefills on the same prefill worker (issue 21.3).

    python benchmarks/bench_verify_under_prefill.py --device cuda --random-init qwen3.5-9b --long 32768 \
        --out benchmarks/results/verify-under-prefill-h200-DATE.json
    python benchmarks/bench_verify_under_prefill.py --device cpu --long 2048 --chunk 256    # the default model

In one process, on the prefill worker's engine (prefill_worker.engine.ExactEngine, the very code a
worker serves): --sessions exact sessions, each Verifying K-draft blocks back to back from its own thread
(what the router's exact loop sends), first alone (the baseline), then while one --long prompt prefills
in --chunk-token pieces (PREFILL_CHUNK on a worker). A piece and a verify pass share the compute lock,
so a Verify waits at most for the piece in flight, never for the whole prompt. Reports, per phase,
the Verify latency p50 / p99 / max, the verify rounds completed, and the long prompt's prefill time
(with and without the verifiers beside it) and its pieces. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from baton.engine.prefill import PREFILL_CHUNK, pieces  # noqa: E402
from baton.engine.runner import ModelRunner  # noqa: E402
from benchmarks.report import emit, machine  # noqa: E402
from prefill_worker.engine import ExactEngine  # noqa: E402


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def _summary(lat: list[float]) -> dict:
    ms = [x * 1e3 for x in lat]
    return {
        "verifies": len(ms),
        "p50_ms": round(statistics.median(ms), 3) if ms else None,
        "p99_ms": round(_pct(ms, 0.99), 3) if ms else None,
        "max_ms": round(max(ms), 3) if ms else None,
    }


def _verifiers(e: ExactEngine, sids: list[str], k: int, stop: threading.Event, lat: list[float]) -> list:
    """One thread per session: blocks [pending, d1..dk] back to back until `stop`; latencies into lat."""

    def loop(sid: str) -> None:
        slot = e.get(sid).slot
        while not stop.is_set() and int(e.runner.state.position[slot]) + k + 1 < e.runner.max_len:
            block = [int(e.runner.state.next_token[slot])] + [1 + i for i in range(k)]
            t0 = time.perf_counter()
            e.verify(sid, block)
            lat.append(time.perf_counter() - t0)

    th = [threading.Thread(target=loop, args=(s,), daemon=True) for s in sids]
    for t in th:
        t.start()
    return th


def _prefill_long(e: ExactEngine, ids: list[int]) -> float:
    _sync(e.runner.device)
    t0 = time.perf_counter()
    s, _ = e.prefill(ids)
    _sync(e.runner.device)
    dt = time.perf_counter() - t0
    e.release(s.id)
    return dt


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--random-init", default=None, help="a random model of this shape (else --model / default)")
    ap.add_argument("--model", default=None, help="a checkpoint directory (default: the embedded model)")
    ap.add_argument("--long", type=int, default=32768, help="tokens of the long prompt")
    ap.add_argument("--chunk", type=int, default=PREFILL_CHUNK, help="prefill piece size (tokens)")
    ap.add_argument("--sessions", type=int, default=4, help="exact sessions verifying meanwhile")
    ap.add_argument("--prompt", type=int, default=512, help="their prompt length")
    ap.add_argument("--k", type=int, default=4, help="drafts per block")
    ap.add_argument("--alone-s", type=float, default=3.0, help="seconds of the verify-alone baseline")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    if a.random_init:
        from baton.loading import random_model
        from baton.random_init import shape

        lm = random_model(shape(a.random_init), dtype="bf16", device=dev, seed=0, mtp=False)
    else:
        from baton.loading import load_model, resolve_model_dir

        lm = load_model(resolve_model_dir(a.model), dtype="bf16" if dev.type == "cuda" else "fp32", device=dev)
    V = lm.cfg.vocab_size
    ceiling = lm.cfg.max_position_embeddings
    if max(a.long, a.prompt) + 64 > ceiling:
        ap.error(f"--long {a.long} / --prompt {a.prompt}: the model's window is {ceiling} tokens")
    max_len = min(max(a.long + 64, a.prompt + 4096), ceiling)  # room for the verifiers' rounds
    # the served prefill worker's runner (prefill_worker/serve.py): row checkpoints, and on CUDA batching on and
    # its graphs captured, so a Verify is the worker's captured pass (until 2026-12-05 this bench ran eager)
    r = ModelRunner(lm.model, slots=a.sessions + 1, max_len=max_len, width=a.k + 2, checkpoints=True)
    r.prefill_chunk = a.chunk
    graphs = None
    if dev.type == "cuda":
        from prefill_worker.serve import prepare_cuda

        st = prepare_cuda(r)
        graphs = {"graphs": st.graphs, "capture_s": round(st.seconds, 1)}
    e = ExactEngine(r)
    print(f"bench_verify_under_prefill: warming up ({a.long}-token prompt in {a.chunk}-token pieces)", file=sys.stderr)
    long_ids = [(7 * i + 3) % V for i in range(a.long)]
    _prefill_long(e, long_ids)  # compile / autotune every shape once
    sids = [e.prefill([(11 * i + 5 * j) % V for i in range(a.prompt)])[0].id for j in range(a.sessions)]
    stop, lat_alone = threading.Event(), []
    th = _verifiers(e, sids, a.k, stop, lat_alone)
    time.sleep(a.alone_s)
    stop.set()
    for t in th:
        t.join()
    prefill_alone = _prefill_long(e, long_ids)
    for sid in sids:  # back to each session's start: the same windows for the second phase
        e.release(sid)
    sids = [e.prefill([(11 * i + 5 * j) % V for i in range(a.prompt)])[0].id for j in range(a.sessions)]
    stop, lat_beside = threading.Event(), []
    th = _verifiers(e, sids, a.k, stop, lat_beside)
    time.sleep(0.2)  # the verifiers are running
    prefill_beside = _prefill_long(e, long_ids)
    stop.set()
    for t in th:
        t.join()
    res = {
        "benchmark": "bench_verify_under_prefill",
        "command": "python benchmarks/bench_verify_under_prefill.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "model": a.random_init or a.model or "default",
        "device": a.device,
        "sessions": a.sessions,
        "k": a.k,
        "long_prompt": a.long,
        "pieces": len(pieces(0, a.long, a.chunk)),
        "chunk": a.chunk,
        "captured": graphs,
        "verify_alone": _summary(lat_alone),
        "verify_during_long_prefill": _summary(lat_beside),
        "long_prefill_s": {"alone": round(prefill_alone, 3), "beside_verifies": round(prefill_beside, 3)},
        "piece_ms_alone": round(prefill_alone / len(pieces(0, a.long, a.chunk)) * 1e3, 2),
    }
    emit(res, a.out)
    return res


if __name__ == "__main__":
    main()
