"""Fast-mode MTP's K per round (decode_worker/mtp.py: rounds, one controller for the worker's mtp sessions;
baton/engine/draft_length.py), on the embedded default model (real MTP acceptance), CPU:
  * any schedule of K, plain AR rounds (K = 0) included, gives the exact engine's tokens, and leaves the
    MTP KV of every finalised position bitwise what K = 3 every round leaves: a K = 0 round keeps its
    pending pairs for the next chain, and a run of them is flushed (finalised without a draft) before
    the pairs outgrow one MTP pass;
  * the adaptive controller (the decode worker's default) falls back to plain AR rounds when no draft is
    ever accepted (no slowdown), and drafts long blocks when every draft is accepted."""

from __future__ import annotations

import pytest

from baton.engine.draft_length import DraftLength
from baton.engine.runner import ModelRunner
from baton.engine.sampling import Params
from baton.engine.speculation import Drafter
from baton.loading import DEFAULT_MODEL_DIR, load_model
from baton.tokenizer import Tokenizer
from decode_worker import mtp
from decode_worker.engine import DecodeEngine
from prefill_worker.engine import ExactEngine

PROMPT = "def sub_debug(msg, *args):\n    if _logger:\n"
NEW, MAX_LEN = 40, 128


@pytest.fixture(scope="module")
def env():
    lm = load_model(None, dtype="fp32", mtp=True)
    ids = Tokenizer.from_dir(DEFAULT_MODEL_DIR).encode(PROMPT)
    exact = ExactEngine(ModelRunner(lm.model, slots=1, max_len=MAX_LEN))
    return lm, ids, exact, exact.generate(ids, NEW)


class Scripted:
    """A controller that plays a fixed list of K (then its last), recording what each round observed."""

    def __init__(self, ks):
        self.ks, self.i, self.seen = list(ks), 0, []

    def next_k(self, batch=None):
        k = self.ks[min(self.i, len(self.ks) - 1)]
        self.i += 1
        return k

    def observe_round(self, k, accepted, draft_s, verify_s):
        self.seen.append((k, accepted))

    def observe_drafts(self, accepted, rejected):
        pass


class Counting(Drafter):
    """Proposes a token that is never the model's (wrong=True), or the true continuation `ref` (an oracle:
    every draft accepted), recording the round of every proposal."""

    def __init__(self, vocab, ids, ref, wrong):
        self.vocab, self.start, self.ref, self.wrong, self.rounds = vocab, len(ids), ref, wrong, []

    def propose(self, session, i, own):
        self.rounds.append(session.rounds)
        if self.wrong:
            return (own + 1) % self.vocab
        return self.ref[int(session.runner.state.position[session.slot]) - self.start + 1 + i]


def _decode(lm, exact, ids, ctl=None, drafter=None, params=None):
    """-> (tokens, session, engine): the prompt prefilled on the exact engine, decoded by fast mtp (with the
    slot's sampling params, if given)."""
    r = ModelRunner(lm.model, slots=1, max_len=MAX_LEN)
    eng = DecodeEngine(
        {"bf16": r, "mtp": r}, default_engine="mtp", drafter=drafter or Drafter(), draft_length="adaptive"
    )
    es, first = exact.prefill(ids)
    tensors, pos, nxt = exact.export(es.id)
    s = eng.load({t.name: t.tensor.clone() for t in tensors}, position=pos, next_token=nxt, engine="mtp")
    exact.release(es.id)
    if params is not None:
        r.sampling.set(s.slot, params)
    eng._mtp_ctl = ctl  # None: the engine makes its own (mtp.control) at the first Decode
    toks = [t for b in eng.decode(s.id, NEW - 1, k=3) for t in b]
    return [first] + toks, s, r


def _load_all(eng, exact, prompts) -> tuple[list, list[int]]:
    """Each prompt prefilled on the exact engine and handed over to `eng` -> (its sessions, first tokens)."""
    sessions, firsts = [], []
    for p in prompts:
        es, first = exact.prefill(p)
        tensors, pos, nxt = exact.export(es.id)
        sessions.append(eng.load({t.name: t.tensor.clone() for t in tensors}, position=pos, next_token=nxt))
        exact.release(es.id)
        firsts.append(first)
    return sessions, firsts


def _mtp_kv(r, s, upto):
    L = r.state.mtp_layer
    return [x[:, :upto] for x in r.state.slot_kv(L, s.slot, upto)]


def test_plain_rounds_and_flushes_keep_tokens_and_mtp_kv(env):
    lm, ids, exact, ref = env
    steady, s0, r0 = _decode(lm, exact, ids, Scripted([3]))
    # K = 0 runs: short ones (kept pairs), one long enough to flush (more than flush_at rounds), K changes
    ks = [2, 0, 0, 3, 0, 1] + [0] * 14 + [3, 0, 2]
    mixed, s1, r1 = _decode(lm, exact, ids, Scripted(ks))
    assert steady == ref and mixed == ref
    assert len(s1.mtp_pairs_ids) < mtp.flush_at(r1)
    upto = min(s0.mtp_start, s1.mtp_start)  # pairs below both sessions' pending ones are final in both
    assert upto > len(ids)
    for a, b in zip(_mtp_kv(r0, s0, upto), _mtp_kv(r1, s1, upto)):
        assert (a == b).all()


def test_a_k0_run_keeps_then_flushes_its_pending_pairs(env):
    lm, ids, exact, ref = env
    ctl = Scripted([2] + [0] * 30)
    toks, s, r = _decode(lm, exact, ids, ctl)
    assert toks == ref
    assert [k for k, _ in ctl.seen[1:]] == [0] * (len(ctl.seen) - 1)  # plain rounds: one token each
    assert all(m == [0] for _, m in ctl.seen[1:])
    cap = mtp.flush_at(r)
    assert 2 <= len(s.mtp_pairs_ids) <= cap  # flushed every time the kept pairs reached the cap
    assert s.mtp_start > len(ids) + 2  # the flushes moved the finalised prefix on


class Priced(DraftLength):
    """The real controller, fed a fixed price per round (1 + 0.3 K, a verify pass plus chain steps) in
    place of the measured seconds, so its choices do not depend on this machine's load."""

    def observe_round(self, k, accepted, draft_s, verify_s):
        return super().observe_round(k, accepted, 0.0, 1.0 + 0.3 * k)


def test_the_adaptive_controller_stops_speculating_when_no_draft_is_accepted(env):
    lm, ids, exact, ref = env
    d = Counting(lm.cfg.vocab_size, ids, ref, wrong=True)
    toks, s, _ = _decode(lm, exact, ids, Priced(prior_k=3, k_max=6, k_min=0), drafter=d)
    assert toks == ref  # wrong drafts are never accepted: the tokens are the verifier's
    assert s.rounds == NEW - 1  # one token a round
    # it stops drafting: plain rounds but for probes, far fewer drafts than K = 3 a round
    assert len(d.rounds) < 1.5 * (NEW - 1), d.rounds
    quiet = max(b - a for a, b in zip(d.rounds, d.rounds[1:] + [NEW - 1]))
    assert quiet >= 10, d.rounds
    right = Counting(lm.cfg.vocab_size, ids, ref, wrong=False)
    toks, s, _ = _decode(lm, exact, ids, Priced(prior_k=3, k_max=6, k_min=0), drafter=right)
    assert toks == ref and s.emitted_in_rounds / s.rounds > 3.0, (s.rounds, s.emitted_in_rounds)


def test_concurrent_sessions_share_scheduled_rounds(env):
    """Batched engines run every mtp session's rounds in one scheduler thread (DecodeEngine._mtp_batched,
    StepScheduler(multi=True)): four run-ahead sessions decoding at once share rounds and each gives the
    exact engine's tokens; a reader that stops early leaves the others exact and no job behind."""
    import threading

    lm, ids, exact, ref = env
    prompts = [ids, ids[:-3], ids, ids[:-3]]
    refs = [ref, exact.generate(ids[:-3], NEW)]
    r = ModelRunner(lm.model, slots=4, max_len=MAX_LEN)
    eng = DecodeEngine({"bf16": r, "mtp": r}, default_engine="mtp", draft_length="fixed")
    sessions, firsts = _load_all(eng, exact, prompts)
    out: dict[int, list[int]] = {}
    start = threading.Barrier(len(sessions))

    def run(i):
        start.wait()
        got = [firsts[i]]
        for batch in eng.decode(sessions[i].id, NEW - 1, k=3, run_ahead=True):
            got += batch
            if i == 3 and len(got) >= 8:  # stops reading early (the generator closes its job)
                break
        out[i] = got

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(sessions))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert out[0] == refs[0] and out[2] == refs[0]
    assert out[1] == refs[1]
    assert out[3] == refs[1][: len(out[3])] and len(out[3]) < NEW
    assert eng.mtp_round_max >= 2 and eng.mtp_rounds.batches == 0  # the scheduler's rounds, not the Gather's
    assert eng.mtp_jobs == {}
    eng.close()


def test_plain_sessions_of_a_batch_flush_together(env):
    """In a round where no session drafts, one session's flush takes every session's pending pairs along
    (decode_worker/mtp.py chains): after it the plain sessions' pairs are aligned and flush in the same
    rounds; the tokens stay the exact engine's and the finalised MTP KV stays what K = 3 every round
    leaves."""
    lm, ids, exact, ref = env
    _, s_ref, r_ref = _decode(lm, exact, ids, Scripted([3]))
    r = ModelRunner(lm.model, slots=2, max_len=MAX_LEN)
    eng = DecodeEngine({"bf16": r, "mtp": r}, default_engine="mtp", draft_length="fixed")
    eng._mtp_ctl = Scripted([0])
    ss, firsts = _load_all(eng, exact, [ids, ids])
    outs = [[f] for f in firsts]
    cap = mtp.flush_at(r)
    for _ in range(3):  # the first session runs ahead alone: its pairs lead by 3
        outs[0] += mtp.rounds(eng, [(ss[0], 0)])[0]
    counts = []
    while len(outs[1]) < NEW:
        for o, got in zip(outs, mtp.rounds(eng, [(s, 0) for s in ss])):
            o += got
        counts.append([len(s.mtp_pairs_ids) for s in ss])
    first_flush = next(i for i, c in enumerate(counts) if c[0] < cap and counts[i - 1][0] >= cap - 1)
    assert counts[first_flush] == [2, 2], counts  # the lagging session flushed with the leading one
    assert all(a == b for a, b in counts[first_flush:]), counts  # aligned from then on
    assert sum(1 for c in counts if c == [2, 2]) >= 2  # and they flushed together again
    assert outs[0][:NEW] == ref and outs[1] == ref
    upto = min(s_ref.mtp_start, *(s.mtp_start for s in ss))
    assert upto > len(ids)
    for s in ss:
        for a, b in zip(_mtp_kv(r_ref, s_ref, upto), _mtp_kv(r, s, upto)):
            assert (a == b).all()


def test_run_ahead_plain_rounds_pipeline_flush_and_stay_exact(env):
    """Run-ahead sessions' plain rounds are batched AR steps launched before the previous round's tokens
    are read (decode_worker/mtp_launch.py): with K = 0 runs long enough to flush while a round is in
    flight, and speculative rounds between them (each first reading the rounds in flight), three
    concurrent sessions each give the exact engine's tokens and leave the MTP KV of every finalised
    position bitwise what K = 3 every round leaves; every round is handed over, nothing stays counted."""
    import threading

    lm, ids, exact, _ = env
    prompts = [ids, ids[:-3], ids[:-5]]  # distinct sessions: a row handed to the wrong one shows
    steady = [_decode(lm, exact, p, Scripted([3])) for p in prompts]  # (tokens, session, runner)
    r = ModelRunner(lm.model, slots=3, max_len=MAX_LEN)
    eng = DecodeEngine({"bf16": r, "mtp": r}, default_engine="mtp", draft_length="fixed")
    ctl = Scripted([2] + [0] * 14 + [3, 1] + [0] * 9 + [2, 0])
    eng._mtp_ctl = ctl
    sessions, firsts = _load_all(eng, exact, prompts)
    outs = [[f] for f in firsts]
    kv: dict[int, tuple] = {}
    start = threading.Barrier(3)

    def run(i):
        start.wait()
        for got in eng.decode(sessions[i].id, NEW - 1, k=3, run_ahead=True):
            outs[i] += got
        s = sessions[i]
        kv[i] = (s.mtp_start, [x.clone() for x in _mtp_kv(r, s, s.mtp_start)])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    refs = [exact.generate(p, NEW) for p in prompts]
    assert [t for t, _, _ in steady] == refs and outs == refs
    assert len({tuple(o) for o in outs}) == 3
    plain = [k for k, _ in ctl.seen].count(0)
    assert plain >= 14 and eng._rounds.max_rows >= 2  # plain rounds ran, sessions shared them
    assert all(s.mtp_inflight == 0 and s.mtp_undelivered == 0 for s in sessions)
    assert eng._mtp_launched == [] and eng.mtp_jobs == {}
    for i, (_, s_ref, r_ref) in enumerate(steady):
        start_i, got = kv[i]
        upto = min(start_i, s_ref.mtp_start)
        assert upto > len(prompts[i]) + 10  # the flushes and chains finalised most of the run
        for a, b in zip(_mtp_kv(r_ref, s_ref, upto), got):
            assert (a[:, :upto] == b[:, :upto]).all()
    eng.close()


class Judged(Scripted):
    """Scripted, recording the first drafts a flush judged (observe_drafts)."""

    def __init__(self, ks):
        super().__init__(ks)
        self.judged = []

    def observe_drafts(self, accepted, rejected):
        self.judged.append((accepted, rejected))


def test_plain_rounds_learn_the_acceptance_from_their_flush(env):
    """At K = 0 the flush's MTP pass picks a token after every pending pair, and the pair after it holds
    the verified one: the controller is told how many of those first drafts would have been accepted.
    On the trained default model that rate is the one K = 1 rounds measure (this prompt: ~0.4; an
    off-by-one pairing would judge ~0); a drafter that is never right gets none."""
    lm, ids, exact, ref = env
    ctl = Judged([0])
    toks, s, r = _decode(lm, exact, ids, ctl)
    assert toks == ref
    cap = mtp.flush_at(r)
    assert len(ctl.judged) >= 2, ctl.judged  # NEW - 1 plain rounds: several flushes
    assert all(a + b == cap - 1 for a, b in ctl.judged[1:]), (ctl.judged, cap)  # pairs 0..n-2 each judged
    rate = sum(a for a, _ in ctl.judged) / sum(a + b for a, b in ctl.judged)
    _, s1, _ = _decode(lm, exact, ids, Scripted([1]))
    k1 = s1.emitted_in_rounds / s1.rounds - 1  # K = 1 rounds: the share of first drafts kept
    assert rate > 0.25 and abs(rate - k1) < 0.2, (rate, k1, ctl.judged)

    class Never(Drafter):
        def judge(self, session, own, actual):
            return False

    ctl = Judged([0])
    _decode(lm, exact, ids, ctl, drafter=Never())
    assert ctl.judged and all(a == 0 and b > 0 for a, b in ctl.judged)


def test_a_masked_session_drafts_nothing_and_its_flushes_judge_nothing(env):
    """A session whose picks are masked (structured outputs; here masks allowing every token, so the tokens
    are the plain ones) without a Masker to write its verify rows' masks (DecodeSession.masker) runs plain
    rounds whatever K the controller asks (mtp.round_cap), and its flushes' head picks, which read mask rows
    of other positions, are not judged (mtp_launch._flush)."""
    lm, ids, exact, ref = env
    masked = Params(structured=b"\x08\x01")  # (any structure: the slot's masks are read, all bits set)
    for ks in ([0], [3]):
        ctl = Judged(ks)
        toks, s, r = _decode(lm, exact, ids, ctl, params=masked)
        assert toks == ref and s.rounds == NEW - 1 == s.emitted_in_rounds, (ks, s.rounds, s.emitted_in_rounds)
        assert ctl.judged == [] and all(k == ks[0] for k, _ in ctl.seen), ctl.seen
    ctl = Judged([0])
    _decode(lm, exact, ids, ctl)
    assert ctl.judged  # (unmasked, the same run judges its flushes)


def test_dear_speculative_rounds_are_logged_with_their_batch_and_joins(env, monkeypatch, caplog):
    """decode_worker/mtp_launch.py: a speculative round of at least DEAR_S (drain included) is logged with its
    K, its sessions and how many were loaded within JOINED_S, at most once a LOG_EVERY_S; plain rounds never."""
    import logging
    import re

    from decode_worker import mtp_launch

    lm, ids, exact, ref = env
    monkeypatch.setattr(mtp_launch, "DEAR_S", 0.0)  # every speculative round is dear
    monkeypatch.setattr(mtp_launch, "LOG_EVERY_S", 0.0)
    ks = [0, 0, 3, 0, 2, 3]
    with caplog.at_level(logging.INFO, logger="baton.decode"):
        toks, _, _ = _decode(lm, exact, ids, ctl=Scripted(ks))
    assert toks == ref
    lines = [r.getMessage() for r in caplog.records if "speculative round" in r.getMessage()]
    # one session, loaded within JOINED_S or not (a slow machine): the count is 1 or 0
    assert len(lines) >= 3 and all(
        re.search(r"1 sessions \([01] loaded within 0.5 s, 0 capped below K\)", m) for m in lines
    ), lines
    assert [m.split("K=")[1].split(",")[0] for m in lines[:3]] == ["3", "2", "3"]
    caplog.clear()
    monkeypatch.setattr(mtp_launch, "LOG_EVERY_S", 3600.0)  # at most one line an hour
    with caplog.at_level(logging.INFO, logger="baton.decode"):
        toks, _, _ = _decode(lm, exact, ids, ctl=Scripted([3]))
    assert toks == ref
    assert sum("speculative round" in r.getMessage() for r in caplog.records) == 1


def test_joining_counts_a_wave_of_young_sessions(monkeypatch):
    """mtp_launch.joining: off by default; with BATON_MTP_JOIN_HOLD=1, a wave is at least max(2, a quarter of
    the round's sessions) that launched fewer than HOLD_ROUNDS rounds (read or still in flight)."""
    from types import SimpleNamespace as S

    from decode_worker import mtp_launch

    old, young = S(rounds=9, mtp_inflight=1), S(rounds=2, mtp_inflight=1)
    monkeypatch.delenv(mtp_launch.HOLD_ENV, raising=False)
    assert not mtp_launch.joining([young] * 8)
    monkeypatch.setenv(mtp_launch.HOLD_ENV, "1")
    assert mtp_launch.joining([young, young]) and not mtp_launch.joining([young, old])
    assert not mtp_launch.joining([young])  # one session joining alone: nobody waits for its round
    assert mtp_launch.joining([young] * 2 + [old] * 6) and not mtp_launch.joining([young] * 2 + [old] * 10)
    assert not mtp_launch.joining([S(rounds=3, mtp_inflight=1)] * 4)  # its 4th round is launched


def test_the_landing_hold_also_waits_for_states_being_received(monkeypatch):
    """BATON_MTP_JOIN_HOLD=2 (mtp_launch.joining / landing): the round is plain while a state is being
    received or a fast mtp session loaded within JOINED_S has not joined; exact, joined and older sessions do
    not count; mode 1 ignores them."""
    import time
    from types import SimpleNamespace as S

    from decode_worker import mtp_launch

    now, runner = time.monotonic(), object()

    def engine(reserved=0, sessions=(), joined=()):
        table = S(reserved=lambda: reserved, sessions=lambda: list(sessions))
        return S(_table=table, mtp_jobs={(id(runner), s.slot): None for s in joined})

    def sess(slot, age=0.0, exact=False, engine="mtp"):
        return S(slot=slot, runner=runner, engine=engine, exact=exact, created=now - age)

    old = [S(rounds=9, mtp_inflight=1)] * 4  # no young wave in the round
    new, gone = sess(5), sess(6, age=mtp_launch.JOINED_S + 1)
    monkeypatch.setenv(mtp_launch.HOLD_ENV, "2")
    assert not mtp_launch.joining(old, engine())
    assert mtp_launch.joining(old, engine(reserved=1))  # a LoadState in progress
    assert mtp_launch.joining(old, engine(sessions=[new]))  # loaded, no Decode joined yet
    assert not mtp_launch.joining(old, engine(sessions=[new], joined=[new]))
    assert not mtp_launch.joining(old, engine(sessions=[gone, sess(7, exact=True), sess(8, engine="bf16")]))
    assert mtp_launch.landing(engine(reserved=2, sessions=[new, gone]), mtp_launch.JOINED_S) == 3
    monkeypatch.setenv(mtp_launch.HOLD_ENV, "1")
    assert not mtp_launch.joining(old, engine(reserved=1, sessions=[new]))


@pytest.mark.parametrize("hold", ["1", "2"])
def test_a_joining_wave_runs_plain_rounds_and_stays_exact(env, monkeypatch, hold):
    """BATON_MTP_JOIN_HOLD=1 (and 2, which also waits for states landing): four sessions decoding at once with a
    controller that always asks K = 3 run plain rounds while they join (at least two of them young), then
    speculate; each gives the exact engine's tokens."""
    import threading

    from decode_worker import mtp_launch

    monkeypatch.setenv(mtp_launch.HOLD_ENV, hold)
    lm, ids, exact, ref = env
    r = ModelRunner(lm.model, slots=4, max_len=MAX_LEN)
    eng = DecodeEngine({"bf16": r, "mtp": r}, default_engine="mtp", draft_length="fixed")
    sessions, firsts = _load_all(eng, exact, [ids] * 4)
    eng._mtp_ctl = ctl = Scripted([3])
    out: dict[int, list[int]] = {}
    start = threading.Barrier(len(sessions))

    def run(i):
        start.wait()
        out[i] = [firsts[i]] + [t for b in eng.decode(sessions[i].id, NEW - 1, k=3, run_ahead=True) for t in b]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(sessions))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    eng.close()
    assert all(out[i] == ref for i in range(4))
    ks = [k for k, _ in ctl.seen]  # the controller asks K = 3 every round: a plain one is the hold's
    assert 0 in ks and ks[-1] == 3, ks[:12]  # (the first round may speculate: one session joined by then)


class Pooled(Scripted):
    """Scripted, with the pooled acceptance own caps are measured against (baton/engine/draft_cap.py)."""

    acceptance = 0.9


class Split(Drafter):
    """Proposes the true continuation `ref` for every session but `bad`, whose drafts are never the model's;
    records the (session, round) of every proposal."""

    def __init__(self, vocab, ids, ref, bad):
        self.vocab, self.start, self.ref, self.bad, self.rounds = vocab, len(ids), ref, bad, []

    def propose(self, session, i, own):
        self.rounds.append((session.id, session.rounds))
        if session.id == self.bad:
            return (own + 1) % self.vocab
        return self.ref[int(session.runner.state.position[session.slot]) - self.start + 1 + i]


def test_a_session_whose_drafts_are_rejected_stops_drafting_beside_one_that_speculates(env):
    """Each session's own acceptance caps its K under the batch's (mtp.own_caps): in rounds of two sessions
    at K = 3, the one whose drafts are all rejected drafts a few rounds, then one draft every PROBE_EVERY
    rounds; the other keeps drafting 3 and the controller pools its acceptance alone. Tokens stay exact."""
    from baton.engine.draft_cap import PROBE_EVERY

    lm, ids, exact, ref = env
    r = ModelRunner(lm.model, slots=2, max_len=MAX_LEN)
    eng = DecodeEngine({"bf16": r, "mtp": r}, default_engine="mtp", draft_length="fixed")
    ss, firsts = _load_all(eng, exact, [ids, ids])
    eng.drafter = d = Split(lm.cfg.vocab_size, ids, ref, bad=ss[0].id)
    eng._mtp_ctl = ctl = Pooled([3])
    outs = [[f] for f in firsts]
    while any(len(o) < NEW for o in outs):
        live = [(s, o) for s, o in zip(ss, outs) if len(o) < NEW]
        got = mtp.rounds(eng, [(s, mtp.round_cap(s, 3, NEW - len(o))) for s, o in live])
        for (_, o), g in zip(live, got):
            o += g
    assert outs[0] == ref and outs[1] == ref
    bad = sorted({n for sid, n in d.rounds if sid == ss[0].id})
    good = sorted({n for sid, n in d.rounds if sid == ss[1].id})
    assert ss[1].rounds < NEW / 3 and good == list(range(len(good))), good  # K = 3 every round it ran
    assert len(bad) <= 8 + (NEW - 8) // PROBE_EVERY + 1 and ss[0].rounds - len(bad) > NEW / 2, bad
    gaps = [b - a for a, b in zip(bad, bad[1:])]
    assert gaps and max(gaps) == PROBE_EVERY, bad  # capped at 0, then a probe every PROBE_EVERY rounds
    # while both drafted 3 the pool had both; once capped, the rounds' pooled acceptance is the other's alone
    both = [m for k, m in ctl.seen if k == 3 and len(m) == 2]
    alone = [m for k, m in ctl.seen if k == 3 and len(m) == 1]
    assert both and alone and all(m == [3] for m in alone), ctl.seen


def test_a_batch_whose_sessions_are_all_capped_runs_plain_rounds(env, monkeypatch, caplog):
    """mtp_launch.launch: when every session's own acceptance caps it at 0 the round is a pipelined plain round
    (the controller observes K = 0) though the controller asked K = 3; a probe drafts 1 now and then."""
    from baton.engine.draft_cap import PROBE_EVERY

    lm, ids, exact, ref = env

    class Wrong(Counting):  # its first drafts judged at a flush are wrong too
        def judge(self, session, own, actual):
            return False

    import logging

    from decode_worker import mtp_launch

    monkeypatch.setattr(mtp_launch, "DEAR_S", 0.0)  # every speculative round is logged
    monkeypatch.setattr(mtp_launch, "LOG_EVERY_S", 0.0)
    d = Wrong(lm.cfg.vocab_size, ids, ref, wrong=True)
    ctl = Pooled([3])
    with caplog.at_level(logging.INFO, logger="baton.decode"):
        toks, s, _ = _decode(lm, exact, ids, ctl, drafter=d)
    assert toks == ref
    lines = [r.getMessage() for r in caplog.records if "speculative round" in r.getMessage()]
    assert any("1 capped below K" in m for m in lines), lines  # the probes: K=3 asked, 1 drafted
    ks = [k for k, _ in ctl.seen]
    assert ks[0] == 3 and ks.count(0) > NEW / 2 and set(ks) <= {0, 1, 2, 3}, ks
    drafted = sorted(set(d.rounds))
    gaps = [b - a for a, b in zip(drafted, drafted[1:])]
    assert len(drafted) < NEW / 3 and max(gaps) == PROBE_EVERY, (drafted, ks)  # capped at 0, then probes
    monkeypatch.setenv(mtp.OWN_CAPS_ENV, "0")  # the A/B switch: K = 3 every round again
    ctl = Pooled([3])
    toks, _, _ = _decode(lm, exact, ids, ctl, drafter=Wrong(lm.cfg.vocab_size, ids, ref, wrong=True))
    assert toks == ref and {k for k, _ in ctl.seen} == {3}, ctl.seen
