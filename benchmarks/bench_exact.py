"""Exact mode through the router, side by side with bf16 AR, with workers as processes over loopback gRPC.

    python benchmarks/bench_exact.py --random-init qwen3.5-9b --device cuda --prompt-len 512 --new 128 \\
        --runs 5 --ks 4,8 --ps 0.8,0.9,0.95,0.99 --out exact.json
    python benchmarks/bench_exact.py --new 16 --runs 1 --ks 4 --ps 0.5,1.0      # CPU, embedded tiny model

Topology (`baton serve --processes` without Ray, as on the GPU host): one prefill worker
(`python -m prefill_worker`), one decode worker (`python -m decode_worker`, engines bf16,fp8,mtp) and one
controlled decode worker (`python -m benchmarks.controlled_decode_worker`, engine fp8), each its own
process on --device, given the same --random-init SHAPE --seed N (bitwise the same weights, the same
fingerprint) or the same --model DIR. Two routers run in this process (as `baton serve` runs its
router): router A over prefill + decode, router B over prefill + controlled decode. The client streams
Generate from them over loopback gRPC; every request uses ignore_eos, so every run yields --new tokens.

What is measured, in this order (so that a run cut short still has the main figures; the JSON file is
rewritten after each phase). tok/s = (new - 1) / (last token - first token) at the client: decode
throughput after the first token, which both modes get from Prefill; median of --runs, after --warmup
runs of --warmup-new tokens per configuration.
  1. bf16 AR: fast mode, engine bf16 (router A). Its tokens are THE reference: bf16 fast decode is
     bitwise the exact engine's AR (docs/CONTRACTS.md). fp8 AR (fast, engine fp8) is reported too.
  2. exact mode with the acceptance-controlled drafter (router B) at each p in --ps, K in --ks (largest
     K first): every draft row still runs on the fp8 model; each proposal is the reference token with
     probability p (benchmarks/controlled_decode_worker.py).
  3. costs, by driving the same two workers directly (Prefill EXACT -> Draft / Verify over loopback
     gRPC, no router) for --cost-runs runs per (p, K), timing every RPC at the client:
       D[v]  Draft RPC of a full block K, by the verdict it carries: v = none (first round), full (m = K:
             one more row consumes d_K), skip (m = K-1: nothing to redo), back (m < K-1: restore the
             snapshot, one rows call of m+1 tokens);
       V[a]  Verify RPC of a full block, a = all (m = K) or rej (m < K: restore, re-advance m+1 rows);
       t_rpc a GetStats round trip (loopback unary gRPC, no compute).
     Derived: t_draft = (D[full] - t_rpc) / (K + 1)  (one fp8 rows step, Python and sync included: a
     full-block verdict is K+1 one-token rows calls), D[skip] = t_rpc + K t_draft unless >= 3 were timed,
     t_verify(K+1) = V[all] - t_rpc, t_fix = V[rej] - V[all], c_full|back = D[full|back] - D[skip].
     D[none] (measured) prices the first round only.
  4. exact mode with real drafts (router A): engine fp8 and engine mtp (--drafters), K in --ks.
Every exact-mode output (real, controlled, direct) must be token-identical to the bf16 AR output;
otherwise the JSON says so ("mismatches"), stderr says FAIL, and the exit status is 1.

The bound (router/exact.py): a round is strictly sequential, Draft(k, verdict of the last round) on the
decode worker, then Verify([pending, d1..dk]) on the exact worker, then the tokens go to the client;
round r+1's Draft needs round r's verdict, so nothing overlaps. With independent proposals right with
probability p, the accepted prefix of a block of K has P(m) = p^m (1-p) (m < K), P(K) = p^K, and a round
yields m + 1 tokens (the correction or bonus token included):
    E(p, K)   = sum_{i=0..K} p^i = (1 - p^(K+1)) / (1 - p)                 tokens per round
    T(p, K)   = t_D + t_V                                                   seconds per round, where
    t_D       = t_rpc + K t_draft + p^K c_full + (1 - p^(K-1)) c_back       (the verdict of the last round)
    t_V       = t_rpc + t_verify(K+1) + (1 - p^K) t_fix
    bound     = E(p, K) / T(p, K)   (steady state; "bound_steady_tok_s")
i.e. E / (K t_draft + t_verify + t_rt) with t_rt = 2 t_rpc + p^K c_full + (1 - p^(K-1)) c_back +
(1 - p^K) t_fix. A finite run also has end effects: the router drafts k = min(K, remaining - 1) and the
last round may yield fewer tokens; "bound_tok_s" is the expectation of the same cost model over the
router's exact schedule for --new tokens (dynamic programme over remaining tokens and the last verdict;
a short block costs (K - k) t_draft less), and "measured_over_bound" = measured tok/s / bound_tok_s is the
target (>= 0.9): what the router loses to its own work. "bound_realized_tok_s" prices the rounds each
measured run actually had (its own acceptance draws), removing sampling noise from the ratio.
Router overhead per round = measured round time - (t_D + t_V) is reported as "router_overhead_ms".

Prints one JSON object (also to --out, rewritten after each phase with "complete": false until the end).
Run time, estimated for the 9B shape on one H200 with --new 128 --runs 5 --ks 4,8 and four p: start-up
1-1.5 min (three processes: random init, FP8 copies, CUDA graph capture), AR 0.5 min, controlled sweep with
the direct runs 2-2.5 min, real drafts 2-4 min (random weights: FP8 and MTP drafts are mostly rejected,
so those runs take ~1 round per token): 6-8 min in all. CPU, embedded tiny model, --new 16 --runs 1:
about 20-30 s. `baton bench` runs --new 512 --real-new 128: 128 tokens left one H200 configuration's
measured / bound at 0.892 on a round draw of 5.77 tokens against the expected 6.13 (session 6), and 4x
the tokens halve that spread; the controlled sweep then takes ~4x as long, the real drafts as before.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from baton.client import Client  # noqa: E402
from baton.rpc import make_channel  # noqa: E402
from baton.settings import Settings  # noqa: E402
from baton.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc  # noqa: E402
from benchmarks.topology import Cmd, child_env  # noqa: E402 (shared with bench_serve)
from deploy.processes import WorkerProcess, stop_processes, wait_serving  # noqa: E402

ENGINE_ENUM = {"bf16": common_pb2.BF16, "fp8": common_pb2.FP8, "mtp": common_pb2.MTP}


# ---------------------------------------------------------------- processes
def worker_args(a) -> list[str]:
    common = [
        "--device",
        a.device,
        "--max-len",
        a.max_len,
        "--width",
        a.width,
        "--slots",
        a.slots,
        "--grace",
        "1",
        "--port",
        "0",
        "--host",
        "127.0.0.1",
    ]
    if a.dtype:
        common += ["--dtype", a.dtype]
    if a.random_init:
        common += ["--random-init", a.random_init, "--seed", a.seed]
    elif a.model:
        common += ["--model", a.model]
    return common


# ---------------------------------------------------------------- measurements
def generate(
    client: Client, prompt: list[int], n: int, *, mode: str, engine: str, k: int = 0, timeout: float = 900.0
) -> dict:
    """One Generate stream; client-side timings. Messages after the first = rounds in exact mode."""
    t0 = time.perf_counter()
    toks, sizes, t_first, last = [], [], None, None
    for d in client.generate(
        token_ids=prompt, max_new_tokens=n, mode=mode, engine=engine, ignore_eos=True, draft_block=k, timeout=timeout
    ):
        now = time.perf_counter()
        if d.token_ids and t_first is None:
            t_first = now
        elif t_first is not None:
            sizes.append(len(d.token_ids))
        toks += d.token_ids
        last = d
    t_end = time.perf_counter()
    if len(toks) != n:
        raise RuntimeError(f"{mode}/{engine}: {len(toks)} tokens for max_new_tokens={n} (ignore_eos)")
    dec = t_end - t_first
    return {
        "tokens": toks,
        "decode_s": dec,
        "tok_s": (n - 1) / dec if dec > 0 else float("inf"),
        "e2e_tok_s": n / (t_end - t0),
        "ttft_ms": (t_first - t0) * 1e3,
        "sizes": sizes,
        "drafted": last.stats.get("drafted", 0),
        "accepted": last.stats.get("accepted", 0),
    }


def schedule(n: int, K: int, sizes: list[int]) -> list[tuple[int, int]]:
    """(k, m) of each round of a measured exact run: the router's k = max(1, min(K, remaining - 1));
    a round that yielded s tokens accepted m = s - 1 (the last round may be cut: m = min(s - 1, k))."""
    out, rem = [], n - 1
    for s in sizes:
        k = max(1, min(K, rem - 1))
        out.append((k, min(max(s - 1, 0), k)))
        rem -= s
    return out


def rounds_at_p1(n: int, K: int) -> int:
    rem, r = n - 1, 0
    while rem > 0:
        k = max(1, min(K, rem - 1))
        rem -= min(k + 1, rem)
        r += 1
    return r


class Direct:
    """The router's exact loop driven from here, straight to the workers: every RPC timed."""

    def __init__(self, prefill_addr: str, decode_addr: str, settings: Settings):
        self._pc, self._dc = make_channel(prefill_addr, settings), make_channel(decode_addr, settings)
        self.p = prefill_pb2_grpc.PrefillWorkerStub(self._pc)
        self.d = decode_pb2_grpc.DecodeWorkerStub(self._dc)
        self.decode_addr = decode_addr

    def close(self):
        self._pc.close()
        self._dc.close()

    def rpc_rtt(self, n: int = 50) -> float:
        ts = []
        for stub in (self.p, self.d):
            for _ in range(n):
                t0 = time.perf_counter()
                stub.GetStats(common_pb2.WorkerStatsRequest(), timeout=30)
                ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    def run(self, prompt: list[int], n: int, K: int, engine: str) -> dict:
        sid, e = uuid.uuid4().hex, ENGINE_ENUM[engine]
        t_start = time.perf_counter()
        r = self.p.Prefill(
            prefill_pb2.PrefillRequest(
                session_id=sid, prompt_ids=prompt, mode=common_pb2.EXACT, decode_target=self.decode_addr, engine=e
            ),
            timeout=600,
        )
        t0 = time.perf_counter()
        out, pending, rem, verdict, prev, rounds = [int(r.first_token)], int(r.first_token), n - 1, None, None, []
        try:
            while rem > 0:
                k = max(1, min(K, rem - 1))
                req = decode_pb2.DraftRequest(session_id=sid, k=k, engine=e, has_verdict=verdict is not None)
                if verdict is not None:
                    req.accepted, req.next_token = verdict
                ta = time.perf_counter()
                drafts = list(self.d.Draft(req, timeout=120).draft_tokens)
                tb = time.perf_counter()
                v = self.p.Verify(prefill_pb2.VerifyRequest(session_id=sid, tokens=[pending, *drafts]), timeout=120)
                tc = time.perf_counter()
                m, nxt = int(v.accepted), int(v.next_token)
                cls = (
                    "none"
                    if prev is None
                    else "full"
                    if prev[1] == prev[0]
                    else "skip"
                    if prev[1] == prev[0] - 1
                    else "back"
                )
                rounds.append({"k": k, "m": m, "v": cls, "D": tb - ta, "V": tc - tb})
                got = (drafts[:m] + [nxt])[:rem]
                out += got
                rem -= len(got)
                pending, verdict, prev = nxt, (m, nxt), (k, m)
            t_end = time.perf_counter()
        finally:
            for stub in (self.d, self.p):
                try:
                    stub.Release(common_pb2.ReleaseRequest(session_id=sid), timeout=10)
                except Exception:  # noqa: BLE001 - best effort
                    pass
        return {"tokens": out, "rounds": rounds, "tok_s": (n - 1) / (t_end - t0), "e2e_s": t_end - t_start}


def mean(xs):
    return statistics.fmean(xs) if xs else None


def cost_model(rounds: list[dict], K: int, t_rpc: float) -> dict:
    """Per-class mean RPC times of full-size (k = K) rounds -> the costs in the module doc."""
    full = [r for r in rounds if r["k"] == K]
    D = {c: [r["D"] for r in full if r["v"] == c] for c in ("none", "full", "skip", "back")}
    V = {"all": [r["V"] for r in full if r["m"] == K], "rej": [r["V"] for r in full if r["m"] < K]}
    est = []
    # one draft row: a full-block verdict is K+1 one-token rows calls (d_K consumed, then K drafts)
    if D["full"]:
        t_draft = (mean(D["full"]) - t_rpc) / (K + 1)
    elif D["skip"] or D["none"]:
        t_draft = (mean(D["skip"] or D["none"]) - t_rpc) / K
        est.append("t_draft from D[skip|none]")
    else:
        raise RuntimeError(f"K={K}: no full-size Draft timed")
    t_draft = max(t_draft, 0.0)
    d = {c: mean(D[c]) for c in D}
    if len(D["skip"]) < 3:  # rare (m = K-1): the model value is steadier than 1-2 samples
        d["skip"] = t_rpc + K * t_draft
        est.append("D[skip]")
    for c, model in (("none", d["skip"]), ("full", d["skip"] + t_draft), ("back", d["skip"] + t_draft)):
        if d[c] is None:
            d[c] = model
            est.append(f"D[{c}]")
    v = {c: mean(V[c]) for c in ("all", "rej")}
    if v["all"] is None and v["rej"] is None:
        raise RuntimeError(f"K={K}: no Verify timed")
    for c, o in (("all", "rej"), ("rej", "all")):
        if v[c] is None:
            v[c] = v[o]
            est.append(f"V[{c}]")
    return {
        "K": K,
        "t_rpc": t_rpc,
        "t_draft": t_draft,
        "t_verify": v["all"] - t_rpc,
        "t_fix": v["rej"] - v["all"],
        "c_full": d["full"] - d["skip"],
        "c_back": d["back"] - d["skip"],
        "D": d,
        "V": v,
        "samples": {"D": {c: len(x) for c, x in D.items()}, "V": {c: len(x) for c, x in V.items()}},
        "estimated": est,
    }


def d_cost(c: dict, k: int, v: str) -> float:
    return c["D"][v] - (c["K"] - k) * c["t_draft"]


def v_cost(c: dict, k: int, m: int) -> float:
    return c["V"]["all" if m == k else "rej"]


def bound_steady(c: dict, p: float, K: int) -> dict:
    E = float(K + 1) if p >= 1.0 else (1 - p ** (K + 1)) / (1 - p)
    tD = c["D"]["skip"] + p**K * c["c_full"] + (1 - p ** (K - 1)) * c["c_back"]
    tV = c["V"]["all"] + (1 - p**K) * c["t_fix"]
    return {"E_tokens_per_round": E, "t_round_ms": (tD + tV) * 1e3, "bound_steady_tok_s": E / (tD + tV)}


def bound_run(c: dict, p: float, K: int, n: int) -> float:
    """Expected tok/s of the router's schedule for n tokens under the cost model (module doc)."""

    @functools.lru_cache(maxsize=None)
    def T(rem: int, v: str) -> float:
        if rem <= 0:
            return 0.0
        k = max(1, min(K, rem - 1))
        tot = 0.0
        for m in range(k + 1):
            pm = p**m * ((1 - p) if m < k else 1.0)
            if pm == 0.0:
                continue
            nv = "full" if m == k else "skip" if m == k - 1 else "back"
            tot += pm * (d_cost(c, k, v) + v_cost(c, k, m) + T(rem - min(m + 1, rem), nv))
        return tot

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 4 * n + 100))
    return (n - 1) / T(n - 1, "none")


def bound_realized(c: dict, sched: list[tuple[int, int]], n: int) -> float:
    t, v = 0.0, "none"
    for k, m in sched:
        t += d_cost(c, k, v) + v_cost(c, k, m)
        v = "full" if m == k else "skip" if m == k - 1 else "back"
    return (n - 1) / t


# ---------------------------------------------------------------- the run
def machine(device: str) -> dict:
    import torch

    try:
        git = (
            subprocess.run(
                ["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True, text=True, timeout=10
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        git = None
    m = {
        "git": git,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "host": platform.node(),
    }
    if device.startswith("cuda") and shutil.which("nvidia-smi"):
        try:
            m["gpu"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return m


def model_config(a):
    from baton.config import ModelConfig

    if a.random_init:
        from baton.random_init import config_of

        return config_of(a.random_init)
    from baton.loading import resolve_model_dir

    return ModelConfig.from_hf(resolve_model_dir(a.model))


def make_prompt(a, cfg) -> list[int]:
    if not a.prompt_file:
        rng = random.Random(a.seed)
        return [rng.randrange(cfg.vocab_size) for _ in range(a.prompt_len)]
    from baton.loading import resolve_model_dir
    from baton.tokenizer import Tokenizer

    ids = Tokenizer.from_dir(resolve_model_dir(a.model)).encode(Path(a.prompt_file).read_text("utf-8"))
    if len(ids) < a.prompt_len:
        raise SystemExit(f"--prompt-file: {len(ids)} tokens, fewer than --prompt-len {a.prompt_len}")
    return ids[: a.prompt_len]


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--random-init",
        default=None,
        metavar="SHAPE",
        help="seeded random weights: qwen3.5-9b | tiny | a directory with config.json",
    )
    src.add_argument("--model", default=None, help="checkpoint directory (default: the embedded tiny model)")
    p.add_argument("--seed", type=int, default=0, help="--random-init weight seed; also the prompt and draw seed")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N (every worker on it)")
    p.add_argument(
        "--dtype", default=None, choices=["bf16", "fp32"], help="worker dtype (default: bf16 on cuda, fp32 on cpu)"
    )
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument(
        "--prompt-file",
        default=None,
        help="prompt = the first --prompt-len tokens of this text file (needs the model's tokenizer; "
        "default: uniform random ids)",
    )
    p.add_argument("--new", type=int, default=128, help="tokens per request (first token included)")
    p.add_argument(
        "--real-new",
        type=int,
        default=0,
        help="tokens per request of the real-draft runs (default: --new). Random weights give them ~1 "
        "token per round, so they are the slow runs; the controlled sweep's ratios want many "
        "tokens (its acceptance draws are its sampling noise), these do not",
    )
    p.add_argument("--runs", type=int, default=5, help="timed runs per configuration (median)")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs first, per configuration")
    p.add_argument("--warmup-new", type=int, default=32, help="tokens per warm-up run (at most --new)")
    p.add_argument("--ps", default="0.8,0.9,0.95,0.99", help="controlled-drafter acceptance probabilities")
    p.add_argument("--ks", default="4,8", help="draft blocks K (<= W-2; CUDA graphs exist for K <= 8)")
    p.add_argument("--drafters", default="fp8,mtp", help="real-draft engines for exact mode (subset of fp8,mtp)")
    p.add_argument(
        "--controlled-engine",
        default="fp8",
        choices=["fp8", "bf16", "mtp"],
        help="drafter whose real steps the controlled drafter runs (mtp: the MTP head's chain)",
    )
    p.add_argument("--cost-runs", type=int, default=1, help="direct (router-less) runs per (p, K) for the costs")
    p.add_argument("--width", type=int, default=16)
    p.add_argument("--max-len", type=int, default=0, help="worker window (default: prompt + new + 2W, to 64)")
    p.add_argument("--slots", type=int, default=2)
    p.add_argument("--threads", type=int, default=0, help="OMP_NUM_THREADS of the workers (0: unset)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds for the workers to come up")
    p.add_argument("--out", default="", help="also write the JSON here")
    a = p.parse_args(argv)
    a.ps_list = [float(x) for x in a.ps.split(",") if x.strip()]
    a.ks_list = [int(x) for x in a.ks.split(",") if x.strip()]
    a.drafter_list = [x.strip() for x in a.drafters.split(",") if x.strip()]
    a.real_new = a.real_new or a.new
    if a.new < 2 or a.runs < 1 or a.prompt_len < 1 or not 2 <= a.real_new <= a.new:
        p.error("--new must be >= 2, --real-new in 2..--new, --runs and --prompt-len >= 1")
    if not a.ks_list or any(not 1 <= k <= a.width - 2 for k in a.ks_list):
        p.error(f"--ks: each K must be in 1..{a.width - 2}")
    if any(not 0.0 <= x <= 1.0 for x in a.ps_list):
        p.error("--ps: probabilities in [0, 1]")
    a.warmup_new = max(2, min(a.warmup_new, a.new))
    if a.prompt_file and a.random_init:
        p.error("--prompt-file needs the tokenizer of --model (or the embedded model), not --random-init")
    if not a.max_len:
        a.max_len = -(-(a.prompt_len + a.new + 2 * a.width) // 64) * 64
    return a


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parse(argv)
    t_start = time.time()
    cfg = model_config(a)
    prompt = make_prompt(a, cfg)
    res = {
        "benchmark": "bench_exact",
        "complete": False,
        "command": "python " + " ".join(shlex.quote(x) for x in ["benchmarks/bench_exact.py", *argv]),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": machine(a.device),
        "setup": {
            "model": (
                f"random-init {a.random_init} seed {a.seed}"
                if a.random_init
                else (a.model or "embedded default (baton/assets/default-model)")
            ),
            "vocab": cfg.vocab_size,
            "layers": cfg.num_hidden_layers,
            "hidden": cfg.hidden_size,
            "device": a.device,
            "dtype": a.dtype or ("bf16" if a.device.startswith("cuda") else "fp32"),
            "prompt_len": a.prompt_len,
            "prompt": (
                f"first tokens of {a.prompt_file}" if a.prompt_file else f"uniform random ids, random.Random({a.seed})"
            ),
            "new_tokens": a.new,
            "real_draft_new_tokens": a.real_new,
            "runs": a.runs,
            "warmup": f"{a.warmup} run(s) of {a.warmup_new} tokens per configuration",
            "width": a.width,
            "max_len": a.max_len,
            "slots": a.slots,
            "ks": a.ks_list,
            "ps": a.ps_list,
            "controlled_engine": a.controlled_engine,
            "topology": "prefill, decode (bf16,fp8,mtp) and controlled-decode workers as processes; "
            "routers A (prefill+decode) and B (prefill+controlled) in the benchmark process; "
            "loopback gRPC, ignore_eos",
            "tok_s": "(new - 1) / (last token - first token) at the client, median over runs",
        },
        "bound_model": "round = Draft(k, last verdict) on the decode worker, then Verify(k+1) on the exact worker, "
        "sequential (router/exact.py); E(p,K) = sum_{i=0..K} p^i tokens per round; "
        "T = t_rpc + K t_draft + p^K c_full + (1-p^(K-1)) c_back + t_rpc + t_verify + (1-p^K) t_fix; "
        "bound_steady = E/T; bound_tok_s = the same cost model over the router's schedule for --new "
        "tokens (k = min(K, remaining-1)); see the module docstring",
        "mismatches": [],
    }

    def emit(final: bool = False) -> None:
        res["seconds_total"] = round(time.time() - t_start, 1)
        res["complete"] = final
        if a.out:
            Path(a.out).write_text(json.dumps(res, indent=1) + "\n")

    def check(label: str, toks: list[int], n: int | None = None) -> bool:
        want = ref[:n] if n else ref
        if toks == want:
            return True
        i = next((i for i, (x, y) in enumerate(zip(toks, want)) if x != y), min(len(toks), len(want)))
        res["mismatches"].append(
            {"what": label, "first_diff_index": i, "got": toks[i : i + 8], "want": want[i : i + 8]}
        )
        print(f"bench_exact: FAIL: {label} differs from bf16 AR at token {i}", file=sys.stderr, flush=True)
        return False

    def say(text: str) -> None:
        print(f"bench_exact: {text}", file=sys.stderr, flush=True)

    tmp = Path(tempfile.mkdtemp(prefix="bench_exact-"))
    ref_file = tmp / "reference.json"
    env = child_env(a.threads)
    common = worker_args(a)
    procs = [
        WorkerProcess(Cmd("prefill", "prefill_worker", common), env=env),
        WorkerProcess(
            Cmd("decode", "decode_worker", common + ["--engines", "bf16,fp8,mtp", "--engine", "bf16"]), env=env
        ),
        WorkerProcess(
            Cmd(
                "controlled",
                "benchmarks.controlled_decode_worker",
                ["--reference", ref_file, "--draft-seed", a.seed]
                + common
                + ["--engines", a.controlled_engine, "--engine", a.controlled_engine],
            ),
            env=env,
        ),
    ]
    routers, clients, direct = [], [], None
    settings = Settings()
    rc = 1
    try:
        from router.__main__ import serve_router, stop_router
        from router.service import ModelMeta, RouterConfig

        t0 = time.perf_counter()
        for w in procs:
            w.start()
        addrs = {w.spec.name: w.wait_ready(timeout=a.timeout, settings=settings) for w in procs}
        res["startup_s"] = round(time.perf_counter() - t0, 1)
        say(f"workers up in {res['startup_s']} s: {addrs}")
        meta = ModelMeta("bench", cfg.vocab_size, tuple(cfg.eos_token_ids), None)
        rcfg = RouterConfig(
            width=a.width,
            max_context=a.max_len,
            default_draft_block=min(4, a.width - 2),
            request_timeout_s=3600.0,
            call_timeout_s=300.0,
        )
        for dec in ("decode", "controlled"):
            h, s = serve_router(
                prefill=[addrs["prefill"]],
                decode=[addrs[dec]],
                meta=meta,
                settings=settings,
                config=rcfg,
                host="127.0.0.1",
                port=0,
            )
            routers.append((h, s))
            wait_serving(h.address, timeout=60, settings=settings, what=f"router ({dec})")
            clients.append(Client(h.address, settings=settings))
        A, B = clients

        def measure(client, label, mode, engine, k=0, check_tokens=True, new=a.new):
            for i in range(a.warmup):  # short warm-ups (first-call effects), checked against the prefix
                w = generate(client, prompt, min(a.warmup_new, new), mode=mode, engine=engine, k=k)
                if check_tokens:
                    check(f"{label} warm-up {i}", w["tokens"], min(a.warmup_new, new))
            runs = [generate(client, prompt, new, mode=mode, engine=engine, k=k) for _ in range(a.runs)]
            ok = all(check(f"{label} run {i}", r["tokens"], new) for i, r in enumerate(runs)) if check_tokens else None
            row = {
                "tok_s": statistics.median(r["tok_s"] for r in runs),
                "runs_tok_s": [r["tok_s"] for r in runs],
                "e2e_tok_s": statistics.median(r["e2e_tok_s"] for r in runs),
                "ttft_ms": statistics.median(r["ttft_ms"] for r in runs),
            }
            if ok is not None:
                row["identical_to_bf16_ar"] = ok
            if mode == "exact":
                dr, ac = sum(r["drafted"] for r in runs), sum(r["accepted"] for r in runs)
                nr = sum(len(r["sizes"]) for r in runs)
                row.update(
                    drafted=dr,
                    accepted=ac,
                    acceptance_rate=ac / dr if dr else 0.0,
                    rounds=nr,
                    tokens_per_round=(new - 1) * len(runs) / nr if nr else 0.0,
                    round_ms=statistics.median(r["decode_s"] / max(len(r["sizes"]), 1) for r in runs) * 1e3,
                )
            say(
                f"{label}: {row['tok_s']:.1f} tok/s"
                + (f", {row['tokens_per_round']:.2f} tokens/round" if mode == "exact" else "")
            )
            return row, runs

        # 1. the reference: bf16 AR (fast mode), and fp8 AR
        ref_run = generate(A, prompt, a.new, mode="fast", engine="bf16")
        ref = ref_run["tokens"]
        bf16, _ = measure(A, "bf16 AR", "fast", "bf16")
        res["bf16_ar"] = bf16
        res["fp8_ar"], _ = measure(A, "fp8 AR (fast, not exact)", "fast", "fp8", check_tokens=False)
        ref_file.write_text(
            json.dumps({"references": [{"prompt_len": len(prompt), "tokens": ref}], "p": 1.0, "seed": a.seed})
        )
        emit()

        # 2. exact mode, controlled drafter (largest K first); 3. costs from direct runs
        direct = Direct(addrs["prefill"], addrs["controlled"], settings)
        t_rpc = direct.rpc_rtt()
        res["t_rpc_ms"] = t_rpc * 1e3
        res["controlled"], res["costs"], raw = [], {}, {}
        for K in sorted(a.ks_list, reverse=True):
            for p in a.ps_list:
                ref_file.write_text(
                    json.dumps({"references": [{"prompt_len": len(prompt), "tokens": ref}], "p": p, "seed": a.seed})
                )
                row, runs = measure(B, f"exact controlled p={p} K={K}", "exact", a.controlled_engine, K)
                drs = [direct.run(prompt, a.new, K, a.controlled_engine) for _ in range(a.cost_runs)]
                for i, d in enumerate(drs):
                    check(f"direct controlled p={p} K={K} run {i}", d["tokens"])
                raw.setdefault(K, []).extend(r for d in drs for r in d["rounds"])
                row.update(
                    p=p,
                    K=K,
                    exact_over_bf16_ar=row["tok_s"] / bf16["tok_s"],
                    direct_tok_s=statistics.median(d["tok_s"] for d in drs),
                    direct_tokens_per_round=statistics.fmean((a.new - 1) / len(d["rounds"]) for d in drs),
                )
                row["_sched"] = [schedule(a.new, K, r["sizes"]) for r in runs]
                row["_decode_s"] = [r["decode_s"] for r in runs]
                if p >= 1.0:
                    row["rounds_expected_at_p1"] = rounds_at_p1(a.new, K) * len(runs)
                res["controlled"].append(row)
                emit()
            if K not in raw:  # --ps empty: no controlled runs
                continue
            cm = cost_model(raw[K], K, t_rpc)
            res["costs"][str(K)] = {
                k: (v * 1e3 if isinstance(v, float) and k.startswith(("t_", "c_")) else v)
                for k, v in cm.items()
                if k not in ("D", "V")
            }
            res["costs"][str(K)]["D_ms"] = {c: x * 1e3 for c, x in cm["D"].items()}
            res["costs"][str(K)]["V_ms"] = {c: x * 1e3 for c, x in cm["V"].items()}
            for row in res["controlled"]:
                if row["K"] != K:
                    continue
                p = row["p"]
                row.update(bound_steady(cm, p, K))
                row["bound_tok_s"] = bound_run(cm, p, K, a.new)
                row["measured_over_bound"] = row["tok_s"] / row["bound_tok_s"]
                real = [bound_realized(cm, s, a.new) for s in row["_sched"]]
                row["bound_realized_tok_s"] = statistics.median(real)
                row["measured_over_bound_realized"] = statistics.median(
                    (a.new - 1) / ds / b for ds, b in zip(row["_decode_s"], real)
                )
                row["router_overhead_ms"] = (
                    statistics.median(
                        (ds - (a.new - 1) / b) / len(s) for ds, b, s in zip(row["_decode_s"], real, row["_sched"])
                    )
                    * 1e3
                )
                row["measured_over_bound_steady"] = row["tok_s"] / row["bound_steady_tok_s"]
                del row["_sched"], row["_decode_s"]
            emit()

        # 4. exact mode, real drafts (last: with random weights these are the slowest runs)
        offered = A.model_info().engines
        res["exact_real"] = []
        for eng in a.drafter_list:
            if ENGINE_ENUM[eng] not in offered:
                res["exact_real"].append({"drafter": eng, "skipped": "not offered by the decode worker"})
                continue
            for K in a.ks_list:
                row, _ = measure(A, f"exact {eng} drafts K={K}", "exact", eng, K, new=a.real_new)
                res["exact_real"].append(
                    {
                        "drafter": eng,
                        "K": K,
                        "new_tokens": a.real_new,
                        **row,
                        "exact_over_bf16_ar": row["tok_s"] / bf16["tok_s"],
                    }
                )
                emit()

        # summary
        ctl = res["controlled"]
        k_hi = max(a.ks_list)
        at = [r for r in ctl if r["K"] == k_hi and abs(r["p"] - 0.95) < 1e-9]
        res["summary"] = {
            "bf16_ar_tok_s": bf16["tok_s"],
            "exact_real": {f"{r['drafter']} K={r['K']}": round(r["tok_s"], 2) for r in res["exact_real"] if "K" in r},
            "controlled_tok_s": {f"p={r['p']} K={r['K']}": round(r["tok_s"], 2) for r in ctl},
            "exact_over_bf16_ar": {f"p={r['p']} K={r['K']}": round(r["exact_over_bf16_ar"], 3) for r in ctl},
            "measured_over_bound": {f"p={r['p']} K={r['K']}": round(r["measured_over_bound"], 3) for r in ctl},
            "min_measured_over_bound": min((r["measured_over_bound"] for r in ctl), default=None),
            "target_measured_over_bound_ge_0.9": all(r["measured_over_bound"] >= 0.9 for r in ctl) if ctl else None,
            f"exact_over_bf16_ar_p0.95_K{k_hi}": at[0]["exact_over_bf16_ar"] if at else None,
            f"target_p0.95_K{k_hi}_ge_1.3x": (at[0]["exact_over_bf16_ar"] >= 1.3) if at else None,
            "all_identical_to_bf16_ar": not res["mismatches"],
        }
        res["all_identical"] = not res["mismatches"]
        rc = 0 if not res["mismatches"] else 1
    except BaseException as e:
        res["error"] = f"{type(e).__name__}: {e}"
        raise
    finally:
        if direct is not None:
            direct.close()
        for c in clients:
            c.close()
        for h, s in routers:
            stop_router(h, s, 0.5)
        stop_processes(procs, grace=5.0)
        shutil.rmtree(tmp, ignore_errors=True)
        emit(final="error" not in res)
    print(json.dumps(res, indent=1), flush=True)
    if rc:
        print(
            f"bench_exact: FAIL: {len(res['mismatches'])} exact-mode output(s) differ from bf16 AR",
            file=sys.stderr,
            flush=True,
        )
    return rc


if __name__ == "__main__":
    sys.exit(main())
