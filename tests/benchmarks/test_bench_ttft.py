"""benchmarks/bench_ttft.py on CPU with the embedded default model and tiny prompts: a smoke test of the
whole path (prefill alone, Prefill RPC + hand-off to a real decode worker) and of the JSON it writes."""

import json
import math

import pytest
import torch

from baton.engine.runner import ModelRunner
from baton.handoff import timeline
from baton.loading import DEFAULT_MODEL_DIR, load_model
from benchmarks import bench_ttft

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def state_bytes(T: int, max_len: int, mtp_kv: bool = False) -> int:
    """The byte count a T-token prefill ships, computed independently of the benchmark: the exported
    state, less the MTP KV rows unless the request's engine can read them (the default: a bf16 request)."""
    lm = load_model(DEFAULT_MODEL_DIR, dtype="fp32", mtp=None)
    r = ModelRunner(lm.model, slots=1, max_len=max_len, width=bench_ttft.WIDTH)
    r.prefill(0, list(range(1, T + 1)))
    return sum(
        t.tensor.numel() * t.tensor.element_size() for t in r.state.export(0) if mtp_kv or not t.name.startswith("mtp.")
    )


def chunk_count(nbytes: int, workers: dict, T: int) -> int:
    """Data chunks of a bf16 request's hand-off (encode.chunk_plan over the shipped tensors)."""
    from baton.handoff.encode import chunk_plan
    from baton.handoff.progress import tail_offset
    from baton.handoff.wire import TensorDesc

    lm = load_model(DEFAULT_MODEL_DIR, dtype="fp32", mtp=None)
    r = ModelRunner(lm.model, slots=1, max_len=workers["max_len"], width=bench_ttft.WIDTH)
    r.prefill(0, list(range(1, T + 1)))
    specs = [TensorDesc.of(t) for t in r.state.export(0) if not t.name.startswith("mtp.")]
    tail = round(workers["tail_chunk_mib"][0] * (1 << 20))
    return chunk_plan(nbytes, workers["chunk_bytes"], tail_offset(specs, workers["tail_layers"]), tail).count


def test_bench_ttft_cpu_smoke(tmp_path):
    out = tmp_path / "ttft.json"
    res = bench_ttft.main(
        [
            "--device",
            "cpu",
            "--prompts",
            "8,40",
            "--runs",
            "2",
            "--warmup",
            "1",
            "--matmul-n",
            "128",
            "--decode-worker",
            "process,in-process",
            "--sender",
            "process,thread",
            "--out",
            str(out),
        ]
    )
    assert json.loads(out.read_text()) == res
    assert res["command"].startswith("python benchmarks/bench_ttft.py --device cpu")
    assert res["date"] and res["torch"] == torch.__version__ and res["machine"]["cores_usable"] >= 1
    assert res["device"] == "cpu" and res["model"]["has_mtp"] and res["matmul"]["tflops"] > 0
    assert [r["prompt_tokens"] for r in res["results"]] == [8, 40]
    assert res["workers"]["decode_worker"] == ["process", "in-process"]
    assert res["workers"]["handoff_sender"] == ["process", "thread"]
    for r in res["results"]:
        for k in (
            "prefill_s",
            "split_s",
            "handoff_s",
            "handoff_GBps",
            "handoff_wall_s",
            "server_prefill_s",
            "flops",
            "achieved_tflops",
            "mfu",
        ):
            assert r[k] > 0, (k, r)
        assert len(r["prefill_s_runs"]) == len(r["split_s_runs"]) == 2
        assert r["decode_worker"] == "process" and set(r["by_decode_worker"]) == {"process", "in-process"}
        assert r["sender"] == "process" and set(r["by_sender"]) == {"process", "thread"}
        assert set(r["by_decode_worker_and_sender"]) == {
            "process/process",
            "process/thread",
            "in-process/process",
            "in-process/thread",
        }
        assert r["by_sender"]["thread"] == r["by_decode_worker_and_sender"]["process/thread"]
        assert all(r["by_decode_worker"]["process"][k] == r[k] for k in ("split_s", "handoff_s", "split_s_runs"))
        for m in r["by_decode_worker"].values():
            assert m["split_s"] > 0 and m["handoff_GBps"] > 0 and len(m["handoff_s_runs"]) == 2
        # the pct is rounded to 0.01 from unrounded seconds; split_s / prefill_s are rounded to 1 us, which
        # moves the recomputed pct by up to 100 * 1e-6 * (1 + split/prefill) / prefill (ms-scale CPU prefills)
        slack = 0.005 + 100 * 1e-6 * (1 + r["split_s"] / r["prefill_s"]) / r["prefill_s"]
        assert r["split_overhead_pct"] == pytest.approx(100 * (r["split_s"] / r["prefill_s"] - 1), abs=slack)
        assert r["state_bytes"] == state_bytes(r["prompt_tokens"], res["workers"]["max_len"])
        assert r["state_bytes"] == sum(r["state_bytes_by_kind"].values())
        assert r["data_chunks"] == chunk_count(r["state_bytes"], res["workers"], r["prompt_tokens"])
        assert r["tail_chunk_mib"] == 1 and set(r["by_tail_chunk_mib"]) == {"1"}  # the settings' default
        assert len(r["by_decode_worker_sender_and_tail"]) == 4
        for key, m in r["by_decode_worker_sender_and_tail"].items():
            assert_tail(m, process_sender=key.split("/")[1] == "process")
        assert r["tail_ms"] == r["by_decode_worker_sender_and_tail"]["process/process/1"]["tail_ms"]
    assert res["workers"]["timeline"] and res["workers"]["timeline_clock"] == timeline.CLOCK_ID
    a, b = res["results"]  # 32 more tokens: KV of the attention layers (not the MTP layer's), K and V, fp32
    cfg = load_model(DEFAULT_MODEL_DIR, dtype="fp32", mtp=None).cfg
    per_token = 2 * len(cfg.attn_layers) * cfg.num_key_value_heads * cfg.head_dim * 4
    assert b["state_bytes"] - a["state_bytes"] == 32 * per_token


def assert_tail(m: dict, process_sender: bool) -> None:
    """A summary's hand-off timeline: every mark of its sender (+ the client's), finite, one clock, medians
    ordered, each run in the order causality imposes (baton.handoff.timeline.CHAINS), backlogs within the chunks."""
    want = set(timeline.MARKS) - (set() if process_sender else timeline.PROCESS_SENDER_ONLY) | {"client.reply"}
    tail, runs = m["tail_ms"], m["tail_ms_runs"]
    assert set(tail) == set(runs) == want, set(tail) ^ want
    assert m["tail_clock_shared"] and m["tail_ordered"]
    assert tail["prefill.compute_end"] == 0 and all(math.isfinite(v) for v in tail.values())
    assert list(tail.values()) == sorted(tail.values())
    assert all(len(v) == len(m["split_s_runs"]) and all(map(math.isfinite, v)) for v in runs.values())
    for i in range(len(m["split_s_runs"])):
        for chain in timeline.CHAINS:
            got = [runs[k][i] for k in chain if k in runs]
            assert got == sorted(got), (i, chain, got)
        # the whole hand-off's tail lies inside the split time the client measured
        assert runs["client.reply"][i] - runs["prefill.rpc_start"][i] <= m["split_s_runs"][i] * 1e3
    assert tail["prefill.rpc_start"] < 0 < tail["decode.loaded"] < tail["client.reply"]
    series = {"sender.handed", "decode.received"} | ({"prefill.staged"} if process_sender else set())
    assert set(m["tail_backlog"]) == series and all(0 <= v <= m["data_chunks"] for v in m["tail_backlog"].values())


def test_bench_ttft_no_timeline(tmp_path):
    """--no-timeline: the Prefill RPC does not ask for one, so no tail_* fields (the rest as usual).
    --request-engine unspecified: the MTP KV is shipped too (the decode worker's default may read it)."""
    res = bench_ttft.main(
        [
            "--device",
            "cpu",
            "--prompts",
            "8",
            "--runs",
            "1",
            "--warmup",
            "0",
            "--matmul-n",
            "64",
            "--decode-worker",
            "in-process",
            "--sender",
            "process",
            "--no-timeline",
            "--request-engine",
            "unspecified",
        ]
    )
    (r,) = res["results"]
    assert not res["workers"]["timeline"] and r["split_s"] > 0
    assert res["workers"]["request_engine"] == "unspecified"
    assert (
        r["state_bytes"]
        == state_bytes(8, res["workers"]["max_len"], mtp_kv=True)
        > state_bytes(8, res["workers"]["max_len"])
    )
    assert not {"tail_ms", "tail_ms_runs", "tail_backlog", "tail_clock_shared", "tail_ordered"} & set(r)
    assert not {"tail_ms", "tail_ordered"} & set(r["by_sender"]["process"])


def test_bench_ttft_tail_chunk_sizes_side_by_side(tmp_path):
    """--tail-chunk-mib 0,1/64: without and with a 16 KiB tail segment (64 KiB chunks before it), measured
    interleaved; each summary has its data_chunks, the tail's as encode.chunk_plan says."""
    from baton.handoff.encode import chunk_plan
    from baton.handoff.progress import tail_offset
    from baton.handoff.wire import TensorDesc

    res = bench_ttft.main(
        [
            "--device",
            "cpu",
            "--prompts",
            "40",
            "--runs",
            "1",
            "--warmup",
            "0",
            "--matmul-n",
            "64",
            "--decode-worker",
            "in-process",
            "--sender",
            "thread",
            "--chunk-mib",
            "0.0625",
            "--tail-chunk-mib",
            "0,0.015625",
        ]
    )
    assert res["workers"]["tail_chunk_mib"] == [0, 0.015625] and res["workers"]["tail_layers"] == 1
    (r,) = res["results"]
    assert set(r["by_tail_chunk_mib"]) == {"0", "0.015625"} and r["tail_chunk_mib"] == 0
    assert set(r["by_decode_worker_sender_and_tail"]) == {"in-process/thread/0", "in-process/thread/0.015625"}
    assert r["by_tail_chunk_mib"]["0"] == r["by_sender"]["thread"]
    lm = load_model(DEFAULT_MODEL_DIR, dtype="fp32", mtp=None)
    runner = ModelRunner(lm.model, slots=1, max_len=res["workers"]["max_len"], width=bench_ttft.WIDTH)
    runner.prefill(0, list(range(1, 41)))
    specs = [TensorDesc.of(t) for t in runner.state.export(0) if not t.name.startswith("mtp.")]  # a bf16 request
    plan = chunk_plan(r["state_bytes"], 64 << 10, tail_offset(specs, 1), 16 << 10)
    assert plan.tail_chunk_bytes and r["by_tail_chunk_mib"]["0.015625"]["data_chunks"] == plan.count
    assert r["by_tail_chunk_mib"]["0"]["data_chunks"] == -(-r["state_bytes"] // (64 << 10)) < plan.count
    for t in r["by_tail_chunk_mib"].values():
        assert t["split_s"] > 0 and t["handoff_GBps"] > 0
    with pytest.raises(SystemExit, match="--tail-chunk-mib"):
        bench_ttft.main(["--device", "cpu", "--chunk-mib", "1", "--tail-chunk-mib", "2"])


def test_bench_ttft_decode_gpu_needs_cuda_and_a_process_worker():
    for argv in (
        ["--device", "cpu", "--decode-gpu", "1"],
        ["--device", "cuda", "--decode-gpu", "1", "--decode-worker", "process,in-process"],
    ):
        with pytest.raises(SystemExit, match="--decode-gpu"):
            bench_ttft.main(argv)


def test_prefill_flops_leave_out_the_mtp_layer_when_the_prefill_skips_it():
    m = load_model(DEFAULT_MODEL_DIR, dtype="fp32").model
    cfg, T = m.cfg, 8
    mtp_params = sum(p.numel() for n, p in m.named_parameters() if n.startswith("mtp.") and p.dim() >= 2)
    attn = 4 * cfg.head_dim * cfg.num_attention_heads * T * (T + 1) // 2
    assert mtp_params > 0
    assert bench_ttft.prefill_flops(m, T) - bench_ttft.prefill_flops(m, T, mtp=False) == 2 * mtp_params * T + attn
