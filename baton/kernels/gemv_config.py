"""The rows GEMM's tile configurations (baton/kernels/gemv.py): `Config`, the tuned tables and `pick_config`.

A config is a pure function of (M-bucket, N, K, weight kind, SM count). For M <= 16 it fixes everything,
the K order included (BLOCK_K, the K split); for M > 16 only the tile's layout changes (TUNED_BATCH: BLOCK_M,
the rows sharing a weight tile, and the warps; TUNED_BATCH_XM: also BLOCK_N and the orientation), so a
row's bits never depend on M (batch invariance).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import triton

FP8_GROUP = 128  # x quantisation group along K (the fp8 BLOCK_K): fixes the fp8 arithmetic


@dataclass(frozen=True)
class Config:
    block_m: int
    block_n: int
    block_k: int
    split: int
    k_per_split: int  # multiple of block_k; split * k_per_split >= K, no empty split
    num_warps: int = 4
    num_stages: int = 4
    xm: bool = False  # the x rows on the MMA's M side (a plain GEMM tile) instead of swap-AB: experimental


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


# (fp8, N, K) -> (block_n, block_k, split, num_warps, num_stages) for M <= 16, from the sweeps
# (benchmarks/sweep_gemv.py, rows = 1; benchmarks/results/gemv-sweep-h200-2026-11-30-{w8a8,stages-fp8,
# stages-bf16}.json): the Qwen3.5-9B merged shapes. bf16 entries exist only where the kernel beats cuBLAS
# (fast_rows.rows_linear routes by this table). Other shapes use the heuristic.
TUNED = {
    (True, 12288, 4096): (128, 128, 4, 4, 3),
    (True, 4096, 4096): (64, 128, 8, 4, 3),
    (True, 12352, 4096): (128, 128, 4, 4, 3),  # GDN qkv|z|b|a: 12288's config (not swept)
    (True, 10240, 4096): (64, 128, 4, 4, 3),
    (True, 24576, 4096): (64, 128, 1, 4, 4),
    (True, 4096, 12288): (64, 128, 8, 4, 4),
    (True, 248320, 4096): (128, 128, 1, 8, 4),
    (False, 4096, 4096): (64, 128, 4, 4, 4),
    (False, 4096, 12288): (64, 128, 4, 4, 3),
    (False, 12288, 4096): (64, 128, 1, 4, 4),
    (False, 64, 4096): (32, 256, 16, 4, 4),
}


# (fp8, N, K) -> ((largest M or None, BLOCK_M, num_warps), ...) for M > 16: the first entry whose M bound
# holds. From benchmarks/sweep_rows_m.py on the H100 (benchmarks/results/sweep-rows-h100-2026-12-06.json):
# every variant's rows were bitwise the M <= 16 kernel's, since only how many rows share a weight tile (the
# MMA's N side) and how many warps split it change. BATCH_BLOCK_M (64) for every M > 32 runs 64-row tiles
# that re-read each weight tile per 64 rows: at 72 rows (8 exact sessions' K = 8 verify blocks) 8.97 ms of
# bf16 GEMMs a forward against 7.80 with this table; fp8 at 64-320 rows 12-25% slower than the table.
BATCH_TABLE = os.environ.get("BATON_GEMV_BATCH_TABLE", "1") != "0"  # 0: BATCH_BLOCK_M for every M > 16 (A/B runs)
TUNED_BATCH = {
    (False, 12352, 4096): ((32, 32, 4), (64, 64, 4), (None, 128, 8)),
    (False, 4096, 4096): ((32, 32, 4), (64, 64, 4), (None, 32, 4)),
    (False, 10240, 4096): ((128, 32, 4), (None, 128, 8)),
    (False, 24576, 4096): ((32, 32, 4), (64, 64, 8), (None, 128, 8)),
    (False, 4096, 12288): ((32, 32, 4), (None, 64, 4)),
    (False, 248320, 4096): ((32, 32, 4), (64, 64, 8), (None, 128, 8)),
    (True, 12352, 4096): ((None, 32, 8),),
    (True, 4096, 4096): ((None, 32, 8),),
    (True, 10240, 4096): ((None, 32, 4),),
    (True, 24576, 4096): ((32, 32, 4), (64, 64, 8), (128, 32, 4), (None, 64, 8)),
    (True, 4096, 12288): ((32, 32, 8), (64, 64, 8), (None, 32, 8)),
    (True, 248320, 4096): ((None, 32, 8),),
}

# (fp8, N, K) -> (from M on, BLOCK_M, BLOCK_N, warps) of the plain orientation (Config.xm: the x rows on the
# MMA's M side); BATON_GEMV_XM=0 turns it off (A/B). The end-to-end GPU tests passed with it on an H100
# (`gpu_pending.sh tests-xm` at 7996845: test_gpu_batch.py 7, test_gpu_verify.py 3, test_gemv.py 31), and a
# verify round of 32 sessions went 54.4 -> 51.9 ms (bench_exact_passes). From the H100 sweep
# (benchmarks/results/sweep-rows-xm-h100-2026-12-06.json), where every xm variant's rows were bitwise the
# M <= 16 kernel's: bf16 at 144 / 320 rows lm_head 1,228 -> 1,100 / 1,959 -> 1,741 us, the GDN in-projection
# 100 -> 81 / 159 -> 132; fp8 MLP gate|up at 72 / 320 rows 122 -> 91 / 315 -> 182 us.
XM_TABLE = os.environ.get("BATON_GEMV_XM", "1") == "1"
TUNED_BATCH_XM = {
    (False, 12352, 4096): (129, 64, 128, 8),
    (False, 24576, 4096): (129, 64, 128, 8),
    (False, 248320, 4096): (129, 64, 128, 8),
    (True, 24576, 4096): (65, 64, 256, 8),
    (True, 248320, 4096): (65, 64, 256, 8),
}


# partial=True (the consumer sums the splits): fewer splits where the summing norm's reads cost more than
# the GEMM gains (benchmarks/results/probe-overhead-handoff-h200-2026-11-30.json).
TUNED_PARTIAL = {
    (True, 4096, 4096): (64, 128, 4, 4, 4),
    (True, 12352, 4096): (64, 128, 2, 4, 4),
}  # GDN qkv|z|b|a -> conv_rows / gdn_rows (12288's)


def pick_config(
    M: int,
    N: int,
    K: int,
    sms: int,
    *,
    fp8: bool,
    partial: bool = False,
    block_n: int | None = None,
    block_k: int | None = None,
    split: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    programs_per_sm: int = 2,
) -> Config:
    """Tile config from (M-bucket, N, K, weight kind, SM count): the TUNED entry, else a heuristic that
    splits K until >= programs_per_sm programs per SM. The overrides are for sweeps."""
    # batch invariance: BLOCK_K and the split are the M <= 16 config's, so the K order of every row is the
    # same for every M; BLOCK_M only sets how many rows share a weight tile (the MMA's N side)
    block_m = 16 if M <= 16 else min(BATCH_BLOCK_M, _pow2(M))
    tuned = ((partial and TUNED_PARTIAL.get((fp8, N, K))) or TUNED.get((fp8, N, K))) if sms >= 132 else None
    batch = TUNED_BATCH.get((fp8, N, K)) if sms >= 132 and M > 16 and BATCH_TABLE else None
    auto = block_n is block_k is split is num_warps is num_stages is None  # no sweep overrides
    if auto:
        if tuned:
            block_n, block_k, split, num_warps, num_stages = tuned
        if batch:  # M > 16: BLOCK_M and warps only, never the K order (BLOCK_K, split)
            _, bm, num_warps = next(e for e in batch if e[0] is None or M <= e[0])
            block_m = min(bm, _pow2(M))
    bk = block_k or 128
    assert not fp8 or bk % FP8_GROUP == 0, "fp8: block_k is a whole number of quantisation groups"
    bn = block_n or 64
    k_iters = triton.cdiv(K, bk)
    if split is None:
        tiles = triton.cdiv(N, bn)  # of one 16-row tile: the split does not depend on M
        split = 1
        while tiles * split < programs_per_sm * sms and split * 2 <= k_iters:
            split *= 2
    split = max(1, min(split, k_iters))
    k_per_split = triton.cdiv(k_iters, split) * bk
    split = triton.cdiv(K, k_per_split)  # drop empty splits
    cfg = Config(block_m, bn, bk, split, k_per_split, num_warps or 4, num_stages or 4)
    plain = TUNED_BATCH_XM.get((fp8, N, K)) if XM_TABLE and auto and batch else None
    if plain and M >= plain[0]:  # after the split is fixed from the M <= 16 BLOCK_N: the K order stays
        cfg = dataclasses.replace(cfg, block_m=plain[1], block_n=plain[2], num_warps=plain[3], xm=True)
    return cfg


BATCH_BLOCK_M = 64  # the widest row tile (M > 16); the MMA's N side, which leaves each column's sum alone
