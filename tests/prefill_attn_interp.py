"""Runs baton/kernels/causal_fixed.py under Triton's interpreter (fp32) and prints a JSON verdict;
tests/engine/test_prefill_attention_fixed.py runs this in a subprocess with TRITON_INTERPRET=1.

A 300-token prompt (4 query heads over 2 kv heads): its attention computed whole, then cut into pieces at
every 64, 128 and 192 tokens (each piece's queries against its slot's keys so far, as a later prefill piece
reads them): every cut gives the whole call's rows bitwise; and the whole call is causal attention (against
a float64 reference). A cut off the kernel's 64-row blocks (every 100) is reported, not asserted."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import interp_shim  # noqa: E402,F401  (before torch/triton kernels are traced)
import launch_record  # noqa: E402  (records each launch: compiled for sm_90 at the end)
import torch  # noqa: E402

from baton.kernels.causal_fixed import causal_fixed  # noqa: E402

L, nh, nkv, d = 300, 4, 2, 16


def cut(q, k, v, every: int) -> torch.Tensor:
    """The prompt's attention in pieces of `every` rows, each against its keys [0, piece end)."""
    outs = []
    for s in range(0, L, every):
        e = min(L, s + every)
        outs.append(causal_fixed(q[s:e], k[:, :e], v[:, :e], s))
    return torch.cat(outs)


def main() -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(L, nh, d, generator=g)
    k = torch.randn(nkv, L, d, generator=g)
    v = torch.randn(nkv, L, d, generator=g)
    whole = causal_fixed(q, k, v, 0)
    out = {"cuts": {str(n): bool(torch.equal(cut(q, k, v, n), whole)) for n in (64, 128, 192)}}
    out["off_block_cut_equal"] = bool(torch.equal(cut(q, k, v, 100), whole))  # reported only
    kk, vv = (x.double().repeat_interleave(nh // nkv, dim=0)[None] for x in (k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(q.double().transpose(0, 1)[None], kk, vv, is_causal=True)
    ref = ref[0].transpose(0, 1).reshape(L, nh * d)
    out["max_err"] = float((whole.double() - ref).abs().max())
    big = torch.randn(64, 4, 256, generator=g)  # the 9B's head dim, compiled for sm_90 too
    kb, vb = torch.randn(2, 64, 256, generator=g), torch.randn(2, 64, 256, generator=g)
    out["d256_finite"] = bool(causal_fixed(big, kb, vb, 0).isfinite().all())
    out["compiles_sm90"] = launch_record.compile_verdict()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
