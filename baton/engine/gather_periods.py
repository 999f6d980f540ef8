"""Periods: the call periods of a Gather's keyed callers (PERIODIC, ROUND_BARRIER: sessions calling once a
round), what its leaders wait for (baton/engine/gather.py, "Round barrier").

Lifecycle of one key (a session): its first call records it (no period yet); each later call updates the
period's EMA (half the last gap, half the old figure); it is live while it called within two periods, and
forgotten when gone past eight (or at forget(), when its session ends). All methods run under the Gather's
condition lock.
"""

from __future__ import annotations

from typing import Hashable

SLOW = 1.5  # a round barrier does not wait for a caller whose period is past SLOW x the median (barrier)


class Periods:
    def __init__(self):
        self._seen: dict[Hashable, list[float]] = {}  # key -> [last call, its period's EMA or 0.0, first call]

    def clear(self) -> None:
        self._seen.clear()

    def forget(self, k: Hashable) -> None:
        self._seen.pop(k, None)

    def arrived(self, k: Hashable, now: float) -> None:
        """A call of `k` at `now` updates its period's EMA (from its second call on)."""
        seen = self._seen.get(k)
        if seen is None:
            self._seen[k] = [now, 0.0, now]
            return
        dt = now - seen[0]
        seen[0], seen[1] = now, dt if not seen[1] else 0.5 * seen[1] + 0.5 * dt

    def shortest(self) -> float:
        """The shortest known period (0.0 when none is known yet)."""
        return min((v[1] for v in self._seen.values() if v[1]), default=0.0)

    def live(self, now: float) -> list[tuple[Hashable, float, float, float]]:
        """[(key, last call, period, first call)] of the live keyed callers (period known, called within two
        periods); one gone past eight periods is forgotten."""
        live = []
        for k, (last, period, first) in list(self._seen.items()):
            if not period:
                continue
            if now - last >= 2 * period:
                if now - last > 8 * period:
                    del self._seen[k]  # long gone: forget it
                continue
            live.append((k, last, period, first))
        return live

    def barrier(self, now: float, queued: set, gather_s: float, max_wait_s: float) -> tuple[set, float]:
        """(the keys to wait for, until when) of a round barrier led from `now` (gather.py, "Round barrier"):
        every live keyed caller not queued whose period is at most SLOW x the live callers' median, until
        the latest one's due time + a quarter of its period (at least gather_s), at most max_wait_s. A
        slower caller (its client reading slowly, its Verify elsewhere) joins whichever batch it meets:
        waiting for it would hold every session to its pace."""
        live = self.live(now)
        if not live:
            return set(), now
        limit = SLOW * sorted(x[2] for x in live)[len(live) // 2]
        awaited, until = set(), now
        for k, last, period, _ in live:
            if k in queued or period > limit:
                continue
            awaited.add(k)
            until = max(until, last + period + max(gather_s, 0.25 * period))
        return awaited, min(until, now + max_wait_s)
