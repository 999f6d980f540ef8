"""The fused batched rows blocks (baton/engine/fused_blocks.py: the batched verify on CUDA), checked on CPU
through Triton's interpreter: several sessions' blocks in one pass (one per block length) leave each
block's picks, hidden rows, logprobs and slot state bitwise those of the block alone, and a batched
verify_blocks with row checkpoints equals verify_block of each block alone, cut blocks included; the
MTP chains of several sessions together (decode_worker/mtp.py: chains) equal each chain alone."""

from __future__ import annotations

import pytest
from helpers import interp_job, run_interp_script

pytest.importorskip("triton")
# the interpreted run starts in the background at collection (tests/prestart.py)
PRESTART = {"test_batched_blocks_equal_each_block_alone": lambda: interp_job("fused_blocks_interp.py")}
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_batched_blocks_equal_each_block_alone():
    res = run_interp_script("fused_blocks_interp.py", timeout=280)
    assert res.pop("compiles_sm90") is True  # every launch also compiles for the H200 (tests/launch_record.py)
    assert res["rows"] == {"equal": True, "logprobs_equal": True, "outside_untouched": True}, res
    # the three cut blocks were rewound by one GDN-only replay of their kept rows (BatchedRows.replay_kept)
    # (and the bytes it kept are those kept_inputs_bytes_of reserves in the workers' memory plans)
    assert res["verify"] == {"equal": True, "accepted": [3, 1, 0, 0], "replays": 1, "counted": True}, res
    assert res["mtp"] == {"equal": True, "kv_equal": True, "drafts": [2, 1, 2, None], "on_device": 1}, res
    # the sessions drafting 3, 1, 2, 3: one on-device chain each run, bitwise the host-chained steps
    for name in ("own", "forced"):
        assert res["mtp_device"][name] == {"equal": True, "kv_equal": True, "on_device": 1}, res
    # a rejection-policy drafting slot (exact mode at T > 0): the same drafts and the same q' recorded
    want = {"equal": True, "kv_equal": True, "on_device": 1, "positions": [9, 10, 11], "proposals_equal": True}
    assert res["mtp_device"]["rejection"] == want, res
    # one session alone (BATON_MTP_CHAIN_ONE=1): its chain on the device, bitwise its host-chained steps
    assert res["mtp_device"]["one"] == {"equal": True, "kv_equal": True, "on_device": 1}, res
    # exact mode's bf16 / fp8 drafts, their steps launched ahead of their reads: bitwise each session alone
    for name in ("own", "forced"):
        assert res["ar_drafts"][name] == {"equal": True, "state_equal": True, "pipelined": 1}, res
    assert res["ar_drafts"]["forced_kept"] is True, res
    assert res["mtp_device"]["forced_kept"] is True and res["mtp_device"]["drafts"] == [3, 1, 2, 3], res
