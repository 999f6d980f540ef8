"""MessagePace: how many messages a decode worker's Decode streams send, together, a second.

Each DecodeResponse costs the worker's process ~100-160 us of Python under the GIL on a 2-core VM, the
same for 1 token or 4 (grpc's send path; `benchmarks/bench_stream_messages.py`,
benchmarks/results/stream-messages-cpu-2026-12-03.json: one process tops out near 5,300 messages/s), and
the step thread needs the GIL to launch every step. At one message per token, 64 streams at ~115 tokens/s
each send ~7,400 messages/s, and on the H200 (serve-steady, 2026-12-03) the step thread then spent half its
time in its launch phase, waiting to get the GIL back. So the streams that may group tokens can share a
budget of `rate` messages/s: with `active` such streams, each waits until active / rate s (at most
MAX_WAIT_S) have passed since its last message, and the tokens queued meanwhile go as one message.
Below rate / (step rate) streams nothing waits: every step's token goes at once, as before.

Only a run-ahead decode groups (DecodeEngine.runs_ahead: release_at_end, no logprobs): its steps go on
while its reader waits (StepScheduler `ahead`, RUN_AHEAD = 16 tokens), so the wait delays no step. The
tokens and their order do not change, only how many ride in a message.

On the H200 (the `paced` stage, 2026-12-03, ebe3754) a budget of 2,000 cut the launch phase (47% -> 36%
at 32 streams, 55% -> 41% at 64) without raising tok/s (2,021 against 2,319 at 32; 2,870 against 2,876 at
64): the GIL's time went elsewhere. So it is off by default (BATON_STREAM_MESSAGES_PER_S=0), kept as a knob.

Lifecycle: one MessagePace per DecodeServicer (settings.stream_messages_per_s; 0 = off);
`with pace.stream() as wait:` around one Decode's loop, `wait()` after each message sent.
"""

from __future__ import annotations

import contextlib
import threading
import time

MAX_WAIT_S = 0.025  # well under RUN_AHEAD (16) steps at any batch, so a waiting reader never holds a step


def _no_wait() -> None:
    pass


class MessagePace:
    def __init__(self, rate: float):
        if rate < 0:
            raise ValueError(f"messages per second: must be >= 0, got {rate}")
        self.rate = rate
        self._lock = threading.Lock()
        self.active = 0  # streams that group tokens right now

    def interval(self) -> float:
        """The seconds each grouping stream leaves between its messages now (0: no grouping)."""
        if not self.rate:
            return 0.0
        return min(MAX_WAIT_S, self.active / self.rate)

    @contextlib.contextmanager
    def stream(self):
        """One grouping stream: yields wait(), to call after each message; it sleeps out the rest of the
        interval since the previous call. With no budget (rate 0, the default) wait() does nothing at all:
        no lock, no clock read per message."""
        if not self.rate:
            yield _no_wait
            return
        with self._lock:
            self.active += 1
        last = time.monotonic()

        def wait() -> None:
            nonlocal last
            left = self.interval() - (time.monotonic() - last)
            if left > 0:
                time.sleep(left)
            last = time.monotonic()

        try:
            yield wait
        finally:
            with self._lock:
                self.active -= 1
