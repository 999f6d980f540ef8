"""The decode engine's pipelined AR loop (ModelRunner(pipeline=True): step t+1 launched before token t
is read, GDN state ping-ponging between two buffer sets). On CPU the steps run eagerly through the same
loop, phases and undo / settle logic as the CUDA-graph path: the tokens and the session state after
every way a decode call can end must be bitwise those of the plain loop."""

from __future__ import annotations

import pytest
import torch
from helpers import make_tiny_dir

from baton.engine.runner import ModelRunner
from baton.loading import load_model
from decode_worker.engine import DecodeEngine
from prefill_worker.engine import ExactEngine

MAX_LEN = 96
PROMPT = [5, 17, 3, 99, 42, 7, 250, 11, 64, 8]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    d = make_tiny_dir(tmp_path_factory.mktemp("pp"), seed=11, layers=4, hidden=64, vocab=300)
    lm = load_model(d, dtype="fp32", mtp=False)
    exact = ExactEngine(ModelRunner(lm.model, slots=1, max_len=MAX_LEN))
    s, first = exact.prefill(PROMPT)
    tensors, pos, nxt = exact.export(s.id)
    host = {t.name: t.tensor.clone() for t in tensors}
    exact.release(s.id)
    plain = DecodeEngine({"bf16": ModelRunner(lm.model, slots=2, max_len=MAX_LEN)}, default_engine="bf16")
    piped = DecodeEngine(  # the per-session pipelined loop (the fused CUDA path's), run here on the CPU
        {"bf16": ModelRunner(lm.model, slots=2, max_len=MAX_LEN, pipeline=True)},
        default_engine="bf16",
        batch_steps=False,
    )
    assert piped.runners["bf16"].state.pingpong and not plain.runners["bf16"].state.pingpong
    return host, pos, nxt, plain, piped


def _state(eng: DecodeEngine, sid: str) -> dict[str, torch.Tensor]:
    s = eng.get(sid)
    st = s.runner.state
    out = {t.name: t.tensor.clone() for t in st.export(s.slot)}
    out["position"], out["next_token"] = st.position[s.slot].clone(), st.next_token[s.slot].clone()
    return out


def _same_state(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _both(env, run):
    """run(engine, session id) on a fresh session of each engine -> (plain result, piped result)."""
    host, pos, nxt, plain, piped = env
    out = []
    for eng in (plain, piped):
        sess = eng.load({k: v.clone() for k, v in host.items()}, position=pos, next_token=nxt)
        try:
            out.append((run(eng, sess.id), _state(eng, sess.id)))
        finally:
            eng.release(sess.id)
    return out


def _toks(eng, sid, n, **kw):
    return [t for b in eng.decode(sid, n, **kw) for t in b]


def test_tokens_and_state_equal_the_plain_loop_at_max_tokens(env):
    (a, sa), (b, sb) = _both(env, lambda e, sid: _toks(e, sid, 12))
    assert a == b and len(a) == 12
    assert _same_state(sa, sb)  # the last step's state settled back into the main buffers


@pytest.mark.parametrize("odd", [0, 1])
def test_a_stop_token_undoes_the_step_launched_past_it(env, odd):
    """The stop token is produced by a phase-0 step (odd=0) or a phase-1 step (odd=1): both undo paths.
    A second decode call continues exactly where the plain loop does."""
    ref = _both(env, lambda e, sid: _toks(e, sid, 12))[0][0]
    stop = ref[4 + odd]
    assert stop not in ref[: 4 + odd]

    def run(e, sid):
        first = _toks(e, sid, 12, stop_ids=[stop])
        return first, _toks(e, sid, 6)

    (a, sa), (b, sb) = _both(env, run)
    assert a == b and a[0][-1] == stop and len(a[0]) == 5 + odd
    assert _same_state(sa, sb)


def test_a_closed_stream_keeps_exactly_the_tokens_it_yielded(env):
    """The client goes away after 3 tokens (generator closed with a step in flight)."""

    def run(e, sid):
        gen = e.decode(sid, 12)
        got = [next(gen)[0] for _ in range(3)]
        gen.close()
        return got, _toks(e, sid, 4)

    (a, sa), (b, sb) = _both(env, run)
    assert a == b and len(a[0]) == 3
    assert _same_state(sa, sb)


def test_one_token_and_zero_tokens(env):
    (a, sa), (b, sb) = _both(env, lambda e, sid: (_toks(e, sid, 1), _toks(e, sid, 0), _toks(e, sid, 2)))
    assert a == b and [len(x) for x in a] == [1, 0, 2]
    assert _same_state(sa, sb)


def test_interleaved_sessions_each_get_their_own_tokens(env):
    """Two sessions of one runner decoding at once (the engine's lock is released between steps, so
    the other session's steps, of the same phase, run while one of this session is unread): each gets
    its own tokens and state. The host token buffer was once per phase only: A read B's token."""
    host, pos, nxt, plain, piped = env
    out = []
    for eng in (plain, piped):
        a, b = (eng.load({k: v.clone() for k, v in host.items()}, position=pos, next_token=nxt) for _ in range(2))
        try:
            _toks(eng, b.id, 3)  # b runs 3 tokens ahead: their next tokens differ
            ga, gb = eng.decode(a.id, 8), eng.decode(b.id, 8)
            got = ([], [])
            for _ in range(8):
                got[0].extend(next(ga))
                got[1].extend(next(gb))
            ga.close()
            gb.close()
            out.append((got, _state(eng, a.id), _state(eng, b.id)))
        finally:
            eng.release(a.id)
            eng.release(b.id)
    (got_plain, sa, sb), (got_piped, pa, pb) = out
    assert got_plain[0] != got_plain[1]
    assert got_piped == got_plain
    assert _same_state(sa, pa) and _same_state(sb, pb)


def test_the_decode_worker_pipelines_by_default(tmp_path):
    """CLI, serve_decode and the Ray actor default to the pipelined loop (bf16 / fp8 runners with ping-pong
    buffers); --no-pipeline / pipeline=False turn it off. ModelRunner's own default (the exact engine,
    `baton complete`) stays plain."""
    import inspect

    from baton.settings import Settings
    from decode_worker.__main__ import build_parser
    from decode_worker.actor import DecodeActor
    from decode_worker.serve import serve_decode

    parse = build_parser().parse_args
    assert parse([]).pipeline is False
    assert parse(["--pipeline"]).pipeline is True
    assert parse(["--no-pipeline"]).pipeline is False
    assert inspect.signature(serve_decode).parameters["pipeline"].default is False
    assert inspect.signature(DecodeActor.__init__).parameters["pipeline"].default is False
    assert inspect.signature(ModelRunner).parameters["pipeline"].default is False

    lm = load_model(make_tiny_dir(tmp_path), dtype="fp32")
    for kw, want in (({}, False), ({"pipeline": True}, True)):
        h, s = serve_decode(lm, engines=("bf16", "fp8", "mtp"), max_len=64, width=4, slots=1, settings=Settings(), **kw)
        try:
            runners = s.engine.runners
            assert set(runners) == {"bf16", "fp8", "mtp"}
            assert runners["bf16"] is runners["mtp"]
            assert runners["bf16"].state.pingpong is want and runners["fp8"].state.pingpong is want
            assert s.engine.batch_steps is (False if want else None)  # pipelined: each session alone
        finally:
            h.stop(0)
