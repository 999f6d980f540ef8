"""The prefill worker's exact-mode RPCs: Verify (one session's block) and VerifyMany (many in one message).

    Verify(session_id, [last committed, d1..dK])  -> accepted m, next token, position, counters (and the
                                                     kept rows' hidden rows when asked)
    VerifyMany([Verify, ...])                     each as its own Verify call, in one verify pass
                                                  (baton/worker/batched.py): the router's round batcher
                                                  (router/batcher.py) sends a round's blocks so

Both run _verify_item (checks) and _verified (the response) around the engine's Gather (ExactEngine.verifies:
call, or call_many), so a session's verdict is the same either way.
"""

from __future__ import annotations

import grpc

from baton import hidden_rows, sampling_rules
from baton.rpc import StatusError
from baton.v1 import prefill_pb2
from baton.worker.batched import serve_many
from baton.worker.servicer import window_field

INVALID = grpc.StatusCode.INVALID_ARGUMENT


class VerifyCalls:
    """Mixin of PrefillServicer (which gives engine, sessions, call)."""

    def Verify(self, request, context):
        with self.call(context, "Verify"), self.sessions.hold(request.session_id):
            item = self._verify_item(request)
            return self._verified(request, item, self.engine.verifies.call(item))

    def VerifyMany(self, request, context):
        with self.call(context, "VerifyMany"):
            outs = serve_many(self, request.requests, self._verify_item, self.engine.verifies.call_many, self._verified)
            return prefill_pb2.VerifyManyResponse(
                outcomes=[prefill_pb2.VerifyOutcome(status=st, response=resp) for st, resp in outs]
            )

    def _verify_item(self, request):
        """A Verify request's checks -> its VerifyItem for ExactEngine.verifies."""
        if len(request.tokens) > self.engine.runner.width:  # before list(), as for prompt_ids
            n, w = len(request.tokens), self.engine.runner.width
            raise StatusError(INVALID, f"tokens: {n} tokens; a block is [last committed, d1..dK] with K < W = {w}")
        with window_field("tokens"):
            tag = (request.round.id, request.round.size) if request.round.size else None
            return self.engine.verify_item(
                request.session_id, list(request.tokens), request.draft_probs, request.want_hidden, tag
            )

    def _verified(self, request, item, got) -> prefill_pb2.VerifyResponse:
        """The VerifyResponse of item's pass result `got` (raised if an exception)."""
        with window_field("tokens"):
            r = self.engine.verified(item, got)
        c = r.counters
        picked = list(request.tokens[1 : r.accepted + 1]) + [r.next_token]
        return prefill_pb2.VerifyResponse(
            logprobs=sampling_rules.logprob_protos(r.logprobs, picked),
            accepted=r.accepted,
            next_token=r.next_token,
            position=r.position,
            counters=prefill_pb2.SessionCounters(
                drafted=c.drafted,
                accepted=c.accepted,
                rejected_blocks=c.rejected_blocks,
                verify_blocks=c.verify_blocks,
                acceptance_rate=c.acceptance_rate,
            ),
            hidden=hidden_rows.encode(r.hidden) if r.hidden is not None else None,
        )
