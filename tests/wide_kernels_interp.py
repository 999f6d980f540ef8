"""Run under TRITON_INTERPRET=1 (tests/engine/test_wide_kernels.py): baton/kernels/wide.py on CPU tensors,
fp32 (the interpreter does not model bf16 arithmetic; bf16 runs on the H200 in test_gpu_batch.py).
Prints one JSON verdict line: each check's result."""

import json

import torch

import tests.interp_shim  # noqa: F401  (first: the interpreter's numpy fix)
import tests.launch_record as launch_record  # records each launch: compiled for sm_90 at the end
from baton.kernels import wide
from baton.models import gdn_ops
from baton.models.context import PassIndex, Segment
from baton.models.qwen3_5 import GatedRMSNorm, RMSNorm

torch.manual_seed(0)
out = {}
K, N = 200, 300  # neither a multiple of the tiles: masked K and N edges
w = torch.randn(N, K) * 0.05
x = torch.randn(300, K)
full = wide.linear(x, w)
ref = x @ w.T
out["linear_close"] = bool(torch.allclose(full.float(), ref.float(), atol=1e-4, rtol=1e-4))
inv = True
for lo, hi in ((0, 1), (3, 8), (100, 231), (5, 300)):  # the same rows inside passes of other sizes
    inv &= bool(torch.equal(wide.linear(x[lo:hi], w), full[lo:hi]))
out["linear_row_invariant"] = inv
out["linear_shape"] = list(wide.linear(x[:6].view(2, 3, K), w).shape) == [2, 3, N]
# the same tiles through tensor descriptors (KERNEL "tma"): the pointer kernel's bits, inside passes of any size
wide.KERNEL = "tma"
assert wide._tma_ok(x, w, full)
tma = wide.linear(x, w)
inv = bool(torch.equal(tma, full))
for lo, hi in ((0, 1), (3, 8), (100, 231), (5, 300)):
    inv &= bool(torch.equal(wide.linear(x[lo:hi], w), full[lo:hi]))
wide.KERNEL = "tma_persistent"
wide.sm_count = lambda device: 4  # 4 programs walking the tiles (gemv.sm_count pretends an H200 on CPU)
inv &= bool(torch.equal(wide.linear(x, w), full))
for lo, hi in ((0, 1), (100, 231)):
    inv &= bool(torch.equal(wide.linear(x[lo:hi], w), full[lo:hi]))
out["linear_tma_equal"] = inv
# "auto" (the default): the tile and loads by M (wide.TILES) across its bounds, the same bits as one config
wide.KERNEL = "ptr"
xl = torch.randn(1100, K)
one = wide.linear(xl, w)
wide.KERNEL = "auto"
assert wide._config(100)[0] == "ptr" and wide._config(1100)[0] == "tma_persistent"
assert wide._config(1100, 4) == ("ptr", wide.BLOCK_M, wide.BLOCK_N, wide.NUM_WARPS, wide.NUM_STAGES)  # fp32
_config = wide._config
wide._config = lambda M, itemsize=2: _config(M)  # the bf16 table on the interpreter's fp32 tensors
inv = bool(torch.equal(wide.linear(xl, w), one))
for lo, hi in ((0, 100), (50, 600), (3, 1100)):
    inv &= bool(torch.equal(wide.linear(xl[lo:hi], w), one[lo:hi]))
wide._config = _config
out["linear_auto_equal"] = inv

h = torch.randn(37, 96)
nw = torch.randn(96) * 0.1
m = RMSNorm(96, 1e-6)
m.weight.data.copy_(nw)
y = wide.rmsnorm(h, nw, 1e-6, centred=True)
out["rmsnorm_close"] = bool(torch.allclose(y.float(), m(h).float(), atol=1e-4, rtol=1e-4))
out["rmsnorm_row_invariant"] = bool(torch.equal(wide.rmsnorm(h[7:9], nw, 1e-6), y[7:9]))
g = torch.randn(37, 96)
gm = GatedRMSNorm(96, 1e-6)
gm.weight.data.copy_(nw)
yg = wide.gated_rmsnorm(h, g, nw, 1e-6)
out["gated_close"] = bool(torch.allclose(yg.float(), gm(h, g).float(), atol=1e-4, rtol=1e-4))
out["gated_row_invariant"] = bool(torch.equal(wide.gated_rmsnorm(h[30:], g[30:], nw, 1e-6), yg[30:]))
l2 = wide.l2norm(h)
out["l2norm_close"] = bool(torch.allclose(l2, h * torch.rsqrt((h * h).sum(-1, keepdim=True) + 1e-6), atol=1e-5))

# the prefill's causal conv: segments of a pass, each from its slot's state (n < KW - 1 included), C not a
# multiple of the channel tile, a segment over several row tiles; against gdn_ops' torch path
C, KW, S = 40, 4, 5
cw = torch.randn(C, KW)
state0 = torch.randn(S, C, KW - 1)
shape = [(1, 0, 7), (3, 5, 2), (0, 9, 1), (4, 0, 40)]  # (slot, start, n)
segs, off = [], 0
for slot, start, n in shape:
    segs.append(Segment(slot, start, n, off))
    off += n
xc = torch.randn(off, C)
ref_state = state0.clone()
ref = gdn_ops.conv_segments(xc, ref_state, PassIndex(segs, "cpu"), cw)  # CPU tensors: the torch path
got_state = state0.clone()
got = wide.causal_conv(xc, got_state, cw, PassIndex(segs, "cpu"))
out["conv_close"] = bool(torch.allclose(got, ref, atol=1e-5, rtol=1e-5))
out["conv_state_equal"] = bool(torch.equal(got_state, ref_state))
inv = True
for sg in segs:  # each segment alone: the same bits, rows and state
    alone_state = state0.clone()
    alone = wide.causal_conv(
        xc[sg.off : sg.off + sg.n], alone_state, cw, PassIndex([Segment(sg.slot, sg.start, sg.n, 0)], "cpu")
    )
    inv &= bool(torch.equal(alone, got[sg.off : sg.off + sg.n]))
    inv &= bool(torch.equal(alone_state[sg.slot], got_state[sg.slot]))
out["conv_row_invariant"] = inv
out["compiles_sm90"] = launch_record.compile_verdict()  # every launch above, compiled for sm_90
print(json.dumps(out))
