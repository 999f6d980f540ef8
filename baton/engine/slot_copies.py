"""Snapshot / restore of many slots' O(1) state as one captured graph a bucket (CUDA), not ~100 launches.

    copies = SlotCopies(state, top)      static slot-index buffers, one per bucket <= top (BUCKETS)
    copies.capture(pool)                 CUDA: one graph per (bucket, direction), into the runner's pool
    copies.run(slots, restore)           state.snapshot_slots / restore_slots of these distinct slots

HybridState.snapshot_slots copies each O(1) tensor (24 GDN conv + 24 recurrent tensors, position,
next_token, hidden at the 9B shape) with an index_select and an index_copy_: ~100 launches a call, each
a few microseconds of the host plus allocator work. Exact mode calls it twice a Verify batch (the snapshot
before the blocks' pass, the restore of the cut blocks) and twice a bf16 / fp8 Draft batch; on the H100 the
Verify batch of 8 sessions spent ~4 ms of its host time there (benchmarks/results/gpu-h100-2026-12-06-
tests-ops.md). Replaying a graph makes it one launch.

The copies themselves: on CUDA each row is read and written once in place (baton/kernels/copy_rows.py),
where index_select + index_copy_ moved it through a temporary (twice the bytes): on the H100 the rewind of
a Verify batch (snapshot and restore of its slots, bench_exact_passes rewind_ms) was 2.4 ms of device
time at 8 sessions and 5.6 ms at 32 that way, graph or not (2.7 / 5.9 ms as eager launches).

Padding: a call of n slots runs the bucket p >= n with the slot list padded by its last slot. A duplicate
index copies the same source row to the same destination row again, so the result is bitwise the unpadded
copy (the copies do no arithmetic). More than the top bucket: in chunks of the top bucket.

Without graphs (CPU, or before capture) `run` executes the same padded copies eagerly, so the padding is
tested on the CPU (tests/engine/test_state.py; with copy_rows under Triton's interpreter,
tests/engine/test_copy_rows.py).

Lifecycle: built by HybridState.enable_slot_copies (graph.capture_all, after the model's graphs), captured
once; the buffers it reads (the state's tensors, the snapshot set, its index buffers) never move.
"""

from __future__ import annotations

import torch

from baton.engine import nogil
from baton.engine.fused_batch import BUCKETS


class SlotCopies:
    def __init__(self, state, top: int):
        self.state = state
        top = max(1, min(top, BUCKETS[-1]))
        self.buckets = [p for p in BUCKETS if p <= top]  # top >= 1 = BUCKETS[0]
        if self.buckets[-1] < top:
            self.buckets.append(next(p for p in BUCKETS if p >= top))
        with torch.inference_mode(False):  # built under capture_all's inference mode; written outside it
            self.idx = {p: torch.zeros(p, dtype=torch.long, device=state.device) for p in self.buckets}
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.copy = None  # CUDA: each row copied in place once (baton/kernels/copy_rows.py), no temporary
        if state.device.type == "cuda":
            from baton.kernels.copy_rows import copy_rows

            self.copy = copy_rows
        self.replays = 0  # graph replays (stats, tests)

    def capture(self, pool) -> int:
        """One graph per (bucket, direction) into `pool` (idx all 0: the warm-up and the prime copy slot 0
        onto itself through the snapshot set; capture_all zeroes every slot after). -> graphs captured."""
        dev = self.state.device
        side = torch.cuda.Stream(device=dev)
        for p in self.buckets:
            for restore in (False, True):
                side.wait_stream(torch.cuda.current_stream(dev))
                with torch.cuda.stream(side):
                    self.state.copy_slots(self.idx[p], restore, self.copy)
                torch.cuda.current_stream(dev).wait_stream(side)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    self.state.copy_slots(self.idx[p], restore, self.copy)
                g.replay()
                self.graphs[(p, restore)] = g
        return len(self.graphs)

    def run(self, slots: list[int], restore: bool) -> None:
        """The copies of distinct `slots` (snapshot: state -> snapshot set; restore: back)."""
        top = self.buckets[-1]
        for a in range(0, len(slots), top):
            chunk = slots[a : a + top]
            p = next(b for b in self.buckets if b >= len(chunk))
            padded = chunk + [chunk[-1]] * (p - len(chunk))
            idx = self.idx[p]
            if idx.is_cuda:  # one pinned upload; the caching host allocator keeps it until the copy ran
                idx.copy_(torch.tensor(padded, dtype=torch.long, pin_memory=True), non_blocking=True)
            else:
                idx.copy_(torch.tensor(padded, dtype=torch.long))
            g = self.graphs.get((p, restore))
            if g is not None:
                nogil.replay(g)  # holding the GIL, as the passes' replays (baton/engine/nogil.py)
                self.replays += 1
            else:
                self.state.copy_slots(idx, restore, self.copy)
