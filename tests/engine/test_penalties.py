"""baton/engine/penalties.py: repetition / presence / frequency penalties over each slot's token history.

Pure tensors: the arithmetic; the history's counts; a penalized pick (greedy and seeded T > 0) equals a
float64 reference; a row's token and logprobs are bitwise the same alone and inside batches of other
slots with other histories; a neutral row is bitwise unchanged inside a penalized chunk; a session with
penalties and no history is refused. The runner (embedded model, CPU): a verify block with penalties
picks what AR steps pick, rows_batch equals alone, and a rejected block or a rewind leaves nothing behind.
"""

import random

import pytest
import torch
from helpers import rows_batch_steps

from baton.engine.noise import gumbel
from baton.engine.penalties import History, penalize, penalized_reference
from baton.engine.sampling import Params, SamplingTable, sample

W = 16


def test_penalties_arithmetic():
    x = torch.tensor([[2.0, -2.0, 1.0, 0.5, 3.0]])
    counts = torch.tensor([[1, 2, 0, 3, 0]])
    seen = torch.tensor([[True, True, False, True, True]])  # index 4: in the prompt only
    out = penalize(x, counts, seen, torch.tensor([2.0]), torch.tensor([0.5]), torch.tensor([0.25]))
    assert out.tolist() == [[2.0 / 2 - 0.5 - 0.25, -2.0 * 2 - 0.5 - 0.5, 1.0, 0.5 / 2 - 0.5 - 0.75, 3.0 / 2]]


def _table(hist: dict[int, tuple[list[int], int]], params: dict[int, Params], slots: int = 8) -> SamplingTable:
    t = SamplingTable(slots, "cpu", W, max_len=512)
    for s, (ids, g) in hist.items():
        t.history.load(s, ids, g)
    for s, p in params.items():
        t.set(s, p)
    return t


def test_counts_are_the_history_before_each_rows_position():
    h = History(2, 32, "cpu")
    h.load(0, [5, 6, 5, 7, 7, 7], 2)  # prompt [5, 6], generated [5, 7, 7, 7]
    h.record(torch.tensor([0, 0]), torch.tensor([6, 7]), torch.tensor([9, 5]))  # two more generated tokens
    counts, seen = h.counts(torch.tensor([0, 0, 0, 2]), torch.tensor([2, 5, 8, 0]), 10)
    assert counts[0].tolist() == [0] * 10 and seen[0].nonzero()[:, 0].tolist() == [5, 6]
    assert counts[1].tolist() == [0, 0, 0, 0, 0, 1, 0, 2, 0, 0]  # positions 2..4: 5, 7, 7
    assert counts[2].tolist() == [0, 0, 0, 0, 0, 2, 0, 3, 0, 1]
    assert seen[2].nonzero()[:, 0].tolist() == [5, 6, 7, 9] and not seen[3].any()  # the scratch row: nothing


def test_a_penalized_pick_equals_the_float64_reference():
    torch.manual_seed(0)
    V, rng = 500, random.Random(0)
    cases = [
        Params(repetition_penalty=1.3),
        Params(presence_penalty=1.5, frequency_penalty=0.7),
        Params(repetition_penalty=0.8, presence_penalty=-0.5, frequency_penalty=-1.0),
        Params(temperature=0.8, seed=3, repetition_penalty=1.2, frequency_penalty=0.5),
        Params(temperature=1.1, seed=4, top_k=50, presence_penalty=2.0),
    ]
    for i, p in enumerate(cases):
        # a history dense in the likely tokens, so the penalties decide the pick
        logits = torch.randn(V) * 2
        top = torch.topk(logits, 8).indices.tolist()
        logits[top[1]] = logits[top[0]] * 0.95  # a close second that never occurs
        ids = [rng.choice(top[:1] + top[2:]) if rng.random() < 0.7 else rng.randrange(V) for _ in range(40)]
        ids = [t for t in ids if t != top[1]] + [top[0]]
        g = 15
        t = _table({0: (ids, g)}, {0: p})
        pos = torch.tensor([len(ids)])
        tok = sample(logits[None], torch.tensor([0]), pos, t)[0]
        ref = penalized_reference(logits, ids, g, p)
        if p.greedy:
            want = int(ref.argmax())
        else:
            z = ref / p.temperature
            if p.top_k:
                z = z.masked_fill(z < torch.topk(z, p.top_k).values[-1], float("-inf"))
            want = int((z + gumbel(t.seed_hi[:1], t.seed_lo[:1], pos, V)[0].double()).argmax())
        assert int(tok[0]) == want, (i, p)
        if i < 2:  # the penalty decides these greedy picks
            assert want == top[1], i
        x = penalize(logits[None].float(), *t.history.counts(torch.tensor([0]), pos, V), t.repetition[:1],
                     t.presence[:1], t.frequency[:1])  # fmt: skip
        assert torch.allclose(x[0].double(), ref, atol=1e-5, rtol=0)


def test_a_rows_token_and_logprobs_do_not_depend_on_the_batch():
    """Rows of 5 slots (different histories and penalties, one neutral, one greedy-penalized) alone vs
    inside batches of 3, 16 and 45 rows at other offsets: torch.equal for the token, logprob, top-N."""
    torch.manual_seed(1)
    V, rng = 4096, random.Random(2)
    params = {
        0: Params(temperature=0.7, seed=11, logprobs=5, repetition_penalty=1.3),
        1: Params(temperature=1.0, top_p=0.9, seed=12, presence_penalty=1.0, frequency_penalty=0.5),
        2: Params(repetition_penalty=1.5, logprobs=3),  # greedy with a penalty
        3: Params(),
        4: Params(temperature=0.9, seed=13, frequency_penalty=-0.5),
    }
    hist = {s: ([rng.randrange(200) for _ in range(100)], 10 + 7 * s) for s in range(5)}
    t = _table(hist, params)
    rows = [(s, p) for s in range(5) for p in (10, 40, 99)]
    logits = {r: torch.randn(V) * 4 for r in rows}
    for s, p in rows:  # the history's tokens are the likely ones, the last one consumed the likeliest
        logits[(s, p)][:200] += 8
        logits[(s, p)][hist[s][0][p - 1]] = logits[(s, p)].max() + 1

    def run(batch):
        lg = torch.stack([logits[r] for r in batch])
        out = sample(lg, torch.tensor([s for s, _ in batch]), torch.tensor([p for _, p in batch]), t, logprobs=True)
        return {r: tuple(o[i] for o in out) for i, r in enumerate(batch)}

    alone = {r: run([r])[r] for r in rows}
    assert any(int(alone[(2, p)][0]) != int(logits[(2, p)].argmax()) for p in (10, 40, 99))  # greedy, penalized
    for M in (3, 16, 45):
        batch = list(dict.fromkeys(rows[rng.randrange(len(rows))] for _ in range(M)))
        for r, got in run(batch).items():
            for a, b in zip(got, alone[r]):
                assert torch.equal(a, b), (M, r)


def test_a_neutral_row_is_bitwise_unchanged_in_a_penalized_chunk():
    torch.manual_seed(2)
    t = _table({0: ([1, 2, 3], 1), 1: ([4, 5], 1)}, {0: Params(temperature=0.9, seed=1, logprobs=4), 1: Params()})
    lg = torch.randn(2, 300)
    a = sample(lg, torch.tensor([0, 1]), torch.tensor([3, 2]), t, logprobs=True, penal=False)
    b = sample(lg, torch.tensor([0, 1]), torch.tensor([3, 2]), t, logprobs=True, penal=True)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    t.set(0, Params(temperature=0.9, seed=1, logprobs=4, presence_penalty=-0.0, repetition_penalty=0.0))
    assert not t.params[0].penalized and float(t.presence[0]) == 0.0 and str(float(t.presence[0])) == "0.0"


def test_penalties_without_a_history_are_refused():
    t = SamplingTable(2, "cpu", W, max_len=64)
    with pytest.raises(ValueError, match="^history"):
        t.set(0, Params(presence_penalty=0.5))
    assert not t.params[0].penalized  # nothing changed
    t.history.begin(0, 3)
    t.set(0, Params(presence_penalty=0.5))
    assert not t.plain(0)
    t.clear(0)  # a released slot forgets its history
    with pytest.raises(ValueError, match="^history"):
        t.set(0, Params(frequency_penalty=0.5))
    with pytest.raises(ValueError, match="generated_from"):
        t.history.load(1, [1, 2], 3)


# ---- the runner's paths ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def runner():
    from baton.engine.runner import ModelRunner
    from baton.loading import load_model

    lm = load_model(None, dtype="fp32", device="cpu", mtp=False)
    return ModelRunner(lm.model, slots=4, max_len=128, checkpoints=True)


PROMPTS = ([5, 6, 7, 8, 5, 6], [100, 200, 100], [42] * 9, [1, 2, 3])
PENALIZED = (
    Params(repetition_penalty=1.8, frequency_penalty=0.6),  # greedy
    Params(temperature=0.8, seed=2, presence_penalty=1.0, logprobs=2),
    Params(),
    Params(temperature=1.0, seed=3, top_k=20, repetition_penalty=1.4, frequency_penalty=0.3),
)


def _open(runner, slot, ids, p, generated=0):
    runner.sampling.history.begin(slot, len(ids) - generated)
    runner.sampling.set(slot, p)
    return runner.prefill(slot, ids)


def _ar(runner, slot, ids, p, n):
    out = [_open(runner, slot, ids, p)]
    for _ in range(n - 1):
        out.append(runner.rows(slot, [out[-1]])[0])
    return out


def test_a_penalty_changes_the_greedy_output(runner):
    plain = _ar(runner, 0, PROMPTS[0], Params(), 16)
    pen = _ar(runner, 0, PROMPTS[0], PENALIZED[0], 16)
    assert pen != plain
    assert len(set(pen)) > len(set(plain)) or max(pen.count(t) for t in pen) < max(plain.count(t) for t in plain)


def test_a_verify_block_with_penalties_picks_what_ar_steps_pick(runner):
    """rows(n = K + 1): row j sees t0, d1..dj in its history, as the AR step at that position does; then a
    rejected block (accept_prefix) and more AR steps: the junk rows' tokens are never counted."""
    from baton.engine.speculation import verify_block

    for p in (PENALIZED[0], PENALIZED[3]):
        ar = _ar(runner, 0, PROMPTS[0], p, 10)
        _open(runner, 0, PROMPTS[0], p)
        assert runner.rows(0, ar[:7]) == ar[1:8], p
        _open(runner, 0, PROMPTS[0], p)
        wrong = [(t + 1) % 100 for t in ar[3:7]]
        m, nxt = verify_block(runner, 0, ar[:3] + wrong)  # accepts d1, d2, then corrects
        assert (m, nxt) == (2, ar[3])
        got = ar[:4]
        while len(got) < 10:
            got.append(runner.rows(0, [got[-1]])[0])
        assert got == ar, p


def test_rows_batch_with_penalties_samples_each_slot_as_alone(runner):
    alone = [_ar(runner, s, PROMPTS[s], PENALIZED[s], 10) for s in range(4)]
    for s in range(4):
        _open(runner, s, PROMPTS[s], PENALIZED[s])
    assert rows_batch_steps(runner, range(4), 10) == alone


def test_a_re_prefill_counts_the_generated_part_as_generated(runner):
    """The fast-mode migration path: prompt + generated re-prefilled with generated_from = len(prompt)
    picks what the original session picks next; counted as prompt, it picks otherwise (frequency)."""
    p = Params(frequency_penalty=2.0, presence_penalty=2.0)
    ar = _ar(runner, 1, PROMPTS[1], p, 10)
    cont = [_open(runner, 1, PROMPTS[1] + ar[:6], p, generated=6)]
    while len(cont) < 4:
        cont.append(runner.rows(1, [cont[-1]])[0])
    assert cont == ar[6:10]
    as_prompt = [_open(runner, 1, PROMPTS[1] + ar[:6], p)]
    while len(as_prompt) < 4:
        as_prompt.append(runner.rows(1, [as_prompt[-1]])[0])
    assert as_prompt != cont


def test_an_undone_pipelined_step_leaves_nothing_behind(runner):
    """ar_launch / undo_step (the decode worker's pipelined loop past a stop token): the undone step's
    token is not counted; the token fed at its position instead is, and the picks are AR's."""
    from baton.engine.runner import ModelRunner

    p = PENALIZED[0]
    piped = ModelRunner(runner.model, slots=1, max_len=128, pipeline=True)
    ar = _ar(piped, 0, PROMPTS[3], p, 3)
    x = (ar[2] + 7) % 100  # fed at ar[2]'s position instead
    want = [_open(piped, 0, PROMPTS[3], p)]
    want += piped.rows(0, [want[0]])
    assert piped.rows(0, [want[1]]) == [ar[2]]  # consumes ar[1]; x then takes ar[2]'s place
    want.append(x)
    while len(want) < 8:
        want.append(piped.rows(0, [want[-1]])[0])
    assert _open(piped, 0, PROMPTS[3], p) == ar[0]
    piped.ar_launch(0, 0)  # consumes ar[0]
    assert piped.ar_collect(0, 0) == ar[1]
    piped.ar_launch(0, 1)  # consumes ar[1]
    assert piped.ar_collect(0, 1) == ar[2]
    piped.ar_launch(0, 0)  # consumes ar[2]: undone, as past a stop token
    piped.state.undo_step(0, 0, ar[2])
    got = ar[:2] + [x]
    while len(got) < 8:
        got.append(piped.rows(0, [got[-1]])[0])
    assert got == want
