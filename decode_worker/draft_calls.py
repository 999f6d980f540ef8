"""The decode worker's exact-mode RPCs: Draft (one session) and DraftMany (many sessions in one message).

    Draft(session, k, verdict)   apply the exact worker's verdict (accepted m, next token, and for mtp
                                 drafts the relayed hidden rows), then K drafts that follow the pending
                                 token; position = tokens consumed by the committed state (drafts excluded)
    DraftMany([Draft, ...])      each as its own Draft call, in one drafting batch (baton/worker/batched.py):
                                 the router's round batcher (router/batcher.py) sends a round's Drafts so,
                                 one RPC instead of one a session

Both run _draft_item (checks, the verdict, the sampling row) and _drafted (the response) around the
engine's Gather (DecodeEngine.drafts: call, or call_many), so a session's drafts are the same either way.

A structured session's drafts follow its grammar (_draft_grammar): its first Draft's history starts a Masker
(DecodeSession.draft_masker), each verdict's kept tokens advance it and each draft's pick is masked by it
(decode_worker/drafting.py). The drafts are proposals either way: the exact worker's Verify masks its rows.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import grpc

from baton import grammar
from baton.engine import rejection
from baton.engine.gather import unwrap
from baton.rpc import StatusError
from baton.v1 import decode_pb2
from baton.worker.batched import serve_many
from baton.worker.servicer import window_field
from decode_worker.mtp import MASKED_DRAFTS_ENV

INVALID = grpc.StatusCode.INVALID_ARGUMENT
log = logging.getLogger("baton.decode")


class DraftCalls:
    """Mixin of DecodeServicer (which gives engine, sessions, call, _session, _ids, _hidden, _set_sampling)."""

    def Draft(self, request, context):
        with self.call(context, "Draft"), self.sessions.hold(request.session_id):
            item = self._draft_item(request)
            return self._drafted(request, item, self.engine.drafts.call(item))

    def DraftMany(self, request, context):
        with self.call(context, "DraftMany"):
            outs = serve_many(self, request.requests, self._draft_item, self.engine.drafts.call_many, self._drafted)
            return decode_pb2.DraftManyResponse(
                outcomes=[decode_pb2.DraftOutcome(status=st, response=resp) for st, resp in outs]
            )

    def _draft_item(self, request) -> tuple:
        """A Draft request's checks and set-up -> its item for DecodeEngine.drafts."""
        s = self._session(request.session_id, request.engine)
        verdict = None
        if request.has_verdict:
            self._ids("next_token", [request.next_token])
            verdict = (request.accepted, request.next_token, self._hidden(s, request))
        elif request.accepted or request.next_token or request.HasField("verdict_hidden"):
            raise StatusError(INVALID, "has_verdict: false, but accepted/next_token/verdict_hidden are set")
        # drafts picked with the exact engine's noise
        self._set_sampling(s, request, proposing=True, fresh=not request.has_verdict)
        with window_field("k"):
            return self.engine.draft_item(request.session_id, request.k, verdict)

    def _drafted(self, request, item: tuple, got) -> decode_pb2.DraftResponse:
        """The DraftResponse of item's drafting result `got` (raised if an exception)."""
        with window_field("k"):
            drafts = unwrap(got)
        s = item[0]
        committed = s.draft_at  # the pending token's position, before drafting consumed t0, d1..d(k-1)
        table, probs = s.runner.sampling, []
        if s.slot in table.proposed:  # REJECTION policy: each draft's q' (d_i is at committed + i)
            probs = rejection.to_protos(table.proposals(s.slot, committed + 1, len(drafts)))
        rid, size = getattr(drafts, "round", (0, 0))  # drafting.Drafted: the batch's round
        resp = decode_pb2.DraftResponse(draft_tokens=drafts, position=committed, draft_probs=probs)
        if size:
            resp.round.id, resp.round.size = rid, size
        return resp

    def _draft_grammar(self, s, request, p, fresh: bool):
        """A structured session's Draft parameters p: kept masked while the session has a draft Masker, started
        on its first Draft after a load from the history the router sends (the generated tokens; the pending
        token is accepted by the first draft row, Masker.at); structured dropped (unconstrained drafts, as
        before 2026-12-08) without a history, where this worker cannot build the grammar (no tokenizer or
        xgrammar: the exact worker's Verify still masks), or with BATON_MTP_MASKED_DRAFTS=0 (the A/B)."""
        if fresh:
            s.draft_masker = None
            if request.HasField("history") and os.environ.get(MASKED_DRAFTS_ENV) != "0":
                h = request.history
                try:
                    c = grammar.constraint(self.engine.grammars, p.structured, self.vocab)
                    m = grammar.Masker(c, s.runner.sampling, s.slot)
                    m.start(h.token_ids[h.generated_from :], len(h.token_ids))  # next: the pending token's position
                    s.draft_masker = m
                except ValueError as e:  # grammar.Unavailable, or history the grammar refuses: the Verify decides
                    log.warning("session %s: its drafts go unconstrained (%s)", s.id, e)
        return p if s.draft_masker is not None else dataclasses.replace(p, structured=b"")
