"""The router with prefill workers that send the first token before the state has landed (PrefillStream's
early answer; the real worker's side: tests/prefill_worker/test_prefill_stream.py). Over loopback with fake
workers: the tokens are the reference's, a hand-off that fails after the first token was sent is recovered
(FAST: re-prefill of prompt + the sent token; EXACT: ExportState) with nothing lost or repeated, and a
request that ends at its first token leaves no session behind."""

from __future__ import annotations

import grpc
import pytest
from fakes import Cluster, reference

PROMPT = [5, 6, 7]


@pytest.fixture
def cluster():
    c = Cluster()
    for w in c.prefill:
        w.servicer.early = True
    yield c
    c.close()


@pytest.mark.parametrize("mode", ["fast", "exact"])
def test_early_first_token_gives_the_reference_tokens(cluster, mode):
    out, deltas = cluster.run(PROMPT, max_new_tokens=16, mode=mode, engine="bf16" if mode == "fast" else "fp8")
    assert out == reference(PROMPT, 16) and deltas[0].token_ids == [out[0]]
    assert deltas[-1].stats["migrations"] == 0 and deltas[-1].stats["bridge_bytes"] > 0  # recorded at landing
    assert cluster.wait_sessions_zero()


@pytest.mark.parametrize("mode", ["fast", "exact"])
def test_a_hand_off_failing_after_the_first_token_is_recovered(mode):
    cluster = Cluster(n_prefill=1)  # one prefill worker: its next hand-off fails once
    try:
        _recovered(cluster, mode)
    finally:
        cluster.close()


def _recovered(cluster, mode):
    cluster.prefill[0].servicer.early = True
    cluster.prefill[0].servicer.fail_after_first = grpc.StatusCode.UNAVAILABLE
    out, deltas = cluster.run(PROMPT, max_new_tokens=16, mode=mode, engine="bf16" if mode == "fast" else "fp8")
    assert out == reference(PROMPT, 16)  # the first token once, then the rest: nothing lost or repeated
    assert deltas[-1].stats["migrations"] == 1
    if mode == "exact":  # the exact worker kept the session: the state is exported again
        assert any(m == "ExportState" for w in cluster.prefill for m, _ in w.servicer.calls)
    else:  # a re-prefill of the prompt and the token already sent
        prefills = [r for w in cluster.prefill for m, r in w.servicer.calls if m == "Prefill"]
        assert [list(r.prompt_ids) for r in prefills][-1] == PROMPT + out[:1]
    assert cluster.wait_sessions_zero()


def test_a_request_that_ends_at_its_first_token_leaves_no_session(cluster):
    out, deltas = cluster.run(PROMPT, max_new_tokens=1, engine="bf16")
    assert out == reference(PROMPT, 1) and deltas[-1].finish_reason == "LENGTH"
    assert cluster.wait_sessions_zero(timeout=5.0)  # a hand-off still in flight at the end: released late
