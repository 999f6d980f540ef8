"""HybridState: the static, slot-indexed decode state of a hybrid GDN / attention model.

Layout (S = slots, fixed at construction; every buffer is allocated once and never replaced, so
captured CUDA graphs stay valid):
    conv[layer]      [S, conv_dim, KW-1]      activation dtype   (GDN layers)
    recurrent[layer] [S, Hv, dk, dv]         fp32               (GDN layers)
    key/value[layer] [S, kv_heads, max_len, head_dim]  activation dtype (attention layers)
    position         [S] int64   tokens consumed by the slot
    next_token       [S] int64   the token to feed next (not yet consumed)
    hidden           [S, hidden] last final-normed hidden row (MTP input)
    row checkpoints (optional, `ckpt_rows=W`; one set shared by all slots: rows passes run one at a
    time under the engine's compute lock):
    ckpt_conv[layer] [W, conv_dim, KW-1]     conv state after row t of the last multi-row pass
    ckpt_rec[layer]  [W, Hv, dk, dv] fp32   recurrent state after row t of the last multi-row pass
    (single-row passes, i.e. AR steps, write none: nothing can cut a one-row block)
    so a verify block that accepts m < K drafts rewinds to row m by copying, instead of restoring the
    snapshot and recomputing m+1 rows (`rewind_rows`).

Ping-pong buffers (optional, `enable_pingpong()`; the decode worker's pipelined AR loop):
    conv_alt[layer], rec_alt[layer]  same layout as conv / recurrent
    hidden_prev      [S, hidden]     hidden before the last AR step
A phase-p AR step reads the GDN state from one set and writes it advanced into the other (phase 0:
main -> alt, phase 1: alt -> main), so the step before it stays intact: a step launched ahead and not
wanted (the token before it was a stop) is undone by `undo_step`, and `settle` moves the state back
into the main buffers. Between decode calls the state is always in the main buffers.

Invariant: KV rows at positions >= position[slot] are never read unmasked, so a rollback only has to
restore the O(1) part (GDN tensors and scalars); the stale KV rows are overwritten before use.

Export yields the O(1) GDN tensors plus KV rows [0, position) only; import writes such a state into
this object's preallocated buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from baton.config import ModelConfig

# state tensor kinds (mirrors baton.v1.TensorKind)
GDN_CONV, GDN_RECURRENT, ATTN_KEY, ATTN_VALUE, HIDDEN = "gdn_conv", "gdn_recurrent", "attn_key", "attn_value", "hidden"


@dataclass(frozen=True)
class StateTensor:
    name: str
    kind: str
    tensor: torch.Tensor  # a view into the state (no copy)


class HybridState:
    def __init__(
        self,
        cfg: ModelConfig,
        *,
        slots: int,
        max_len: int,
        dtype: torch.dtype,
        device,
        mtp: bool = False,
        ckpt_rows: int = 0,
    ):
        self.cfg, self.slots, self.max_len, self.dtype = cfg, slots, max_len, dtype
        self.mtp_layer = cfg.num_hidden_layers if mtp else None  # the MTP layer's KV index
        self.device = torch.device(device)
        z = lambda *shape, dt=dtype: torch.zeros(*shape, dtype=dt, device=self.device)  # noqa: E731
        KW = cfg.linear_conv_kernel_dim
        self.conv = {i: z(slots, cfg.conv_dim, KW - 1) for i in cfg.gdn_layers}
        self.recurrent = {
            i: z(
                slots, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim, dt=torch.float32
            )
            for i in cfg.gdn_layers
        }
        kv_shape = (slots, cfg.num_key_value_heads, max_len, cfg.head_dim)
        self.attn_ids = cfg.attn_layers + ((self.mtp_layer,) if mtp else ())
        self.key = {i: z(*kv_shape) for i in self.attn_ids}
        self.value = {i: z(*kv_shape) for i in self.attn_ids}
        self.position = z(slots, dt=torch.int64)
        self.next_token = z(slots, dt=torch.int64)
        self.hidden = z(slots, cfg.hidden_size)
        self.ckpt_conv = {i: z(ckpt_rows, cfg.conv_dim, KW - 1) for i in cfg.gdn_layers} if ckpt_rows else {}
        self.ckpt_rec = (
            {
                i: z(
                    ckpt_rows,
                    cfg.linear_num_value_heads,
                    cfg.linear_key_head_dim,
                    cfg.linear_value_head_dim,
                    dt=torch.float32,
                )
                for i in cfg.gdn_layers
            }
            if ckpt_rows
            else {}
        )
        # snapshot buffers for the O(1) part, same layout
        self._snap = {k: torch.zeros_like(t) for k, t in self._o1_items()}
        self.conv_alt: dict[int, torch.Tensor] = {}
        self.rec_alt: dict[int, torch.Tensor] = {}
        self.hidden_prev: torch.Tensor | None = None

    def enable_pingpong(self) -> None:
        """Allocates the ping-pong buffers (once; a captured graph may point at them)."""
        if self.hidden_prev is None:
            self.conv_alt = {i: torch.zeros_like(t) for i, t in self.conv.items()}
            self.rec_alt = {i: torch.zeros_like(t) for i, t in self.recurrent.items()}
            self.hidden_prev = torch.zeros_like(self.hidden)

    @property
    def pingpong(self) -> bool:
        return self.hidden_prev is not None

    def gdn_io(self, layer: int, phase: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(conv_in, conv_out, rec_in, rec_out) [S, ...] of a GDN layer for a step of `phase`
        (None: in place, the main buffers both ways)."""
        main, alt = (self.conv[layer], self.recurrent[layer]), (self.conv_alt.get(layer), self.rec_alt.get(layer))
        if phase is None:
            src = dst = main
        else:
            assert self.pingpong, "enable_pingpong() first"
            src, dst = (main, alt) if phase == 0 else (alt, main)
        return src[0], dst[0], src[1], dst[1]

    def _alt_to_main(self, slot: int) -> None:
        for i in self.cfg.gdn_layers:
            self.conv[i][slot].copy_(self.conv_alt[i][slot])
            self.recurrent[i][slot].copy_(self.rec_alt[i][slot])

    def settle(self, slot: int, last_phase: int | None) -> None:
        """After AR steps whose last kept one had `last_phase`: the GDN state back in the main buffers."""
        if last_phase == 0:
            self._alt_to_main(slot)

    def undo_step(self, slot: int, phase: int, token: int) -> None:
        """Undo the last AR step (of `phase`; it consumed `token`): GDN state, position, next_token and
        hidden as before it, the state left in the main buffers. Its KV row (at the old position) is
        past the position again, so never read unmasked."""
        if phase == 1:  # it read alt: the state before it is there
            self._alt_to_main(slot)
        self.position[slot] -= 1
        self.next_token[slot] = token
        self.hidden[slot].copy_(self.hidden_prev[slot])

    # ---- accessors used by the model ----------------------------------------------------------
    def gdn(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.conv[layer], self.recurrent[layer]

    def kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.key[layer], self.value[layer]

    def row_ckpt(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(ckpt_conv [W, C, KW-1], ckpt_rec [W, Hv, dk, dv]) of a GDN layer, or None when not kept."""
        return (self.ckpt_conv[layer], self.ckpt_rec[layer]) if self.ckpt_conv else None

    def rewind_rows(self, slot: int, row: int) -> None:
        """GDN conv + recurrent state of `slot` := the checkpoint after `row` of the last rows pass
        (the caller sets position, hidden and next_token)."""
        for i in self.cfg.gdn_layers:
            self.conv[i][slot].copy_(self.ckpt_conv[i][row])
            self.recurrent[i][slot].copy_(self.ckpt_rec[i][row])

    def _o1_items(self):
        for i in self.cfg.gdn_layers:
            yield f"conv.{i}", self.conv[i]
            yield f"rec.{i}", self.recurrent[i]
        yield "position", self.position
        yield "next_token", self.next_token
        yield "hidden", self.hidden

    # ---- snapshot / restore (no allocation: copies between fixed buffers) ------------------------
    def snapshot(self, slot: int) -> None:
        for k, t in self._o1_items():
            self._snap[k][slot].copy_(t[slot])

    def restore(self, slot: int) -> None:
        for k, t in self._o1_items():
            t[slot].copy_(self._snap[k][slot])

    def reset(self, slot: int) -> None:
        """Zero a slot (GDN state, scalars and its KV rows)."""
        for _, t in self._o1_items():
            t[slot].zero_()
        for i in self.attn_ids:
            self.key[i][slot].zero_()
            self.value[i][slot].zero_()

    def zero_kv_rows(self, slot: int, start: int, end: int) -> None:
        for i in self.attn_ids:
            self.key[i][slot, :, start:end].zero_()
            self.value[i][slot, :, start:end].zero_()

    # ---- sizes ---------------------------------------------------------------------------------
    def kv_bytes_per_token(self) -> int:
        c = self.cfg
        return 2 * len(c.attn_layers) * c.num_key_value_heads * c.head_dim * self.key_itemsize()

    def key_itemsize(self) -> int:
        return torch.empty(0, dtype=self.dtype).element_size()

    def slot_bytes(self) -> int:
        """Bytes one slot holds (its full KV window included)."""
        return sum(t[0].numel() * t.element_size() for _, t in self.items_all())

    def items_all(self):
        yield from self._o1_items()
        for i in self.attn_ids:
            yield f"key.{i}", self.key[i]
            yield f"value.{i}", self.value[i]

    # ---- export / import -----------------------------------------------------------------------
    def export(self, slot: int, position: int | None = None) -> list[StateTensor]:
        """Tensors describing one slot, in the order prefill finishes them (the wire's table order):
        per layer its O(1) GDN tensors or KV rows [0, position), then the hidden row, then the MTP KV.
        Returns views; the caller copies them off the device."""
        p = int(self.position[slot]) if position is None else position
        out: list[StateTensor] = []
        for i in range(self.cfg.num_hidden_layers):
            if i in self.conv:
                out.append(StateTensor(f"layers.{i}.conv", GDN_CONV, self.conv[i][slot]))
                out.append(StateTensor(f"layers.{i}.recurrent", GDN_RECURRENT, self.recurrent[i][slot]))
            else:
                out.append(StateTensor(f"layers.{i}.key", ATTN_KEY, self.key[i][slot, :, :p]))
                out.append(StateTensor(f"layers.{i}.value", ATTN_VALUE, self.value[i][slot, :, :p]))
        out.append(StateTensor("hidden", HIDDEN, self.hidden[slot]))
        if self.mtp_layer is not None:  # MTP pairs (h_t, x_{t+1}) for t < position: computed last
            out.append(StateTensor("mtp.key", ATTN_KEY, self.key[self.mtp_layer][slot, :, :p]))
            out.append(StateTensor("mtp.value", ATTN_VALUE, self.value[self.mtp_layer][slot, :, :p]))
        return out

    def layout(self) -> dict[str, tuple[str, torch.dtype, tuple[int, ...] | None]]:
        """name -> (kind, dtype, fixed shape or None for KV rows [kv_heads, position, head_dim])."""
        out = {}
        for t in self.export(0, position=0):
            fixed = None if t.kind in (ATTN_KEY, ATTN_VALUE) else tuple(t.tensor.shape)
            out[t.name] = (t.kind, t.tensor.dtype, fixed)
        return out

    def import_(self, slot: int, tensors: dict[str, torch.Tensor], *, position: int, next_token: int) -> None:
        """Write a verified exported state into `slot`. `tensors` must match `layout()` exactly
        (the wire layer checks that before calling)."""
        views = self.import_views(slot, position)
        for name, dst in views.items():
            dst.copy_(tensors[name], non_blocking=True)
        self.finish_import(slot, position=position, next_token=next_token)

    def import_views(self, slot: int, position: int) -> dict[str, torch.Tensor]:
        """name -> the view of `slot` that an imported tensor of that name is copied into
        (a state may be placed tensor by tensor, then finish_import)."""
        if position > self.max_len:
            raise ValueError(f"position {position} exceeds the window max_len={self.max_len}")
        return {t.name: t.tensor for t in self.export(slot, position=position)}

    def finish_import(self, slot: int, *, position: int, next_token: int) -> None:
        """After every tensor of import_views was copied in: zero the KV rows past position, set the scalars."""
        self.zero_kv_rows(slot, position, self.max_len)
        self.position[slot] = position
        self.next_token[slot] = next_token
