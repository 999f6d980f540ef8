"""SlotTable: sessions keyed by id, each owning one slot of a runner's HybridState, with a TTL.

Both engines keep their sessions here (ExactEngine: one pool; DecodeEngine: one pool per runner).
Invariant: a slot is in exactly one place — a pool's free list or one live session.
on_free(pool, slot) runs whenever a slot goes back to a free list (release, TTL reap, replace, give_back):
the engines free the slot's KV pages there (baton/engine/pages.py), so every end of a session frees them.
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Callable, Generic, Hashable, TypeVar

S = TypeVar("S")  # a session object with .slot and .last_used


class SessionNotFound(KeyError):
    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class SessionLimit(RuntimeError):
    """No free slot: RESOURCE_EXHAUSTED."""


class SlotTable(Generic[S]):
    def __init__(
        self, ttl_s: float, pools: dict[Hashable, int], on_free: Callable[[Hashable, int], None] | None = None
    ):
        """pools: pool key -> slot count; on_free(pool, slot): a slot is free again (under the table's lock)."""
        self.ttl_s, self._on_free = ttl_s, on_free
        self._lock = threading.Lock()
        self._sessions: dict[str, tuple[Hashable, S]] = {}
        self._free = {k: list(range(n)) for k, n in pools.items()}
        self._slots = sum(pools.values())

    def _put(self, pool: Hashable, slot: int) -> None:
        """A slot back to its free list (the lock held)."""
        if self._on_free is not None:
            self._on_free(pool, slot)
        self._free[pool].append(slot)

    def __len__(self) -> int:
        with self._lock:
            return len(self._sessions)

    def __contains__(self, session_id: str) -> bool:
        """A live session of that id (get() would find it)."""
        with self._lock:
            return session_id in self._sessions

    def reserved(self) -> int:
        """Slots taken for sessions not yet published (a state being received)."""
        with self._lock:
            return self._slots - sum(len(f) for f in self._free.values()) - len(self._sessions)

    def sessions(self) -> list[S]:
        with self._lock:
            return [s for _, s in self._sessions.values()]

    def take(self, pool: Hashable, session_id: str | None, *, replace: bool, what: str) -> tuple[str, int]:
        """Reserves a free slot for a new session id (not yet visible to get()). With replace=True an
        existing session of that id is dropped first (a re-sent state), else its id is refused."""
        self.reap_expired()
        sid = session_id or uuid.uuid4().hex
        with self._lock:
            if sid in self._sessions:
                if not replace:
                    raise ValueError(f"session_id: {sid!r} already exists")
                old_pool, old = self._sessions.pop(sid)
                self._put(old_pool, old.slot)
            free = self._free[pool]
            if not free:
                raise SessionLimit(f"all {what} slots are in use")
            return sid, free.pop()

    def give_back(self, pool: Hashable, slot: int) -> None:
        """Returns a slot reserved by take() whose session never opened."""
        with self._lock:
            self._put(pool, slot)

    def publish(self, pool: Hashable, session_id: str, session: S) -> S:
        """Makes `session` visible under session_id; a session already there is replaced and its slot freed."""
        with self._lock:
            old = self._sessions.get(session_id)
            if old is not None and old[1] is not session:
                self._put(old[0], old[1].slot)
            self._sessions[session_id] = (pool, session)
        return session

    def open(
        self,
        pool: Hashable,
        session_id: str | None,
        make: Callable[[str, int], S],
        *,
        replace: bool = False,
        what: str = "session",
    ) -> S:
        sid, slot = self.take(pool, session_id, replace=replace, what=what)
        return self.publish(pool, sid, make(sid, slot))

    def get(self, session_id: str) -> S:
        with self._lock:
            entry = self._sessions.get(session_id)
            if entry is None:
                raise SessionNotFound(f"session_id: unknown or released session {session_id!r}")
            entry[1].last_used = time.monotonic()
            return entry[1]

    def release(self, session_id: str) -> bool:
        with self._lock:
            entry = self._sessions.pop(session_id, None)
            if entry is not None:
                self._put(entry[0], entry[1].slot)
            return entry is not None

    def reap_expired(self) -> int:
        """Releases every session idle longer than the TTL. The choice and the releases happen under
        one hold of the lock, so a session that get() touches meanwhile is never reaped."""
        now = time.monotonic()
        with self._lock:
            dead = [sid for sid, (_, s) in self._sessions.items() if now - s.last_used > self.ttl_s]
            for sid in dead:
                pool, s = self._sessions.pop(sid)
                self._put(pool, s.slot)
        return len(dead)
