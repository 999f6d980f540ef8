"""HybridState (issue 3): O(1) GDN bytes, KV bytes linear in the prompt, snapshot/restore keep addresses,
export -> wire -> import is bitwise and decodes identically; no pickle in runtime code."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from helpers import make_tiny_dir
from torch.utils._python_dispatch import TorchDispatchMode

from baton.engine.runner import ModelRunner
from baton.engine.state import ATTN_KEY, ATTN_VALUE, GDN_CONV, GDN_RECURRENT
from baton.handoff import decode, encode, wire
from baton.handoff import layout as wire_layout
from baton.loading import load_model

ROOT = Path(__file__).resolve().parents[2]
RUNTIME = ["baton", "prefill_worker", "decode_worker", "router", "deploy"]


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    return load_model(make_tiny_dir(tmp_path_factory.mktemp("st")), dtype="fp32", device="cpu", mtp=False)


def _bytes_by_kind(tensors):
    out = {}
    for t in tensors:
        out[t.kind] = out.get(t.kind, 0) + t.tensor.numel() * t.tensor.element_size()
    return out


def test_gdn_state_is_o1_and_kv_is_linear_in_prompt(lm):
    r = ModelRunner(lm.model, max_len=1100)
    per_token = r.state.kv_bytes_per_token()
    seen = []
    for n in (10, 100, 1000):
        r.prefill(0, torch.randint(0, lm.cfg.vocab_size, (n,)).tolist())
        b = _bytes_by_kind(r.state.export(0))
        seen.append((b[GDN_CONV], b[GDN_RECURRENT]))
        assert b[ATTN_KEY] + b[ATTN_VALUE] == n * per_token
    assert seen[0] == seen[1] == seen[2]
    assert per_token == 2 * len(lm.cfg.attn_layers) * lm.cfg.num_key_value_heads * lm.cfg.head_dim * 4


def test_snapshot_restore_keep_addresses_and_values(lm):
    r = ModelRunner(lm.model, max_len=64)
    r.prefill(0, [1, 2, 3, 4])
    addrs = {k: t.data_ptr() for k, t in r.state.items_all()}
    before = {k: t.clone() for k, t in r.state._o1_items()}
    r.state.snapshot(0)
    r.rows(0, [5, 6, 7])
    r.state.restore(0)
    assert {k: t.data_ptr() for k, t in r.state.items_all()} == addrs
    for k, t in r.state._o1_items():
        assert torch.equal(t, before[k]), k


class _Ops(TorchDispatchMode):
    """Counts the torch ops run under it (each a kernel launch or a view on CUDA: the host's cost)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def test_snapshot_and_restore_of_many_slots_equal_the_per_slot_ones_in_ops_independent_of_the_count(lm):
    """State.snapshot_slots / restore_slots (a batched verify's rewind, speculation.verify_blocks): bitwise
    what snapshot / restore of each slot gives, in the same number of torch ops for 1 slot or 6, where
    the per-slot loop runs one op a slot and O(1) tensor (51 a slot at the 9B shape)."""
    r = ModelRunner(lm.model, slots=8, max_len=64)
    for s in range(8):
        r.prefill(s, [1 + s, 2, 3, 4 + s])
    snap0 = {k: t.clone() for k, t in r.state._snap.items()}
    ops = {}
    for slots in ([5], [6, 0, 3, 1, 7, 2]):
        with _Ops() as c:
            r.state.snapshot_slots(slots)
        ops[len(slots)] = c.n
    want = {k: v.clone() for k, v in snap0.items()}
    for s in [5, 6, 0, 3, 1, 7, 2]:
        for k, t in r.state._o1_items():
            want[k][s] = t[s]
    assert all(torch.equal(r.state._snap[k], want[k]) for k in want)  # slot 4 untouched, the rest taken
    assert ops[1] == ops[6], ops
    before = {k: t.clone() for k, t in r.state._o1_items()}
    for s in (0, 1, 2, 4):
        r.rows(s, [9, 10])
    with _Ops() as c:
        r.state.restore_slots([2, 0, 1])
    assert c.n == ops[1]
    for k, t in r.state._o1_items():
        assert torch.equal(t[[0, 1, 2]], before[k][[0, 1, 2]]), k  # rewound
    assert int(r.state.position[4]) == int(before["position"][4]) + 2  # slot 4 kept its rows
    with pytest.raises(ValueError, match="distinct"):
        r.state.snapshot_slots([1, 1])


def test_reset_of_many_slots_equals_the_per_slot_resets_in_ops_independent_of_the_count(lm):
    """HybridState.reset_slots (a prefill pass's fresh prompts, baton/engine/prefill.py run_pass): every
    O(1) tensor and KV page of the slots zeroed, and the extra pages given, bitwise as reset() of each slot,
    the other slots untouched, in the same number of torch ops for 1 slot or 3 (one loop of ~70 ops a slot
    at the 9B shape before)."""
    r = ModelRunner(lm.model, slots=6, max_len=64)
    for s in range(6):
        r.prefill(s, [1 + s, 2, 3, 4 + s] * (3 + s))
    state = lambda: {k: t.clone() for k, t in r.state.items_all()}  # noqa: E731
    before = state()
    spare = r.state.pages.owned(4)  # another slot's pages, zeroed through `pages`
    for s in (1, 3, 5):
        r.state.reset(s)
    for i in r.state.attn_ids:
        r.state.key[i][spare] = 0
        r.state.value[i][spare] = 0
    want = state()
    for k, t in r.state.items_all():  # back to the prefilled state
        t.copy_(before[k])
    ops = {}
    for slots, pages in (([2], []), ([5, 1, 3], spare)):
        if len(slots) > 1:
            for k, t in r.state.items_all():
                t.copy_(before[k])
        with _Ops() as c:
            r.state.reset_slots(slots, pages)
        ops[len(slots)] = c.n
    got = state()
    assert all(torch.equal(got[k], want[k]) for k in want), [k for k in want if not torch.equal(got[k], want[k])]
    assert any(not torch.equal(before[k], want[k]) for k in want)  # the resets zeroed something
    assert ops[1] == ops[3], ops


def test_slot_copies_pad_with_the_last_slot_and_chunk_bitwise_as_the_per_slot_copies(lm):
    """With slot copies on (baton/engine/slot_copies.py: on CUDA a graph replay a bucket; here the same
    padded copies run eagerly), snapshot_slots / restore_slots of 3 slots (bucket 4, padded with the last
    slot) and of 7 (chunks of the top bucket, 4 and 3) leave every buffer bitwise as snapshot / restore of
    each slot, and no slot outside the call is written (the padding copies its last slot again)."""
    r = ModelRunner(lm.model, slots=8, max_len=64)
    for s in range(8):
        r.prefill(s, [1 + s, 2, 3, 4 + s])
    with torch.inference_mode():  # as graph.capture_all builds it; used outside inference mode after
        copies = r.state.enable_slot_copies(4)
    assert copies.buckets == [1, 2, 4]
    for slots in ([6, 1, 3], [5, 1, 7, 2, 4, 0, 6]):
        for k in r.state._snap:
            r.state._snap[k].fill_(7)
        want = {k: v.clone() for k, v in r.state._snap.items()}
        for s in slots:
            for k, t in r.state._o1_items():
                want[k][s] = t[s]
        r.state.snapshot_slots(slots)
        assert all(torch.equal(r.state._snap[k], want[k]) for k in want), slots
        before = {k: t.clone() for k, t in r.state._o1_items()}
        for s in range(8):
            r.rows(s, [9, 10])
        after = {k: t.clone() for k, t in r.state._o1_items()}
        r.state.restore_slots(slots)
        for k, t in r.state._o1_items():
            for s in range(8):
                assert torch.equal(t[s], (before if s in slots else after)[k][s]), (k, s)
        assert int(r.state.position[slots[0]]) == int(before["position"][slots[0]])
    assert copies.replays == 0 and not copies.graphs  # no CUDA: the eager padded copies ran


def test_export_wire_import_is_bitwise_and_decodes_the_same(lm):
    src = ModelRunner(lm.model, max_len=128)
    dst = ModelRunner(lm.model, slots=2, max_len=128)
    first = src.prefill(0, torch.randint(0, lm.cfg.vocab_size, (37,)).tolist())
    tensors = src.state.export(0)
    chunks = list(
        encode.encode_state(
            session_id="s",
            fingerprint=lm.fingerprint,
            position=37,
            next_token=first,
            tensors=[wire.WireTensor(t.name, t.kind, t.tensor) for t in tensors],
            chunk_bytes=4096,
        )
    )
    layout = wire_layout.ExpectedLayout.from_tensors(
        [wire.WireTensor(t.name, t.kind, t.tensor) for t in tensors], max_position=128
    )
    got = decode.decode_stream(chunks, layout, lm.fingerprint, 1 << 30)
    dst.state.import_(1, got.tensors, position=got.position, next_token=got.next_token)
    for a, b in zip(src.state.export(0), dst.state.export(1)):
        assert torch.equal(a.tensor, b.tensor), a.name
    ta, tb = first, first
    for _ in range(32):
        ta, tb = src.rows(0, [ta])[0], dst.rows(1, [tb])[0]
        assert ta == tb


def test_no_pickle_marshal_or_cloudpickle_in_runtime_code():
    banned = {"pickle", "cPickle", "cloudpickle", "marshal", "dill", "_pickle"}
    hits = []
    for pkg in RUNTIME:
        for f in (ROOT / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(f.read_text(), filename=str(f))):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name.split(".")[0] for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module.split(".")[0]]
                hits += [f"{f.relative_to(ROOT)}: {n}" for n in names if n in banned]
    assert not hits, hits


def test_slot_reads_and_writes_in_one_copy():
    """baton/transfer.py read_slots / write_slots: per-slot scalars (positions, next tokens) of many slots
    read and written at once, equal to the per-slot reads and writes they replace."""
    import torch

    from baton.transfer import read_slots, write_slots

    t = torch.arange(10, dtype=torch.int64) * 7
    assert read_slots(t, [3, 0, 9]) == [21, 0, 63] and read_slots(t, []) == []
    write_slots(t, [4, 1], [-5, 11])
    assert t.tolist() == [0, 11, 14, 21, -5, 35, 42, 49, 56, 63]
    write_slots(t, [], [])
    with pytest.raises(ValueError):
        write_slots(t, [1, 2], [3])


@pytest.mark.parametrize("n", [7, 256, 600])
def test_a_lazy_kv_tensor_read_in_place_is_its_gathered_rows(lm, n):
    """export(lazy=True)'s KV tensors (the hand-off sender's, prefill_worker/engine.py export) read in place
    (StateTensor.paged: a PagedSource over the slot's pages, what the stager copies by address with
    BATON_STAGE_KV_IN_PLACE=1) hold, address run by address run, exactly the rows their gather copies out,
    for every attention layer's key and value, the slot's pages in any order in the pool."""
    import ctypes

    r = ModelRunner(lm.model, slots=3, max_len=1100)
    r.prefill(1, torch.randint(0, lm.cfg.vocab_size, (300,)).tolist())  # slot 1's pages first: slot 2's land after
    r.prefill(2, torch.randint(0, lm.cfg.vocab_size, (n,)).tolist())
    lazy = [t for t in r.state.export(2, n, lazy=True) if t.kind in (ATTN_KEY, ATTN_VALUE)]
    assert len(lazy) == 2 * len(lm.cfg.attn_layers)
    for t in lazy:
        want = t.gather()
        src = t.paged()
        assert src.shape == tuple(want.shape) and src.dtype == want.dtype and src.pages == r.state.pages.owned(2)
        assert torch.equal(src.gather(), want), t.name
        total = src.numel() * src.element_size()
        got = b"".join(ctypes.string_at(at, k) for at, k in src.address_ranges(0, total))
        assert got == bytes(want.contiguous().view(torch.uint8).reshape(-1).numpy()), t.name
