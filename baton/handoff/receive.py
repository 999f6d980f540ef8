"""The decode worker's side of a hand-off: a StateChunk stream -> a fully verified ReceivedState.

    LoadState peeks the header (engine, MTP entries: peek_header), then receive_state builds the
    ExpectedLayout of the receiving runner's HybridState (layout_of), feeds every chunk through
    decode.StateReceiver (chunk digests verified in the pool as chunks arrive, then the manifest) and
    returns a ReceivedState or raises a wire.StateError (its `.code` is the gRPC status); nothing partial
    escapes. The engine copies into a free slot only then (slot_fill.SlotFill).

MTP KV entries (`mtp.key`, `mtp.value`: the MTP layer's KV rows for the prompt):
  * sent, and the receiver has an MTP head        -> loaded as usual;
  * not sent (a prefill worker without the head, or a Prefill for a bf16 / fp8 session: needs_mtp_kv)
                                                  -> accepted; the rows are zero-filled. The MTP layer
    then attends to zero keys/values over the prompt: drafts get worse (lower acceptance) but every
    draft is verified by the BF16 rows, so the output is unchanged;
  * sent to a receiver without an MTP head        -> accepted and dropped after the digests covered
    them (a prefill worker with the head can feed any decode worker; the cost is wire bytes only).

A draft-only state (StateHeader.draft_only; baton/handoff/policy.py: DRAFT_ONLY_NAMES): only where the
caller says its engine reads one (draft_only_ok: the mtp engine) and only for mode EXACT, else
INVALID_ARGUMENT; its table must hold exactly `hidden`, `mtp.key` and `mtp.value` (INVALID_ARGUMENT
otherwise), and the result holds those alone (ReceivedState.draft_only): nothing is zero-filled for the GDN
and attention entries it leaves out. A state not marked so is checked against the whole layout, as before:
one that lacks entries is refused (INVALID_ARGUMENT, "tensors: missing ..."). The flag is in the header, so
the manifest covers it: flipping it in flight fails the layout check or, if the table is rewritten to
match, the manifest (DATA_LOSS).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Callable, Iterable, Mapping

import torch

from baton.handoff.decode import decode_stream
from baton.handoff.layout import ExpectedLayout, LayoutEntry, ReceivedState
from baton.handoff.policy import DRAFT_ONLY_NAMES, MTP_NAMES
from baton.handoff.wire import StateCorrupt, StateInvalid
from baton.v1 import common_pb2, state_pb2


def layout_of(state) -> dict:
    """receive_state keyword arguments describing a baton.engine.state.HybridState (window = max_len - 1:
    a loaded state must leave room to consume its pending next_token)."""
    return dict(
        state_layout=state.layout(),
        kv_dims=(state.cfg.num_key_value_heads, state.cfg.head_dim),
        max_position=state.max_len - 1,
    )


def peek_header(chunk) -> state_pb2.StateHeader | None:
    """The StateHeader of a first message (StateChunk or its bytes), or None if it is not one."""
    if chunk is None:
        return None
    if not isinstance(chunk, state_pb2.StateChunk):
        if bytes(chunk[:1]) == b"\x12":  # a data frame: never a header
            return None
        try:
            chunk = state_pb2.StateChunk.FromString(bytes(chunk))
        except Exception:  # noqa: BLE001 - the receiver reports it as DATA_LOSS
            return None
    return chunk.header if chunk.WhichOneof("part") == "header" else None


def _entries(state_layout: Mapping, kv_dims: tuple[int, int]) -> dict[str, LayoutEntry]:
    """HybridState.layout() (name -> (kind, dtype, fixed shape | None for KV)) -> LayoutEntry map."""
    return {
        name: LayoutEntry(kind, dtype, shape, None if shape is not None else tuple(kv_dims))
        for name, (kind, dtype, shape) in state_layout.items()
    }


def receive_state(
    chunks: Iterable,
    *,
    state_layout: Mapping,
    kv_dims: tuple[int, int],
    max_position: int,
    fingerprint: str,
    max_total_bytes: int | None = None,
    alloc=None,
    on_tensor: Callable[[str, torch.Tensor], None] | None = None,
    draft_only_ok: bool = False,
) -> ReceivedState:
    """Verifies one whole stream (StateChunk messages or their bytes) against the receiving state's
    layout and returns it; raises wire.StateError (.code = gRPC status name). The returned tensors
    hold exactly the names of `state_layout` (MTP entries zero-filled or dropped, see module doc).
    max_total_bytes None = the layout's size at max_position. Messages are pulled on a helper thread
    (wire.pipelined), so receiving overlaps verification. on_tensor(name, cpu tensor): each tensor of
    `state_layout` that was sent, as soon as its chunks verified (see wire.StateReceiver); the
    zero-filled ones only come with the result. draft_only_ok: a draft-only state is accepted (see the
    module doc; the caller's engine is mtp)."""
    it = iter(chunks)
    first = next(it, None)
    if first is None:
        raise StateCorrupt("stream ended without a header")
    header = peek_header(first)
    entries = _entries(state_layout, kv_dims)
    if header is not None and header.draft_only:
        entries = _draft_only(header, entries, draft_only_ok)
        got = decode_stream(
            itertools.chain((first,), it), ExpectedLayout(entries, max_position), fingerprint,
            max_total_bytes or _limit(entries, max_position), alloc=alloc, on_tensor=on_tensor,
        )  # fmt: skip
        return dataclasses.replace(got, draft_only=True)
    sent = {s.name for s in header.tensors} & set(MTP_NAMES) if header is not None else set()
    kv = next((e for e in entries.values() if e.kv_dims is not None), None)
    zero_fill: dict[str, LayoutEntry] = {}
    drop: list[str] = []
    if all(n in entries for n in MTP_NAMES):
        if header is not None and not sent:
            zero_fill = {n: entries.pop(n) for n in MTP_NAMES}
    elif sent and kv is not None:
        kinds = {"mtp.key": "attn_key", "mtp.value": "attn_value"}
        for n in sorted(sent):
            entries[n] = LayoutEntry(kinds[n], kv.dtype, None, kv.kv_dims)
            drop.append(n)
    layout = ExpectedLayout(entries, max_position)
    if max_total_bytes is None:
        max_total_bytes = _limit(layout.entries, max_position)
    placed = None if on_tensor is None else (lambda name, t: None if name in drop else on_tensor(name, t))
    got = decode_stream(
        itertools.chain((first,), it), layout, fingerprint, max_total_bytes, alloc=alloc, on_tensor=placed
    )
    if not zero_fill and not drop:
        return got
    tensors = {k: v for k, v in got.tensors.items() if k not in drop}
    for n, e in zero_fill.items():  # [kv_heads, position, head_dim], zero-stride: no host memory, and
        tensors[n] = torch.zeros((), dtype=e.dtype).expand(e.shape_at(got.position))  # filled on the device
    return dataclasses.replace(got, tensors=tensors)


def _limit(entries: Mapping[str, LayoutEntry], max_position: int) -> int:
    """The bytes of a state holding `entries` at the window's position: the largest a stream may declare."""
    return sum(math.prod(e.shape_at(max_position)) * e.dtype.itemsize for e in entries.values())


def _draft_only(header, entries: dict[str, LayoutEntry], ok: bool) -> dict[str, LayoutEntry]:
    """The layout a draft-only header is checked against (DRAFT_ONLY_NAMES of `entries`), or StateInvalid:
    a receiver whose engine does not read one, a mode other than EXACT, or a table that is not exactly those
    names (decode.StateReceiver then checks their kinds, dtypes and shapes as for any state)."""
    if not ok or not all(n in entries for n in DRAFT_ONLY_NAMES):
        raise StateInvalid("draft_only: this engine does not load a draft-only state (only mtp drafts for exact mode)")
    if header.mode != common_pb2.EXACT:
        raise StateInvalid(f"draft_only: a draft-only state is for mode EXACT, not {header.mode}")
    names = sorted(s.name for s in header.tensors)
    if names != sorted(DRAFT_ONLY_NAMES):
        raise StateInvalid(f"tensors: a draft-only state holds exactly {sorted(DRAFT_ONLY_NAMES)}, not {names[:6]}")
    return {n: entries[n] for n in DRAFT_ONLY_NAMES}
