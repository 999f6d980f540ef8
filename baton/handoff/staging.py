"""Device -> host staging for the sender: a chunk's bytes copied D2H into a reused pinned buffer.

Lifecycle of one staged chunk (CUDA sources only; CPU tensors are read in place, no copy):
    take()           a pinned uint8 buffer of chunk_bytes from the process's free list (made on first
                     use: pinned allocations are slow, so buffers outlive streams); at most `limit`
                     buffers per stream are out, which bounds the pinned memory a stream holds
    stage(...)       stage_into(buf, ...): on the device's copy stream: wait for each piece's ready event (recorded by the
                     producer of the tensor, e.g. after a prefill layer), then non_blocking copies of the
                     pieces into the buffer, then a done event. Never a host sync: the caller's thread
                     returns at once, and the copy stream runs beside the compute stream. With the
                     GIL-holding launcher (baton/engine/nogil.py) the waits and copies of a chunk of CUDA
                     tensors are runtime calls on addresses (byte_ranges), not torch calls: each torch call,
                     a view included, gives the GIL up, and the prefill's thread, which launches a pass's
                     kernels beside the stagers, waited for it behind them (on an H100 a pass of 8 x 512
                     tokens took 387-458 ms beside its hand-offs, 203-217 ms without;
                     benchmarks/results/gpu-h100-2026-12-06-mps.md; on an H200 a burst of 32 x 512 tokens
                     first token p50 890 -> 715 ms by address, benchmarks/results/gpu-h200-2026-12-06.md).
                     On by default; BATON_STAGE_BY_ADDRESS=0 turns it off (torch's views and copies).
                     With BATON_STAGE_KV_IN_PLACE=1 too (kv_in_place; off by default), a paged KV
                     tensor (baton/engine/pages.py: PagedSource) is copied from its pages in place, not
                     gathered on the sender's thread first
    StagedChunk.wait()   in the hashing pool: done.synchronize() (no GIL), then the bytes are final
    StagedChunk.release()  once the chunk is framed (its bytes copied out): the buffer is free again
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

import torch

from baton.engine import nogil
from baton.engine.pages import PagedSource

BY_ADDRESS_ENV = "BATON_STAGE_BY_ADDRESS"  # "0": torch's views and copies (module doc); default on
KV_IN_PLACE_ENV = "BATON_STAGE_KV_IN_PLACE"  # "1": paged KV staged from its pages (kv_in_place); default off
_FREE: dict[int, list[torch.Tensor]] = {}  # chunk_bytes -> free pinned uint8 buffers
_LOCK = threading.Lock()
_STREAMS: dict[int, torch.cuda.Stream] = {}  # device index -> copy stream


def copy_stream(device: torch.device) -> torch.cuda.Stream:
    """One D2H copy stream per device, shared by all senders of the process."""
    with _LOCK:
        s = _STREAMS.get(device.index)
        if s is None:
            s = _STREAMS[device.index] = torch.cuda.Stream(device)
        return s


def byte_slices(t: torch.Tensor, a: int, b: int) -> list[torch.Tensor]:
    """Contiguous uint8 views covering bytes [a, b) of t's C-order layout, without copying. A KV view
    [kv_heads, L, head_dim] of a [kv_heads, max_len, head_dim] buffer is contiguous per head, so it
    splits along its leading dim; anything else non-contiguous is copied on the copy stream."""
    if t.is_contiguous():
        return [t.reshape(-1).view(torch.uint8)[a:b]]
    if t.dim() <= 1:
        return [t.contiguous().reshape(-1).view(torch.uint8)[a:b]]  # caller is on the copy stream
    row = t[0].numel() * t.element_size()
    out: list[torch.Tensor] = []
    for i in range(a // row, -(-b // row)):
        out += byte_slices(t[i], max(a, i * row) - i * row, min(b, (i + 1) * row) - i * row)
    return out


def byte_ranges(t: torch.Tensor, a: int, b: int) -> list[tuple[int, int]] | None:
    """byte_slices' pieces of bytes [a, b) of t's C-order layout as (byte offset from t.data_ptr(), length),
    in order, adjacent pieces merged; from t's shape and strides alone, without a torch call. None where
    byte_slices would copy (a strided last dimension)."""
    size = t.element_size()
    got = _ranges(tuple(t.shape), tuple(x * size for x in t.stride()), size, a, b, 0)
    if got is None:
        return None
    out: list[tuple[int, int]] = []
    for at, n in got:
        if out and out[-1][0] + out[-1][1] == at:
            out[-1] = (out[-1][0], out[-1][1] + n)
        elif n:
            out.append((at, n))
    return out


def _ranges(shape: tuple, strides: tuple, size: int, a: int, b: int, base: int) -> list[tuple[int, int]] | None:
    expect, dense = size, True  # C-contiguous (torch's rule: a dimension of size 1 has any stride)
    for n, st in zip(reversed(shape), reversed(strides)):
        dense = dense and (n == 1 or st == expect)
        expect *= n
    if dense:
        return [(base + a, b - a)] if b > a else []
    if len(shape) <= 1:
        return None
    row = expect // shape[0]  # bytes of one index of dim 0, C order
    out: list[tuple[int, int]] = []
    for i in range(a // row, -(-b // row)):
        lo, hi = max(a, i * row) - i * row, min(b, (i + 1) * row) - i * row
        sub = _ranges(shape[1:], strides[1:], size, lo, hi, base + i * strides[0])
        if sub is None:
            return None
        out += sub
    return out


def by_address_on() -> bool:
    """Whether stage_into may copy by address (BATON_STAGE_BY_ADDRESS, the launcher loaded)."""
    return os.environ.get(BY_ADDRESS_ENV, "1") != "0" and nogil.launcher() is not None


def kv_in_place() -> bool:
    """Whether a sender keeps a paged KV source in place (PagedSource, copied from its pages by address)
    instead of gathering it first: by_address_on() and BATON_STAGE_KV_IN_PLACE=1. Off by default: on an H100 it
    passed the streamed hand-off's GPU test, but a burst of 32 x 512's states landed 233 ms later (p50) with it,
    one copy a page run (benchmarks/results/gpu-h100-2026-12-06-stop52.md; gpu_pending.sh kv-ab); the
    same bytes either way (tests/handoff/test_staging.py checks the addresses against the gather)."""
    return os.environ.get(KV_IN_PLACE_ENV, "0") == "1" and by_address_on()


def addresses(t, a: int, b: int) -> list[tuple[int, int]] | None:
    """Bytes [a, b) of a segment's source as (address, length) pieces in order: a PagedSource's runs, or a
    tensor's byte_ranges from its data_ptr(); None where byte_slices would copy."""
    if isinstance(t, PagedSource):
        return t.address_ranges(a, b)
    ranges = byte_ranges(t, a, b)
    return None if ranges is None else [(t.data_ptr() + at, n) for at, n in ranges]


def _stage_by_address(fast, s: int, dst: int, segments, device: bool = True) -> int | None:
    """stage_into's copies through the launcher `fast` (module doc) on stream handle s into the buffer at
    address dst: every segment a CUDA source (device=False: a CPU one, for the tests) whose bytes have
    addresses(), each ready event recorded, else None (nothing enqueued). -> bytes staged."""
    plan = []
    for t, ready, a, b in segments:
        ranges = addresses(t, a, b) if t.is_cuda == device else None
        if ranges is None or (ready is not None and not ready.cuda_event):
            return None
        plan.append((ready, ranges))
    off = 0
    for ready, ranges in plan:
        if ready is not None:
            fast.wait_event(s, ready)
        for at, n in ranges:
            fast.copy(dst + off, at, n, s)
            off += n
    return off


@dataclass
class StagedChunk:
    buf: torch.Tensor  # pinned uint8 [chunk_bytes]; the chunk is buf[:n]
    n: int
    done: torch.cuda.Event
    _ring: "Ring"

    def wait(self) -> memoryview:
        self.done.synchronize()
        return memoryview(self.buf[: self.n].numpy())

    def release(self) -> None:
        self._ring.give(self.buf)


class Ring:
    """The pinned buffers of one stream: at most `limit` out at once (take() blocks past that)."""

    def __init__(self, chunk_bytes: int, limit: int):
        self.chunk_bytes, self._slots = chunk_bytes, threading.Semaphore(limit)

    def take(self) -> torch.Tensor:
        self._slots.acquire()
        with _LOCK:
            free = _FREE.setdefault(self.chunk_bytes, [])
            if free:
                return free.pop()
        return torch.empty(self.chunk_bytes, dtype=torch.uint8, pin_memory=True)

    def give(self, buf: torch.Tensor) -> None:
        with _LOCK:
            _FREE.setdefault(self.chunk_bytes, []).append(buf)
        self._slots.release()

    def stage(self, segments: list[tuple[torch.Tensor, torch.cuda.Event | None, int, int]]) -> StagedChunk:
        """segments: (tensor, ready event | None, byte start, byte end) in chunk order; CUDA tensors
        (all on one device) or CPU tensors. Returns at once; StagedChunk.wait() for the bytes."""
        buf = self.take()
        n, done = stage_into(buf, segments)
        return StagedChunk(buf, n, done, self)


def stage_into(
    buf: torch.Tensor,
    segments: list[tuple[torch.Tensor, torch.cuda.Event | None, int, int]],
    by_address: bool = True,
) -> tuple[int, torch.cuda.Event | None]:
    """Copies the segments' bytes, in order, into the front of `buf` (uint8, pinned for CUDA sources);
    -> (bytes staged, done event). With a CUDA tensor among them: on its device's copy stream, each piece
    gated on its ready event, non_blocking; the bytes are final once `done` completed (never a host sync
    here). CPU only: plain copies (torch releases the GIL in them), done None: final on return.
    by_address: the copies may go through the GIL-holding launcher (module doc); only into page-locked
    memory (a copy into pageable memory waits on the host, here with the GIL held). Otherwise a PagedSource
    is gathered on the copy stream (each chunk it spans gathers it whole: the rare path)."""
    dev = next((t.device for t, _, _, _ in segments if t.is_cuda), None)
    off = 0
    if dev is None:
        for t, _, a, b in segments:
            t = t.gather() if isinstance(t, PagedSource) else t
            buf[off : off + b - a].copy_(t.reshape(-1).view(torch.uint8)[a:b])
            off += b - a
        return off, None
    stream = copy_stream(dev)
    fast = nogil.launcher() if by_address and by_address_on() else None
    staged = _stage_by_address(fast, stream.cuda_stream, buf.data_ptr(), segments) if fast is not None else None
    if staged is not None:
        done = torch.cuda.Event(blocking=True)  # as below
        done.record(stream)
        return staged, done
    with torch.cuda.stream(stream):
        for t, ready, a, b in segments:
            if ready is not None:
                stream.wait_event(ready)
            if isinstance(t, PagedSource):
                t = t.gather()
            for piece in byte_slices(t, a, b) if t.is_cuda else [t.reshape(-1).view(torch.uint8)[a:b]]:
                buf[off : off + piece.numel()].copy_(piece, non_blocking=t.is_cuda)
                off += piece.numel()
        # blocking: its waiter (the stager, the hashing pool) sleeps in synchronize() instead of spinning a
        # core for as long as the prefill's later layers take (a push waits on each chunk's copy)
        done = torch.cuda.Event(blocking=True)
        done.record(stream)
    return off, done
