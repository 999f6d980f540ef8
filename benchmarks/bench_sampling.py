"""What a sampled pick costs against a greedy one: the sampler alone, on one chunk of rows (issue 22's bound:
top-p within 5% of greedy's tok/s at 1 and 32 streams). Prints one JSON object.

    python benchmarks/bench_sampling.py --device cuda --vocab 248320 --width 16
    python benchmarks/bench_sampling.py --device cpu --vocab 8192 --reps 20

For each case, the median over --reps of one `sample()` call on [width, vocab] bf16 logits (CUDA: device
time of a replay of the call captured in a CUDA graph, as the decode step's sampled graphs run it; --eager:
of eager calls, host-bound for the pick's Triton launches; CPU: wall time), for the path a step takes:
    greedy      every row greedy, no penalty: the argmax shortcut of SamplingTable.pick
    temperature T 0.8 (CUDA: the sort-free pick, baton/kernels/pick.py; CPU: no sort)
    top_p       T 0.8, top-p 0.9 (CUDA: the same pick; CPU: the full-vocab stable sort, softmax, cumsum)
    top_k_top_p T 0.7, top-k 20, top-p 0.8 (Qwen's recommended settings: the pick's radix select too)
    greedy_one_row, top_p_one_row   one live row (a single stream's step)
    graph_path  what the full sampled graph "arbs" runs for any table (penalties and logprobs on)
and the stable descending sort alone of the fp32 z keys (what the CPU's `_chunk` sorts) against the bf16
logits. Random logits at --scale.
"""

from __future__ import annotations

import argparse
import datetime
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from baton.engine.sampling import Params, SamplingTable, sample  # noqa: E402
from benchmarks.report import emit, machine  # noqa: E402


def timed(fn, device: torch.device, reps: int, graph: bool = False) -> float:
    """Median ms of fn() over reps (after 3 warm-up calls); graph (CUDA): of a replay of fn captured in a
    CUDA graph, as a decode step runs it (eagerly, the pick's Triton launches are host-bound)."""
    for _ in range(3):
        fn()
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        fn = g.replay
        fn()
    out = []
    for _ in range(reps):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            out.append(1e3 * (time.perf_counter() - t0))
    return round(statistics.median(out), 4)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--vocab", type=int, default=248320, help="Qwen3.5's vocabulary")
    ap.add_argument("--width", type=int, default=16, help="rows of one chunk (the worker's width W)")
    ap.add_argument("--scale", type=float, default=2.0, help="std of the random logits")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--eager", action="store_true", help="CUDA: time eager calls, not graph replays")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    dev, W, V = torch.device(a.device), a.width, a.vocab
    graph = dev.type == "cuda" and not a.eager
    g = torch.Generator(device=dev).manual_seed(0)
    logits = (torch.randn(W, V, generator=g, device=dev) * a.scale).to(torch.bfloat16)
    table = SamplingTable(W, dev, W, max_len=64)
    slots = torch.arange(W, device=dev)
    positions = torch.full((W,), 10, dtype=torch.long, device=dev)
    for s in range(W):
        table.history.begin(s, 0)
    temp, top_p, top_k = (
        Params(temperature=0.8, seed=1),
        Params(temperature=0.8, top_p=0.9, seed=1),
        Params(temperature=0.7, top_k=20, top_p=0.8, seed=1),
    )
    cases = {  # name: (the table's parameters, the call); each case sets its parameters before it is timed
        "greedy": (None, lambda: logits.argmax(-1)),
        "temperature": (temp, lambda: sample(logits, slots, positions, table, width=W, truncate=False, penal=False)),
        "top_p": (top_p, lambda: sample(logits, slots, positions, table, width=W, truncate=True, penal=False)),
        "top_k_top_p": (top_k, lambda: sample(logits, slots, positions, table, width=W, truncate=True, penal=False)),
        "greedy_one_row": (None, lambda: logits[:1].argmax(-1)),
        "top_p_one_row": (
            top_p,
            lambda: sample(logits[:1], slots[:1], positions[:1], table, width=W, truncate=True, penal=False),
        ),
        "graph_path": (
            top_p,
            lambda: sample(logits, slots, positions, table, width=W, truncate=True, penal=True, logprobs=True),
        ),
    }
    ms = {}
    for name, (p, fn) in cases.items():
        for s in range(W):
            table.set(s, p)
        ms[name] = timed(fn, dev, a.reps, graph)
    z = logits.float() / 0.8
    sorts = {
        "fp32_z": timed(lambda: torch.sort(z, dim=-1, descending=True, stable=True), dev, a.reps),
        "bf16_logits": timed(lambda: torch.sort(logits, dim=-1, descending=True, stable=True), dev, a.reps),
    }
    same = bool(
        torch.equal(
            torch.sort(z, dim=-1, descending=True, stable=True).indices,
            torch.sort(logits, dim=-1, descending=True, stable=True).indices,
        )
    )
    out = {
        "benchmark": "sampling",
        "command": shlex.join(["python", "benchmarks/bench_sampling.py", *(sys.argv[1:] if argv is None else argv)]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(gpu=torch.cuda.get_device_name(dev) if dev.type == "cuda" else None),
        "shape": [W, V],
        "timing": "cuda graph replay" if graph else ("eager, device time" if dev.type == "cuda" else "eager, wall"),
        "ms": ms,
        "over_greedy_ms": {
            k: round(v - ms["greedy_one_row" if k.endswith("_one_row") else "greedy"], 4)
            for k, v in ms.items()
            if not k.startswith("greedy")
        },
        "sort_ms": sorts,
        "sort_same_order": same,
    }
    emit(out, a.out)
    return out


if __name__ == "__main__":
    main()
