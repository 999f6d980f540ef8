"""benchmarks/bench_verify_under_prefill.py, run small on a tiny checkpoint: both phases verify, the long
prompt runs in its pieces, one JSON object with the command and machine."""

import json

from helpers import make_tiny_dir


def test_bench_verify_under_prefill_cpu_smoke(tmp_path, capsys):
    from benchmarks import bench_verify_under_prefill as b

    d = make_tiny_dir(tmp_path, seed=3)
    argv = ["--model", str(d), "--long", "96", "--chunk", "16", "--sessions", "2", "--prompt", "8", "--alone-s", "0.3"]
    res = b.main(argv)
    assert json.loads(capsys.readouterr().out) == res
    assert res["pieces"] == 6 and res["chunk"] == 16 and res["sessions"] == 2
    assert res["verify_alone"]["verifies"] > 0 and res["verify_during_long_prefill"]["verifies"] > 0
    assert res["long_prefill_s"]["alone"] > 0 and res["command"].endswith(" ".join(argv)) and res["machine"]["cpu"]
