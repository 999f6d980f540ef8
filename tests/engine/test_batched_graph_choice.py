"""Which captured graph a batched AR step replays (baton/engine/fused_batch.py BatchedAR.step): "arb"
(greedy argmax) when every slot is plain greedy, "arbs" (the sampling pick on the device) when a slot
samples or asks for logprobs, "arbt" (the pick alone) when no slot asks for penalties or logprobs, and no graph (the same kernels eagerly) when a slot drafts or judges for
the rejection policy, whose picks keep host-side records, or when the bucket was not captured. The
graphs here record their replays; the step's tensor code is not run (the GPU test
tests/engine/test_gpu_batch.py checks the sampled graph's tokens against the session alone)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from baton.engine.fused_batch import BatchedAR
from baton.engine.sampling import REJECTION, Params, SamplingTable


class _Graph:
    def __init__(self, key, log):
        self.key, self.log = key, log

    def replay(self):
        self.log.append(self.key)


@pytest.fixture
def batched():
    log = []
    table = SamplingTable(8, "cpu", 4)
    runner = SimpleNamespace(
        device=torch.device("cpu"), cfg=SimpleNamespace(hidden_size=4), dtype=torch.float32, sampling=table
    )
    b = BatchedAR(runner, 8)
    runner.graphs = {(k, p): _Graph((k, p), log) for k in ("arb", "arbs", "arbt") for p in b.buckets}
    b.compute = lambda p, live=(), sampled=False, lite=False: log.append(("eager", p))
    return b, table, log


def test_all_greedy_replays_the_greedy_graph(batched):
    b, _, log = batched
    b.step([0, 3, 5])
    assert log == [("arb", 4)]


@pytest.mark.parametrize(
    "p, kind",
    [
        (Params(temperature=0.7, seed=3), "arbt"),
        (Params(top_p=0.5, temperature=1), "arbt"),
        (Params(logprobs=2), "arbs"),
        (Params(temperature=0.7, logprobs=1), "arbs"),
        (Params(temperature=0.7, presence_penalty=0.5), "arbs"),
    ],
)
def test_a_sampling_slot_replays_the_lite_or_the_full_sampled_graph(batched, p, kind):
    """The lite graph ("arbt": the pick alone) when no slot asks for penalties or logprobs, else the full one."""
    b, table, log = batched
    table.history.begin(5, 0)
    table.set(5, p)
    b.step([0, 5])
    b.step([5])
    table.set(3, Params(logprobs=1))  # one full-path slot takes the whole batch to the full graph
    b.step([3, 5])
    table.clear(5)
    b.step([5])
    assert log == [(kind, 2), (kind, 1), ("arbs", 2), ("arb", 1)]


def test_a_missing_lite_graph_falls_back_to_the_full_one(batched):
    b, table, log = batched
    del b.runner.graphs[("arbt", 2)]
    table.set(1, Params(temperature=0.7, seed=3))
    b.step([0, 1])
    assert log == [("arbs", 2)]


def test_a_rejection_drafting_or_judging_slot_runs_eagerly(batched):
    b, table, log = batched
    p = Params(temperature=0.9, seed=1, exact_policy=REJECTION)
    table.set(2, p, proposing=True)  # drafts for a rejection-policy Verify: its q' is recorded on the host
    b.step([1, 2, 6])
    table.set(2, p)
    b.step([1, 2, 6])
    table.set(2, None)
    table.set(6, p)
    table.judge(6, 10, [4], [(torch.tensor([4]), torch.tensor([1.0]))])
    b.step([1, 6])
    table.end_judge(6)
    b.step([1, 6])
    assert log == [("eager", 4), ("arbt", 4), ("eager", 2), ("arbt", 2)]


def test_an_uncaptured_bucket_runs_eagerly(batched):
    b, table, log = batched
    del b.runner.graphs[("arbs", 8)], b.runner.graphs[("arbt", 8)]
    table.set(0, Params(temperature=1.0, seed=2))
    b.step(list(range(5)))
    b.step(list(range(1, 6)))
    assert log == [("eager", 8), ("arb", 8)]


@pytest.fixture
def blocks():
    """BatchedRows (baton/engine/fused_blocks.py) over fake graphs of every (bucket, n) for n <= 4."""
    from baton.engine.fused_blocks import BatchedRows

    log = []
    table = SamplingTable(8, "cpu", 4)
    runner = SimpleNamespace(
        device=torch.device("cpu"), cfg=SimpleNamespace(hidden_size=4), dtype=torch.float32, sampling=table
    )
    b = BatchedRows(runner, 8)
    keys = [(k, (p, n)) for k in ("rowsb", "rowsbs", "mtpb", "mtpbs") for n in range(1, 5) for p in b.buckets(n)]
    runner.graphs = {key: _Graph(key, log) for key in keys}
    b.compute = lambda p, n, live=(): log.append(("eager rows", (p, n)))
    b.mtp_compute = lambda p, n, live=(): log.append(("eager mtp", (p, n)))
    return b, table, log


def test_batched_blocks_replay_the_graph_of_their_bucket_and_longest_block(blocks):
    b, table, log = blocks
    b.run([(0, [1, 2, 3]), (3, [4, 5, 6]), (5, [7, 8, 9])])  # one pass of 3 blocks of 3 rows: bucket 4
    b.run([(0, [1, 2]), (3, [4, 5, 6]), (5, [7, 8])])  # ragged: one pass of groups of the longest
    table.set(5, Params(temperature=0.7, seed=3))
    b.run([(0, [1]), (5, [2])])
    h = torch.zeros(2, 4)
    b.mtp([(0, h, [1, 2], 7), (5, h, [3, 4], 9)])
    table.set(5, Params(temperature=0.9, seed=1, exact_policy=REJECTION), proposing=True)  # host records
    b.mtp([(0, h[:1], [1], 7), (5, h[:1], [3], 9)])
    b.run([(0, [1]), (5, [2])])
    assert log == [
        ("rowsb", (4, 3)),
        ("rowsb", (4, 3)),
        ("rowsbs", (2, 1)),
        ("mtpbs", (2, 2)),
        ("eager mtp", (2, 1)),
        ("eager rows", (2, 1)),
    ]


def test_a_pass_never_exceeds_max_rows():
    from baton.engine.fused_blocks import MAX_ROWS, BatchedRows

    runner = SimpleNamespace(
        device=torch.device("cpu"), cfg=SimpleNamespace(hidden_size=4), dtype=torch.float32, sampling=None
    )
    b = BatchedRows(runner, 128)
    for n in range(1, 17):
        assert b.buckets(n) and max(b.buckets(n)) * n <= MAX_ROWS, n
    assert b.buckets(1)[-1] == 128 and b.buckets(9)[-1] == 32 and b.buckets(11)[-1] == 16  # 32 x 9 <= 320 < 32 x 11
