"""The prefill worker's prefix cache (baton/engine/prefix_cache.py): a prompt that begins with a cached
prompt's first pieces starts from their state, and its state, first token and decode are bitwise what
computing every piece gives; entries are evicted leaves first and their pages go back to requests."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import exported, make_tiny_dir

from baton.engine.pages import PAGE, PagesExhausted
from baton.engine.prefix_cache import boundary_keys
from baton.engine.runner import ModelRunner
from baton.engine.sampling import Params
from baton.loading import load_model
from prefill_worker.engine import ExactEngine

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CHUNK = PAGE  # pieces of one page: boundaries every 256 tokens


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    return load_model(make_tiny_dir(tmp_path_factory.mktemp("m")), dtype="bf16")


def _engine(lm, entries=4, *, max_len=1280, kv_pages=None) -> ExactEngine:
    r = ModelRunner(lm.model, slots=4, max_len=max_len, width=8, kv_pages=kv_pages)
    r.prefill_chunk = CHUNK
    return ExactEngine(r, prefix_entries=entries)


def _ids(lm, n, seed):
    rng = random.Random(seed)
    return [rng.randrange(lm.cfg.vocab_size) for _ in range(n)]


def _prefilled(e, ids, **kw):
    s, tok = e.prefill(ids, **kw)
    state = exported(e, s.id)
    cached = s.cached_tokens
    e.release(s.id)
    return tok, state, cached


def _same_state(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k], k


@pytest.mark.parametrize("mtp", [True, False], ids=["mtp", "no-mtp"])
def test_a_prompt_from_cached_pieces_equals_it_computed(lm, mtp):
    assert lm.has_mtp
    e, ref = _engine(lm), _engine(lm, entries=0)
    assert ref.prefix is None
    a = _ids(lm, 700, 1)
    b = a[:600] + _ids(lm, 300, 2)  # shares boundaries 256 and 512 with a, not 768
    _, _, cached = _prefilled(e, a)
    assert cached == 0 and e.prefix.stats()["entries"] == 2
    tokens_before = e.pass_totals[2]
    tok, state, cached = _prefilled(e, b, mtp=mtp)  # mtp=False: the MTP layer's rows left zero, as computed
    assert cached == 512
    assert e.pass_totals[2] - tokens_before == 900 - 512  # only the rest was computed
    want_tok, want_state, _ = _prefilled(ref, b, mtp=mtp)
    assert tok == want_tok
    _same_state(state, want_state)
    st = e.prefix.stats()
    assert (st["hits"], st["tokens_reused"], st["entries"]) == (1, 512, 3)  # b's boundary 768 added
    e.runner.state.pages.check()


def test_an_entry_without_the_mtp_layer_serves_prefills_without_it_until_one_with_it_completes_it(lm):
    e, ref = _engine(lm), _engine(lm, entries=0)
    a = _ids(lm, 600, 8)
    _prefilled(e, a, mtp=False)  # entries at 256 and 512, no MTP layer KV
    b = a[:550] + _ids(lm, 60, 9)
    _, state, cached = _prefilled(e, b, mtp=True)  # cannot use them: computes every piece (and completes them)
    assert cached == 0
    _same_state(state, _prefilled(ref, b, mtp=True)[1])
    for mtp in (False, True):
        tok, state, cached = _prefilled(e, b, mtp=mtp)
        assert cached == 512
        want_tok, want_state, _ = _prefilled(ref, b, mtp=mtp)
        assert tok == want_tok
        _same_state(state, want_state)


def test_decoding_after_a_cached_prefix_equals_the_uncached_decode(lm):
    """Greedy and seeded sampling with penalties (the restored prefix is in the token history)."""
    e, ref = _engine(lm, entries=8), _engine(lm, entries=0)
    base = _ids(lm, 560, 3)
    e.generate(base, 2)  # caches boundaries 256 and 512
    prompt = base[:520] + _ids(lm, 100, 4)
    for sp in (None, Params(temperature=0.9, seed=11, repetition_penalty=1.4, presence_penalty=0.5)):
        e.generate(_ids(lm, 600, 7), 1)  # the slot's token history now holds other tokens
        hits = e.prefix.hits
        got = e.generate(prompt, 24, sampling=sp)
        assert e.prefix.hits == hits + 1
        assert got == ref.generate(prompt, 24, sampling=sp)


def test_a_re_prefill_reuses_the_prompt_part(lm):
    e, ref = _engine(lm), _engine(lm, entries=0)
    prompt = _ids(lm, 530, 5)
    gen = ref.generate(prompt, 12)
    e.prefill(prompt)  # caches 256 and 512 (its session stays: a second slot for the re-prefill)
    tok, state, cached = _prefilled(e, prompt + gen[:-1], generated=len(gen) - 1)
    assert cached == 512
    want_tok, want_state, _ = _prefilled(ref, prompt + gen[:-1], generated=len(gen) - 1)
    assert tok == want_tok == gen[-1]
    _same_state(state, want_state)


def test_prompt_logprobs_compute_every_piece(lm):
    e = _engine(lm)
    prompt = _ids(lm, 600, 6)
    e.generate(prompt, 1)
    s = e.open_prefill(prompt, prompt_logprobs=2)
    e.run_prefill(s, prompt)
    assert s.cached_tokens == 0 and len(s.prompt_logprobs) == len(prompt) - 1
    e.release(s.id)


def test_eviction_takes_leaves_first_and_keeps_every_chain_whole(lm):
    e = _engine(lm, entries=3)
    pc, pool = e.prefix, e.runner.state.pages
    prompts = [_ids(lm, 800, 10 + i) for i in range(3)]  # 3 boundaries each
    for p in prompts:
        e.generate(p, 1)
        pool.check()
        assert len(pc) <= 3 and pool.lent_pages == len(pc) * pc.pages_per_entry
        for q in prompts:  # what is cached of a prompt is a chain from its first boundary
            present = [k in pc._lru for k in boundary_keys(q, CHUNK)]
            assert present == sorted(present, reverse=True), present
    assert pc.evicted == 9 - 3 and pc.reclaimed == 0  # evicted for newer entries, none for a request's pages
    # the last prompt's chain is whole: a prompt sharing it restores all of it
    tok, _, cached = _prefilled(e, prompts[-1][:790] + _ids(lm, 50, 99))
    assert cached == 768


def test_requests_reclaim_the_cache_pages_and_a_full_pool_still_refuses(lm):
    e = _engine(lm, max_len=2048, kv_pages=8)
    pool = e.runner.state.pages
    e.generate(_ids(lm, 700, 20), 1)  # two entries of one page each
    assert pool.lent_pages == 2 and pool.free_pages == 6
    s, _ = e.prefill(_ids(lm, 2000, 21))  # 8 pages: the cache gives its 2 back
    assert pool.lent_pages == 0 and len(e.prefix) == 0 and pool.free_pages == 0
    assert e.prefix.stats()["reclaimed"] == e.prefix.stats()["evicted"] == 2  # WorkerStats prefix_cache_reclaimed
    pool.check()
    with pytest.raises(PagesExhausted):
        e.prefill(_ids(lm, 10, 22))
    e.release(s.id)
    assert pool.free_pages == 8
    pool.check()


def test_entries_for_defaults_and_checks():
    from baton.engine.prefix_cache import DEFAULT_PREFIX_ENTRIES, entries_for

    assert entries_for(4096, 8192, None) == 0  # one piece holds the window: nothing to cache
    assert entries_for(32768, 8192, None) == DEFAULT_PREFIX_ENTRIES
    assert entries_for(32768, 8192, 0) == 0 and entries_for(4096, 8192, 5) == 5
    with pytest.raises(ValueError, match="prefix_cache"):
        entries_for(32768, 8192, -1)


def test_a_cache_salt_shares_entries_only_with_the_same_salt(lm):
    e, ref = _engine(lm, entries=8), _engine(lm, entries=0)
    a = _ids(lm, 600, 30)
    b = a[:560] + _ids(lm, 30, 31)
    assert boundary_keys(a, CHUNK) != boundary_keys(a, CHUNK, "tenant-1") != boundary_keys(a, CHUNK, "tenant-2")

    def cached(ids, salt):
        s = e.open_prefill(ids, cache_salt=salt)
        tok = e.run_prefill(s, ids)
        e.release(s.id)
        return s.cached_tokens, tok

    assert cached(a, "tenant-1")[0] == 0
    assert cached(b, "")[0] == 0 and cached(b, "tenant-2")[0] == 0  # other chains
    n, tok = cached(b, "tenant-1")
    assert n == 512 and tok == ref.prefill(b)[1]


def test_a_piece_cached_by_another_prompt_s_earlier_pass_is_restored_not_computed(lm, monkeypatch):
    """Two prompts sharing their first two pieces, out of step: b's start finds nothing cached, but its first
    piece arrives only once a's first pass runs (one piece a pass), so a's pass caches it before b's pass of
    it, which restores it instead of computing it (restore_pieces). b's tokens and state are bitwise what
    computing every piece gives, and the shared pieces were computed once."""
    import threading

    import prefill_worker.engine as eng

    r = ModelRunner(lm.model, slots=4, max_len=1280, width=8)
    r.prefill_chunk = CHUNK
    e, ref = ExactEngine(r, prefix_entries=4, prefill_budget=CHUNK), _engine(lm, entries=0)
    a = _ids(lm, 700, 21)
    b = a[:600] + _ids(lm, 50, 22)  # shares boundaries 256 and 512 with a
    a_runs, got = threading.Event(), {}
    give_way = e.verifies.give_way
    monkeypatch.setattr(e.verifies, "give_way", lambda: (a_runs.set(), give_way())[1])  # a pass is running
    pieces = eng.prefill_pieces

    def late(*args, **kw):  # b: its start's restore done (nothing cached), its pieces only once a pass runs
        if threading.current_thread().name == "b":
            assert a_runs.wait(30)
        return pieces(*args, **kw)

    monkeypatch.setattr(eng, "prefill_pieces", late)

    def run(name, ids):
        got[name] = _prefilled(e, ids)

    threads = [threading.Thread(target=run, args=(n, ids), name=n) for n, ids in (("a", a), ("b", b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert got.keys() == {"a", "b"}
    dbg = (e.pass_totals, list(e.passes), e.prefix.stats())
    # b's first piece came from the cache in its own pass; its second did too, or ran in a's pass of it (one
    # computation for both: shared_pieces), as the threads fell
    assert got["a"][2] == 0 and got["b"][2] in (256, 512), dbg
    assert e.pass_totals[2] == 700 + 650 - 512, dbg  # each shared piece computed once (1,094 before)
    assert e.prefix.stats()["tokens_reused"] == got["b"][2], dbg
    for name, ids in (("a", a), ("b", b)):
        tok, state, _ = got[name]
        want_tok, want_state, _ = _prefilled(ref, ids)
        assert tok == want_tok
        _same_state(state, want_state)
    e.runner.state.pages.check()


def test_a_page_piece_that_passes_the_cut_check_equals_the_reference_pieces(lm):
    """--prefill-piece 256 (prefill_worker/serve.py checked_piece): the tiny model cuts at a page without
    changing a bit (baton/engine/prefill.py cut_check), so a prompt restored from 256-token boundaries and
    computed in 256-token pieces ends bitwise as the reference's 8,192-token pieces leave it (`baton complete`
    cuts there): first token and every state tensor. A cut elsewhere (300 tokens) does change bits."""
    from baton.engine.prefill import cut_check
    from prefill_worker.serve import checked_piece

    e = _engine(lm)  # pieces of 256
    assert checked_piece(e.runner, CHUNK, 1280 - 9) == CHUNK
    assert cut_check(e.runner, 300, 900)  # the check can tell: a cut off the delta rule's 64-token chunks
    ref = ExactEngine(ModelRunner(lm.model, slots=4, max_len=1280, width=8), prefix_entries=0)
    assert ref.runner.prefill_chunk == 8192
    a = _ids(lm, 700, 1)
    b = a[:600] + _ids(lm, 300, 2)
    _prefilled(e, a)
    tok, state, cached = _prefilled(e, b)
    assert cached == 512  # two page boundaries restored
    want_tok, want, _ = _prefilled(ref, b)
    assert tok == want_tok
    _same_state(state, want)


def test_a_piece_that_fails_the_cut_check_is_not_taken(lm, monkeypatch, caplog):
    """Where cutting at the asked piece would change a prompt's bits on the device, the worker keeps 8,192-token
    pieces and says why; a window too small to cut a prompt there needs no check."""
    import prefill_worker.serve as serve

    monkeypatch.setattr(serve, "cut_check", lambda *a, **k: ["layers.0.recurrent", "hidden"])
    r = ModelRunner(lm.model, slots=1, max_len=1280, width=8)
    with caplog.at_level("WARNING", logger="baton"):
        assert serve.checked_piece(r, 512, 1271) == serve.PREFILL_CHUNK
    assert "--prefill-piece 512 not taken" in caplog.text and "layers.0.recurrent, hidden" in caplog.text
    assert serve.checked_piece(r, 1024, 900) == 1024  # no prompt is cut there: nothing to check
