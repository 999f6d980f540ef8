"""Tile configurations of the prefill's row-invariant GEMM (baton/kernels/wide.py) against cuBLAS, at the
9B shape's projections and several pass sizes M. Prints one JSON object: per config and M the summed time
of one layer's worth of projections, cuBLAS's, and whether each config's result is bitwise the first's
(if so, a config could be chosen by M without changing any row's arithmetic). A config names its loads too:
masked pointer loads ("ptr") or Hopper's TMA through tensor descriptors ("tma", wide.KERNEL).

    python benchmarks/sweep_wide.py --out R.json                  (bash benchmarks/gpu_pending.sh wide-tma COMMIT)
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from baton.kernels import wide  # noqa: E402
from benchmarks.report import emit  # noqa: E402

# (N, K) of the 9B shape's projections: GDN qkv / z / out, attention q / kv / o, MLP gate+up / down
SHAPES = [
    (8192, 4096),
    (4096, 4096),
    (4096, 4096),
    (8192, 4096),
    (1024, 4096),
    (12288, 4096),
    (12288, 4096),
    (4096, 12288),
]
# (loads, BLOCK_M, BLOCK_N, BLOCK_K, warps, stages): the first is the default, every other is checked against
# its bits. "ptr": masked pointer loads; "tma": tensor descriptors (sm_90+); "tma_persistent": one program an SM. --configs picks some by index.
CONFIGS = [
    ("ptr", 128, 128, 64, 8, 3),
    ("ptr", 128, 256, 64, 8, 3),
    ("ptr", 64, 128, 64, 4, 4),
    ("tma", 128, 128, 64, 8, 3),
    ("tma", 128, 128, 64, 8, 4),
    ("tma", 128, 256, 64, 8, 3),
    ("tma", 128, 256, 64, 8, 4),
    ("tma", 64, 128, 64, 4, 4),
    ("tma", 64, 256, 64, 4, 3),
    ("tma_persistent", 128, 128, 64, 8, 3),
    ("tma_persistent", 128, 256, 64, 8, 3),
    ("tma_persistent", 128, 256, 64, 8, 4),
]


def timed(fn, reps=10) -> float:
    fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / reps


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="128,512,2048,4096,8192")
    ap.add_argument("--configs", default=None, help="indices into CONFIGS, e.g. 0,3,5 (default: all)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    configs = [CONFIGS[int(i)] for i in a.configs.split(",")] if a.configs else CONFIGS
    g = torch.Generator(device="cuda").manual_seed(0)
    ws = {s: (torch.randn(*s, device="cuda", generator=g) * 0.02).to(torch.bfloat16) for s in set(SHAPES)}
    rows = []
    for M in [int(x) for x in a.ms.split(",")]:
        xs = {K: torch.randn(M, K, device="cuda", generator=g).to(torch.bfloat16) for K in {k for _, k in SHAPES}}
        cublas = sum(timed(lambda N=N, K=K: torch.nn.functional.linear(xs[K], ws[(N, K)])) for N, K in SHAPES)
        first = None
        for cfg in configs:
            wide.KERNEL, wide.BLOCK_M, wide.BLOCK_N, wide.BLOCK_K, wide.NUM_WARPS, wide.NUM_STAGES = cfg
            name = "{}_BM{}_BN{}_BK{}_w{}_s{}".format(*cfg)
            try:
                outs = [wide.linear(xs[K], ws[(N, K)]) for N, K in SHAPES]
            except Exception as e:  # noqa: BLE001 - e.g. a tile that needs more shared memory than the SM has
                rows.append({"M": M, "config": name, "error": f"{type(e).__name__}: {str(e)[:160]}"})
                print(rows[-1], flush=True)
                continue
            same = None if first is None else all(torch.equal(o, f) for o, f in zip(outs, first))
            first = first or outs
            ms = sum(timed(lambda N=N, K=K: wide.linear(xs[K], ws[(N, K)])) for N, K in SHAPES)
            flops = sum(2 * M * N * K for N, K in SHAPES)
            rows.append(
                {
                    "M": M,
                    "config": name,
                    "ms": round(ms, 3),
                    "cublas_ms": round(cublas, 3),
                    "of_cublas": round(cublas / ms, 3),
                    "tflops": round(flops / ms / 1e9, 1),
                    "bitwise_as_first_config": same,
                }
            )
            print(rows[-1], flush=True)
    res = {
        "benchmark": "sweep_wide",
        "command": "python benchmarks/sweep_wide.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(),
        "rows": rows,
    }
    emit(res, a.out)
    return res


if __name__ == "__main__":
    main()
