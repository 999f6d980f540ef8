"""baton/engine/sampling.py: the counter-based noise, greedy identity, batch invariance, the distributions
(chi-square over thousands of draws on the trained default model's logits, and a deliberately wrong
sampler that fails the same test), logprobs against a float64 reference, and the runner's paths
(prefill, rows, rows_batch) with per-slot parameters."""

import math
import random

import pytest
import torch
from helpers import rows_batch_steps, rows_with_logits

from baton.engine.noise import gumbel, hash32, uniform
from baton.engine.sampling import MAX_LOGPROBS, Params, SamplingTable, sample
from baton.engine.sampling_reference import reference_probs

W = 16


def _lowbias32(x: int) -> int:  # the same mix in Python's exact integers
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_hash_is_the_exact_32_bit_mix_without_overflow():
    rng = random.Random(0)
    xs = [0, 1, 0xFFFF, 0x10000, 0xFFFFFFFF, 0x80000000] + [rng.getrandbits(32) for _ in range(2000)]
    got = hash32(torch.tensor(xs, dtype=torch.int64)).tolist()
    assert got == [_lowbias32(x) for x in xs]
    assert all(0 <= g < 1 << 32 for g in got)


def test_uniform_is_a_pure_function_of_seed_and_position_in_the_open_interval():
    hi, lo = torch.tensor([0, 0, 7]), torch.tensor([5, 5, 5])
    pos = torch.tensor([3, 3, 3])
    u = uniform(hi, lo, pos, 8192)
    assert torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])  # same key twice; another seed
    assert torch.equal(u[0], uniform(hi[:1], lo[:1], pos[:1], 8192)[0])  # alone or with other rows
    assert float(u.min()) > 0.0 and float(u.max()) < 1.0
    many = uniform(torch.zeros(64, dtype=torch.long), torch.zeros(64, dtype=torch.long), torch.arange(64), 8192)
    assert abs(float(many.mean()) - 0.5) < 0.002 and abs(float(many.var()) - 1 / 12) < 0.001
    g = gumbel(hi, lo, pos, 8192)
    assert abs(float(g.mean()) - 0.5772) < 0.05  # Euler-Mascheroni: the Gumbel(0, 1) mean


def _table(params: dict[int, Params], slots: int = 8) -> SamplingTable:
    t = SamplingTable(slots, "cpu", W)
    for s, p in params.items():
        t.set(s, p)
    return t


def _rows(t, slot, n, pos0=0):
    return t.slot_rows[slot, :n].clone(), torch.arange(pos0, pos0 + n)


def test_greedy_rows_are_exactly_argmax_beside_sampled_rows():
    torch.manual_seed(0)
    t = _table({1: Params(temperature=1.0, top_p=0.9, seed=3)})
    logits = torch.randn(40, 1000) * 3
    slots = torch.tensor([0, 1] * 20)
    tok, *_ = sample(logits, slots, torch.arange(40), t)
    assert torch.equal(tok[0::2], logits[0::2].argmax(-1))
    assert not torch.equal(tok[1::2], logits[1::2].argmax(-1))  # the sampled slot does sample
    t2 = _table({1: Params(temperature=0.0, top_k=5, seed=9)})  # T = 0 ignores everything else
    assert torch.equal(sample(logits, slots, torch.arange(40), t2)[0], logits.argmax(-1))


def test_greedy_processed_rows_skip_the_noise_with_the_same_bits():
    """sample(..., sampled=False), the eager pick's path when every live slot is greedy (SamplingTable.pick):
    penalized, biased, banned and masked greedy rows get the tokens and logprobs of the sampled path, bitwise,
    with no noise drawn and no sort; penalties=False (no live slot penalized) leaves the other rows' bits."""
    torch.manual_seed(4)
    V = 1000
    t = SamplingTable(4, "cpu", W, max_len=64, vocab_size=V)
    t.history.load(0, list(range(12)), 4)
    t.set(0, Params(repetition_penalty=1.3, presence_penalty=0.5, logprobs=3))
    t.set(1, Params(logit_bias=((7, 5.0), (500, -3.0)), ban_end=8, banned=(1, 2, 3), top_p=0.5))
    t.set(2, Params(structured=b"x"))  # masked: every third token allowed at position 5
    bits = torch.zeros(1, (V + 31) // 32, dtype=torch.int32)
    for tok in range(0, V, 3):
        bits[0, tok // 32] |= 1 << (tok % 32) if tok % 32 < 31 else -(1 << 31)
    t.allow(2, 5, bits)
    logits = torch.randn(9, V) * 3
    slots, pos = torch.tensor([0, 1, 2] * 3), torch.tensor([5, 5, 5, 6, 6, 6, 12, 12, 12])
    with torch.inference_mode():
        fast = sample(logits, slots, pos, t, logprobs=True, sampled=False)
        full = sample(logits, slots, pos, t, logprobs=True)
        bare = sample(logits, slots, pos, t, sampled=False)[0]  # no logprobs: each row's argmax, unpadded
    for a, b in zip(fast, full):
        assert torch.equal(a, b)
    assert torch.equal(bare, full[0])
    assert int(fast[0][2]) % 3 == 0 and int(fast[0][1]) not in (1, 2, 3)  # the mask and the ban held
    assert not torch.equal(fast[0], logits.argmax(-1))  # (the processing changed some tokens)
    unpenalized = slots != 0  # penalties=False, where no row is penalized: the same bits again
    with torch.inference_mode():
        lean = sample(logits[unpenalized], slots[unpenalized], pos[unpenalized], t, logprobs=True, penalties=False)
    for a, b in zip(lean, full):
        assert torch.equal(a, b[unpenalized])


def test_a_rows_token_and_logprobs_do_not_depend_on_the_batch():
    """Each row alone (M = 1) vs inside batches of 3, 16 and 45 rows at other offsets, among rows of
    other slots with other parameters (some truncating, some not): bitwise equal."""
    torch.manual_seed(1)
    V = 8192
    params = {
        0: Params(temperature=0.7, seed=11, logprobs=5),
        1: Params(temperature=1.3, top_p=0.8, seed=12),
        2: Params(temperature=1.0, top_k=40, min_p=0.05, seed=13),
        3: Params(),
        4: Params(temperature=0.9, seed=14, logit_bias=((3, 5.0), (100, -2.0), (8000, 40.0)), logprobs=3),
        5: Params(logit_bias=((7, 50.0),)),  # greedy, biased
        6: Params(temperature=0.8, seed=15, ban_end=6, banned=(0, 1, 2, 3)),  # min_tokens: banned at 5, not 6
        7: Params(ban_end=900, banned=tuple(range(0, 8000, 100))),  # greedy, 80 ids banned at 5 and 6
    }
    t = _table(params)
    rows = [(s, p) for s in range(8) for p in (5, 6, 900)]
    logits = {r: torch.randn(V) * 4 for r in rows}

    def run(batch):
        lg = torch.stack([logits[r] for r in batch])
        out = sample(lg, torch.tensor([s for s, _ in batch]), torch.tensor([p for _, p in batch]), t, logprobs=True)
        return {r: tuple(o[i] for o in out) for i, r in enumerate(batch)}

    alone = {r: run([r])[r] for r in rows}
    rng = random.Random(2)
    for M in (3, 16, 45):
        batch = [rows[rng.randrange(len(rows))] for _ in range(M)]
        batch = list(dict.fromkeys(batch)) or rows[:1]
        for r, got in run(batch).items():
            for a, b in zip(got, alone[r]):
                assert torch.equal(a, b), (M, r)


def test_the_graph_path_picks_what_the_eager_shortcuts_pick():
    """pick(full=True) is what a captured sampled graph computes whatever the table holds (every row
    through the full sampler: truncation, logprobs, penalty counts); the eager pick takes its host
    shortcuts from the live slots' parameters. Same tokens and logprobs, row for row, for greedy,
    sampled, truncating and logprob slots together, and for an all-greedy batch."""
    torch.manual_seed(4)
    V = 4096
    params = {0: Params(), 1: Params(temperature=0.8, seed=5), 2: Params(temperature=1.1, top_p=0.7, seed=6)}
    params[3] = Params(temperature=0.9, top_k=20, seed=7, logprobs=3)
    for live in ((0, 1, 2, 3), (0,)):
        t = _table({s: params[s] for s in live})
        slots = torch.tensor([s for s in live for _ in range(2)])
        rows, pos = torch.tensor([0, 1] * len(live)), torch.tensor([9, 10] * len(live))
        logits = torch.randn(len(slots), V) * 3
        eager = t.pick(logits, slots, rows, pos, live)
        lp_eager = {s: t.logprobs(s, 2) for s in live}
        graph = t.pick(logits, slots, rows, pos, live, full=True)
        assert torch.equal(eager, graph), live
        assert {s: t.logprobs(s, 2) for s in live} == lp_eager


def test_same_seed_same_tokens_other_seed_other_tokens():
    torch.manual_seed(3)
    logits = torch.randn(64, 2000)

    def run(seed):
        return sample(logits, torch.zeros(64, dtype=torch.long), torch.arange(64), _table({0: Params(1.0, seed=seed)}))[
            0
        ]

    a = run(5)
    assert torch.equal(a, run(5)) and (a != run(6)).sum() > 32
    assert (run((5 << 32) | 5) != a).sum() > 32  # the seed's high half counts too


# ---- distributions -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_logits():
    """The trained default model's next-token logits after a code prompt (fp32, CPU)."""
    from baton.engine.runner import ModelRunner
    from baton.loading import load_model, resolve_model_dir
    from baton.tokenizer import Tokenizer

    lm = load_model(None, dtype="fp32", device="cpu", mtp=False)
    ids = Tokenizer.from_dir(resolve_model_dir(None)).encode("def parse(self, text):\n    ")
    runner = ModelRunner(lm.model, slots=1, max_len=64)
    runner.prefill(0, ids)
    _, logits = rows_with_logits(runner, 0, runner.pad_ids([int(runner.state.next_token[0])]), 1)
    return logits[0].clone()


N_DRAWS = 3000


def _draws(logits, p: Params, n: int = N_DRAWS, seed_slot: int = 0) -> torch.Tensor:
    t = _table({seed_slot: p}, slots=1)
    lg = logits[None].expand(n, -1)
    truncate = p.top_k > 0 or 0.0 < p.top_p < 1.0  # as SamplingTable.pick decides
    return sample(lg, torch.zeros(n, dtype=torch.long), torch.arange(n), t, truncate=truncate, width=1000)[0]


def chi_square_p(draws: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square goodness of fit of draws to probs ([V] float64): bins with expected count
    >= 5 each, the rest pooled; a draw outside the support fails outright (p = 0)."""
    n = draws.numel()
    counts = torch.bincount(draws, minlength=probs.numel()).double()
    if counts[probs == 0].sum() > 0:
        return 0.0
    exp = probs * n
    big = exp >= 5
    obs_b, exp_b = counts[big].tolist(), exp[big].tolist()
    rest_o, rest_e = float(counts[~big].sum()), float(exp[~big].sum())
    if rest_e > 0:
        obs_b.append(rest_o)
        exp_b.append(rest_e)
    stat = sum((o - e) ** 2 / e for o, e in zip(obs_b, exp_b))
    df = len(exp_b) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2)))


CASES = {
    "temperature": Params(temperature=0.9, seed=101),
    "top_k": Params(temperature=1.0, top_k=12, seed=102),
    "top_p": Params(temperature=1.2, top_p=0.8, seed=103),
    "min_p": Params(temperature=1.1, min_p=0.02, seed=104),
    "combined": Params(temperature=0.8, top_k=30, top_p=0.9, min_p=0.01, seed=105),
    # unlikely tokens boosted into the support, one banned: the reference adds the same bias in float64
    "logit_bias": Params(temperature=1.0, top_p=0.95, seed=106, logit_bias=((10, 9.0), (11, 7.0), (12, -100.0))),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_sampler_matches_the_reference_distribution(model_logits, case):
    p = CASES[case]
    probs = reference_probs(model_logits, p)
    support = int((probs > 0).sum())
    assert 2 < support, support  # a distribution worth testing
    pv = chi_square_p(_draws(model_logits, p), probs)
    assert pv > 0.001, (case, pv, support)


def _wrong_top_p_before_temperature(logits, p: Params, n: int = N_DRAWS) -> torch.Tensor:
    """The classic bug: the nucleus chosen on softmax(logits) (T = 1), then the temperature applied."""
    keep = reference_probs(logits, Params(temperature=1.0, top_p=p.top_p)) > 0
    z = (logits / p.temperature).masked_fill(~keep, -math.inf)
    zero = torch.zeros(n, dtype=torch.long)
    return torch.cat(
        [
            (z[None] + gumbel(zero[:1000], zero[:1000] + p.seed, torch.arange(c, c + 1000), z.numel())).argmax(-1)
            for c in range(0, n, 1000)
        ]
    )


def test_a_deliberately_wrong_sampler_fails_the_same_test(model_logits):
    p = CASES["top_p"]
    probs = reference_probs(model_logits, p)
    assert chi_square_p(_wrong_top_p_before_temperature(model_logits, p), probs) < 0.001
    t_wrong = reference_probs(model_logits, Params(temperature=1.0, top_p=p.top_p))  # no temperature at all
    assert chi_square_p(_draws(model_logits, p), t_wrong) < 0.001


def test_logprobs_are_the_log_softmax_of_the_tempered_logits(model_logits):
    T = 0.7
    t = _table({0: Params(temperature=T, top_p=0.9, seed=7, logprobs=MAX_LOGPROBS)}, slots=1)
    lg = model_logits[None].expand(20, -1)
    tok, lp, top_lp, top_ids = sample(lg, torch.zeros(20, dtype=torch.long), torch.arange(20), t, logprobs=True)
    ref = torch.log_softmax(model_logits.double() / T, -1)
    assert torch.allclose(lp.double(), ref[tok], atol=1e-5, rtol=0)
    want_lp, want_ids = torch.topk(ref, MAX_LOGPROBS)
    assert torch.equal(top_ids[0], want_ids) and torch.allclose(top_lp[0].double(), want_lp, atol=1e-5, rtol=0)


def test_table_set_clear_and_limits():
    t = SamplingTable(2, "cpu", W)
    t.set(1, Params(temperature=0.5, top_p=1.0, min_p=0.1, seed=(1 << 64) - 1, logprobs=3))
    assert float(t.temperature[1]) == 0.5 and float(t.top_p[1]) == 1.0 and t.wants_logprobs(1)
    assert (int(t.seed_hi[1]), int(t.seed_lo[1])) == (0xFFFFFFFF, 0xFFFFFFFF)
    assert float(t.log_min_p[1]) == pytest.approx(math.log(0.1))
    t.clear(1)
    assert float(t.temperature[1]) == 0.0 and not t.wants_logprobs(1) and float(t.log_min_p[1]) == -math.inf
    with pytest.raises(ValueError, match="logprobs"):
        t.set(0, Params(logprobs=21))
    with pytest.raises(ValueError, match="slot"):
        t.set(2, Params())  # the scratch row is not a session's


# ---- the runner's paths ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def runner():
    from baton.engine.runner import ModelRunner
    from baton.loading import load_model

    lm = load_model(None, dtype="fp32", device="cpu", mtp=False)
    return ModelRunner(lm.model, slots=4, max_len=128)


PROMPTS = ([5, 6, 7, 8], [100, 200], [42] * 9, [1, 2, 3])
SAMPLED = (
    Params(temperature=0.8, seed=1),
    Params(temperature=1.0, top_p=0.9, seed=2, logprobs=2),
    Params(),
    Params(temperature=1.5, top_k=20, seed=3),
)


def _ar(runner, slot, ids, p, n):
    runner.sampling.set(slot, p)
    out = [runner.prefill(slot, ids)]
    for _ in range(n - 1):
        out.append(runner.rows(slot, [out[-1]])[0])
    return out


def test_runner_rows_batch_samples_each_slot_as_alone(runner):
    alone = [_ar(runner, s, PROMPTS[s], SAMPLED[s], 10) for s in range(4)]
    assert alone[2] == _ar(runner, 2, PROMPTS[2], None, 10)  # greedy = no parameters at all
    assert alone[0] != _ar(runner, 0, PROMPTS[0], Params(temperature=0.8, seed=99), 10)
    for s in range(4):  # batched: every slot steps in one rows_batch
        runner.sampling.set(s, SAMPLED[s])
        runner.prefill(s, PROMPTS[s])
    assert rows_batch_steps(runner, range(4), 10) == alone
    lp = runner.sampling.logprobs(1, 1)
    assert len(lp) == 1 and len(lp[0][1]) == 2 and lp[0][1][0][1] >= lp[0][1][1][1]


def test_a_verify_block_picks_what_ar_steps_pick(runner):
    """rows(n = K + 1) at width W picks at each row what the AR step at that position picks (the
    exact-mode coupling at T > 0)."""
    p = Params(temperature=1.0, seed=21)
    ar = _ar(runner, 0, PROMPTS[0], p, 8)
    runner.sampling.set(0, p)
    runner.prefill(0, PROMPTS[0])
    assert runner.rows(0, ar[:7]) == ar[1:8]


def test_logit_bias_moves_the_pick_and_leaves_other_rows_bitwise():
    """+100 makes a token the greedy pick, -100 bans the argmax (the runner-up is picked); an unbiased row
    beside biased ones (the table's -0.0 padding adds nothing) keeps its logits' exact argmax and logprobs."""
    torch.manual_seed(3)
    logits = torch.randn(3, 500) * 3
    top2 = logits.topk(2, dim=-1).indices
    t = _table(
        {0: Params(logprobs=2), 1: Params(logit_bias=((7, 100.0),)), 2: Params(logit_bias=((int(top2[2, 0]), -100.0),))}
    )
    tok, lp, top_lp, _ = sample(logits, torch.tensor([0, 1, 2]), torch.tensor([4, 4, 4]), t, logprobs=True)
    assert tok.tolist() == [int(top2[0, 0]), 7, int(top2[2, 1])]
    assert torch.equal(lp[0], torch.log_softmax(logits[0].float(), -1)[tok[0]])
    alone = sample(logits[:1], torch.tensor([0]), torch.tensor([4]), _table({0: Params(logprobs=2)}), logprobs=True)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(alone, (tok, lp, top_lp)))
    t.clear(1)  # a cleared slot has no bias left
    assert t.pick(logits[1:2], torch.tensor([1]), torch.tensor([0]), torch.tensor([4]), [1]).item() == int(top2[1, 0])


def test_setting_a_slot_s_unchanged_parameters_writes_nothing_to_the_device():
    """Exact mode's Draft sets its session's parameters every round: unchanged, the device scalars are already
    them, so the set writes nothing (it was 10 fill kernels a session a round); a change writes them, and
    going back writes the first ones again."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Writes(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Writes.n += str(func.overloadpacket).endswith(("fill_", "copy_"))
            return func(*args, **(kwargs or {}))

    t = SamplingTable(3, "cpu", 4)
    a = Params(temperature=0.8, top_p=0.9, seed=7, logit_bias=((3, 2.0),))
    b = Params(temperature=0.5, top_k=20, seed=9)
    t.set(1, a)
    before = [x.clone() for x in (t.temperature, t.top_p, t.top_k, t.seed_lo, t.bias_ids, t.bias_vals)]
    with Writes():
        t.set(1, Params(temperature=0.8, top_p=0.9, seed=7, logit_bias=((3, 2.0),)))  # equal, not the same object
    assert Writes.n == 0
    with Writes():
        t.set(1, b)
    assert Writes.n >= 10 and float(t.temperature[1]) == 0.5 and int(t.top_k[1]) == 20
    t.set(1, a)
    after = [t.temperature, t.top_p, t.top_k, t.seed_lo, t.bias_ids, t.bias_vals]
    assert all(torch.equal(x, y) for x, y in zip(before, after)) and t.params[1] == a
    t.clear(1)
    assert float(t.temperature[1]) == 0.0 and float(t.bias_vals[1].abs().sum()) == 0.0


def test_min_tokens_bans_its_ids_below_the_end_only_and_leaves_other_rows_bitwise():
    """min_tokens' ban (Params.ban_end / banned): at a position below ban_end the banned ids are never picked,
    greedy or sampled, and their logprob is -inf; from ban_end on the row is the unbanned row, bitwise; a row
    of another slot beside banned ones is bitwise what it is alone (the -0.0 padding adds nothing)."""
    torch.manual_seed(5)
    logits = torch.randn(4, 500) * 3
    top = logits.topk(3, dim=-1).indices
    ban = tuple(sorted({int(top[0, 0]), int(top[1, 0]), int(top[1, 1])}))
    greedy = Params(ban_end=10, banned=ban, logprobs=2)
    sampled = Params(temperature=0.7, seed=3, ban_end=10, banned=ban, logprobs=2)
    t = _table({0: greedy, 1: sampled, 2: Params(logprobs=2)})
    slots, lp_on = torch.tensor([0, 1, 2, 0]), dict(logprobs=True)
    tok, lp, top_lp, top_ids = sample(logits, slots, torch.tensor([9, 9, 9, 10]), t, **lp_on)
    assert int(tok[0]) == int(top[0, 1])  # greedy's argmax banned at position 9: the runner-up
    assert int(tok[3]) == int(top[3, 0])  # position 10 = ban_end: no ban
    assert int(tok[1]) not in ban and int(tok[2]) == int(top[2, 0])
    assert not any(int(i) in ban for i in top_ids[0]) and torch.isfinite(lp[:3]).all()
    plain = _table({0: Params(logprobs=2), 1: Params(temperature=0.7, seed=3, logprobs=2), 2: Params(logprobs=2)})
    unbanned = sample(logits, slots, torch.tensor([9, 9, 9, 10]), plain, **lp_on)
    for a, b in zip((tok, lp, top_lp, top_ids), unbanned):  # row 2 (other slot), row 3 (past the end): bitwise
        assert torch.equal(a[2:], b[2:])
    alone = sample(logits[2:3], torch.tensor([2]), torch.tensor([9]), _table({2: Params(logprobs=2)}), **lp_on)
    assert all(torch.equal(a[0], b[2]) for a, b in zip(alone, (tok, lp, top_lp, top_ids)))
    x = torch.full((500,), 0.0)  # the float64 reference: -inf at a banned id below the end only
    x[ban[0]] = 5.0
    from baton.engine.penalties import penalized_reference

    assert penalized_reference(x, [1] * 9, 0, greedy)[ban[0]] == -math.inf
    assert penalized_reference(x, [1] * 10, 0, greedy)[ban[0]] == 5.0
    many = SamplingTable(2, "cpu", W)
    with pytest.raises(ValueError, match="min_tokens"):
        many.set(0, Params(ban_end=3, banned=tuple(range(81))))
    assert many.params[0] == Params()  # a refused set leaves the slot as it was


def test_a_constrained_slot_picks_only_its_allowed_tokens_and_other_rows_stay_bitwise():
    """Structured outputs' mask (SamplingTable.allow): a constrained slot's greedy and sampled picks, logprobs and
    top-N keep to the allowed bits; rows of other slots beside it are bitwise what they are alone; a slot set
    unconstrained again ignores the bits it had."""
    torch.manual_seed(7)
    V = 500
    logits = torch.randn(3, V) * 3
    t = SamplingTable(4, "cpu", W, vocab_size=V)
    ok = [3, 77, 499]
    bits = torch.zeros((V + 31) // 32, dtype=torch.int32)
    for i in ok:
        bits[i // 32] |= torch.tensor(1 << (i % 32), dtype=torch.int64).to(torch.int32)
    g, smp = Params(structured=b"x", logprobs=3), Params(structured=b"x", temperature=0.9, seed=2, logprobs=3)
    t.set(0, g)
    t.set(1, smp)
    t.set(2, Params(logprobs=3))
    t.allow(0, 5, bits[None])  # the picks at position 5 (row 5 % W)
    t.allow(1, 4, torch.stack([bits.new_full(bits.shape, -1), bits]))  # positions 4 (all allowed) and 5
    tok, lp, top_lp, top_ids = sample(logits, torch.tensor([0, 1, 2]), torch.tensor([5, 5, 5]), t, logprobs=True)
    assert int(tok[0]) == ok[int(logits[0, ok].argmax())] and int(tok[1]) in ok
    assert set(top_ids[0, :3].tolist()) == set(ok) and torch.isinf(top_lp[0, 3:]).all()
    alone = sample(logits[2:], torch.tensor([2]), torch.tensor([5]), _table({2: Params(logprobs=3)}), logprobs=True)
    assert all(torch.equal(a[0], b[2]) for a, b in zip(alone, (tok, lp, top_lp, top_ids)))
    other = sample(logits[:1], torch.tensor([1]), torch.tensor([4]), t)[0]  # position 4: everything allowed
    fresh = SamplingTable(4, "cpu", W, vocab_size=V)  # its masks start all allowed
    fresh.set(3, smp)
    assert int(other[0]) == int(sample(logits[:1], torch.tensor([3]), torch.tensor([4]), fresh)[0][0])
    t.set(0, Params(logprobs=3))  # no longer constrained: its stale bits are not read
    assert int(sample(logits[:1], torch.tensor([0]), torch.tensor([5]), t)[0][0]) == int(logits[0].argmax())
    with pytest.raises(ValueError, match="no token masks"):
        SamplingTable(2, "cpu", W).set(0, g)
