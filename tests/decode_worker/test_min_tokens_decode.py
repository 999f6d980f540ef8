"""DecodeEngine.decode with min_tokens' ban (Params.ban_end / banned): the banned id is never picked below the
end, the tokens equal the exact engine's with the same ban, and once every pick left is past the end the
session drops the ban (its steps may take the plain graphs again), in the batched and the mtp paths."""

import pytest

from baton.engine.runner import ModelRunner
from baton.engine.sampling import Params
from baton.loading import DEFAULT_MODEL_DIR, load_model
from baton.tokenizer import Tokenizer
from decode_worker.engine import DecodeEngine
from prefill_worker.engine import ExactEngine

PROMPT = "def sub_debug(msg, *args):\n    if _logger:\n"
NEW, MAX_LEN = 16, 128


@pytest.fixture(scope="module")
def env():
    lm = load_model(None, dtype="fp32", mtp=True)
    ids = Tokenizer.from_dir(DEFAULT_MODEL_DIR).encode(PROMPT)
    return lm, ids, ExactEngine(ModelRunner(lm.model, slots=1, max_len=MAX_LEN))


@pytest.mark.parametrize("engine", ["bf16", "mtp"])
def test_the_ban_holds_below_its_end_then_is_dropped(env, engine):
    lm, ids, exact = env
    plain = exact.generate(ids, NEW)
    end = len(ids) + 10
    p = Params(ban_end=end, banned=(plain[3], plain[4]))
    want = exact.generate(ids, NEW, sampling=p)
    assert want != plain and not {plain[3], plain[4]} & set(want[:10])  # so this test can fail
    r = ModelRunner(lm.model, slots=1, max_len=MAX_LEN)
    eng = DecodeEngine({"bf16": r, "mtp": r}, default_engine=engine, draft_length="fixed")
    es, first = exact.prefill(ids, sampling=p)
    tensors, pos, nxt = exact.export(es.id)
    s = eng.load({t.name: t.tensor.clone() for t in tensors}, position=pos, next_token=nxt, engine=engine)
    exact.release(es.id)
    r.sampling.set(s.slot, p)
    got, banned_after = [first], []
    for toks in eng.decode(s.id, NEW - 1, k=3):
        got += toks
        banned_after.append((len(ids) + len(got), r.sampling.params[s.slot].banning))
    assert got == want
    # banning while a pick below the end is left (the next pick is at prompt + tokens), dropped after
    assert all(banning == (at < end) for at, banning in banned_after), banned_after
    eng.close()
