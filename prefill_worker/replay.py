"""Migration re-prefills' replays on the prefill worker, batched: every session replaying its generated
tokens at the same time feeds its next W-row block in one shared rows pass.

    replays = Replays(runner, compute_lock)
    token = replays.run(slot, start, generated, mtp)   # after the prompt's `start` tokens; blocks until fed

Why. A re-prefill replays the tokens a session had generated as AR rows, W a block (baton/engine/prefill.py
Replay), so the state is bitwise the AR decode's. Alone, a session of g generated tokens costs g / W passes,
and when a decode worker holding many sessions dies they all re-prefill at once: one pass each per block,
one after another, was N x g / W passes behind the prefill worker's lock (64 sessions of 4,096 tokens at
W = 16: 16,384 passes). Gathered (baton/engine/gather.py), the blocks of every replaying session share a pass
(batch.rows_batch: ragged groups, each bitwise as alone): g / W passes for all of them.

Lifecycle of one replay: its session counts as replaying from run() until its last block (a pass's leader
waits up to the Gather's window for the blocks of every replaying session); each block is one Gather call
under the compute lock, so verify and prefill passes interleave with a long replay; a failed pass fails
each replay in it (its caller releases the session). Its KV pages are all reserved before (open_prefill
reserves prompt + generated), so a block never runs short of them.
"""

from __future__ import annotations

import threading

from baton.engine.gather import Gather
from baton.engine.prefill import Replay, replay_step


class Replays:
    def __init__(self, runner, lock):
        self.runner = runner
        self._live = 0
        self._count = threading.Lock()
        self.gather = Gather(self._batch, lock, expected=lambda: self._live)

    def run(self, slot: int, start: int, generated: list[int], mtp: bool) -> int:
        """Feeds `generated` into `slot`, whose prompt of `start` tokens is computed, as AR rows -> the token
        picked after them."""
        r = Replay(slot, list(generated), start, mtp=mtp)
        with self._count:
            self._live += 1
        try:
            while not r.done:
                self.gather.call(r)
        finally:
            with self._count:
                self._live -= 1
        return r.token

    def _batch(self, items: list[Replay]) -> list[None]:
        replay_step(self.runner, items)
        return [None] * len(items)
