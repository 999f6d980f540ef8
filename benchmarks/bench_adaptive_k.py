"""Exact mode's adaptive draft length (baton/engine/draft_length.py) against fixed K, through the router, with
the acceptance-controlled drafter of bench_exact (benchmarks/controlled_decode_worker.py).

    python benchmarks/bench_adaptive_k.py --new 128 --runs 3 --ks 1,2,4,8 --ps 0.3,0.95 \\
        --out benchmarks/results/adaptive-k-cpu.json                       # CPU, embedded default model
    python benchmarks/bench_adaptive_k.py --random-init qwen3.5-9b --device cuda --prompt-len 512 --new 256

Topology: one prefill worker (`python -m prefill_worker`) and one controlled decode worker (engine
--engine, fp8 by default: every draft row runs on the fp8 model, each proposal is the reference token
with probability p), each its own process, over loopback gRPC. Two routers in this process over that
pair: one with RouterConfig(draft_length="fixed"), one with "adaptive" (prior = --prior-k, the server's
default K, ceiling --max-adaptive-k). The reference tokens are the exact engine's own AR decode
(`baton.complete.complete` in this process, the workers' width and window), and every exact-mode run
must equal them (else "mismatches", FAIL on stderr, exit status 1).

For each p in --ps: fixed K for each K in --ks and adaptive, --runs timed runs each, interleaved (one
run of every configuration, then the next), after --warmup runs; tok/s = (new - 1) / (last token - first
token) at the client, median over runs. For the adaptive runs also the K of every round (the
controllers are wrapped in process), its histogram and mean. "adaptive_over_best_fixed" and
"adaptive_over_prior_fixed" (against fixed K = --prior-k, i.e. today's default) are the figures.
Prints one JSON object (also to --out).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from baton.client import Client  # noqa: E402
from baton.settings import Settings  # noqa: E402
from benchmarks.bench_exact import Cmd, child_env, generate, machine, make_prompt, model_config, worker_args  # noqa: E402
from deploy.processes import WorkerProcess, stop_processes, wait_serving  # noqa: E402


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--random-init", default=None, help="named shape (baton/random_init.py), random weights")
    p.add_argument("--model", default=None, help="checkpoint directory (default: the embedded default model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--prompt-file", default=None)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--ps", default="0.3,0.95")
    p.add_argument("--ks", default="1,2,4,8")
    p.add_argument("--prior-k", type=int, default=4, help="the server's default K: the adaptive prior")
    p.add_argument("--max-adaptive-k", type=int, default=8)
    p.add_argument("--engine", default="fp8", help="the controlled worker's drafting engine (bf16 | fp8)")
    p.add_argument("--width", type=int, default=16)
    p.add_argument("--max-len", type=int, default=0)
    p.add_argument("--slots", type=int, default=2)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    a.ps_list = [float(x) for x in a.ps.split(",") if x.strip()]
    a.ks_list = [int(x) for x in a.ks.split(",") if x.strip()]
    if not a.max_len:
        a.max_len = -(-(a.prompt_len + a.new + 2 * a.width) // 64) * 64
    return a


def spy_controllers():
    """Wraps router.exact's controller factory: -> the list of every adaptive session's K per round."""
    import router.exact
    from baton.engine.draft_length import controller

    made: list[list[int]] = []

    def make(policy, k, k_max):
        ctl = controller(policy, k, k_max)
        if policy == "adaptive":
            ks: list[int] = []
            made.append(ks)
            observe = ctl.observe

            def rec(k, accepted, draft_s, verify_s):
                ks.append(k)
                return observe(k, accepted, draft_s, verify_s)

            ctl.observe = rec
        return ctl

    router.exact.controller = make
    return made


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parse(argv)
    t_start = time.time()
    cfg = model_config(a)
    prompt = make_prompt(a, cfg)
    res = {
        "benchmark": "bench_adaptive_k",
        "command": "python " + " ".join(shlex.quote(x) for x in ["benchmarks/bench_adaptive_k.py", *argv]),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": machine(a.device),
        "setup": {
            "model": f"random-init {a.random_init}" if a.random_init else (a.model or "embedded default model"),
            "device": a.device,
            "prompt_len": a.prompt_len,
            "new_tokens": a.new,
            "runs": a.runs,
            "engine": a.engine,
            "prior_k": a.prior_k,
            "max_adaptive_k": a.max_adaptive_k,
            "topology": "prefill + controlled decode worker as processes, two routers (fixed, adaptive) in "
            "the benchmark process, loopback gRPC, ignore_eos",
        },
        "mismatches": [],
        "settings": [],
    }
    from baton.complete import complete
    from baton.loading import load_model

    lm = load_model(a.model, dtype=a.dtype or "fp32", device="cpu", mtp=False) if not a.random_init else None
    if lm is None:
        raise SystemExit("--random-init: the in-process reference needs the weights; use --model on CPU")
    ref = complete(None, prompt, a.new, loaded=lm, width=a.width, max_len=a.max_len, ignore_eos=True)
    tmp = Path(tempfile.mkdtemp(prefix="bench_adaptive_k-"))
    ref_file = tmp / "reference.json"
    ref_file.write_text(json.dumps({"references": [{"prompt_len": len(prompt), "tokens": ref}], "p": 1.0}))
    env, common = child_env(a.threads), worker_args(a)
    procs = [
        WorkerProcess(Cmd("prefill", "prefill_worker", common), env=env),
        WorkerProcess(
            Cmd(
                "controlled",
                "benchmarks.controlled_decode_worker",
                ["--reference", ref_file, "--draft-seed", a.seed]
                + common
                + ["--engines", a.engine, "--engine", a.engine],
            ),
            env=env,
        ),
    ]
    settings, routers, rc = Settings(), [], 1
    say = lambda t: print(f"bench_adaptive_k: {t}", file=sys.stderr, flush=True)  # noqa: E731
    try:
        from router.__main__ import serve_router, stop_router
        from router.service import ModelMeta, RouterConfig

        for w in procs:
            w.start()
        addrs = {w.spec.name: w.wait_ready(timeout=a.timeout, settings=settings) for w in procs}
        meta = ModelMeta("bench", cfg.vocab_size, tuple(cfg.eos_token_ids), None)
        spies = spy_controllers()
        clients = {}
        for policy in ("fixed", "adaptive"):
            rcfg = RouterConfig(
                width=a.width,
                max_context=a.max_len,
                default_draft_block=a.prior_k,
                draft_length=policy,
                max_adaptive_k=a.max_adaptive_k,
                request_timeout_s=3600.0,
                call_timeout_s=300.0,
            )
            h, s = serve_router(
                prefill=[addrs["prefill"]], decode=[addrs["controlled"]], meta=meta, settings=settings, config=rcfg
            )
            routers.append((h, s))
            wait_serving(h.address, timeout=60, settings=settings, what=f"router ({policy})")
            clients[policy] = Client(h.address, settings=settings)
        configs = [(f"fixed K={k}", "fixed", k) for k in a.ks_list] + [("adaptive", "adaptive", 0)]
        for p in a.ps_list:
            ref_file.write_text(
                json.dumps({"references": [{"prompt_len": len(prompt), "tokens": ref}], "p": p, "seed": a.seed})
            )
            runs: dict[str, list[dict]] = collections.defaultdict(list)
            for i in range(a.warmup + a.runs):
                for label, policy, k in configs:
                    n0 = len(spies)
                    r = generate(clients[policy], prompt, a.new, mode="exact", engine=a.engine, k=k)
                    if r["tokens"] != ref:
                        res["mismatches"].append({"p": p, "what": label, "run": i})
                        say(f"FAIL: p={p} {label} run {i} differs from the exact AR reference")
                    if i >= a.warmup:
                        r["ks"] = [k for ks in spies[n0:] for k in ks]
                        runs[label].append(r)
            row = {"p": p}
            for label, *_ in configs:
                rs = runs[label]
                row[label] = {
                    "tok_s": statistics.median(r["tok_s"] for r in rs),
                    "runs_tok_s": [round(r["tok_s"], 2) for r in rs],
                    "acceptance_rate": sum(r["accepted"] for r in rs) / max(1, sum(r["drafted"] for r in rs)),
                    "tokens_per_round": statistics.fmean((a.new - 1) / max(1, len(r["sizes"])) for r in rs),
                }
                if label == "adaptive":
                    ks = [k for r in rs for k in r["ks"]]
                    row[label]["k_mean"] = statistics.fmean(ks) if ks else 0.0
                    row[label]["k_histogram"] = dict(sorted(collections.Counter(ks).items()))
                    row[label]["k_last_rounds"] = rs[-1]["ks"][-12:]
            fixed = {lab: row[lab]["tok_s"] for lab, pol, _ in configs if pol == "fixed"}
            best = max(fixed, key=fixed.get)
            row["best_fixed"] = best
            row["adaptive_over_best_fixed"] = row["adaptive"]["tok_s"] / fixed[best]
            if f"fixed K={a.prior_k}" in fixed:
                row["adaptive_over_prior_fixed"] = row["adaptive"]["tok_s"] / fixed[f"fixed K={a.prior_k}"]
            say(
                f"p={p}: "
                + ", ".join(f"{lab} {row[lab]['tok_s']:.1f}" for lab, *_ in configs)
                + f" tok/s; adaptive K mean {row['adaptive']['k_mean']:.2f}"
            )
            res["settings"].append(row)
        rc = 1 if res["mismatches"] else 0
    finally:
        for h, s in routers:
            stop_router(h, s, 0)
        stop_processes(procs)
    res["seconds_total"] = round(time.time() - t_start, 1)
    out = json.dumps(res, indent=1)
    print(out)
    if a.out:
        Path(a.out).write_text(out + "\n")
    return rc


if __name__ == "__main__":
    sys.exit(main())
