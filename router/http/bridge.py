"""The HTTP front door's way into the router's own Generate: in process, the same code path as gRPC.

    stream = GenerateStream(servicer, request, out=queue, index=i, loop=loop)   # starts a thread
    item = await queue.get()       # (i, GenerateResponse) ... (i, END) | (i, StatusError)
    stream.cancel()                # the HTTP client left: downstream calls cancelled, sessions released

`RouterServicer.Generate(request, context)` is a plain generator; it uses three things of its gRPC
context, which LocalContext provides: time_remaining() (None: no client deadline), add_callback(fn)
(fn = Calls.cancel, run by cancel(); False once cancelled, as grpc answers for an ended RPC) and
abort(code, message) (raises StatusError, the code and message the gRPC client would get). So
admission (max_inflight), validation, hand-off, migration, exact mode, metrics and the request log line
are Generate's own. A thread drives the generator (it blocks on the workers' streams); each message is
handed to the event loop with call_soon_threadsafe.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import grpc

from baton.rpc import StatusError

log = logging.getLogger("baton.router.http")
END = object()


class LocalContext:
    """The subset of grpc.ServicerContext that RouterServicer.Generate uses."""

    def __init__(self, timeout: float | None = None):
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._lock = threading.Lock()
        self._callbacks: list = []
        self._cancelled = False

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def add_callback(self, fn) -> bool:
        with self._lock:
            if self._cancelled:
                return False
            self._callbacks.append(fn)
            return True

    def abort(self, code: grpc.StatusCode, details: str):
        raise StatusError(code, details)

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def cancel(self) -> None:
        """Runs the registered callbacks once (from any thread)."""
        with self._lock:
            if self._cancelled:
                return
            self._cancelled = True
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            try:
                fn()
            except Exception:  # a callback's failure must not keep the others from running
                log.exception("cancel callback failed")


class GenerateStream:
    """One Generate call on its own thread; its messages go to `out` as (index, item)."""

    def __init__(
        self,
        servicer,
        request,
        *,
        out: asyncio.Queue,
        index: int,
        loop: asyncio.AbstractEventLoop,
        timeout: float | None = None,
    ):
        self.ctx = LocalContext(timeout)
        self._out, self._index, self._loop = out, index, loop
        self._thread = threading.Thread(
            target=self._run, args=(servicer, request), daemon=True, name=f"baton-http-generate-{index}"
        )
        self._thread.start()

    def _put(self, item) -> None:
        try:
            self._loop.call_soon_threadsafe(self._out.put_nowait, (self._index, item))
        except RuntimeError:  # the event loop is gone (server shut down): nobody is listening
            pass

    def _run(self, servicer, request) -> None:
        try:
            gen = servicer.Generate(request, self.ctx)
            try:
                for msg in gen:
                    self._put(msg)
                    if self.ctx.cancelled:
                        break
            finally:
                gen.close()  # GeneratorExit inside Generate: CANCELLED, sessions released
            self._put(END)
        except StatusError as e:
            self._put(e)
        except Exception:  # a router bug: what gRPC would report as UNKNOWN
            log.exception("Generate failed")
            self._put(StatusError(grpc.StatusCode.INTERNAL, "router: internal error (see the router's log)"))

    def cancel(self) -> None:
        self.ctx.cancel()
