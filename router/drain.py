"""The router's requests in flight at shutdown (stop_router: SIGTERM / SIGINT of `python -m router` and
`baton serve`).

    drain = Drain()
    drain.enter(calls) -> bool      # a Generate starts its downstream calls: False once stopping
    drain.leave(calls)              # ... and ends, however it ends
    drain.stop(grace) -> int        # no new requests; those in flight get `grace` s to finish, then the
                                    # rest are cancelled (their downstream calls, their sessions released)
    drain.cut(calls) -> bool        # was this request cancelled by stop()?

A request cut by stop() ends UNAVAILABLE with SHUTTING_DOWN on either door (gRPC status; HTTP 503, or an
error chunk once streaming), a status a client can retry on another router, and is logged so; before this
the gRPC server cancelled it after its grace ("UNAVAILABLE: Cancelling all calls", logged CANCELLED) and
uvicorn cut HTTP streams with no error and a traceback, a second grace later.
"""

from __future__ import annotations

import threading

SHUTTING_DOWN = "router: shutting down; retry on another router"


class Drain:
    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._live: set = set()  # router.calls.Calls of the requests in flight
        self._cut: set[int] = set()  # id() of the Calls stop() cancelled
        self.stopping = False

    def enter(self, calls) -> bool:
        with self._cv:
            if self.stopping:
                return False
            self._live.add(calls)
            return True

    def leave(self, calls) -> None:
        with self._cv:
            self._live.discard(calls)
            self._cut.discard(id(calls))
            self._cv.notify_all()

    def cut(self, calls) -> bool:
        with self._cv:
            return id(calls) in self._cut

    def stop(self, grace: float) -> int:
        """Refuses new requests, waits up to `grace` s for those in flight, cancels the rest; -> how many."""
        with self._cv:
            self.stopping = True
            self._cv.wait_for(lambda: not self._live, timeout=max(0.0, grace))
            left = list(self._live)
            self._cut.update(id(c) for c in left)
        for calls in left:
            calls.cancel()
        return len(left)
