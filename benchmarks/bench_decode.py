"""Batch-1 decode benchmark: Baton bf16 / fp8 / mtp (CUDA graphs) vs HF `generate` vs the bandwidth
floor, side by side in one run. Prints one JSON object (and writes it with --out).

    python benchmarks/bench_decode.py --random-init qwen3.5-9b --contexts 512,8192 --new 256 --out R.json
    ... --no-pipeline      bf16 / fp8 with the plain AR loop
    ... --pipeline-ab      bf16 / fp8 timed with both loops in the same run

What the figures mean:
    tok_s            the loop the decode worker runs: by default (--pipeline, as `python -m decode_worker`)
                     bf16 / fp8 use the pipelined AR loop (ModelRunner(pipeline=True)); with --no-pipeline
                     the plain loop. The top-level "pipeline" says which (files written before 2026-12
                     have "pipeline": false: their tok_s is the plain loop). mtp never pipelines.
    with --pipeline-ab, bf16 / fp8 rows also get (both loops timed, the other one on its own runners):
    tok_s_pipelined  the pipelined loop   (== tok_s when "pipeline" is true)
    tok_s_plain      the plain loop       (== tok_s when "pipeline" is false)
    tokens_equal_plain  the pipelined loop's tokens == the plain loop's
Every row also has "pipelined": whether its tok_s is the pipelined loop.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import platform
import socket
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from baton.engine import graph  # noqa: E402
from baton.engine.runner import ModelRunner  # noqa: E402
from baton.loading import random_model  # noqa: E402
from baton.random_init import shape  # noqa: E402
from benchmarks.baselines import hbm_bandwidth, hf_model  # noqa: E402
from benchmarks.baselines import hf_generate as baselines_hf_generate  # noqa: E402
from benchmarks.report import emit  # noqa: E402
from decode_worker.engine import DecodeEngine  # noqa: E402
from prefill_worker.engine import ExactEngine  # noqa: E402


def step_bytes(model, state, context: int) -> int:
    """Bytes one decode step must read: projection weights and the LM head as stored (bf16 or fp8),
    one embedding row, the GDN state (read + write) and the KV rows up to the context."""
    cfg = model.cfg
    fp8_head = getattr(model, "fp8_head", None) is not None
    w = 0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if name.startswith("mtp.") or "embed_tokens" in name or t.dim() < 2:
            continue
        if fp8_head and name == "lm_head.weight":
            continue
        w += t.numel() * t.element_size()
    if cfg.tie_word_embeddings and not fp8_head:
        w += cfg.vocab_size * cfg.hidden_size * 2
    gdn = sum(t[0].numel() * t.element_size() for t in state.recurrent.values()) * 2
    kv = state.kv_bytes_per_token() * context
    return w + gdn + kv + cfg.hidden_size * 2


def time_decode(eng: DecodeEngine, exact: ExactEngine, prompt: list[int], engine: str, new: int, runs: int, k: int = 4):
    s, first = exact.prefill(prompt)
    tensors, pos, nxt = exact.export(s.id)
    host = {t.name: t.tensor.clone() for t in tensors}
    exact.release(s.id)
    rates, toks, accept = [], None, 0.0
    for i in range(runs + 1):
        sess = eng.load(host, position=pos, next_token=nxt, engine=engine)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = [t for b in eng.decode(sess.id, new, k=k) for t in b]
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        accept = sess.mean_accept_len
        eng.release(sess.id)
        if i:  # run 0 is warm-up
            rates.append(len(out) / dt)
        toks = toks or out
        assert out == toks, "decode is not repeatable"
    return statistics.median(rates), [first] + toks, accept


def hf_generate(model, cfg, prompt: list[int], new: int, runs: int) -> float:
    """HF `generate` at batch 1 on the same weights: end-to-end tok/s (benchmarks/baselines.py)."""
    hf = hf_model(model, cfg)
    rate = baselines_hf_generate(hf, [prompt], new, runs)["tok_s"]
    del hf
    torch.cuda.empty_cache()
    return rate


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--random-init", default="qwen3.5-9b")
    p.add_argument("--contexts", default="512,8192")
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--engines", default="bf16,fp8,mtp")
    p.add_argument("--hf-new", type=int, default=32)
    p.add_argument("--no-hf", action="store_true")
    p.add_argument(
        "--pipeline",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="tok_s of bf16 / fp8 with ModelRunner(pipeline=True), the decode worker's default: the "
        "next AR step launched before the token is read (--no-pipeline: the plain AR loop)",
    )
    p.add_argument(
        "--pipeline-ab",
        action="store_true",
        help="also time bf16 / fp8 with the other loop in the same run: rows get tok_s_pipelined, "
        "tok_s_plain and tokens_equal_plain",
    )
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    torch.manual_seed(0)
    cfg = shape(a.random_init)
    contexts = [int(c) for c in a.contexts.split(",")]
    engines = a.engines.split(",")
    res = {
        "command": " ".join(["python", "benchmarks/bench_decode.py"] + (argv or sys.argv[1:])),
        "date": datetime.date.today().isoformat(),
        "host": socket.gethostname(),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "shape": a.random_init,
        "new_tokens": a.new,
        "runs": a.runs,
        "pipeline": a.pipeline,
        "results": [],
    }
    bw = hbm_bandwidth()
    res["hbm_bytes_per_s"] = bw
    lm = random_model(cfg, dtype="bf16", device="cuda", seed=0, mtp="mtp" in engines)
    max_len = max(contexts) + a.new + 64
    t0 = time.perf_counter()
    runner = ModelRunner(lm.model, slots=1, max_len=max_len, width=16, pipeline=a.pipeline)
    gs = graph.capture_all(runner, max_draft=4)
    res["capture"] = {"bf16": {"graphs": gs.graphs, "seconds": gs.seconds, "pool_bytes": gs.pool_bytes}}
    runners = {"bf16": runner}
    if "mtp" in engines:
        runners["mtp"] = runner
    exact = ExactEngine(ModelRunner(lm.model, slots=1, max_len=max_len, width=16))
    if "fp8" in engines:
        from decode_worker.fp8 import quantize_model

        m8 = copy.deepcopy(lm.model)
        if hasattr(m8, "mtp"):
            del m8.mtp
        res["fp8_quant"] = quantize_model(m8, "full")
        r8 = ModelRunner(m8, slots=1, max_len=max_len, width=16, pipeline=a.pipeline)
        gs8 = graph.capture_all(r8, max_draft=4)
        res["capture"]["fp8"] = {"graphs": gs8.graphs, "seconds": gs8.seconds, "pool_bytes": gs8.pool_bytes}
        runners["fp8"] = r8
    res["setup_seconds"] = time.perf_counter() - t0
    eng = DecodeEngine(runners, default_engine="bf16")
    eng_ab = None
    if a.pipeline_ab:  # the same models, runners with the other loop (ping-pong buffers + ar0 / ar1 graphs or not)
        ab = {
            e: ModelRunner(runners[e].model, slots=1, max_len=max_len, width=16, pipeline=not a.pipeline)
            for e in ("bf16", "fp8")
            if e in runners
        }
        for r in ab.values():
            graph.capture_all(r, max_draft=4)
        eng_ab = DecodeEngine(ab, default_engine="bf16")
    g = torch.Generator().manual_seed(1)
    for ctx in contexts:
        prompt = torch.randint(0, cfg.vocab_size, (ctx,), generator=g).tolist()
        bf16_tokens = None
        for e in engines:
            runs = a.runs if ctx <= 8192 else max(3, a.runs // 2)
            rate, toks, acc = time_decode(eng, exact, prompt, e, a.new, runs)
            floor_b = step_bytes(runners[e].model, runners[e].state, ctx)
            row = {
                "engine": e,
                "context": ctx,
                "tok_s": rate,
                "floor_tok_s": bw / floor_b,
                "pct_of_floor": rate * floor_b / bw,
                "bytes_per_step": floor_b,
                "pipelined": e != "mtp" and runners[e].state.pingpong,
            }
            if e == "mtp":
                row["mean_accept_len"] = acc
            if eng_ab is not None and e in eng_ab.runners:
                rate_ab, toks_ab, _ = time_decode(eng_ab, exact, prompt, e, a.new, runs)
                (rate_pp, toks_pp), (rate_plain, toks_plain) = (
                    ((rate, toks), (rate_ab, toks_ab)) if row["pipelined"] else ((rate_ab, toks_ab), (rate, toks))
                )
                row.update(tok_s_pipelined=rate_pp, tok_s_plain=rate_plain, tokens_equal_plain=toks_pp == toks_plain)
            if e == "bf16":
                bf16_tokens = toks
            if e == "mtp" and bf16_tokens is not None:
                row["tokens_equal_bf16"] = toks == bf16_tokens
            res["results"].append(row)
            print(json.dumps(row), flush=True)
    res["peak_gpu_bytes"] = torch.cuda.max_memory_allocated()
    if not a.no_hf:
        prompt = torch.randint(0, cfg.vocab_size, (contexts[0],), generator=g).tolist()
        res["hf_generate"] = {
            "context": contexts[0],
            "new_tokens": a.hf_new,
            "tok_s": hf_generate(lm.model, cfg, prompt, a.hf_new, 3),
        }
    emit(res, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
