"""Per-part GPU time of one decode step (batch 1, n = 1 row at width W), and the CUDA-graph step time,
for the fused rows path and the eager reference, bf16 and fp8. Prints one JSON object.

    python benchmarks/profile_step.py --random-init qwen3.5-9b --context 512 --out R.json

Parts: kernel time summed per kernel name from the torch profiler over an eager (non-graph) step, then
grouped (GEMM, GDN, attention, norms, elementwise, ...). "graph_ms" is the replay time of the captured
step (the figure decode tok/s follows); "synced_ms" the step with the token read back each time (the AR
loop); "launch_us" the host time of one replay call; "kernels" the number of kernels one step launches.
"""

from __future__ import annotations

import argparse
import collections
import copy
import datetime
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from baton.engine import graph  # noqa: E402
from baton.engine.runner import ModelRunner  # noqa: E402
from baton.loading import random_model  # noqa: E402
from baton.random_init import shape  # noqa: E402
from benchmarks.report import emit  # noqa: E402

GROUPS = [
    ("gemm", ("gemm", "gemv", "cutlass", "sm90", "sm80", "skinny", "splitk", "xmma", "cublas")),
    ("gdn", ("gdn_rows", "conv_rows")),
    ("norm", ("rmsnorm", "norm")),
    ("mlp_act", ("silu",)),
    ("softmax", ("softmax",)),
    ("reduce", ("reduce", "argmax")),
    ("copy", ("copy", "index", "cat")),
]


def group(name: str) -> str:
    low = name.lower()
    for g, keys in GROUPS:
        if any(k in low for k in keys):
            return g
    return "elementwise/other"


def profile_eager(r: ModelRunner) -> dict:
    from torch.profiler import ProfilerActivity, profile

    r.state.snapshot(0)
    r.compute_rows(0, 1)
    r.state.restore(0)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        r.compute_rows(0, 1)
        torch.cuda.synchronize()
    r.state.restore(0)
    per_name, per_group, count = collections.Counter(), collections.Counter(), 0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per_name[e.name] += e.device_time
            per_group[group(e.name)] += e.device_time
            count += 1
    return {
        "kernels": count,
        "kernel_ms": sum(per_group.values()) / 1e3,
        "groups_ms": {k: v / 1e3 for k, v in per_group.most_common()},
        "top_kernels_ms": {k[:90]: v / 1e3 for k, v in per_name.most_common(12)},
    }


def graph_ms(r: ModelRunner, reps: int = 50) -> dict:
    """graph_ms: back-to-back replays (GPU time per step, unless the host cannot keep up);
    synced_ms: replay + read the token each step, as the AR loop does; launch_us: host time of
    one replay() call."""
    graph.capture_all(r, ns={"rows": range(1, 2)})
    g = r.graphs[("rows", 1)]
    times, synced, launch = [], [], []
    for _ in range(5):
        r.state.snapshot(0)
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(reps):
            g.replay()
        e.record()
        torch.cuda.synchronize()
        r.state.restore(0)
        times.append(s.elapsed_time(e) / reps)
        t0 = time.perf_counter()
        for _ in range(reps):
            t1 = time.perf_counter()
            g.replay()
            launch.append(time.perf_counter() - t1)
            int(r.tok_out[0])
        synced.append((time.perf_counter() - t0) / reps * 1e3)
        r.state.restore(0)
    r.graphs.clear()
    return {
        "graph_ms": statistics.median(times),
        "synced_ms": statistics.median(synced),
        "launch_us": statistics.median(launch) * 1e6,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--random-init", default="qwen3.5-9b")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--window", type=int, default=0, help="max_len (default: context + 320)")
    p.add_argument("--engines", default="bf16,fp8")
    p.add_argument("--paths", default="fused,eager")
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    cfg = shape(a.random_init)
    res = {
        "command": " ".join(["python", "benchmarks/profile_step.py"] + (argv or sys.argv[1:])),
        "date": datetime.date.today().isoformat(),
        "host": socket.gethostname(),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "context": a.context,
        "runs": [],
    }
    lm = random_model(cfg, dtype="bf16", device="cuda", seed=0, mtp=False)
    window = a.window or a.context + 320
    models = {"bf16": lm.model}
    if "fp8" in a.engines:
        from decode_worker.fp8 import quantize_model

        models["fp8"] = copy.deepcopy(lm.model)
        quantize_model(models["fp8"], "full")
    prompt = torch.randint(0, cfg.vocab_size, (a.context,), generator=torch.Generator().manual_seed(1)).tolist()
    for eng in a.engines.split(","):
        for fast in [x == "fused" for x in a.paths.split(",")]:
            r = ModelRunner(models[eng], slots=1, max_len=window, width=16, fast=fast)
            r.prefill(0, prompt)
            row = {"engine": eng, "path": "fused" if fast else "eager", **profile_eager(r)}
            r.prefill(0, prompt)
            row.update(graph_ms(r))
            row["tok_s"] = 1e3 / row["graph_ms"]
            row["pdl"] = os.environ.get("BATON_PDL", "0") == "1"
            print(json.dumps(row), flush=True)
            res["runs"].append(row)
            del r
            torch.cuda.empty_cache()
    emit(res, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
