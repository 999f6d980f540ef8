"""The sender's staging by address (baton/handoff/staging.py byte_ranges, _stage_by_address): a chunk's
copies computed from shapes and strides, not torch views, stage exactly the bytes byte_slices' views
hold, in the same order. On CUDA the copies are the GIL-holding launcher's cudaMemcpyAsync
(baton/engine/nogil.py); here a launcher that moves host memory stands for it, over CPU tensors."""

from __future__ import annotations

import ctypes

import pytest
import torch

from baton.handoff.staging import _stage_by_address, byte_ranges, byte_slices


def _slices_bytes(t: torch.Tensor, a: int, b: int) -> bytes:
    return b"".join(bytes(x.contiguous().numpy()) for x in byte_slices(t, a, b))


def _ranges_bytes(t: torch.Tensor, ranges) -> bytes:
    return b"".join(ctypes.string_at(t.data_ptr() + at, n) for at, n in ranges)


def _tensors():
    g = torch.Generator().manual_seed(0)
    pool = torch.randn(3, 4, 16, 8, generator=g).to(torch.bfloat16)  # [pages, kv_heads, PAGE, d]
    window = torch.randn(4, 40, 8, generator=g)  # [kv_heads, max_len, d]
    return {
        "contiguous": torch.randn(5, 6, generator=g),
        "kv rows of a window": window[:, :13],  # contiguous per head: one range a head
        "a view at an offset": window[1:3, 5:9],
        "transposed pages": pool.transpose(0, 1)[:, 1:],  # [kv_heads, pages, PAGE, d]
        "size-1 dims": torch.randn(1, 7, 1, generator=g).expand(1, 7, 1),
        "empty": torch.randn(0, 4, generator=g),
    }


@pytest.mark.parametrize("name", list(_tensors()))
def test_byte_ranges_hold_the_bytes_of_byte_slices_in_order(name):
    t = _tensors()[name]
    total = t.numel() * t.element_size()
    cuts = sorted({min(c, total) for c in (0, total, total // 3, total // 2 + 1, max(total - 5, 0))})
    for a in cuts:
        for b in cuts:
            if b < a:
                continue
            ranges = byte_ranges(t, a, b)
            assert ranges is not None
            assert _ranges_bytes(t, ranges) == _slices_bytes(t, a, b), (a, b)
            assert sum(n for _, n in ranges) == b - a
            assert all(n > 0 for _, n in ranges)
            assert all(x[0] + x[1] < y[0] or x[0] + x[1] > y[0] for x, y in zip(ranges, ranges[1:]))  # merged
    if t.is_contiguous() and total:
        assert byte_ranges(t, 0, total) == [(0, total)]


def test_a_strided_last_dimension_has_no_ranges():
    t = torch.arange(20.0).view(4, 5)[:, ::2]
    assert byte_ranges(t, 0, t.numel() * t.element_size()) is None


class _HostCopies:
    """A launcher over host memory: copy = memmove, enqueued in order; wait_event recorded."""

    def __init__(self):
        self.calls = []

    def copy(self, dst: int, src: int, n: int, stream: int) -> None:
        self.calls.append(("copy", n, stream))
        ctypes.memmove(dst, src, n)

    def wait_event(self, stream: int, event) -> None:
        self.calls.append(("wait", event, stream))


class _Recorded:
    cuda_event = 1234  # a recorded torch.cuda.Event's handle


def test_a_chunk_staged_by_address_is_the_bytes_of_its_segments_in_order():
    ts = _tensors()
    kv, pages = ts["kv rows of a window"], ts["transposed pages"]
    ev = _Recorded()
    segs = [(kv, None, 100, kv.numel() * 4), (pages, ev, 0, 700), (ts["contiguous"], ev, 8, 64)]
    want = b"".join(_slices_bytes(t, a, b) for t, _, a, b in segs)
    buf = torch.zeros(len(want) + 16, dtype=torch.uint8)
    fast = _HostCopies()
    n = _stage_by_address(fast, 7, buf.data_ptr(), segs, device=False)
    assert n == len(want)
    assert bytes(buf[:n].numpy()) == want and not buf[n:].any()
    waits = [c for c in fast.calls if c[0] == "wait"]
    assert waits == [("wait", ev, 7), ("wait", ev, 7)]  # each segment's ready event, on the copy stream
    assert fast.calls[0][0] == "copy" and fast.calls.index(waits[0]) > 0  # the first segment waits for nothing
    assert all(c[2] == 7 for c in fast.calls)


def test_a_chunk_it_cannot_stage_by_address_enqueues_nothing():
    ts = _tensors()
    fast, buf = _HostCopies(), torch.zeros(4096, dtype=torch.uint8)
    strided = torch.arange(20.0).view(4, 5)[:, ::2]
    segs = [(ts["contiguous"], None, 0, 32), (strided, None, 0, 16)]
    assert _stage_by_address(fast, 7, buf.data_ptr(), segs, device=False) is None
    assert fast.calls == [] and not buf.any()

    class _Unrecorded:
        cuda_event = 0

    segs = [(ts["contiguous"], _Unrecorded(), 0, 32)]
    assert _stage_by_address(fast, 7, buf.data_ptr(), segs, device=False) is None
    assert _stage_by_address(fast, 7, buf.data_ptr(), [(ts["contiguous"], None, 0, 32)]) is None  # not CUDA
    assert fast.calls == []


def _paged(position: int, pages: list[int]):
    from baton.engine.pages import PagedSource

    g = torch.Generator().manual_seed(position)
    pool = torch.randn(6, 2, 256, 4, generator=g).to(torch.bfloat16)  # [P + 1, kv_heads, PAGE, d]
    return PagedSource(pool, pages, position)


@pytest.mark.parametrize("position", [0, 1, 255, 256, 257, 600])
def test_a_paged_source_addresses_the_bytes_of_its_gathered_rows(position):
    """PagedSource.address_ranges names, in the pool, exactly the bytes gather() copies out (the rows of
    HybridState.slot_rows), for any byte window: the stager copies them in place, no gather."""
    src = _paged(position, [4, 0, 3, 1])  # out of order; only the first pages_for(position) are read
    want = bytes(src.gather().view(torch.uint8).reshape(-1).numpy())
    total = src.numel() * src.element_size()
    assert total == len(want) and src.shape == (2, position, 4)
    cuts = sorted({min(c, total) for c in (0, 1, 511, 2048, total // 3, total // 2 + 1, total - 5, total)})
    for a in cuts:
        for b in cuts:
            if b < a:
                continue
            ranges = src.address_ranges(a, b)
            assert b"".join(ctypes.string_at(at, n) for at, n in ranges) == want[a:b], (a, b)
            assert all(n > 0 for _, n in ranges)


def test_a_paged_source_must_hold_its_rows():
    with pytest.raises(ValueError, match="do not hold"):
        _paged(257, [2])


def test_a_chunk_of_paged_kv_is_staged_from_the_pages_in_place():
    """A chunk mixing a paged KV source and a tensor: one wait per ready event, then the pages' runs."""
    src, ts, ev = _paged(300, [2, 5]), _tensors(), _Recorded()
    segs = [(src, ev, 100, src.numel() * 2), (ts["contiguous"], None, 0, 40)]
    want = bytes(src.gather().view(torch.uint8).reshape(-1).numpy())[100:] + _slices_bytes(ts["contiguous"], 0, 40)
    buf, fast = torch.zeros(len(want) + 8, dtype=torch.uint8), _HostCopies()
    assert _stage_by_address(fast, 3, buf.data_ptr(), segs, device=False) == len(want)
    assert bytes(buf[: len(want)].numpy()) == want and not buf[len(want) :].any()
    assert fast.calls[0] == ("wait", ev, 3)
    assert len([c for c in fast.calls if c[0] == "copy"]) == 2 * 2 + 1  # 2 heads x 2 pages, then the tensor
