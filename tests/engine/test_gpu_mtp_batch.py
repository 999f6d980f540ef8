"""GPU checks of batched MTP speculation (run on the device with `pytest -m gpu`), Qwen3.5-9B shape, random
weights with an MTP head, the decode worker's runner as served (bf16 + mtp on one runner with row
checkpoints, batching on, every graph captured):
  * eight concurrent fast-mode mtp decodes (prompts of different lengths, so blocks are cut at
    different points and the passes are ragged) each give exactly the exact engine's AR tokens, with
    their rounds gathered (several sessions a round) and the batched graphs replayed: the chains'
    ("mtpb", (P, n)) and the verify's ("rowsb", (P, n));
  * the same under the adaptive draft length (K = 0 rounds included) and with a drafter that is right
    only some of the time;
  * run-ahead sessions whose plain rounds (K = 0) run as pipelined batched AR steps ("arb",
    decode_worker/mtp_launch.py), flushed and interleaved with speculative rounds, give the exact AR
    tokens and leave each session's finalised MTP KV bitwise what K = 3 every round leaves."""

from __future__ import annotations

import os
import random
import threading

import pytest
import torch
from helpers import count_graph_replays

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(1200)]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
SHAPE = os.environ.get("BATON_GPU_SHAPE", "qwen3.5-9b")
S, NEW = 8, 40


@pytest.fixture(scope="module")
def setup():
    from baton.engine import graph
    from baton.engine.runner import ModelRunner
    from baton.loading import random_model
    from baton.random_init import shape
    from prefill_worker.engine import ExactEngine

    lm = random_model(shape(SHAPE), dtype="bf16", device="cuda", seed=0, mtp=True)
    rng = random.Random(0)
    prompts = [[rng.randrange(lm.cfg.vocab_size) for _ in range(n)] for n in rng.sample(range(30, 700), S)]
    max_len = 800
    exact = ExactEngine(ModelRunner(lm.model, slots=1, max_len=max_len, width=16))
    refs = [exact.generate(p, NEW) for p in prompts]
    r = ModelRunner(lm.model, slots=S, max_len=max_len, width=16, checkpoints=True)
    r.enable_batching()
    graph.capture_all(r, max_draft=4)
    assert any(k[0] == "mtpb" for k in r.graphs) and any(k[0] == "rowsb" for k in r.graphs)
    return lm, exact, prompts, refs, r


class _Scripted:
    """A controller that plays a fixed list of K (then its last)."""

    def __init__(self, ks):
        self.ks, self.i = list(ks), 0

    def next_k(self, batch=None):
        self.i += 1
        return self.ks[min(self.i - 1, len(self.ks) - 1)]

    def observe_round(self, k, accepted, draft_s, verify_s):
        pass

    def observe_drafts(self, accepted, rejected):
        pass


def _decode_all(setup, policy, drafter=None, ctl=None, run_ahead=False, kv=None):
    """Every prompt's session decoded by fast mtp at once -> (tokens, most sessions in a round, the
    batched graphs replayed). ctl: the engine's controller (default: `policy`'s); kv: a dict that gets
    each session's (mtp_start, its finalised MTP KV) before its release."""
    from baton.engine.speculation import GREEDY
    from decode_worker.engine import DecodeEngine

    lm, exact, prompts, refs, r = setup
    graphs = dict(r.graphs)
    mp = pytest.MonkeyPatch()
    replays = count_graph_replays(mp, r, ("mtpb", "rowsb", "arb"))
    try:
        dec = DecodeEngine({"bf16": r, "mtp": r}, default_engine="mtp", draft_length=policy, drafter=drafter or GREEDY)
        dec._mtp_ctl = ctl
        loaded = []
        for p in prompts:
            s, first = exact.prefill(p)
            tensors, pos, nxt = exact.export(s.id)
            sess = dec.load({t.name: t.tensor.clone() for t in tensors}, position=pos, next_token=nxt, engine="mtp")
            loaded.append((sess, first))
            exact.release(s.id)
        outs: list = [None] * S
        start = threading.Barrier(S)

        def one(i):
            sess, first = loaded[i]
            start.wait()
            outs[i] = [first] + [t for b in dec.decode(sess.id, NEW - 1, k=4, run_ahead=run_ahead) for t in b]
            if kv is not None:
                L, n = r.state.mtp_layer, sess.mtp_start
                kv[i] = (n, [x[:, :n].clone() for x in r.state.slot_kv(L, sess.slot, n)])
            dec.release(sess.id)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(S)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return outs, dec.mtp_round_max, [key[0] for key in replays]
    finally:
        mp.undo()
        r.graphs.clear()
        r.graphs.update(graphs)


@cuda
def test_concurrent_mtp_decodes_batch_their_rounds_and_equal_exact_ar(setup):
    refs = setup[3]
    outs, most, log = _decode_all(setup, "fixed")
    for i in range(S):
        assert outs[i] == refs[i], i
    assert most > 1  # rounds of several sessions shared their passes
    assert "mtpb" in log and "rowsb" in log  # in the batched graphs


def _sometimes_right(prompts, refs):
    from baton.engine.speculation import Drafter

    class SometimesRight(Drafter):
        """Drafts the exact continuation with probability 0.7 (blocks accepted to different lengths); the
        prompts' lengths are distinct, so a session's start position names its reference."""

        def __init__(self):
            self.by_len = {len(p): ref for p, ref in zip(prompts, refs)}
            self.rng = random.Random(3)
            self.start: dict[str, int] = {}

        def attach(self, session, position, next_token):
            self.start[session.id] = position

        def propose(self, session, i, own):
            ref = self.by_len[self.start[session.id]]
            j = int(session.runner.state.position[session.slot]) - self.start[session.id] + 1 + i
            right = ref[j] if j < len(ref) else own
            return right if self.rng.random() < 0.7 else (right + 1) % 1000

    return SometimesRight()


@cuda
def test_adaptive_k_and_partly_right_drafts_stay_exact(setup):
    _, _, prompts, refs, _ = setup
    outs, most, log = _decode_all(setup, "adaptive", _sometimes_right(prompts, refs))
    for i in range(S):
        assert outs[i] == refs[i], i
    assert most > 1 and "rowsb" in log


@cuda
def test_pipelined_plain_rounds_keep_tokens_and_mtp_kv(setup):
    prompts, refs = setup[2], setup[3]
    steady: dict = {}
    outs, _, _ = _decode_all(setup, "fixed", ctl=_Scripted([3]), kv=steady)
    assert outs == refs
    mixed: dict = {}
    ks = [2] + [0] * 14 + [3, 1] + [0] * 9 + [4, 0]
    outs, most, log = _decode_all(setup, "fixed", ctl=_Scripted(ks), run_ahead=True, kv=mixed)
    for i in range(S):
        assert outs[i] == refs[i], i
    assert most > 1 and "arb" in log and "mtpb" in log
    for i in range(S):
        upto = min(steady[i][0], mixed[i][0])
        assert upto > len(prompts[i]) + 10  # most of the run is final in both
        for a, b in zip(steady[i][1], mixed[i][1]):
            assert torch.equal(a[:, :upto], b[:, :upto]), i
