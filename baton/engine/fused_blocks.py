"""BatchedRows: rows blocks of many sessions of a fused (CUDA) runner in one pass (issue 21's batched
verify: B x (K+1) rows), in one captured graph per (bucket, rows per block).

    run([(slot, tokens), ...], hidden_out)  -> each block's picks: every block as ModelRunner.rows(slot,
                     tokens) alone leaves its slot (position + n, KV rows, GDN state, hidden; next_token
                     untouched), bitwise. Blocks of one length share a pass; each length is its own pass.
    compute(p, n)    the tensor code of p groups of n rows (what graph.capture_all captures as
                     ("rowsb", (p, n)): greedy, and ("rowsbs", (p, n)): each row picked by its slot's
                     sampling parameters on the device)

A pass of G blocks of n rows runs in the smallest bucket P >= G (fused_batch.BUCKETS) whose P x n rows fit
MAX_ROWS; groups G..P-1 are padding (slot -1): they read no slot state and write nothing. The slot of
every group is a device input, so one graph per (P, n) serves any set of sessions.

Why a block's bits do not depend on the batch: the same argument as the batched AR step
(baton/engine/fused_batch.py), with groups of gs = n rows instead of one: the GEMMs run one config for
every M (a row's K order is the one-slot step's), the norms / RoPE / gates / the pick are per row, the
GDN conv and delta rule of a group run over its own n rows against its own slot's state (row t of the
block from rows <= t, as in the one-slot step), and each row's attention reduces over its own slot's
keys up to its own position in fixed 256-key pieces. Tested on CPU through Triton's interpreter
(tests/engine/test_fused_blocks.py) and on the GPU (tests/engine/test_gpu_verify.py).

Row checkpoints (ModelRunner(checkpoints=True)) are not written for several groups: callers cutting a
block (speculation.verify_blocks) snapshot each slot first and recompute the kept rows, as the eager
batched path does.

Lifecycle: built by ModelRunner.enable_batching with BatchedAR (buffers allocated once, never replaced,
so captured graphs stay valid); used under the engine's compute lock through ModelRunner.rows_batch. The
caller checks each block's window and reserves its KV pages (batch.check_groups).
"""

from __future__ import annotations

import torch

from baton.engine.fused_batch import BUCKETS
from baton.kernels import rows as rk

MAX_ROWS = 256  # rows of one pass (P x n): bounds the logits buffer ([MAX_ROWS, vocab]) and the graphs


class BatchedRows:
    def __init__(self, runner, max_groups: int):
        self.runner = runner
        self.max_groups = min(max_groups, BUCKETS[-1])
        dev, H = runner.device, runner.cfg.hidden_size
        self.slots = torch.full((BUCKETS[-1],), -1, dtype=torch.long, device=dev)  # [P] group -> slot
        self.ids = torch.zeros(MAX_ROWS, dtype=torch.long, device=dev)  # [P*n] the blocks' tokens
        self.tok = torch.zeros(MAX_ROWS, dtype=torch.long, device=dev)  # [P*n] each row's pick
        self.h = torch.zeros(MAX_ROWS, H, dtype=runner.dtype, device=dev)  # [P*n] final-normed hidden
        self.arange = torch.arange(MAX_ROWS, device=dev)
        pin = dev.type == "cuda"
        self._host_ids = torch.zeros(MAX_ROWS, dtype=torch.long, pin_memory=pin)
        self._host_slots = torch.full((BUCKETS[-1],), -1, dtype=torch.long, pin_memory=pin)

    def buckets(self, n: int) -> list[int]:
        """The buckets of a pass of blocks of n rows: P <= the bucket of max_groups, P x n <= MAX_ROWS."""
        top = next(p for p in BUCKETS if p >= self.max_groups)
        return [p for p in BUCKETS if p <= top and p * n <= MAX_ROWS]

    def pad(self, p: int) -> None:
        """Every group of the first p padding (capture: a warm-up that writes no slot)."""
        self.slots[:p].fill_(-1)

    def compute(self, p: int, n: int, live: tuple[int, ...] = (), sampled: bool = False) -> None:
        """slots[:p], ids[:p*n] -> tok[:p*n], h[:p*n]; commits each live group into its slot
        (rk.blocks_commit). Row r of group g picks the token at position[slot] + r + 1. Captured greedy
        (argmax, "rowsb") or with sampled=True ("rowsbs": SamplingTable.pick's full path on the device);
        eager: the same pick with its host shortcuts (`live` = the pass's slots)."""
        r = self.runner
        st, M = r.state, p * n
        idx = self.slots[:p]  # [p]
        row_slot = idx.repeat_interleave(n)  # [M]
        within = self.arange[:M] % n  # [M] each row's index in its block
        pos = st.position[row_slot.clamp(min=0)] + within  # [M] the position each row consumes
        ids = self.ids[:M]
        h = r.fast.forward(ids, st, idx, n, pos, None, gs=n)  # [M, hidden]
        logits = r.fast.head(h, rows=M)  # [M, vocab]
        if logits.is_cuda and torch.cuda.is_current_stream_capturing() and not sampled:
            tok = logits.argmax(-1)
        else:  # padding rows pick with the table's greedy scratch slot
            smp = r.sampling
            rows = torch.where(row_slot < 0, smp.scratch, row_slot)
            smp.history.record(rows, pos, ids)  # as BatchedAR: a penalized slot is never plain
            tok = smp.pick(logits, rows, within, pos + 1, live, full=sampled)
        self.tok[:M].copy_(tok)
        self.h[:M].copy_(h)
        rk.blocks_commit(idx, n, self.h[:M], st.position, st.hidden)

    @torch.inference_mode()
    def _pass(self, blocks: list[tuple[int, list[int]]], n: int) -> list[list[int]]:
        """One pass of blocks of n rows each (at most a bucket's worth) -> each block's picks."""
        g = len(blocks)
        p = next(b for b in self.buckets(n) if b >= g)
        hs, hi = self._host_slots, self._host_ids
        hs[:g] = torch.tensor([s for s, _ in blocks], dtype=torch.long)
        hs[g:p] = -1
        hi[: g * n] = torch.tensor([t for _, toks in blocks for t in toks], dtype=torch.long)
        hi[g * n : p * n] = 0
        self.slots[:p].copy_(hs[:p], non_blocking=True)
        self.ids[: p * n].copy_(hi[: p * n], non_blocking=True)
        slots = [s for s, _ in blocks]
        smp, graphs = self.runner.sampling, self.runner.graphs
        if all(smp.plain(s) for s in slots):
            graph = graphs.get(("rowsb", (p, n)))
        else:  # sampling / logprobs: the sampled graph, unless a slot keeps rejection-policy host records
            graph = graphs.get(("rowsbs", (p, n))) if all(smp.in_graph(s) for s in slots) else None
        if graph is not None:
            graph.replay()
        else:
            self.compute(p, n, tuple(slots))
        toks = self.tok[: g * n].tolist()  # the one host sync of the pass
        return [toks[i * n : (i + 1) * n] for i in range(g)]

    def run(self, blocks: list[tuple[int, list[int]]], hidden_out: list | None = None) -> list[list[int]]:
        """blocks [(slot, tokens)] of distinct slots, validated (batch.check_groups) -> each block's
        picks, in order. hidden_out gets each block's final-normed hidden rows [n, hidden] (copies)."""
        out: list = [None] * len(blocks)
        hid: list = [None] * len(blocks)
        by_n: dict[int, list[int]] = {}
        for i, (_, toks) in enumerate(blocks):
            by_n.setdefault(len(toks), []).append(i)
        for n, idx in by_n.items():
            step = self.buckets(n)[-1]
            for c in range(0, len(idx), step):
                part = idx[c : c + step]
                picks = self._pass([blocks[i] for i in part], n)
                for j, i in enumerate(part):
                    out[i] = picks[j]
                    if hidden_out is not None:
                        hid[i] = self.h[j * n : (j + 1) * n].clone()
        if hidden_out is not None:
            hidden_out.extend(hid)
        return out
