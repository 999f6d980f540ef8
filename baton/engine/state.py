"""HybridState: the static, slot-indexed decode state of a hybrid GDN / attention model.

Layout (S = slots, fixed at construction; every buffer is allocated once and never replaced, so
captured CUDA graphs stay valid):
    conv[layer]      [S, conv_dim, KW-1]      activation dtype   (GDN layers)
    recurrent[layer] [S, Hv, dk, dv]         fp32               (GDN layers)
    key/value[layer] [P + 1, kv_heads, PAGE, head_dim]  activation dtype (attention layers and the MTP
                     layer): one pool of KV pages per layer, shared by the slots through one page table
                     pages.table [S, max_pages] int32 (baton/engine/pages.py: PagePool, its lifecycle);
                     a slot's KV row pos is in page table[slot, pos // PAGE] at pos % PAGE
    position         [S] int64   tokens consumed by the slot
    next_token       [S] int64   the token to feed next (not yet consumed)
    hidden           [S, hidden] last final-normed hidden row (MTP input)
    row checkpoints (optional, `ckpt_rows=W`; one set shared by all slots: a one-slot multi-row pass
    writes them, under the engine's compute lock), so a verify block that accepts m < K drafts rewinds
    to row m by copying (`rewind_rows`), not by a snapshot restore and a recompute of m+1 rows:
    ckpt_conv[layer] [W, conv_dim, KW-1]     conv state after row t of the last multi-row pass
    ckpt_rec[layer]  [W, Hv, dk, dv] fp32   recurrent state after row t of the last multi-row pass
Snapshots: one buffer set like the O(1) part; snapshot / restore one slot, snapshot_slots / restore_slots
many at once (a batched verify: speculation.verify_blocks).

Ping-pong buffers (optional, `enable_pingpong()`; the decode worker's pipelined AR loop):
    conv_alt[layer], rec_alt[layer]  same layout as conv / recurrent
    hidden_prev      [S, hidden]     hidden before the last AR step
A phase-p AR step reads the GDN state from one set and writes it advanced into the other (phase 0:
main -> alt, phase 1: alt -> main), so the step before it stays intact: a step launched ahead and not
wanted (the token before it was a stop) is undone by `undo_step`, and `settle` moves the state back
into the main buffers. Between decode calls the state is always in the main buffers.

Invariant: KV rows at positions >= position[slot] are never read unmasked, so a rollback only has to
restore the O(1) part (GDN tensors and scalars); the stale KV rows are overwritten before use.
KV is written only at positions the slot's pages cover (reserve(), before any work of a request).

Export yields the O(1) GDN tensors plus KV rows [0, position) only, KV as [kv_heads, position, head_dim]
(gathered from the slot's pages: the wire format of the contiguous window); import writes such a state
into this object's preallocated buffers (KV scattered into the slot's pages: PagedRows).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from baton.config import ModelConfig
from baton.engine.pages import PAGE, PagedRows, PagedSource, PagePool, pages_for, rows_of
from baton.transfer import upload

# state tensor kinds (mirrors baton.v1.TensorKind)
GDN_CONV, GDN_RECURRENT, ATTN_KEY, ATTN_VALUE, HIDDEN = "gdn_conv", "gdn_recurrent", "attn_key", "attn_value", "hidden"


@dataclass(frozen=True)
class StateTensor:
    name: str
    kind: str
    tensor: torch.Tensor  # a view into the state (GDN, hidden) or a gathered copy (KV); lazy: a meta tensor
    gather: Callable[[], torch.Tensor] | None = None  # lazy KV (export(lazy=True)): gathers the rows when called
    paged: Callable[[], PagedSource] | None = None  # lazy KV: the rows read in place from the slot's pages

    def materialize(self) -> torch.Tensor:
        return self.tensor if self.gather is None else self.gather()


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
        kv_pages: int | None = None,
    ):
        """kv_pages: pages of PAGE keys in each attention layer's pool (None: slots x the window, so every
        slot can hold a full window, as the contiguous layout did)."""
        self.cfg, self.slots, self.max_len, self.dtype = cfg, slots, max_len, dtype
        self.mtp_layer = cfg.num_hidden_layers if mtp else None  # the MTP layer's KV index
        self.device = torch.device(device)
        z = lambda *shape, dt=dtype: torch.zeros(*shape, dtype=dt, device=self.device)  # noqa: E731
        KW = cfg.linear_conv_kernel_dim
        rec = (cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)  # [Hv, dk, dv]
        self.conv = {i: z(slots, cfg.conv_dim, KW - 1) for i in cfg.gdn_layers}
        self.recurrent = {i: z(slots, *rec, dt=torch.float32) for i in cfg.gdn_layers}
        max_pages = pages_for(max_len)
        self.pages = PagePool(kv_pages or slots * max_pages, slots, max_pages, self.device)
        kv_shape = (self.pages.pages + 1, cfg.num_key_value_heads, PAGE, cfg.head_dim)  # + the sink page
        self.attn_ids = cfg.attn_layers + ((self.mtp_layer,) if mtp else ())
        self.key = {i: z(*kv_shape) for i in self.attn_ids}
        self.value = {i: z(*kv_shape) for i in self.attn_ids}
        self.position = z(slots, dt=torch.int64)
        self.next_token = z(slots, dt=torch.int64)
        self.hidden = z(slots, cfg.hidden_size)
        self.ckpt_conv = {i: z(ckpt_rows, cfg.conv_dim, KW - 1) for i in cfg.gdn_layers} if ckpt_rows else {}
        self.ckpt_rec = {i: z(ckpt_rows, *rec, dt=torch.float32) for i in cfg.gdn_layers} if ckpt_rows else {}
        # snapshot buffers for the O(1) part, same layout
        self._snap = {k: torch.zeros_like(t) for k, t in self._o1_items()}
        self.slot_copies = None  # SlotCopies (enable_slot_copies): snapshot_slots as graph replays
        self.conv_alt, self.rec_alt = {}, {}  # {layer: [S, ...]} ping-pong GDN buffers (enable_pingpong)
        self.attn_scratch: torch.Tensor | None = None  # the attention's partials on CUDA (kernels/split_scratch.py)
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
        """The layer's page pools (key, value), [P + 1, kv_heads, PAGE, head_dim] each."""
        return self.key[layer], self.value[layer]

    def slot_kv(self, layer: int, slot: int, length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The slot's KV rows [0, length) (None: the whole window, max_len) gathered from its pages through
        the device table (no host sync) -> key, value [kv_heads, length, head_dim], contiguous: the values
        the contiguous window held (rows past the slot's pages read the sink: only ever read masked)."""
        return self.slot_rows(self.key[layer], slot, length), self.slot_rows(self.value[layer], slot, length)

    def slot_rows(self, pool: torch.Tensor, slot: int, length: int | None = None) -> torch.Tensor:
        """One pool's rows [0, length) of the slot (slot_kv's key or value alone) [kv_heads, length, head_dim]."""
        n = self.max_len if length is None else int(length)
        g = pool.index_select(0, self.pages.table[slot, : pages_for(n)].long())  # [k, nkv, PAGE, d]
        return g.transpose(0, 1).reshape(g.shape[1], -1, g.shape[3])[:, :n].contiguous()

    def slots_kv(self, layer: int, slots: list[int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """slot_kv of several slots at one length, each pool in one gather -> key, value [b, kv_heads, length,
        head_dim] (pages.rows_of: the slots' pages from the host, not the device table)."""
        owned = [self.pages.owned(s) for s in slots]
        return rows_of(self.key[layer], owned, length), rows_of(self.value[layer], owned, length)

    def write_kv(self, layer: int, slot, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """KV rows pos [n] (device int64) := k, v [n, kv_heads, head_dim], through the table: of `slot` (an
        int), or row i of slot[i] (a device int64 [n]: a prefill pass's rows, one write a layer)."""
        page = self.pages.table[slot, pos // PAGE].long()  # [n]
        off = pos % PAGE
        self.key[layer][page, :, off] = k
        self.value[layer][page, :, off] = v

    def reserve(self, slot: int, tokens: int, zero: bool = True) -> list[int]:
        """The slot's pages cover positions [0, tokens) (PagePool.ensure: all or none, PagesExhausted);
        new pages are zeroed on the current stream (zero=False: the caller overwrites or zeroes them)
        -> the pages added."""
        new = self.pages.ensure(slot, tokens)
        if new and zero:
            self._zero_pages(new)
        return new

    def release_pages(self, slot: int) -> int:
        """Every page of the slot back to the free list (an end of its session); -> how many."""
        return self.pages.free(slot)

    def _zero_pages(self, pages: list[int]) -> None:
        idx = upload(pages, torch.long, self.device)
        for i in self.attn_ids:
            self.key[i].index_fill_(0, idx, 0)
            self.value[i].index_fill_(0, idx, 0)

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

    def snapshot_slots(self, slots: list[int], restore: bool = False) -> None:
        """snapshot(s) (restore=True: restore(s)) of distinct slots in two kernels a tensor whatever their
        count (a loop of snapshot() is one copy a tensor and slot: 51 a slot at the 9B shape); with slot
        copies enabled (CUDA graphs: baton/engine/slot_copies.py) one graph replay a bucket of slots."""
        if len(set(slots)) != len(slots):
            raise ValueError(f"snapshot / restore of slots: distinct slots, got {slots}")
        if not slots:
            return
        if self.slot_copies is not None:
            self.slot_copies.run(list(slots), restore)
        else:
            self.copy_slots(upload(slots, torch.long, self.device), restore)

    def copy_slots(self, idx: torch.Tensor, restore: bool, copy=None) -> None:
        """The slots in idx [n] (device; a duplicate copies its row again), every O(1) tensor: state ->
        snapshot set, or back (restore). Capturable. copy(src, dst, idx): how (SlotCopies passes
        baton/kernels/copy_rows.py on CUDA: rows in place, no temporary). Exact copies: no arithmetic."""
        for k, t in self._o1_items():
            src, dst = (self._snap[k], t) if restore else (t, self._snap[k])
            copy(src, dst, idx) if copy is not None else dst.index_copy_(0, idx, src.index_select(0, idx))

    def enable_slot_copies(self, top: int):
        """snapshot_slots / restore_slots through SlotCopies (buckets up to `top` slots); -> it (capture
        it on CUDA: graph.capture_all does)."""
        from baton.engine.slot_copies import SlotCopies

        self.slot_copies = SlotCopies(self, top)
        return self.slot_copies

    def restore_slots(self, slots: list[int]) -> None:
        self.snapshot_slots(slots, restore=True)

    def reset(self, slot: int) -> None:
        """Zero a slot (GDN state, scalars and the KV rows of its pages; the pages stay its own)."""
        self.reset_slots([slot])

    def reset_slots(self, slots: list[int], pages: list[int] = ()) -> None:
        """reset() of each of `slots`, and the KV rows of `pages` zeroed too: one launch a state tensor for
        all of them (~70 a slot one by one at the 9B shape: a prefill pass of 16 fresh prompts made ~1,100).
        Zeros are zeros: bitwise what reset() of each slot leaves."""
        if slots:
            idx = upload(list(slots), torch.long, self.device)
            for _, t in self._o1_items():
                t.index_fill_(0, idx, 0)
        own = [p for s in slots for p in self.pages.owned(s)] + list(pages)
        if own:
            self._zero_pages(own)

    def zero_kv_rows(self, slot: int, start: int, end: int) -> None:
        """Zero the KV rows [start, end) that the slot's pages hold."""
        full = []
        for j, page in enumerate(self.pages.owned(slot)):
            a, b = max(start, j * PAGE), min(end, (j + 1) * PAGE)
            if a >= b:
                continue
            if b - a == PAGE:
                full.append(page)
                continue
            for i in self.attn_ids:
                self.key[i][page, :, a - j * PAGE : b - j * PAGE].zero_()
                self.value[i][page, :, a - j * PAGE : b - j * PAGE].zero_()
        if full:
            self._zero_pages(full)

    # ---- sizes ---------------------------------------------------------------------------------
    def kv_bytes_per_token(self) -> int:
        c = self.cfg
        return 2 * len(c.attn_layers) * c.num_key_value_heads * c.head_dim * self.key_itemsize()

    def key_itemsize(self) -> int:
        return torch.empty(0, dtype=self.dtype).element_size()

    def page_bytes(self) -> int:
        """Bytes of one page across every attention layer's key and value pools (the MTP layer's included)."""
        return sum(2 * t[0].numel() * t.element_size() for t in self.key.values())

    def slot_bytes(self) -> int:
        """Bytes one slot may hold: its O(1) state and the pages of a full window."""
        return self.o1_slot_bytes() + self.pages.max_pages * self.page_bytes()

    def o1_slot_bytes(self) -> int:
        """Bytes of one slot's O(1) state (GDN conv / recurrent, hidden, ...)."""
        return sum(t[0].numel() * t.element_size() for _, t in self._o1_items())

    def held_bytes(self, slot: int) -> int:
        """Bytes the slot holds now: its O(1) state and the KV pages it owns (WorkerStats.session_bytes)."""
        return self.o1_slot_bytes() + len(self.pages.owned(slot)) * self.page_bytes()

    def items_all(self):
        """Every buffer (the O(1) tensors, [S, ...], then the KV page pools and the page table)."""
        yield from self._o1_items()
        for i in self.attn_ids:
            yield f"key.{i}", self.key[i]
            yield f"value.{i}", self.value[i]
        yield "page_table", self.pages.table

    # ---- export / import -----------------------------------------------------------------------
    def _kv_tensors(self, names: tuple[str, str], layer: int, slot: int, p: int, lazy: bool) -> list[StateTensor]:
        if not lazy:
            k, v = self.slot_kv(layer, slot, p)
            return [StateTensor(names[0], ATTN_KEY, k), StateTensor(names[1], ATTN_VALUE, v)]
        meta = torch.empty(self.cfg.num_key_value_heads, p, self.cfg.head_dim, dtype=self.dtype, device="meta")
        out = []  # gather: the rows it ships; paged: the same read in place (its pages taken once final)
        for name, kind, pool in zip(names, (ATTN_KEY, ATTN_VALUE), (self.key[layer], self.value[layer])):
            paged = lambda pool=pool: PagedSource(pool, self.pages.owned(slot), p)  # noqa: E731
            out.append(StateTensor(name, kind, meta, lambda pool=pool: self.slot_rows(pool, slot, p), paged))
        return out

    def export(self, slot: int, position: int | None = None, *, lazy: bool = False) -> list[StateTensor]:
        """Tensors describing one slot, in the order prefill finishes them (the wire's table order):
        per layer its O(1) GDN tensors or KV rows [0, position) [kv_heads, position, head_dim], then the
        hidden row, then the MTP KV. GDN / hidden are views, KV is gathered from the pages now (a device
        copy) or, lazy=True (a prefill not run yet: the sender pulls each tensor once its layer is final),
        on StateTensor.materialize(). The caller copies them off the device."""
        p = int(self.position[slot]) if position is None else position
        out: list[StateTensor] = []
        for i in range(self.cfg.num_hidden_layers):
            if i in self.conv:
                out.append(StateTensor(f"layers.{i}.conv", GDN_CONV, self.conv[i][slot]))
                out.append(StateTensor(f"layers.{i}.recurrent", GDN_RECURRENT, self.recurrent[i][slot]))
            else:
                out += self._kv_tensors((f"layers.{i}.key", f"layers.{i}.value"), i, slot, p, lazy)
        out.append(StateTensor("hidden", HIDDEN, self.hidden[slot]))
        if self.mtp_layer is not None:  # MTP pairs (h_t, x_{t+1}) for t < position: computed last
            out += self._kv_tensors(("mtp.key", "mtp.value"), self.mtp_layer, slot, p, lazy)
        return out

    def layout(self) -> dict[str, tuple[str, torch.dtype, tuple[int, ...] | None]]:
        """name -> (kind, dtype, fixed shape or None for KV rows [kv_heads, position, head_dim])."""
        out = {}
        for t in self.export(0, position=0, lazy=True):
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

    def import_views(self, slot: int, position: int) -> dict[str, torch.Tensor | PagedRows]:
        """name -> where an imported tensor of that name is copied into (`.copy_(src, non_blocking)`):
        a view of `slot` (GDN, hidden) or its pages (KV: PagedRows); a state may be placed tensor by tensor,
        then finish_import. Reserves the slot's pages for [0, position + 1) first (PagesExhausted), not
        zeroed: every row below position is overwritten, finish_import zeroes the rest."""
        if position > self.max_len:
            raise ValueError(f"position {position} exceeds the window max_len={self.max_len}")
        self.reserve(slot, min(position + 1, self.max_len), zero=False)
        own = self.pages.owned(slot)
        out: dict[str, torch.Tensor | PagedRows] = {}
        shared: dict = {}  # the slot's page ids on the device, uploaded once for every KV tensor
        for t in self.export(slot, position=position, lazy=True):
            if t.gather is None:
                out[t.name] = t.tensor
            else:
                layer = self.mtp_layer if t.name.startswith("mtp.") else int(t.name.split(".")[1])
                pool = (self.key if t.kind == ATTN_KEY else self.value)[layer]
                out[t.name] = PagedRows(pool, own, position, shared)
        return out

    def finish_import(self, slot: int, *, position: int, next_token: int) -> None:
        """After every tensor of import_views was copied in: zero the KV rows past position (in the slot's
        pages), set the scalars."""
        self.zero_kv_rows(slot, position, self.pages.capacity(slot))
        # fill_: kernels on the stream the steps run on, not blocking copies that wait for every step already
        # queued (a decode worker commits a hand-off under its compute lock: the steps would stall behind it)
        self.position[slot].fill_(position)
        self.next_token[slot].fill_(next_token)
