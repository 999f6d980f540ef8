"""Batched rows (issue 20, first step): one eager step over several sessions' slots.

    rows_batch(runner, [(slot, tokens), ...])  ->  [the token picked after each of tokens, ...]
    (greedy, or sampled by the slot's row of runner.sampling at its own positions: baton/engine/sampling.py,
    whose pick also runs on W-row chunks with no cross-row op)

Each group is one slot's rows (1 <= len(tokens) <= W, distinct slots). The rows of all groups are
flattened, each group contiguous and in order, and padded to C chunks of W rows. The model
(baton/models/qwen3_5.py, `StepContext.groups`) then runs

  * every per-row op (embedding, GEMMs, norms, MLP, RoPE, gates, the head) chunk by chunk on
    [W, ...] inputs: the exact shape of the one-slot step, so BLAS picks the same kernel for a row
    whatever the batch (BLAS kernels change with M: docs/CONTRACTS.md, "Batch invariance");
  * each group's mixer on its own rows padded to [W, ...] at rows [0, n): the GDN conv and delta rule
    against its slot's state, token by token; the attention against its slot's KV [nkv, L, d] with
    the mask j <= its position. These are the one-slot step's calls with the same inputs.

A row's result therefore depends only on its own inputs, its slot's state and its index inside its
W-chunk; the rows GEMMs' row independence at M = W (the row-invariance contract, which already lets
row 0 of an AR step equal row i of a verify block) covers the index. The one-slot `rows` eager path is
the case of one group in one chunk of the same code, so alone and batched agree bitwise
(tests/engine/test_batch_invariance.py).

Each slot advances exactly as `rows(slot, tokens)` alone would: position, conv, recurrent, KV rows at
[position, position + n), hidden (the last row's final-normed hidden). next_token is not touched (as
`rows`). A batch of one group also leaves tok_out / h_rows as `rows` does (accept_prefix reads them).

Row checkpoints (`ModelRunner(checkpoints=True)`) are one set per runner (HybridState), written by a
multi-row pass: with them, a batch of more than one group must have one row per group (AR steps write
none); a lone multi-row group writes them as `rows` does.

The fused CUDA path (`runner.fast`) runs several groups as baton/engine/fused_blocks.py's BatchedRows
(one pass, or one per distinct group length, in captured graphs when they exist) once the runner has
batching enabled (ModelRunner.enable_batching); without it, and for one group, it runs the groups one
after another through `rows` (same results).
"""

from __future__ import annotations

import torch

from baton.models.qwen3_5 import RowGroup, StepContext
from baton.transfer import read_slots


def check_groups(runner, groups, ckpt_unused: bool = False) -> list[tuple[int, list[int]]]:
    """Validates a batch (before any state is touched); returns it as [(slot, [tokens])].
    ckpt_unused: the caller will not read the row checkpoints (they may hold any group's rows)."""
    out: list[tuple[int, list[int]]] = []
    if not groups:
        raise ValueError("rows_batch: no groups")
    seen: set[int] = set()
    W = runner.width
    for i, (slot, tokens) in enumerate(groups):
        slot, tokens = int(slot), [int(t) for t in tokens]
        if not 0 <= slot < runner.state.slots:
            raise ValueError(f"rows_batch: group {i}: slot {slot} out of range [0, {runner.state.slots})")
        if slot in seen:
            raise ValueError(f"rows_batch: group {i}: duplicate slot {slot}")
        seen.add(slot)
        if not 1 <= len(tokens) <= W:
            raise ValueError(f"rows_batch: group {i} (slot {slot}): {len(tokens)} tokens, expected 1..{W}")
        runner.check_ids(tokens, f"rows_batch: group {i} (slot {slot})")
        out.append((slot, tokens))
    if not ckpt_unused and runner.state.ckpt_conv and len(out) > 1 and any(len(t) > 1 for _, t in out):
        raise ValueError(
            "rows_batch: row checkpoints are kept (one set per runner): a batch of several groups must have"
            " one row per group"
        )
    # window and KV pages, after the cheap checks: every group's position in one host read
    for (slot, tokens), pos in zip(out, read_slots(runner.state.position, [slot for slot, _ in out])):
        runner.check_window(pos, len(tokens))
        runner.reserve(slot, pos + len(tokens))  # PagesExhausted: no state touched (pages only grow)
    return out


@torch.inference_mode()
def rows_batch(runner, groups, ckpt_unused: bool = False, hidden_out: list | None = None) -> list[list[int]]:
    """See the module docstring. Raises ValueError / WindowError (state untouched) on a bad batch.
    ckpt_unused: several multi-row groups even with row checkpoints kept, whose contents are then
    undefined (speculation.verify_blocks rewinds from snapshots instead). hidden_out: a list that gets
    each group's final-normed hidden rows [n, hidden] (copies)."""
    batch = check_groups(runner, groups, ckpt_unused)  # also grows each group's KV pages, as rows() does
    if runner.fast is not None and runner.batched_rows is not None and len(batch) > 1:
        return runner.batched_rows.run(batch, hidden_out)  # fused: baton/engine/fused_blocks.py
    if runner.fast is not None:  # fused without batching (or one group): one group at a time through rows
        out = []
        for slot, tokens in batch:
            out.append(runner.rows(slot, tokens))
            if hidden_out is not None:
                hidden_out.append(runner.h_rows[: len(tokens)].clone())
        return out
    W, dev, state = runner.width, runner.device, runner.state
    total = sum(len(t) for _, t in batch)
    T = -(-total // W) * W  # C chunks of W rows
    flat: list[int] = []
    rgroups = []
    for slot, tokens in batch:
        rgroups.append(RowGroup(slot, len(tokens), len(flat)))
        flat.extend(tokens)
    ids = torch.zeros(T, dtype=torch.long, device=dev)
    ids[:total] = torch.tensor(flat, dtype=torch.long, device=dev)
    ctx = StepContext(slot=batch[0][0], width=W, n=len(batch[0][1]), groups=tuple(rgroups))
    model, smp = runner.model, runner.sampling
    # each row's sampling slot, index in its group and picked position (scratch slot for padding rows)
    slots = torch.full((T,), smp.scratch, dtype=torch.long)
    rows = torch.zeros(T, dtype=torch.long)
    for g in rgroups:
        slots[g.off : g.off + g.n] = g.slot
        rows[g.off : g.off + g.n] = torch.arange(g.n)
    slots, rows = slots.to(dev), rows.to(dev)
    positions = state.position[slots.clamp(max=state.slots - 1)] + rows + 1  # before the step advances them
    smp.history.record(slots, positions - 1, ids)  # each row's token at its position (penalties)
    h = model(ids, state, ctx)  # [T, hidden]
    live = rgroups[0].n if len(rgroups) == 1 else None  # the fp8 head's live rows, as compute_rows
    logits = ctx.map(lambda hc: model.logits(hc, rows=live), h)  # [T, vocab]; head at [W, hidden]
    tok = smp.pick(logits, slots, rows, positions, [g.slot for g in rgroups])  # [T], W-row chunks
    for g in rgroups:
        state.hidden[g.slot].copy_(h[g.off + g.n - 1])
        if hidden_out is not None:
            hidden_out.append(h[g.off : g.off + g.n].clone())
    if len(rgroups) == 1:  # as rows(): the static buffers hold this block
        runner.tok_out.copy_(tok[:W])
        runner.h_rows.copy_(h[:W])
    tl = tok.tolist()
    return [tl[g.off : g.off + g.n] for g in rgroups]
