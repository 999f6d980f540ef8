"""The embedded default model (baton/assets/default-model, trained by deploy/train_default_model.py): it loads with
its MTP head, the MTP head really drafts (acceptance >= 1.8 tokens per round at K=3 on held-out code),
mtp and FP8-draft exact mode stay token-identical to the exact AR reference, and Baton matches
transformers on it. Full figures: benchmarks/acceptance_default_model.py."""

from __future__ import annotations

import copy

import pytest
import torch

from baton.engine.runner import ModelRunner
from baton.loading import DEFAULT_MODEL_DIR, load_model
from baton.tokenizer import Tokenizer
from decode_worker.engine import DecodeEngine
from decode_worker.fp8 import quantize_model
from prefill_worker.engine import ExactEngine

# the first lines of functions from held-out stdlib files (sha256(relpath) mod 20 == 0)
PROMPTS = [
    "def AddPackagePath(packagename, path):\n    packagePathMap.setdefault(packagename, []).append(path)\n",
    "def sub_debug(msg, *args):\n    if _logger:\n",
    "    def __init__(self, **kw):\n        \"\"\"Create new Policy, possibly overriding some defaults.\n",
]
NEW, MAX_LEN = 48, 160
pytestmark = pytest.mark.timeout(600)  # ~15 s alone; CPU contention can stretch it


@pytest.fixture(scope="module")
def env():
    lm = load_model(None, dtype="fp32", mtp=True)
    tok = Tokenizer.from_dir(DEFAULT_MODEL_DIR)
    exact = ExactEngine(ModelRunner(lm.model, slots=2, max_len=MAX_LEN))
    r = ModelRunner(lm.model, slots=1, max_len=MAX_LEN)
    fp8 = copy.deepcopy(lm.model)
    del fp8.mtp
    quantize_model(fp8, "full")
    dec = DecodeEngine(
        {"bf16": r, "mtp": r, "fp8": ModelRunner(fp8, slots=1, max_len=MAX_LEN)},
        default_engine="mtp",
        draft_length="fixed",
    )  # fixed K: the acceptance at K=3
    return lm, tok, exact, dec


def _load(exact, dec, ids, engine, keep=False):
    s, first = exact.prefill(ids)
    tensors, pos, nxt = exact.export(s.id)
    sess = dec.load({t.name: t.tensor.clone() for t in tensors}, position=pos, next_token=nxt, engine=engine)
    if not keep:
        exact.release(s.id)
    return s, sess, first


def test_shape_and_files():
    lm = load_model(None, dtype="fp32")
    assert lm.has_mtp and lm.cfg.vocab_size == 8192 and lm.cfg.num_hidden_layers == 8
    assert sum(f.stat().st_size for f in DEFAULT_MODEL_DIR.glob("*.safetensors")) <= 16_000_000
    assert (DEFAULT_MODEL_DIR / "README.md").is_file() and (DEFAULT_MODEL_DIR / "tokenizer.json").is_file()


def test_mtp_drafts_well_and_stays_exact(env):
    lm, tok, exact, dec = env
    rounds = emitted = 0
    for text in PROMPTS:
        ids = tok.encode(text)
        ref = exact.generate(ids, NEW, eos_ids=lm.cfg.eos_token_ids)
        _, sess, first = _load(exact, dec, ids, "mtp")
        out = [first] + [t for b in dec.decode(sess.id, NEW - 1, eos_ids=lm.cfg.eos_token_ids, k=3) for t in b]
        rounds, emitted = rounds + sess.rounds, emitted + sess.emitted_in_rounds
        dec.release(sess.id)
        assert out == ref, text
    assert emitted / rounds >= 1.8, f"MTP acceptance {emitted / rounds:.2f} tokens per round at K=3"


def test_exact_mode_with_fp8_drafts(env):
    lm, tok, exact, dec = env
    ids = tok.encode(PROMPTS[0])
    ref = exact.generate(ids, NEW, eos_ids=lm.cfg.eos_token_ids)
    es, sess, first = _load(exact, dec, ids, "fp8", keep=True)
    out, verdict, drafted, accepted = [first], None, 0, 0
    while len(out) < NEW:
        drafts = dec.draft(sess.id, 4, verdict)
        v = exact.verify(es.id, [out[-1]] + drafts)
        out += drafts[: v.accepted] + [v.next_token]
        verdict, drafted, accepted = (v.accepted, v.next_token), drafted + 4, accepted + v.accepted
    exact.release(es.id)
    dec.release(sess.id)
    assert out[:NEW] == ref
    assert accepted / drafted >= 0.7, f"FP8 draft acceptance {accepted / drafted:.1%}"


@torch.no_grad()
def test_matches_transformers(env):
    from transformers import Qwen3_5ForCausalLM as HF

    from baton.models.qwen3_5 import StepContext

    lm, tok, _, _ = env
    ids = tok.encode(PROMPTS[0] + PROMPTS[1])
    ref = HF.from_pretrained(str(DEFAULT_MODEL_DIR), dtype=torch.float32).eval()(torch.tensor([ids])).logits[0]
    r = ModelRunner(lm.model, max_len=len(ids) + 16)
    r.state.reset(0)
    ours = lm.model.logits(lm.model(torch.tensor(ids), r.state, StepContext(slot=0, width=None, n=len(ids))))
    assert (ours - ref).abs().max() < 1e-3
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
