"""GPU checks of the prefill worker's batched verify (issue 21; run on the device with `pytest -m gpu`),
Qwen3.5-9B shape, random weights, on the exact engine a prefill worker serves (ExactEngine over a
ModelRunner with per-row checkpoints, batching and graphs, as prefill_worker/serve.py builds it):
  * a verify pass of 16 sessions' blocks of 5 rows, and of 32 sessions' blocks of 9 rows (K = 8: one pass
    of 288 rows, the (32, 9) graph of MAX_ROWS 320) (ExactEngine._verify_batch, what concurrent Verify
    calls share) leaves each session's accepted count, next token, position and state bitwise those of
    its block verified alone;
  * exact mode under a batch of 16: rounds of 16 sessions' blocks, drafted by a drafter that is right
    only some of the time, accept exactly the exact engine's own AR tokens for every session."""

from __future__ import annotations

import os
import random

import pytest
import torch

from prefill_worker.verifying import verify_batch

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(1200)]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
SHAPE = os.environ.get("BATON_GPU_SHAPE", "qwen3.5-9b")
S, K, NEW = 16, 4, 24
S_MAX, K_MAX = 32, 8  # the widest verify pass checked: 32 blocks of K_MAX + 1 rows


@pytest.fixture(scope="module")
def big():
    from baton.loading import random_model
    from baton.random_init import shape

    return random_model(shape(SHAPE), dtype="bf16", device="cuda", seed=0, mtp=False)


def _engine(lm, slots=S_MAX + 1):
    from baton.engine.runner import ModelRunner
    from prefill_worker.engine import ExactEngine
    from prefill_worker.serve import prepare_cuda

    runner = ModelRunner(lm.model, slots=slots, max_len=2048, width=K_MAX + 2, checkpoints=True)
    prepare_cuda(runner)  # as the worker serves it: batched blocks (fused_blocks.py) in captured graphs
    return ExactEngine(runner)


def _prompts(vocab, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randrange(20, 900))] for _ in range(S_MAX)]


def _state(e, sid):
    tensors, pos, nxt = e.export(sid)
    return {**{t.name: t.materialize().clone() for t in tensors}, "position": pos, "next": nxt}


@pytest.fixture(scope="module")
def refs(big):
    """Each prompt's exact AR continuation (ExactEngine.generate alone: what `baton complete` prints)."""
    prompts = _prompts(big.cfg.vocab_size)
    e = _engine(big, slots=1)
    return prompts, [e.generate(p, NEW + K_MAX + 1) for p in prompts]


def _drafts(right: list[int], rng: random.Random, vocab: int) -> list[int]:
    """len(right) drafts that follow the true continuation `right` up to a random point (or all the way),
    then go wrong: the verifier accepts a different prefix length per block."""
    cut = rng.randrange(len(right) + 1)
    return right[:cut] + [(t + 1) % vocab for t in right[cut:]]


def _prefilled(lm, prompts, ref):
    """A fresh engine with every prompt prefilled -> (engine, session ids); each first token checked."""
    e = _engine(lm)
    sids = []
    for p, r in zip(prompts, ref):
        s, first = e.prefill(p)
        assert first == r[0]
        sids.append(s.id)
    return e, sids


@cuda
@pytest.mark.parametrize("n,k", [(S, K), (S_MAX, K_MAX)])
def test_a_verify_pass_of_many_blocks_equals_each_block_alone(big, refs, monkeypatch, n, k):
    from baton.engine import nogil

    prompts, ref = refs
    e, sids = _prefilled(big, prompts[:n], ref[:n])
    rng = random.Random(1)
    blocks = [[r[0]] + _drafts(r[1 : 1 + k], rng, big.cfg.vocab_size) for r in ref[:n]]
    alone, st = [], e.runner.state
    for sid, block in zip(sids, blocks):
        slot = e.get(sid).slot
        st.snapshot(slot)
        with e._compute:
            (got,) = verify_batch(e.runner, [(e.get(sid), block, None)])
        alone.append((got[:3], _state(e, sid)))
        st.restore(slot)
    # together through the GIL-holding launcher (baton/engine/nogil.py: the pass's copies and replays),
    # alone above through torch's calls
    monkeypatch.setenv(nogil.ENV, "1")
    monkeypatch.setattr(nogil, "_state", {})
    assert nogil.launcher() is not None
    assert ("rowsb", (n, k + 1)) in e.runner.graphs  # one captured pass of n blocks of k + 1 rows
    copies = st.slot_copies  # the snapshot and the cut blocks' restore: a graph replay each (slot_copies.py)
    assert copies is not None and copies.graphs
    assert ("replay", (n, k + 1)) in e.runner.graphs  # the cut blocks' kept rows through the GDN layers
    replays, kept = copies.replays, e.runner.batched_rows.replays
    with e._compute:
        together = verify_batch(e.runner, [(e.get(sid), block, None) for sid, block in zip(sids, blocks)])
    assert copies.replays - replays == 2 and e.runner.batched_rows.replays - kept == 1
    accepted = set()
    for sid, got, (want, state) in zip(sids, together, alone):
        assert got[:3] == want, sid
        now = _state(e, sid)
        for k, v in state.items():
            assert torch.equal(now[k], v) if isinstance(v, torch.Tensor) else now[k] == v, (sid, k)
        accepted.add(got[0])
    assert len(accepted) > 1  # the blocks accepted different lengths in the same pass


@cuda
def test_exact_mode_under_a_batch_of_16_equals_exact_ar(big, refs):
    prompts, ref = refs
    prompts, ref = prompts[:S], ref[:S]
    e, sids = _prefilled(big, prompts, ref)
    rng = random.Random(2)
    out = [[r[0]] for r in ref]
    rounds = 0
    while any(len(o) < NEW for o in out):
        live = [i for i in range(S) if len(out[i]) < NEW]
        items = []
        for i in live:  # m varies per session and round
            drafts = _drafts(ref[i][len(out[i]) : len(out[i]) + K], rng, big.cfg.vocab_size)
            items.append((e.get(sids[i]), [out[i][-1]] + drafts, None))
        with e._compute:
            res = verify_batch(e.runner, items)
        for i, (_, block, _), got in zip(live, items, res):
            m, nxt = got[0], got[1]
            out[i] += block[1 : 1 + m] + [nxt]
        rounds += 1
    for i in range(S):
        assert out[i][:NEW] == ref[i][:NEW], i
    assert rounds < NEW  # several tokens per round on average: the rounds really verified drafts
