"""SlotFill: a received state placed into a reserved slot tensor by tensor, activated only at commit().

Lifecycle (one LoadState stream):
    DecodeEngine.reserve(engine, session_id, position)   a free slot and the KV pages of rows
        [0, position + 1), taken from the pools but invisible to get() (a session of the same id keeps
        serving); when no slot (or too few pages) is free but session_id already holds a slot, the fill is
        deferred: tensors are kept on the host and the old slot (and pages) are reused at commit
        KV tensors go straight into the slot's pages (HybridState.import_views: PagedRows)
    place(name, cpu_tensor)   as soon as the wire has verified that tensor: copied into the slot
        (CUDA: non_blocking H2D from pinned memory on the engine's load stream, overlapping the rest of
        the stream; a GDN / hidden tensor's copy goes through
        baton/engine/nogil.py, holding the GIL); the slot's other sessions never read it, and nothing marks
        it live yet
    commit(tensors, next_token, draft_only)   after the whole stream verified (manifest included): places
        what is left (zero-filled MTP rows: filled on the device), zeroes KV rows past position, sets the
        scalars, waits for all of it, and publishes the session (replacing one of the same id). A draft-only
        state (baton/handoff/receive.py) fills its hidden row and MTP KV rows alone: the slot's GDN state and
        attention KV rows keep whatever they held (another session's), never read, since the session is
        draft_only (its drafts read only the MTP pairs, the MTP KV, position and next_token). Its KV pages
        are reserved as for any state: one page table serves every attention layer and the MTP layer.
        CUDA: all on the load stream, without the engine's compute lock: the slot is not live, so no step
        reads or writes it, and whatever a step queues after the publish finds the slot complete (the load
        stream was waited for); the steps go on meanwhile (under load a commit's ~20 small ops, each a GIL
        hand-over, held the lock the step thread's launches wait for: 15% of its time at 64 streams on the
        H200). CPU: under the lock (no streams: the steps' kernels run in the step thread at the same time).
    abort()   any failure: the slot and its pages go back to the pools; half-written contents are never read
        (a later fill overwrites every tensor, and finish_import the rest)
"""

from __future__ import annotations

import time

import torch

from baton.engine import nogil


def _copy_in(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst := src; a constant source (zero strides: the zero-filled MTP rows) is filled on the device
    instead of being materialised on the host and copied over."""
    if src.numel() and not any(src.stride()):
        dst.fill_(src.as_strided((1,), (1,)).item())
    else:
        dst.copy_(src, non_blocking=True)


def _same_bytes(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """A plain byte copy does what dst.copy_(src) would: same dtype and shape, both contiguous, src pinned
    host memory (the receiver's buffers on CUDA), dst on the device."""
    return (
        dst.dtype == src.dtype
        and dst.shape == src.shape
        and dst.is_contiguous()
        and src.is_contiguous()
        and dst.is_cuda
        and not src.is_cuda
    )


class SlotFill:
    def __init__(self, engine, name: str, runner, session_id: str | None, position: int):
        self.engine, self.name, self.runner, self.position = engine, name, runner, position
        self.session_id, self.slot = session_id, None
        self._placed: set[str] = set()
        self._views: dict[str, torch.Tensor] | None = None
        self._stream = torch.cuda.Stream(runner.device) if runner.device.type == "cuda" else None
        self._nogil = nogil.launcher() if self._stream is not None else None  # BATON_NOGIL_LAUNCH=0: off
        self._done = False

    def _reserve(self, replace: bool) -> None:
        e, r = self.name, self.runner
        sid, self.slot = self.engine._table.take(
            id(r), self.session_id if replace else None, replace=replace, what=f"{r.state.slots} {e} decode"
        )
        try:  # the KV pages of rows [0, position + 1), before a byte arrives (PagesExhausted)
            r.state.reserve(self.slot, min(self.position + 1, r.max_len), zero=False)
        except BaseException:
            self.engine._table.give_back(id(r), self.slot)  # frees any pages too (on_free)
            self.slot = None
            raise
        self.session_id = self.session_id or sid

    def place(self, name: str, src: torch.Tensor) -> None:
        """Copies one verified tensor into the reserved slot (deferred fill: nothing yet)."""
        if self.slot is None:
            return
        if self._views is None:
            self._views = self.runner.state.import_views(self.slot, self.position)
            if self._stream is not None:  # after all work already queued (a freed slot's or page's last use)
                self._stream.wait_stream(torch.cuda.current_stream(self.runner.device))
        dst = self._views[name]
        fast = self._nogil
        if fast is not None and isinstance(dst, torch.Tensor) and _same_bytes(dst, src):
            # a GDN / hidden view of the slot from the pinned receive buffer, holding the GIL
            # (baton/engine/nogil.py); the buffer lives until commit or abort has waited for the stream
            fast.copy(dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size(), self._stream.cuda_stream)
        elif self._stream is not None:
            with torch.cuda.stream(self._stream):
                dst.copy_(src, non_blocking=True)
        else:
            dst.copy_(src)
        self._placed.add(name)

    def commit(self, tensors: dict[str, torch.Tensor], next_token: int, draft_only: bool = False):
        """The verified state's tensors (those already placed are skipped) -> the published session;
        draft_only: `tensors` is a draft-only state's (the names it lacks are left as they are)."""
        eng, r = self.engine, self.runner
        if self.slot is None:  # deferred: replace the old session's slot now
            self._reserve(replace=True)
        st = r.state
        try:
            # the views place() built (~100 tensors' views and page lists: Python work, each torch call a
            # GIL hand-over) are not built again
            views = self._views if self._views is not None else st.import_views(self.slot, self.position)
            left = {n: dst for n, dst in views.items() if n not in self._placed and (n in tensors or not draft_only)}
            if self._stream is not None:
                if self._views is None:  # nothing placed: after all work already queued, as place() does
                    self._stream.wait_stream(torch.cuda.current_stream(r.device))
                with torch.cuda.stream(self._stream):
                    for name, dst in left.items():
                        _copy_in(dst, tensors[name])
                    st.finish_import(self.slot, position=self.position, next_token=next_token)
                # the H2D copies read pinned buffers the caller holds, and the first step of the session
                # must find its slot complete: wait here (the GIL given up), not under the compute lock
                self._stream.synchronize()
            else:
                with eng._compute:
                    for name, dst in left.items():
                        _copy_in(dst, tensors[name])
                    st.finish_import(self.slot, position=self.position, next_token=next_token)
        except BaseException:
            self.abort()
            raise
        self._done = True
        now = time.monotonic()
        return eng._publish(self.session_id, self.name, r, self.slot, self.position, next_token, now, draft_only)

    def abort(self) -> None:
        if self._done or self.slot is None:
            return
        self._done = True
        if self._stream is not None:
            self._stream.synchronize()
        self.engine._table.give_back(id(self.runner), self.slot)
