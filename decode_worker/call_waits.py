"""What a fast-mode Decode call waits for before its first message, split in two so that the router's
first_decode_ms (the state landed -> the decode worker's first tokens at the router) can be taken apart:

    loaded -> called    a session's LoadState commit (DecodeSession.created) -> its first Decode call's entry
                        into the handler: the rest of the hand-off's report, the router's turn, the RPC's transit
    called -> first     the call's entry -> its first message handed to gRPC: the handler's set-up (session
                        lock, sampling row, window check, page reservation) and the join of the step scheduler
                        or the mtp rounds up to its first tokens (of which WorkerStats first_tokens_s_* is the
                        join's part)
    called -> asked     of it, the handler's own set-up: the entry -> the engine asked for the first tokens
                        (decode_setup_s_*); the rest is the engine's (window, pages, the join)

Why: on an H100 at 32 streams fast mtp's first decode took 125 ms p50 against bf16's 46, of which the join
measured only 28 against 19 ms (2026-12-07, benchmarks/results/gpu-h100-2026-12-07-stop57.md); later that
day called -> first took 142-211 ms against bf16's 63-76, the join 27-35 against 21
(benchmarks/results/gpu-h100-2026-12-07-stop59.md): called -> asked tells the handler's part from the engine's.
Lifecycle: one CallWaits a DecodeServicer; windows of the most recent calls, reset with GetStats' reset_steps.
"""

from __future__ import annotations

import collections
import threading
import time

from baton.engine.scheduler import p50_p99

WINDOW = 4096  # calls a window keeps


class CallWaits:
    """The two windows (seconds), appended from the handler threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.loaded_to_called: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self.called_to_first: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self.called_to_asked: collections.deque[float] = collections.deque(maxlen=WINDOW)

    def called(self, created: float | None) -> float:
        """A Decode call's entry: records loaded -> called for a session's first call (`created`: its LoadState
        commit, time.monotonic(); None for a later call) and returns the entry time for first()."""
        now = time.monotonic()
        if created is not None:
            with self._lock:
                self.loaded_to_called.append(max(0.0, now - created))
        return now

    def asked(self, entered: float) -> None:
        """The handler asks the engine for the call's first tokens (entered: called()'s return)."""
        with self._lock:
            self.called_to_asked.append(time.monotonic() - entered)

    def first(self, entered: float) -> None:
        """The call's first message is out (entered: called()'s return)."""
        with self._lock:
            self.called_to_first.append(time.monotonic() - entered)

    def fill(self, out, reset: bool = False) -> None:
        """WorkerStats' decode_called_s_* (loaded -> called), decode_first_message_s_* (called -> first) and
        decode_setup_s_* (called -> asked)."""
        with self._lock:
            out.decode_called_s_p50, out.decode_called_s_p99 = p50_p99(self.loaded_to_called)
            out.decode_first_message_s_p50, out.decode_first_message_s_p99 = p50_p99(self.called_to_first)
            out.decode_setup_s_p50, out.decode_setup_s_p99 = p50_p99(self.called_to_asked)
            if reset:
                self.loaded_to_called.clear()
                self.called_to_first.clear()
                self.called_to_asked.clear()
