"""Batched prefill (baton/engine/prefill.py): several sessions' prompt pieces in one pass leave every
slot's state (GDN conv / recurrent, KV rows, hidden, MTP KV, position, next token) bitwise as the prompt
alone does, whatever shares the pass, at any offset; long prompts are cut at fixed PREFILL_CHUNK
boundaries, so a piece interleaved with others equals the same pieces alone; a refused pass changes
nothing. (CPU: the per-row ops run once per segment; CUDA's row-invariant kernels: test_gpu_batch.py
and tests/engine/test_wide_kernels.py.)"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from helpers import assert_same_state, make_tiny_dir, slot_state

from baton.engine.prefill import Piece, pieces, prefill_pieces, run_pass
from baton.engine.runner import ModelRunner, WindowError
from baton.engine.sampling import Params
from baton.loading import load_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")
MAX_LEN = 256


@pytest.fixture(scope="module", params=["fp32", "bf16"])
def lm(request, tmp_path_factory):
    return load_model(make_tiny_dir(tmp_path_factory.mktemp("m")), dtype=request.param)


def _runner(lm, chunk: int | None = None) -> ModelRunner:
    r = ModelRunner(lm.model, slots=4, max_len=MAX_LEN, width=8)
    if chunk is not None:
        r.prefill_chunk = chunk
    return r


_state, _assert_same = slot_state, assert_same_state


def _prompts(lm, lengths, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(lm.cfg.vocab_size) for _ in range(n)] for n in lengths]


def test_pieces_are_cut_at_fixed_boundaries():
    assert pieces(0, 5, 4) == [(0, 4), (4, 1)]
    assert pieces(10, 8, 4) == [(10, 4), (14, 4)]
    assert pieces(3, 2, 4) == [(3, 2)]


def test_a_pass_of_several_prompts_equals_each_alone(lm):
    prompts = _prompts(lm, [5, 17, 1, 40])
    alone = _runner(lm)
    solo_tok, solo = [], []
    for slot, ids in enumerate(prompts):
        solo_tok.append(alone.prefill(slot, ids))
        solo.append(_state(alone, slot))
    batched = _runner(lm)
    toks = run_pass(batched, [Piece(slot, ids) for slot, ids in enumerate(prompts)])
    assert toks == solo_tok
    for slot in range(len(prompts)):
        _assert_same(_state(batched, slot), solo[slot])


def test_companions_and_offsets_do_not_matter(lm):
    a, b, c = _prompts(lm, [23, 9, 31], seed=1)
    r1, r2 = _runner(lm), _runner(lm)
    t1 = run_pass(r1, [Piece(0, a)])[0]
    t2 = run_pass(r2, [Piece(1, c), Piece(2, b), Piece(3, a)])[2]  # a at offset 40, in another slot
    assert t1 == t2
    s1, s2 = _state(r1, 0), _state(r2, 3)
    _assert_same(s1, s2)


def test_sampled_first_token_is_the_same_alone_and_batched(lm):
    a, b = _prompts(lm, [12, 30], seed=2)
    p = Params(temperature=1.0, seed=1234)
    r1, r2 = _runner(lm), _runner(lm)
    r1.sampling.set(0, p)
    r2.sampling.set(1, p)
    t1 = run_pass(r1, [Piece(0, a)])[0]
    t2 = run_pass(r2, [Piece(0, b), Piece(1, a)])[1]
    assert t1 == t2


def test_long_prompts_run_as_pieces_interleaved_with_others(lm):
    """chunk 16: a 50-token prompt is 4 pieces; interleaved with other prompts over 4 passes it leaves
    the state its pieces leave alone (ModelRunner.prefill), MTP KV included."""
    long, x, y = _prompts(lm, [50, 7, 20], seed=3)
    alone = _runner(lm, chunk=16)
    t_long = alone.prefill(0, long)
    ref_long = _state(alone, 0)
    t_x, t_y = alone.prefill(1, x), alone.prefill(2, y)
    ref_x, ref_y = _state(alone, 1), _state(alone, 2)
    r = _runner(lm, chunk=16)
    ps = prefill_pieces(r, 0, long)
    assert [(p.start, len(p.ids), p.last) for p in ps] == [
        (0, 16, False),
        (16, 16, False),
        (32, 16, False),
        (48, 2, True),
    ]
    py = prefill_pieces(r, 2, y)  # 16 + 4
    assert run_pass(r, [ps[0], Piece(1, x)]) == [None, t_x]
    assert run_pass(r, [py[0], ps[1]]) == [None, None]
    assert run_pass(r, [ps[2], py[1]]) == [None, t_y]
    assert run_pass(r, [ps[3]]) == [t_long]
    _assert_same(_state(r, 0), ref_long)
    _assert_same(_state(r, 1), ref_x)
    _assert_same(_state(r, 2), ref_y)


def test_pieces_compute_the_prompt(lm):
    """The chunked prefill is the prompt's prefill: a 50-token prompt in pieces of 16 (later pieces attend
    to the earlier pieces' KV, the delta rule continues from their state) is close to one pass of 50."""
    (ids,) = _prompts(lm, [50], seed=6)
    one, cut = _runner(lm), _runner(lm, chunk=16)
    t1, t2 = one.prefill(0, ids), cut.prefill(0, ids)
    a, b = _state(one, 0), _state(cut, 0)
    tol = 1e-4 if lm.model.head_weight().dtype == torch.float32 else 5e-2
    for k in ("hidden", "layers.0.recurrent", "layers.3.key"):
        if k in a:
            assert torch.allclose(a[k].float(), b[k].float(), atol=tol, rtol=tol), k
    if lm.model.head_weight().dtype == torch.float32:
        assert t1 == t2


def test_a_refused_pass_changes_nothing(lm):
    a, b = _prompts(lm, [10, 5], seed=4)
    r = _runner(lm)
    r.prefill(0, a)
    before = _state(r, 0)
    with pytest.raises(WindowError):
        run_pass(r, [Piece(1, b), Piece(0, [1] * (MAX_LEN + 1))])
    _assert_same(_state(r, 0), before)
    with pytest.raises(ValueError, match="one piece per slot"):
        run_pass(r, [Piece(1, b), Piece(1, a)])
    with pytest.raises(ValueError, match="empty"):
        run_pass(r, [Piece(1, [])])


def test_a_pass_refused_for_pages_leaves_the_pages_it_took_zeroed(lm):
    """A pass whose second piece finds no free KV page (PagesExhausted) keeps the page its first piece took
    (all or none is per slot), and that page reads zeros, as reserve() leaves a new page: the pass zeroes
    its pages with its fresh slots in one go (HybridState.reset_slots), so a refusal zeroes them first."""
    from baton.engine.pages import PagesExhausted

    r = ModelRunner(lm.model, slots=4, max_len=MAX_LEN, width=8, kv_pages=1)
    st = r.state
    for i in st.attn_ids:  # stale rows, as a page freed by an earlier session holds
        st.key[i].fill_(7)
        st.value[i].fill_(7)
    a, b = _prompts(lm, [10, 5], seed=4)
    with pytest.raises(PagesExhausted):
        run_pass(r, [Piece(1, a), Piece(2, b)])
    (page,) = st.pages.owned(1)
    assert st.pages.owned(2) == []
    for i in st.attn_ids:
        assert not st.key[i][page].any() and not st.value[i][page].any(), i
    assert int(st.position[1]) == 0


def test_the_cudnn_sdpa_knob_turns_torch_s_backend_off_only_when_asked(monkeypatch):
    """BATON_PREFILL_CUDNN_SDPA=0 (baton/models/qwen3_5.py): the prefill's attention switches torch's cuDNN
    SDPA backend off (a process-wide flag, so a worker and a reference run given the same setting compute
    the same bits); unset or 1 leaves it as it is."""
    from baton.models import qwen3_5

    was = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        monkeypatch.delenv(qwen3_5.CUDNN_SDPA_ENV, raising=False)
        qwen3_5._no_cudnn_sdpa()
        assert torch.backends.cuda.cudnn_sdp_enabled()
        monkeypatch.setenv(qwen3_5.CUDNN_SDPA_ENV, "1")
        qwen3_5._no_cudnn_sdpa()
        assert torch.backends.cuda.cudnn_sdp_enabled()
        monkeypatch.setenv(qwen3_5.CUDNN_SDPA_ENV, "0")
        qwen3_5._no_cudnn_sdpa()
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(was)


@pytest.mark.parametrize("batch", ["0", "1"])
def test_equal_first_pieces_in_one_sdpa_call_equal_each_alone(lm, monkeypatch, batch):
    """BATON_PREFILL_SDPA_BATCH=1 (baton/models/prefill_attention.py): consecutive pieces of one shape (start
    and length) attend in one SDPA call with a batch dimension: a pass of three 16-token first pieces and a
    10-token prompt makes two calls a layer (3 and 1); the next pass's three later pieces (8 tokens at 16,
    their keys from their pages) one call; every slot's state stays bitwise its prompt's alone. 0: one call
    a segment. (CUDA: test_gpu_prefill.py under gpu_pending.sh prefill-sdpa-batch.)"""
    from baton.engine.prefill import prefill_pieces
    from baton.models import prefill_attention

    monkeypatch.setenv(prefill_attention.SDPA_BATCH_ENV, batch)
    prompts = _prompts(lm, [24, 24, 24, 10], seed=3)
    alone = _runner(lm, chunk=16)  # the same pieces (cut at fixed boundaries)
    want = []
    for slot, ids in enumerate(prompts):
        alone.prefill(slot, ids)
        want.append(_state(alone, slot))
    calls: list[list[int]] = []
    real = torch.nn.functional.scaled_dot_product_attention

    def counting(q, *a, **kw):  # each call's batch size
        calls[-1].append(q.shape[0])
        return real(q, *a, **kw)

    # the module's F only (torch's own stays: causal_lower_right dispatches through it)
    monkeypatch.setattr(prefill_attention, "F", SimpleNamespace(scaled_dot_product_attention=counting))
    r = _runner(lm, chunk=16)  # a 24-token prompt: a first piece of 16, then a later piece of 8
    cut = [prefill_pieces(r, slot, ids) for slot, ids in enumerate(prompts)]
    for k in range(2):
        calls.append([])
        run_pass(r, [ps[k] for ps in cut if len(ps) > k])
    layers = len(r.state.key)  # the attention layers' KV pools, the MTP layer's included
    if batch == "1":
        assert calls == [[3, 1] * layers, [3] * layers], calls
    else:
        assert calls == [[1] * 4 * layers, [1] * 3 * layers], calls
    for slot in range(len(prompts)):
        _assert_same(_state(r, slot), want[slot])
