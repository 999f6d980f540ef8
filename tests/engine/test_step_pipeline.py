"""The step scheduler's pipeline (baton/engine/scheduler.py, `launch`): step t + 1 is launched before the
tokens of step t are collected, for the jobs that may run ahead (sessions released at the end of their
call). A fake runner stands for the device: each launch records itself and computes the slot's next
token (a pure function of slot and count, as a device-fed step is of the slot's state), collect()
records when the host read it. Checked: the launch / collect order, that a job that may not run ahead
is never in two uncollected steps, that a run-ahead job ending on an end token drops the extra step's
token, and that every job's tokens are those of the plain (unpipelined) scheduler."""

from __future__ import annotations

import threading
import time

import pytest

from baton.engine.scheduler import StepScheduler


class FakeRunner:
    """A device-fed step: slot s's n-th token is (s * 100 + n) % 97, unless `ends` says otherwise."""

    def __init__(self):
        self.count: dict[int, int] = {}
        self.log: list[tuple] = []  # ("launch", id, slots) / ("collect", id)
        self.lock = threading.Lock()
        self.steps = 0
        self.step_s = 0.0

    def _next(self, slot: int) -> int:
        n = self.count.get(slot, 0)
        self.count[slot] = n + 1
        return (slot * 100 + n) % 97

    def step(self, slots):
        return [self._next(s) for s in slots]

    def launch(self, slots):
        step_s = self.step_s
        with self.lock:
            self.steps += 1
            sid = self.steps
            self.log.append(("launch", sid, tuple(slots)))
            toks = self.step(slots)

        def collect():
            time.sleep(step_s)  # the device finishing the step
            with self.lock:
                self.log.append(("collect", sid))
            return toks

        return collect


def _run(pipelined: bool, jobs_spec, ends=(), step_s: float = 0.0, sizes: dict | None = None, pause=None):
    """-> ({slot: its tokens}, the fake runner). sizes: the readers take every queued token at once
    (Job.take) and record each message's length there; pause(slot): seconds a reader sleeps after each."""
    r = FakeRunner()
    r.step_s = step_s
    sched = StepScheduler(
        lambda rr, slots: rr.step(slots), threading.Lock(), launch=(lambda rr, s: rr.launch(s)) if pipelined else None
    )
    out = {}
    try:
        jobs = {slot: sched.join(r, slot, n, ends, ahead=ahead) for slot, n, ahead in jobs_spec}

        def read(slot):
            got = []
            while (toks := jobs[slot].take() if sizes is not None else jobs[slot].next()) is not None:
                if sizes is None:
                    got.append(toks)
                else:
                    got += toks
                    sizes.setdefault(slot, []).append(len(toks))
                if pause is not None:
                    time.sleep(pause(slot))
            jobs[slot].close()
            out[slot] = got

        th = [threading.Thread(target=read, args=(slot,)) for slot in jobs]
        for t in th:
            t.start()
        for t in th:
            t.join(10)
    finally:
        sched.close()
    return out, r


def _uncollected_max(log, slot) -> int:
    """The most steps holding `slot` at once between launch and collect."""
    live, worst = {}, 0
    for e in log:
        if e[0] == "launch":
            live[e[1]] = e[2]
        else:
            live.pop(e[1])
        worst = max(worst, sum(slot in s for s in live.values()))
    return worst


def test_run_ahead_jobs_launch_the_next_step_before_collecting_and_keep_their_tokens():
    spec = [(0, 12, 2), (1, 7, 2), (2, 10, 0)]
    plain, _ = _run(False, spec)
    piped, r = _run(True, spec)
    assert piped == plain and [len(plain[s]) for s in (0, 1, 2)] == [12, 7, 10]
    kinds = [e[0] for e in r.log]
    overlapped = any(a == "launch" and b == "launch" for a, b in zip(kinds, kinds[1:]))
    assert overlapped, "no step was launched before the one before it was collected"
    assert _uncollected_max(r.log, 0) == 2 and _uncollected_max(r.log, 2) == 1  # slot 2 may not run ahead
    assert r.count[0] == 12 and r.count[1] == 7  # never a step past max_new_tokens


@pytest.mark.parametrize("pipelined", [False, True])
def test_an_end_token_ends_a_run_ahead_job_and_the_extra_step_is_dropped(pipelined):
    spec = [(3, 50, 2), (4, 50, 2)]
    end = (3 * 100 + 5) % 97  # slot 3's 6th token
    out, r = _run(pipelined, spec, ends=(end,))
    assert out[3] == [(300 + n) % 97 for n in range(6)] and out[3][-1] == end
    assert 6 <= r.count[3] <= 6 + pipelined  # pipelined: at most one step past the end, its token dropped
    assert out[4] == [(400 + n) % 97 for n in range(3)]  # slot 4 meets the same end token at its 3rd


@pytest.mark.parametrize("pipelined", [False, True])
def test_an_end_at_the_first_token_drops_the_step_launched_past_it(pipelined):
    """The first step's jobs are in flight with empty queues, so the second step is launched before the
    first is collected (deterministically): slot 3's first token is an end, so its second step ran and
    its token is dropped; slot 4 goes on to its max_new_tokens."""
    end = 300 % 97
    out, r = _run(pipelined, [(3, 50, 2), (4, 20, 2)], ends=(end,))
    assert out[3] == [end] and r.count[3] == 1 + pipelined
    assert out[4] == [(400 + n) % 97 for n in range(20)] and r.count[4] == 20


def _overlapped(log) -> int:
    """Launches made while another step was still uncollected."""
    live, n = set(), 0
    for e in log:
        if e[0] == "launch":
            n += bool(live)
            live.add(e[1])
        else:
            live.discard(e[1])
    return n


def test_with_decode_workers_run_ahead_the_pipeline_keeps_going():
    """DecodeEngine's RUN_AHEAD: the scheduler gathers step t + 1 right after it handed out token t - 1,
    often before the reader took it, so a job must be allowed 2 queued tokens past the one in flight
    (ahead >= 3) for the steps to keep overlapping. Readers that keep up, a device step of 1 ms: most
    launches find the step before still uncollected."""
    from decode_worker.engine import RUN_AHEAD

    assert RUN_AHEAD >= 3
    _, r = _run(True, [(i, 60, RUN_AHEAD) for i in range(4)], step_s=0.001)
    assert _overlapped(r.log) >= r.steps // 2, (_overlapped(r.log), r.steps)


def test_a_reader_that_falls_behind_takes_its_queued_tokens_at_once_and_stays_in_every_step():
    """DecodeEngine's consumers read with Job.take: a reader slower than the steps (32+ streams sharing a
    worker's host) gets every token queued since its last read in one message, and with RUN_AHEAD of
    room its job stays in every step instead of dropping out until it catches up (steps of part of the
    batch). The tokens are those of the plain scheduler."""
    from decode_worker.engine import RUN_AHEAD

    spec = [(i, 40, RUN_AHEAD) for i in range(4)]
    plain, _ = _run(False, spec)
    sizes: dict = {}
    # reader 0 reads once every ~5 steps
    out, r = _run(True, spec, step_s=0.002, sizes=sizes, pause=lambda slot: 0.010 if slot == 0 else 0.0)
    assert out == plain
    assert len(sizes[0]) < 40 / 2  # the slow reader: several tokens a message
    launches = [e[2] for e in r.log if e[0] == "launch"]
    full = sum(len(s) == 4 for s in launches)
    assert full >= 0.7 * len(launches), [len(s) for s in launches]  # the batch stays whole (ahead 3: ~0.4)
