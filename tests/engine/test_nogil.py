"""baton/engine/nogil.py: the GIL-holding CUDA launcher's host side (the calls themselves run on the GPU:
tests/engine/test_gpu_batch.py's batched steps launch through it and equal each session alone)."""

from __future__ import annotations

import pytest

from baton.engine import nogil


class _Fn:
    """A fake runtime entry point: records its calls, returns `err`."""

    def __init__(self, calls: list, name: str, err: int = 0):
        self.calls, self.name, self.err = calls, name, err
        self.argtypes = self.restype = None

    def __call__(self, *args):
        self.calls.append((self.name, args))
        return self.err


class _Lib:
    def __init__(self, fail: str | None = None):
        self.calls: list = []
        for name in (
            "cudaGraphLaunch",
            "cudaEventRecord",
            "cudaMemcpyAsync",
            "cudaEventElapsedTime",
            "cudaStreamWaitEvent",
        ):
            setattr(self, name, _Fn(self.calls, name, 700 if name == fail else 0))
        self.cudaGetErrorString = lambda err: b"an illegal memory access was encountered"


class _Graph:
    def __init__(self, handle: int):
        self.handle, self.asked = handle, 0

    def raw_cuda_graph_exec(self) -> int:
        self.asked += 1
        return self.handle


class _Event:
    def __init__(self, handle: int):
        self.cuda_event = handle


def test_calls_pass_the_handles_and_cache_each_graphs_exec():
    lib = _Lib()
    L = nogil.Launcher(lib)
    g, h = _Graph(0xABC), _Graph(0xDEF)
    L.replay(g, 7)
    L.replay(g, 7)
    L.replay(h, 9)
    L.record(_Event(0x55), 7)
    L.copy(1000, 2000, 64, 7)
    L.copy(1000, 2000, 0, 7)  # nothing to copy: no call
    L.wait_event(9, _Event(0x66))
    assert lib.calls == [
        ("cudaGraphLaunch", (0xABC, 7)),
        ("cudaGraphLaunch", (0xABC, 7)),
        ("cudaGraphLaunch", (0xDEF, 9)),
        ("cudaEventRecord", (0x55, 7)),
        ("cudaMemcpyAsync", (1000, 2000, 64, 4, 7)),  # cudaMemcpyDefault
        ("cudaStreamWaitEvent", (9, 0x66, 0)),
    ]
    assert (g.asked, h.asked) == (1, 1)


@pytest.mark.parametrize("fail", ["cudaGraphLaunch", "cudaEventRecord", "cudaMemcpyAsync", "cudaStreamWaitEvent"])
def test_a_failing_call_raises_naming_it_and_the_runtime_error(fail):
    L = nogil.Launcher(_Lib(fail))
    with pytest.raises(RuntimeError, match=f"{fail}: CUDA error 700 \\(an illegal memory access"):
        L.replay(_Graph(1), 0)
        L.record(_Event(2), 0)
        L.copy(1, 2, 8, 0)
        L.wait_event(0, _Event(3))


def test_an_event_not_created_yet_is_refused():
    with pytest.raises(RuntimeError, match="never recorded"):
        nogil.Launcher(_Lib()).record(_Event(0), 0)
    with pytest.raises(RuntimeError, match="cudaStreamWaitEvent: the event was never recorded"):
        nogil.Launcher(_Lib()).wait_event(0, _Event(0))


def test_off_cuda_or_switched_off_there_is_no_launcher(monkeypatch):
    monkeypatch.setattr(nogil, "_state", {})
    monkeypatch.setenv(nogil.ENV, "0")
    monkeypatch.setattr(nogil.torch.cuda, "is_available", lambda: True)  # switched off, even on CUDA
    assert nogil.DEFAULT == "1" and nogil.launcher() is None
    monkeypatch.setattr(nogil, "_state", {})
    monkeypatch.setenv(nogil.ENV, "1")
    monkeypatch.setattr(nogil.torch.cuda, "is_available", lambda: False)
    assert nogil.launcher() is None


def test_elapsed_ms_reads_the_runtime_figure_for_the_two_events():
    lib = _Lib()

    def elapsed(out, start, end):
        lib.calls.append(("cudaEventElapsedTime", (start, end)))
        out._obj.value = 2.5  # what the runtime writes through the pointer
        return 0

    lib.cudaEventElapsedTime = elapsed
    assert nogil.Launcher(lib).elapsed_ms(_Event(0x11), _Event(0x22)) == 2.5
    assert lib.calls == [("cudaEventElapsedTime", (0x11, 0x22))]


def test_replay_without_a_launcher_is_torchs_replay(monkeypatch):
    monkeypatch.setattr(nogil, "_state", {"got": None})
    replayed = []

    class Graph:
        def replay(self):
            replayed.append(self)

    g = Graph()
    nogil.replay(g)
    assert replayed == [g]
