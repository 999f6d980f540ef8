"""The mtp rounds scheduler's launch (DecodeEngine._mtp_batched): plain rounds pipelined as batched AR steps,
speculative rounds computed at once.

    launch(engine, runner, slots, left) -> Launched     StepScheduler(multi=True, launch=...)'s launch: one
                                                          round of the mtp sessions in `slots` of `runner`

Why. At a large batch the verify rows are no longer free and the controller (baton/engine/draft_length.py)
runs K = 0: plain rounds. Run as a one-row verify (mtp.rounds) each such round paid the rows pass's host
work (window checks, per-session hidden copies and pair joins, two host syncs) with the device idle: on
the H200 at 32 streams ~22 ms a round against ~7 ms for a pipelined batched AR step. A plain round here IS
that step (ModelRunner.ar_batch_launch: the "arb" graph, launched before the previous round's tokens are
read), so fast mtp at K = 0 runs as fast bf16 does.

A plain round (every session at K = 0). The step consumes each slot's pending token and sets the next;
its final-normed hidden rows are copied on the device right after it (one copy a round: the rows
state.hidden gets), and each session's pending MTP pair (h_p, next) is appended when its token is read
(mtp_h_more, mtp_pairs_ids): the pairs mtp.chains finalises later, bitwise the ones a one-row verify
leaves (the AR step and the one-row rows pass are the same row's arithmetic: row and batch invariance).
Before a session's pending pairs would outgrow one MTP pass (mtp.flush_at), the round first flushes them:
the pairs read so far, of every session, finalised together in one MTP pass (mtp.flush_later: chains'
first pass), keeping the last of them pending, as a flushed one-row verify round leaves it. The rounds in
flight stay in flight (their pairs are appended when read, after the kept one): the flush's pass queues
behind them and writes only MTP KV rows and its own buffers, which they do not touch, so the pipeline never
drains for it (until 2026-12-06 it drained first: every flush_at rounds the device idled while the host
handed out the drained tokens and relaunched, part of fast mtp's 5% gap to bf16 at K = 0, 32 streams).
Nor does the host wait for it: its picks (the controller's judged first drafts, _flush) are read once a
round launched after it is read, when the stream has passed the pass (until 2026-12-07 they were read at
once: the host waited for the two rounds in flight and the pass before it launched the next round, and the
device idled while it launched; BATON_MTP_FLUSH_LATER=0 reads them at once again, for the A/B).

A speculative round (K > 0, or a session capped). The plain rounds still in flight are read first
(drain: their tokens and pairs land on the host) and handed to the consumers (StepScheduler.settle: not
held back until after this round), then mtp.rounds runs the chains and the verify at once;
its result is handed to the scheduler at once (Launched.ready). `left` (the scheduler's count) is cut by the
tokens read but not yet handed over (mtp_undelivered), so a round never drafts past a session's end.

Joins (BATON_MTP_JOIN_HOLD=1, or 2; off until measured on a GPU). A speculative round runs at once, so
sessions loaded meanwhile wait for its end to join, and on a shared GPU its passes slow the prefill of the
next prompts. While a wave of sessions joins (at least max(2, a quarter of the round's sessions) have run
fewer than HOLD_ROUNDS rounds) the round is plain, whatever K the controller asked for; the controller
observes a plain round. With 2, also while states land (`landing`: a LoadState in progress, or a
fast mtp session loaded within JOINED_S that has not joined): a wave's tail, its last sessions speculating
beside the next wave's prefill, ran rounds of one session at 100-800 ms on an H100 (a K = 1-2 round of 1-3
sessions took 10-19 ms there; benchmarks/results/gpu-h100-2026-12-07-stop59.md). The tokens are the same
either way (a session's tokens do not depend on its K). On an H100 at 32 streams fast mtp ran 15
speculative rounds of 58-131 ms beside 915 plain ones of 9.6 ms, and its TTFT p50 was 0.63 s against
bf16's 0.37 (benchmarks/results/gpu-h100-2026-12-06-stop52.md).

Bookkeeping per session: mtp_inflight (plain rounds launched, tokens not read), mtp_undelivered (tokens
read, not yet collected by the scheduler). Launched.result() reads a round once (the drain, or the
scheduler's collect, whichever comes first); Launched() is the scheduler's collect.
The controller observes each round: a plain round's seconds are the device's between two reads (collect
to collect, or from its launch if the device was idle; a flush's pass lies between two reads, so it is
counted once, in the round read after it); a speculative round's, its own (measured after the drain).
All of it runs in the rounds scheduler's thread: launch under the engine's compute lock, the collect
outside it (as the bf16 step scheduler's).
"""

from __future__ import annotations

import logging
import os
import time

import torch

from decode_worker import mtp

log = logging.getLogger("baton.decode")
DEAR_S = 0.05  # a speculative round at least this long (drain included) is logged, at most once a LOG_EVERY_S
LOG_EVERY_S = 1.0
JOINED_S = 0.5  # ... with how many of its sessions were loaded this recently (a wave of sessions joining)
HOLD_ENV = "BATON_MTP_JOIN_HOLD"  # "1": no speculative round while a wave joins; "2": nor while states land
HOLD_ROUNDS = 4  # a session is joining for its first HOLD_ROUNDS rounds
LATER_ENV = "BATON_MTP_FLUSH_LATER"  # "0": a flush's picks are read at once, as until 2026-12-07 (its A/B)


class Launched:
    """One round of the rounds scheduler (module doc): result() reads it once; calling it hands the
    tokens to the scheduler (each session's list)."""

    def __init__(self, engine, sessions: list, read, ready: bool = False):
        self.engine, self.sessions, self._read = engine, sessions, read
        self.ready = ready  # computed at once: the scheduler hands it out now (StepScheduler, module doc)
        self._out: list[list[int]] | None = None
        self._err: BaseException | None = None
        engine._mtp_launched.append(self)

    def result(self) -> list[list[int]]:
        if self._out is None and self._err is None:
            try:
                self._out = self._read()
            except BaseException as e:  # noqa: BLE001 - re-raised to each caller
                self._err = e
            else:
                for s, toks in zip(self.sessions, self._out):
                    s.mtp_undelivered += len(toks)
        if self._err is not None:
            raise self._err
        return self._out

    def __call__(self) -> list[list[int]]:
        try:
            out = self.result()
        finally:
            if self in self.engine._mtp_launched:
                self.engine._mtp_launched.remove(self)
        for s, toks in zip(self.sessions, out):
            s.mtp_undelivered -= len(toks)
        return out


def joining(sessions: list, engine=None) -> bool:
    """With BATON_MTP_JOIN_HOLD=1 or 2: a wave of sessions joins, at least max(2, a quarter of the sessions)
    have launched fewer than HOLD_ROUNDS rounds (read or in flight); with 2 also while landing(engine) (states
    being received, or fast mtp sessions loaded within JOINED_S that have not joined yet: they would wait for
    the round, and on a shared GPU their prompts' prefill runs beside it). Always False with it off (the
    default)."""
    mode = os.environ.get(HOLD_ENV, "0")
    if mode not in ("1", "2"):
        return False
    young = sum(s.rounds + s.mtp_inflight < HOLD_ROUNDS for s in sessions)
    return young >= max(2, len(sessions) // 4) or (mode == "2" and engine is not None and landing(engine, JOINED_S) > 0)


def landing(engine, within_s: float) -> int:
    """States the engine is receiving, and its fast mtp sessions loaded within `within_s` not joined yet."""
    now, joined, table = time.monotonic(), engine.mtp_jobs, engine._table
    fresh = [s for s in table.sessions() if s.engine == "mtp" and not s.exact and now - s.created < within_s]
    return table.reserved() + sum((id(s.runner), s.slot) not in joined for s in fresh)


def drain(engine) -> None:
    """Reads every round still in flight, in launch order (their pairs land on the host)."""
    for launched in list(engine._mtp_launched):
        launched.result()


def launch(engine, runner, slots: list[int], left: list[int]) -> Launched:
    """One round of the sessions in `slots` (module doc): plain rounds launched, others computed now."""
    jobs = [engine.mtp_jobs[(id(runner), slot)] for slot in slots]
    sessions = [s for s, _ in jobs]
    ctl = mtp.control(engine)
    K = ctl.next_k(batch=len(sessions))
    if K and joining(sessions, engine):
        K = 0  # a wave of sessions joins: a plain round (module doc, Joins)
    own = mtp.own_caps(ctl, K, sessions)
    if not any(own):  # K = 0, or every session's own acceptance caps it at 0: a pipelined plain round
        if any(len(s.mtp_pairs_ids) + s.mtp_inflight >= mtp.flush_at(runner) for s in sessions):
            _flush(engine, sessions)  # the pairs read so far; the rounds in flight stay in flight
        return _plain(engine, ctl, runner, sessions)
    t0 = time.perf_counter()
    drain(engine)
    rest = [n - s.mtp_undelivered for s, n in zip(sessions, left)]  # tokens left once the drained are handed over
    engine._rounds.settle()  # ... handed over now, before this round's compute (counted in `rest` above)
    live = [i for i, n in enumerate(rest) if n > 0]
    items = [(jobs[i][0], mtp.round_cap(jobs[i][0], jobs[i][1], rest[i])) for i in live]
    t1 = time.perf_counter()
    got = mtp.rounds(engine, items, K, [own[i] for i in live]) if items else []
    engine._mtp_last_read = time.perf_counter()
    _note_dear(engine, K, sessions, t0, t1, engine._mtp_last_read, sum(o < K for o in own))
    out: list[list[int]] = [[] for _ in sessions]
    for i, toks in zip(live, got):
        out[i] = toks
    return Launched(engine, sessions, lambda: out, ready=True)


def _note_dear(engine, K: int, sessions: list, t0: float, t1: float, t2: float, capped: int = 0) -> None:
    """Logs a dear speculative round (at least DEAR_S from its drain to its end; at most one line a
    LOG_EVERY_S): its K, sessions, how many were loaded within JOINED_S and how many their own acceptance capped
    below K (mtp.own_caps), the drain's and the round's ms. Which rounds cost fast mtp its time against bf16
    under load (stop 52: 15 rounds of 58-131 ms at 32 sessions)."""
    if t2 - t0 < DEAR_S or t2 - getattr(engine, "_mtp_dear_logged", float("-inf")) < LOG_EVERY_S:
        return
    engine._mtp_dear_logged = t2
    now = time.monotonic()
    young = sum(now - s.created < JOINED_S for s in sessions)
    log.info(
        "mtp: a speculative round of %.0f ms: K=%d, %d sessions (%d loaded within %.1f s, %d capped below K), "
        "drain %.1f ms",
        1e3 * (t2 - t0), K, len(sessions), young, JOINED_S, capped, 1e3 * (t1 - t0),
    )  # fmt: skip


def _flush(engine, sessions: list) -> None:
    """Finalises every session's pending pairs in one MTP pass (no draft), launched without a host read
    (mtp.flush_later); the last pair, (h_{p-1}, t0), stays pending: the next chain starts from it. The
    pass's own picks are free first drafts: after pair j the head picks the token after the next, which
    pair j + 1 holds, so the controller learns the acceptance at K = 0 too (Drafter.judge,
    DraftLength.observe_drafts), once a round launched after the flush is read (_judge)."""
    picks = mtp.flush_later(sessions)
    # a masked session's (structured outputs) head picks read its mask rows of other positions: not judged
    ids_of = [[] if s.runner.sampling.params[s.slot].constrained else s.mtp_pairs_ids for s in sessions]
    engine._mtp_judging.append((engine._mtp_seq, sessions, ids_of, picks))
    if os.environ.get(LATER_ENV, "1") == "0":  # judged now: the host waits for the rounds in flight and the pass
        _judge(engine, mtp.control(engine), engine._mtp_seq + 1)
    lasts = torch.cat([s.mtp_h_more[-1] if s.mtp_h_more else s.mtp_pairs_h[-1:] for s in sessions])
    for i, s in enumerate(sessions):
        s.mtp_start += len(s.mtp_pairs_ids) - 1
        s.mtp_pairs_h, s.mtp_h_more = lasts[i : i + 1], []  # (views of one copy: the round's rows are freed)
        s.mtp_pairs_ids = s.mtp_pairs_ids[-1:]


def _judge(engine, ctl, read_seq: int) -> None:
    """The flushes launched before round read_seq (just read: the stream has passed them) judge their
    picks (_flush); a flush's picks are read once, without waiting."""
    while engine._mtp_judging and engine._mtp_judging[0][0] < read_seq:
        _, sessions, ids_of, picks = engine._mtp_judging.pop(0)
        kept = []
        for s, ids, own in zip(sessions, ids_of, picks()):
            mine = [engine.drafter.judge(s, pick, ids[j + 1]) for j, pick in enumerate(own[: max(0, len(ids) - 1)])]
            s.draft_cap.observe_drafts(sum(mine), len(mine) - sum(mine))
            kept += mine
        if kept:
            ctl.observe_drafts(sum(kept), len(kept) - sum(kept))


def _plain(engine, ctl, runner, sessions: list) -> Launched:
    """A plain round: one batched AR step of every session, launched (module doc)."""
    hidden: list = []
    t_launch = time.perf_counter()
    get = runner.ar_batch_launch([s.slot for s in sessions], hidden_out=hidden)
    engine._mtp_seq += 1
    seq = engine._mtp_seq
    for s in sessions:
        s.mtp_inflight += 1

    def read() -> list[list[int]]:
        try:
            toks = get()
        finally:
            for s in sessions:
                s.mtp_inflight -= 1
        _judge(engine, ctl, seq)
        h = hidden[0]
        for i, (s, t) in enumerate(zip(sessions, toks)):
            s.mtp_h_more.append(h[i : i + 1])
            s.mtp_pairs_ids = s.mtp_pairs_ids + [t]
            s.rounds += 1
            s.emitted_in_rounds += 1
        now = time.perf_counter()
        seconds = now - max(engine._mtp_last_read, t_launch)
        engine._mtp_last_read = now
        ctl.observe_round(0, [0] * len(sessions), 0.0, seconds)
        return [[t] for t in toks]

    return Launched(engine, sessions, read)
