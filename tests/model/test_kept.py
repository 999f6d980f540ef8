"""baton/models/kept.py: tensors of the config or the weights computed once (the rotary inverse
frequencies, a GDN layer's -exp(A_log)) give the model's bits, are computed again when the weight is
written, and are never kept with autograd on."""

from __future__ import annotations

import pytest
import torch
from helpers import make_tiny_dir

from baton.engine.runner import ModelRunner
from baton.loading import load_model
from baton.models.kept import kept, weights_key
from baton.models.qwen3_5 import GatedDeltaNet


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    return load_model(make_tiny_dir(tmp_path_factory.mktemp("kept")), dtype="bf16")


def test_kept_once_and_again_for_another_key():
    store, made = {}, []
    make = lambda: made.append(1) or torch.ones(2)  # noqa: E731
    with torch.no_grad():
        a = kept(store, ("k", 1), make)
        assert kept(store, ("k", 1), make) is a and len(made) == 1
        b = kept(store, ("k", 2), make)
        assert list(store) == [("k", 1), ("k", 2)] and len(made) == 2  # kept both: a graph may read the first
        assert kept(store, ("k", 1), make) is a and kept(store, ("k", 2), make) is b
        kept(store, None, make)
        assert len(made) == 3 and len(store) == 2


def test_with_autograd_on_nothing_is_kept():
    store = {}
    w = torch.zeros(3, requires_grad=True)
    x = kept(store, weights_key(w), lambda: -w.exp())
    assert store == {} and x.requires_grad
    x.sum().backward()
    assert torch.equal(w.grad, -torch.ones(3))


def test_weights_key_follows_in_place_writes():
    w = torch.zeros(3)
    k0 = weights_key(w)
    w.add_(1)
    assert weights_key(w) != k0
    with torch.inference_mode():
        assert weights_key(torch.zeros(3)) is None  # an inference tensor has no version counter


def test_a_prefill_after_a_gdn_weight_is_written_uses_the_new_weight(lm):
    """The kept -exp(A_log) follows the weight: a second model run after A_log changed in place equals a
    fresh computation with the changed weight (and differs from the first)."""
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    gdn = next(m for m in lm.model.modules() if isinstance(m, GatedDeltaNet))

    def run():
        r = ModelRunner(lm.model, slots=1, max_len=64, width=8)
        r.prefill(0, ids)
        return r.state.recurrent[gdn.layer_idx][0].clone()

    first = run()
    assert torch.equal(run(), first)  # kept: the same bits
    old = gdn.A_log.detach().clone()
    try:
        with torch.no_grad():
            gdn.A_log.add_(0.5)
        second = run()
        gdn._kept.clear()  # nothing kept: computed from the weight afresh
        assert torch.equal(run(), second) and not torch.equal(second, first)
    finally:
        with torch.no_grad():
            gdn.A_log.copy_(old)
