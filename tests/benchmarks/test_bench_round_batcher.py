"""benchmarks/bench_round_batcher.py runs and sends each lockstep round as about one DraftMany."""

from __future__ import annotations

from benchmarks import bench_round_batcher


def test_a_round_of_sessions_is_one_rpc_and_costs_less_cpu_than_unary_calls():
    r = bench_round_batcher.main(["--sessions", "8", "--rounds", "20"])
    unary, batched = r["points"]
    assert (unary["mode"], batched["mode"]) == ("unary", "batched") and unary["rpcs_per_round"] == 8
    assert batched["rpcs_per_round"] <= 2  # a round may split at most once in 20 (a late thread)
    assert batched["cpu_us_per_session_round"] < unary["cpu_us_per_session_round"]
