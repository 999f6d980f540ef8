"""DecodeSession: one decode-worker session's record (DecodeEngine's table): its runner and slot, and what
exact-mode drafting and MTP rounds keep between calls. Made when a LoadState commits
(handoff/slot_fill.py), read and updated under the engine's locks, dropped when the session ends (release,
TTL, migration); the slot's device state lives in the runner's HybridState, never here."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from baton.engine.draft_cap import SessionCap
from baton.engine.runner import ModelRunner


@dataclass
class DecodeSession:
    id: str
    engine: str
    runner: ModelRunner
    slot: int
    created: float
    last_used: float
    # exact-mode drafting (fp8 / bf16 drafts): drafts of the last Draft call and the token fed first
    drafts: list[int] = field(default_factory=list)
    draft_t0: int = 0  # exact mode, each Draft: the pending token and its position (the committed tokens')
    draft_at: int = 0  # (read with the batch's other slots, not by each Draft handler from the device)
    # mtp: pairs (hidden row, token) whose MTP KV rows are not final yet, starting at KV index mtp_start
    mtp_pairs_h: torch.Tensor | None = None
    mtp_pairs_ids: list[int] = field(default_factory=list)
    mtp_start: int = 0
    mtp_h_more: list = field(default_factory=list)  # plain rounds' hidden rows not joined yet (mtp.pairs_h)
    mtp_inflight: int = 0  # plain rounds launched whose tokens were not read yet (mtp_launch)
    mtp_undelivered: int = 0  # tokens read from rounds not handed to the scheduler's job yet (mtp_launch)
    # the ends of its fast mtp decode call (stop and EOS ids, a reasoning phase's after_token): a round's accept
    # stops at one (speculation.accepted_length), so the state never holds a token past where the call ended
    round_ends: frozenset = frozenset()
    masker: object = None  # its grammar's baton.grammar.Masker while a structured decode runs (constrained.py)
    draft_masker: object = None  # exact mode: its grammar's Masker for its drafts' picks (draft_calls, drafting)
    rounds: int = 0
    emitted_in_rounds: int = 0
    draft_cap: SessionCap = field(default_factory=SessionCap)  # its own K under the batch's (fast mtp rounds)
    exact: bool = False  # has drafted (exact mode): counted by the Draft gather
    draft_only: bool = False  # exact mtp: verdicts with hidden rows, or a draft-only load: BF16 state never advanced
    # the slot's position while the host knows it (as loaded, or as an mtp Draft batch left it); a Decode or
    # Draft batch reads it here, not from the device (a blocking read), and clears it before moving the state
    loaded_position: int | None = None

    def position(self) -> int:
        """The slot's position: loaded_position while the host knows it, else read from the device (blocking)."""
        return self.loaded_position if self.loaded_position is not None else int(self.runner.state.position[self.slot])

    @property
    def mean_accept_len(self) -> float:
        return self.emitted_in_rounds / self.rounds if self.rounds else 0.0
