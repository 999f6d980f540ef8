"""BatchedAR: one AR step for many sessions of a fused (CUDA) runner, in one captured graph per bucket.

    step(slots)   -> each slot's new token: consumes next_token[slot] of every slot, sets the new one,
                     advances position, stores hidden; each slot bitwise as ModelRunner.ar_step(slot)
    launch(slots) -> handle; collect(handle) -> the tokens: step() in two halves (step = collect(launch));
                     launch enqueues the step and returns at once on CUDA
    compute(P)    the tensor code of a bucket of P rows (what graph.capture_all captures as ("arb", P):
                  greedy, and as ("arbs", P): every row picked by its slot's sampling parameters)

A step whose slots are all greedy without logprobs replays "arb"; one with a sampling or logprob slot
replays "arbs" (the pick runs on the device, no host round trip), or "arbt" when no slot asks for
penalties or logprobs (the pick alone), unless a slot drafts or judges for the
rejection policy, whose picks keep host-side records (SamplingTable.in_graph): that step runs eagerly.

A step of B sessions runs in the smallest bucket P >= B (BUCKETS); rows B..P-1 are padding rows, whose
slot is -1. The slot of every row is a device input (`slots`), so one graph per bucket serves any set of
sessions, and capture cost does not grow with the slot count.

Why a row's bits do not depend on the batch (docs/CONTRACTS.md, "Batch invariance"):
  * the GEMMs (gemv.linear) run one config for every M, but for how many rows share a weight tile: the
    K order and split of each row are those of the one-slot step, and no row reads another's inputs;
  * the norms, RoPE, gates and the argmax are per row;
  * the GDN conv and delta rule run per (slot, head): a row reads and writes only its slot's state;
  * the attention of a row reduces over its own slot's keys in fixed 256-key pieces (attention_rows).
The kernels are the very binaries of the one-slot step (a one-slot step is group 0 of the same kernels),
and padding rows read no slot state and write nothing: the GDN and attention kernels skip them.

Lifecycle: built by ModelRunner.enable_batching (its buffers are allocated once and never replaced, so
captured graphs stay valid); used under the engine's compute lock by the step scheduler
(ModelRunner.ar_batch, or ar_batch_launch then ar_batch_collect: the scheduler launches step t + 1 before
it reads step t's tokens, so the host's work overlaps the device's). The caller checks each session's
window and reserves its KV pages.
"""

from __future__ import annotations

import collections

import torch

from baton.engine import nogil
from baton.kernels import rows as rk

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
PHASES = 4  # batched steps that may be uncollected at once (host buffer phases)


def bucket(b: int) -> int:
    """The smallest bucket >= b rows."""
    for p in BUCKETS:
        if p >= b:
            return p
    raise ValueError(f"a batched step holds at most {BUCKETS[-1]} rows, got {b}")


def pick_rows(
    smp, logits, slots, within, ids, record_at, pick_at, live, sampled: bool, lite: bool = False
) -> torch.Tensor:
    """The pick of a batched pass's M rows (BatchedAR, fused_blocks.BatchedRows): logits [M, V]; slots [M]
    each row's slot (< 0: a padding or junk row, picked with the table's greedy scratch slot); within [M]
    its index in its block; ids [M] the tokens the rows consumed, recorded in the token history at
    record_at (penalties); the picked tokens are those at pick_at -> [M]. While a greedy graph is
    captured: the argmax (a sampling or penalized slot is never plain, so it need not record); else the
    history and SamplingTable.pick (sampled: the full path, what the sampled graph captures; with lite, the
    lite sampled graph's: no penalties, no logprobs)."""
    if logits.is_cuda and torch.cuda.is_current_stream_capturing() and not sampled:
        return logits.argmax(-1)
    rows = torch.where(slots < 0, smp.scratch, slots)
    smp.history.record(rows, record_at, ids)
    return smp.pick(logits, rows, within, pick_at, live, full=sampled, lite=lite)


class BatchedAR:
    def __init__(self, runner, max_rows: int):
        self.runner = runner
        self.max_rows = min(max_rows, BUCKETS[-1])
        top = bucket(self.max_rows)
        self.buckets = [p for p in BUCKETS if p <= top]
        dev, H = runner.device, runner.cfg.hidden_size
        self.slots = torch.full((top,), -1, dtype=torch.long, device=dev)  # [P] row -> slot, -1 = padding
        self.tok = torch.zeros(top, dtype=torch.long, device=dev)  # [P] each row's greedy next token
        self.h = torch.zeros(top, H, dtype=runner.dtype, device=dev)  # [P] final-normed hidden rows
        self.zeros = torch.zeros(top, dtype=torch.long, device=dev)  # [P] each row's index in its block
        pin = dev.type == "cuda"
        # PHASES of host buffers: a step may be in flight (launched, not collected) while the next is
        # launched; a phase is reused only once its step was collected (its copies are done). Two
        # schedulers may pipeline on one runner (bf16 sessions' steps, mtp sessions' plain rounds): 2 each
        self._host_slots = torch.full((PHASES, top), -1, dtype=torch.long, pin_memory=pin)
        self._host_tok = torch.zeros(PHASES, top, dtype=torch.long, pin_memory=pin)
        # numpy views of both: launch and collect write and read them without a torch call, each of which
        # gives up the GIL and waits to get it back behind the worker's other threads
        self._host_slots_np, self._host_tok_np = self._host_slots.numpy(), self._host_tok.numpy()
        self._done = [torch.cuda.Event(enable_timing=True) for _ in range(PHASES)] if pin else None
        self._start = [torch.cuda.Event(enable_timing=True) for _ in range(PHASES)] if pin else None
        self._busy = [False] * PHASES
        # CUDA: the launch's copies, event records and graph replay through baton/engine/nogil.py, holding the
        # GIL (torch's calls give it up, and the step thread then queued for it behind the worker's other
        # threads); the events are created here (torch creates one at its first record)
        self._nogil = nogil.launcher() if pin else None
        if self._nogil is not None:
            for e in self._done + self._start:
                e.record()
            self._isz = self._host_slots.element_size()  # slots and tokens: int64
            self._row_bytes = top * self._isz
        # CUDA: each collected step's device time, s (its start event to its token copy's end): a step in
        # service against the step alone tells a GPU shared with other work from a host that falls behind
        self.device_s: collections.deque = collections.deque(maxlen=4096)

    def pad(self, p: int) -> None:
        """Every row of the first p padding (capture: a warm-up that writes no slot)."""
        self.slots[:p].fill_(-1)

    def compute(self, p: int, live: tuple[int, ...] = (), sampled: bool = False, lite: bool = False) -> None:
        """slots[:p] -> tok[:p], h[:p]; commits each live row into its slot (rk.ar_commit). Captured:
        greedy (argmax, kind "arb"), or with sampled=True (kind "arbs") each row picked by its slot's row
        of runner.sampling on the device (SamplingTable.pick's full path: temperature, top-k / top-p /
        min-p, Gumbel noise, penalties, logprobs into the table), and its warm-up runs that same full path
        eagerly; with lite=True too (kind "arbt") the pick without penalties and logprobs, for steps whose
        slots all are SamplingTable.lite (the same tokens: penalties and logprobs never change a lite row's). Eager steps (sampled=False off-capture): the same pick (`live` = the batch's slots on the
        host, for its greedy shortcut and the rejection policy's host-side records)."""
        r = self.runner
        st, fast = r.state, r.fast
        idx = self.slots[:p]
        safe = idx.clamp(min=0)  # padding rows read slot 0's token and position, and write nothing
        ids = st.next_token[safe]  # [P]
        pos = st.position[safe]  # [P]
        h = fast.forward(ids, st, idx, 1, pos, None, gs=1)  # [P, hidden]
        logits = fast.head(h, rows=p)  # [P, vocab]
        tok = pick_rows(r.sampling, logits, idx, self.zeros[:p], ids, pos, pos + 1, live, sampled, lite)  # [P]
        self.tok[:p].copy_(tok)
        self.h[:p].copy_(h)
        rk.ar_commit(idx, self.tok[:p], self.h[:p], st.next_token, st.position, st.hidden)

    @torch.inference_mode()
    def launch(self, slots: list[int]) -> tuple[int, int]:
        """Enqueues one step of `slots` (their KV pages reserved by the caller) and the copy of its
        tokens to the host; returns at once on CUDA -> a handle for collect. At most PHASES steps are
        uncollected at a time (one per phase of the host buffers)."""
        b = len(slots)
        if not 1 <= b <= self.max_rows:
            raise ValueError(f"a batched step of {b} sessions (1..{self.max_rows})")
        if len(set(slots)) != b:
            raise ValueError(f"a batched step needs distinct slots, got {slots}")
        if all(self._busy):
            raise RuntimeError(f"{PHASES} batched steps are in flight: collect one first")
        ph = self._busy.index(False)
        p = bucket(b)
        self._host_slots_np[ph, :b] = slots
        self._host_slots_np[ph, b:p] = -1
        fast = self._nogil is not None  # (the launcher exists only where one GPU is visible: this runner's)
        if fast:
            nog, stream = self._nogil, torch.cuda.current_stream(self.runner.device).cuda_stream
            nog.record(self._start[ph], stream)
            at = ph * self._row_bytes
            nog.copy(self.slots.data_ptr(), self._host_slots.data_ptr() + at, p * self._isz, stream)
        else:
            if self._start is not None:
                self._start[ph].record()
            self.slots[:p].copy_(self._host_slots[ph, :p], non_blocking=True)
        smp, graphs = self.runner.sampling, self.runner.graphs
        if all(smp.plain(s) for s in slots):
            g = graphs.get(("arb", p))
        elif all(smp.in_graph(s) for s in slots):  # a slot samples or asks for logprobs: a sampled graph
            g = graphs.get(("arbt", p)) if all(smp.lite(s) for s in slots) else None
            g = g or graphs.get(("arbs", p))
        else:  # a slot drafts or judges for the rejection policy: its picks keep host records
            g = None
        if g is not None and fast:
            nog.replay(g, stream)
        elif g is not None:
            g.replay()
        else:  # CPU, or not captured, or a rejection-policy slot: the same kernels, eagerly
            self.compute(p, tuple(slots))
        if fast:
            nog.copy(self._host_tok.data_ptr() + at, self.tok.data_ptr(), b * self._isz, stream)
            nog.record(self._done[ph], stream)
        else:
            self._host_tok[ph, :b].copy_(self.tok[:b], non_blocking=True)
            if self._done is not None:
                self._done[ph].record()
        self._busy[ph] = True
        return ph, b

    def collect(self, handle: tuple[int, int]) -> list[int]:
        """The tokens of a launched step (waits for that step only)."""
        ph, b = handle
        if self._done is not None:
            self._done[ph].synchronize()
            if self._nogil is not None:  # (torch's elapsed_time gives the GIL up around the call)
                self.device_s.append(self._nogil.elapsed_ms(self._start[ph], self._done[ph]) / 1e3)
            else:
                self.device_s.append(self._start[ph].elapsed_time(self._done[ph]) / 1e3)
        toks = self._host_tok_np[ph, :b].tolist()
        self._busy[ph] = False
        return toks

    def step(self, slots: list[int]) -> list[int]:
        return self.collect(self.launch(slots))

    def free_phases(self) -> int:
        """How many more steps may be launched before one is collected (the fast-mode scheduler's step in
        flight holds one)."""
        return self._busy.count(False)
