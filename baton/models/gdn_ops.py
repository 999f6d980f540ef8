"""Gated DeltaNet kernels: causal conv, chunked (prefill) and token-by-token (rows) delta rule.

Per value head, with S [dk, dv] (fp32):
    S <- S * exp(g_t);   u_t = beta_t * (v_t - S^T k_t);   S <- S + k_t u_t^T;   o_t = S^T q_t
q and k are L2-normalised per head and q is scaled by dk^-0.5. Key heads are shared by
Hv/Hk consecutive value heads (grouped value attention).

The prefill (`conv_segments`, `chunked_segments`) uses one fused conv kernel (baton/kernels/wide.py
causal_conv) and flash-linear-attention's varlen kernel on CUDA, and plain torch (`chunked`) elsewhere; `recurrent_rows` is always plain torch, one token at a time with identical ops, so an AR step and a verify row are bitwise equal.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from baton.models import fla_pins

CHUNK = 64

_FLA: list = []  # [chunk_gated_delta_rule or None], resolved on the first CUDA prefill


def _fla_chunk():
    """flash-linear-attention's chunked kernel, or None where it is not installed. Imported lazily:
    importing fla initialises CUDA (it asks device 0 for its name), and a worker narrows
    CUDA_VISIBLE_DEVICES (`--device cuda:N`, baton/gpus.py) after importing this module. Its launch configs
    are pinned first where Baton has them for this GPU (baton/models/fla_pins.py)."""
    if not _FLA:
        if torch.cuda.is_available():  # fla's launch configs pinned, not timed (baton/models/fla_pins.py)
            fla_pins.pin(torch.cuda.get_device_name())
        try:  # optional GPU kernels
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        except Exception:  # pragma: no cover - depends on the machine
            chunk_gated_delta_rule = None
        _FLA.append(chunk_gated_delta_rule)
    return _FLA[0]


def causal_conv(
    x: torch.Tensor, conv_state: torch.Tensor, w: torch.Tensor, n: int, ckpt: torch.Tensor | None = None
) -> torch.Tensor:
    """Rows mode: depthwise causal conv + SiLU over fixed-shape windows (row-invariant). x [W, C];
    conv_state [C, KW-1] (updated in place with the last KW-1 inputs of the first n rows); w [C, KW].
    ckpt [W, C, KW-1] (optional): ckpt[t] := the conv state after row t, t < n. Returns [W, C].
    (The prefill's conv is conv_segments.)"""
    KW = w.shape[1]
    seq = torch.cat([conv_state, x.transpose(0, 1)], dim=1)  # [C, KW-1+W]
    out = (seq.unfold(1, KW, 1) * w[:, None, :]).sum(-1)  # [C, W]
    if ckpt is not None:
        ckpt[:n].copy_(seq.unfold(1, KW - 1, 1)[:, 1 : n + 1].transpose(0, 1))
    conv_state.copy_(seq[:, n : n + KW - 1])
    return F.silu(out).transpose(0, 1)


def _conv_columns(segs, K1: int) -> tuple[list[int], list[int], list[int]]:
    """conv_segments' gathers for segments `segs` (Segment: n, off) and KW - 1 = K1 state columns:
    seq columns (each segment's state, then its inputs) as columns of [states (K1 per segment) | x^T],
    the windows that end on each segment's rows, and each segment's last K1 seq columns (its next state)."""
    xb, seq, win, tail, base = len(segs) * K1, [], [], [], 0
    for i, s in enumerate(segs):
        seq += [*range(i * K1, (i + 1) * K1), *range(xb + s.off, xb + s.off + s.n)]
        win += range(base, base + s.n)
        tail += range(base + s.n, base + s.n + K1)
        base += s.n + K1
    return seq, win, tail


def conv_segments(x: torch.Tensor, conv_all: torch.Tensor, index, w: torch.Tensor):
    """The prefill's causal conv + SiLU for a pass of segments: x [T, C] (segment i's rows are
    index.segments[i]'s rows), each segment continuing from its slot's conv state conv_all[slot]
    [C, KW-1] (updated in place with its last KW-1 inputs). One set of ops for the whole pass, whatever
    the segment count (index: the pass's PassIndex, baton/models/context.py: gathers copied once per
    pass, no host sync), each output an explicit fp32 sum over the KW taps in order, so a row's result
    depends on its own window only. Returns [T, C] in x's dtype. On CUDA the same sums in one kernel
    (wide.causal_conv) instead of the torch ops below, which write ~10 [C, T] fp32 temporaries: with it a
    burst of 32 x 512-token prompts took 636 ms of CUDA time on the H200 against 824 ms (the kernel 14 ms
    of it; benchmarks/results/gpu-h200-2026-12-02-later.md)."""
    if x.is_cuda:  # one fused kernel (baton/kernels/wide.py causal_conv): the same sums, no [C, T] fp32 copies
        from baton.kernels import wide  # CUDA only (Triton)

        return wide.causal_conv(x, conv_all, w, index)
    return conv_segments_torch(x, conv_all, index, w)


def conv_segments_torch(x: torch.Tensor, conv_all: torch.Tensor, index, w: torch.Tensor):
    """conv_segments in torch ops (the CPU path; on CUDA the reference of wide.causal_conv's GPU test)."""
    C, KW = w.shape
    N, K1, T = len(index.segments), KW - 1, x.shape[0]
    cols = index.ints(("conv", K1), lambda: sum(_conv_columns(index.segments, K1), []))  # one copy a pass
    seq_c, win_c, tail_c = cols.split([T + N * K1, T, N * K1])
    states = conv_all.index_select(0, index.slots).transpose(0, 1).reshape(C, N * K1)  # [C, N (KW-1)]
    seq = torch.cat([states, x.transpose(0, 1)], dim=1).index_select(1, seq_c)  # [C, T + N (KW-1)]
    L = seq.shape[1] - KW + 1
    acc = seq[:, 0:L].float() * w[:, 0:1].float()
    for j in range(1, KW):
        acc = acc + seq[:, j : j + L].float() * w[:, j : j + 1].float()
    out = acc.index_select(1, win_c)  # [C, T]: the windows that end on each segment's rows
    conv_all.index_copy_(0, index.slots, seq.index_select(1, tail_c).view(C, N, K1).transpose(0, 1))
    return F.silu(out).to(x.dtype).transpose(0, 1)


def chunked_segments(q, k, v, g, beta, rec_all: torch.Tensor, index) -> torch.Tensor:
    """The prefill's delta rule for a pass of segments (rows as conv_segments), each from its slot's
    recurrent state rec_all[slot] [Hv, dk, dv] fp32 (updated in place). CUDA with fla: one varlen call
    (cu_seqlens) for the whole pass, also for one segment, so a segment's arithmetic is the same alone or
    in any pass (fla's chunks never cross a sequence; its autotune keys hold no length). cu_seqlens are
    the pass's PassIndex tensors, the same objects in every layer: fla's identity cache then derives its
    chunk indices once per pass (each derivation is a blocking copy). Else each segment through `chunked`.
    q / k are L2-normalised first by wide.l2norm (fla's own l2norm autotunes its row tile per number of
    rows). Returns [T, Hv, dv]."""
    fla = _fla_chunk() if v.is_cuda else None
    if fla is None:
        lens = [s.n for s in index.segments]
        parts = zip(index.segments, *(t.split(lens) for t in (q, k, v, g, beta)))
        outs = [chunked(qs, ks, vs, gs, bs, rec_all[sg.slot]) for sg, qs, ks, vs, gs, bs in parts]
        return torch.cat(outs) if len(outs) > 1 else outs[0]
    from baton.kernels import wide  # CUDA only (Triton)

    q, k = wide.l2norm(q), wide.l2norm(k)  # row-invariant; fla's in-kernel l2norm tiles by the row count
    Hv = v.shape[1]
    rep = Hv // q.shape[1]
    qr, kr = (q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)) if rep > 1 else (q, k)
    st = index.slots
    o, final = fla(
        qr[None].contiguous(),
        kr[None].contiguous(),
        v[None].contiguous(),
        g=g[None].float(),
        beta=beta[None].to(v.dtype),
        initial_state=rec_all.index_select(0, st),
        output_final_state=True,
        use_qk_l2norm_in_kernel=False,
        cu_seqlens=index.cu,
        cu_seqlens_cpu=index.cu_cpu,
    )
    rec_all.index_copy_(0, st, final.to(rec_all.dtype))
    return o[0]


def _prep(q, k, g_heads: int):
    """L2-normalise (fp32), scale q, repeat key heads to value heads. q,k [T, Hk, dk] -> [T, Hv, dk]."""
    q, k = q.float(), k.float()
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * (q.shape[-1] ** -0.5)
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    if g_heads > 1:
        q, k = q.repeat_interleave(g_heads, dim=1), k.repeat_interleave(g_heads, dim=1)
    return q, k


def recurrent_rows(q, k, v, g, beta, S: torch.Tensor, n: int, ckpt: torch.Tensor | None = None) -> torch.Tensor:
    """q,k [W, Hk, dk]; v [W, Hv, dv]; g, beta [W, Hv]; S [Hv, dk, dv] fp32 updated in place by the
    first n rows; ckpt [W, Hv, dk, dv] (optional): ckpt[i] := S after row i. Returns o [W, Hv, dv] in
    v's dtype (rows >= n are zero)."""
    W, Hv, dv = v.shape
    q, k = _prep(q, k, Hv // q.shape[1])
    vf, bf, decay = v.float(), beta.float(), g.float().exp()
    out = torch.zeros(W, Hv, dv, dtype=torch.float32, device=v.device)
    for i in range(n):
        S.mul_(decay[i][:, None, None])
        kv = (S * k[i][:, :, None]).sum(1)  # [Hv, dv]
        u = (vf[i] - kv) * bf[i][:, None]
        S.add_(k[i][:, :, None] * u[:, None, :])
        out[i] = (S * q[i][:, :, None]).sum(1)
        if ckpt is not None:
            ckpt[i].copy_(S)
    return out.to(v.dtype)


def chunked(q, k, v, g, beta, S: torch.Tensor) -> torch.Tensor:
    """One sequence in plain torch (CUDA prefill: chunked_segments' fla call); S updated in place,
    returns [T, Hv, dv]. WY form per chunk of C tokens, with G = in-chunk cumulative log decay:
    (I + A) U = beta*V - beta*exp(G)*K S0,   A[i,j] = beta_i exp(G_i-G_j) k_i.k_j  (j < i)
    O = exp(G) Q S0 + (Q K^T * D) U,         D[i,j] = exp(G_i-G_j)              (j <= i)
    S_C = exp(G_C) S0 + (K * exp(G_C - G))^T U
    Every op after the per-row prep runs on one chunk at a time, in shapes that do not depend on T, so a
    sequence cut at multiples of C ends bitwise as the whole (a prefix-cache restore, --prefill-piece): batched
    over all chunks at once, a batched GEMM's blocking and the vectorised loops' tails changed with the chunk
    count on an AVX2 CPU (a cut 45 tokens before the end changed bits there; not on AVX-512), and it was slower
    (benchmarks/bench_gdn_chunked.py: 14.9 against 9.0 ms median for 813 tokens of the tiny model's shape there,
    benchmarks/results/gdn-chunked-cpu-epyc-*2026-12-07.json).
    """
    T, Hv, dv = v.shape
    q, k = _prep(q, k, Hv // q.shape[1])  # [T, Hv, dk] fp32
    pad = (-T) % CHUNK
    vf, bf, gf = v.float(), beta.float(), g.float()
    if pad:
        q, k, vf = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (q, k, vf))
        bf, gf = F.pad(bf, (0, 0, 0, pad)), F.pad(gf, (0, 0, 0, pad))
    nc = (T + pad) // CHUNK
    # -> [Hv, nc, C, *]
    q, k, vf = (t.view(nc, CHUNK, Hv, -1).permute(2, 0, 1, 3) for t in (q, k, vf))
    bf, gf = (t.view(nc, CHUNK, Hv).permute(2, 0, 1) for t in (bf, gf))
    tri = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=v.device).tril()
    strict = tri & ~torch.eye(CHUNK, dtype=torch.bool, device=v.device)
    eye = torch.eye(CHUNK, device=v.device)
    out = torch.empty_like(vf)
    for c in range(nc):  # each chunk's tensors contiguous [Hv, C, *]: the same shapes for every chunk count
        qc, kc, vc, bc = (t[:, c].contiguous() for t in (q, k, vf, bf))
        G = gf[:, c].contiguous().cumsum(-1)  # [Hv, C]
        D = (G[:, :, None] - G[:, None, :]).masked_fill(~tri, float("-inf")).exp()  # j <= i
        M = eye + ((kc @ kc.transpose(-1, -2)) * D * bc[:, :, None]).masked_fill(~strict, 0.0)  # unit lower-tri
        eG = G.exp()[..., None]  # [Hv, C, 1]
        U = torch.linalg.solve_triangular(M, bc[:, :, None] * (vc - eG * (kc @ S)), upper=False, unitriangular=True)
        out[:, c] = eG * (qc @ S) + ((qc @ kc.transpose(-1, -2)) * D) @ U
        tail = (G[:, -1:, None] - G[:, :, None]).exp()  # [Hv, C, 1]
        S.copy_(G[:, -1].exp()[:, None, None] * S + (kc * tail).transpose(-1, -2) @ U)
    out = out.permute(1, 2, 0, 3).reshape(nc * CHUNK, Hv, dv)[:T]
    return out.to(v.dtype)
