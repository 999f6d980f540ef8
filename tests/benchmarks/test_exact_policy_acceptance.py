"""benchmarks/exact_policy_acceptance.py, run small: both policies' rounds over loopback gRPC, one JSON object."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


def test_exact_policy_acceptance_prints_both_policies(capsys):
    import exact_policy_acceptance

    argv = ["--prompts", "1", "--seeds", "1", "--new", "12", "--temperatures", "1.0", "--engines", "fp8"]
    assert exact_policy_acceptance.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    c, r = out["results"]["fp8/T1.0/coupling"], out["results"]["fp8/T1.0/rejection"]
    for cell in (c, r):
        assert cell["tokens"] >= 12 and 1.0 <= cell["mean_tokens_per_round"] <= 5.0
    assert c["proposal_support"] is None and 1 <= r["proposal_support"]["max"] <= 512
    assert r["mean_draft_response_bytes"] > 50 * c["mean_draft_response_bytes"]  # q' travels, only there
    assert out["dense_q_bytes_per_draft"] == 4 * out["vocab"] and out["command"] and out["date"]
