"""The fused rows step on CUDA: the same computation as `Qwen3_5ForCausalLM.forward` in rows mode
(ctx.width == W), in about ten kernels per layer instead of ~75.

    per layer  add+RMSNorm (Triton) -> merged input projections (one GEMM per weight type)
               GDN:  conv_rows (Triton) -> gdn_rows (Triton: gates + delta rule per dv slice, then the
                     gated norm per row) -> out_proj
               attn: q/k RMSNorm + RoPE + KV write (Triton), split-window attention with
                     the output gate (Triton, reads keys up to each row's position only) -> o_proj
               add+RMSNorm (Triton) -> gate|up GEMM -> silu_mul (Triton) -> down
               (fp8: one gate|up GEMM with silu(gate)*up in its epilogue -> down; GDN qkv|z|b|a one GEMM)
Row invariance holds as in the eager path: every op sees fixed [W, ...] shapes, the Triton kernels
compute row t from row t (recurrences: from rows <= t) only, and GEMMs run at M = W.

Both workers build this from the same weights, so the exact engine's AR path and the decode
worker's bf16 engine replay the same kernels (the exactness contract is per device kind: CPU runs
the eager reference). Merged projections: the merged weight owns the storage and each original
Linear / FP8Linear keeps a row-slice view of it, so the eager path (prefill) and this path read the
same bytes and no weight is stored twice.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

try:
    from baton.kernels import attention as attn
    from baton.kernels import gdn, gdn_conv, gemv
    from baton.kernels import rows as rk
except ImportError:  # no Triton: the eager rows path is used everywhere
    attn = rk = gdn = gdn_conv = gemv = None
from baton.models.qwen3_5 import Attention, GatedDeltaNet, Qwen3_5ForCausalLM, rope_cos_sin

_CACHE: "weakref.WeakKeyDictionary[nn.Module, FastRows]" = weakref.WeakKeyDictionary()


class Merged:
    """One GEMM standing in for several bias-free projections of the same input and weight type.
    Calling it returns the per-projection outputs as column views of one [T, sum(out)] result.
    glu=True (FP8Linear gate, up only): the rows interleave (gate_i, up_i) (gemv.interleave_glu), the
    originals keep row-strided views, and `act(x, n)` gives silu(gate) * up from one kernel."""

    def __init__(self, mods: list[nn.Module], glu: bool = False):
        kinds = {type(m) for m in mods}
        if len(kinds) != 1:
            raise TypeError(f"Merged: mixed projection types {sorted(k.__name__ for k in kinds)}")
        self.sizes = [m.weight.shape[0] for m in mods]
        self.glu = glu
        if glu:
            if type(mods[0]) is nn.Linear or len(mods) != 2 or self.sizes[0] != self.sizes[1]:
                raise ValueError("Merged(glu=True): FP8Linear gate and up projections of one size")
            gate, up = mods
            w = gemv.interleave_glu(gate.weight, up.weight)  # [2I, in] e4m3
            s = gemv.interleave_glu(gate.scale, up.scale)  # [2I]
            self.module = type(gate)(w, s)
            for j, m in enumerate(mods):
                m._buffers["weight"], m._buffers["scale"] = w[j::2], s[j::2]  # row-strided views
            return
        if type(mods[0]) is nn.Linear:
            if any(m.bias is not None for m in mods):
                raise ValueError("Merged: biased projections are not supported")
            w = torch.cat([m.weight.detach() for m in mods])  # [sum(out), in]
            self.module = nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
            self.module.weight = nn.Parameter(w, requires_grad=False)
            for m, view in zip(mods, w.split(self.sizes)):
                m.weight = nn.Parameter(view, requires_grad=False)
        else:  # FP8Linear: weight + row scales
            w = torch.cat([m.weight for m in mods])
            s = torch.cat([m.scale for m in mods])
            self.module = type(mods[0])(w, s)
            for m, wv, sv in zip(mods, w.split(self.sizes), s.split(self.sizes)):
                m._buffers["weight"], m._buffers["scale"] = wv, sv

    def __call__(self, x: torch.Tensor, n: int, partial: bool = False) -> list[torch.Tensor]:
        assert not self.glu
        return list(rows_linear(self.module, x, n, partial).split(self.sizes, dim=-1))

    def act(self, x: torch.Tensor, n: int) -> torch.Tensor:
        """gate|up merge only: x [W, in] -> silu(x @ gate^T) * (x @ up^T) [W, I]."""
        if self.glu:
            return gemv.linear(x, self.module.weight, self.module.scale, rows=n, glu=True)
        return rk.silu_mul(rows_linear(self.module, x, n))


def rows_linear(mod: nn.Module, x: "torch.Tensor | gemv.QuantX", n: int, partial: bool = False) -> torch.Tensor:
    """mod(x) for x [W, in] whose first n rows are live -> [W, out]; rows >= n are 0 or junk, never read.
    FP8Linear: the W8A8 rows kernel. bf16 nn.Linear: the rows kernel for the bf16 gemv.TUNED shapes (where
    it beats cuBLAS), else cuBLAS at M = W. Each is row-invariant, so a row's bits depend on
    neither n nor the other rows (the exactness contract).
    NOTE: silu(gate) * up is never fused into the down projection's input load: there it is recomputed
    by every N tile (64x for N = 4096; README Performance has the cost). FP8 fuses it
    into the gate|up GEMM's epilogue instead (Merged.act).
    x may be a gemv.QuantX (FP8Linear) and partial=True asks for the split-K partials (FP8Linear, or a
    bf16 Linear of a TUNED shape: see FastRows.forward)."""
    w = mod.weight
    if partial or isinstance(x, gemv.QuantX):
        return gemv.linear(x, w, getattr(mod, "scale", None), rows=n, partial=partial)
    if type(mod) is nn.Linear:
        if w.dtype == x.dtype == torch.bfloat16:  # every bf16 projection: cuBLAS rows change with M
            return gemv.linear(x, w, rows=n)
        return mod(x)
    return mod(x, rows=n)


def _groups(mods: list[nn.Module]) -> list[Merged]:
    """Consecutive projections of the same type merged."""
    out, run = [], [mods[0]]
    for m in mods[1:]:
        if type(m) is type(run[-1]):
            run.append(m)
        else:
            out.append(Merged(run))
            run = [m]
    return out + [Merged(run)]


def _call(groups: list[Merged], x: torch.Tensor, n: int, partial: bool = False) -> list[torch.Tensor]:
    return [y for g in groups for y in g(x, n, partial)]


class FastRows:
    """Built once per model (`FastRows.for_model`); `forward` replaces the model's rows-mode forward.
    NOTE: it holds the model's projections as merged modules, so swap modules (fp8.quantize_model) on a
    copy or before the first CUDA runner of that model is built, never after."""

    def __init__(self, model: Qwen3_5ForCausalLM, max_len: int):
        self.model, self.cfg = model, model.cfg
        self.mixer: list[list[Merged]] = []  # per layer: GDN qkv|z|b|a, attention q|k|v
        self.gate_up: list[Merged] = []
        for layer in model.model.layers:
            if hasattr(layer, "linear_attn"):
                a = layer.linear_attn
                self.mixer.append(_groups([a.in_proj_qkv, a.in_proj_z, a.in_proj_b, a.in_proj_a]))
            else:
                a = layer.self_attn
                self.mixer.append(_groups([a.q_proj, a.k_proj, a.v_proj]))
            mlp = layer.mlp  # fp8 quantizes both or neither
            glu = type(mlp.gate_proj) is not nn.Linear and mlp.gate_proj.weight.shape == mlp.up_proj.weight.shape
            self.gate_up.append(Merged([mlp.gate_proj, mlp.up_proj], glu=glu))
        self.w8a8 = _all_fp8(model, self)  # the FP8 module class (its use_kernel switch), or None
        self.bf16_partial = _bf16_partial(model)
        if hasattr(model, "mtp"):  # the MTP head's decoder layer (full attention)
            a, mlp = model.mtp.layers[0].self_attn, model.mtp.layers[0].mlp
            self.mtp_mixer = _groups([a.q_proj, a.k_proj, a.v_proj])
            (self.mtp_gate_up,) = _groups([mlp.gate_proj, mlp.up_proj])
        self.rope_len = 0
        self._old_tables: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._rope_table(max_len)

    @classmethod
    def for_model(cls, model: Qwen3_5ForCausalLM, max_len: int) -> "FastRows":
        fr = _CACHE.get(model)
        if fr is None:
            fr = _CACHE[model] = cls(model, max_len)
        fr._rope_table(max_len)
        return fr

    def _rope_table(self, max_len: int) -> None:
        """cos/sin [max_len, rotary_dim] tables; callers pass max_len >= window + W + 1 (padded rows,
        MTP RoPE offset)."""
        if max_len <= self.rope_len:
            return
        p = next(self.model.parameters())
        pos = torch.arange(max_len, device=p.device)
        dtype = self.model.model.embed_tokens.weight.dtype
        if self.rope_len:  # graphs captured by an earlier runner read the old tables: keep them
            self._old_tables.append((self.cos, self.sin))
        self.cos, self.sin = rope_cos_sin(self.cfg, pos, dtype)
        self.rope_len = max_len

    # ---- the step ------------------------------------------------------------------------------
    # Hand-offs between kernels, each bitwise the plain sequence (tests/engine/test_gemv.py, test_gdn_rows.py):
    #   partial  the GEMMs that feed an add+RMSNorm (out_proj, o_proj, down) hand it their split-K
    #            partials instead of reducing them in-kernel (FP8, or bf16 where the rows kernel runs);
    #   w8a8     (every projection FP8, each norm output feeding one merged GEMM) the norms and the GDN
    #            gated norm hand the next GEMM its input already quantised (gemv.QuantX), and the GDN
    #            qkv|z|b|a GEMM hands conv_rows / gdn_rows its partials too.
    def forward(
        self,
        ids: torch.Tensor,
        state,
        slots: torch.Tensor,
        n: int,
        pos: torch.Tensor,
        phase: int | None = None,
        gs: int | None = None,
        lens: torch.Tensor | None = None,
        save=None,
    ) -> torch.Tensor:
        """ids [M] (first n valid), pos [M] positions -> final-normed hidden [M, hidden]; slots [G] int64
        on the device: the slot of each group of gs rows (gs None: one group, slots [1], the first n of
        M = W rows; a batch: G groups of gs = n rows each, M = G * gs, slot < 0 = a padding group; lens [G]
        int64, ragged groups: group g's first lens[g] rows are live, the rest junk, never read back). Every
        kernel reads the slot from the device, so one captured graph serves any slots. Each group's rows
        are bitwise the one-slot step's (the same kernels; GEMM rows are independent of M, gemv).
        The caller advances state.position. phase: GDN state read from one ping-pong set and written to
        the other (HybridState.gdn_io); None = in place. save(i, proj): called with each GDN layer's
        projections (mixed, z, beta, alpha) before its conv (fused_blocks.BatchedRows keeps them)."""
        m, layers = self.model, self.model.model.layers
        live = n if gs is None else ids.shape[0]  # rows the GEMMs and norms compute
        gs = ids.shape[0] if gs is None else gs
        b = dict(slots=slots, gs=gs, lens=lens)
        x = m.model.embed_tokens(ids)  # [M, h]
        eps = self.cfg.rms_norm_eps
        q8 = self.w8a8 is not None and self.w8a8.use_kernel
        part = q8 or self.bf16_partial
        res, xn = rk.add_rmsnorm(x, None, layers[0].input_layernorm.weight, eps, quant=q8)
        for i, layer in enumerate(layers):
            if hasattr(layer, "linear_attn"):
                proj = _call(self.mixer[i], xn, live, partial=q8)
                if save is not None:
                    save(i, proj)
                y = self._gdn(layer.linear_attn, proj, state, n, phase, b, live, partial=part, quant=q8)
            else:
                proj = _call(self.mixer[i], xn, live)
                y = self._attn(layer.self_attn, proj, state, n, pos, b, live, partial=part)
            res, xn = rk.add_rmsnorm(y, res, layer.post_attention_layernorm.weight, eps, rows=live, quant=q8)
            y = rows_linear(layer.mlp.down_proj, self.gate_up[i].act(xn, live), live, partial=part)
            last = i + 1 == len(layers)
            nxt = m.model.norm if last else layers[i + 1].input_layernorm
            res, xn = rk.add_rmsnorm(y, res, nxt.weight, eps, rows=live, quant=q8 and not last)
        return xn

    def head(self, h: torch.Tensor, rows: int) -> torch.Tensor:
        """The LM head of the fused step: h [M, hidden] -> logits [M, vocab] (rows >= `rows` junk). The
        bf16 head runs in the rows GEMM (its rows are independent of M; cuBLAS's are not), fp8 in its own."""
        m = self.model
        if getattr(m, "fp8_head", None) is not None:
            return m.logits(h, rows=rows)
        return gemv.linear(h, m.head_weight(), rows=rows)

    def mtp(
        self,
        hidden: torch.Tensor,
        ids: torch.Tensor,
        state,
        slots: torch.Tensor,
        n: int,
        pos: torch.Tensor,
        gs: int | None = None,
        lens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The MTP head in rows mode (baton/models/mtp.py): pairs (hidden[i], ids[i]) at KV indexes pos[i],
        RoPE position pos[i] + 1 -> normed out [M, hidden]. Writes the MTP KV rows of the live pairs.
        Groups as in `forward`: gs None = one group (slots [1]), the first n of M = W pairs; else G groups
        of gs = n pairs each (slots [G], < 0 = padding; lens [G]: ragged, as forward), M = G * gs, each
        group bitwise as it is alone."""
        head, eps = self.model.mtp, self.cfg.rms_norm_eps
        layer = head.layers[0]
        live = n if gs is None else ids.shape[0]  # rows the GEMMs compute
        b = dict(slots=slots, gs=ids.shape[0] if gs is None else gs, lens=lens)
        _, e = rk.add_rmsnorm(self.model.model.embed_tokens(ids), None, head.pre_fc_norm_embedding.weight, eps)
        _, hn = rk.add_rmsnorm(hidden, None, head.pre_fc_norm_hidden.weight, eps)
        res, xn = rk.add_rmsnorm(
            rows_linear(head.fc, torch.cat([e, hn], dim=-1), live), None, layer.input_layernorm.weight, eps
        )
        y = self._attn(layer.self_attn, _call(self.mtp_mixer, xn, live), state, n, pos, b, live, rope_offset=1)
        res, xn = rk.add_rmsnorm(y, res, layer.post_attention_layernorm.weight, eps)
        y = rows_linear(layer.mlp.down_proj, self.mtp_gate_up.act(xn, live), live)
        return rk.add_rmsnorm(y, res, head.norm.weight, eps)[1]

    def _gdn(
        self,
        a: GatedDeltaNet,
        proj,
        state,
        n: int,
        phase: int | None,
        b: dict,
        live: int,
        partial: bool = False,
        quant: bool = False,
    ) -> torch.Tensor:
        """b: slots / gs of the groups (see forward); live: the rows the GEMM computes."""
        mixed, z, beta, alpha = proj  # [M, C], [M, Hv*dv], [M, Hv] x2 (or [S, M, .] partials)
        c_in, c_out, r_in, r_out = state.gdn_io(a.layer_idx, phase)  # [S, ...] each
        # per-row checkpoints: one-slot blocks only
        ck = state.row_ckpt(a.layer_idx) if n > 1 and b["slots"].numel() == 1 else None
        cv = gdn_conv.conv_rows(mixed, c_in, a.conv1d.weight[:, 0, :].contiguous(), n, ck and ck[0], c_out, **b)
        o = gdn.gdn_rows(
            cv,
            beta,
            alpha,
            z,
            a.A_log,
            a.dt_bias,
            a.norm.weight,
            r_in,
            n,
            nk=a.nk,
            eps=a.norm.eps,
            ckpt=ck and ck[1],
            S_out=r_out,
            quant=quant,
            **b,
        )
        return rows_linear(a.out_proj, o, live, partial)

    def _attn(
        self,
        a: Attention,
        proj,
        state,
        n: int,
        pos,
        b: dict,
        live: int,
        rope_offset: int = 0,
        partial: bool = False,
    ) -> torch.Tensor:
        """b: slots / gs of the groups (see forward); live: the rows the GEMM computes."""
        qg, k, v = proj
        W, nh, nkv, d = qg.shape[0], a.nh, a.nkv, a.d
        qg = qg.view(W, nh, 2 * d)
        kc, vc = state.kv(a.layer_idx)  # page pools [P + 1, nkv, PAGE, d], read through the page table
        b = dict(b, table=state.pages.table)
        q = attn.qk_rope_kv(
            qg[..., :d],
            k.view(W, nkv, d),
            v.view(W, nkv, d),
            a.q_norm.weight,
            a.k_norm.weight,
            self.cos,
            self.sin,
            pos,
            kc,
            vc,
            n,
            a.q_norm.eps,
            rope_offset,
            **b,
        )  # KV rows of the live rows written
        o = attn.attention_rows(q, kc, vc, pos, qg[..., d:], n, scratch=state.attn_scratch, **b)  # [W, nh*d], gated
        return rows_linear(a.o_proj, o, live, partial)


def _all_fp8(model: Qwen3_5ForCausalLM, fr: FastRows) -> type | None:
    """FastRows.w8a8: every decoder layer's projections are FP8 (one class, returned) and each norm
    output feeds one merged GEMM; else None."""
    mods = []
    for layer, mixer, gu in zip(model.model.layers, fr.mixer, fr.gate_up):
        a = getattr(layer, "linear_attn", None)
        mods += [a.out_proj if a is not None else layer.self_attn.o_proj, layer.mlp.down_proj, gu.module]
        if len(mixer) != 1 or not gu.glu:
            return None
        mods.append(mixer[0].module)
    kinds = {type(m) for m in mods}
    return kinds.pop() if len(kinds) == 1 and hasattr(mods[0], "scale") else None


def _bf16_partial(model: Qwen3_5ForCausalLM) -> bool:
    """FastRows.bf16_partial: every out_proj / o_proj / down is a bf16 Linear that rows_linear runs in
    the rows kernel (a gemv.TUNED shape), so each can hand its split-K partials to the next norm."""
    for layer in model.model.layers:
        a = getattr(layer, "linear_attn", None)
        for m in (a.out_proj if a is not None else layer.self_attn.o_proj, layer.mlp.down_proj):
            if (
                type(m) is not nn.Linear
                or m.weight.dtype != torch.bfloat16
                or (False, *m.weight.shape) not in gemv.TUNED
            ):
                return False
    return True


def usable(model: nn.Module) -> bool:
    """The fused path runs on CUDA (Triton kernels) for the dense Qwen3.5 model."""
    return rk is not None and next(model.parameters()).is_cuda and isinstance(model, Qwen3_5ForCausalLM)
