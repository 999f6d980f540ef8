"""A released-at-end Decode runs its batched steps ahead of its reader (StepScheduler `ahead`), but a
session that asks for logprobs must not: the service reads each token's logprobs from the sampling
table after the token reaches it, and a step run ahead would have overwritten them with the next
token's. Here the reader is slow (as a busy gRPC stream is) and every token's logprobs must still be
its own: those of the same decode read at once, one step at a time."""

from __future__ import annotations

import time

import pytest
from helpers import make_tiny_dir

from baton.engine.runner import ModelRunner
from baton.engine.sampling import Params
from baton.loading import load_model
from decode_worker.engine import DecodeEngine
from prefill_worker.engine import ExactEngine

MAX_LEN, N = 96, 8


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    lm = load_model(make_tiny_dir(tmp_path_factory.mktemp("la"), seed=5), dtype="fp32", mtp=False)
    exact = ExactEngine(ModelRunner(lm.model, slots=1, max_len=MAX_LEN))
    s, _ = exact.prefill([5, 17, 3, 99, 42, 7, 25, 11])
    tensors, pos, nxt = exact.export(s.id)
    host = {t.name: t.tensor.clone() for t in tensors}
    exact.release(s.id)
    return (
        DecodeEngine({"bf16": ModelRunner(lm.model, slots=2, max_len=MAX_LEN)}, default_engine="bf16"),
        host,
        pos,
        nxt,
    )


def _decode(env, params: Params, run_ahead: bool, pause: float):
    eng, host, pos, nxt = env
    sess = eng.load({k: v.clone() for k, v in host.items()}, position=pos, next_token=nxt)
    table = sess.runner.sampling
    table.set(sess.slot, params)
    out = []
    try:
        for toks in eng.decode(sess.id, N, run_ahead=run_ahead):
            time.sleep(pause)  # the reader is slow: a step run ahead would land meanwhile
            out.append((toks, table.logprobs(sess.slot, len(toks))))
    finally:
        eng.release(sess.id)
    return out


@pytest.mark.parametrize("params", [Params(logprobs=3), Params(temperature=0.9, seed=4, logprobs=2)])
def test_a_run_ahead_decode_reads_each_tokens_own_logprobs(env, params):
    want = _decode(env, params, run_ahead=False, pause=0.0)
    assert len(want) == N and all(lps for _, lps in want)
    assert _decode(env, params, run_ahead=True, pause=0.05) == want
