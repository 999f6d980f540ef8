"""The fused step's per-slot kernels (baton/kernels/gdn.py conv_rows / gdn_rows, baton/kernels/attention.py
qk_rope_kv / attention_rows, baton/kernels/rows.py ar_commit) batched over several sessions' slots, under
Triton's interpreter on CPU: each live group bitwise equal to the one-slot call alone (its outputs and
its slot's state), padding groups write nothing and give zero rows, other slots untouched; the attention
kernels read KV through shuffled page tables, bitwise equal to the contiguous-window kernels they replaced. AR batches of
1, 4 and 8 rows (with padding) and a batch of 3-row blocks; positions differ per group."""

from __future__ import annotations

import pytest
from helpers import interp_job, run_interp_script

pytest.importorskip("triton")
# the interpreted run starts in the background at collection (tests/prestart.py)
PRESTART = {"test_batched_kernels_equal_each_slot_alone": lambda: interp_job("batch_kernels_interp.py")}


def test_batched_kernels_equal_each_slot_alone():
    res = run_interp_script("batch_kernels_interp.py", timeout=120)
    assert res.pop("compiles_sm90") is True  # every launch also compiles for the H200 (tests/launch_record.py)
    assert len(res) == 13, res
    bad = {k: v for k, v in res.items() if not all(v.values())}  # attn: also paged == contiguous
    assert all("paged_equals_contiguous" in res[k] for k in res if k.startswith("attn_") and "ragged" not in k), res
    assert not bad, bad


def test_piece_programs_default_to_32_a_row_head_keep_the_grid_full_and_follow_the_environment(monkeypatch):
    """Unset: 32 programs a (row, kv head), more for calls of few rows (a grid of at least 1,024 programs),
    never more than the window's pieces; BATON_ATTN_PIECE_PROGRAMS=N: min(N, pieces), 0 or less: one program a
    piece; anything else is named, not guessed."""
    from baton.kernels.attention_loop import PIECE_PROGRAMS_ENV, piece_programs

    monkeypatch.delenv(PIECE_PROGRAMS_ENV, raising=False)
    assert piece_programs(513, rows=32, nkv=4) == 32  # 4,096 programs already
    assert piece_programs(513, rows=1, nkv=4) == 256  # one long row: 1,024 programs, ~2 pieces each
    assert piece_programs(513, rows=3, nkv=4) == 86  # ceil(1024 / 12)
    assert piece_programs(17, rows=1, nkv=4) == 17  # a 4,296-token window: one program a piece, as before
    assert piece_programs(17, rows=64, nkv=4) == 17
    for raw, want in (("0", 513), ("32", 32), (" 600 ", 513), ("-4", 513), ("1", 1)):
        monkeypatch.setenv(PIECE_PROGRAMS_ENV, raw)
        assert piece_programs(513, rows=1, nkv=4) == want, raw
    monkeypatch.setenv(PIECE_PROGRAMS_ENV, "many")
    with pytest.raises(ValueError, match="BATON_ATTN_PIECE_PROGRAMS: 'many'"):
        piece_programs(513, rows=1, nkv=4)


def test_program_partials_fix_the_programs_and_size_the_partials_by_them(monkeypatch):
    """BATON_ATTN_PROGRAM_PARTIALS=N: N programs a (row, kv head) whatever the rows or BATON_ATTN_PIECE_PROGRAMS
    say (a row's bits depend on N past N pieces), at most the window's pieces; the partials and a runner's
    scratch are sized by them, not by the window (~32x less at 262,144 tokens with N = 32)."""
    from baton.engine import pages as pages_mod
    from baton.kernels.attention_loop import PIECE_PROGRAMS_ENV, piece_programs
    from baton.kernels.split_scratch import PARTIALS_ENV, partial_slots, program_partials
    from baton.random_init import shape

    cfg = shape("qwen3.5-9b")
    monkeypatch.delenv(PARTIALS_ENV, raising=False)
    monkeypatch.setenv(PIECE_PROGRAMS_ENV, "7")
    long = pages_mod.attention_scratch_bytes_of(cfg, 320, 262_144)
    assert (program_partials(), partial_slots(1024), piece_programs(1024, rows=1, nkv=4)) == (0, 1024, 7)
    monkeypatch.setenv(PARTIALS_ENV, "32")
    assert (program_partials(), partial_slots(1024), partial_slots(17)) == (32, 32, 17)
    assert [piece_programs(1024, rows=r, nkv=4) for r in (1, 64)] == [32, 32] and piece_programs(17, 1, 4) == 17
    assert pages_mod.attention_scratch_bytes_of(cfg, 320, 262_144) * 32 == long  # 1,024 pieces -> 32 partials
    for raw in ("0", "-3"):
        monkeypatch.setenv(PARTIALS_ENV, raw)
        assert program_partials() == 0 and partial_slots(1024) == 1024
    monkeypatch.setenv(PARTIALS_ENV, "lots")
    with pytest.raises(ValueError, match="BATON_ATTN_PROGRAM_PARTIALS: 'lots'"):
        program_partials()
