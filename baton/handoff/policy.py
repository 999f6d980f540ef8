"""What a hand-off ships: the MTP KV rule (who computes and who sends the MTP layer's KV rows) and the
draft-only rule (an exact session drafted by the MTP head alone gets only what its drafts read)."""

from __future__ import annotations

from baton.v1 import common_pb2

MTP_NAMES = ("mtp.key", "mtp.value")
# a draft-only state (StateHeader.draft_only) holds exactly these: what an mtp session that drafts from the
# exact worker's verdict hidden rows reads of the BF16 state (its first MTP pair: the prompt's last hidden
# row with the trailer's next_token; the MTP KV rows its chains attend to). Position and next_token ride in
# the header and trailer; the penalties' token history in the first Draft (DraftRequest.history).
DRAFT_ONLY_NAMES = ("hidden", *MTP_NAMES)


def needs_mtp_kv(engine: int) -> bool:
    """Whether a Prefill hand-off for a session of `engine` ships the MTP KV rows: only the mtp engine
    reads them, and UNSPECIFIED (the decode worker's default, unknown here) may be mtp. A bf16 / fp8
    session never switches engine, so for it they are bytes spent on the wire for nothing, and they are
    computed last, so they would be the tail of the hand-off. ExportState (migration: the
    target's engine is its own default) always ships them."""
    return engine in (common_pb2.ENGINE_UNSPECIFIED, common_pb2.MTP)


def computes_mtp_kv(exact: bool, engine: int, handed_off: bool) -> bool:
    """Whether a Prefill computes the MTP layer's KV (~1/(layers+1) of its compute): when its hand-off
    ships it (needs_mtp_kv), or when the session is kept (EXACT: a later ExportState ships it). A FAST
    Prefill for a bf16 / fp8 session, or one with no decode_target, skips it."""
    return exact or (handed_off and needs_mtp_kv(engine))


def draft_only_allowed(mode: int, engine: int) -> bool:
    """Whether a session may be handed off draft-only: EXACT (the exact worker keeps the whole state, and
    ExportState can still send it) and engine MTP (of the BF16 state, MTP drafts fed verdict hidden rows
    read nothing but DRAFT_ONLY_NAMES; bf16 / fp8 drafts run the whole model)."""
    return mode == common_pb2.EXACT and engine == common_pb2.MTP


def shipped(tensors: list, mtp_kv: bool) -> list:
    """The exported tensors a hand-off sends: all of them, or (mtp_kv False: see needs_mtp_kv) all but the
    MTP KV rows. A draft-only export (ExactEngine.export(only=DRAFT_ONLY_NAMES)) is already those alone."""
    return list(tensors) if mtp_kv else [t for t in tensors if t.name not in MTP_NAMES]
