"""benchmarks/bench_bridge.py on CPU with a short context: the receiver in a child process (the default)
and in this process both carry the whole state, and the JSON says which topology ran."""

import json

from benchmarks import bench_bridge


def test_bench_bridge_receiver_process_and_in_process(tmp_path):
    out = tmp_path / "bridge.json"
    res = bench_bridge.main(
        [
            "--tokens",
            "16",
            "--repeats",
            "1",
            "--chunk-mib",
            "1",
            "--paths",
            "e2e_frames,e2e_frames_receiver_in_process,e2e_frames_sender_process,ceiling_grpc_raw_frames",
            "--out",
            str(out),
        ]
    )
    assert json.loads(out.read_text()) == res
    assert res["receiver"] == "process"
    assert set(res["results"]) == {
        "e2e_frames",
        "e2e_frames_receiver_in_process",
        "e2e_frames_sender_process",
        "ceiling_grpc_raw_frames",
    }
    assert all(r["best_GBps"] > 0 for r in res["results"].values())
    res = bench_bridge.main(["--tokens", "16", "--repeats", "1", "--receiver", "in-process", "--paths", "e2e_frames"])
    assert res["receiver"] == "in-process" and set(res["results"]) == {"e2e_frames"}


def test_bench_bridge_tail_segment():
    """--tail-chunk-mib: the last layer's bytes (+ hidden) in 64 KiB chunks, through both senders."""
    res = bench_bridge.main(
        [
            "--tokens",
            "16",
            "--repeats",
            "1",
            "--chunk-mib",
            "1",
            "--tail-chunk-mib",
            "0.0625",
            "--receiver",
            "in-process",
            "--paths",
            "e2e_frames,e2e_frames_sender_process",
        ]
    )
    st = res["state"]
    assert st["tail_chunk_bytes"] == 64 << 10 and 0 < st["tail_from"] < st["total_bytes"]
    assert st["tail_from"] % (1 << 20) == 0
    assert st["data_chunks"] == st["tail_from"] // (1 << 20) + -(-(st["total_bytes"] - st["tail_from"]) // (64 << 10))
    assert all(r["best_GBps"] > 0 for r in res["results"].values())
