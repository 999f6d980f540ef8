"""CUDA host calls that keep the GIL: a graph launch, an event record and an async copy, made through the
CUDA runtime library the process already loaded, with ctypes.PyDLL (which, unlike ctypes.CDLL and torch's
own wrappers, does not give up the GIL around the call).

Why. torch's wrappers of these calls release the GIL around each one (pybind's gil_scoped_release), and a
thread that released it queues to get it back behind every other thread that wants it. On the H200 at 64
streams the decode worker's step thread spent 57% of its time in a launch of five such calls (write the
slots, record an event, replay the graph, copy the tokens back, record an event: well under a millisecond
alone, 7.3 ms a step there; benchmarks/results/gpu-h200-2026-12-03-phases.md), behind the gRPC threads of
the Decode streams and the hand-off. Each of these calls only enqueues work and returns in microseconds,
so holding the GIL through it costs the other threads nothing, and the step thread keeps the GIL from the
end of its wait for the previous step to the end of its launch. Measured (H200, 64 steady streams,
`BATON_NOGIL_LAUNCH=1` against `0`, benchmarks/results/gpu-h200-2026-12-05-nogil.md): the step thread's
launch phase 64% -> 1.7% of its time (it now waits for the device 81%), 2,888 -> 3,223 tok/s.

    launcher() -> Launcher | None     None: BATON_NOGIL_LAUNCH=0, not on CUDA, not exactly one GPU visible
                                      (a worker sees one), no runtime library found in the process, or
                                      torch without CUDAGraph.raw_cuda_graph_exec
    replay(graph)                     graph.replay() on the current stream, through the launcher if any
    Launcher.replay(graph, stream)    cudaGraphLaunch of a captured torch.cuda.CUDAGraph (no RNG in it:
                                      torch's replay would advance the Philox offsets of a graph that
                                      draws random numbers; Baton's graphs draw none, noise is hashed)
    Launcher.record(event, stream)    cudaEventRecord of a torch.cuda.Event already created (recorded once)
    Launcher.wait_event(stream, event)   cudaStreamWaitEvent: the stream's later work waits for a torch.cuda.Event
                                      already recorded (the hand-off's D2H copies wait for a prefill layer)
    Launcher.elapsed_ms(start, end)   cudaEventElapsedTime of two completed timing events
    Launcher.copy(dst, src, nbytes, stream)   cudaMemcpyAsync between addresses (data_ptr() + offset) on
                                      the device or in pinned host memory
    stream: the cudaStream_t (torch.cuda.Stream.cuda_stream). A failing call raises RuntimeError naming
    the call and the runtime's error string.
Same work on the same stream in the same order as torch's calls: the results are the same bits.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading

import torch

log = logging.getLogger("baton.engine")
ENV = "BATON_NOGIL_LAUNCH"
DEFAULT = "1"  # on: at 64 streams on the H200 the launch phase went 64% -> 1.7% and tok/s +12% (2026-12-05)
_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: the direction from the pointers (unified addressing)
_lock = threading.Lock()
_state: dict[str, object] = {}


def _runtime_path() -> str | None:
    """The CUDA runtime library this process mapped (torch's), from /proc/self/maps; None if none."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                at = line.find("/")
                if at >= 0 and "libcudart.so" in line:
                    return line[at:].strip()
    except OSError:
        pass
    return None


class Launcher:
    def __init__(self, lib: ctypes.PyDLL):
        vp, i = ctypes.c_void_p, ctypes.c_int
        self._launch = lib.cudaGraphLaunch
        self._launch.argtypes, self._launch.restype = [vp, vp], i
        self._record = lib.cudaEventRecord
        self._record.argtypes, self._record.restype = [vp, vp], i
        self._copy = lib.cudaMemcpyAsync
        self._copy.argtypes, self._copy.restype = [vp, vp, ctypes.c_size_t, i, vp], i
        self._wait = lib.cudaStreamWaitEvent
        self._wait.argtypes, self._wait.restype = [vp, vp, ctypes.c_uint], i
        self._elapsed = lib.cudaEventElapsedTime
        self._elapsed.argtypes, self._elapsed.restype = [ctypes.POINTER(ctypes.c_float), vp, vp], i
        self._ms = ctypes.c_float()
        self._why = lib.cudaGetErrorString
        self._why.argtypes, self._why.restype = [i], ctypes.c_char_p
        self._execs: dict[int, tuple[torch.cuda.CUDAGraph, int]] = {}  # id(graph) -> (graph, its exec)

    def _check(self, what: str, err: int) -> None:
        if err:
            raise RuntimeError(f"{what}: CUDA error {err} ({self._why(err).decode(errors='replace')})")

    def replay(self, graph: torch.cuda.CUDAGraph, stream: int) -> None:
        got = self._execs.get(id(graph))
        if got is None or got[0] is not graph:  # NOTE: the graph is kept, so its id is never reused
            got = self._execs[id(graph)] = (graph, graph.raw_cuda_graph_exec())
        self._check("cudaGraphLaunch", self._launch(got[1], stream))

    def record(self, event: torch.cuda.Event, stream: int) -> None:
        handle = event.cuda_event
        if not handle:
            raise RuntimeError("cudaEventRecord: the event was never recorded (not created yet)")
        self._check("cudaEventRecord", self._record(handle, stream))

    def wait_event(self, stream: int, event: torch.cuda.Event) -> None:
        """The stream's work enqueued after this waits for the event's last record (already recorded)."""
        handle = event.cuda_event
        if not handle:
            raise RuntimeError("cudaStreamWaitEvent: the event was never recorded (not created yet)")
        self._check("cudaStreamWaitEvent", self._wait(stream, handle, 0))

    def elapsed_ms(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        """Milliseconds between two completed events (timing events: enable_timing=True)."""
        self._check("cudaEventElapsedTime", self._elapsed(ctypes.byref(self._ms), start.cuda_event, end.cuda_event))
        return self._ms.value

    def copy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """nbytes from address src to address dst (device or pinned host memory; the caller keeps both
        alive and unchanged until the stream is past the copy)."""
        if nbytes:
            self._check("cudaMemcpyAsync", self._copy(dst, src, nbytes, _MEMCPY_DEFAULT, stream))


def launcher() -> Launcher | None:
    """The process's Launcher (module doc), or None where it cannot or must not be used."""
    got = _state.get("got", _state)
    if got is not _state:
        return got  # type: ignore[return-value]
    with _lock:
        if "got" not in _state:
            _state["got"] = _load()
        return _state["got"]  # type: ignore[return-value]


def replay(graph: torch.cuda.CUDAGraph) -> None:
    """graph.replay() on the current stream: through the launcher where there is one."""
    got = launcher()
    if got is None:
        graph.replay()
    else:
        got.replay(graph, torch.cuda.current_stream().cuda_stream)


def _load() -> Launcher | None:
    if os.environ.get(ENV, DEFAULT) != "1":
        return None
    if not torch.cuda.is_available() or not hasattr(torch.cuda.CUDAGraph, "raw_cuda_graph_exec"):
        return None
    if torch.cuda.device_count() != 1:  # torch's replay sets the graph's device; a worker sees one GPU
        log.info("nogil: %d GPUs visible, CUDA launches through torch", torch.cuda.device_count())
        return None
    torch.cuda.init()  # the runtime library is mapped once CUDA is initialised
    path = _runtime_path()
    if path is None:
        log.warning("nogil: no libcudart mapped in this process; CUDA launches through torch")
        return None
    try:
        got = Launcher(ctypes.PyDLL(path))
    except (OSError, AttributeError) as e:
        log.warning("nogil: %s unusable (%s); CUDA launches through torch", path, e)
        return None
    log.info("nogil: graph launches, event records and copies through %s, holding the GIL", path)
    return got
