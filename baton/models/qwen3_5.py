"""Qwen3.5 text model (Gated DeltaNet + gated full attention), HF parameter names.

One entry point, `Qwen3_5ForCausalLM.forward(ids, state, ctx)`, serves every use:
  * prefill (`ctx.width is None`): T prompt rows computed wide — chunked GDN, causal SDPA — for one
    or several sessions' prompt pieces in one pass (`ctx.segments`, baton/models/context.py): per-row
    ops once on all rows through the row-invariant wide kernels (CUDA) or once per segment, each
    segment's mixer on its own rows, so a prompt's state is the same alone or in any pass;
  * rows (`ctx.width == W`): n <= W decode-time rows (an AR step is n=1, a verify block n=K+1),
    computed at the fixed width W so that row i is bitwise independent of n:
      - every GEMM / norm / elementwise op sees a padded [W, ...] input,
      - attention scores every row against the whole [max_len] window (gathered from the slot's KV
        pages) with a position mask,
      - the GDN recurrence runs token by token with identical kernels.
  * batched rows (`ctx.groups`, issue 20): several slots' rows flattened into C chunks of W rows
    (each group's rows contiguous and in order). Per-row ops (GEMMs, norms, MLP, RoPE, gates) run
    chunk by chunk on [W, ...] inputs, the shape of the one-slot step; each group's mixer (GDN conv +
    delta rule, attention against its own slot's KV) runs on its rows padded to [W, ...] at rows
    [0, n), exactly the call of the one-slot step. One-slot rows are the case of one group at offset
    0 in one chunk (`ctx.groups is None`), the same code: so a slot's rows are bitwise the same alone
    or inside any batch.
State lives in `baton.engine.state.HybridState`, never in the modules. In rows mode the position comes
from the device buffer `state.position[slot]`, so the step is CUDA-graph capturable.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from baton.config import ModelConfig
from baton.models import gdn_ops, prefill_attention
from baton.models.context import RowGroup, Segment, StepContext, lin, wide_kernels  # noqa: F401 (re-exported)
from baton.models.kept import kept, weights_key

CUDNN_SDPA_ENV = prefill_attention.CUDNN_SDPA_ENV  # the knob and why: baton/models/prefill_attention.py


def _no_cudnn_sdpa() -> None:
    if os.environ.get(CUDNN_SDPA_ENV, "1") == "0" and torch.backends.cuda.cudnn_sdp_enabled():
        torch.backends.cuda.enable_cudnn_sdp(False)


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm: y = x / rms(x) * (1 + w), computed in fp32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (k := wide_kernels()) is not None:
            return k.rmsnorm(x, self.weight, self.eps, centred=True)
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).type_as(x)


class GatedRMSNorm(nn.Module):
    """y = w * norm(x) * silu(gate) (plain weight, not zero-centred)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        if (k := wide_kernels()) is not None:
            return k.gated_rmsnorm(x, gate, self.weight, self.eps)
        dt = x.dtype
        xf = x.float()
        y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(dt)
        return (self.weight * y * F.silu(gate.float())).to(dt)


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return lin(self.down_proj, F.silu(lin(self.gate_proj, x)) * lin(self.up_proj, x))


_ROPE: dict = {}  # kept(): the inverse frequencies of one config and device


def rope_cos_sin(cfg: ModelConfig, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """pos [T] int64 -> cos, sin [T, rotary_dim] (half-split layout, as HF)."""
    rd = cfg.rotary_dim
    inv = kept(
        _ROPE,
        (rd, cfg.rope_theta, pos.device),
        lambda: 1.0 / (cfg.rope_theta ** (torch.arange(0, rd, 2, device=pos.device, dtype=torch.float) / rd)),
    )
    freqs = pos.float()[:, None] * inv[None, :]  # [T, rd/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [T, rd]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; rotates the first rotary_dim features of each head."""
    rd = cos.shape[-1]
    xr, xp = x[..., :rd], x[..., rd:]
    x1, x2 = xr[..., : rd // 2], xr[..., rd // 2 :]
    rot = torch.cat([-x2, x1], dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([xr * c + rot * s, xp], dim=-1)


class Attention(nn.Module):
    """Gated full attention: q_proj yields (query, gate); q/k RMSNorm; partial RoPE; sigmoid gate."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.cfg, self.layer_idx = cfg, layer_idx
        h, d = cfg.hidden_size, cfg.head_dim
        self.nh, self.nkv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.q_proj = nn.Linear(h, self.nh * d * 2, bias=False)
        self.k_proj = nn.Linear(h, self.nkv * d, bias=False)
        self.v_proj = nn.Linear(h, self.nkv * d, bias=False)
        self.o_proj = nn.Linear(self.nh * d, h, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def _project(self, x: torch.Tensor, pos: torch.Tensor, rope_offset: int):
        """x [T, hidden], pos [T] -> q [T, nh, d], k, v [T, nkv, d] (RoPE applied), gate [T, nh*d]."""
        T = x.shape[0]
        qg = lin(self.q_proj, x).view(T, self.nh, 2 * self.d)
        q, gate = qg[..., : self.d], qg[..., self.d :].reshape(T, self.nh * self.d)
        q = self.q_norm(q)  # [T, nh, d]
        k = self.k_norm(lin(self.k_proj, x).view(T, self.nkv, self.d))  # [T, nkv, d]
        v = lin(self.v_proj, x).view(T, self.nkv, self.d)
        cos, sin = rope_cos_sin(self.cfg, pos + rope_offset if rope_offset else pos, x.dtype)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, gate

    def _attend_rows(self, q, k, v, pos, state, slot: int, n: int) -> torch.Tensor:
        """One slot's rows: q [W, nh, d], k, v [W, nkv, d], pos [W] (first n valid) -> o [W, nh*d]. The n
        rows' KV is written into the slot's pages, then the whole window kc, vc [nkv, L = max_len, d] is
        gathered from them (state.slot_kv: the contiguous window's values and layout). Row-invariant:
        fixed shapes [nkv, g*W, L]; row i sees keys j <= pos[i]."""
        T, g = q.shape[0], self.nh // self.nkv
        state.write_kv(self.layer_idx, slot, pos[:n], k[:n], v[:n])
        kc, vc = state.slot_kv(self.layer_idx, slot)  # [nkv, L, d]
        qh = q.view(T, self.nkv, g, self.d).permute(1, 2, 0, 3).reshape(self.nkv, g * T, self.d)
        scores = torch.matmul(qh, kc.transpose(1, 2)).float() * (self.d**-0.5)  # [nkv, g*W, L]
        L = kc.shape[1]
        mask = torch.arange(L, device=q.device)[None, :] > pos[:, None]  # [W, L]
        scores = scores.view(self.nkv, g, T, L).masked_fill(mask, float("-inf"))
        p = torch.softmax(scores, dim=-1).to(vc.dtype).view(self.nkv, g * T, L)
        o = torch.matmul(p, vc)  # [nkv, g*W, d]
        return o.view(self.nkv, g, T, self.d).permute(2, 0, 1, 3).reshape(T, self.nh * self.d)

    def _attend_prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state, sg: Segment) -> torch.Tensor:
        """One segment's queries q [n, nh, d] (positions [start, start + n), its KV k, v [n, nkv, d]
        already written) against keys [0, start + n) of its slot, causal -> o [n, nh*d]: the call of the
        segment alone (prefill_attention.attend_segment). A first piece (start 0) reads its keys from k, v
        (the values its pages now hold, bitwise), a later one gathers them from the pages."""
        T, s0 = q.shape[0], sg.start
        if s0 == 0 and state.key[self.layer_idx].dtype == k.dtype:
            keys, vals = k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()  # [nkv, T, d]
        else:
            keys, vals = state.slot_kv(self.layer_idx, sg.slot, s0 + T)  # [nkv, s0+T, d]
        return prefill_attention.attend_segment(q, keys, vals, s0, self.nh // self.nkv)

    def _attend_pass(self, q, k, v, state, segs: list) -> torch.Tensor:
        """Every segment of a prefill pass -> o [T, nh*d]: each alone, or pieces of one shape together
        (prefill_attention.groups, BATON_PREFILL_SDPA_BATCH), each segment's rows the same either way."""
        if q.is_cuda:
            _no_cudnn_sdpa()
        own = state.key[self.layer_idx].dtype == k.dtype  # a first piece's keys from k, v (else its pages)
        outs, g, L = [], self.nh // self.nkv, self.layer_idx
        for grp in prefill_attention.groups(segs, prefill_attention.batching_on(q.is_cuda)):
            a, b, s0, n = grp[0].off, grp[-1].off + grp[-1].n, grp[0].start, grp[0].n
            if len(grp) == 1:
                outs.append(self._attend_prefill(q[a:b], k[a:b], v[a:b], state, grp[0]))
            elif s0 == 0 and own:
                outs.append(prefill_attention.attend_first_pieces(q[a:b], k[a:b], v[a:b], len(grp), g))
            else:  # each piece's slot's keys [0, s0 + n) from its pages [b, nkv, s0 + n, d], one gather for all
                keys, vals = state.slots_kv(L, [sg.slot for sg in grp], s0 + n)
                outs.append(prefill_attention.attend_pieces(q[a:b], keys, vals, s0, g))
        return torch.cat(outs)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, state, ctx: StepContext) -> torch.Tensor:
        T = x.shape[0]  # x [T, hidden]; KV through the slot's pages (HybridState.write_kv / slot_kv)
        if ctx.width is None:
            q, k, v, gate = ctx.map(lambda xc, pc: self._project(xc, pc, ctx.rope_offset), x, pos)
            segs = ctx.prefill_segments()  # pos = [start, start + n) of each segment
            state.write_kv(self.layer_idx, ctx.pass_index(x.device).row_slot, pos, k, v)
            ctx.state_written(self.layer_idx)  # KV rows final
            o = self._attend_pass(q, k, v, state, segs)
            return ctx.map(lambda oc, gc: lin(self.o_proj, oc * torch.sigmoid(gc)), o, gate)
        q, k, v, gate = ctx.map(lambda xc, pc: self._project(xc, pc, ctx.rope_offset), x, pos)
        groups = ctx.row_groups()
        o = None if len(groups) == 1 and T == ctx.width else torch.zeros_like(gate)
        for grp in groups:  # each slot's rows against its own KV, at the one-slot shape
            og = self._attend_rows(*(ctx.group_rows(t, grp) for t in (q, k, v, pos)), state, grp.slot, grp.n)
            if o is None:
                o = og
            else:
                o[grp.off : grp.off + grp.n] = og[: grp.n]
        return ctx.map(lambda oc, gc: lin(self.o_proj, oc * torch.sigmoid(gc)), o, gate)


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet linear attention; conv and recurrent state live in HybridState."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.cfg, self.layer_idx = cfg, layer_idx
        h = cfg.hidden_size
        self.nk, self.nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.conv1d = nn.Conv1d(
            cfg.conv_dim,
            cfg.conv_dim,
            cfg.linear_conv_kernel_dim,
            bias=False,
            groups=cfg.conv_dim,
            padding=cfg.linear_conv_kernel_dim - 1,
        )
        self.dt_bias = nn.Parameter(torch.ones(self.nv))
        self.A_log = nn.Parameter(torch.zeros(self.nv))
        self._kept: dict = {}  # kept(): -exp(A_log), for the A_log it was computed from
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(cfg.value_dim, h, bias=False)
        self.in_proj_qkv = nn.Linear(h, cfg.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(h, cfg.value_dim, bias=False)
        self.in_proj_b = nn.Linear(h, self.nv, bias=False)
        self.in_proj_a = nn.Linear(h, self.nv, bias=False)

    def _gdn_state(self, state, slot: int, phase: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv [C, K-1], recurrent [Hv, dk, dv]) of `slot` that this step advances in place."""
        if phase is None:
            conv_state, rec_state = state.gdn(self.layer_idx)  # [S, C, K-1], [S, Hv, dk, dv]
        else:  # ping-pong step: advance a copy in the other buffers (the fused kernels read in, write out)
            c_in, conv_state, r_in, rec_state = state.gdn_io(self.layer_idx, phase)
            conv_state[slot].copy_(c_in[slot])
            rec_state[slot].copy_(r_in[slot])
        return conv_state[slot], rec_state[slot]

    def _project(self, x: torch.Tensor):
        """x [T, hidden] -> mixed [T, C] (pre-conv), beta, g [T, Hv], z [T, value_dim]."""
        beta = torch.sigmoid(lin(self.in_proj_b, x))  # [T, Hv]
        a = self.A_log
        decay = kept(self._kept, weights_key(a), lambda: -a.float().exp())  # -exp(A_log) [Hv] fp32
        g = decay * F.softplus(lin(self.in_proj_a, x).float() + self.dt_bias)
        return lin(self.in_proj_qkv, x), beta, g, lin(self.in_proj_z, x)

    def _mix(self, mixed, beta, g, cs, rs, n: int, ck) -> torch.Tensor:
        """One slot's rows: conv + delta rule on its state (cs, rs updated in place) -> o [T, Hv, dv].
        Rows mode: T = W rows, the first n valid; ck = (conv, recurrent) per-row checkpoints or None."""
        T = mixed.shape[0]
        w = self.conv1d.weight[:, 0, :]  # [C, K]
        mixed = gdn_ops.causal_conv(mixed, cs, w, n, ck and ck[0])  # [W, C], updates cs
        kd = self.cfg.key_dim
        q = mixed[:, :kd].reshape(T, self.nk, self.dk)
        k = mixed[:, kd : 2 * kd].reshape(T, self.nk, self.dk)
        v = mixed[:, 2 * kd :].reshape(T, self.nv, self.dv)
        return gdn_ops.recurrent_rows(q, k, v, g, beta, rs, n, ck and ck[1])  # [W, Hv, dv]

    def _mix_segments(self, mixed, beta, g, state, index) -> torch.Tensor:
        """Prefill: every segment's conv + delta rule against its own slot's state (updated in place),
        each as in a pass of its own (gdn_ops.conv_segments / chunked_segments; index: the pass's
        PassIndex) -> o [T, Hv, dv]."""
        T = mixed.shape[0]
        conv_all, rec_all = state.gdn(self.layer_idx)  # [S, C, K-1], [S, Hv, dk, dv]
        mixed = gdn_ops.conv_segments(mixed, conv_all, index, self.conv1d.weight[:, 0, :])  # [T, C]
        kd = self.cfg.key_dim
        q = mixed[:, :kd].reshape(T, self.nk, self.dk)
        k = mixed[:, kd : 2 * kd].reshape(T, self.nk, self.dk)
        v = mixed[:, 2 * kd :].reshape(T, self.nv, self.dv)
        return gdn_ops.chunked_segments(q, k, v, g, beta, rec_all, index)

    def _out(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        T = o.shape[0]
        o = self.norm(o.reshape(T * self.nv, self.dv), z.reshape(T * self.nv, self.dv))
        return lin(self.out_proj, o.reshape(T, self.nv * self.dv))

    def forward(self, x: torch.Tensor, pos: torch.Tensor, state, ctx: StepContext) -> torch.Tensor:
        T = x.shape[0]  # x [T, hidden]
        if ctx.width is None:
            mixed, beta, g, z = ctx.map(self._project, x)
            o = self._mix_segments(mixed, beta, g, state, ctx.pass_index(x.device))
            ctx.state_written(self.layer_idx)  # conv + recurrent final
            return ctx.map(self._out, o, z)
        mixed, beta, g, z = ctx.map(self._project, x)
        groups = ctx.row_groups()
        o = None if len(groups) == 1 and T == ctx.width else x.new_zeros(T, self.nv, self.dv)
        for grp in groups:  # each slot's rows in order against its own state, at the one-slot shape
            cs, rs = self._gdn_state(state, grp.slot, ctx.phase)
            ck = state.row_ckpt(self.layer_idx) if grp.n > 1 else None  # per-row ckpts (one set per runner)
            og = self._mix(*(ctx.group_rows(t, grp) for t in (mixed, beta, g)), cs, rs, grp.n, ck)
            if o is None:
                o = og
            else:
                o[grp.off : grp.off + grp.n] = og[: grp.n]
        return ctx.map(self._out, o, z)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        # layer_idx >= num_hidden_layers is the MTP layer: always full attention
        if layer_idx < cfg.num_hidden_layers and cfg.layer_types[layer_idx] == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg, layer_idx)
        else:
            self.self_attn = Attention(cfg, layer_idx)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, pos, state, ctx: StepContext):
        mixer = self.linear_attn if hasattr(self, "linear_attn") else self.self_attn
        x = x + mixer(ctx.map(self.input_layernorm, x), pos, state, ctx)
        return ctx.map(lambda xc: xc + self.mlp(self.post_attention_layernorm(xc)), x)


class TextModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen3_5ForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, with_mtp: bool = False):
        super().__init__()
        self.cfg = cfg
        self.model = TextModel(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if with_mtp:
            from baton.models.mtp import MTPHead

            self.mtp = MTPHead(cfg)

    def head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.cfg.tie_word_embeddings else self.lm_head.weight

    def positions(self, state, ctx: StepContext, T: int, device) -> torch.Tensor:
        if ctx.width is None:  # each segment's positions [start, start + n)
            if ctx.segments is None or len(ctx.segments) == 1:
                return torch.arange(ctx.start, ctx.start + T, device=device)
            return ctx.pass_index(device).pos
        if ctx.groups is None:
            return state.position[ctx.slot] + torch.arange(T, device=device)  # [W] device-side
        pos = torch.zeros(T, dtype=torch.long, device=device)  # [C*W]; padding rows 0
        ar = torch.arange(ctx.width, device=device)
        for grp in ctx.groups:
            pos[grp.off : grp.off + grp.n] = state.position[grp.slot] + ar[: grp.n]
        return pos

    def forward(self, ids: torch.Tensor, state, ctx: StepContext) -> torch.Tensor:
        """ids [T] (prefill), [W] (rows, padded) or [C*W] (batched rows, ctx.groups) -> final-normed
        hidden [T, hidden].

        Rows mode advances `state.position[slot]` by n on the device for every group; prefill leaves
        it to the caller.
        """
        x = self.model.embed_tokens(ids)  # [T, hidden]
        pos = self.positions(state, ctx, ids.shape[0], ids.device)
        for layer in self.model.layers:
            x = layer(x, pos, state, ctx)  # prefill: marks ctx.state_written(i) mid-layer
        if ctx.width is not None:
            for grp in ctx.row_groups():
                state.position[grp.slot] += grp.n
        return ctx.map(self.model.norm, x)

    def logits(self, hidden: torch.Tensor, rows: int | None = None) -> torch.Tensor:
        """hidden [T, h] -> [T, vocab]; `rows`: only the first rows are live (the FP8 head skips the rest)."""
        head = getattr(self, "fp8_head", None)  # set by decode_worker.fp8.quantize_head
        if head is not None:
            return head(hidden, rows=rows)  # [T, vocab]
        return F.linear(hidden, self.head_weight())  # [T, vocab]
