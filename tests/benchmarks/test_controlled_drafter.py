"""benchmarks/controlled_decode_worker.py: ControlledDrafter.ahead draws what propose would (the on-device
MTP chains and the pipelined bf16 / fp8 drafts take a round's drafts from ahead, before the first step)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from benchmarks.controlled_decode_worker import ControlledDrafter, _Ctl

REF = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]


def _session(engine: str, position: int, base: int) -> SimpleNamespace:
    """A session whose round starts with t0 = REF[2] (reference index idx0 - 1 = 2)."""
    st = SimpleNamespace(position=torch.tensor([position]), next_token=torch.tensor([REF[2]]))
    s = SimpleNamespace(engine=engine, slot=0, runner=SimpleNamespace(state=st), draft_t0=REF[2], mtp_pairs_ids=[])
    s.ctl = _Ctl(base, [list(REF)], 0.5, random.Random(3), 100)
    return s


@pytest.mark.parametrize("engine", ["bf16", "fp8", "mtp"])
def test_ahead_draws_what_propose_would(engine):
    d, P, k = ControlledDrafter(None), 20, 6
    # propose's first call comes after the round's first step: a bf16 / fp8 state has consumed t0 by then
    after = _session(engine, P + (engine != "mtp"), base=P - 2)
    ahead = _session(engine, P, base=P - 2)
    proposed = [d.propose(after, i, 999) for i in range(k)]
    got = d.ahead(ahead, k)
    assert got == proposed and ahead.ctl.proposed == after.ctl.proposed
    assert ahead.ctl.idx0 == after.ctl.idx0 == 3
    assert ahead.ctl.rng.random() == after.ctl.rng.random()  # the same draws, in the same order
    assert any(g == REF[3 + i] for i, g in enumerate(got)) and any(g != REF[3 + i] for i, g in enumerate(got))


def test_ahead_past_the_reference_is_the_model_own_pick():
    d = ControlledDrafter(None)
    s = _session("mtp", 20, base=20 - 2)
    got = d.ahead(s, 9)  # drafts at reference indexes 3..11: the last two are past REF
    assert got[-2:] == [None, None] and all(g is not None for g in got[:-2])
    s.ctl = None
    assert d.ahead(s, 3) == [None, None, None]  # an uncontrolled session: the model's own picks
