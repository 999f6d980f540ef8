"""The prefill worker's checks of request fields that are not the prompt's: decode_target, draft_only, and
the tail segment's chunk size (prefill_worker/service.py). Each bad field is INVALID_ARGUMENT naming it."""

from __future__ import annotations

import re

import grpc

from baton.handoff.policy import draft_only_allowed
from baton.rpc import StatusError
from baton.settings import Settings

INVALID = grpc.StatusCode.INVALID_ARGUMENT
_TARGET = re.compile(r"(?:[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,252})|\[[0-9A-Fa-f:.]{2,45}\]):(\d{1,5})")


def check_target(target: str) -> None:
    """decode_target must be HOST:PORT (a name, an IPv4 address or a bracketed IPv6 address): anything else
    (a gRPC URI scheme, control characters, no port) is INVALID_ARGUMENT, not a dial with odd errors."""
    m = _TARGET.fullmatch(target)
    if m is None or not 0 < int(m.group(1)) < 65536:
        raise StatusError(INVALID, f"decode_target: {target[:80]!r} is not HOST:PORT")


def check_draft_only(draft_only: bool, mode: int, engine: int) -> None:
    """PrefillRequest / ExportStateRequest.draft_only only for an EXACT session of engine MTP
    (baton/handoff/policy.py: draft_only_allowed): another session's decode worker reads its whole state."""
    if draft_only and not draft_only_allowed(mode, engine):
        raise StatusError(INVALID, "draft_only: only for an EXACT session of engine MTP (its drafts read nothing else)")


def check_tail_chunk_bytes(settings: Settings, chunk_bytes: int) -> int:
    """The tail segment's chunk size: settings.handoff_tail_chunk_bytes (0: no tail segment), at most the
    worker's chunk size (a larger value is that size: the tail's chunks are never the bigger ones)."""
    return min(settings.handoff_tail_chunk_bytes, chunk_bytes)
