"""Where a prefill's time goes: wall time against GPU kernel time, per prompt length. Prints one JSON object.

    python benchmarks/profile_prefill.py --random-init qwen3.5-9b --lengths 128,512,4096 --out R.json

Prefill runs as `baton.engine.prefill.run_pass` does it (the row-invariant wide kernels on CUDA).
"batched": --batches prompts of --batch-len in one pass against the same prompts one pass each.
For each length: the wall time of `ModelRunner.prefill` (synchronized, median of --reps), the sum of its
kernels' device time from the torch profiler, the number of kernels it launches, and the host time spent
issuing them (wall while the GPU is idle is host-bound time: launches, Python, syncs). Kernel time is
grouped as in profile_step.py. A prefill whose wall is far above its kernel time gains from batching
prompts into one pass (fewer launches per prompt) or from a captured graph, not from faster kernels.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import socket
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from baton.engine.prefill import Piece, run_pass  # noqa: E402
from baton.engine.runner import ModelRunner  # noqa: E402
from baton.loading import random_model  # noqa: E402
from baton.random_init import shape  # noqa: E402
from benchmarks.profile_step import group  # noqa: E402
from benchmarks.report import emit  # noqa: E402


def timed(r: ModelRunner, ids: list[int], reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        r.prefill(0, ids, mtp=False)
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return out


def profiled(r: ModelRunner, ids: list[int]) -> dict:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        r.prefill(0, ids, mtp=False)
        torch.cuda.synchronize()
    per_name, per_group, count = collections.Counter(), collections.Counter(), 0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per_name[e.name] += e.device_time
            per_group[group(e.name) if "chunk" not in e.name.lower() else "gdn_chunk"] += e.device_time
            count += 1
    return {
        "kernels": count,
        "kernel_ms": sum(per_group.values()) / 1e3,
        "groups_ms": {k: round(v / 1e3, 3) for k, v in per_group.most_common()},
        "top_kernels_ms": {k[:90]: round(v / 1e3, 3) for k, v in per_name.most_common(15)},
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--random-init", default="qwen3.5-9b")
    ap.add_argument("--lengths", default="128,512,4096")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--batches", default="1,4,8,16", help="prompts of --batch-len in one pass (run_pass)")
    ap.add_argument("--batch-len", type=int, default=512)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    lengths = [int(x) for x in a.lengths.split(",")]
    cfg = shape(a.random_init)
    lm = random_model(cfg, dtype="bf16", device="cuda", seed=0, mtp=False)
    batches = [int(x) for x in a.batches.split(",") if x]
    r = ModelRunner(lm.model, slots=max(batches + [1]), max_len=max(lengths + [a.batch_len]) + 64, width=16)
    for n in lengths:  # compile / autotune fla at every length first
        r.prefill(0, list(range(n)), mtp=False)
    dense = sum(p.numel() for k, p in lm.model.named_parameters() if "embed" not in k and "lm_head" not in k)
    points = []
    for n in lengths:
        ids = [(7 * i + 3) % cfg.vocab_size for i in range(n)]
        walls = timed(r, ids, a.reps)
        prof = profiled(r, ids)
        wall_ms = statistics.median(walls) * 1e3
        flops = 2.0 * dense * n  # matmul FLOPs (attention's score FLOPs left out)
        points.append(
            {
                "prompt_len": n,
                "wall_ms": round(wall_ms, 3),
                "wall_ms_all": [round(w * 1e3, 3) for w in walls],
                "kernel_ms": round(prof["kernel_ms"], 3),
                "gpu_busy": round(prof["kernel_ms"] / wall_ms, 3),
                "tok_s": round(n / (wall_ms / 1e3), 1),
                "tflops_per_s": round(flops / (wall_ms / 1e3) / 1e12, 1),
                **prof,
            }
        )
    batched = []
    for b in batches:  # b prompts in one pass against the same b prompts one pass each
        ps = [[(11 * i + 5 * j) % cfg.vocab_size for i in range(a.batch_len)] for j in range(b)]
        one = [Piece(j, ps[j], mtp=False) for j in range(b)]
        run_pass(r, one)
        walls, serial = [], []
        for _ in range(a.reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            run_pass(r, one)
            torch.cuda.synchronize()
            walls.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            for p in one:
                run_pass(r, [p])
            torch.cuda.synchronize()
            serial.append(time.perf_counter() - t0)
        w, sr = statistics.median(walls), statistics.median(serial)
        batched.append(
            {
                "prompts": b,
                "prompt_len": a.batch_len,
                "pass_ms": round(w * 1e3, 2),
                "serial_ms": round(sr * 1e3, 2),
                "tok_s": round(b * a.batch_len / w, 1),
                "serial_tok_s": round(b * a.batch_len / sr, 1),
                "speedup": round(sr / w, 2),
            }
        )
    res = {
        "benchmark": "profile_prefill",
        "command": "python benchmarks/profile_prefill.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"host": socket.gethostname(), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__},
        "model": a.random_init,
        "points": points,
        "batched": batched,
    }
    emit(res, a.out)
    return res


if __name__ == "__main__":
    main()
