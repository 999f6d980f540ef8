"""benchmarks/sim_draft_length.py: the controller's model under a heavy batch prints its JSON, and plain rounds'
figures there are the controller's ceiling: the adaptive policy spends a small share on speculative rounds
where they cannot pay (assumed costs: a K = 4 round of 28 sessions ~12x a plain step) and stays within 5% of
plain rounds (issue 21's bound), while dear probes at the old 5% share spend more."""

from __future__ import annotations

import json

from benchmarks import sim_draft_length


def _run(capsys, *argv) -> dict:
    assert sim_draft_length.main(["--seeds", "3", "--rounds", "1200", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_model_prints_its_json_and_the_controller_stays_near_plain_rounds(capsys):
    got = _run(capsys)
    assert got["benchmark"] == "sim_draft_length" and got["plain"]["spec_share"] == 0.0
    assert got["adaptive"]["spec_share"] < 0.05 and got["adaptive_over_plain"] >= 0.95, got
    old = _run(capsys, "--probe-share", "0.05")
    assert old["adaptive"]["spec_share"] > got["adaptive"]["spec_share"], (old, got)


def test_a_closed_loops_waves_keep_the_controller_within_issue_21s_bound_of_plain_rounds(capsys):
    """--waves: 32 clients whose requests end in waves (the batch drops to a few, then a wave joins). Every
    seed within 6% of plain rounds; before a switch probe's loss marked its batch (2026-12-07) the worst of
    these seeds was at 0.85 (benchmarks/results/sim-draft-length-waves-cpu-2026-12-07.json)."""
    got = _run(capsys, "--waves", "--seeds", "4")
    assert got["adaptive"]["spec_share"] > 0.0 and len(got["adaptive"]["tok_s_by_seed"]) == 4
    assert got["worst_seed_over_plain"] >= 0.93 and got["adaptive_over_plain"] >= 0.95, got
