"""BatchedRows: rows blocks of many sessions of a fused (CUDA) runner in one pass (issue 21's batched
verify: B x (K+1) rows), in one captured graph per (bucket, rows per block).

    run([(slot, tokens), ...], hidden_out)  -> each block's picks: every block as ModelRunner.rows(slot,
                     tokens) alone leaves its slot (position + n, KV rows, GDN state, hidden; next_token
                     untouched), bitwise. Blocks of one length share a pass; each length is its own pass.
    compute(p, n)    the tensor code of p groups of n rows (what graph.capture_all captures as
                     ("rowsb", (p, n)): greedy, and ("rowsbs", (p, n)): each row picked by its slot's
                     sampling parameters on the device)
    mtp([(slot, h [n, H], ids, start), ...])  -> each group's MTP drafts [n] and normed outputs [n, H]:
                     the MTP head over each session's pairs (KV indexes start..start+n-1), every group as
                     ModelRunner.compute_mtp alone (MTP KV rows written; nothing else of the slot changes)
    mtp_compute(p, n)  its tensor code ("mtpb", (p, n)) / ("mtpbs", (p, n)))

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
        self.start = torch.zeros(BUCKETS[-1], dtype=torch.long, device=dev)  # [P] MTP KV index of each group
        self.mtp_h = torch.zeros(MAX_ROWS, H, dtype=runner.dtype, device=dev)  # [P*n] MTP hidden inputs
        pin = dev.type == "cuda"
        self._host_ids = torch.zeros(MAX_ROWS, dtype=torch.long, pin_memory=pin)
        self._host_slots = torch.full((BUCKETS[-1],), -1, dtype=torch.long, pin_memory=pin)
        self._host_start = torch.zeros(BUCKETS[-1], dtype=torch.long, pin_memory=pin)

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

    def mtp_compute(self, p: int, n: int, live: tuple[int, ...] = (), sampled: bool = False) -> None:
        """slots[:p], start[:p], mtp_h / ids[:p*n] -> tok[:p*n] (drafts), h[:p*n] (normed MTP outputs);
        writes each live group's MTP KV rows start..start+n-1. Row r of group g is pair start + r: its
        draft is picked as the exact model would pick the token at position start + r + 2, with the
        slot's sampling row (as ModelRunner.compute_mtp). Captured as ("mtpb", (p, n)) / ("mtpbs", ...)."""
        r = self.runner
        M = p * n
        idx = self.slots[:p]
        row_slot = idx.repeat_interleave(n)  # [M]
        within = self.arange[:M] % n
        pos = self.start[:p].repeat_interleave(n) + within  # [M] KV index of each pair
        ids = self.ids[:M]
        out = r.fast.mtp(self.mtp_h[:M], ids, r.state, idx, n, pos, gs=n)  # [M, hidden]
        logits = r.fast.head(out, rows=M)
        if logits.is_cuda and torch.cuda.is_current_stream_capturing() and not sampled:
            tok = logits.argmax(-1)
        else:
            smp = r.sampling
            rows = torch.where(row_slot < 0, smp.scratch, row_slot)
            smp.history.record(rows, pos + 1, ids)  # pair t's token is at t + 1 (as compute_mtp)
            tok = smp.pick(logits, rows, within, pos + 2, live, full=sampled)
        self.tok[:M].copy_(tok)
        self.h[:M].copy_(out)

    def _load(self, slots: list[int], ids: list[int], p: int, n: int, starts: list[int] | None = None) -> None:
        """A pass's inputs to the device: slots [g] (padding to p), ids [g*n] (zeros to p*n), MTP starts."""
        g = len(slots)
        hs, hi = self._host_slots, self._host_ids
        hs[:g] = torch.tensor(slots, dtype=torch.long)
        hs[g:p] = -1
        hi[: g * n] = torch.tensor(ids, dtype=torch.long)
        hi[g * n : p * n] = 0
        self.slots[:p].copy_(hs[:p], non_blocking=True)
        self.ids[: p * n].copy_(hi[: p * n], non_blocking=True)
        if starts is not None:
            self._host_start[:g] = torch.tensor(starts, dtype=torch.long)
            self._host_start[g:p] = 0
            self.start[:p].copy_(self._host_start[:p], non_blocking=True)

    def _launch(self, kind: str, slots: list[int], p: int, n: int, compute) -> None:
        """Replays the captured graph of the pass ((kind, (p, n)) when every slot is plain greedy, its
        sampled twin kind + "s" when a slot samples or asks for logprobs, none when a slot keeps
        rejection-policy host records or the graph is missing: then compute(p, n, slots) eagerly)."""
        smp, graphs = self.runner.sampling, self.runner.graphs
        if all(smp.plain(s) for s in slots):
            graph = graphs.get((kind, (p, n)))
        else:
            graph = graphs.get((kind + "s", (p, n))) if all(smp.in_graph(s) for s in slots) else None
        if graph is not None:
            graph.replay()
        else:
            compute(p, n, tuple(slots))

    def _bucket(self, g: int, n: int) -> int:
        return next(b for b in self.buckets(n) if b >= g)

    @torch.inference_mode()
    def _pass(self, blocks: list[tuple[int, list[int]]], n: int) -> list[list[int]]:
        """One pass of blocks of n rows each (at most a bucket's worth) -> each block's picks."""
        g, slots = len(blocks), [s for s, _ in blocks]
        p = self._bucket(g, n)
        self._load(slots, [t for _, toks in blocks for t in toks], p, n)
        self._launch("rowsb", slots, p, n, self.compute)
        toks = self.tok[: g * n].tolist()  # the one host sync of the pass
        return [toks[i * n : (i + 1) * n] for i in range(g)]

    @torch.inference_mode()
    def _mtp_pass(self, groups: list, n: int) -> list[list[int]]:
        g, slots = len(groups), [int(x[0]) for x in groups]
        p = self._bucket(g, n)
        self._load(slots, [int(t) for x in groups for t in x[2]], p, n, [int(x[3]) for x in groups])
        for j, x in enumerate(groups):
            self.mtp_h[j * n : (j + 1) * n].copy_(x[1])
        self._launch("mtpb", slots, p, n, self.mtp_compute)
        toks = self.tok[: g * n].tolist()
        return [toks[i * n : (i + 1) * n] for i in range(g)]

    def _by_length(self, items: list, length, one_pass, keep: list | None) -> list:
        """Runs items in passes of equal length (length(item) = n), each at most a bucket -> each item's
        picks, in order; keep (a list) gets each item's h rows [n, H] (copies), in order."""
        out: list = [None] * len(items)
        hid: list = [None] * len(items)
        by_n: dict[int, list[int]] = {}
        for i, x in enumerate(items):
            by_n.setdefault(length(x), []).append(i)
        for n, idx in by_n.items():
            step = self.buckets(n)[-1]
            for c in range(0, len(idx), step):
                part = idx[c : c + step]
                picks = one_pass([items[i] for i in part], n)
                for j, i in enumerate(part):
                    out[i] = picks[j]
                    if keep is not None:
                        hid[i] = self.h[j * n : (j + 1) * n].clone()
        if keep is not None:
            keep.extend(hid)
        return out

    def run(self, blocks: list[tuple[int, list[int]]], hidden_out: list | None = None) -> list[list[int]]:
        """blocks [(slot, tokens)] of distinct slots, validated (batch.check_groups) -> each block's
        picks, in order. hidden_out gets each block's final-normed hidden rows [n, hidden] (copies)."""
        return self._by_length(blocks, lambda b: len(b[1]), self._pass, hidden_out)

    def mtp(self, groups: list) -> tuple[list[list[int]], list[torch.Tensor]]:
        """groups [(slot, h [n, H], ids [n], start)] of distinct slots, 1 <= n <= W -> (each group's drafts
        [n], each group's normed outputs [n, H]), in order (see mtp_compute)."""
        outs: list[torch.Tensor] = []
        toks = self._by_length(groups, lambda x: len(x[2]), self._mtp_pass, outs)
        return toks, outs
