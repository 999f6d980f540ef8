"""PrefillStream over real loopback gRPC: the first token leaves before the state has landed (early first
token) once the decode worker admitted the session, then the whole answer once it has landed; a hand-off
that fails after the early answer ends the stream with its status; a client gone after it cancels the
hand-off and releases the session on both sides; a receiver that never admits early gets one answer.

The decode target is a gate: a DecodeWorker whose LoadState reads every frame, then waits for the test to
open it (or to fail it), so the hand-off is in flight for as long as the test wants."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from helpers import make_tiny_dir

from baton import rpc
from baton.handoff.admission import ADMITTED
from baton.loading import load_model
from baton.rpc import make_channel
from baton.settings import Settings
from baton.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from prefill_worker.serve import serve_prefill

T = 30
pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Gate(decode_pb2_grpc.DecodeWorkerServicer):
    """LoadState: drains the frames, then answers when `opened` is set (or aborts with `fail`); `cancelled`:
    the call ended without an answer (its sender cancelled it, while it streamed or while it waited)."""

    def __init__(self):
        self.opened, self.read = threading.Event(), threading.Event()
        self.fail: grpc.StatusCode | None = None
        self.admit = True  # False: a receiver that never admits early (an older decode worker)
        self.cancelled = threading.Event()
        self.released: list[str] = []

    def LoadState(self, request_iterator, context):
        answered = []
        context.add_callback(lambda: answered or self.cancelled.set())  # the call ended before an answer
        if self.admit:
            context.send_initial_metadata((ADMITTED,))  # as the decode worker does once the slot is reserved
        for _ in request_iterator:
            pass
        self.read.set()
        while not self.opened.wait(0.02):
            if not context.is_active():
                return decode_pb2.LoadStateResponse()
        if self.fail is not None:
            answered.append(1)
            context.abort(self.fail, "slots are full")
        answered.append(1)
        return decode_pb2.LoadStateResponse(session_id="x")

    def Release(self, request, context):
        self.released.append(request.session_id)
        return common_pb2.ReleaseResponse(released=True)


@pytest.fixture(scope="module")
def prefill(tmp_path_factory):
    lm = load_model(make_tiny_dir(tmp_path_factory.mktemp("m")), dtype="fp32")
    handle, _ = serve_prefill(lm, max_len=128, width=16, slots=4, settings=Settings())
    with make_channel(handle.address, Settings()) as ch:
        yield prefill_pb2_grpc.PrefillWorkerStub(ch)
    handle.stop(0)


@pytest.fixture
def gate():
    g = Gate()
    h = rpc.build_server(
        [(decode_pb2_grpc.add_DecodeWorkerServicer_to_server, g)],
        service_names=["baton.v1.DecodeWorker"],
        settings=Settings(),
        max_workers=8,
        serving=True,
    )
    g.address = h.address
    yield g
    g.opened.set()
    h.stop(0)


def _idle(stub) -> None:
    """Every session released and no call in flight on the prefill worker (a cancel may still finish)."""
    for _ in range(200):
        st = stub.GetStats(common_pb2.WorkerStatsRequest(), timeout=T)
        if st.sessions == 0 and st.outstanding == 0:
            return
        time.sleep(0.05)
    raise AssertionError(st)


PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


def test_the_first_token_leaves_before_the_state_lands(prefill, gate):
    want = prefill.Prefill(prefill_pb2.PrefillRequest(session_id="alone", prompt_ids=PROMPT), timeout=T)
    stream = prefill.PrefillStream(
        prefill_pb2.PrefillRequest(session_id="s1", prompt_ids=PROMPT, decode_target=gate.address), timeout=T
    )
    first = next(stream)
    assert gate.read.wait(T) and not gate.opened.is_set()  # the gate holds the state: not landed yet
    assert first.first_token == want.first_token and not first.HasField("bridge")
    assert first.prompt_tokens == len(PROMPT)
    gate.opened.set()
    rest = list(stream)
    assert len(rest) == 1 and rest[0].first_token == want.first_token
    assert rest[0].bridge.total_bytes > 0  # the whole answer: the hand-off's report
    _idle(prefill)


def test_a_hand_off_that_fails_after_the_first_token_ends_the_stream_with_its_status(prefill, gate):
    stream = prefill.PrefillStream(
        prefill_pb2.PrefillRequest(session_id="s2", prompt_ids=PROMPT, decode_target=gate.address), timeout=T
    )
    next(stream)
    gate.fail = grpc.StatusCode.RESOURCE_EXHAUSTED
    gate.opened.set()
    with pytest.raises(grpc.RpcError) as ei:
        list(stream)
    assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "decode_target" in ei.value.details()  # the router blames the decode worker
    _idle(prefill)


def test_an_exact_session_whose_hand_off_fails_after_the_first_token_is_kept_for_export(prefill, gate):
    """The router recovers an EXACT session whose hand-off failed after the early first token by moving it
    with ExportState (router/exact.py: migrate), so the worker must keep it: it is exported to another
    decode worker with the same pending token, then released (a CI run lost all 8 sessions' 8th this way)."""
    req = prefill_pb2.PrefillRequest(
        session_id="x1", prompt_ids=PROMPT, decode_target=gate.address, mode=common_pb2.EXACT
    )
    stream = prefill.PrefillStream(req, timeout=T)
    first = next(stream)
    gate.fail = grpc.StatusCode.UNAVAILABLE  # the decode worker died while the state was landing
    gate.opened.set()
    with pytest.raises(grpc.RpcError) as ei:
        list(stream)
    assert ei.value.code() == grpc.StatusCode.UNAVAILABLE and "decode_target" in ei.value.details()
    assert prefill.GetStats(common_pb2.WorkerStatsRequest(), timeout=T).sessions == 1  # kept
    gate.fail = None
    moved = prefill.ExportState(
        prefill_pb2.ExportStateRequest(session_id="x1", decode_target=gate.address, target_session_id="x1"),
        timeout=T,
    )
    assert moved.next_token == first.first_token and moved.position == len(PROMPT)
    assert prefill.Release(common_pb2.ReleaseRequest(session_id="x1"), timeout=T).released
    _idle(prefill)


def test_a_client_gone_after_the_first_token_cancels_the_hand_off_and_releases_both_sides(prefill, gate):
    stream = prefill.PrefillStream(
        prefill_pb2.PrefillRequest(session_id="s3", prompt_ids=PROMPT, decode_target=gate.address), timeout=T
    )
    next(stream)
    stream.cancel()
    assert gate.cancelled.wait(T)  # the LoadState call was cancelled
    for _ in range(200):
        if "s3" in gate.released:
            break
        time.sleep(0.05)
    assert "s3" in gate.released  # in case it landed just before the cancel
    _idle(prefill)


def test_a_receiver_that_does_not_admit_early_gets_one_whole_answer(prefill, gate):
    """No early first token before the decode worker has reserved the slot: a refusal for full slots
    must fail the call before any token (the router then tries another decode worker)."""
    gate.admit = False
    stream = prefill.PrefillStream(
        prefill_pb2.PrefillRequest(session_id="s5", prompt_ids=PROMPT, decode_target=gate.address), timeout=T
    )
    got = []
    reader = threading.Thread(target=lambda: got.extend(stream))
    reader.start()
    assert gate.read.wait(T)
    time.sleep(0.3)
    assert got == []  # nothing before the receiver's answer
    gate.opened.set()
    reader.join(T)
    assert len(got) == 1 and got[0].bridge.total_bytes > 0
    _idle(prefill)


def test_without_a_decode_target_the_stream_is_one_whole_answer(prefill):
    msgs = list(prefill.PrefillStream(prefill_pb2.PrefillRequest(session_id="s4", prompt_ids=PROMPT), timeout=T))
    assert len(msgs) == 1 and msgs[0].prompt_tokens == len(PROMPT)
    _idle(prefill)


@pytest.fixture
def slow_passes(monkeypatch):
    """Every prefill pass takes 0.6 s more; `entered` is set when one begins."""
    import prefill_worker.engine as engine_mod

    real, entered = engine_mod.run_pass, threading.Event()

    def slow(*a, **kw):
        entered.set()
        time.sleep(0.6)
        return real(*a, **kw)

    monkeypatch.setattr(engine_mod, "run_pass", slow)
    return entered


def test_heartbeats_while_queued_behind_a_pass_and_none_while_no_pass_ends(prefill, slow_passes):
    """Asked for (heartbeat_ms), a prompt that waits for another prompt's pass gets heartbeat messages
    (only `heartbeat` set) once that pass ends, then its whole answer, with the token it gets unhurried; a
    prompt alone in a slow pass gets none (heartbeats mean passes ended, not a timer: a wedged worker
    stays silent); heartbeat_ms 0 (the default) sends none."""
    other = [7, 7, 2, 9]
    want = [m.first_token for m in prefill.PrefillStream(prefill_pb2.PrefillRequest(prompt_ids=other), timeout=T)]
    slow_passes.clear()
    first = threading.Thread(
        target=lambda: list(prefill.PrefillStream(prefill_pb2.PrefillRequest(prompt_ids=PROMPT), timeout=T))
    )
    first.start()
    assert slow_passes.wait(T)
    msgs = list(prefill.PrefillStream(prefill_pb2.PrefillRequest(prompt_ids=other, heartbeat_ms=100), timeout=T))
    first.join(T)
    beats = [m for m in msgs if m.heartbeat]
    assert (
        beats and msgs[: len(beats)] == beats and all(m == prefill_pb2.PrefillResponse(heartbeat=True) for m in beats)
    )
    assert len(msgs) == len(beats) + 1 and [msgs[-1].first_token] == want and msgs[-1].prompt_tokens == len(other)
    alone = list(prefill.PrefillStream(prefill_pb2.PrefillRequest(prompt_ids=other, heartbeat_ms=100), timeout=T))
    assert [m.heartbeat for m in alone] == [False] and [alone[0].first_token] == want
    _idle(prefill)


def test_heartbeats_while_the_state_waits_to_land_then_a_client_gone_at_one_releases_both(prefill, gate):
    """After the early first token, the state held at the gate: each heartbeat_ms in which another pass of
    the worker ended brings a heartbeat, none while nothing moves; the whole answer comes once it lands.
    A client that leaves at a heartbeat cancels the hand-off and releases the session on both sides."""
    stream = prefill.PrefillStream(
        prefill_pb2.PrefillRequest(session_id="b1", prompt_ids=PROMPT, decode_target=gate.address, heartbeat_ms=50),
        timeout=T,
    )
    first = next(stream)
    assert not first.heartbeat and first.prompt_tokens == len(PROMPT) and gate.read.wait(T)
    got = []
    reader = threading.Thread(target=lambda: got.extend(stream))
    reader.start()
    time.sleep(0.3)
    assert got == []  # no pass, no hand-off ended: silent
    prefill.Prefill(prefill_pb2.PrefillRequest(prompt_ids=[5, 5, 5]), timeout=T)  # another prompt's pass
    for _ in range(100):
        if got:
            break
        time.sleep(0.02)
    assert [m.heartbeat for m in got] == [True]
    gate.opened.set()
    reader.join(T)
    assert [m.heartbeat for m in got] == [True, False] and got[-1].bridge.total_bytes > 0
    assert got[-1].first_token == first.first_token
    _idle(prefill)

    for e in (gate.opened, gate.read, gate.cancelled):
        e.clear()
    stream = prefill.PrefillStream(
        prefill_pb2.PrefillRequest(session_id="b2", prompt_ids=PROMPT, decode_target=gate.address, heartbeat_ms=50),
        timeout=T,
    )
    next(stream)
    assert gate.read.wait(T)
    prefill.Prefill(prefill_pb2.PrefillRequest(prompt_ids=[5, 5, 5]), timeout=T)
    assert next(stream).heartbeat
    stream.cancel()
    assert gate.cancelled.wait(T)
    for _ in range(200):
        if "b2" in gate.released:
            break
        time.sleep(0.05)
    assert "b2" in gate.released
    _idle(prefill)
