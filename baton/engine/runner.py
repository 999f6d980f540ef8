"""ModelRunner: a model plus its static HybridState, with the two compute paths every engine uses.

    prefill(slot, ids)      wide kernels over the prompt; sets position, next_token, hidden
    rows(slot, tokens)      n <= W decode-time rows at fixed width W (AR step: n=1, verify: n=K+1)
    rows_batch(groups)      rows of several slots in one eager step, [(slot, tokens), ...]; each slot
                            bitwise as rows(slot, tokens) alone (baton/engine/batch.py)
    ar_step(slot)           one AR row fed from next_token on the device (the decode worker's fast path)
    ar_launch / ar_collect  the same, pipelined (pipeline=True): a step is launched before the previous
                            step's token is read; GDN state ping-pongs (HybridState.gdn_io) so an
                            unwanted step can be undone (HybridState.undo_step)
Three layers of names: compute_rows / compute_ar / compute_mtp are the pure tensor code on static
buffers (what a CUDA graph captures); replay_rows / replay_mtp run the captured graph of (kind, slot, n)
if there is one (graphs are keyed (kind, n) and read the slot from the device: `select`), else that code; rows / ar_step / ar_launch are the host API (tokens in, tokens out).

Rows computed at width W are bitwise independent of n (see baton/models/qwen3_5.py), which is what
makes verification and MTP speculation exact. The decode worker replays `rows` from CUDA graphs
(baton/engine/graph.py); this class is the eager reference and the CPU path.
"""

from __future__ import annotations

import torch

from baton.engine import batch, fast_rows, nogil
from baton.engine.prefill import PREFILL_CHUNK, prefill_pieces, run_pass
from baton.engine.sampling import SamplingTable
from baton.engine.state import HybridState
from baton.models.qwen3_5 import Qwen3_5ForCausalLM, StepContext
from baton.transfer import upload

DEFAULT_WIDTH = 16
DEFAULT_MAX_LEN = 4096  # window; part of the exactness contract: workers and `complete` must agree


class WindowError(ValueError):
    """A request does not fit the engine's window (prompt + new tokens + speculation rows)."""


class ModelRunner:
    def __init__(
        self,
        model: Qwen3_5ForCausalLM,
        *,
        slots: int = 1,
        max_len: int = DEFAULT_MAX_LEN,
        width: int = DEFAULT_WIDTH,
        dtype: torch.dtype | None = None,
        fast: bool | None = None,
        checkpoints: bool = False,
        pipeline: bool = False,
        kv_pages: int | None = None,
    ):
        """fast: use the fused rows kernels (baton/engine/fast_rows.py); None = on CUDA. Every runner
        that must agree bitwise (exact engine, decode engines) must make the same choice.
        checkpoints: keep per-row GDN checkpoints so a rejected verify block rewinds by copying
        (`rewind`) instead of recomputing; costs W x the GDN state of one slot.
        pipeline: ping-pong GDN buffers for ar_launch / ar_collect; costs 1 x the GDN state per slot.
        kv_pages: the attention KV pool's pages (baton/engine/pages.py; None: slots x the window).
        max_len: the per-request window (the page table's width), at most the model's max_position_embeddings."""
        if max_len > model.cfg.max_position_embeddings:
            raise ValueError(
                f"max_len: {max_len} exceeds the model's max_position_embeddings {model.cfg.max_position_embeddings}"
            )
        p = next(model.parameters())
        self.model, self.cfg = model, model.cfg
        self.device, self.dtype = p.device, dtype or p.dtype
        self.width, self.max_len = width, max_len
        self.prefill_chunk = PREFILL_CHUNK  # a prompt runs as pieces of this many tokens (baton/engine/prefill.py)
        self.has_mtp = hasattr(model, "mtp")
        self.state = HybridState(
            self.cfg,
            slots=slots,
            max_len=max_len,
            dtype=self.dtype,
            device=self.device,
            mtp=self.has_mtp,
            ckpt_rows=width if checkpoints else 0,
            kv_pages=kv_pages,
        )
        # Static step buffers: the eager path and captured CUDA graphs read and write these.
        W, H, dev = width, self.cfg.hidden_size, self.device
        self.ids_buf = torch.zeros(W, dtype=torch.long, device=dev)  # [W] row tokens
        self.tok_out = torch.zeros(W, dtype=torch.long, device=dev)  # [W] greedy next tokens
        self.h_rows = torch.zeros(W, H, dtype=self.dtype, device=dev)  # [W] final-normed hidden
        self.mtp_h = torch.zeros(W, H, dtype=self.dtype, device=dev)  # [W] MTP hidden inputs
        self.mtp_ids = torch.zeros(W, dtype=torch.long, device=dev)  # [W] MTP token inputs
        self.mtp_start = torch.zeros((), dtype=torch.long, device=dev)  # MTP KV index of row 0
        self.mtp_tok = torch.zeros(W, dtype=torch.long, device=dev)  # [W] MTP drafts
        self.mtp_out = torch.zeros(W, H, dtype=self.dtype, device=dev)  # [W] MTP normed outputs
        self.graphs: dict[tuple[str, int], object] = {}  # (kind, n) -> graph, for any slot
        # the slot a one-slot step works on, read on the device by every kernel and index op of the fused
        # path (so one graph serves every slot); set by `select` before each step, never inside a capture
        self.slot_buf = torch.zeros(1, dtype=torch.long, device=dev)
        if pipeline:
            self.state.enable_pingpong()
        pin = dev.type == "cuda"
        # [slot, phase] pipelined tokens: per slot, since sessions on other slots launch steps of the
        # same phase while one of this slot is unread (the engine's lock is released between steps)
        self._tok_host = torch.zeros(slots, 2, dtype=torch.long, pin_memory=pin)
        self._tok_ev = [[torch.cuda.Event() for _ in range(2)] for _ in range(slots)] if pin else None
        self.arange_w = torch.arange(W, device=dev)
        self.sampling = SamplingTable(
            slots, dev, W, max_len, self.cfg.vocab_size
        )  # per-slot sampling parameters, token history
        if fast is None:
            fast = fast_rows.usable(model)
        self.fast = fast_rows.FastRows.for_model(model, max_len + W + 1) if fast else None
        if self.fast is not None:  # the attention's partials: one buffer for every call (CUDA)
            from baton.kernels.split_scratch import runner_scratch

            self.state.attn_scratch = runner_scratch(dev, self.cfg, max_len)
        self.batched = None  # fused_batch.BatchedAR, made by enable_batching (fused runners)
        self.batched_rows = None  # fused_blocks.BatchedRows, made by enable_batching (fused runners)

    def enable_batching(self, max_rows: int | None = None) -> None:
        """Fused runners: build the bucketed batched AR step (baton/engine/fused_batch.py) and the batched
        rows blocks (baton/engine/fused_blocks.py: rows_batch, the batched verify) for up to max_rows
        sessions a step (default: every slot)."""
        from baton.engine.fused_batch import BatchedAR
        from baton.engine.fused_blocks import BatchedRows

        if self.fast is not None and self.batched is None:
            self.batched = BatchedAR(self, max_rows or self.state.slots)
            self.batched_rows = BatchedRows(self, max_rows or self.state.slots)

    def graph_for(self, key: tuple[str, int], slot: int):
        """The captured graph of `key`, or None: none captured, or `slot` samples / asks for logprobs
        (graphs are captured greedy; such a slot runs the same kernels eagerly, bitwise the same step)."""
        g = self.graphs.get(key)
        if g is not None and not self.sampling.plain(slot):
            return None
        return g

    def select(self, slot: int) -> None:
        """The slot of the next one-slot step (the device-side slot_buf; no host sync)."""
        self.slot_buf.fill_(slot)

    def check_window(self, prompt_len: int, new_tokens: int, extra_rows: int = 0) -> None:
        need = prompt_len + new_tokens + extra_rows
        if need > self.max_len:
            raise WindowError(
                f"prompt ({prompt_len}) + max_new_tokens ({new_tokens})"
                + (f" + speculation rows ({extra_rows})" if extra_rows else "")
                + f" = {need} exceeds the window of {self.max_len} tokens"
            )

    def reserve(self, slot: int, tokens: int, zero: bool = True) -> list[int]:
        """The slot's KV pages cover positions [0, tokens), tokens capped at the window (check_window first);
        raises PagesExhausted (RESOURCE_EXHAUSTED) with nothing changed when the pool is short. -> the pages
        added (zero=False: not zeroed yet, the caller zeroes them: HybridState.reset_slots)."""
        return self.state.reserve(slot, min(tokens, self.max_len), zero)

    def reserve_next(self, slots: list[int]) -> None:
        """Pages for the row each slot consumes next (ar_step / ar_batch called outside DecodeEngine.decode,
        which reserves a whole decode up front): one host read of the positions; the steps sync anyway.
        ar_launch (pipelined) reads nothing: its caller reserves first, as decode() does."""
        pos = self.state.position[upload(slots, torch.long, self.device)].tolist()
        for slot, p in zip(slots, pos):
            self.reserve(slot, p + 1)

    def check_ids(self, ids, field: str = "prompt") -> None:
        bad = [t for t in ids if not 0 <= int(t) < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"{field}: token id {bad[0]} out of range [0, {self.cfg.vocab_size})")

    # ---- prefill -------------------------------------------------------------------------------
    def prefill(self, slot: int, ids: list[int], start: int = 0, on_layer=None, mtp: bool = True) -> int:
        """Consumes ids at positions [start, start+T); returns the next token (greedy, or sampled by the
        slot's parameters at position start+T). The prompt runs as its pieces (baton/engine/prefill.py:
        cut every PREFILL_CHUNK tokens), each a pass of its own: bitwise what the same pieces compute
        inside any batched pass.
        on_layer(i): called once layer i's state writes are enqueued (StepContext.state_written), during
        the last piece. mtp=False skips the MTP layer's KV (~1/(layers+1) of the compute): the slot's MTP
        rows for [start, start+T) are then left as they were, for a session that will never read them."""
        if not ids:
            raise ValueError("prompt: empty")
        self.check_window(start + len(ids), 0)
        tok = None
        for p in prefill_pieces(self, slot, ids, start, on_layer=on_layer, mtp=mtp):
            tok = run_pass(self, [p])[0]
        return tok

    # ---- fixed-width rows ------------------------------------------------------------------------
    def pad_ids(self, tokens: list[int]) -> torch.Tensor:
        buf = torch.zeros(self.width, dtype=torch.long, device=self.device)
        buf[: len(tokens)].copy_(upload(tokens, torch.long, self.device))
        return buf

    def compute_rows(self, slot: int, n: int, phase: int | None = None) -> torch.Tensor:
        """ids_buf [W] (first n valid) -> tok_out [W] (picked by the slot's sampling parameters:
        greedy unless set), h_rows [W, h]; advances position by n and
        stores hidden row n-1. Pure tensor code on static buffers: this is what a CUDA graph captures.
        Returns logits [W, vocab] (tests compare them; graphs ignore them). phase: see ar_launch."""
        st, sb = self.state, self.slot_buf
        if self.fast is not None:  # the slot comes from slot_buf (select), on the device
            pos = st.position[sb] + self.arange_w  # [W], before the step advances it
            h = self.fast.forward(self.ids_buf, st, sb, n, pos, phase)
            logits = self.fast.head(h, rows=n)  # [W, vocab]; rows >= n junk
            st.position.index_copy_(0, sb, st.position[sb] + n)
            st.hidden.index_copy_(0, sb, h[n - 1 : n])
        else:
            pos = st.position[slot] + self.arange_w
            h = self.model(self.ids_buf, st, StepContext(slot=slot, width=self.width, n=n, phase=phase))
            logits = self.model.logits(h, rows=n)  # [W, vocab]; rows >= n junk
            st.hidden[slot].copy_(h[n - 1])
        self.sampling.history.record(sb.expand(n), pos[:n], self.ids_buf[:n])  # before the pick (penalties)
        if logits.is_cuda and torch.cuda.is_current_stream_capturing():
            self.tok_out.copy_(logits.argmax(-1))  # graphs are greedy; a sampled slot runs eagerly (graph_for)
        else:  # row i picks position pos+i+1
            self.tok_out.copy_(self.sampling.pick(logits, sb.expand(self.width), self.arange_w, pos + 1, (slot,)))
        self.h_rows.copy_(h)
        return logits

    def compute_ar(self, slot: int, phase: int | None = None) -> None:
        """One AR step fed on the device: next_token[slot] -> rows(n=1) -> next_token[slot] = greedy.
        The host reads tok_out[0] once per token and writes nothing. phase 0 / 1: a ping-pong step
        (GDN state main -> alt / alt -> main; hidden saved to hidden_prev first). The slot is slot_buf's
        (select(slot) first; the eager model also takes `slot`)."""
        st, sb = self.state, self.slot_buf
        self.ids_buf.zero_()
        self.ids_buf[:1].copy_(st.next_token[sb])
        if phase is not None:
            st.hidden_prev.index_copy_(0, sb, st.hidden[sb])
        self.compute_rows(slot, 1, phase)
        st.next_token.index_copy_(0, sb, self.tok_out[:1])

    def compute_mtp(self, slot: int, n: int) -> None:
        """MTP head over n pairs (mtp_h[i], mtp_ids[i]) at KV indexes mtp_start + i -> mtp_tok, mtp_out.
        mtp_tok[i] is picked as the exact model would pick the token at position mtp_start + i + 2 (the
        slot's sampling row: greedy, or seeded noise), so sampled drafts agree with the exact picks."""
        pos = self.mtp_start + self.arange_w
        if self.fast is not None:
            out = self.fast.mtp(self.mtp_h, self.mtp_ids, self.state, self.slot_buf, n, pos)
        else:
            out = self.model.mtp(
                self.model.model.embed_tokens,
                self.mtp_h,
                self.mtp_ids,
                pos,
                self.state,
                StepContext(slot=slot, width=self.width, n=n, rope_offset=1),
            )
        head = self.fast.head if self.fast is not None else self.model.logits
        logits = head(out, rows=n)
        sb = self.slot_buf if self.fast is not None else torch.full_like(self.slot_buf, slot)
        self.sampling.history.record(sb.expand(n), pos[:n] + 1, self.mtp_ids[:n])  # pair t's token is at t + 1
        if logits.is_cuda and torch.cuda.is_current_stream_capturing():
            self.mtp_tok.copy_(logits.argmax(-1))  # graphs are greedy (graph_for)
        else:  # a draft with the noise the exact model's pick at its position uses: pair t predicts t + 2
            self.mtp_tok.copy_(self.sampling.pick(logits, sb.expand(self.width), self.arange_w, pos + 2, (slot,)))
        self.mtp_out.copy_(out)

    @torch.inference_mode()
    def replay_rows(self, slot: int, n: int) -> None:
        self.select(slot)
        g = self.graph_for(("rows", n), slot)
        nogil.replay(g) if g is not None else self.compute_rows(slot, n)

    def ar_batch_launch(self, slots: list[int], hidden_out: list | None = None):
        """ar_batch in two halves: -> a callable that returns the tokens. A fused runner with batching
        enqueues the step and returns at once (one step of this runner may be uncollected while the next
        is launched: the step scheduler's pipeline); the slots' KV pages must be reserved (as
        DecodeEngine.decode does), since launch reads nothing from the device. Other runners compute
        the step now. hidden_out: a list that gets the step's final-normed hidden rows [len(slots),
        hidden] (a device copy, enqueued right after the step: what state.hidden[slot] holds after it)."""
        if self.batched is not None and len(slots) <= self.batched.max_rows:
            h = self.batched.launch(slots)
            if hidden_out is not None:
                hidden_out.append(self.batched.h[: len(slots)].clone())
            return lambda: self.batched.collect(h)
        toks = self.ar_batch(slots)
        if hidden_out is not None:
            hidden_out.append(self.state.hidden[upload(slots, torch.long, self.device)])  # (indexing copies)
        return lambda: toks

    def ar_batch(self, slots: list[int]) -> list[int]:
        """One AR step for each slot (distinct slots): consumes each next_token, returns the new ones.
        Each slot's bits are those of ar_step(slot) alone (the step scheduler's step function): eager
        runners run all slots as one rows_batch; fused runners, one bucketed batched step (enable_batching;
        without it, one ar_step per slot)."""
        if self.fast is not None:
            if self.batched is not None:
                self.reserve_next(slots)
                m = self.batched.max_rows
                return [t for i in range(0, len(slots), m) for t in self.batched.step(slots[i : i + m])]
            return [self.ar_step(slot) for slot in slots]
        nxt = self.state.next_token
        toks = [t[0] for t in self.rows_batch([(slot, [int(nxt[slot])]) for slot in slots])]
        for slot, t in zip(slots, toks):
            nxt[slot] = t
        return toks

    @torch.inference_mode()
    def ar_step(self, slot: int) -> int:
        """Consumes next_token[slot] (window checked by the caller); returns the new next token."""
        self.reserve_next([slot])
        self.select(slot)
        g = self.graph_for(("ar", 1), slot)
        nogil.replay(g) if g is not None else self.compute_ar(slot)
        return int(self.tok_out[0])

    @torch.inference_mode()
    def ar_launch(self, slot: int, phase: int) -> None:
        """Enqueues a ping-pong AR step of `phase` (graph ("ar<phase>", slot, 1), else eager) and the
        copy of its token to the host; returns at once on CUDA. Phases alternate 0, 1, 0, ... from the
        main buffers, so at most two steps (one per phase) of a slot are unread. The KV pages of the row
        must be reserved (DecodeEngine.decode); on CPU, where reading the position costs nothing, it grows them."""
        if self.device.type != "cuda":
            self.reserve_next([slot])
        self.select(slot)
        g = self.graph_for((f"ar{phase}", 1), slot)
        nogil.replay(g) if g is not None else self.compute_ar(slot, phase)
        self._tok_host[slot, phase].copy_(self.tok_out[0], non_blocking=True)
        if self._tok_ev is not None:
            self._tok_ev[slot][phase].record()

    def ar_collect(self, slot: int, phase: int) -> int:
        """The token of the last launched step of `phase` on `slot` (waits for that step only)."""
        if self._tok_ev is not None:
            self._tok_ev[slot][phase].synchronize()
        return int(self._tok_host[slot, phase])

    @torch.inference_mode()
    def replay_mtp(self, slot: int, n: int) -> None:
        self.select(slot)
        g = self.graph_for(("mtp", n), slot)
        nogil.replay(g) if g is not None else self.compute_mtp(slot, n)

    def mtp_batch(self, groups: list) -> tuple[list[list[int]], list[torch.Tensor]]:
        """The MTP head over several slots' pairs: groups [(slot, h [n, hidden], ids [n], start)] of
        distinct slots (1 <= n <= W, pairs at KV indexes start..start+n-1) -> (each group's drafts [n],
        its normed outputs [n, hidden]); each group bitwise as compute_mtp alone. Fused with batching:
        one pass per pair count (fused_blocks.BatchedRows.mtp); else one group at a time (replay_mtp)."""
        if self.batched_rows is not None and len(groups) > 1:
            return self.batched_rows.mtp(groups)
        toks, outs = [], []
        for group in groups:
            n = self._mtp_one(*group)
            toks.append(self.mtp_tok[:n].tolist())
            outs.append(self.mtp_out[:n].clone())
        return toks, outs

    def mtp_later(self, groups: list):
        """mtp_batch's passes without a host read (outputs not kept) -> a function giving each group's drafts,
        to call once a later read of the stream passed them (the plain rounds' flush, mtp_launch.py)."""
        if self.batched_rows is not None and len(groups) > 1:
            return self.batched_rows.mtp_later(groups)
        picks = [self.mtp_tok[: self._mtp_one(*group)].clone() for group in groups]
        return lambda: [p.tolist() for p in picks]

    def _mtp_one(self, slot: int, h: torch.Tensor, ids: list[int], start: int) -> int:
        n = len(ids)  # one group's MTP pass: its n pairs at KV index start.. (replay_mtp) -> n
        self.mtp_h.zero_()
        self.mtp_h[:n].copy_(torch.cat(h) if isinstance(h, list) else h)  # (h: [n, H] or its pieces)
        self.mtp_ids.zero_()
        self.mtp_ids[:n].copy_(upload(ids, torch.long, self.device))
        self.mtp_start.fill_(start)
        self.replay_mtp(slot, n)
        return n

    def begin_block(self, slot: int) -> None:
        """Before a rows block that `accept_prefix` may cut: snapshot, unless row checkpoints are kept."""
        if not self.state.ckpt_conv:
            self.state.snapshot(slot)

    def accept_prefix(self, slot: int, pos0: int, tokens: list[int], m: int) -> None:
        """After rows(slot, tokens) from position pos0, keep only tokens[0..m]: the state as if
        rows(slot, tokens[:m+1]) had run. Bitwise equal either way (row invariance); with row
        checkpoints it is a copy, else a snapshot restore (see begin_block) and a recompute."""
        if m + 1 == len(tokens):
            return
        if self.state.ckpt_conv:
            self.state.rewind_rows(slot, m)
            self.state.position[slot] = pos0 + m + 1
            self.state.hidden[slot].copy_(self.h_rows[m])
        else:
            self.state.restore(slot)
            self.rows(slot, tokens[: m + 1])

    def rows_batch(
        self, groups: list[tuple[int, list[int]]], ckpt_unused: bool = False, hidden_out: list | None = None
    ) -> list[list[int]]:
        """rows() of several slots in one batched eager step: groups = [(slot, tokens)] with distinct
        slots, 1 <= len(tokens) <= W; returns each group's greedy tokens. See baton/engine/batch.py.
        Each group's KV pages are grown first, as rows() does (a batched verify writes K+1 rows)."""
        return batch.rows_batch(self, groups, ckpt_unused, hidden_out)

    def rows(self, slot: int, tokens: list[int]) -> list[int]:
        """Feeds tokens (1 <= n <= W) and returns the greedy token after each of them."""
        n = len(tokens)
        if not 1 <= n <= self.width:
            raise ValueError(f"rows: {n} tokens, expected 1..{self.width}")
        pos = int(self.state.position[slot])
        self.check_window(pos, n)
        self.reserve(slot, pos + n)  # grown at the step boundary if the session's reservation is short
        self.ids_buf.zero_()
        self.ids_buf[:n].copy_(upload(tokens, torch.long, self.device))
        self.replay_rows(slot, n)
        return self.tok_out[:n].tolist()
