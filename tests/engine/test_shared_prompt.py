"""Equal prompts in one prefill pass are computed once (baton/engine/prefill.py: shared_pieces, run_pass):
every slot still ends bitwise as its prompt alone leaves it (GDN state, KV rows, hidden, MTP KV, position,
next token), picks its own token by its own sampling parameters, records its own token history (the
penalties read it) and gets its streaming marks for every layer, after its state is in place."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import assert_same_state, make_tiny_dir, slot_state

from baton.engine.prefill import Piece, prefill_pieces, run_pass, shared_pieces
from baton.engine.runner import ModelRunner
from baton.engine.sampling import Params
from baton.loading import load_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", params=["fp32", "bf16"])
def lm(request, tmp_path_factory):
    return load_model(make_tiny_dir(tmp_path_factory.mktemp("m")), dtype=request.param)


def _runner(lm) -> ModelRunner:
    return ModelRunner(lm.model, slots=5, max_len=256, width=8)


_state, _assert_same = slot_state, assert_same_state


def _prompt(lm, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(lm.cfg.vocab_size) for _ in range(n)]


def test_which_pieces_share():
    a, b = [1, 2, 3], [4, 5]
    ps = [Piece(0, a), Piece(1, b), Piece(2, a), Piece(3, a, start=3), Piece(4, list(a))]
    assert shared_pieces(ps) == {2: 0, 4: 0}  # a piece past position 0 without its `before`: never shared
    assert shared_pieces([Piece(0, a), Piece(1, b)]) == {}
    # past position 0: shared when the tokens before it are the same (its boundary key) and its ids are
    later = [Piece(0, a, 3, before=b"k1"), Piece(1, a, 3, before=b"k2"), Piece(2, a, 3, before=b"k1")]
    assert shared_pieces([*later, Piece(3, b, 3, before=b"k1")]) == {2: 0}
    # first pieces of salted requests (cache_salt in `before`): shared only with the same salt
    salted = [Piece(0, a, before=b"t1"), Piece(1, a), Piece(2, a, before=b"t2"), Piece(3, a, before=b"t1")]
    assert shared_pieces([*salted, Piece(4, a)]) == {3: 0, 4: 1}


def test_equal_prompts_in_one_pass_end_as_each_alone(lm):
    p, q = _prompt(lm, 37, 1), _prompt(lm, 20, 2)
    params = [Params(temperature=1.0, seed=7), Params(), Params(temperature=0.8, top_p=0.9, seed=99), None]
    alone, want = _runner(lm), []
    for slot, ids in enumerate([p, q, p, p]):
        alone.sampling.set(slot, params[slot])
        alone.prefill(slot, ids)
        want.append(_state(alone, slot))
    r = _runner(lm)
    for slot in range(4):
        r.sampling.set(slot, params[slot])
    toks = run_pass(r, [Piece(0, p), Piece(1, q), Piece(2, p), Piece(3, list(p))])
    assert toks == [w["next_token"] for w in want]
    for slot in range(4):
        _assert_same(_state(r, slot), want[slot])


def test_a_prompt_over_several_kv_pages_is_copied_whole(lm):
    """600 tokens: two full 256-token pages and a part of a third (PagedRows' index_copy_ and tail copy)."""
    p = _prompt(lm, 600, 6)
    alone = ModelRunner(lm.model, slots=2, max_len=704, width=8)
    alone.prefill(1, p)
    want = _state(alone, 1)
    r = ModelRunner(lm.model, slots=2, max_len=704, width=8)
    run_pass(r, [Piece(0, p), Piece(1, list(p))])
    _assert_same(_state(r, 1), want)


def test_penalties_read_each_copys_own_history(lm):
    p = _prompt(lm, 30, 3)
    pen = Params(temperature=1.0, seed=5, repetition_penalty=1.3, frequency_penalty=0.5)
    alone = _runner(lm)
    alone.sampling.history.begin(0, len(p))
    alone.sampling.set(0, pen)
    want = alone.prefill(0, p)
    r = _runner(lm)
    for slot in (0, 1):
        r.sampling.history.begin(slot, len(p))
        r.sampling.set(slot, pen if slot == 1 else None)
    toks = run_pass(r, [Piece(0, p), Piece(1, list(p))])
    assert toks[1] == want
    assert torch.equal(r.sampling.history.ids[1, : len(p)], r.sampling.history.ids[0, : len(p)])


def test_a_copys_marks_come_once_its_state_is_in_place(lm):
    p = _prompt(lm, 25, 4)
    alone = _runner(lm)
    alone.prefill(0, p)
    want = _state(alone, 0)
    r = _runner(lm)
    seen: dict[int, list] = {0: [], 1: []}

    def mark(slot):
        def f(layer):  # what a streaming hand-off reads at the mark: the layer's state of this slot
            t = [x for x in r.state.export(slot, position=len(p)) if x.name.startswith(f"layers.{layer}.")]
            seen[slot].append((layer, [x.materialize().clone() for x in t]))

        return f

    pieces = [prefill_pieces(r, s, p, on_layer=mark(s))[0] for s in (0, 1)]
    run_pass(r, pieces)
    layers = lm.cfg.num_hidden_layers
    for slot in (0, 1):
        assert [layer for layer, _ in seen[slot]] == list(range(layers))
        for layer, got in seen[slot]:
            names = [n for n in want if n.startswith(f"layers.{layer}.")]
            assert len(got) == len(names)
            for n, g in zip(names, got):
                assert torch.equal(g, want[n]), (slot, n)


def test_prompt_logprobs_of_a_copy(lm):
    p = _prompt(lm, 18, 5)
    a, b = Piece(0, p, prompt_logprobs=2), Piece(1, list(p), prompt_logprobs=0)
    run_pass(_runner(lm), [a, b])
    alone = Piece(0, p, prompt_logprobs=2)
    run_pass(_runner(lm), [alone])
    assert a.logprobs == alone.logprobs
    assert [c for c, _ in b.logprobs] == [c for c, _ in alone.logprobs] and all(not t for _, t in b.logprobs)
