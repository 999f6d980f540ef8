"""Equal prompts announced by their callers: Prefill calls sent together with the same prompt (an OpenAI
request's `n` choices: PrefillRequest.equal_prompts = n on each), so that a pass's leader waits for the ones
not here yet and their prompt is computed once (baton/engine/prefill.py shared_pieces).

Why: the choices' Prefill calls reach the worker a few milliseconds apart, and a pass's leader waits only
until no call arrived for PREFILL_SETTLE_S. On the 2-core CPU the first of 8 choices led a pass alone and
the other seven shared the next (benchmarks/results/http-choices-cpu-2026-12-06.json): two passes for one
prompt. With the announcement the leader expects the rest (ExactEngine.prefills' `expected`), at most
PREFILL_GATHER_S as for any expected call.

Lifecycle of one group (key: the prompt's ids):
    arrive(ids, n)   a call of the group opened its session: the first makes the group with n - 1 calls
                     still to come, each later one takes one off; the group ends when none is left
    pending()        the calls announced and not arrived yet, over the groups younger than EXPIRE_S
A group whose other calls never come (their client went away) is dropped after EXPIRE_S, so a stale
announcement costs later passes' leaders at most their gather wait (PREFILL_GATHER_S) for that long. Two
groups of the same prompt at once count as one: a leader then waits at most its gather time in vain.
"""

from __future__ import annotations

import threading
import time

EXPIRE_S = 0.5  # an announced group's calls arrive within milliseconds; past this they are not coming
MAX_GROUP = 128  # the most calls one announcement counts (the HTTP API's n is at most 128)


class Announced:
    def __init__(self, expire_s: float = EXPIRE_S, clock=time.monotonic):
        self.expire_s, self._clock = expire_s, clock
        self._groups: dict[tuple, list] = {}  # ids -> [calls still to come, when the first arrived]
        self._lock = threading.Lock()

    def arrive(self, ids, n: int) -> None:
        """A call with prompt `ids` announcing n equal calls (itself included; n <= 1: none) opened."""
        if n <= 1:
            return
        key, now = tuple(ids), self._clock()
        with self._lock:
            self._expire(now)
            g = self._groups.get(key)
            if g is None:
                self._groups[key] = [min(n, MAX_GROUP) - 1, now]
            elif g[0] <= 1:
                del self._groups[key]
            else:
                g[0] -= 1

    def pending(self) -> int:
        """Calls announced by the groups alive and not arrived yet."""
        with self._lock:
            self._expire(self._clock())
            return sum(g[0] for g in self._groups.values())

    def _expire(self, now: float) -> None:
        for key in [k for k, g in self._groups.items() if now - g[1] > self.expire_s]:
            del self._groups[key]
