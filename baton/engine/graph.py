"""CUDA-graph capture of the whole decode step (embedding -> layers -> norm -> head -> argmax ->
position increment), one graph per (kind, n), serving every slot: the fused path reads the slot from the
device (ModelRunner.slot_buf, set by `select` before a replay), so capture cost does not grow with slots.

    kind "rows": ModelRunner.compute_rows(slot, n)  — AR step (n=1), verify (n=K+1), re-advance (n=m+1)
    kind "ar":   ModelRunner.compute_ar(slot)       — AR step fed from next_token on the device (n=1)
    kind "ar0", "ar1": ModelRunner.compute_ar(slot, phase) — the ping-pong AR steps (runner pipeline=True)
    kind "mtp":  ModelRunner.compute_mtp(slot, n)   — MTP pairs: catch-up + first draft (n<=K+2), chain (n=1)
    kind "arb":  BatchedAR.compute(P)                — the batched AR step over a bucket of P rows
                 (baton/engine/fused_batch.py; runner.enable_batching), captured with every row padding
    kind "arbs": BatchedAR.compute(P, sampled=True)  — the same step with each row's sampling pick on the
                 device (baton/engine/sampling.py: parameters and outputs are the table's tensors)
    kind "arbt": BatchedAR.compute(P, sampled=True, lite=True) — the sampled step without penalties and
                 logprobs (the pick alone), for batches whose slots ask for neither (SamplingTable.lite)
    kind "rowsb", "rowsbs": BatchedRows.compute(P, n), keyed (kind, (P, n)) — P sessions' blocks of n rows
                 in one pass (baton/engine/fused_blocks.py: the batched verify), greedy / sampled
    kind "mtpb", "mtpbs": BatchedRows.mtp_compute(P, n) — P sessions' MTP chain steps of n pairs each
    kind "replay": BatchedRows.replay_compute(P, n) — the cut blocks' kept rows of a ("rowsb", (P, n)) pass
                 through the GDN layers (replay_kept), captured after the rowsb graphs (their warm-ups
                 allocate the kept inputs); none where the pass keeps none (fp8's split-K gates)
    and the state's slot copies (HybridState.snapshot_slots / restore_slots: baton/engine/slot_copies.py),
    one graph per (bucket, direction), outside runner.graphs

First-call discipline (so the first served token is bitwise the same as every later one):
    1. warm up eagerly on a side stream (kernel autotuning, lazily allocated buffers) — no tokens kept;
    2. capture into a shared memory pool;
    3. prime with one replay;
    4. roll every slot back to zero (GDN state, scalars, and the KV rows the warm-up wrote).
One-slot kinds warm up and capture on slot 0.
Captured graphs read the runner's static buffers (ids_buf, mtp_h, ...) and the HybridState tensors,
whose addresses never change (import/restore copy into them).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

import torch

from baton.engine.runner import ModelRunner

log = logging.getLogger("baton.graph")

SLOT_COPIES_ENV = "BATON_SLOT_COPIES"  # "0": snapshot_slots / restore_slots stay eager launches (A/B)
MAX_DRAFT = 8  # the longest draft block graphs exist for (K + 1 rows; baton/engine/draft_length.py DEFAULT_K_MAX)


@dataclass
class GraphStats:
    graphs: int = 0
    seconds: float = 0.0
    pool_bytes: int = 0
    keys: list = field(default_factory=list)


def _bodies(runner: ModelRunner):
    return {
        "rows": runner.compute_rows,
        "mtp": runner.compute_mtp,
        "ar": lambda slot, n: runner.compute_ar(slot),
        "ar0": lambda slot, n: runner.compute_ar(slot, 0),
        "ar1": lambda slot, n: runner.compute_ar(slot, 1),
        "arb": lambda slot, n: runner.batched.compute(n),
        "arbs": lambda slot, n: runner.batched.compute(n, sampled=True),
        "arbt": lambda slot, n: runner.batched.compute(n, sampled=True, lite=True),
        "rowsb": lambda slot, pn: runner.batched_rows.compute(*pn),
        "rowsbs": lambda slot, pn: runner.batched_rows.compute(*pn, sampled=True),
        "mtpb": lambda slot, pn: runner.batched_rows.mtp_compute(*pn),
        "mtpbs": lambda slot, pn: runner.batched_rows.mtp_compute(*pn, sampled=True),
        "replay": lambda slot, pn: runner.batched_rows.replay_compute(*pn),
    }


def block_keys(runner: ModelRunner, n_max: int) -> list[tuple[int, int]]:
    """The (P, n) keys of the batched rows graphs: blocks of n = 1..n_max rows, every bucket P of n."""
    return [(p, n) for n in range(1, min(n_max, runner.width) + 1) for p in runner.batched_rows.buckets(n)]


def default_ns(runner: ModelRunner, max_draft: int) -> dict[str, list]:
    """rows: n = 1..max_draft+1 (verify, re-advance); ar: the device-fed AR step (ar0 / ar1 too with
    ping-pong buffers); mtp: n = 1..max_draft+2 (when a head exists); arb / arbs / arbt: every batch bucket;
    with an MTP head and batching, rowsb / rowsbs / replay: every (bucket, n) of blocks of n = 1..max_draft+1
    rows (the rounds' batched verify, its cut blocks' replay) and mtpb / mtpbs: n = 1..max_draft+2 pairs
    (the batched chains)."""
    k = min(max_draft, runner.width - 2)
    ns: dict[str, list | range] = {"rows": range(1, k + 2), "ar": range(1, 2)}
    if runner.state.pingpong:
        ns.update(ar0=range(1, 2), ar1=range(1, 2))
    if runner.has_mtp:
        ns["mtp"] = range(1, k + 3)
    if runner.batched is not None:
        ns["arb"] = ns["arbs"] = ns["arbt"] = runner.batched.buckets
    if runner.batched_rows is not None and runner.has_mtp:  # MTP rounds: batched chains and verify
        ns["rowsb"] = ns["rowsbs"] = ns["replay"] = block_keys(runner, k + 1)
        ns["mtpb"] = ns["mtpbs"] = block_keys(runner, k + 2)
    return ns


@torch.inference_mode()
def capture_all(
    runner: ModelRunner,
    *,
    max_draft: int = MAX_DRAFT,
    ns: dict[str, list | range] | None = None,
    warmup: int = 2,
) -> GraphStats:
    """Captures every (kind, n) graph into runner.graphs; leaves all slots zeroed."""
    if runner.device.type != "cuda":
        raise RuntimeError("capture_all: CUDA graphs need a CUDA device")
    t0 = time.perf_counter()
    ns = ns or default_ns(runner, max_draft)
    bodies = _bodies(runner)
    slot = 0
    pool = torch.cuda.graph_pool_handle()
    mem0 = torch.cuda.memory_allocated(runner.device)
    stats = GraphStats()
    side = torch.cuda.Stream(device=runner.device)
    for kind, n_range in ns.items():
        body = bodies[kind]
        for n in n_range:
            runner.select(slot)
            if kind in ("arb", "arbs", "arbt"):
                runner.batched.pad(n)  # every row padding: the warm-up and the prime write no slot
            elif kind in ("rowsb", "rowsbs", "mtpb", "mtpbs", "replay"):
                if kind == "replay" and not (runner.batched_rows.saving and runner.batched_rows.saved):
                    continue  # no kept inputs (fp8's split-K gates): replay_kept recomputes instead
                runner.batched_rows.pad(n[0])  # every group padding
            runner.state.snapshot(slot)
            side.wait_stream(torch.cuda.current_stream(runner.device))
            with torch.cuda.stream(side):
                for _ in range(warmup):
                    body(slot, n)
                    runner.state.restore(slot)
            torch.cuda.current_stream(runner.device).wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                body(slot, n)
            g.replay()  # prime
            runner.state.restore(slot)
            runner.graphs[(kind, n)] = g
            stats.graphs += 1
            stats.keys.append((kind, n))
    # snapshot_slots / restore_slots (exact mode's Verify and bf16 / fp8 Draft batches): a replay a bucket
    if os.environ.get(SLOT_COPIES_ENV, "1") != "0":
        stats.graphs += runner.state.enable_slot_copies(runner.state.slots).capture(pool)
        stats.keys.append(("slot_copies", tuple(runner.state.slot_copies.buckets)))
    runner.state.reset_slots(range(runner.state.slots))  # roll back: zero state and every KV row warm-up wrote
    torch.cuda.synchronize(runner.device)
    stats.seconds = time.perf_counter() - t0
    stats.pool_bytes = torch.cuda.memory_allocated(runner.device) - mem0
    log.info("captured %d graphs in %.1fs (%.1f MB)", stats.graphs, stats.seconds, stats.pool_bytes / 1e6)
    return stats


def destroy(runner: ModelRunner) -> None:
    runner.graphs.clear()
    runner.state.slot_copies = None
    if runner.device.type == "cuda":
        torch.cuda.empty_cache()
