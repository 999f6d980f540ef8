"""The compiled sort-free pick (baton/kernels/pick.py) on the H200, at Qwen3.5's vocabulary: its tokens equal
the torch sampler's on the CPU (the same cuts; the CUDA and CPU logs can differ in the last bit, which moves a
token only at a near-tie of z + g, rare at these sizes: the rows here have none), a row's token does not
depend on the batch, and the kernel runs inside a CUDA graph. (Under Triton's interpreter:
tests/engine/test_pick_kernel.py.)"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
def test_compiled_pick_equals_the_cpu_sampler_and_is_row_invariant():
    from baton.engine.sampling import Params, SamplingTable, sample
    from baton.kernels import pick as pk

    V, R = 248320, 8
    cases = [
        Params(temperature=0.8, seed=1),
        Params(temperature=0.8, top_p=0.9, seed=2),
        Params(temperature=1.0, top_p=0.2, seed=3),
        Params(temperature=1.0, top_k=50, seed=4),
        Params(temperature=0.7, min_p=0.1, seed=5),
        Params(temperature=1.2, top_k=2000, top_p=0.7, min_p=0.001, seed=2**50 + 6),
        Params(),
    ]
    S = len(cases)
    tables = {d: SamplingTable(S, d, 16, max_len=64) for d in ("cpu", "cuda")}
    for t in tables.values():
        for s, p in enumerate(cases):
            t.set(s, p)
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(S * R, V, generator=g) * 3).to(torch.bfloat16)  # bf16: exact ties, as a model's
    logits[R : 2 * R, :40] += 12  # a peaked row: a small nucleus
    slots = torch.arange(S).repeat_interleave(R)
    positions = torch.arange(500, 500 + R).repeat(S)
    ref = sample(logits.float(), slots, positions, tables["cpu"], width=16)[0]
    lg, sl, ps = logits.cuda(), slots.cuda(), positions.cuda()
    got = sample(lg, sl, ps, tables["cuda"])[0]
    assert got.cpu().tolist() == ref.tolist()
    raw = pk.pick(lg, sl, ps, tables["cuda"])
    alone = torch.stack([pk.pick(lg[i : i + 1], sl[i : i + 1], ps[i : i + 1], tables["cuda"])[0] for i in range(S * R)])
    assert torch.equal(alone, raw)
    perm = torch.randperm(S * R, generator=g).cuda()
    assert torch.equal(pk.pick(lg[perm], sl[perm], ps[perm], tables["cuda"]), raw[perm])
    # a staircase (top-p 0.001 keeps token 0 alone; each lower group ~4x the mass of those above it): most
    # rows take more candidates than the launched checks, and finish in the last kernel's own loop
    stair = torch.full((6, V), -10.0)
    stair[:, 0], stair[:, 1:5], stair[:, 5:21], stair[:, 21:85], stair[:, 85:341] = 10.0, 9.9, 9.8, 9.7, 9.6
    t1 = SamplingTable(1, "cuda", 16, max_len=64)
    t1.set(0, Params(temperature=1.0, top_p=0.001, seed=77))
    z6 = torch.zeros(6, dtype=torch.long, device="cuda")
    assert pk.pick(stair.cuda(), z6, torch.arange(6, device="cuda"), t1).tolist() == [0] * 6
    graph, out = torch.cuda.CUDAGraph(), torch.empty_like(raw)
    with torch.cuda.graph(graph):
        out.copy_(pk.pick(lg, sl, ps, tables["cuda"]))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, raw)
