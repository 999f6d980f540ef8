"""BatchedRows: rows blocks of many sessions of a fused (CUDA) runner in one pass (issue 21's batched
verify: B x (K+1) rows, and the batched MTP chains), in one captured graph per (bucket, rows per group).

    run([(slot, tokens), ...], hidden_out)  -> each block's picks: every block as ModelRunner.rows(slot,
                     tokens) alone leaves its slot (position + len, KV rows, GDN state, hidden;
                     next_token untouched), bitwise. Blocks of any lengths share one pass.
    mtp([(slot, h [n, H], ids, start), ...])  -> each group's MTP drafts [n] and normed outputs [n, H]:
                     the MTP head over each session's pairs (KV indexes start..start+n-1), every group as
                     ModelRunner.compute_mtp alone (MTP KV rows written; nothing else of the slot changes)
    compute(p, n) / mtp_compute(p, n)   the tensor code of p groups of n rows each, the first lens[g] of
                     group g live (what graph.capture_all captures as ("rowsb", (p, n)) / ("mtpb", (p, n)):
                     greedy, and as "rowsbs" / "mtpbs": each row picked by its slot's sampling parameters)

A pass holds G groups of gs rows, gs = the longest group's length: group g's rows are [g*gs, g*gs + gs),
its first lens[g] live, the rest junk rows that write no state (the kernels' ragged groups: lens is a
device input) and whose picks are thrown away. It runs in the smallest bucket P >= G
(fused_batch.BUCKETS) whose P x gs rows fit MAX_ROWS; groups G..P-1 are padding (slot -1): they read no
slot state and write nothing. Slots and lengths are device inputs, so one graph per (P, gs) serves any
set of sessions and block lengths. Junk and padding rows cost GEMM rows only (memory-bound: ~free).

Why a block's bits do not depend on the batch: the argument of the batched AR step
(baton/engine/fused_batch.py), with groups of rows instead of one: the GEMMs run one config for every M
(a row's K order is the one-slot step's), the norms / RoPE / gates / the pick are per row, the GDN conv
and delta rule of a group run over its own live rows against its own slot's state (row t from rows <= t,
as in the one-slot step; the group's length is a runtime value, one binary for every call), and each
row's attention reduces over its own slot's keys up to its own position in fixed 256-key pieces. Tested
on CPU through Triton's interpreter (tests/engine/test_fused_blocks.py, tests/engine/test_batch_kernels.py)
and on the GPU (tests/engine/test_gpu_verify.py).

Row checkpoints (ModelRunner(checkpoints=True)) are not written for several groups: callers cutting a
block (speculation.verify_blocks) snapshot each slot first and restore the cut ones. Their kept rows are
then replayed through the GDN layers alone (`replay_kept`): a rows pass keeps each GDN layer's inputs
(the conv's input rows and the gates' beta / alpha, [MAX_ROWS, .] a layer: ~125 MB at the 9B shape), and
the replay runs the same conv and delta-rule kernels over the kept rows from the restored state, so each
cut slot's GDN state is bitwise the recompute's (the kernels' inputs are those bits; a group's length is a
runtime value and row t reads rows <= t) at the cost of 2 kernels a GDN layer instead of a whole-model
pass. The attention KV of the kept rows was written by the pass itself (rows past them are rewritten
before they are read); position and hidden are set from the pass. A pass that ran as several bucket-sized
passes, or whose gate inputs were split-K partials (fp8), falls back to the recompute pass.

Lifecycle: built by ModelRunner.enable_batching with BatchedAR (buffers allocated once, never replaced,
so captured graphs stay valid); used under the engine's compute lock through ModelRunner.rows_batch and
ModelRunner.mtp_batch. The caller checks each block's window and reserves its KV pages (batch.check_groups).
"""

from __future__ import annotations

import torch

from baton.engine import nogil
from baton.engine.fused_batch import BUCKETS, pick_rows
from baton.kernels import gdn, gdn_conv
from baton.kernels import rows as rk
from baton.transfer import upload

# rows of one pass (P x gs): bounds the logits buffer ([MAX_ROWS, vocab]) and the graphs. 320: 32 sessions'
# blocks of K + 1 = 9 or 10 rows in one pass (at 256, 32 exact sessions at K = 8 verified as two passes:
# 32.7 ms against 16.4 ms for 16 sessions on an H100, benchmarks/results/exact-passes-h100-2026-12-05.json)
MAX_ROWS = 320


class BatchedRows:
    def __init__(self, runner, max_groups: int):
        self.runner = runner
        self.max_groups = min(max_groups, BUCKETS[-1])
        dev, H, top = runner.device, runner.cfg.hidden_size, BUCKETS[-1]
        self.slots = torch.full((top,), -1, dtype=torch.long, device=dev)  # [P] group -> slot, -1 padding
        self.lens = torch.zeros(top, dtype=torch.long, device=dev)  # [P] each group's live rows
        self.start = torch.zeros(top, dtype=torch.long, device=dev)  # [P] MTP KV index of each group
        self.ids = torch.zeros(MAX_ROWS, dtype=torch.long, device=dev)  # [P*gs] the groups' tokens
        self.tok = torch.zeros(MAX_ROWS, dtype=torch.long, device=dev)  # [P*gs] each row's pick
        self.h = torch.zeros(MAX_ROWS, H, dtype=runner.dtype, device=dev)  # [P*gs] (normed) hidden rows
        self.mtp_h = torch.zeros(MAX_ROWS, H, dtype=runner.dtype, device=dev)  # [P*gs] MTP hidden inputs
        self.arange = torch.arange(MAX_ROWS, device=dev)
        pin = self._pinned = dev.type == "cuda"
        self._host = torch.zeros(3, top, dtype=torch.long, pin_memory=pin)  # slots, lens, starts
        self._host_ids = torch.zeros(MAX_ROWS, dtype=torch.long, pin_memory=pin)
        # numpy views of the pinned buffers: the host fills them without a torch op a group
        self._host_np, self._host_ids_np = self._host.numpy(), self._host_ids.numpy()
        self.saved: dict[int, tuple[torch.Tensor, ...]] = {}  # GDN layer -> its inputs (mixed, beta, alpha)
        self.saving = True  # False once a layer's gates came as split-K partials: no replay, the recompute
        self._z: torch.Tensor | None = None  # [MAX_ROWS, Hv*dv] zeros: the replay's gate (its output is dropped)
        self.last: tuple | None = None  # (slots, lens, gs, p) of the last run() when it was one pass
        self.replays = 0
        self.device_chains = 0  # mtp_chain calls (chains run with one host read)

    def buckets(self, gs: int) -> list[int]:
        """The buckets of a pass of groups of gs rows: P <= the bucket of max_groups, P x gs <= MAX_ROWS."""
        top = next(p for p in BUCKETS if p >= self.max_groups)
        return [p for p in BUCKETS if p <= top and p * gs <= MAX_ROWS]

    def pad(self, p: int) -> None:
        """Every group of the first p padding (capture: a warm-up that writes no slot)."""
        self.slots[:p].fill_(-1)
        self.lens[:p].fill_(0)

    # ---- the tensor code (captured) ------------------------------------------------------------
    def _rows(self, p: int, n: int, base: torch.Tensor):
        """-> (row_slot [M], within [M], pos [M]) of p groups of n rows: each row's slot (-1 for padding
        groups and for a group's junk rows past its length: they pick with the scratch slot), its index in
        its group and its position (base[g] + within)."""
        M, idx = p * n, self.slots[:p]
        within = self.arange[:M] % n
        row_slot = idx.repeat_interleave(n)
        live = within < self.lens[:p].repeat_interleave(n)
        return torch.where(live, row_slot, -1), within, base.repeat_interleave(n) + within

    def compute(self, p: int, n: int, live: tuple[int, ...] = (), sampled: bool = False) -> None:
        """slots / lens[:p], ids[:p*n] -> tok, h [:p*n]; commits each live group into its slot
        (rk.blocks_commit: position + lens[g], hidden = its last live row). Row r of group g consumes
        the token at position[slot] + r and picks the one after it. Eager: the pick's host shortcuts
        (`live` = the pass's slots); captured greedy, or sampled=True (SamplingTable.pick's full path)."""
        r = self.runner
        st, M = r.state, p * n
        idx, lens = self.slots[:p], self.lens[:p]
        rows, within, pos = self._rows(p, n, st.position[idx.clamp(min=0)])
        ids = self.ids[:M]
        h = r.fast.forward(ids, st, idx, n, pos, None, gs=n, lens=lens, save=self._save)  # [M, hidden]
        logits = r.fast.head(h, rows=M)  # [M, vocab]
        self.tok[:M].copy_(pick_rows(r.sampling, logits, rows, within, ids, pos, pos + 1, live, sampled))
        self.h[:M].copy_(h)
        rk.blocks_commit(idx, n, self.h[:M], st.position, st.hidden, lens)

    def mtp_compute(self, p: int, n: int, live: tuple[int, ...] = (), sampled: bool = False) -> None:
        """slots / lens / start[:p], mtp_h / ids[:p*n] -> tok (drafts), h (normed MTP outputs) [:p*n];
        writes each live group's MTP KV rows start..start+lens-1. Row r of group g is the pair at KV
        index start + r: its draft is picked as the exact model picks the token at start + r + 2, with
        the slot's sampling row (as ModelRunner.compute_mtp)."""
        r = self.runner
        M, idx = p * n, self.slots[:p]
        rows, within, pos = self._rows(p, n, self.start[:p])
        ids = self.ids[:M]
        out = r.fast.mtp(self.mtp_h[:M], ids, r.state, idx, n, pos, gs=n, lens=self.lens[:p])  # [M, hidden]
        logits = r.fast.head(out, rows=M)
        self.tok[:M].copy_(pick_rows(r.sampling, logits, rows, within, ids, pos + 1, pos + 2, live, sampled))
        self.h[:M].copy_(out)

    def _save(self, layer: int, proj) -> None:
        """Keeps a GDN layer's inputs of this pass (in a captured graph: copies it replays)."""
        mixed, z, beta, alpha = proj
        ts = (mixed, beta, alpha)
        if any(t.dim() != 2 for t in ts) or z.dim() != 2:
            self.saving = False
            return
        buf = self.saved.get(layer)
        if buf is None:  # once, at the first pass (a graph capture's eager warm-up): never replaced
            buf = tuple(torch.empty((MAX_ROWS, t.shape[1]), dtype=t.dtype, device=t.device) for t in ts)
            self.saved[layer] = buf
            if self._z is None:
                self._z = torch.zeros((MAX_ROWS, z.shape[1]), dtype=z.dtype, device=z.device)
        for dst, src in zip(buf, ts):
            dst[: src.shape[0]].copy_(src)

    def replay_compute(self, p: int, gs: int) -> None:
        """slots / lens[:p] (each cut group's slot and kept rows; -1 / 0 for the others and the padding), the
        last pass's saved GDN inputs -> each cut group's GDN conv and recurrent state advanced by its kept
        rows from its restored state (graph.capture_all captures it as ("replay", (p, gs)))."""
        st, M = self.runner.state, p * gs
        b = dict(slots=self.slots[:p], gs=gs, lens=self.lens[:p])
        layers = self.runner.fast.model.model.layers
        for i, (mixed, beta, alpha) in self.saved.items():
            a = layers[i].linear_attn
            c_in, c_out, r_in, r_out = st.gdn_io(a.layer_idx, None)
            w = a.conv1d.weight[:, 0, :].contiguous()
            cv = gdn_conv.conv_rows(mixed[:M], c_in, w, gs, None, c_out, **b)
            gdn.gdn_rows(
                cv, beta[:M], alpha[:M], self._z[:M], a.A_log, a.dt_bias, a.norm.weight, r_in, gs,
                nk=a.nk, eps=a.norm.eps, S_out=r_out, **b,
            )  # fmt: skip

    @torch.inference_mode()
    def replay_kept(self, blocks: list[tuple[int, list[int]]], redo: list[tuple[int, list[int]]]) -> bool:
        """After run(blocks) and the restore of the slots of `redo` [(slot, kept tokens)] to their state
        before it: advances each such slot by its kept rows through the GDN layers alone (module doc),
        and sets its position (+ kept) and hidden (the pass's row kept - 1); next_token is the caller's.
        -> False (nothing done) when the last run was not `blocks` in one pass or kept no inputs."""
        slots, lens = [s for s, _ in blocks], [len(t) for _, t in blocks]
        if not self.saving or not self.saved or self.last is None or self.last[:2] != (slots, lens):
            return False
        gs, p = self.last[2:]
        kept = {s: len(t) for s, t in redo}
        if len(kept) != len(redo) or not set(kept) <= set(slots):
            return False
        r, st, dev = self.runner, self.runner.state, self.runner.device
        self.slots[:p].copy_(upload([s if s in kept else -1 for s in slots] + [-1] * (p - len(slots)), torch.long, dev))
        self.lens[:p].copy_(upload([kept.get(s, 0) for s in slots] + [0] * (p - len(slots)), torch.long, dev))
        g = r.graphs.get(("replay", (p, gs)))  # captured: one launch for 2 kernels a GDN layer
        nogil.replay(g) if g is not None else self.replay_compute(p, gs)
        cut = [s for s in slots if s in kept]
        idx = upload(cut, torch.long, dev)
        st.position.index_add_(0, idx, upload([kept[s] for s in cut], torch.long, dev))
        rows = [j * gs + kept[s] - 1 for j, s in enumerate(slots) if s in kept]
        st.hidden.index_copy_(0, idx, self.h.index_select(0, upload(rows, torch.long, dev)))
        self.replays += 1
        return True

    # ---- the host side -------------------------------------------------------------------------
    def _load(self, slots: list[int], lens: list[int], ids: list[list[int]], p: int, gs: int, starts=None) -> None:
        """A pass's inputs to the device: slots / lens / starts [g] (padding groups to p), ids of each
        group at rows [g*gs, g*gs + lens[g]) (zeros elsewhere)."""
        g, host, hi = len(slots), self._host_np, self._host_ids_np
        host[:, :p] = 0
        host[0, :p] = -1
        host[0, :g] = slots
        host[1, :g] = lens
        if starts is not None:
            host[2, :g] = starts
        hi[: p * gs] = 0
        for j, toks in enumerate(ids):
            hi[j * gs : j * gs + len(toks)] = toks
        host = self._host
        hi = self._host_ids
        fast = nogil.launcher() if self._pinned else None
        if fast is not None:  # the four copies holding the GIL (baton/engine/nogil.py)
            stream, b, row = torch.cuda.current_stream().cuda_stream, host.element_size(), host.shape[1]
            for i, dst in enumerate((self.slots, self.lens, self.start)):
                fast.copy(dst.data_ptr(), host.data_ptr() + i * row * b, p * b, stream)
            fast.copy(self.ids.data_ptr(), hi.data_ptr(), p * gs * b, stream)
            return
        self.slots[:p].copy_(host[0, :p], non_blocking=True)
        self.lens[:p].copy_(host[1, :p], non_blocking=True)
        self.start[:p].copy_(host[2, :p], non_blocking=True)
        self.ids[: p * gs].copy_(hi[: p * gs], non_blocking=True)

    def _launch(self, kind: str, slots: list[int], p: int, gs: int, compute) -> None:
        """Replays the captured graph of the pass ((kind, (p, gs)) when every slot is plain greedy, its
        sampled twin kind + "s" when a slot samples or asks for logprobs, none when a slot keeps
        rejection-policy host records or the graph is missing: then compute(p, gs, slots) eagerly)."""
        smp, graphs = self.runner.sampling, self.runner.graphs
        if all(smp.plain(s) for s in slots):
            graph = graphs.get((kind, (p, gs)))
        else:
            graph = graphs.get((kind + "s", (p, gs))) if all(smp.in_graph(s) for s in slots) else None
        if graph is not None:
            nogil.replay(graph)
        else:
            compute(p, gs, tuple(slots))

    @torch.inference_mode()
    def _passes(self, kind: str, items: list, keep: list | None, setup, later: bool = False):
        """items of (slot, length, ...) -> each item's picks, in order, in passes of at most a bucket of
        groups; setup(part, p, gs) loads a pass's inputs. keep gets each item's h rows [len, H] (copies).
        later (keep None): the last pass's picks are copied on the device, not read: -> a function that
        reads them and returns the picks (the passes before it are read at once: the next pass's setup
        rewrites the pinned inputs its copies may not have read yet)."""
        out: list = [None] * len(items)
        gs = max(x[1] for x in items)
        step = self.buckets(gs)[-1]
        compute = self.compute if kind == "rowsb" else self.mtp_compute
        for c in range(0, len(items), step):
            part = items[c : c + step]
            p = next(b for b in self.buckets(gs) if b >= len(part))
            setup(part, p, gs)
            self._launch(kind, [x[0] for x in part], p, gs, compute)
            if later and c + step >= len(items):
                picks = self.tok[: len(part) * gs].clone()  # (later passes rewrite tok)

                def read(c=c, part=part):
                    toks = picks.tolist()
                    for j, x in enumerate(part):
                        out[c + j] = toks[j * gs : j * gs + x[1]]
                    return out

                return read
            toks = self.tok[: len(part) * gs].tolist()  # the one host sync of the pass
            kept = self.h[: len(part) * gs].clone() if keep is not None else None  # one copy a pass
            for j, x in enumerate(part):
                out[c + j] = toks[j * gs : j * gs + x[1]]
                if kept is not None:
                    keep.append(kept[j * gs : j * gs + x[1]])  # views of the pass's copy: read, never written
        return out

    def run(self, blocks: list[tuple[int, list[int]]], hidden_out: list | None = None) -> list[list[int]]:
        """blocks [(slot, tokens)] of distinct slots, validated (batch.check_groups) -> each block's
        picks, in order. hidden_out gets each block's final-normed hidden rows [n, hidden] (copies)."""

        def setup(part, p, gs):
            self._load([x[0] for x in part], [x[1] for x in part], [x[2] for x in part], p, gs)
            layout.append((p, gs))

        layout: list[tuple[int, int]] = []
        self.last = None
        out = self._passes("rowsb", [(s, len(t), t) for s, t in blocks], hidden_out, setup)
        if len(layout) == 1:  # one pass: its kept inputs are every block's (replay_kept)
            self.last = ([s for s, _ in blocks], [len(t) for _, t in blocks], layout[0][1], layout[0][0])
        return out

    def _mtp_load(self, part: list, p: int, gs: int) -> None:
        """An MTP pass's inputs: part [(slot, n, ids, h [n, H] or its pieces in order, start)] -> slots / lens /
        start, ids and mtp_h."""
        self._load([x[0] for x in part], [x[1] for x in part], [x[2] for x in part], p, gs, [x[4] for x in part])
        dt = self.mtp_h.dtype
        hs = [h if h.dtype == dt else h.to(dt) for x in part for h in (x[3] if isinstance(x[3], list) else [x[3]])]
        if all(x[1] == gs for x in part):  # no junk rows (a chain's one-pair steps): one copy
            torch.cat(hs, out=self.mtp_h[: len(part) * gs])
        else:  # each group's rows at g * gs: one scatter of them all
            rows = [j * gs + i for j, x in enumerate(part) for i in range(x[1])]
            self.mtp_h.index_copy_(0, upload(rows, torch.long, self.mtp_h.device), torch.cat(hs))

    @staticmethod
    def _items(groups: list) -> list:
        return [(int(s), len(ids), [int(t) for t in ids], h, int(start)) for s, h, ids, start in groups]

    def mtp(self, groups: list) -> tuple[list[list[int]], list[torch.Tensor]]:
        """groups [(slot, h [n, H], ids [n], start)] of distinct slots, 1 <= n <= W -> (each group's drafts
        [n], each group's normed outputs [n, H]), in order (see mtp_compute)."""
        self.last = None  # (an MTP pass keeps no rows inputs, but overwrites h, slots and lens)
        outs: list[torch.Tensor] = []
        return self._passes("mtpb", self._items(groups), outs, self._mtp_load), outs

    def mtp_later(self, groups: list):
        """mtp() launched without the host read of its (last) pass, outputs not kept: -> a function giving
        each group's drafts [n]; call it once a later host read of this stream has passed the pass (it then
        waits for nothing). Fast mtp's plain-round flush (decode_worker/mtp_launch.py)."""
        self.last = None
        return self._passes("mtpb", self._items(groups), None, self._mtp_load, later=True)

    def chain_bucket(self, g: int, gs: int) -> int | None:
        """The bucket of an on-device chain of g groups whose first step has gs pairs (mtp_chain), or None:
        its first step would not be one pass, or its one-pair steps would run in another bucket."""
        first, one = self.buckets(gs), self.buckets(1)
        if not first or g > first[-1]:
            return None
        p = next(b for b in first if b >= g)
        return p if p == next(b for b in one if b >= g) else None

    @torch.inference_mode()
    def mtp_chain(self, groups: list, ks: list[int], forced: list | None = None) -> list[list[int]] | None:
        """Chained MTP steps of several sessions with one host read, at the end: groups [(slot, h [n, H],
        ids [n], start)] as mtp(), group g drafting ks[g] >= 0 tokens. Step 0 finalises each group's pairs
        (one pass of gs = the most pairs); step j >= 1 runs one pair per group still drafting (ks[g] > j;
        the others' rows are junk: no state written), (the previous step's output row of the group's last
        row, the previous draft), at KV index start + n + j - 1; draft j is step j's pick of the group's
        last row, or forced[g][j] where that is given and not None (a drafter whose drafts are known
        ahead, Drafter.ahead). Each step's inputs are gathered on the device from the previous step's
        outputs, and each group's rows of every step are those mtp() runs for it (the same kernels on the
        same inputs; a group's bits do not depend on the others in its pass), so the drafts and the MTP KV
        rows are bitwise those of the host-chained steps (decode_worker/mtp.py chains), without their host
        read and upload a step. -> each group's ks[g] drafts; None (nothing run) when chain_bucket is None."""
        items = self._items(groups)
        g, gs = len(items), max(x[1] for x in items)
        p = self.chain_bucket(g, gs)
        if p is None or len(ks) != g or min(ks) < 0:
            return None
        steps = max(max(ks), 1)
        self.last = None
        slots, dev, pad = [x[0] for x in items], self.tok.device, [0] * (p - g)
        self._mtp_load(items, p, gs)
        self._launch("mtpb", slots, p, gs, self.mtp_compute)
        last = upload([j * gs + x[1] - 1 for j, x in enumerate(items)] + pad, torch.long, dev)
        fixed = None
        if forced is not None and any(v is not None for f in forced for v in f):
            vals = [[f[j] if j < len(f) and f[j] is not None else 0 for f in forced] + pad for j in range(steps)]
            mask = [[j < len(f) and f[j] is not None for f in forced] + [False] * (p - g) for j in range(steps)]
            fixed = (upload(vals, torch.long, dev), upload(mask, torch.bool, dev))  # [steps, p] each
        if steps > 1:  # each later step's live groups ([steps, p]: 1 where ks[g] > j)
            lens = upload([[int(k > j) for k in ks] + pad for j in range(steps)], torch.long, dev)
        drafts = torch.empty((steps, p), dtype=torch.long, device=dev)
        for j in range(steps):
            pick = self.tok.index_select(0, last)  # [p]: each group's pick of step j
            if fixed is not None:
                pick = torch.where(fixed[1][j], fixed[0][j], pick)
            drafts[j].copy_(pick)
            if j == steps - 1:
                break
            torch.index_select(self.h, 0, last, out=self.mtp_h[:p])  # the chained hidden: the output row
            self.ids[:p].copy_(pick)
            self.lens[:p].copy_(lens[j + 1])
            if j == 0:  # one pair a group from now on, at KV index start + n, then + 1 a step
                self.start[:p].add_(upload([x[1] for x in items] + pad, torch.long, dev))
                last = self.arange[:p]
            else:
                self.start[:p].add_(1)
            self._launch("mtpb", slots, p, 1, self.mtp_compute)
        self.device_chains += 1
        cols = drafts[:, :g].tolist()
        return [[cols[j][i] for j in range(k)] for i, k in enumerate(ks)]
