"""Runs the fused step's per-slot kernels batched and alone under Triton's interpreter (fp32) and prints
a JSON verdict; tests/engine/test_batch_kernels.py runs this in a subprocess with TRITON_INTERPRET=1.

A batch is G groups of gs rows, group g against slot slots[g] (-1: padding). Each live group must give,
bitwise, what the one-slot call gives for that slot alone (outputs and its slot's state), padding
groups must leave every slot untouched and produce zero rows, and slots outside the batch stay as they
were."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import interp_shim  # noqa: E402,F401  (before torch/triton kernels are traced)
import torch  # noqa: E402

from baton.kernels import attention as A  # noqa: E402
from baton.kernels import gdn as G  # noqa: E402
from baton.kernels import rows as R  # noqa: E402

S, KW, nk, Hv, dk, dv = 5, 4, 2, 4, 16, 32
C = 2 * nk * dk + Hv * dv  # conv channels: q | k | v
nh, nkv, d, L, rd = 4, 2, 16, 512, 8


def gdn_case(slots: list[int], gs: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    P = len(slots) * gs
    conv0 = torch.randn(S, C, KW - 1, generator=g)
    rec0 = torch.randn(S, Hv, dk, dv, generator=g) * 0.1
    x = torch.randn(P, C, generator=g)
    w = torch.randn(C, KW, generator=g)
    b, a, z = torch.randn(P, Hv, generator=g), torch.randn(P, Hv, generator=g), torch.randn(P, Hv * dv, generator=g)
    A_log, dtb, nw = torch.randn(Hv, generator=g) * 0.5, torch.randn(Hv, generator=g) * 0.5, torch.randn(dv) + 1
    sl = torch.tensor(slots, dtype=torch.long)
    conv, rec = conv0.clone(), rec0.clone()
    cv = G.conv_rows(x, conv, w, gs, slots=sl, gs=gs)
    y = G.gdn_rows(cv, b, a, z, A_log, dtb, nw, rec, gs, nk=nk, eps=1e-6, slots=sl, gs=gs)
    ok = True
    for gi, s in enumerate(slots):
        rows = slice(gi * gs, (gi + 1) * gs)
        if s < 0:
            ok &= bool((y[rows] == 0).all())
            continue
        c1, r1 = conv0[s].clone(), rec0[s].clone()
        cv1 = G.conv_rows(x[rows], c1, w, gs)
        y1 = G.gdn_rows(cv1, b[rows], a[rows], z[rows], A_log, dtb, nw, r1, gs, nk=nk, eps=1e-6)
        ok &= torch.equal(y1, y[rows]) and torch.equal(cv1, cv[rows])
        ok &= torch.equal(c1, conv[s]) and torch.equal(r1, rec[s])
    for s in set(range(S)) - set(slots):
        ok &= torch.equal(conv[s], conv0[s]) and torch.equal(rec[s], rec0[s])
    return {"equal": bool(ok)}


def attn_case(slots: list[int], gs: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    P = len(slots) * gs
    kc0, vc0 = torch.randn(S, nkv, L, d, generator=g), torch.randn(S, nkv, L, d, generator=g)
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
    kc, vc = kc0.clone(), vc0.clone()
    qo = A.qk_rope_kv(q, k, v, wq, wk, cos, sin, pos, kc, vc, gs, 1e-6, slots=sl, gs=gs)
    o = A.attention_rows(qo, kc, vc, pos, gate, gs, slots=sl, gs=gs)
    ok = True
    for gi, s in enumerate(slots):
        rows = slice(gi * gs, (gi + 1) * gs)
        if s < 0:
            ok &= bool((o[rows] == 0).all())
            continue
        k1, v1 = kc0[s].clone(), vc0[s].clone()
        q1 = A.qk_rope_kv(q[rows], k[rows], v[rows], wq, wk, cos, sin, pos[rows], k1, v1, gs, 1e-6)
        o1 = A.attention_rows(q1, k1, v1, pos[rows], gate[rows], gs)
        ok &= torch.equal(o1, o[rows]) and torch.equal(q1, qo[rows])
        ok &= torch.equal(k1, kc[s]) and torch.equal(v1, vc[s])
    for s in set(range(S)) - set(slots):
        ok &= torch.equal(kc[s], kc0[s]) and torch.equal(vc[s], vc0[s])
    return {"equal": bool(ok)}


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
    out["commit"] = commit_case()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
