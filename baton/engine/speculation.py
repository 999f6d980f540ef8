"""Speculation's rules, in one place: who proposes drafts, what a verify accepts, and how state rewinds.

A round over one session, whoever runs it (the decode worker's MTP loop, or exact mode's Draft on the
decode worker and Verify on the exact worker):
    propose   k drafts d1..dk after the pending token t0 (Drafter.propose picks each one)
    verify    verify_block: rows [t0, d1..dk] on the verifying model -> greedy g0..gk, where g_i follows
              t0, d1..d_i; m = accepted_length: the longest prefix with d_{i+1} == g_i; next = g_m
    rewind    the verifier keeps exactly t0, d1..dm (runner.accept_prefix: a copy of checkpoint row m, or
              a snapshot restore and a recompute); the drafter replays to the same point
              (rows_to_replay after a verdict)
    emit      tokens d1..dm, next: by row invariance bitwise the tokens plain AR would give
No module-level torch import: the router checks verdicts with check_verdict too.
"""

from __future__ import annotations

from baton.engine.parts import PartClock


class Drafter:
    """Chooses each draft token. The default proposes the drafting model's own greedy token; a benchmark
    passes another one (benchmarks/controlled_decode_worker.py) to control acceptance. Whatever it
    proposes is what the drafting state consumes next, so the state stays consistent with the drafts."""

    def attach(self, session, position: int, next_token: int) -> None:
        """Called when a session's state is loaded (position, pending token). May refuse: ValueError."""

    def propose(self, session, i: int, own: int) -> int:
        """Draft i (0-based) of a round, given the drafting model's own greedy token `own`."""
        return own

    def ahead(self, session, k: int) -> list | None:
        """A round's k drafts as far as they are known before its chain runs (they do not depend on the
        drafting model's picks): entry i is draft i, or None where draft i is the model's own pick (what
        propose returns). Then the chain runs on the device with one host read (decode_worker/mtp.py,
        BatchedRows.mtp_chain), and propose is not called; it must leave the drafter as k propose calls
        would. None: not known (a subclass that overrides propose only): the chain reads every step's pick
        and calls propose. The default drafter's drafts are the model's own: [None] * k."""
        return [None] * k if type(self).propose is Drafter.propose else None

    def judge(self, session, own: int, actual: int) -> bool:
        """Would a first draft have been accepted where the drafting model picked `own` and the verified
        token is `actual`? (Plain rounds learn the acceptance from their flush: decode_worker/mtp_launch.py.)
        Unlike propose, nothing is drafted: the drafter's state must not change what it proposes later."""
        return own == actual


GREEDY = Drafter()


def known_ahead(drafter: Drafter, rounds: list) -> list | None:
    """Drafter.ahead of every (session, k) of rounds, or None when the drafter does not know its drafts ahead
    (asked of the first session only: one drafter answers alike for all, and a None drew nothing)."""
    first = drafter.ahead(*rounds[0])
    return None if first is None else [first] + [drafter.ahead(s, k) for s, k in rounds[1:]]


def accepted_length(drafts: list[int], greedy: list[int], ends=()) -> int:
    """m: how many drafts the verifier accepts. greedy[i] is its token after t0, d1..d_i. ends: tokens the
    caller's decode stops at (a fast mtp round's: the call's stop and EOS ids, a reasoning phase's after_token):
    an accepted draft that is one ends the accept before it, so it is `next` (greedy[m] == drafts[m]) and the
    state holds nothing past it, as plain AR stopping there would leave it (the session may go on from it)."""
    m = 0
    while m < len(drafts) and drafts[m] == greedy[m] and drafts[m] not in ends:
        m += 1
    return m


def check_verdict(m: int, k: int) -> None:
    """A verdict of m accepted drafts out of k must satisfy 0 <= m <= k."""
    if not 0 <= m <= k:
        raise ValueError(f"accepted: {m} out of range 0..{k}")


def verify_block(runner, slot: int, tokens: list[int], ends=()) -> tuple[int, int]:
    """The verify of one block on `runner`: tokens = [t0, d1..dk] fed from the slot's position; keeps
    t0, d1..dm and sets the pending token to next. -> (m, next). Row invariance makes the kept state
    bitwise that of feeding t0, d1..dm alone. ends: accepted_length's."""
    st = runner.state
    pos0 = int(st.position[slot])
    runner.check_window(pos0, len(tokens))
    if len(tokens) > 1:  # a one-row block (a plain step) is never cut: nothing to rewind to
        runner.begin_block(slot)
    greedy = runner.rows(slot, tokens)
    m = accepted_length(tokens[1:], greedy, ends)
    runner.accept_prefix(slot, pos0, tokens, m)
    st.next_token[slot] = greedy[m]
    return m, greedy[m]


def verify_blocks(
    runner, blocks: list[tuple[int, list[int]]], hidden_out: list | None = None, clock=None, outputs=None, ends=None
) -> list[tuple[int, int]]:
    """verify_block for several sessions' blocks [(slot, [t0, d1..dk])] (distinct slots) in one batched
    rows pass (ModelRunner.rows_batch): each slot ends bitwise as verify_block alone would leave it.
    A block that accepts m < k drafts is rewound from its slot's snapshot and its m+1 kept rows are
    recomputed (one more batched pass for all such blocks; on the fused path only through the GDN
    layers, from the pass's kept inputs: BatchedRows.replay_kept): row and batch invariance make that
    state the one of feeding t0, d1..dm alone. One block: verify_block itself (its row checkpoints).
    hidden_out: a list that gets each block's final-normed hidden rows [k+1, hidden] (what the runner's
    h_rows holds after verify_block alone; the MTP pairs read them). clock: a parts.PartClock, marked
    "snapshot", "pass" (ends with the picks' host read), "restore", "replay". outputs(result): called once
    the picks are read and before the rewind is queued (the host reads of the pass's outputs then wait for
    nothing more). ends: per block, accepted_length's (None: none)."""
    clock = clock or PartClock(None)
    ends = ends or [()] * len(blocks)
    if len(blocks) == 1:
        res = [verify_block(runner, *blocks[0], ends[0])]
        if hidden_out is not None:
            hidden_out.append(runner.h_rows[: len(blocks[0][1])].clone())
        if outputs is not None:
            outputs(res)
        clock.mark("pass")
        return res
    st = runner.state
    # rows_batch validates the blocks (windows, ids) before it touches any state; a one-row block (no
    # drafts: a plain step) is never cut. Snapshot and rewind: a few kernels for all the slots at once.
    st.snapshot_slots([slot for slot, tokens in blocks if len(tokens) > 1])
    clock.mark("snapshot")
    picks = runner.rows_batch(blocks, ckpt_unused=True, hidden_out=hidden_out)
    out, redo = [], []
    for (slot, tokens), greedy, stop in zip(blocks, picks, ends):
        m = accepted_length(tokens[1:], greedy, stop)
        out.append((m, greedy[m]))
        if m + 1 < len(tokens):
            redo.append((slot, tokens[: m + 1]))
    if outputs is not None:
        outputs(out)
    clock.mark("pass")
    if redo:
        st.restore_slots([slot for slot, _ in redo])
        clock.mark("restore")
        br = runner.batched_rows if runner.fast is not None else None
        if br is None or not br.replay_kept(blocks, redo):  # fused: the kept rows through the GDN layers alone
            runner.rows_batch(redo, ckpt_unused=True)
        clock.mark("replay")
    from baton.transfer import write_slots  # here: the router imports this module without torch

    write_slots(st.next_token, [slot for slot, _ in blocks], [nxt for _, nxt in out])  # one copy, not one a slot
    return out


def rows_to_replay(drafts: list[int], t0: int, m: int) -> tuple[bool, list[int]]:
    """The drafter's rewind after a verdict of m out of k drafts, for a drafting state that consumed
    t0, d1..d_{k-1} (a bf16 / fp8 Draft call: dk is pending). -> (restore the snapshot taken before t0?,
    tokens to feed after that):
        m == k      nothing restored; feed dk (the state then holds t0, d1..dk)
        m == k - 1  the state already holds t0, d1..d_m: nothing to do
        m <  k - 1  restore, then feed t0, d1..dm"""
    k = len(drafts)
    check_verdict(m, k)
    if m == k:
        return False, [drafts[-1]]
    if m == k - 1:
        return False, []
    return True, [t0, *drafts[:m]]
