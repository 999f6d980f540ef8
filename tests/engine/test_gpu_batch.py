"""GPU checks of batch invariance (run on the device with `pytest -m gpu`), on the Qwen3.5-9B shape with
random weights:
  * the rows GEMM (gemv.linear): every row of an M-row call is bitwise that row computed in a 16-row
    call, for every M up to 128, bf16 and fp8, reduced and split-K partials;
  * the batched AR step (fused_batch.BatchedAR) under CUDA graphs: a session's tokens and state are
    bitwise those of the session alone (ar_step, and the exact engine's AR path `rows`), inside batches
    of every bucket up to 128 with other sessions at other positions, bf16 and fp8;
  * DecodeEngine: concurrent decode calls step together and each equals its decode alone."""

from __future__ import annotations

import copy
import dataclasses
import os
import threading

import pytest
import torch
from helpers import count_graph_replays

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(1200)]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
SHAPE = os.environ.get("BATON_GPU_SHAPE", "qwen3.5-9b")


@cuda
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_rows_gemm_rows_do_not_depend_on_m(fp8):
    from baton.kernels import gemv

    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = sorted({(n, k) for (f, n, k) in gemv.TUNED if f == fp8} | {(24576, 4096), (1000, 4096)})
    for N, K in shapes:
        w = torch.randn(N, K, device="cuda", generator=g).to(torch.bfloat16) * 0.02
        scale = None
        if fp8:
            scale = w.float().abs().amax(1).clamp(min=1e-8) / 448.0
            w = (w.float() / scale[:, None]).to(torch.float8_e4m3fn)
        x = torch.randn(128, K, device="cuda", generator=g).to(torch.bfloat16)
        for partial in (False, True):  # partial: [SPLIT, M, N], the chunks joined along M
            chunks = [gemv.linear(x[i : i + 16], w, scale, partial=partial) for i in range(0, 128, 16)]
            ref = torch.cat(chunks, dim=1 if partial else 0)
            for M in (1, 3, 16, 17, 32, 64, 100, 128):
                y = gemv.linear(x[:M], w, scale, partial=partial)
                assert torch.equal(y, ref[:, :M] if partial else ref[:M]), (N, K, M, partial)


@pytest.fixture(scope="module")
def big():
    from baton.loading import random_model
    from baton.random_init import shape

    return random_model(shape(SHAPE), dtype="bf16", device="cuda", seed=0, mtp=False)


def _runner(model, slots, max_len):
    from baton.engine import graph
    from baton.engine.runner import ModelRunner

    r = ModelRunner(model, slots=slots, max_len=max_len, width=16)
    r.enable_batching()
    graph.capture_all(r, max_draft=1)
    assert sorted(n for k, n in r.graphs if k == "arb") == [p for p in (1, 2, 4, 8, 16, 32, 64, 128) if p < 2 * slots]
    return r


@cuda
@pytest.mark.parametrize("engine", ["bf16", "fp8"])
def test_batched_ar_equals_each_session_alone_every_bucket(big, engine, monkeypatch):
    from baton.engine import nogil

    monkeypatch.setenv(nogil.ENV, "1")  # the batched steps through the GIL-holding launcher
    monkeypatch.setattr(nogil, "_state", {})
    model = big.model
    if engine == "fp8":
        from decode_worker import fp8

        model = copy.deepcopy(model)
        fp8.quantize_model(model, "full")
    S, T, L = 130, 24, 1024
    r = _runner(model, S, L)
    # the batched steps launch through baton/engine/nogil.py (the alone paths through torch): equal below
    assert r.batched._nogil is not None
    g = torch.Generator().manual_seed(7)
    V = big.cfg.vocab_size
    for s in range(S):  # every session at its own position
        r.prefill(s, torch.randint(0, V, (int(torch.randint(20, 600, (1,), generator=g)),), generator=g).tolist())
    targets = [0, 57, 129]
    st = r.state
    solo, solo_rows = {}, {}
    for s in targets:  # alone: the decode worker's AR step, and the exact engine's AR path (rows)
        st.snapshot(s)
        pos0 = int(st.position[s])
        solo[s] = [r.ar_step(s) for _ in range(T)]
        after = [t.tensor.clone() for t in st.export(s)]
        st.restore(s)
        t, solo_rows[s] = int(st.next_token[s]), []
        for _ in range(T):
            t = r.rows(s, [t])[0]
            solo_rows[s].append(t)
        st.restore(s)
        assert int(st.position[s]) == pos0
        solo[s] = (solo[s], after)
    sizes = [1, 2, 3, 5, 8, 13, 16, 31, 32, 33, 64, 100, 128, 128, 127, 65, 17, 9, 4, 2, 1, 40, 128, 77]
    got = {s: [] for s in targets}
    others = [s for s in range(S) if s not in targets]
    for step, b in enumerate(sizes[:T]):
        pick = targets + [others[i] for i in torch.randperm(len(others), generator=g)[: b - len(targets)].tolist()]
        pick = pick[:b] if b < len(targets) else pick
        # targets not in a small batch step alone this step (the same step either way)
        rest = [s for s in targets if s not in pick]
        order = torch.randperm(len(pick), generator=g).tolist()
        toks = r.ar_batch([pick[i] for i in order])
        for i, t in zip(order, toks):
            if pick[i] in got:
                got[pick[i]].append(t)
        for s in rest:
            got[s] += r.ar_batch([s])
    for s in targets:
        assert got[s] == solo[s][0], (engine, s)
        assert got[s] == solo_rows[s], (engine, s, "exact AR path")
        now = [t.tensor for t in st.export(s)]
        assert all(torch.equal(a, b) for a, b in zip(now, solo[s][1])), (engine, s, "state")


@cuda
def test_concurrent_decodes_step_together_and_equal_alone(big):
    from decode_worker.engine import DecodeEngine

    S, N = 16, 40
    r = _runner(big.model, S, 1024)
    eng = DecodeEngine({"bf16": r}, default_engine="bf16")
    g = torch.Generator().manual_seed(9)
    V = big.cfg.vocab_size
    states = []
    for s in range(S):
        r.prefill(s, torch.randint(0, V, (int(torch.randint(30, 500, (1,), generator=g)),), generator=g).tolist())
        states.append(
            (
                {t.name: t.tensor.clone() for t in r.state.export(s)},
                int(r.state.position[s]),
                int(r.state.next_token[s]),
            )
        )
        r.state.reset(s)

    def run(i, out):
        tensors, pos, nxt = states[i]
        sess = eng.load({k: v.clone() for k, v in tensors.items()}, position=pos, next_token=nxt, engine="bf16")
        out[i] = [t for b in eng.decode(sess.id, N) for t in b]
        eng.release(sess.id)

    alone = {}
    for i in range(S):
        run(i, alone)
    sched = eng._scheduler
    steps0, rows0 = sched.steps, sched.rows
    together = {}
    th = [threading.Thread(target=run, args=(i, together)) for i in range(S)]
    for t in th:
        t.start()
    for t in th:
        t.join()
    steps, rows = sched.steps - steps0, sched.rows - rows0
    eng.close()
    assert together == alone
    assert rows == S * N and steps < rows / 4, (steps, rows)  # they stepped together


@cuda
@pytest.mark.parametrize("kind", ["arbs", "arbt"])
def test_sampled_batched_steps_run_in_the_sampled_graph_and_equal_alone(big, kind, monkeypatch):
    """Sessions that sample (seeded temperature with top-p, top-k with min-p; with logprobs for "arbs", and
    for "arbs" a greedy and a sampled session with a logit_bias, the sampled one penalized too, the greedy one
    with min_tokens' ban of its biased ids for half the steps, and a structured-output session under a fixed
    mask) beside greedy
    ones: every batched step replays the captured sampled graph ("arbs": the full pick on the
    device; "arbt": the lite one, no penalties or logprobs asked) and each session's tokens and logprobs are
    bitwise those of the session stepping alone (eager pick)."""
    from baton.engine.sampling import Params

    S, T = 12, 16
    r = _runner(big.model, S, 1024)
    assert sorted(n for k, n in r.graphs if k == "arbs") == sorted(n for k, n in r.graphs if k == "arb")
    g = torch.Generator().manual_seed(11)
    V = big.cfg.vocab_size
    kinds = [
        Params(),
        Params(temperature=0.8, top_p=0.9, seed=101),
        Params(temperature=1.0, top_k=50, min_p=0.05, seed=7, logprobs=3 if kind == "arbs" else 0),
    ]
    if kind == "arbs":  # the full pick's bias and penalties in the captured graph (a1963fd): greedy and sampled
        bias = ((3, 6.5), (17, -100.0), (V - 1, 2.25))
        kinds += [
            Params(logit_bias=bias),
            Params(temperature=0.9, seed=5, logit_bias=bias, repetition_penalty=1.3, presence_penalty=0.4),
            Params(temperature=0.7, seed=9, structured=b"mask"),  # structured outputs: a fixed mask's bits
        ]
        allowed = torch.randperm(V, generator=g)[:2000]
        bits = torch.zeros(r.sampling.mask_bits.shape[2] * 32, dtype=torch.int64)
        bits[allowed] = 1
        bits = (bits.view(-1, 32) << torch.arange(32)).sum(1).to(torch.int64)
        bits = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)
    for s in range(S):
        r.prefill(s, torch.randint(0, V, (int(torch.randint(20, 400, (1,), generator=g)),), generator=g).tolist())
        r.sampling.history.begin(s, r.state.position[s].item())  # penalties read the slot's history
        p = kinds[s % len(kinds)]
        if p.logit_bias and p.greedy:  # min_tokens too: its biased ids banned for the first half of the steps
            p = dataclasses.replace(p, ban_end=r.state.position[s].item() + T // 2, banned=(3, V - 1))
        r.sampling.set(s, p)
        if p.constrained:
            r.sampling.allow(s, 0, bits.expand(r.sampling.width, -1).contiguous())  # every position's row
    targets, st = ([1, 2, 3, 4, 5] if kind == "arbs" else [1, 2, 5, 9]), r.state  # each kind of session
    solo = {}
    for s in targets:  # alone: the one-slot AR step (a sampled slot picks eagerly)
        st.snapshot(s)
        toks, lps = [], []
        for _ in range(T):
            toks.append(r.ar_step(s))
            lps.append(r.sampling.logprobs(s, 1))
        solo[s] = (toks, lps, [t.tensor.clone() for t in st.export(s)])
        st.restore(s)
    replays = count_graph_replays(monkeypatch, r, ("arb", "arbs", "arbt"))
    got = {s: ([], []) for s in targets}
    others = [s for s in range(S) if s not in targets]
    for step in range(T):
        b = len(targets) + step % (len(others) + 1)
        pick = targets + [others[i] for i in torch.randperm(len(others), generator=g)[: b - len(targets)].tolist()]
        order = torch.randperm(len(pick), generator=g).tolist()
        toks = r.ar_batch([pick[i] for i in order])
        for i, t in zip(order, toks):
            if pick[i] in got:
                got[pick[i]][0].append(t)
        for s in targets:
            got[s][1].append(r.sampling.logprobs(s, 1))
    assert sum(k == kind for k, _ in replays) == T and set(k for k, _ in replays) == {kind}
    if kind == "arbs":  # the constrained session picked only its allowed tokens
        assert set(got[5][0]) <= set(allowed.tolist())
    for s in targets:
        assert got[s][0] == solo[s][0], s
        assert got[s][1] == solo[s][1], (s, "logprobs")
        assert all(torch.equal(a, b.tensor) for a, b in zip(solo[s][2], st.export(s))), (s, "state")
