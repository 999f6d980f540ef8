"""The step scheduler (baton/engine/scheduler.py) under DecodeEngine on the eager CPU path: concurrent
bf16 / fp8 sessions step together, and each gets exactly the tokens and the state it gets alone."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from helpers import make_tiny_dir

from baton.engine.runner import ModelRunner
from baton.engine.scheduler import StepScheduler
from baton.loading import load_model
from decode_worker.engine import DecodeEngine
from prefill_worker.engine import ExactEngine

MAX_LEN, N = 96, 24
PROMPTS = [[(7 * i + j) % 250 + 3 for j in range(5 + i)] for i in range(8)]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    d = make_tiny_dir(tmp_path_factory.mktemp("sched"), seed=5, layers=4, hidden=64, vocab=300)
    lm = load_model(d, dtype="fp32", mtp=False)
    exact = ExactEngine(ModelRunner(lm.model, slots=1, max_len=MAX_LEN))
    states = []
    for p in PROMPTS:
        s, _ = exact.prefill(p)
        tensors, pos, nxt = exact.export(s.id)
        states.append(({t.name: t.tensor.clone() for t in tensors}, pos, nxt))
        exact.release(s.id)
    eng = DecodeEngine({"bf16": ModelRunner(lm.model, slots=8, max_len=MAX_LEN)}, default_engine="bf16")
    assert eng.batch_steps is None and eng.runners["bf16"].fast is None  # eager: the scheduler path
    alone = DecodeEngine(
        {"bf16": ModelRunner(lm.model, slots=1, max_len=MAX_LEN)}, default_engine="bf16", batch_steps=False
    )
    yield eng, alone, states
    eng.close()


def _slot_state(eng, sid):
    s = eng.get(sid)
    st = s.runner.state
    out = {t.name: t.tensor.clone() for t in st.export(s.slot)}
    out["position"], out["next_token"] = st.position[s.slot].clone(), st.next_token[s.slot].clone()
    return out


def _decode(eng, sid, n, **kw):
    return [t for b in eng.decode(sid, n, **kw) for t in b]


def test_concurrent_sessions_get_exactly_their_tokens_and_state_alone(env):
    eng, alone, states = env
    want = []
    for host, pos, nxt in states:  # the reference: each session alone, plain per-session loop
        s = alone.load({k: v.clone() for k, v in host.items()}, position=pos, next_token=nxt)
        want.append((_decode(alone, s.id, N), _slot_state(alone, s.id)))
        alone.release(s.id)
    sids = [eng.load({k: v.clone() for k, v in h.items()}, position=p, next_token=x).id for h, p, x in states]
    got, start = [None] * len(sids), threading.Barrier(len(sids))

    def run(i):
        start.wait()
        got[i] = _decode(eng, sids[i], N)

    steps0, rows0 = (eng._scheduler.steps, eng._scheduler.rows) if eng._scheduler else (0, 0)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(sids))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    try:
        for i, sid in enumerate(sids):
            assert got[i] == want[i][0], f"session {i}"
            st = _slot_state(eng, sid)
            assert st.keys() == want[i][1].keys() and all(torch.equal(st[k], want[i][1][k]) for k in st), i
        sched = eng._scheduler
        steps, rows = sched.steps - steps0, sched.rows - rows0
        assert rows == len(sids) * N
        assert rows / steps > 2.0, (rows, steps)  # they really stepped together
    finally:
        for sid in sids:
            eng.release(sid)


def test_a_stop_token_ends_the_job_and_the_next_decode_continues(env):
    eng, alone, states = env
    host, pos, nxt = states[0]
    s = alone.load({k: v.clone() for k, v in host.items()}, position=pos, next_token=nxt)
    ref = _decode(alone, s.id, N)
    alone.release(s.id)
    s = eng.load({k: v.clone() for k, v in host.items()}, position=pos, next_token=nxt)
    try:
        stop = ref[6]
        first = _decode(eng, s.id, N, stop_ids={stop})
        assert first == ref[: ref.index(stop) + 1]
        rest = _decode(eng, s.id, N - len(first))
        assert first + rest == ref
    finally:
        eng.release(s.id)


def test_one_decode_per_slot_and_a_stopped_scheduler_refuses():
    lock = threading.Lock()
    sched = StepScheduler(lambda r, slots: [0] * len(slots), lock)
    job = sched.join("r", 0, 3, ())
    with pytest.raises(RuntimeError, match="slot 0 already"):
        sched.join("r", 0, 3, ())
    assert [job.next() for _ in range(4)] == [0, 0, 0, None]  # max_new_tokens, then done
    with pytest.raises(ValueError, match="max_new_tokens"):
        sched.join("r", 1, 0, ())
    sched.close()
    with pytest.raises(RuntimeError, match="stopped"):
        sched.join("r", 1, 3, ())


def test_a_failing_step_reaches_its_consumer_and_the_thread_goes_on():
    calls = []

    def step(r, slots):
        calls.append(list(slots))
        if len(calls) == 1:
            raise ValueError("boom")
        return [9] * len(slots)

    sched = StepScheduler(step, threading.Lock())
    try:
        job = sched.join("r", 0, 5, ())
        with pytest.raises(ValueError, match="boom"):
            job.next()
        job.close()
        job = sched.join("r", 0, 5, ())
        assert job.next() == 9
    finally:
        sched.close()


def test_run_ahead_steps_without_the_reader_and_keeps_the_tokens(env):
    """ahead = 2 (a Decode released at its end): steps run before the consumer asks, at most 2 tokens
    ahead; the tokens read are those of ahead = 0, and concurrent run-ahead sessions step together."""
    eng, alone, states = env
    host, pos, nxt = states[0]
    s = alone.load({k: v.clone() for k, v in host.items()}, position=pos, next_token=nxt)
    want = _decode(alone, s.id, N)
    alone.release(s.id)
    lock = threading.Lock()
    sched = StepScheduler(lambda r, slots: r.ar_batch(slots), lock)
    try:
        s = eng.load({k: v.clone() for k, v in host.items()}, position=pos, next_token=nxt)
        r = eng.get(s.id).runner
        job = sched.join(r, s.slot, N, (), ahead=2)
        deadline = time.monotonic() + 10
        while sched.steps < 2 and time.monotonic() < deadline:  # nobody reads: two steps, then it waits
            time.sleep(0.01)
        time.sleep(0.2)
        assert sched.steps == 2 and list(job.queue) == want[:2]
        assert int(r.state.position[s.slot]) == pos + 2
        got = [job.next() for _ in range(N)]
        assert got == want and job.next() is None
        eng.release(s.id)
    finally:
        sched.close()
        eng.release(s.id)
    # through the engine: run_ahead decodes of 8 sessions at once, each equal to its run alone
    outs, sids = {}, []
    for host, pos, nxt in states:
        sids.append(eng.load({k: v.clone() for k, v in host.items()}, position=pos, next_token=nxt).id)

    def run(i):
        outs[i] = _decode(eng, sids[i], N, run_ahead=True)

    th = [threading.Thread(target=run, args=(i,)) for i in range(len(sids))]
    for t in th:
        t.start()
    for t in th:
        t.join()
    for i, (host, pos, nxt) in enumerate(states):
        a = alone.load({k: v.clone() for k, v in host.items()}, position=pos, next_token=nxt)
        assert outs[i] == _decode(alone, a.id, N), i
        alone.release(a.id)
        eng.release(sids[i])


def test_close_waits_for_a_step_that_holds_the_job():
    """Job.close() returns only once no running step holds the job, so the caller may free (and reuse)
    the slot right after; a step gathered before the close leaves the job out."""
    started, finished = threading.Event(), threading.Event()

    def step(runner, slots):
        started.set()
        time.sleep(0.3)
        finished.set()
        return [7] * len(slots)

    sched = StepScheduler(step, threading.Lock())
    try:
        job = sched.join(object(), 0, 100, (), ahead=2)  # runs ahead: a step starts without a reader
        assert started.wait(5)
        job.close()
        assert finished.is_set()  # close() waited for the step that held the job
        n = sched.steps
        time.sleep(0.1)
        assert sched.steps == n  # and no step ran it after
    finally:
        sched.close()


def test_phases_say_where_the_step_thread_waited():
    """phase_s: time held behind the compute lock counts as "lock", a pipelined step's device wait as
    "collect", a run-ahead job whose queue is full as "held"; fill_stats reports them and resets."""
    from baton.v1 import common_pb2

    lock = threading.Lock()

    def launch(runner, slots):
        return lambda: (time.sleep(0.05), [1] * len(slots))[1]  # the "device": 50 ms a step

    sched = StepScheduler(lambda r, s: [1] * len(s), lock, launch=launch)
    try:
        with lock:  # a LoadState commit holding the compute lock
            job = sched.join("r", 0, 100, (), ahead=3)
            time.sleep(0.3)
        assert job.next() == 1
        deadline = time.monotonic() + 5
        while len(job.queue) < 3 and time.monotonic() < deadline:  # queue full (ahead = 3): the job is held out
            time.sleep(0.01)
        time.sleep(0.3)
        out = common_pb2.WorkerStats()
        sched.fill_stats(out, [], reset=True)
        ph = dict(out.step_phase_s)
        assert ph["lock"] >= 0.25, ph
        assert ph["collect"] >= 0.1, ph  # at least the steps that filled the queue
        assert ph["held"] >= 0.25, ph
        assert sum(ph.values()) <= out.step_phase_window_s + 0.01
        assert out.steps >= 3 and out.step_held_rows >= 1
        out2 = common_pb2.WorkerStats()
        sched.fill_stats(out2, [])
        assert sum(out2.step_phase_s.values()) < 0.2 and out2.step_phase_window_s < 0.2  # reset
    finally:
        job.close()
        sched.close()


def test_the_first_decode_after_a_load_takes_the_loaded_position(env):
    """DecodeSession.loaded_position: the first decode after the load uses it instead of reading the device
    (a blocking read behind the steps in flight); the decode clears it, so the next decode reads the
    device, and a Draft clears it too. The tokens are those of the session alone either way."""
    eng, alone, states = env
    host, pos, nxt = states[1]
    a = alone.load({k: v.clone() for k, v in host.items()}, position=pos, next_token=nxt)
    want = _decode(alone, a.id, 12)
    alone.release(a.id)
    s = eng.load({k: v.clone() for k, v in host.items()}, position=pos, next_token=nxt)
    try:
        assert eng.get(s.id).loaded_position == pos
        got = _decode(eng, s.id, 5)
        assert eng.get(s.id).loaded_position is None
        got += _decode(eng, s.id, 7)  # reads the device: pos + 5
        assert got == want and int(eng.get(s.id).runner.state.position[eng.get(s.id).slot]) == pos + 12
    finally:
        eng.release(s.id)
    s = eng.load({k: v.clone() for k, v in host.items()}, position=pos, next_token=nxt)
    try:
        eng.draft(s.id, 2, None)
        assert eng.get(s.id).loaded_position is None
    finally:
        eng.release(s.id)


def test_settle_hands_out_the_steps_in_flight_before_a_computed_launch():
    """Rounds (multi): a launch that computes at once calls settle() first, so the round in flight reaches
    its consumer during that compute, not after it; the tokens stay in order; settle() from another thread
    is refused. Without settle the first round's tokens wait the whole second launch."""
    sched: StepScheduler | None = None
    calls, release, got_first = [], threading.Event(), threading.Event()

    def launch(runner, slots, left):
        calls.append(list(left))
        n = len(calls)
        if n == 1:  # a plain round: launched, read later
            return lambda: [[10]] * len(slots)
        if n == 2:  # computed at once: settle, then the "compute" until the consumer got round 1
            sched.settle()
            release.wait(5)
            return lambda: [[20, 21]] * len(slots)
        return lambda: [[30 + n]] * len(slots)

    sched = StepScheduler(lambda r, s, left: launch(r, s, left)(), threading.Lock(), launch=launch, multi=True)
    try:
        job = sched.join("r", 0, 4, (), ahead=4)

        def read():
            first = job.next()
            got_first.set()
            release.set()  # the second launch's compute ends only after round 1 reached us
            return [first] + [t for r in iter(job.next, None) for t in [r]]

        t = threading.Thread(target=lambda: calls.append(("read", read())))
        t.start()
        assert got_first.wait(3), "round 1 was held back by the launch after it"
        t.join(5)
        assert calls[-1] == ("read", [[10], [20, 21], [33]])  # order kept; max_new_tokens 4 cuts the rest
        assert calls[0] == [4] and calls[1] == [4]  # `left` as the scheduler knew it at each launch
        with pytest.raises(RuntimeError, match="only from a launch"):
            sched.settle()
    finally:
        sched.close()


def test_a_launch_computed_at_once_is_handed_out_before_the_next_launch():
    """A launch result with ready = True (its tokens already on the host) reaches the consumer at once,
    while the next launch runs; a plain launched result waits one launch (the pipeline)."""
    got2, calls = threading.Event(), []

    class Ready:
        ready = True

        def __init__(self, out):
            self.out = out

        def __call__(self):
            return self.out

    def launch(runner, slots, left):
        calls.append(len(calls) + 1)
        if calls[-1] == 1:
            return Ready([[1, 2]] * len(slots))
        if calls[-1] == 2:
            assert got2.wait(3), "round 1 (ready) was held back until the next launch returned"
        return lambda: [[3]] * len(slots)

    sched = StepScheduler(lambda r, s, left: launch(r, s, left)(), threading.Lock(), launch=launch, multi=True)
    try:
        job = sched.join("r", 0, 3, (), ahead=4)
        first = job.next()
        got2.set()
        assert [first, job.next(), job.next()] == [[1, 2], [3], None]
    finally:
        sched.close()


def test_first_s_times_each_job_from_its_join_to_its_first_tokens():
    """StepScheduler.first_s (WorkerStats first_tokens_s_*): one figure a job, the wait from join() to its
    first tokens handed out, here a step held back 50 ms by the compute lock; later tokens add nothing."""
    lock = threading.Lock()
    sched = StepScheduler(lambda r, slots: [7] * len(slots), lock)
    try:
        with lock:  # a LoadState commit, a Draft: the step waits for the lock
            job = sched.join("r", 0, 3, ())
            time.sleep(0.05)
        assert [job.next() for _ in range(4)] == [7, 7, 7, None]
        assert len(sched.first_s) == 1 and 0.05 <= sched.first_s[0] < 2.0
        job = sched.join("r", 1, 1, ())
        assert job.next() == 7 and len(sched.first_s) == 2 and sched.first_s[1] < sched.first_s[0]
    finally:
        sched.close()
