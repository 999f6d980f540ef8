"""Batched RPCs on a worker (DecodeWorker.DraftMany, PrefillWorker.VerifyMany): many sessions' calls in one
message, each run as its own unary call would be, with a status of its own.

    outcomes = serve_many(servicer, requests, prepare, run, respond)

Lifecycle of one batched RPC (inside ServicerBase.call, which counts it and maps a whole-RPC failure):
    1. per request, in order: hold its session (SessionLocks: ABORTED when busy, a session twice in one
       batch included), then prepare(request) -> its engine item (the unary handler's checks and set-up);
    2. run(items) -> per item its result or its exception: the items of every prepared request, in one
       call of the engine's Gather (call_many), so they share passes as concurrent unary calls would;
    3. respond(request, item, result) -> its response message.
An exception in 1 or 3, or an exception result of 2, fails that request alone: its outcome carries the status
the unary call would have ended with (ServicerBase.status_of); the others go on. The sessions are held until
every response is built. Nothing of one request depends on the others (batch invariance is the Gather's
batch functions': baton/engine/speculation.py verify_blocks, decode_worker/drafting.py draft_batch).
"""

from __future__ import annotations

import logging
from contextlib import ExitStack
from typing import Callable

import grpc

from baton.v1 import common_pb2

log = logging.getLogger("baton.worker")


def serve_many(servicer, requests, prepare: Callable, run: Callable, respond: Callable) -> list:
    """See the module doc -> per request (common_pb2.ItemStatus, response or None)."""
    out: list = [None] * len(requests)
    servicer.count_batched(len(requests))
    with ExitStack() as held:
        todo: list[tuple[int, object]] = []
        for i, req in enumerate(requests):
            try:
                held.enter_context(servicer.sessions.hold(req.session_id))
                todo.append((i, prepare(req)))
            except Exception as e:  # noqa: BLE001 - this request's own fault, its own status
                out[i] = _failed(servicer, e)
        results = run([item for _, item in todo]) if todo else []
        for (i, item), got in zip(todo, results):
            try:
                out[i] = (common_pb2.ItemStatus(), respond(requests[i], item, got))
            except Exception as e:  # noqa: BLE001
                out[i] = _failed(servicer, e)
    return out


def _failed(servicer, e: BaseException) -> tuple:
    code, message = servicer.status_of(e)
    if code == grpc.StatusCode.INTERNAL:
        log.warning("batched call item failed: %s", message, exc_info=e)
    return common_pb2.ItemStatus(code=code.value[0], message=message), None
