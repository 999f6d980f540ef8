"""GPU check of the looped split attention (baton/kernels/attention_loop.py; run on the device with
`pytest -m gpu`): at the Qwen3.5-9B attention shape (16 query heads, 4 kv heads, head_dim 256), bf16 KV in
shuffled pages of a 64-piece window, rows of 8 sessions at positions from 0 to the window's end (short rows,
rows ending inside a piece, rows at a piece's last key, full-window rows), batched with padding groups:
attention_rows' output with N programs a (row, kv head) looping the row's pieces is bitwise the output of
one program a piece (BATON_ATTN_PIECE_PROGRAMS=0), for N = 1, 7, 32, the window's pieces and the default
(which follows the rows); and its partials land in the runner's scratch as in buffers of their own."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


NH, NKV, D, MP, S, GS = 16, 4, 256, 64, 8, 2  # the 9B's attention heads; a 64-piece window, 8 slots, 2 rows a group
SLOTS = [0, 1, -1, 2, 3, 4, -1, 5, 6, 7]  # groups' slots, two of them padding
ENDS = [0, 255, 0, 256, 1000, 5000, 0, 8191, 12345, MP * 256 - 2]  # each group's first row's position


def _case(seed: int):
    """-> (kp, vp, table, slots, pos, q, gate) on CUDA: bf16 KV in shuffled pages (5 spare), two rows a group."""
    from baton.kernels.attention import ATTN_SPLIT as SP

    g = torch.Generator(device="cuda").manual_seed(seed)
    pages = S * MP + 5
    kp, vp = (torch.randn(pages, NKV, SP, D, generator=g, device="cuda").to(torch.bfloat16) for _ in range(2))
    tab = torch.randperm(pages, generator=g, device="cuda")[: S * MP].reshape(S, MP).to(torch.int32).contiguous()
    pos = torch.tensor([[e, e + 1] for e in ENDS], device="cuda").reshape(-1)
    q, gate = (torch.randn(pos.numel(), NH, D, generator=g, device="cuda").to(torch.bfloat16) for _ in range(2))
    return kp, vp, tab, torch.tensor(SLOTS, device="cuda"), pos, q, gate


@cuda
def test_looped_partials_give_the_one_program_a_piece_output_bitwise(monkeypatch):
    from baton.kernels import attention as A
    from baton.kernels.attention_loop import PIECE_PROGRAMS_ENV
    from baton.kernels.split_scratch import reserve_split_scratch

    kp, vp, tab, slots, pos, q, gate = _case(0)
    gs, rows = GS, pos.numel()

    def run(scratch=None):
        o = A.attention_rows(q, kp, vp, pos, gate, gs, table=tab, slots=slots, gs=gs, scratch=scratch)
        torch.cuda.synchronize()
        return o

    monkeypatch.setenv(PIECE_PROGRAMS_ENV, "0")  # one program a piece
    plain = run()
    assert plain.abs().sum() > 0 and bool((plain[4:6] == 0).all())  # a padding group's rows are zero
    for programs in ("1", "7", "32", str(MP), None):
        if programs is None:
            monkeypatch.delenv(PIECE_PROGRAMS_ENV)
        else:
            monkeypatch.setenv(PIECE_PROGRAMS_ENV, programs)
        assert torch.equal(run(), plain), programs
    scratch = reserve_split_scratch("cuda", rows, NH, MP, D)
    assert torch.equal(run(scratch), plain)


@cuda
@pytest.mark.parametrize("parts", ["8", "32"])
def test_program_partials_keep_a_row_the_same_alone_and_batched(monkeypatch, parts):
    """BATON_ATTN_PROGRAM_PARTIALS=N (baton/kernels/attention_loop.py, "Program partials"): each program merges
    its pieces, N partials a (row, head). At the 9B attention shape over a 64-piece window in shuffled pages,
    each group's rows are bitwise the same rows computed alone (any batch, padding groups included), rows of at
    most N pieces are bitwise one program a piece, and the rest are within fp32 rounding of it."""
    from baton.kernels import attention as A
    from baton.kernels.attention_loop import PIECE_PROGRAMS_ENV
    from baton.kernels.split_scratch import PARTIALS_ENV, reserve_split_scratch

    kp, vp, tab, slots, pos, q, gate = _case(1)
    gs, rows, SP = GS, pos.numel(), A.ATTN_SPLIT
    monkeypatch.setenv(PIECE_PROGRAMS_ENV, "0")  # one program a piece: the reference
    plain = A.attention_rows(q, kp, vp, pos, gate, gs, table=tab, slots=slots, gs=gs)
    monkeypatch.delenv(PIECE_PROGRAMS_ENV)
    monkeypatch.setenv(PARTIALS_ENV, parts)
    scratch = reserve_split_scratch("cuda", rows, NH, int(parts), D)
    out = A.attention_rows(q, kp, vp, pos, gate, gs, table=tab, slots=slots, gs=gs, scratch=scratch)
    torch.cuda.synchronize()
    assert torch.allclose(out.float(), plain.float(), rtol=2e-2, atol=2e-2)
    for gi, s in enumerate(slots.tolist()):
        r = slice(gi * gs, (gi + 1) * gs)
        if s < 0:
            assert bool((out[r] == 0).all())
            continue
        alone = A.attention_rows(q[r].contiguous(), kp, vp, pos[r], gate[r], gs, table=tab[s : s + 1])
        assert torch.equal(alone, out[r]), (gi, ENDS[gi])
        if ENDS[gi] // SP + 2 <= int(parts):  # both rows within N pieces: one piece a program
            assert torch.equal(out[r], plain[r]), (gi, ENDS[gi])
