"""HybridState's ping-pong AR steps (baton/engine/state.py): undo_step, settle, snapshot / restore.

Driven through ModelRunner(pipeline=True).ar_launch / ar_collect in the order decode_worker/engine.py
`_ar_pipelined` uses (step t+1 launched before token t is read, phases 0, 1, 0, ...), on a tiny fp32
model on CPU. The reference is a run that never launched the unwanted step: plain in-place ar_step on
a runner without ping-pong buffers. "The slot's state" is every tensor a later step can read: GDN conv
and recurrent state, the KV rows [0, position) of every attention layer, position, next_token, hidden."""

from __future__ import annotations

import pytest
import torch
from helpers import make_tiny_dir

from baton.engine.runner import ModelRunner
from baton.loading import load_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_LEN = 64
PROMPT = [5, 17, 3, 99, 42, 7, 250, 11]
OTHER = [9, 8, 7, 6, 5]  # a second session in the other slot: never touched by slot 0's steps
N_REF = 10


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    d = make_tiny_dir(tmp_path_factory.mktemp("undo"), seed=11, layers=4, hidden=64, vocab=300)
    lm = load_model(d, dtype="fp32", device="cpu", mtp=False)
    piped = ModelRunner(lm.model, slots=2, max_len=MAX_LEN, pipeline=True)
    plain = ModelRunner(lm.model, slots=2, max_len=MAX_LEN)
    assert piped.state.pingpong and not plain.state.pingpong and piped.fast is None
    cfg = lm.cfg
    assert cfg.gdn_layers and cfg.attn_layers  # both kinds of state are exercised
    # the reference: plain AR after PROMPT; ref_states[j] = the slot's state after j tokens
    plain.prefill(0, PROMPT)
    ref_states, ref_tokens = [_state(plain, 0)], []
    for _ in range(N_REF):
        ref_tokens.append(plain.ar_step(0))
        ref_states.append(_state(plain, 0))
    assert len(set(ref_tokens)) > 2, ref_tokens  # a random model that does not loop on one token
    return piped, ref_states, ref_tokens


def _state(r: ModelRunner, slot: int) -> dict[str, torch.Tensor]:
    st = r.state
    pos = int(st.position[slot])
    out = {}
    for i in st.cfg.gdn_layers:
        out[f"conv.{i}"] = st.conv[i][slot].clone()
        out[f"rec.{i}"] = st.recurrent[i][slot].clone()
    for i in st.attn_ids:
        out[f"key.{i}"], out[f"value.{i}"] = st.slot_kv(i, slot, pos)
    out["position"] = st.position[slot].clone()
    out["next_token"] = st.next_token[slot].clone()
    out["hidden"] = st.hidden[slot].clone()
    return out


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    bad = [k for k in a if a[k].shape != b[k].shape or not torch.equal(a[k], b[k])]
    assert not bad, f"state differs in {bad}"


def _fresh(piped: ModelRunner) -> dict[str, torch.Tensor]:
    """Prefill PROMPT in slot 0 and OTHER in slot 1; scribble over the alt buffers (they must never
    matter once the state is settled). -> slot 1's state."""
    st = piped.state
    piped.prefill(1, OTHER)
    piped.prefill(0, PROMPT)
    g = torch.Generator().manual_seed(0)
    for i in st.cfg.gdn_layers:
        st.conv_alt[i].copy_(torch.randn(st.conv_alt[i].shape, generator=g))
        st.rec_alt[i].copy_(torch.randn(st.rec_alt[i].shape, generator=g))
    st.hidden_prev.copy_(torch.randn(st.hidden_prev.shape, generator=g))
    return _state(piped, 1)


def _pipelined(r: ModelRunner, slot: int, max_new: int, ends=()) -> list[int]:
    """decode_worker/engine.py `_ar_pipelined`, run to completion: the tokens it yields."""
    out: list[int] = []
    fed = int(r.state.next_token[slot])
    r.ar_launch(slot, 0)
    pending, kept = 0, None
    while pending is not None:
        cur, pending = pending, None
        if len(out) + 1 < max_new:
            pending = 1 - cur
            r.ar_launch(slot, pending)
        tok = r.ar_collect(slot, cur)
        kept, fed = cur, tok
        out.append(tok)
        if tok in ends:
            break
    if pending is not None:
        r.state.undo_step(slot, pending, fed)
    else:
        r.state.settle(slot, kept)
    return out


@pytest.mark.parametrize("j", [1, 2, 3, 4, 5])
def test_a_step_launched_past_a_stop_token_is_undone_bitwise(env, j):
    """Stop at the j-th token: step j+1 (phase j % 2: both phases covered) was already launched."""
    piped, ref_states, ref_tokens = env
    stop = ref_tokens[j - 1]
    j = ref_tokens.index(stop) + 1  # the first occurrence is where the loop stops
    other = _fresh(piped)
    assert _pipelined(piped, 0, N_REF, ends={stop}) == ref_tokens[:j]
    _assert_same(_state(piped, 0), ref_states[j])
    _assert_same(_state(piped, 1), other)


@pytest.mark.parametrize("j", [0, 1, 2, 3, 4])
def test_undo_step_of_each_phase_restores_the_state_before_it(env, j):
    """j tokens read, step j+1 (phase j % 2) launched and never read: undo_step(slot, phase, the token
    it consumed) -> the state after j tokens, in the main buffers (j = 0: undo the very first step)."""
    piped, ref_states, ref_tokens = env
    other = _fresh(piped)
    st = piped.state
    fed = int(st.next_token[0])
    for t in range(j + 1):
        piped.ar_launch(0, t % 2)
        if t < j:
            assert piped.ar_collect(0, t % 2) == ref_tokens[t]
            fed = ref_tokens[t]
    assert int(st.position[0]) == len(PROMPT) + j + 1  # the unwanted step did run
    assert piped.ar_collect(0, j % 2) == ref_tokens[j]
    st.undo_step(0, j % 2, fed)
    _assert_same(_state(piped, 0), ref_states[j])
    _assert_same(_state(piped, 1), other)


@pytest.mark.parametrize("j", [1, 2, 3, 4])
def test_settle_after_each_phase_leaves_the_state_in_the_main_buffers(env, j):
    """j steps, all read (the last of phase (j - 1) % 2), none pending: settle -> the state after j tokens."""
    piped, ref_states, ref_tokens = env
    other = _fresh(piped)
    assert _pipelined(piped, 0, j) == ref_tokens[:j]
    _assert_same(_state(piped, 0), ref_states[j])
    _assert_same(_state(piped, 1), other)


def test_settle_with_no_step_is_a_no_op(env):
    piped, ref_states, _ = env
    _fresh(piped)
    piped.state.settle(0, None)
    piped.state.settle(0, 1)
    _assert_same(_state(piped, 0), ref_states[0])


def test_decoding_goes_on_exactly_after_an_undo(env):
    """The undone step's KV row (past the position again) is stale: the next calls overwrite it before
    reading it. Undo at 3 and at 3 + 2, continuing each time: the tokens are the reference's."""
    piped, ref_states, ref_tokens = env
    _fresh(piped)
    out = []
    for stop_after in (3, 2, 4):
        stop = ref_tokens[len(out) + stop_after - 1]
        want = ref_tokens[len(out) :]
        want = want[: want.index(stop) + 1]
        got = _pipelined(piped, 0, N_REF - len(out), ends={stop})
        assert got == want
        out += got
        _assert_same(_state(piped, 0), ref_states[len(out)])
    # and plain in-place steps after a pipelined call agree too
    if len(out) < N_REF:
        assert piped.ar_step(0) == ref_tokens[len(out)]
        _assert_same(_state(piped, 0), ref_states[len(out) + 1])


def test_undo_step_writes_only_its_slot(env):
    """Interleaved sessions: slot 1 has a step pending while slot 0 launches and undoes one."""
    piped, ref_states, _ref_tokens = env
    _fresh(piped)
    st = piped.state
    piped.ar_launch(1, 0)
    other_after_step = _state(piped, 1)
    fed = int(st.next_token[0])
    piped.ar_launch(0, 0)
    st.undo_step(0, 0, fed)
    _assert_same(_state(piped, 0), ref_states[0])
    _assert_same(_state(piped, 1), other_after_step)  # slot 1's alt (phase-0 output) untouched
    st.settle(1, 0)
    piped.ar_collect(1, 0)
    ref = ModelRunner(piped.model, slots=1, max_len=MAX_LEN)
    ref.prefill(0, OTHER)
    ref.ar_step(0)
    _assert_same(_state(piped, 1), _state(ref, 0))


def test_snapshot_restore_round_trip_over_pipelined_steps(env):
    """snapshot, decode (pipelined, undone and settled), restore: bitwise the snapshotted state, and
    decoding from it again gives the same tokens."""
    piped, ref_states, ref_tokens = env
    other = _fresh(piped)
    st = piped.state
    assert _pipelined(piped, 0, 2) == ref_tokens[:2]
    st.snapshot(0)
    addrs = {k: t.data_ptr() for k, t in st.items_all()}
    after = ref_tokens[2:7]
    assert _pipelined(piped, 0, 5, ends={ref_tokens[4]}) == after[: after.index(ref_tokens[4]) + 1]
    assert not torch.equal(st.position[0], ref_states[2]["position"])
    st.restore(0)
    assert {k: t.data_ptr() for k, t in st.items_all()} == addrs  # no buffer replaced
    _assert_same(_state(piped, 0), ref_states[2])
    _assert_same(_state(piped, 1), other)
    assert _pipelined(piped, 0, 4) == ref_tokens[2:6]
    _assert_same(_state(piped, 0), ref_states[6])
