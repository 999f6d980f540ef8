"""Request bodies that do not parse: INVALID_ARGUMENT naming the message type, one rate-limited log line.

grpc's own handling of a request deserializer that raises (e.g. `string` fields with invalid UTF-8, bytes
that are no protobuf at all) is INTERNAL "Exception deserializing request!" and a full traceback in the
log for every such request, so a hostile client could flood the log (issue 24). baton.rpc.build_server
installs `DecodeGuard` as a server interceptor after AuthInterceptor (an unauthenticated body is never
parsed): it replaces each method handler's request_deserializer by one that never raises and its
behaviour by one that answers INVALID_ARGUMENT for an unparsable message, for every service on the server
(Baton's, health, reflection), with no change to the generated *_pb2_grpc.py.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, NoReturn

import grpc
from google.protobuf.message import DecodeError


class RateLimitedLog:
    """warning(): at most `burst` lines at once, then one per `per_s` seconds; a suppressed line is counted
    into the next one written ("(N more suppressed)"). A hostile client cannot flood the log."""

    def __init__(
        self, logger: logging.Logger, *, per_s: float = 1.0, burst: int = 5, clock: Callable[[], float] = time.monotonic
    ):
        self._logger, self._per_s, self._burst, self._clock = logger, per_s, burst, clock
        self._lock = threading.Lock()
        self._tokens, self._last, self._suppressed = float(burst), clock(), 0

    def warning(self, msg: str, *args) -> bool:
        """True when the line was written."""
        with self._lock:
            t = self._clock()
            self._tokens = min(self._burst, self._tokens + (t - self._last) / self._per_s)
            self._last = t
            if self._tokens < 1:
                self._suppressed += 1
                return False
            self._tokens -= 1
            n, self._suppressed = self._suppressed, 0
        if n:
            msg, args = msg + " (%d more suppressed)", (*args, n)
        self._logger.warning(msg, *args)
        return True


class _Unparsable:
    """What a guarded request deserializer returns for bytes that do not parse (it never raises: grpc
    would answer INTERNAL "Exception deserializing request!" and log a traceback)."""

    __slots__ = ("error",)

    def __init__(self, error: Exception):
        self.error = error


def _why(error: Exception) -> str:
    """upb's "Error parsing message with type 'T': String field had bad UTF-8" -> "String field had bad UTF-8"."""
    text = str(error) or type(error).__name__
    return text.split("': ", 1)[1] if text.startswith("Error parsing message with type '") and "': " in text else text


def _type_name(deserializer: Callable, method: str) -> str:
    """ "baton.v1.GenerateRequest" for Message.FromString; else "the request of <method>"."""
    desc = getattr(getattr(deserializer, "__self__", None), "DESCRIPTOR", None)
    return getattr(desc, "full_name", None) or f"the request of {method}"


class DecodeGuard(grpc.ServerInterceptor):
    """A request body that does not parse as the method's request type (e.g. invalid UTF-8 in a `string`)
    ends INVALID_ARGUMENT "request: the body does not parse as <full type name>: ..." with one warning line
    (RateLimitedLog), never reaching the servicer. Streaming requests too: the bad message aborts the call
    wherever the servicer is reading it. Methods without a deserializer (LoadState: raw bytes) pass as they
    are; so does every call of a healthy client (one isinstance check per message)."""

    def __init__(self, log: RateLimitedLog | None = None):
        self.log = log or RateLimitedLog(logging.getLogger("baton.rpc"))
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}  # one per method

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        method = handler_call_details.method
        got = self._wrapped.get(method)
        if got is None or got[0] is not handler:
            got = self._wrapped[method] = (handler, self._guard(handler, method))
        return got[1]

    def _guard(self, h: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        parse, type_name = h.request_deserializer, _type_name(h.request_deserializer, method)

        def deserialize(data: bytes):
            try:
                return parse(data)
            except (DecodeError, UnicodeDecodeError) as e:
                return _Unparsable(e)

        def refuse(bad: _Unparsable, context, log: bool = True) -> NoReturn:
            if log:
                self.log.warning(
                    "%s from %s: the request body does not parse as %s: %s",
                    method,
                    context.peer(),
                    type_name,
                    _why(bad.error),
                )
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"request: the body does not parse as {type_name}: {_why(bad.error)}"
            )
            raise AssertionError("unreachable: context.abort returned")

        def unary(behavior):
            def guarded(request, context):
                if isinstance(request, _Unparsable):
                    refuse(request, context)
                return behavior(request, context)

            return guarded

        def stream(behavior, streaming_response: bool):
            def guarded(request_iterator, context):
                bad: list[_Unparsable] = []

                def checked():
                    for r in request_iterator:
                        if isinstance(r, _Unparsable):
                            bad.append(r)
                            refuse(r, context)
                        yield r

                def settle():  # NOTE: the servicer may have caught the abort and ended with a code of its own
                    if bad:
                        refuse(bad[0], context, log=False)

                if not streaming_response:
                    try:
                        resp = behavior(checked(), context)
                    except Exception:
                        settle()
                        raise
                    settle()
                    return resp

                def responses():
                    try:
                        yield from behavior(checked(), context)
                    except Exception:
                        settle()
                        raise
                    settle()

                return responses()

            return guarded

        kw = dict(request_deserializer=deserialize, response_serializer=h.response_serializer)
        if h.request_streaming and h.response_streaming:
            return grpc.stream_stream_rpc_method_handler(stream(h.stream_stream, True), **kw)
        if h.request_streaming:
            return grpc.stream_unary_rpc_method_handler(stream(h.stream_unary, False), **kw)
        if h.response_streaming:
            return grpc.unary_stream_rpc_method_handler(unary(h.unary_stream), **kw)
        return grpc.unary_unary_rpc_method_handler(unary(h.unary_unary), **kw)
