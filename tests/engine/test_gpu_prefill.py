"""GPU checks of the batched prefill (run on the device with `pytest -m gpu`), Qwen3.5-9B shape, random
weights:
  * the wide GEMM (baton/kernels/wide.py): a row of an M-row call is bitwise that row in an M' call, for
    the model's projection shapes and M from 1 to 4096; its TMA loads (BATON_WIDE_GEMM=tma) give the same bits;
  * equal prompts in one pass (computed once, the state copied) end bitwise as each alone;
  * a prompt restored from the prefix cache's pieces is bitwise the prompt computed, also a piece restored in
    its pass (another prompt's earlier pass cached it), and equal later pieces in one pass are computed once;
  * a pass of several prompts leaves each slot's state (GDN, KV, hidden, MTP KV) and first token bitwise
    as the prompt alone; long prompts cut into pieces and interleaved with others equal the pieces alone;
  * the wide kernels compute the model: the prefill's hidden rows are close to the cuBLAS / torch path's;
  * the fused causal conv (wide.causal_conv) against its torch ops at the 9B conv width in bf16: the state
    bitwise, the outputs within a bf16 rounding, and a prefill's hidden rows with either."""

from __future__ import annotations

import contextlib
import os
import random

import pytest
import torch
from helpers import decoded_alone, exported, re_prefill_together, rows_with_logits

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(1200)]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
SHAPE = os.environ.get("BATON_GPU_SHAPE", "qwen3.5-9b")


@cuda
def test_wide_gemm_rows_do_not_depend_on_m():
    from baton.kernels import wide

    g = torch.Generator(device="cuda").manual_seed(0)
    for N, K in ((8192, 4096), (4096, 4096), (12288, 4096), (4096, 12288), (32, 4096), (1024, 4096)):
        w = (torch.randn(N, K, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
        x = torch.randn(4096, K, device="cuda", generator=g).to(torch.bfloat16)
        ref = wide.linear(x, w)
        close = torch.allclose(ref.float(), (x.float() @ w.float().T), atol=5e-2, rtol=2e-2)
        assert close, (N, K)
        for lo, hi in ((0, 1), (5, 42), (100, 612), (1000, 2000), (3000, 4096)):
            assert torch.equal(wide.linear(x[lo:hi], w), ref[lo:hi]), (N, K, lo, hi)


@cuda
def test_wide_gemm_tma_loads_give_the_pointer_kernels_bits(monkeypatch):
    """KERNEL "tma" / "tma_persistent" (the tiles through tensor descriptors) against "ptr": bitwise the same rows, in calls
    of any M, at the model's projection shapes (what lets BATON_WIDE_GEMM change without any state moving)."""
    from baton.kernels import wide

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs sm_90+")
    g = torch.Generator(device="cuda").manual_seed(1)
    for N, K in ((8192, 4096), (12288, 4096), (4096, 12288), (32, 4096), (1024, 4096)):
        w = (torch.randn(N, K, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
        x = torch.randn(2048, K, device="cuda", generator=g).to(torch.bfloat16)
        monkeypatch.setattr(wide, "KERNEL", "ptr")
        ref = wide.linear(x, w)
        assert wide._tma_ok(x, w, ref)
        for kind in ("tma", "tma_persistent"):
            monkeypatch.setattr(wide, "KERNEL", kind)
            for lo, hi in ((0, 2048), (0, 1), (5, 42), (100, 612), (1000, 2048)):
                assert torch.equal(wide.linear(x[lo:hi], w), ref[lo:hi]), (kind, N, K, lo, hi)


@pytest.fixture(scope="module")
def big():
    from baton.loading import random_model
    from baton.random_init import shape

    return random_model(shape(SHAPE), dtype="bf16", device="cuda", seed=0, mtp=True)


def _runner(lm, chunk=None):
    from baton.engine.runner import ModelRunner

    r = ModelRunner(lm.model, slots=5, max_len=4096, width=16)
    if chunk:
        r.prefill_chunk = chunk
    return r


def _state(r, slot):
    out = {t.name: t.materialize().clone() for t in r.state.export(slot)}
    out["position"] = int(r.state.position[slot])
    out["next_token"] = int(r.state.next_token[slot])
    return out


def _same(a, b):
    for k in a:
        same = torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k]
        assert same, k


def _prompts(vocab, lengths, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


@cuda
def test_batched_prefill_equals_each_prompt_alone(big):
    from baton.engine.prefill import Piece, prefill_pieces, run_pass

    prompts = _prompts(big.cfg.vocab_size, [37, 512, 1000, 130, 2100])
    alone = _runner(big)
    toks, ref = [], []
    for slot, ids in enumerate(prompts):
        toks.append(alone.prefill(slot, ids))
        ref.append(_state(alone, slot))
    r = _runner(big)
    assert run_pass(r, [Piece(s, ids) for s, ids in enumerate(prompts)]) == toks
    for slot in range(len(prompts)):
        _same(_state(r, slot), ref[slot])
    # other companions, other offsets and slots
    r2 = _runner(big)
    got = run_pass(r2, [Piece(0, prompts[3]), Piece(1, prompts[0]), Piece(2, prompts[2])])
    assert got == [toks[3], toks[0], toks[2]]
    _same(_state(r2, 2), ref[2])
    # chunked: the 2100 prompt as 1024-token pieces interleaved with the others
    a1, a2 = _runner(big, chunk=1024), _runner(big, chunk=1024)
    t_long = a1.prefill(0, prompts[4])
    ref_long = _state(a1, 0)
    ps = prefill_pieces(a2, 0, prompts[4])
    assert len(ps) == 3
    run_pass(a2, [Piece(1, prompts[1]), ps[0]])
    run_pass(a2, [ps[1], Piece(2, prompts[0]), Piece(3, prompts[3])])
    assert run_pass(a2, [ps[2]]) == [t_long]
    _same(_state(a2, 0), ref_long)


@cuda
@pytest.mark.parametrize("cudnn", ["1", "0"])
def test_equal_length_first_pieces_in_one_sdpa_call_end_as_each_alone(big, monkeypatch, cudnn):
    """BATON_PREFILL_SDPA_BATCH=1 (baton/models/prefill_attention.py): distinct prompts of one length attend in
    one SDPA call with a batch dimension (4 of 512 tokens, then 2 of 256 beside a 37-token one; 3 of 2,048 in
    1,024-token pieces, the later pieces' keys from their pages), with cuDNN's backend: each slot's state
    and first token bitwise its prompt alone (one call of its own). With flash (BATON_PREFILL_CUDNN_SDPA=0)
    batched first pieces differed on an H100 (2026-12-07: layers.4.conv), so there the batching is declined
    and every segment keeps its own call: the same bits."""
    from baton.engine.prefill import Piece, run_pass
    from baton.models import prefill_attention

    monkeypatch.setenv("BATON_PREFILL_CUDNN_SDPA", cudnn)
    was = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        prompts = _prompts(big.cfg.vocab_size, [512, 512, 512, 512, 256, 256, 37], seed=7)
        toks, ref = [], []
        for group in (prompts[:4], prompts[4:]):  # each prompt alone: one call a segment
            alone = _runner(big)
            for slot, ids in enumerate(group):
                toks.append(alone.prefill(slot, ids))
                ref.append(_state(alone, slot))
        monkeypatch.setenv(prefill_attention.SDPA_BATCH_ENV, "1")
        assert prefill_attention.batching_on(cuda=True) == (cudnn == "1")
        r = _runner(big)
        assert run_pass(r, [Piece(s, ids) for s, ids in enumerate(prompts[:4])]) == toks[:4]
        for s in range(4):
            _same(_state(r, s), ref[s])
        r2 = _runner(big)
        assert run_pass(r2, [Piece(s, ids) for s, ids in enumerate(prompts[4:])]) == toks[4:]
        for s in range(3):
            _same(_state(r2, s), ref[4 + s])
        # long prompts of one length in 1024-token pieces: the first pieces together, then the later ones
        # (their keys from their pages) together
        from baton.engine.prefill import prefill_pieces

        monkeypatch.setenv(prefill_attention.SDPA_BATCH_ENV, "0")
        long = _prompts(big.cfg.vocab_size, [2048, 2048, 2048], seed=8)
        alone = _runner(big, chunk=1024)
        want = [(alone.prefill(slot, ids), _state(alone, slot))[1] for slot, ids in enumerate(long)]
        monkeypatch.setenv(prefill_attention.SDPA_BATCH_ENV, "1")
        r3 = _runner(big, chunk=1024)
        cut = [prefill_pieces(r3, slot, ids) for slot, ids in enumerate(long)]
        assert [len(c) for c in cut] == [2, 2, 2]
        for k in range(2):
            run_pass(r3, [c[k] for c in cut])
        for slot in range(3):
            _same(_state(r3, slot), want[slot])
    finally:
        torch.backends.cuda.enable_cudnn_sdp(was)


@cuda
def test_equal_prompts_in_one_pass_are_computed_once_and_end_as_each_alone(big):
    """shared_pieces on the GPU: the copied slots' states (GDN, KV pages, MTP KV) and seeded picks are
    bitwise what each prompt alone gives, beside a distinct prompt in the same pass."""
    from baton.engine.prefill import Piece, run_pass
    from baton.engine.sampling import Params

    p, q = _prompts(big.cfg.vocab_size, [700, 300], seed=9)
    params = [Params(temperature=1.0, seed=3), None, Params(temperature=0.7, top_p=0.9, seed=11)]
    alone, ref = _runner(big), []
    for slot, ids in enumerate([p, q, p]):
        alone.sampling.set(slot, params[slot])
        alone.prefill(slot, ids)
        ref.append(_state(alone, slot))
    r = _runner(big)
    for slot in range(3):
        r.sampling.set(slot, params[slot])
    assert run_pass(r, [Piece(0, p), Piece(1, q), Piece(2, list(p))]) == [x["next_token"] for x in ref]
    for slot in range(3):
        _same(_state(r, slot), ref[slot])


@cuda
def test_equal_later_pieces_in_one_pass_are_computed_once_and_end_as_each_alone(big):
    """shared_pieces past position 0 (Piece.before: the boundary key of the tokens before the piece): two slots
    of one 2,304-token prompt in 1,024-token pieces, each pass computing the piece once and copying it (GDN
    state, KV pages [start, start + n), MTP KV computed per slot): both states bitwise the prompt alone."""
    from baton.engine.prefill import prefill_pieces, run_pass, shared_pieces
    from baton.engine.prefix_cache import boundary_keys

    ids = _prompts(big.cfg.vocab_size, [2304], seed=23)[0]
    alone = _runner(big, chunk=1024)
    alone.prefill(0, ids)
    want = _state(alone, 0)
    r = _runner(big, chunk=1024)
    keys = boundary_keys(ids, 1024)
    cut = [prefill_pieces(r, slot, ids) for slot in (0, 1)]
    for k in range(3):
        ps = [c[k] for c in cut]
        for p in ps:
            p.before = keys[p.start // 1024 - 1] if p.start else None
        assert shared_pieces(ps) == {1: 0}
        run_pass(r, ps)
    for slot in (0, 1):
        _same(_state(r, slot), want)


@cuda
def test_a_prompt_from_cached_pieces_is_bitwise_the_prompt_computed(big):
    """The prefill worker's prefix cache on the GPU (baton/engine/prefix_cache.py), 1,024-token pieces: a
    prompt that begins with a cached prompt's first two pieces starts after them, and its state (GDN, KV
    pages, MTP KV, hidden) and first token are bitwise the whole prompt computed, fresh or in the same engine."""
    from prefill_worker.engine import ExactEngine

    def engine(entries):
        r = _runner(big, chunk=1024)
        return ExactEngine(r, prefix_entries=entries)

    e, ref = engine(4), engine(0)
    a = _prompts(big.cfg.vocab_size, [2600], seed=21)[0]
    b = a[:2100] + _prompts(big.cfg.vocab_size, [300], seed=22)[0]
    s, _ = e.prefill(a)
    e.release(s.id)
    s, tok = e.prefill(b)
    assert s.cached_tokens == 2048
    got = exported(e, s.id)
    e.release(s.id)
    s2, want_tok = ref.prefill(b)
    assert tok == want_tok
    want = exported(ref, s2.id)
    assert got.keys() == want.keys()
    for k in got:
        assert torch.equal(got[k], want[k]) if isinstance(got[k], torch.Tensor) else got[k] == want[k], k


@cuda
def test_a_piece_another_prompt_cached_meanwhile_is_restored_in_its_pass(big, monkeypatch):
    """Out of step (prefix_cache.restore_pieces), 1,024-token pieces, one a pass: b starts before anything is
    cached, its pieces arrive once a's first pass runs, so b's pass of a shared piece restores it from the cache
    a's pass filled; b's state and first token are bitwise the prompt computed, and each shared piece ran once
    (tests/prefill_worker/test_prefix_cache.py has the CPU twin)."""
    import threading

    import prefill_worker.engine as eng
    from prefill_worker.engine import ExactEngine

    e = ExactEngine(_runner(big, chunk=1024), prefix_entries=4, prefill_budget=1024)
    ref = ExactEngine(_runner(big, chunk=1024))  # the same cuts, nothing cached
    a = _prompts(big.cfg.vocab_size, [2600], seed=31)[0]
    b = a[:2100] + _prompts(big.cfg.vocab_size, [300], seed=32)[0]  # shares boundaries 1,024 and 2,048
    a_runs, got = threading.Event(), {}
    give_way, pieces = e.verifies.give_way, eng.prefill_pieces
    monkeypatch.setattr(e.verifies, "give_way", lambda: (a_runs.set(), give_way())[1])

    def late(*args, **kw):
        if threading.current_thread().name == "b":
            assert a_runs.wait(60)
        return pieces(*args, **kw)

    monkeypatch.setattr(eng, "prefill_pieces", late)

    def run(name, ids):
        s, tok = e.prefill(ids)
        got[name] = (tok, exported(e, s.id), s.cached_tokens)
        e.release(s.id)

    threads = [threading.Thread(target=run, args=(n, ids), name=n) for n, ids in (("a", a), ("b", b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert got.keys() == {"a", "b"} and got["a"][2] == 0 and got["b"][2] in (1024, 2048), got.get("b", (0, 0, 0))[2]
    assert e.pass_totals[2] == 2600 + 2400 - 2048  # each shared piece computed once
    s, want_tok = ref.prefill(b)
    want = exported(ref, s.id)
    tok, have, _ = got["b"]
    assert tok == want_tok and have.keys() == want.keys()
    for k in have:
        assert torch.equal(have[k], want[k]) if isinstance(have[k], torch.Tensor) else have[k] == want[k], k


@cuda
def test_wide_prefill_computes_the_model(big, monkeypatch):
    from baton.engine import prefill as pf

    ids = _prompts(big.cfg.vocab_size, [700], seed=5)[0]
    r = _runner(big)
    r.prefill(0, ids)
    h_wide = r.state.hidden[0].float().clone()
    monkeypatch.setattr(pf, "wide_prefill", lambda dev: contextlib.nullcontext())  # cuBLAS / torch norms
    r.prefill(1, ids)
    h_ref = r.state.hidden[1].float()
    rel = ((h_wide - h_ref).norm() / h_ref.norm()).item()
    assert rel < 0.05, rel


@cuda
def test_the_fused_conv_computes_the_torch_conv(big, monkeypatch):
    from baton.kernels import wide
    from baton.models import gdn_ops
    from baton.models.context import PassIndex, Segment

    C, KW = big.cfg.conv_dim, big.cfg.linear_conv_kernel_dim
    g = torch.Generator(device="cuda").manual_seed(3)
    shape, segs, off = [(1, 0, 700), (3, 40, 2), (0, 9, 1), (4, 0, 3000)], [], 0
    for slot, start, n in shape:
        segs.append(Segment(slot, start, n, off))
        off += n
    x = torch.randn(off, C, device="cuda", generator=g).bfloat16()
    w = (torch.randn(C, KW, device="cuda", generator=g) * 0.5).bfloat16()
    state = torch.randn(5, C, KW - 1, device="cuda", generator=g).bfloat16()
    s_ref, s_got = state.clone(), state.clone()
    ref = gdn_ops.conv_segments_torch(x, s_ref, PassIndex(segs, "cuda"), w)
    got = wide.causal_conv(x, s_got, w, PassIndex(segs, "cuda"))
    assert torch.equal(s_got, s_ref)
    diff = (got.float() - ref.float()).abs()
    assert (diff <= 1e-2 * ref.float().abs() + 1e-3).all(), diff.max().item()  # a bf16 rounding at most
    assert (got == ref).float().mean().item() > 0.95
    # a whole prefill with either conv
    ids = _prompts(big.cfg.vocab_size, [900], seed=6)[0]
    r = _runner(big)
    r.prefill(0, ids)
    h_fused = r.state.hidden[0].float().clone()
    monkeypatch.setattr(wide, "causal_conv", lambda x, st, w, index: gdn_ops.conv_segments_torch(x, st, index, w))
    r.prefill(1, ids)
    h_ref = r.state.hidden[1].float()
    rel = ((h_fused - h_ref).norm() / h_ref.norm()).item()
    # the tolerance of test_wide_prefill_computes_the_model (the same model under other roundings): random
    # 9B weights amplify a bf16 rounding over 32 layers; 0.037 on the H200 at c04fef7 (it failed a first
    # bound of 0.02; the kernel-level checks above, state bitwise and each element within a rounding, held)
    assert rel < 0.05, rel


@cuda
def test_a_re_prefill_replays_as_the_ar_decode_did(big):
    """A migration's re-prefill (prompt + g generated tokens, generated=g) on the prefill worker's runner (CUDA
    graphs captured as the worker does) leaves the slot bitwise in the state the exact AR decode reached, and
    picks the same next token (baton/engine/prefill.py replay_step), for g below, at and past W."""
    from baton.engine.runner import ModelRunner
    from prefill_worker.engine import ExactEngine
    from prefill_worker.serve import prepare_cuda

    r = ModelRunner(big.model, slots=4, max_len=4096, width=16, checkpoints=True)
    prepare_cuda(r)
    e = ExactEngine(r)
    prompt = _prompts(big.cfg.vocab_size, [300], seed=3)[0]
    ref = e.generate(prompt, 42)
    for g in (1, 16, 40):
        s, _ = e.prefill(prompt)
        for want in ref[1 : g + 1]:
            assert e.step(s.id) == want
        tensors, pos, nxt = e.export(s.id)
        alone = {t.name: t.materialize().clone() for t in tensors}
        e.release(s.id)
        again, tok = e.prefill(prompt + ref[:g], generated=g)
        assert tok == ref[g], g
        tensors, pos2, nxt2 = e.export(again.id)
        assert (pos2, nxt2) == (pos, nxt), g
        for t in tensors:  # AR steps write no MTP KV; the replay writes it as a prefill would (not compared)
            if not t.name.startswith("mtp."):
                assert torch.equal(t.materialize(), alone[t.name]), (g, t.name)
        e.release(again.id)


@cuda
def test_concurrent_re_prefills_share_their_replay_passes_and_equal_the_ar_decode(big):
    """Three re-prefills at once (a dead decode worker's sessions) on the worker's runner: their W-row blocks
    share the fused batched rows passes ("rowsb" graphs), and each slot ends bitwise in its AR state."""

    from baton.engine.runner import ModelRunner
    from prefill_worker.engine import ExactEngine
    from prefill_worker.serve import prepare_cuda

    r = ModelRunner(big.model, slots=6, max_len=4096, width=16, checkpoints=True)
    prepare_cuda(r)
    e = ExactEngine(r)
    prompts, gs = _prompts(big.cfg.vocab_size, [300, 120, 57], seed=4), [40, 16, 23]
    refs, alone = decoded_alone(e, prompts, gs)
    out = re_prefill_together(e, prompts, refs, gs, timeout=300)
    assert e.replays.gather.max_items == 3
    for (again, tok), ref, g, want in zip(out, refs, gs, alone):
        assert tok == ref[g], g
        got = exported(e, again.id)
        assert (got["pos"], got["next"]) == (want["pos"], want["next"]), g
        for name in got:
            if name not in ("pos", "next") and not name.startswith("mtp."):
                assert torch.equal(got[name], want[name]), (g, name)


@cuda
def test_prompt_logprobs_at_the_9b_vocabulary_do_not_depend_on_the_pass(big):
    """Prompt logprobs (482f8d2) at the 9B vocabulary (248K: [64, vocab] float32 head calls): a prompt's
    logprobs and top-5 alternatives are bitwise the same alone and in a pass with other prompts, and so are
    its 128-token pieces alone and beside other prompts (close to the whole prompt's: another cut); the first token is unchanged by asking; and they are the model's: within bf16 rounding of
    the log_softmax of the eager rows path's logits from position 0 (float64)."""
    from baton.engine.prefill import Piece, prefill_pieces, run_pass

    prompt, other, third = _prompts(big.cfg.vocab_size, [300, 77, 512], seed=3)

    def asked(pieces):
        for p in pieces:
            p.prompt_logprobs = 5
        return pieces

    plain = _runner(big)
    tok = plain.prefill(0, prompt)
    r = _runner(big)
    (solo,) = asked([Piece(0, prompt)])
    assert run_pass(r, [solo]) == [tok]
    assert len(solo.logprobs) == len(prompt) - 1 and all(len(top) == 5 for _, top in solo.logprobs)
    r2 = _runner(big)
    mates = asked([Piece(1, other), Piece(0, prompt), Piece(2, third)])
    assert run_pass(r2, mates)[1] == tok
    assert mates[1].logprobs == solo.logprobs
    r3, r4 = _runner(big, chunk=128), _runner(big, chunk=128)  # pieces: alone, and each beside another prompt
    ps, qs = asked(prefill_pieces(r3, 0, prompt)), asked(prefill_pieces(r4, 0, prompt))
    assert len(ps) == 3
    cut_tok = [run_pass(r3, [p]) for p in ps][-1]  # another cut than the whole prompt's: its own bits
    run_pass(r4, asked([Piece(1, other), qs[0]]))
    run_pass(r4, [qs[1], *asked([Piece(2, third)])])
    assert run_pass(r4, [qs[2]]) == cut_tok
    cut = [x for p in ps for x in p.logprobs]
    assert [x for q in qs for x in q.logprobs] == cut
    assert max(abs(a - b) for (a, _), (b, _) in zip(cut, solo.logprobs)) < 0.25
    ref = _runner(big)  # the eager rows path, W = 16 rows a block from position 0
    ref.state.reset(0)
    rows = []
    for c in range(0, len(prompt), ref.width):
        blk = prompt[c : c + ref.width]
        ids = torch.zeros(ref.width, dtype=torch.long, device="cuda")
        ids[: len(blk)] = torch.tensor(blk)
        rows.append(torch.log_softmax(rows_with_logits(ref, 0, ids, len(blk))[1][: len(blk)].double(), -1))
    lp = torch.cat(rows)
    got = torch.tensor([v for v, _ in solo.logprobs], dtype=torch.float64)
    want = lp[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])].cpu()
    diff = (got - want).abs()  # bf16: two kernel paths' roundings (a wrong token's logprob is off by units)
    assert diff.mean().item() < 0.1 and diff.max().item() < 1.0, (diff.mean().item(), diff.max().item())
    top_ids = torch.tensor([[i for i, _ in top] for _, top in solo.logprobs])
    agree = (top_ids[:, 0] == lp[: len(prompt) - 1].argmax(-1).cpu()).float().mean().item()
    assert agree > 0.5, agree  # random weights: the top logits lie close together
