"""Runs the fused step's per-slot kernels batched and alone under Triton's interpreter (fp32) and prints
a JSON verdict; tests/engine/test_batch_kernels.py runs this in a subprocess with TRITON_INTERPRET=1.

A batch is G groups of gs rows, group g against slot slots[g] (-1: padding). Each live group must give,
bitwise, what the one-slot call gives for that slot alone (outputs and its slot's state), padding
groups must leave every slot untouched and produce zero rows, and slots outside the batch stay as they
were. The attention kernels read KV through a shuffled page table and must equal, bitwise, the
contiguous-window kernels they replaced (tests/attn_contig_ref.py). Ragged groups (lens: group g's
first lens[g] rows live) must give each group what the one-slot call of n = lens[g] gives."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import attn_contig_ref as REF  # noqa: E402  (the contiguous-window kernels before paging)
import interp_shim  # noqa: E402,F401  (before torch/triton kernels are traced)
import launch_record  # noqa: E402  (records each launch: compiled for sm_90 at the end)
import torch  # noqa: E402

from baton.kernels import attention as A  # noqa: E402
from baton.kernels import gdn as G  # noqa: E402
from baton.kernels import gdn_conv as GC  # noqa: E402
from baton.kernels import rows as R  # noqa: E402
from baton.kernels.attention_loop import PIECE_PROGRAMS_ENV  # noqa: E402
from baton.kernels.split_scratch import PARTIALS_ENV  # noqa: E402

S, KW, nk, Hv, dk, dv = 5, 4, 2, 4, 16, 32
C = 2 * nk * dk + Hv * dv  # conv channels: q | k | v
nh, nkv, d, L, rd = 4, 2, 16, 512, 8
SP = A.ATTN_SPLIT  # keys per page


def gdn_case(slots: list[int], gs: int, seed: int, lens: list[int] | None = None) -> dict:
    """lens: ragged groups (group g's first lens[g] rows live), each against the one-slot call of n = lens[g]."""
    g = torch.Generator().manual_seed(seed)
    ln = None if lens is None else torch.tensor(lens, dtype=torch.long)
    P = len(slots) * gs
    conv0 = torch.randn(S, C, KW - 1, generator=g)
    rec0 = torch.randn(S, Hv, dk, dv, generator=g) * 0.1
    x = torch.randn(P, C, generator=g)
    w = torch.randn(C, KW, generator=g)
    b, a, z = torch.randn(P, Hv, generator=g), torch.randn(P, Hv, generator=g), torch.randn(P, Hv * dv, generator=g)
    A_log, dtb, nw = torch.randn(Hv, generator=g) * 0.5, torch.randn(Hv, generator=g) * 0.5, torch.randn(dv) + 1
    sl = torch.tensor(slots, dtype=torch.long)
    conv, rec = conv0.clone(), rec0.clone()
    cv = GC.conv_rows(x, conv, w, gs, slots=sl, gs=gs, lens=ln)
    y = G.gdn_rows(cv, b, a, z, A_log, dtb, nw, rec, gs, nk=nk, eps=1e-6, slots=sl, gs=gs, lens=ln)
    ok = True
    for gi, s in enumerate(slots):
        rows = slice(gi * gs, (gi + 1) * gs)
        if s < 0:
            ok &= bool((y[rows] == 0).all())
            continue
        n = gs if lens is None else lens[gi]
        c1, r1 = conv0[s].clone(), rec0[s].clone()
        cv1 = GC.conv_rows(x[rows], c1, w, n)
        y1 = G.gdn_rows(cv1, b[rows], a[rows], z[rows], A_log, dtb, nw, r1, n, nk=nk, eps=1e-6)
        ok &= torch.equal(y1, y[rows]) and torch.equal(cv1[:n], cv[rows][:n])
        ok &= torch.equal(c1, conv[s]) and torch.equal(r1, rec[s])
    for s in set(range(S)) - set(slots):
        ok &= torch.equal(conv[s], conv0[s]) and torch.equal(rec[s], rec0[s])
    return {"equal": bool(ok)}


def _to_pages(win: torch.Tensor, tab: torch.Tensor, pages: int, g) -> torch.Tensor:
    """Windows [S, nkv, L, d] -> a pool [pages, nkv, SPLIT, d] holding slot s's piece j in page tab[s, j]
    (the pages no slot owns: random junk)."""
    pool = torch.randn(pages, nkv, SP, d, generator=g)
    for s in range(win.shape[0]):
        for j in range(tab.shape[1]):
            pool[tab[s, j]] = win[s, :, j * SP : (j + 1) * SP]
    return pool


def _windows(pool: torch.Tensor, tab: torch.Tensor) -> torch.Tensor:
    """The pool read back through the table as windows [S, nkv, L, d]."""
    return torch.stack([torch.cat([pool[p] for p in row.tolist()], dim=1) for row in tab])


def attn_case(slots: list[int], gs: int, seed: int, lens: list[int] | None = None) -> dict:
    """Paged (a shuffled, non-identity page table with spare pages) == the contiguous window kernels
    (tests/attn_contig_ref.py, the pre-paging attention.py) bitwise, batched == each slot alone bitwise."""
    g = torch.Generator().manual_seed(seed)
    P = len(slots) * gs
    MP, spare = L // SP, 3
    kc0, vc0 = torch.randn(S, nkv, L, d, generator=g), torch.randn(S, nkv, L, d, generator=g)
    tab = torch.randperm(S * MP + spare, generator=g)[: S * MP].reshape(S, MP).to(torch.int32)
    kp0, vp0 = _to_pages(kc0, tab, S * MP + spare, g), _to_pages(vc0, tab, S * MP + spare, g)
    base = torch.randint(0, L - gs, (len(slots),), generator=g)  # each group's first position
    pos = (base[:, None] + torch.arange(gs)[None, :]).reshape(P)
    q, k, v = (
        torch.randn(P, nh, d, generator=g),
        torch.randn(P, nkv, d, generator=g),
        torch.randn(P, nkv, d, generator=g),
    )
    gate = torch.randn(P, nh, d, generator=g)
    wq, wk = torch.randn(d, generator=g) * 0.1, torch.randn(d, generator=g) * 0.1
    cos, sin = torch.randn(L + 1, rd, generator=g), torch.randn(L + 1, rd, generator=g)
    sl = torch.tensor(slots, dtype=torch.long)
    kp, vp = kp0.clone(), vp0.clone()
    ln = None if lens is None else torch.tensor(lens, dtype=torch.long)
    qo = A.qk_rope_kv(q, k, v, wq, wk, cos, sin, pos, kp, vp, gs, 1e-6, table=tab, slots=sl, gs=gs, lens=ln)
    o = A.attention_rows(qo, kp, vp, pos, gate, gs, table=tab, slots=sl, gs=gs, lens=ln)
    looped = True  # the partials from 1, 2 or one program a piece ("0") a (row, head) (attention_loop.py)
    for programs in ("1", "2", "0"):
        os.environ[PIECE_PROGRAMS_ENV] = programs
        try:
            ol = A.attention_rows(qo, kp, vp, pos, gate, gs, table=tab, slots=sl, gs=gs, lens=ln)
        finally:
            del os.environ[PIECE_PROGRAMS_ENV]
        looped &= torch.equal(ol, o)
    carried = True  # program partials (BATON_ATTN_PROGRAM_PARTIALS=N): N = 2 (the window's pieces, one a program)
    # is `o` bitwise; N = 1 merges a row's pieces in its program: each group's rows are the one-slot call's
    # bitwise (batch invariance holds for a fixed N), and close to `o`
    for parts in ("2", "1"):
        os.environ[PARTIALS_ENV] = parts
        try:
            oc = A.attention_rows(qo, kp, vp, pos, gate, gs, table=tab, slots=sl, gs=gs, lens=ln)
            carried &= torch.equal(oc, o) if parts == "2" else torch.allclose(oc, o, rtol=1e-5, atol=1e-6)
            for gi, s in enumerate(slots if parts == "1" else []):
                rows = slice(gi * gs, (gi + 1) * gs)
                n1 = gs if lens is None else lens[gi]
                if s >= 0:
                    o1 = A.attention_rows(
                        qo[rows].contiguous(), kp, vp, pos[rows], gate[rows], n1, table=tab[s : s + 1]
                    )
                    carried &= torch.equal(o1, oc[rows])
        finally:
            del os.environ[PARTIALS_ENV]
    if lens is not None:  # ragged: each live group against the one-slot call of n = lens[g] (no reference)
        ok = True
        for gi, s in enumerate(slots):
            rows = slice(gi * gs, (gi + 1) * gs)
            if s < 0:
                ok &= bool((o[rows] == 0).all())
                continue
            k1, v1 = kp0.clone(), vp0.clone()
            args = (wq, wk, cos, sin, pos[rows], k1, v1, lens[gi], 1e-6)
            q1 = A.qk_rope_kv(q[rows], k[rows], v[rows], *args, table=tab[s : s + 1])
            o1 = A.attention_rows(q1, k1, v1, pos[rows], gate[rows], lens[gi], table=tab[s : s + 1])
            ok &= torch.equal(o1, o[rows]) and torch.equal(q1, qo[rows])
            for p in tab[s].tolist():  # this slot's pages: the same KV rows written
                ok &= torch.equal(k1[p], kp[p]) and torch.equal(v1[p], vp[p])
        return {"equal": bool(ok), "looped_equals": bool(looped), "carried": bool(carried)}
    kc, vc = kc0.clone(), vc0.clone()  # the contiguous reference, batched
    qr = REF.qk_rope_kv(q, k, v, wq, wk, cos, sin, pos, kc, vc, gs, 1e-6, slots=sl, gs=gs)
    orf = REF.attention_rows(qr, kc, vc, pos, gate, gs, slots=sl, gs=gs)
    paged = torch.equal(o, orf) and torch.equal(qo, qr)
    paged &= torch.equal(_windows(kp, tab), kc) and torch.equal(_windows(vp, tab), vc)
    owned = set(tab.flatten().tolist())
    for p in set(range(kp.shape[0])) - owned:  # pages of no slot: untouched
        paged &= torch.equal(kp[p], kp0[p]) and torch.equal(vp[p], vp0[p])
    ok = True
    for gi, s in enumerate(slots):
        rows = slice(gi * gs, (gi + 1) * gs)
        if s < 0:
            ok &= bool((o[rows] == 0).all())
            continue
        k1, v1 = kp0.clone(), vp0.clone()  # alone: the same pool, the slot's own table row
        q1 = A.qk_rope_kv(
            q[rows], k[rows], v[rows], wq, wk, cos, sin, pos[rows], k1, v1, gs, 1e-6, table=tab[s : s + 1]
        )
        o1 = A.attention_rows(q1, k1, v1, pos[rows], gate[rows], gs, table=tab[s : s + 1])
        ok &= torch.equal(o1, o[rows]) and torch.equal(q1, qo[rows])
        ok &= torch.equal(_windows(k1, tab[s : s + 1]), kc[s : s + 1]) and torch.equal(
            _windows(v1, tab[s : s + 1]), vc[s : s + 1]
        )
        # alone with the identity table: the pool is the slot's window cut in pages, in order
        ki = kc0[s].reshape(nkv, MP, SP, d).transpose(0, 1).contiguous()
        vi = vc0[s].reshape(nkv, MP, SP, d).transpose(0, 1).contiguous()
        qi = A.qk_rope_kv(q[rows], k[rows], v[rows], wq, wk, cos, sin, pos[rows], ki, vi, gs, 1e-6)
        oi = A.attention_rows(qi, ki, vi, pos[rows], gate[rows], gs)
        kr, vr = kc0[s].clone(), vc0[s].clone()
        qr1 = REF.qk_rope_kv(q[rows], k[rows], v[rows], wq, wk, cos, sin, pos[rows], kr, vr, gs, 1e-6)
        or1 = REF.attention_rows(qr1, kr, vr, pos[rows], gate[rows], gs)
        paged &= torch.equal(oi, or1) and torch.equal(qi, qr1) and torch.equal(oi, o1)
        paged &= torch.equal(ki.transpose(0, 1).reshape(nkv, L, d), kr) and torch.equal(
            vi.transpose(0, 1).reshape(nkv, L, d), vr
        )
    for s in set(range(S)) - set(slots):
        ok &= torch.equal(kc[s], kc0[s]) and torch.equal(vc[s], vc0[s])
    out = {"equal": bool(ok), "paged_equals_contiguous": bool(paged), "looped_equals": bool(looped)}
    return out | {"carried": bool(carried)}


def commit_case() -> dict:
    slots = torch.tensor([3, -1, 0, -1])
    tok, h = torch.tensor([11, 12, 13, 14]), torch.randn(4, 40)
    nt, pos, hid = torch.zeros(S, dtype=torch.long), torch.arange(S) * 10, torch.zeros(S, 40)
    R.ar_commit(slots, tok, h, nt, pos, hid)
    ok = nt.tolist() == [13, 0, 0, 11, 0] and pos.tolist() == [1, 10, 20, 31, 40]
    ok &= torch.equal(hid[3], h[0]) and torch.equal(hid[0], h[2]) and bool((hid[[1, 2, 4]] == 0).all())
    return {"equal": bool(ok)}


def main() -> None:
    out = {}
    for name, slots, gs in (
        ("ar1", [2], 1),
        ("ar4", [3, -1, 0, 4], 1),
        ("ar8", [1, 4, 0, 2, 3, -1, -1, -1], 1),
        ("blocks", [4, -1, 1], 3),
    ):
        out[f"gdn_{name}"] = gdn_case(slots, gs, seed=len(slots) * 7 + gs)
        out[f"attn_{name}"] = attn_case(slots, gs, seed=len(slots) * 11 + gs)
    for name, slots, gs, lens in (("ragged", [4, -1, 1, 2], 3, [3, 0, 1, 2]), ("ragged1", [0, 3], 4, [1, 4])):
        out[f"gdn_{name}"] = gdn_case(slots, gs, seed=len(slots) * 5 + gs, lens=lens)
        out[f"attn_{name}"] = attn_case(slots, gs, seed=len(slots) * 13 + gs, lens=lens)
    out["commit"] = commit_case()
    out["compiles_sm90"] = launch_record.compile_verdict()  # every launch above, compiled for sm_90
    print(json.dumps(out))


if __name__ == "__main__":
    main()
