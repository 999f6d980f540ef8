"""baton/engine/rejection.py: exact mode's rejection-sampling policy. Its output is distributed as the
exact model's processed distribution (chi-square over thousands of seeded draws on the trained default
model's logits, the drafter's q from another context of the same model), a deliberately wrong variant
fails the same test, the proposal cut bounds the wire, and the randomness is a pure function of (seed,
position), batch-invariant."""

import pytest
import torch
from helpers import rows_with_logits

from baton.engine import rejection
from baton.engine.sampling import REJECTION, Params, SamplingTable
from baton.engine.sampling_reference import reference_probs
from tests.engine.test_sampling import chi_square_p

N = 3000
POS = 41  # the position every draw picks (the seed varies)


def _logits(lm, tok, text):
    from baton.engine.runner import ModelRunner

    runner = ModelRunner(lm.model, slots=1, max_len=64)
    runner.prefill(0, tok.encode(text))
    _, logits = rows_with_logits(runner, 0, runner.pad_ids([int(runner.state.next_token[0])]), 1)
    return logits[0].clone()


@pytest.fixture(scope="module")
def pq():
    """(exact model logits, drafter logits): the default model after two prompts that differ in one word
    (sum min(p, q) ~ 0.7 at T = 0.8 / 1.0: both acceptance and the residual are exercised)."""
    from baton.loading import load_model, resolve_model_dir
    from baton.tokenizer import Tokenizer

    lm = load_model(None, dtype="fp32", device="cpu", mtp=False)
    tok = Tokenizer.from_dir(resolve_model_dir(None))
    return _logits(lm, tok, "def parse(self, text):\n    "), _logits(lm, tok, "def parse(self, data):\n    ")


def _tables(n, target: Params, draft: Params):
    d, v = SamplingTable(n, "cpu", 16), SamplingTable(n, "cpu", 16)
    for s in range(n):
        d.set(s, Params(**{**draft.__dict__, "seed": 1000 + s}), proposing=True)
        v.set(s, Params(**{**target.__dict__, "seed": 1000 + s}))
    return d, v


def _run(pq, target: Params, draft: Params, n: int = N):
    """n seeds: the drafter picks a draft at POS (recording q'), the verifier judges it -> (tokens, drafts, q's)."""
    p_logits, q_logits = pq
    d, v = _tables(n, target, draft)
    slots, rows, pos = torch.arange(n), torch.zeros(n, dtype=torch.long), torch.full((n,), POS)
    drafts = d.pick(q_logits[None].expand(n, -1), slots, rows, pos, range(n)).tolist()
    props = [d.proposals(s, POS, 1)[0] for s in range(n)]
    for s in range(n):
        v.judge(s, POS, [drafts[s]], [props[s]])
    out = v.pick(p_logits[None].expand(n, -1), slots, rows, pos, range(n))
    return out, torch.tensor(drafts), props


CASES = {
    "temperature": (Params(temperature=0.8, exact_policy=REJECTION), Params(temperature=1.0, exact_policy=REJECTION)),
    "top_p": (
        Params(temperature=1.0, top_p=0.9, exact_policy=REJECTION),
        Params(temperature=1.0, top_p=0.95, top_k=40, exact_policy=REJECTION),
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_rejection_policy_output_is_the_exact_models_distribution(pq, case):
    target, draft = CASES[case]
    out, drafts, props = _run(pq, target, draft)
    probs = reference_probs(pq[0], target)
    accepted = float((out == drafts).double().mean())
    assert 0.3 < accepted < 0.95, accepted  # both branches ran, often
    pv = chi_square_p(out, probs)
    assert pv > 0.001, (case, pv, accepted)
    # the acceptance rate is sum min(p, q') (the maximal coupling), within sampling error
    q = rejection.dense(*props[0], probs.numel(), "cpu").double()
    assert abs(accepted - float(torch.minimum(probs, q).sum())) < 0.04


def test_a_deliberately_wrong_rejection_sampler_fails_the_same_test(pq, monkeypatch):
    target, draft = CASES["temperature"]
    real = rejection.judge

    def wrong(p, draft_, q, seed_hi, seed_lo, positions, tok):
        """The classic bug: accept as the real policy does, but on rejection draw from p itself (tok: the
        row's own seeded pick from p) instead of from norm(max(0, p - q))."""
        right = real(p, draft_, q, seed_hi, seed_lo, positions, tok)  # == draft iff accepted
        return torch.where(right == draft_, draft_, tok)

    monkeypatch.setattr(rejection, "judge", wrong)
    out, _, _ = _run(pq, target, draft)
    assert chi_square_p(out, reference_probs(pq[0], target)) < 0.001


def test_the_proposal_cut_bounds_the_support_and_the_dropped_mass(pq):
    _, q_logits = pq
    V = q_logits.numel()
    for T in (0.7, 1.0, 3.0):
        full = reference_probs(q_logits, Params(temperature=T))
        _, _, props = _run(
            pq, Params(temperature=T, exact_policy=REJECTION), Params(temperature=T, exact_policy=REJECTION), n=2
        )
        ids, probs = props[0]
        assert 1 <= ids.numel() <= rejection.CUT_MAX
        assert abs(float(probs.double().sum()) - 1.0) < 1e-5
        kept = float(full[ids].sum())
        assert kept >= 1 - rejection.CUT_EPS - 1e-6 or ids.numel() == rejection.CUT_MAX, (T, kept)
        assert ids.numel() < V


def test_same_seed_same_verdict_alone_or_in_a_batch(pq):
    target, draft = CASES["top_p"]
    many, drafts, _ = _run(pq, target, draft, n=40)
    again, _, _ = _run(pq, target, draft, n=40)
    assert torch.equal(many, again)
    one, d1, _ = _run(pq, target, draft, n=1)  # seed 1000 alone
    assert int(one[0]) == int(many[0]) and int(d1[0]) == int(drafts[0])
    assert len(set(many.tolist())) > 3  # seeds differ


def test_parse_refuses_what_is_not_a_proposal():
    from baton.v1 import common_pb2

    D = common_pb2.TokenDistribution
    ok = [D(token_ids=[3, 5], probs=[0.25, 0.75])]
    assert [i.tolist() for i, _ in rejection.parse(ok, [5], 8)] == [[3, 5]]
    bad = {
        "2 distributions for 1": ([D(token_ids=[5], probs=[1.0])] * 2, [5]),
        "token_ids and": ([D(token_ids=[5, 3], probs=[1.0])], [5]),
        "distinct": ([D(token_ids=[5, 5], probs=[0.5, 0.5])], [5]),
        "vocabulary": ([D(token_ids=[9], probs=[1.0])], [9]),
        "sum to 1": ([D(token_ids=[5], probs=[0.5])], [5]),
        "> 0": ([D(token_ids=[5, 3], probs=[1.0, 0.0])], [5]),
        "outside": ([D(token_ids=[3], probs=[1.0])], [5]),
    }
    for why, (msgs, drafts) in bad.items():
        with pytest.raises(ValueError, match="draft_probs") as e:
            rejection.parse(msgs, drafts, 8)
        assert why in str(e.value), (why, e.value)


def test_proposals_of_earlier_rounds_are_dropped():
    """A proposing slot keeps q' only for the rounds still to come: reading round r's drafts drops the
    records of positions before it (a long generation does not grow the table)."""
    from baton.engine.sampling import SamplingTable

    t = SamplingTable(2, "cpu", 4)
    t.proposed[0] = {p: (torch.tensor([1]), torch.tensor([1.0])) for p in range(10, 20)}
    got = t.proposals(0, 15, 3)
    assert len(got) == 3 and sorted(t.proposed[0]) == list(range(15, 20))
