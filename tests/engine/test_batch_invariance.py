"""Batch invariance (issue 20, first step), CPU eager path: `ModelRunner.rows_batch` over several
slots gives every slot bitwise the tokens and the state (conv, recurrent, KV rows [0, position),
position, next_token, hidden) that today's one-slot `rows` gives it alone, for AR rows and verify
blocks, at random positions, with batches whose flattened rows cross W-chunk boundaries and exceed W,
in fp32 and bf16, at W = 16 (the default) and W = 4 (many chunks per batch). Group order does not
matter; a bad batch raises before touching any state."""

from __future__ import annotations

import pytest
import torch
from helpers import make_tiny_dir

from baton.engine.runner import ModelRunner, WindowError
from baton.loading import load_model

SLOTS = 10
MAX_LEN = 96
VOCAB = 300


@pytest.fixture(scope="module", params=["fp32", "bf16"])
def lm(request, tmp_path_factory):
    d = make_tiny_dir(tmp_path_factory.mktemp("bi"), seed=21, layers=4, hidden=64, vocab=VOCAB, mtp=False)
    return load_model(d, dtype=request.param, device="cpu", mtp=False)


def _runner(lm, width: int, **kw) -> ModelRunner:
    return ModelRunner(lm.model, slots=SLOTS, max_len=MAX_LEN, width=width, **kw)


def _slot_state(r: ModelRunner, slot: int) -> dict[str, torch.Tensor]:
    st = r.state
    p = int(st.position[slot])
    out = {}
    for i in st.conv:
        out[f"conv.{i}"], out[f"rec.{i}"] = st.conv[i][slot].clone(), st.recurrent[i][slot].clone()
    for i in st.attn_ids:
        out[f"key.{i}"], out[f"value.{i}"] = st.slot_kv(i, slot, p)
    out["position"], out["next_token"] = st.position[slot].clone(), st.next_token[slot].clone()
    out["hidden"] = st.hidden[slot].clone()
    return out


def _assert_same_slot(a: ModelRunner, b: ModelRunner, slot: int, where: str) -> None:
    sa, sb = _slot_state(a, slot), _slot_state(b, slot)
    for k in sa:
        assert torch.equal(sa[k], sb[k]), f"{where}: slot {slot} {k}"


def _whole_state(r: ModelRunner) -> dict[str, torch.Tensor]:
    return {k: t.clone() for k, t in r.state.items_all()}


def _rand(g, lo: int, hi: int) -> int:
    return int(torch.randint(lo, hi + 1, (1,), generator=g))


def _tokens(g, n: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=g).tolist()


def _join(runners, slot: int, g) -> None:
    """A new session on `slot` in every runner: the same random prompt (a random position)."""
    ids = _tokens(g, _rand(g, 1, 40))
    for r in runners:
        r.prefill(slot, ids)


def _row_count(g, W: int) -> int:
    """An AR row half the time, else a verify block of 2..W rows."""
    return 1 if _rand(g, 0, 1) == 0 else _rand(g, 2, W)


@pytest.mark.parametrize("width", [16, 4])
def test_each_slot_in_a_batch_equals_rows_alone(lm, width):
    """Random schedule: each step a random batch of 1..SLOTS sessions (random row counts, random
    order) runs through rows_batch on one runner and slot by slot through rows() on the other; the
    tokens of every group and the state of every slot in the batch are bitwise equal, step after
    step (so also every later step). Sessions whose window fills leave and new ones join."""
    ref, bat = _runner(lm, width), _runner(lm, width)
    g = torch.Generator().manual_seed(width)
    for s in range(SLOTS):
        _join((ref, bat), s, g)
    sizes, chunks, crossed = set(), set(), False
    for step in range(24):
        B = 1 + step % SLOTS if step < SLOTS else _rand(g, 1, SLOTS)
        slots = torch.randperm(SLOTS, generator=g)[:B].tolist()
        groups = []
        for s in slots:
            n = _row_count(g, width)
            if int(bat.state.position[s]) + n > MAX_LEN:  # leaves; a new session takes the slot
                _join((ref, bat), s, g)
            groups.append((s, _tokens(g, n)))
        total = sum(len(t) for _, t in groups)
        sizes.add(B)
        chunks.add(-(-total // width))
        off = 0
        for _, t in groups:  # a group spanning two chunks
            crossed |= off // width != (off + len(t) - 1) // width
            off += len(t)
        want = [ref.rows(s, t) for s, t in groups]
        got = bat.rows_batch(groups)
        assert got == want, f"step {step}: tokens"
        for s, _ in groups:
            _assert_same_slot(ref, bat, s, f"step {step}")
    assert len(sizes) >= SLOTS // 2 and max(chunks) >= 3 and crossed, (sizes, chunks, crossed)


@pytest.mark.parametrize("width", [16, 4])
def test_one_session_alone_and_inside_batches_of_others(lm, width):
    """One session followed through AR rows and verify blocks of 2..W rows: alone (rows) and inside
    batches of 1..SLOTS-1 other sessions at random positions with random row counts, placed first,
    last or in the middle of the batch; its tokens and its state stay bitwise the same."""
    alone, bat = _runner(lm, width), _runner(lm, width)
    g = torch.Generator().manual_seed(100 + width)
    me = 3
    ids = _tokens(g, 17)
    alone.prefill(me, ids)
    bat.prefill(me, ids)
    others = [s for s in range(SLOTS) if s != me]
    for s in others:
        _join((bat,), s, g)
    for step, n in enumerate([1, 2, width, 1, 3, width - 1, 1, 1, 2, width]):
        toks = _tokens(g, n)
        k = 1 + step % (SLOTS - 1)
        grp = []
        for s in torch.randperm(len(others), generator=g)[:k].tolist():
            m = _row_count(g, width)
            if int(bat.state.position[others[s]]) + m > MAX_LEN:
                _join((bat,), others[s], g)
            grp.append((others[s], _tokens(g, m)))
        at = _rand(g, 0, len(grp))
        batch = grp[:at] + [(me, toks)] + grp[at:]
        got = bat.rows_batch(batch)[at]
        assert got == alone.rows(me, toks), f"step {step}"
        _assert_same_slot(alone, bat, me, f"step {step}")


def test_batch_of_one_is_rows(lm):
    """rows_batch([(slot, tokens)]) is rows(slot, tokens): tokens, slot state and the static
    buffers accept_prefix reads (tok_out, h_rows), bitwise."""
    a, b = _runner(lm, 16), _runner(lm, 16)
    g = torch.Generator().manual_seed(7)
    for slot in (0, 5):
        _join((a, b), slot, g)
        for n in (1, 4, 16, 1):
            t = _tokens(g, n)
            assert b.rows_batch([(slot, t)]) == [a.rows(slot, t)]
            assert torch.equal(a.tok_out[:n], b.tok_out[:n]) and torch.equal(a.h_rows[:n], b.h_rows[:n])
            _assert_same_slot(a, b, slot, f"slot {slot} n {n}")


def test_group_order_does_not_matter(lm):
    W = 4
    runners = [_runner(lm, W) for _ in range(3)]
    g = torch.Generator().manual_seed(9)
    for s in range(SLOTS):
        _join(runners, s, g)
    for step in range(4):
        groups = [(s, _tokens(g, _rand(g, 1, W))) for s in range(SLOTS)]
        orders = [groups, groups[::-1], [groups[i] for i in torch.randperm(SLOTS, generator=g).tolist()]]
        outs = []
        for r, order in zip(runners, orders):
            res = r.rows_batch(order)
            outs.append({s: t for (s, _), t in zip(order, res)})
        assert outs[0] == outs[1] == outs[2], f"step {step}"
        for s in range(SLOTS):
            _assert_same_slot(runners[0], runners[1], s, f"step {step}")
            _assert_same_slot(runners[0], runners[2], s, f"step {step}")


@pytest.mark.parametrize(
    "groups, err, match",
    [
        ([], ValueError, "no groups"),
        ([(1, [5]), (1, [6])], ValueError, "duplicate slot 1"),
        ([(1, [5]), (2, [])], ValueError, r"group 1 \(slot 2\): 0 tokens"),
        ([(1, [5] * 5)], ValueError, r"group 0 \(slot 1\): 5 tokens, expected 1..4"),
        ([(1, [5]), (SLOTS, [5])], ValueError, f"slot {SLOTS} out of range"),
        ([(1, [5]), (2, [VOCAB])], ValueError, f"token id {VOCAB} out of range"),
        ([(1, [5]), (0, [5, 6])], WindowError, f"exceeds the window of {MAX_LEN}"),
    ],
)
def test_bad_batch_raises_and_leaves_state_untouched(lm, groups, err, match):
    r = _runner(lm, 4)
    g = torch.Generator().manual_seed(5)
    for s in range(3):
        _join((r,), s, g)
    r.prefill(0, _tokens(g, MAX_LEN - 1))  # slot 0: one row left in its window
    before = _whole_state(r)
    with pytest.raises(err, match=match):
        r.rows_batch(groups)
    after = _whole_state(r)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_row_checkpoints_allow_one_row_groups_or_a_lone_block(lm):
    """With per-runner row checkpoints: AR rows of many slots batch; a lone verify block writes the
    checkpoints as rows() does (accept_prefix then rewinds as after rows); a multi-row group beside
    others is refused."""
    ck, ref = _runner(lm, 4, checkpoints=True), _runner(lm, 4, checkpoints=True)
    g = torch.Generator().manual_seed(11)
    for s in range(SLOTS):
        _join((ck, ref), s, g)
    groups = [(s, _tokens(g, 1)) for s in range(SLOTS)]
    assert ck.rows_batch(groups) == [ref.rows(s, t) for s, t in groups]
    blk = _tokens(g, 4)
    pos0 = int(ck.state.position[2])
    for r in (ck, ref):
        (r.rows_batch([(2, blk)]) if r is ck else r.rows(2, blk))
        r.accept_prefix(2, pos0, blk, 1)
    _assert_same_slot(ck, ref, 2, "after accept_prefix")
    before = _whole_state(ck)
    with pytest.raises(ValueError, match="one row per group"):
        ck.rows_batch([(1, [3]), (2, [4, 5])])
    assert all(torch.equal(before[k], t) for k, t in _whole_state(ck).items())
