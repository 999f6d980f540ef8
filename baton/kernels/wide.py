"""Row-invariant wide kernels for the batched prefill (issue 20): a pass holds the rows of several
prompts, and a prompt's state must not depend on which other prompts shared its pass.

cuBLAS picks its GEMM kernel (tile, split-K, stream-K) by M, and torch's reductions pick their thread
layout by the number of rows, so a row's arithmetic may change with the pass's total row count. These
kernels sum every output in one order for every M (the GEMM's K in steps of 64 whatever its tile), so row t
is computed by the same arithmetic from row t's inputs whatever the other rows are:

    linear(x [M, K], w [N, K])          x @ w.T, fp32 accumulate in K order (BLOCK_K 64 for every M), no
                                        split-K; tile shape and loads (pointer / Hopper's TMA) by M, TILES:
                                        the same bits whichever runs
    rmsnorm(x [M, N], w, eps, centred)  y = x / rms(x) * (1 + w)  (centred)  or  * w
    gated_rmsnorm(x, gate, w, eps)      (w * norm(x).to(dt) * silu(gate)).to(dt)  (the GDN output norm)
    l2norm(x, eps)                      x * rsqrt(sum(x^2) + eps) over the last dim (GDN q / k before fla:
                                        fla's own l2norm picks its tile by the row count)
    causal_conv(x, conv_all, w, index)  the GDN layers' depthwise causal conv + SiLU of a pass's segments,
                                        each from its slot's conv state (advanced in place)

`baton.models.context.wide_prefill(device)` switches them on for the prefill's per-row ops (`lin`,
RMSNorm, GatedRMSNorm in baton/models/qwen3_5.py) on CUDA; on CPU nothing changes and the model runs each
prompt's rows in its own call instead (StepContext.map), which is the solo call.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from baton.kernels.gemv import sm_count

try:  # Triton >= 3.4
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - an older Triton: the pointer loads only
    TensorDescriptor = None

# K in steps of 64 always: a row's sums are the same whatever the tile shape and loads (below). The default
# tile: 128 x 128 x 64 with 8 warps, the best of benchmarks/sweep_wide.py's pointer-load configurations from M =
# 128 to 4096 on the H200 (0.57-0.72 of cuBLAS).
BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M = 128, 128, 64, 8
NUM_WARPS, NUM_STAGES = 8, 3
# How the tiles are loaded: "ptr" (masked pointer loads, any GPU), "tma" (Hopper's tensor memory accelerator
# through host-built tensor descriptors: the same tiles, the same K order, the same dot, so the same bits;
# out-of-range rows / K read as zeros, as the masks do), "tma_persistent" (the same with one program per SM
# walking the tiles), or "auto": TILES by M. BATON_WIDE_GEMM; the TMA kinds apply only on sm_90+ with
# 16-byte aligned rows, anything else takes "ptr" with the default tile.
KERNEL = os.environ.get("BATON_WIDE_GEMM", "auto")
# "auto": (largest M, loads, BLOCK_M, BLOCK_N, warps, stages), the first row whose M bound holds. Every
# configuration swept gave bitwise the default's rows (BLOCK_K 64), so choosing by M changes no row: a row
# is the same inside a pass of any size. benchmarks/results/gpu-h100-2026-12-06-wide-tma.md, H100, one
# layer's projections of the 9B against cuBLAS: M 128 0.79x (the default tile 0.63x), 512 0.69x, 2048 0.94x
# (0.69x), 4096 0.90x (0.64x), 8192 1.02x (0.67x).
TILES = (
    (128, "ptr", 64, 128, 4, 4),
    (1024, "ptr", 128, 128, 8, 3),
    (None, "tma_persistent", 128, 256, 8, 3),
)


def _config(M: int, itemsize: int = 2) -> tuple[str, int, int, int, int]:
    """-> (loads, BLOCK_M, BLOCK_N, warps, stages) for a call of M rows of `itemsize`-byte elements (TILES
    were swept for bf16: a 4-byte call keeps the default tile, whose stages fit an SM's shared memory)."""
    if KERNEL != "auto" or itemsize != 2:
        return KERNEL if KERNEL != "auto" else "ptr", BLOCK_M, BLOCK_N, NUM_WARPS, NUM_STAGES
    return next(t[1:] for t in TILES if t[0] is None or M <= t[0])


@triton.jit
def _tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """-> (row tile, column tile) of program pid, in grouped order: GROUP_M row tiles share each weight
    tile's read (L2)."""
    m_tiles, n_tiles = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group = GROUP_M * n_tiles
    first_m = (pid // group) * GROUP_M
    gm = tl.minimum(m_tiles - first_m, GROUP_M)
    return first_m + (pid % group) % gm, (pid % group) // gm


@triton.jit(do_not_specialize=["M"])
def _gemm_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    M,
    N,
    K,
    sxm,
    swn,
    sym,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_m, pid_n = _tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    mm, mn = rm < M, rn < N
    xp = x_ptr + rm[:, None].to(tl.int64) * sxm + rk[None, :]
    wp = w_ptr + rn[None, :].to(tl.int64) * swn + rk[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):  # every row: the same K order, whatever M is
        mk = (k + rk) < K
        a = tl.load(xp, mask=mm[:, None] & mk[None, :], other=0.0)
        b = tl.load(wp, mask=mk[:, None] & mn[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        xp += BLOCK_K
        wp += BLOCK_K
    yp = y_ptr + rm[:, None].to(tl.int64) * sym + rn[None, :]
    tl.store(yp, acc.to(y_ptr.dtype.element_ty), mask=mm[:, None] & mn[None, :])


@triton.jit(do_not_specialize=["M"])
def _gemm_tma_kernel(
    x_desc,
    w_desc,
    y_desc,
    M,
    N,
    K,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """_gemm_kernel's tiles through tensor descriptors: x [M, K] in [BLOCK_M, BLOCK_K] boxes, w [N, K] in
    [BLOCK_N, BLOCK_K] boxes (used transposed), y [M, N]; the box loads zero-fill past M, N and K."""
    pid_m, pid_n = _tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):  # every row: the same K order, whatever M is
        a = x_desc.load([pid_m * BLOCK_M, k])
        b = w_desc.load([pid_n * BLOCK_N, k])
        acc = tl.dot(a, b.T, acc, input_precision=PRECISION)
    y_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(y_desc.dtype))


@triton.jit(do_not_specialize=["M"])
def _gemm_tma_persistent_kernel(
    x_desc,
    w_desc,
    y_desc,
    M,
    N,
    K,
    PROGRAMS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """_gemm_tma_kernel's tiles with one program per SM walking them (tiles pid, pid + PROGRAMS, ...): each
    tile computed as there, so the same bits; the loop lets a tile's loads overlap the previous one's store."""
    tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    for t in tl.range(tl.program_id(0), tiles, PROGRAMS, flatten=True):
        pid_m, pid_n = _tile(t, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            a = x_desc.load([pid_m * BLOCK_M, k])
            b = w_desc.load([pid_n * BLOCK_N, k])
            acc = tl.dot(a, b.T, acc, input_precision=PRECISION)
        y_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(y_desc.dtype))


_SM90: dict = {}  # device index -> whether it has TMA (sm_90+)


def _tma_ok(*ts: torch.Tensor) -> bool:
    """Whether the "tma" loads apply: on CUDA sm_90+ (or Triton's interpreter, CPU tensors), every 2-D
    operand's base and row stride 16-byte aligned."""
    t0 = ts[0]
    if TensorDescriptor is None:
        return False
    if t0.is_cuda:
        i = t0.device.index if t0.device.index is not None else torch.cuda.current_device()
        if i not in _SM90:
            _SM90[i] = torch.cuda.get_device_capability(i)[0] >= 9
        if not _SM90[i]:
            return False
    elif os.environ.get("TRITON_INTERPRET") != "1":
        return False
    return all(t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0 for t in ts)


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ w[N, K].T -> [..., N] in x's dtype. Row invariant: row t of the result depends only
    on row t of x (one K order for every M, whatever tile and loads _config picks; no split-K)."""
    lead, K = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if w.stride(-1) != 1:
        w = w.contiguous()
    M, N = x2.shape[0], w.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if not M:
        return y.view(*lead, N)
    loads, bm, bn, warps, stages = _config(M, x.element_size())
    if loads != "ptr" and not _tma_ok(x2, w, y):
        loads, bm, bn, warps, stages = "ptr", BLOCK_M, BLOCK_N, NUM_WARPS, NUM_STAGES
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
    tiles = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=BLOCK_K, GROUP_M=GROUP_M, num_warps=warps, num_stages=stages)
    tiles["PRECISION"] = "ieee" if x.dtype == torch.float32 else "tf32"  # fp32: no TF32 rounding
    if loads != "ptr":
        xd = TensorDescriptor.from_tensor(x2, [bm, BLOCK_K])
        wd = TensorDescriptor.from_tensor(w, [bn, BLOCK_K])
        yd = TensorDescriptor.from_tensor(y, [bm, bn])
        if loads == "tma":
            _gemm_tma_kernel[grid](xd, wd, yd, M, N, K, **tiles)
        else:
            sms = sm_count(x.device)  # the persistent kernel's programs
            _gemm_tma_persistent_kernel[(min(sms, grid[0]),)](xd, wd, yd, M, N, K, PROGRAMS=sms, **tiles)
    else:
        _gemm_kernel[grid](x2, w, y, M, N, K, x2.stride(0), w.stride(0), y.stride(0), **tiles)
    return y.view(*lead, N)


@triton.jit
def _norm_kernel(
    x_ptr,
    g_ptr,
    w_ptr,
    y_ptr,
    N,
    eps,
    CENTRED: tl.constexpr,
    GATED: tl.constexpr,
    L2: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < N
    x = tl.load(x_ptr + row * N + offs, mask=m, other=0.0).to(tl.float32)
    ss = tl.sum(x * x, axis=0)
    if L2:  # no weight
        y = x * tl.rsqrt(ss + eps)
    else:
        y = x * tl.rsqrt(ss / N + eps)
        w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
        if GATED:  # (w * y.to(dt) * silu(gate.float())).to(dt), as GatedRMSNorm
            g = tl.load(g_ptr + row * N + offs, mask=m, other=0.0).to(tl.float32)
            y = y.to(y_ptr.dtype.element_ty).to(tl.float32)
            y = w.to(y_ptr.dtype.element_ty).to(tl.float32) * y
            y = y.to(y_ptr.dtype.element_ty).to(tl.float32) * (g * tl.sigmoid(g))
        elif CENTRED:
            y = y * (1.0 + w)
        else:
            y = y * w
    tl.store(y_ptr + row * N + offs, y.to(y_ptr.dtype.element_ty), mask=m)


def _norm(
    x: torch.Tensor, gate: torch.Tensor | None, w: torch.Tensor | None, eps: float, centred: bool, l2: bool = False
) -> torch.Tensor:
    N = x.shape[-1]
    x2 = x.reshape(-1, N).contiguous()
    g2 = gate.reshape(-1, N).contiguous() if gate is not None else x2
    y = torch.empty_like(x2)
    if x2.shape[0]:
        block = triton.next_power_of_2(N)
        _norm_kernel[(x2.shape[0],)](
            x2,
            g2,
            w if w is not None else x2,
            y,
            N,
            eps,
            CENTRED=centred,
            GATED=gate is not None,
            L2=l2,
            BLOCK=block,
            num_warps=8 if block >= 2048 else 4,
        )
    return y.view(x.shape)


def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float, centred: bool = True) -> torch.Tensor:
    """Row-wise RMSNorm over the last dim, fp32 inside: one program per row (row invariant)."""
    return _norm(x, None, w, eps, centred)


def gated_rmsnorm(x: torch.Tensor, gate: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """GatedRMSNorm's (w * norm(x).to(dt) * silu(gate.float())).to(dt), row by row."""
    return _norm(x, gate, w, eps, False)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x * rsqrt(sum(x^2) + eps) over the last dim, fp32 inside, one program per row."""
    return _norm(x, None, None, eps, False, l2=True)


# ---- the prefill's causal conv -------------------------------------------------------------------
CONV_T, CONV_C = 32, 128  # rows x channels of one program (any tile gives the same bits: per element)


@triton.jit(do_not_specialize=["T"])
def _conv_kernel(
    x_ptr, sx, st_ptr, s_slot, s_c, w_ptr, sw, slot_ptr, within_ptr, y_ptr, T, C,
    KW: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    rt = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    rc = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mt, mc = rt < T, rc < C
    within = tl.load(within_ptr + rt, mask=mt, other=0)  # the row's index in its segment
    slot = tl.load(slot_ptr + rt, mask=mt, other=0).to(tl.int64)
    st_row = st_ptr + slot[:, None] * s_slot + rc[None, :].to(tl.int64) * s_c
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for j in tl.static_range(KW):  # tap j: input r = within - (KW - 1) + j of the segment, in tap order
        r = within - (KW - 1) + j
        fx, fs = mt & (r >= 0), mt & (r < 0)  # from x (the segment's rows) or from the slot's state
        xv = tl.load(
            x_ptr + (rt + j - (KW - 1))[:, None].to(tl.int64) * sx + rc[None, :],
            mask=fx[:, None] & mc[None, :],
            other=0.0,
        )
        sv = tl.load(st_row + (r + KW - 1)[:, None], mask=fs[:, None] & mc[None, :], other=0.0)
        wj = tl.load(w_ptr + rc * sw + j, mask=mc, other=0.0).to(tl.float32)
        acc = acc + tl.where(fx[:, None], xv, sv).to(tl.float32) * wj[None, :]
    y = acc / (1.0 + tl.exp(-acc))  # SiLU
    tl.store(y_ptr + rt[:, None].to(tl.int64) * C + rc[None, :], y.to(y_ptr.dtype.element_ty), mask=mt[:, None] & mc[None, :])  # fmt: skip


@triton.jit
def _conv_state_kernel(
    x_ptr, sx, st_ptr, s_slot, s_c, seg_ptr, N, C,
    KW: tl.constexpr, KP: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0)  # segment i: seg = [slots (N) | row offsets (N) | lengths (N)]
    slot = tl.load(seg_ptr + i).to(tl.int64)
    off = tl.load(seg_ptr + N + i)
    n = tl.load(seg_ptr + 2 * N + i)
    rc = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ri = tl.arange(0, KP)
    mc, mi = rc < C, ri < KW - 1
    r = n - (KW - 1) + ri  # the new state's column ri: input r of the segment (r < 0: an old state column)
    fx, fs = mi & (r >= 0), mi & (r < 0)
    st_row = st_ptr + slot * s_slot + rc[:, None].to(tl.int64) * s_c
    xv = tl.load(x_ptr + (off + r)[None, :].to(tl.int64) * sx + rc[:, None], mask=mc[:, None] & fx[None, :], other=0.0)
    sv = tl.load(st_row + (r + KW - 1)[None, :], mask=mc[:, None] & fs[None, :], other=0.0)
    v = tl.where(fx[None, :], xv, sv)  # every load before the store: the old columns are read first
    tl.store(st_row + ri[None, :], v.to(st_ptr.dtype.element_ty), mask=mc[:, None] & mi[None, :])


def causal_conv(x: torch.Tensor, conv_all: torch.Tensor, w: torch.Tensor, index) -> torch.Tensor:
    """The prefill's depthwise causal conv + SiLU (baton/models/gdn_ops.py conv_segments on CUDA): x [T, C]
    (segment i's rows are index.segments[i]'s), conv_all [S, C, KW-1] (each segment's slot's state: its
    last KW-1 inputs, advanced in place to the segment's last KW-1), w [C, KW]. Output [T, C] in x's
    dtype: row t, channel c = silu(sum_j in[t - (KW-1) + j, c] * w[c, j]) in fp32, taps in order, each
    input from the segment's rows or, before its first row, from its slot's state. Every element is
    computed from its own window alone, so a row's bits never depend on the pass's other rows or size.
    Two launches, no host sync (index: the pass's PassIndex; its tensors are copied once a pass)."""
    T, C = x.shape
    KW = w.shape[1]
    if x.stride(1) != 1:
        x = x.contiguous()
    segs = index.segments
    within = index.ints("conv_within", lambda: [j for sg in segs for j in range(sg.n)])
    seg = index.ints("conv_segs", lambda: [sg.slot for sg in segs] + [sg.off for sg in segs] + [sg.n for sg in segs])
    y = torch.empty(T, C, dtype=x.dtype, device=x.device)
    if T == 0:
        return y
    s_slot, s_c, s_k = conv_all.stride()
    if s_k != 1:
        raise ValueError("conv state: the KW-1 columns must be contiguous")
    grid = (triton.cdiv(T, CONV_T), triton.cdiv(C, CONV_C))
    _conv_kernel[grid](
        x, x.stride(0), conv_all, s_slot, s_c, w, w.stride(0), index.row_slot, within, y, T, C,
        KW=KW, BLOCK_T=CONV_T, BLOCK_C=CONV_C, num_warps=4,
    )  # fmt: skip
    _conv_state_kernel[(len(segs), triton.cdiv(C, CONV_C))](
        x, x.stride(0), conv_all, s_slot, s_c, seg, len(segs), C,
        KW=KW, KP=triton.next_power_of_2(max(KW - 1, 1)), BLOCK_C=CONV_C, num_warps=4,
    )  # fmt: skip
    return y
