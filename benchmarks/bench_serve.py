"""Serving benchmark: concurrent streams through the router over gRPC (fast mode, fast-mode MTP speculation,
or exact mode), against HF `generate` at batch N and the memory-bandwidth floor at N, in one run.

    python benchmarks/bench_serve.py                                   # CPU, the embedded model, N = 1,2,4,8
    python benchmarks/bench_serve.py --device cuda --random-init qwen3.5-9b --engine bf16 \\
        --concurrency 1,8,32,64,128 --input-len 512 --output-len 256   # the GPU defaults, written out
    ... --rate 4,16 --num-prompts 128                                  # Poisson arrivals as well
    ... --workload fixed,mixed [--mixed-input 64:1024 --mixed-output 32:512 --long-frac 0.1 --long-input 4096:16384]
    ... --layout both                  # the same points with prefill GPU 0 + decode GPU 1, then both on GPU 0
                                       # (benchmarks/serve_layouts.py: refused / skipped without two GPUs)
    ... --engine mtp                   # fast-mode MTP speculation (real drafts: the model's own MTP head)
    ... --mode exact --engine fp8|mtp  # exact mode: fp8 / MTP drafts on the decode worker, verified on the prefill
    ... --engine mtp --draft-p 0.9 --draft-k 4       # controlled acceptance: each draft right with p = 0.9
    ... --mode exact --engine mtp --draft-p 0.95     # (random weights: real drafts are nearly all rejected)
    python benchmarks/bench_serve.py --report benchmarks/results/serve-....json   # the .md and .png again
    python benchmarks/bench_serve.py --report A.json B.json --out AB.json         # two runs as one (+ .md, .png)

Steps, in order:
 1. prepare (benchmarks/baselines.py, a child process, so that its GPU memory is free again before the
    servers start): --random-init SHAPE writes the seeded random bf16 weights of SHAPE as a checkpoint in
    --ckpt-dir (reused when it holds the same shape and seed); `baton complete` tokens of the checked prompts
    (the exact engine on --device, the workers' dtype and window); the memory bandwidth (CUDA: a device
    copy; CPU: a host memcpy); HF `generate` at each batch N of --concurrency, or of --hf-batches (N prompts of
    --input-len, no padding; skipped with the reason in the JSON when transformers cannot build the model).
 2. `baton serve --processes` on --device with that model (--slots, default max(8, N), --max-len, --engine;
    --serve-args for anything else), then a warm-up (--warmup concurrencies, 8 tokens a stream).
    --draft-p P: the same topology with the acceptance-controlled decode worker instead
    (benchmarks/topology.py ControlledServe: `baton serve`'s own option parser and worker specs, then
    `python -m benchmarks.controlled_decode_worker --reference FILE --draft-p P --draft-seed S ... --mtp-k K`
    in place of each decode worker, and `python -m router` over them as its own process); FILE holds every
    prompt's `baton complete` tokens (so every prompt gets a reference: --check complete, all prompts), and
    each draft (fast mtp rounds, exact-mode fp8 / bf16 / mtp drafts) is the reference token with
    probability P, so a block of K accepts m with P(m) = P^m (1 - P), P(K) = P^K
    (benchmarks/controlled_decode_worker.py). --random-init with --engine mtp writes the MTP head too.
 3. the points. Closed loop: for each N of --concurrency, N clients (threads, a channel each) start
    together and each sends --requests Generate calls one after another; --requests 1 is a burst of N
    prompts. Poisson: for each R of --rate, --num-prompts requests at exponential inter-arrival times of mean
    1/R s (seeded), each on its own thread, as vLLM's benchmark_serving sends them. ignore_eos; GenerateRequest
    mode --mode (fast | exact), engine --engine (bf16 | fp8 | mtp: fast mode's decode engine, exact mode's
    drafter), draft_block --draft-k (speculating runs: fast mtp or exact mode; default 4, the router's
    default block and the decode worker's --mtp-k; fast mtp drafts the worker's --mtp-k, so another K
    needs --draft-p, whose controlled worker is started with --mtp-k K).
    Workloads: fixed (every prompt --input-len random token ids, --output-len new tokens; --prompts distinct
    prompts, default max N, so no two concurrent streams share a prompt) and mixed (input and output
    lengths uniform in --mixed-input / --mixed-output; with probability --long-frac the input is uniform in
    --long-input instead); all seeded by --seed. --shared-prefix N: every prompt's first N tokens are one
    shared prefix (a system prompt), so the prefill workers' prefix cache serves their whole pieces.
 4. the servers stop; JSON to --out (default benchmarks/results/serve-<device>-<date>.json) with the command,
    machine, date, git commit and `env` (the BATON_* variables the served processes inherited, tokens left
    out); beside it the same stem .md (tables) and .png (throughput against concurrency: Baton, HF, the
    floor; latencies; the Poisson points) when matplotlib is installed (the `bench` extra), else `--report
    FILE.json` makes them later on any machine.

Per point:
    workload, mode     fixed | mixed; concurrency (closed loop: concurrency, requests_per_client) | rate
    serve_mode, engine how it generated: --mode (fast | exact), --engine; controlled: true with --draft-p
    streams, completed, wall_s   streams sent / completed OK; seconds from the start to the last token
    decode_steps, decode_mean_rows, decode_step_s_p50, decode_step_s_p99
                       the decode workers' batched AR steps during the point (WorkerStats): how many, their
                       mean rows, their duration (the worst worker's p99: decode steps while prefills run);
                       0 steps for mtp (its rounds are gathered, not stepped). A step's duration spans about
                       two step periods (the next step is launched before its tokens are read)
    handoff_timeline_ms   with --timeline-every N: every Nth request's first hand-off timeline (the marks of
                       baton/handoff/timeline.py), per mark p50 / p99 ms after prefill.compute_end and how many
                       requests had it: where the state's wait to land goes (a ring slot, framing, the wire,
                       the receiver's checks, the commit)
    decode_step_interval_s_*, decode_step_device_s_*   (p50, p99)
                       the step period (one launch to the next, steps back to back) and, on CUDA, a step's
                       device time (events around its kernels): device time near the step alone
                       (bench_batch_step) with a longer period means the decode worker's host falls behind;
                       device time near the period means the GPU is shared (the prefill worker's passes)
    decode_stall_s_*, decode_stall_share   (p99, max; share of the time) how late a Python thread of the
                       decode worker's process woke up to run (the GIL held elsewhere, a garbage collection),
                       from its probe (baton/stalls.py): a host that falls behind, and why
    decode_phase_share_*, decode_held_rows_mean   where the decode worker's step thread spent the point
                       (baton/engine/scheduler.py, the phases: idle, held, gather, lock, launch, collect,
                       deliver, and other = the rest: its bookkeeping and waits for the GIL between phases),
                       each a share of the point's wall time; collect near 1 means the device is the limit,
                       lock / launch / other the host; held_rows_mean: joined sessions left out of a step
    router_cpu         CPU seconds per wall second of the `baton serve` process over the point: the router
                       (its gRPC server, the exact loops' Draft / Verify calls, HTTP) and nothing else there
                       (the workers are its child processes); /proc, so Linux only (else absent)
    decode_thread_cpu, prefill_thread_cpu   {thread group: CPU seconds per wall second} of the role's
                       workers over the point (WorkerStats thread_cpu_s, baton/thread_cpu.py; groups under
                       0.5% left out): Python runs only with the GIL, so under a busy GIL these say who
                       holds it (baton-steps: the step thread; baton-rpc: the gRPC handlers, the Decode
                       streams and the hand-off's LoadState; Thread (_serve): grpc's server loop; os:...:
                       threads Python does not know)
    decode_gathered_batches, decode_gathered_mean, prefill_gathered_batches, prefill_gathered_mean
                       the workers' Gather batches during the point and their mean calls (WorkerStats
                       gathered_*): decode: Draft calls and fast mtp rounds run together; prefill: Verify
                       calls verified in one pass (exact mode); 0.0 = none
    decode_batched_rpcs, decode_batched_mean, prefill_batched_rpcs, prefill_batched_mean
                       the router's batched round RPCs during the point (DraftMany / VerifyMany, router/batcher.py;
                       WorkerStats batched_*) and their mean requests; 0 = none (fast mode, or BATON_BATCHED_ROUNDS=0)
    prefix_cache_hits, prefix_cache_evicted, prefix_cache_reclaimed
                       the prefill workers' prefix cache during the point (WorkerStats prefix_cache_*): prompts
                       that started from a cached prefix, entries evicted, and of them those evicted because
                       a request found too few free KV pages
    prefill_passes, prefill_pass_mean_pieces, prefill_pass_ms_mean, prefill_pass_gave_way
                       the prefill workers' batched prefill passes during the point (WorkerStats
                       prefill_*): how many, their mean prompt pieces, their mean wall time (a Verify that
                       took the lock between layers counted in), and the times they gave it to one
    tok_s              output tokens of every completed stream / wall time of the point (the start -> the
                       last token); requests_per_s: completed streams / wall; tokens, prompt_tokens: totals;
                       cached_prompt_tokens: of them, those the prefill workers restored from their prefix cache
    stream_tok_s_*     each stream's tokens / (its last token - its first): p50, min, max
    ttft_s_*, itl_s_*  time to the first token (p50 / p99 / max), gap between streamed messages (p50 / p99);
                       tokens_per_message: 1.0 when every token came in a message of its own
    handoff_gap_s_*    the gap between a stream's first message (the prefill's token) and its second (the
                       decode worker's first): the state hand-off and the session's join, as the client
                       sees it (p50 / p99); a part of every stream's ITL that its p99 hides
    router_handoff_ms_*, first_decode_ms_*   that gap in two, from the router's Stats (handoff_ms,
                       first_decode_ms): the first token -> the state landed on the decode worker (the
                       push), then -> the decode worker's first tokens (the Decode call, the join, a step)
    decode_first_tokens_ms_p50, decode_first_tokens_ms_p99   the decode worker's part of first_decode_ms
                       (WorkerStats first_tokens_s_*, the worst worker's): a Decode call's join of the step
                       scheduler (bf16 / fp8 steps, fast mtp rounds) -> its first tokens handed out
    decode_called_ms_*, decode_first_message_ms_*   the rest of first_decode_ms, on the decode worker
                       (WorkerStats decode_called_s_*, decode_first_message_s_*, the worst worker's;
                       decode_worker/call_waits.py): a session's LoadState commit -> its Decode call's
                       entry, and that entry -> the call's first message (its set-up, the join above)
    decode_setup_ms_*  of decode_first_message_ms, the handler's own set-up until it asks the engine for the
                       first tokens (WorkerStats decode_setup_s_*); the rest is the engine's (window, pages, join)
    handoff_bytes_p50, draft_only_handoffs   a request's state bytes handed off (Stats.bridge_bytes: its
                       hand-offs together), and how many hand-offs were draft-only (exact mtp: the hidden
                       row and MTP KV alone; BATON_SLIM_HANDOFF=0 turns them off: the A/B of the bytes)
    errors             by gRPC status (a refused request is not retried); error_details: each status's first
                       message (what refused it); short: streams of fewer tokens
                       than asked (ignore_eos: should be 0)
    checked, mismatched  streams compared with their reference / that differ from it: the batch must not
                       change a token. --check complete: `baton complete` (default for bf16, mtp and exact
                       mode: the exact engine, which bf16 fast mode, mtp fast mode and exact mode equal
                       bitwise); alone: the same prompt through the router alone, before the sweep (default
                       for fast fp8: batch invariance); none. --check-prompts K checks the first K prompts
                       of each workload (default: all on the CPU, 8 on CUDA; --draft-p: all, always)
    mean_inflight      requests in flight on average (sum of request times / wall)
    client_cpu         this process's CPU seconds / wall (near 1.0: the load generator's GIL is the limit)
    scaling            tok_s / tok_s at N = 1
    hf_*               HF generate at batch N (closed fixed points): hf_tok_s (whole call, prefill included,
                       --hf-new tokens), hf_decode_tok_s (without the prefill)
    floor_tok_s        N * bandwidth / step_bytes(N rows at floor_context = the mean of input + output / 2)
                       (benchmarks/baselines.py: the weights once, per row its GDN state read + written and its
                       KV; fp8 weights for the fp8 engine in fast mode; mtp and exact mode: the bf16 AR
                       floor, which speculation may pass); pct_of_floor
    draft_k, rounds, tokens_per_round, drafted, accepted, acceptance_rate
                       speculating runs (fast mtp, exact mode): K; rounds = messages after each stream's
                       first (each a round: exact mode, Draft + Verify; fast mtp, an MTP chain + its
                       verify; the router sends one message a round); tokens_per_round = the tokens after
                       each stream's first / rounds (cut last rounds included); drafted / accepted: exact
                       mode, the router's Stats summed over streams (k = min(K, remaining - 1) a round);
                       fast mtp, counted from the rounds: each round but a stream's last (which
                       max_new_tokens may cut) drafted K and accepted its tokens - 1; acceptance_rate =
                       accepted / drafted. --mtp-draft-length adaptive (fast mtp): draft_length
                       "adaptive", K the prior, drafted / accepted / acceptance_rate and the law None (K
                       moves round to round; a K = 0 round is one token)
    round_ms_p50, round_draft_ms_p50, round_verify_ms_p50, round_other_ms_p50
                       exact mode: where a stream's round goes, from the router's Stats (rounds, draft_ms,
                       verify_ms): per stream its decode time (first token -> last message) / rounds, and
                       the Draft and the Verify calls' wall time a round as the router sees them (a Draft:
                       sent -> answered, though sent ahead of the previous round's tokens); other = the rest
                       (the router's own work and sending between rounds; below 0 where the next Draft ran
                       while the tokens were sent: BATON_DRAFT_PREFETCH); p50 over the streams
    decode_gathered_wait_ms, decode_gathered_lock_ms, decode_gathered_run_ms, prefill_gathered_wait_ms,
    prefill_gathered_lock_ms, prefill_gathered_run_ms
                       the workers' gathered batches during the point (WorkerStats.gathered_s), ms a batch:
                       the leader waiting for the calls it expects, then for the compute lock, then the batch
                       (decode: Draft calls and fast mtp rounds; prefill: Verify)
    mtp_rounds_by_k, mtp_round_ms_by_k
                       fast mtp: the decode workers' rounds during the point by the K their controller ran
                       ({"0": plain batched steps, "4": ...}) and their mean ms as it timed them (a plain
                       step: from the later of its launch and the previous read to its read)
    mtp_spec_rounds    fast mtp: the speculative rounds (K > 0) during the point, as the controllers logged
                       them (WorkerStats.mtp_spec_rounds, the last 256 a worker): [round number, K, sessions,
                       ms, 1 if a probe asked for it]: whether a heavy batch's dear rounds are probes, and at
                       which batch
    decode_gathered_run_*, prefill_gathered_run_*
                       the run by part (baton/engine/parts.py), ms a batch, host wall time: prefill: checks,
                       snapshot, pass (ends with the picks' and the outputs' host reads), restore, replay,
                       finish; decode: checks, verdicts, snapshot, chains (mtp), ar (bf16 / fp8 drafts)
    draft_p, expected_acceptance_rate, expected_tokens_per_round
                       --draft-p runs: p and the controlled drafter's steady-state law at K:
                       sum_{i=1..K} p^i / K and sum_{i=0..K} p^i (exact mode's shorter last blocks and
                       references that share a prompt length and first token move the measure off it a
                       little; the JSON's `controlled` says how many share)
    Poisson points also have rate, num_prompts, arrivals_s (the last arrival), dispatch_late_s_max.
    --layout points also have layout, gpus, goodput_per_gpu (tok_s / gpus); the JSON then has layouts,
                       comparison and verdict (benchmarks/serve_layouts.py)
The JSON's `serve`: argv (the `baton serve` command; --draft-p: the commands ControlledServe ran, `;`-separated,
and baton_serve_args, the `baton serve` options they were built from), boot_s, capacity (per worker, read
once all are up: engines, slots, kv_pools, kv_pages, kv_pages_free, kv_page_tokens), exit_code, worker_exits, log
(with --out: the whole `baton serve` stderr, saved beside the JSON as OUT.serve.log, OUT.serve-LAYOUT.log per
layout; stderr_tail keeps its last lines in the JSON when a point failed).
The JSON's `controlled` (--draft-p runs): draft_p, draft_k, draft_seed, draft_length, references (prompts in the
reference file), shared_first_token (how many of them share their prompt length and first token with
another of other tokens: the controlled drafter tells those apart as their tokens are verified, at
the cost of a forced miss where two part). The report's tables get a run column ("fast mtp p=0.9 K=4")
and the speculation columns when the points speculated or generated in more than one way (merged files).
Exit status 1 when any checked stream differs from its reference.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import os
import random
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from baton.thread_cpu import share as thread_cpu_share  # noqa: E402
from benchmarks import serve_layouts as layouts  # noqa: E402
from benchmarks.baselines import DTYPE_BYTES, floor_tok_s, weight_bytes  # noqa: E402
from benchmarks.load import (  # noqa: E402
    Serve,
    capacity,
    decode_steps,
    gathers,
    pct,
    process_cpu_s,
    serve_env,
    thread_cpu,
)
from router.service import RouterConfig  # noqa: E402

PROMPTS = [f"def f{i}(x):\n    return x + {i}\n\n\ndef g{i}(" for i in range(32)]
RESULTS = ROOT / "benchmarks" / "results"
DEFAULT_K = RouterConfig.default_draft_block  # 4: the router's draft block, and the decode worker's --mtp-k
MAX_K = RouterConfig.width - 2  # the workers' width W = 16 (baton serve leaves it): K in 1..W-2
DEFAULTS = {  # per --device: what a plain run sweeps
    "cpu": dict(
        concurrency="1,2,4,8", input_len=32, output_len=48, requests=2, check_prompts=-1, hf_new=16, warmup="1"
    ),
    "cuda": dict(
        concurrency="1,8,32,64,128", input_len=512, output_len=256, requests=1, check_prompts=8, hf_new=32, warmup="1,8"
    ),
}


# ------------------------------------------------------------------------------------------ workloads
@dataclass(frozen=True)
class Job:
    """One Generate call: a prompt (text or token ids), its new tokens, the tokens it must give (a prefix
    of `ref`; None = unchecked)."""

    prompt: str | tuple[int, ...]
    max_new: int
    ref: tuple[int, ...] | None = None
    sampling: tuple[tuple[str, float], ...] = ()  # client.generate keywords (temperature, top_p, seed)


@dataclass
class Workload:
    """prompts[i]: token ids; requests[j] = (prompt index, new tokens), in the order they are sent."""

    name: str
    prompts: list[list[int]]
    requests: list[tuple[int, int]]
    info: dict = field(default_factory=dict)
    sampling: dict = field(default_factory=dict)  # {temperature, top_p, seed}: every request samples, seeded

    def sampled(self, p: int) -> tuple[tuple[str, float], ...]:
        """Prompt p's sampling keywords: its seed is sampling["seed"] + p, so every request of a prompt
        (and its reference) draws the same tokens; () = greedy."""
        if not self.sampling.get("temperature"):
            return ()
        sp = self.sampling
        return (("temperature", sp["temperature"]), ("top_p", sp.get("top_p", 0.0)), ("seed", sp["seed"] + p))

    def job(self, p: int, n: int, refs: dict[int, list[int]] | None = None) -> Job:
        ref = tuple(refs[p]) if refs and p in refs else None
        return Job(tuple(self.prompts[p]), n, ref, self.sampled(p))

    def ref_lengths(self, limit: int) -> dict[int, int]:
        """The first `limit` prompts in order of use (-1 = all) -> the most new tokens asked of each."""
        out: dict[int, int] = {}
        for p, n in self.requests:
            if p in out or limit < 0 or len(out) < limit:
                out[p] = max(n, out.get(p, 0))
        return out

    def jobs(self, refs: dict[int, list[int]], start: int = 0, count: int | None = None) -> list[Job]:
        reqs = self.requests[start : None if count is None else start + count]
        return [self.job(p, n, refs) for p, n in reqs]


def random_prompts(lengths: list[int], vocab: int, rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def fixed_workload(n_requests: int, n_prompts: int, input_len: int, output_len: int, vocab: int, seed: int = 0):
    """n_prompts distinct prompts of input_len random ids; request j asks prompt j % n_prompts for output_len."""
    rng = random.Random(f"fixed:{seed}")
    prompts = random_prompts([input_len] * n_prompts, vocab, rng)
    reqs = [(j % n_prompts, output_len) for j in range(n_requests)]
    return Workload("fixed", prompts, reqs, {"input_len": input_len, "output_len": output_len, "prompts": n_prompts})


def mixed_workload(
    n_requests: int,
    input_range: tuple[int, int],
    output_range: tuple[int, int],
    vocab: int,
    seed: int = 0,
    long_frac: float = 0.0,
    long_range: tuple[int, int] = (4096, 16384),
):
    """Every request its own prompt: input length uniform in input_range (in long_range with probability
    long_frac), output length uniform in output_range; all bounds inclusive, all draws from `seed`."""
    rng = random.Random(f"mixed:{seed}")
    lens, outs = [], []
    for _ in range(n_requests):
        lo, hi = long_range if rng.random() < long_frac else input_range
        lens.append(rng.randint(lo, hi))
        outs.append(rng.randint(*output_range))
    prompts = random_prompts(lens, vocab, rng)
    info = {
        "input_range": list(input_range),
        "output_range": list(output_range),
        "long_frac": long_frac,
        "long_range": list(long_range),
        "input_mean": round(sum(lens) / max(1, len(lens)), 1),
        "output_mean": round(sum(outs) / max(1, len(outs)), 1),
        "long_prompts": sum(n >= long_range[0] for n in lens) if long_frac else 0,
    }
    return Workload("mixed", prompts, list(zip(range(n_requests), outs)), info)


def poisson_schedule(n: int, rate: float, seed: int = 0) -> list[float]:
    """Arrival offsets (s) of n requests: the first at 0, then exponential gaps of mean 1/rate (rate = inf:
    all at 0, a burst)."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(f"poisson:{seed}:{rate}")
    t, out = 0.0, []
    for j in range(n):
        if j:
            t += rng.expovariate(rate)
        out.append(t)
    return out


def span(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    lo, hi = int(lo), int(hi or lo)
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"{text!r}: want LO:HI with 1 <= LO <= HI")
    return lo, hi


# ------------------------------------------------------------------------------------------ measurement
@dataclass
class Sample:
    start: float
    times: list[float]  # arrival of each message that carried tokens
    tokens: list[int]
    status: str
    end: float = 0.0
    job: Job | None = None
    sizes: list[int] = field(default_factory=list)  # tokens of each message that carried tokens
    drafted: int = 0  # the router's Stats (last message): exact mode's drafted / accepted drafts
    accepted: int = 0
    handoff_ms: float = 0.0  # the router's Stats: the first token -> the state landed on the decode worker
    first_decode_ms: float = 0.0  # ... -> the decode worker's first tokens
    rounds: int = 0  # the router's Stats, exact mode: draft / verify rounds and their calls' summed wall time
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    timeline: dict | None = None  # the first hand-off's marks (name -> monotonic ns), when asked for
    cached: int = 0  # usage.cached_tokens: prompt tokens the prefill restored from its prefix cache
    bridge_bytes: int = 0  # the router's Stats: the state bytes of the request's hand-offs ...
    draft_only_handoffs: int = 0  # ... and how many of them were draft-only
    detail: str = ""  # the error's message (status != OK)


@dataclass(frozen=True)
class Gen:
    """How every request of a run is sent: GenerateRequest engine, mode and draft_block (0 = default)."""

    engine: str = "bf16"
    mode: str = "fast"
    draft_block: int = 0
    timeline_every: int = 0  # every Nth request asks for the hand-off's timeline (0: none)

    @property
    def speculates(self) -> bool:
        return self.mode == "exact" or self.engine == "mtp"


_SENT = itertools.count()  # requests sent by this process: which ask for a timeline (Gen.timeline_every)


def timeline_ms(samples: list[Sample]) -> dict:
    """The sampled hand-off timelines: per mark, p50 / p99 of its time after prefill.compute_end, ms (negative:
    before it, e.g. chunks sent while the prefill ran), over the requests that carry that mark; {} if none."""
    per: dict[str, list[float]] = {}
    for s in samples:
        t = s.timeline or {}
        if "prefill.compute_end" in t:
            for k, v in t.items():
                per.setdefault(k, []).append((v - t["prefill.compute_end"]) / 1e6)
    return {
        k: {"p50": round(pct(v, 0.5), 2), "p99": round(pct(v, 0.99), 2), "n": len(v)} for k, v in sorted(per.items())
    }


def run_job(client, job: Job, gen: Gen | str, timeout: float) -> Sample:
    gen = Gen(gen) if isinstance(gen, str) else gen
    s = Sample(time.monotonic(), [], [], "OK", job=job)
    ask = gen.timeline_every > 0 and next(_SENT) % gen.timeline_every == 0
    try:
        for d in client.generate(
            job.prompt,
            max_new_tokens=job.max_new,
            engine=gen.engine,
            mode=gen.mode,
            draft_block=gen.draft_block,
            ignore_eos=True,
            timeout=timeout,
            handoff_timeline=ask,
            **dict(job.sampling),
        ):
            if d.token_ids:
                s.times.append(time.monotonic())
                s.tokens += d.token_ids
                s.sizes.append(len(d.token_ids))
            if d.stats:
                s.drafted, s.accepted = int(d.stats.get("drafted", 0)), int(d.stats.get("accepted", 0))
                s.handoff_ms = float(d.stats.get("handoff_ms", 0.0))
                s.first_decode_ms = float(d.stats.get("first_decode_ms", 0.0))
                s.rounds = int(d.stats.get("rounds", 0))
                s.draft_ms, s.verify_ms = float(d.stats.get("draft_ms", 0.0)), float(d.stats.get("verify_ms", 0.0))
                s.timeline = d.stats.get("handoff_timeline")
                s.bridge_bytes = int(d.stats.get("bridge_bytes", 0))
                s.draft_only_handoffs = int(d.stats.get("draft_only_handoffs", 0))
            if d.usage:
                s.cached = int(d.usage.get("cached_tokens", 0))
    except Exception as e:  # noqa: BLE001 - counted by status
        code = getattr(e, "code", lambda: None)()
        s.status = str(getattr(code, "name", type(e).__name__))
        details = getattr(e, "details", None)
        s.detail = str(details() if callable(details) else e)[:300]
    s.end = time.monotonic()
    return s


def speculation(ok: list[Sample], gen: Gen, k: int, p: float | None, adaptive: bool = False) -> dict:
    """The speculation fields of a point (module doc): rounds = messages after each stream's first (one
    round each); accepted / drafted from the router's Stats (exact mode) or, fast mtp, from the rounds
    (each round but a stream's last, which max_new_tokens may cut, drafted k and accepted its tokens - 1).
    adaptive (fast mtp, the worker's controller): K moves round to round, so k is the prior only and
    drafted / accepted / the law are None; tokens_per_round stays (a K = 0 round is one token)."""
    rounds = sum(max(0, len(s.sizes) - 1) for s in ok)
    after_first = sum(sum(s.sizes[1:]) for s in ok)
    if gen.mode == "exact":
        drafted, accepted = sum(s.drafted for s in ok), sum(s.accepted for s in ok)
    else:
        drafted = k * sum(max(0, len(s.sizes) - 2) for s in ok)
        accepted = sum(n - 1 for s in ok for n in s.sizes[1:-1])
    out = {
        "draft_k": k,
        "rounds": rounds,
        "tokens_per_round": round(after_first / rounds, 3) if rounds else None,
        "drafted": drafted,
        "accepted": accepted,
        "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
    }
    if gen.mode == "exact":
        out |= _round_split(ok)
    if adaptive and gen.mode != "exact":
        out |= {"draft_length": "adaptive", "drafted": None, "accepted": None, "acceptance_rate": None}
        return out | ({"draft_p": p} if p is not None else {})
    if p is not None:
        out |= {"draft_p": p} | expected_law(p, k)
    return out


def _round_split(ok: list[Sample]) -> dict:
    """Exact mode: a round's time split (module doc, round_*_ms_p50), p50 over the streams that had rounds."""
    timed = [s for s in ok if s.rounds and len(s.times) > 1]
    if not timed:
        return {}
    per = {
        "round": [1e3 * (s.times[-1] - s.times[0]) / s.rounds for s in timed],
        "round_draft": [s.draft_ms / s.rounds for s in timed],
        "round_verify": [s.verify_ms / s.rounds for s in timed],
    }
    per["round_other"] = [t - d - v for t, d, v in zip(per["round"], per["round_draft"], per["round_verify"])]
    return {f"{k}_ms_p50": round(pct(v, 0.5), 2) for k, v in per.items()}


def expected_law(p: float, k: int) -> dict:
    """The controlled drafter's law at block k (benchmarks/controlled_decode_worker.py): P(m) = p^m (1-p),
    P(k) = p^k; tokens a round sum_{i=0..k} p^i, accepted / drafted sum_{i=1..k} p^i / k."""
    acc = sum(p**i for i in range(1, k + 1))
    return {"expected_acceptance_rate": round(acc / k, 4), "expected_tokens_per_round": round(1 + acc, 3)}


def first_details(samples: list[Sample]) -> dict:
    """{status: the first failed request's message of that status}: why requests were refused."""
    out: dict[str, str] = {}
    for s in samples:
        if s.status != "OK":
            out.setdefault(s.status, s.detail)
    return dict(sorted(out.items()))


def summarize(samples: list[Sample], wall: float, cpu_s: float, spec: tuple | None = None) -> dict:
    """spec: (Gen, k, draft p or None) of a speculating run: adds speculation()'s fields."""
    ok = [s for s in samples if s.status == "OK"]
    ttft = [s.times[0] - s.start for s in ok if s.times]
    handoff = [s.times[1] - s.times[0] for s in ok if len(s.times) > 1]  # first token (prefill) -> the decode's
    itl = [b - a for s in ok for a, b in zip(s.times, s.times[1:])]
    per = [
        (len(s.tokens) - 1) / (s.times[-1] - s.times[0]) for s in ok if len(s.times) > 1 and s.times[-1] > s.times[0]
    ]
    checked = [s for s in ok if s.job is not None and s.job.ref is not None]
    mismatched = sum(tuple(s.tokens) != s.job.ref[: s.job.max_new] for s in checked)
    tokens = sum(len(s.tokens) for s in ok)
    msgs = sum(len(s.times) for s in ok)
    r = lambda x, n=3: None if x is None else round(x, n)  # noqa: E731
    return {
        "streams": len(samples),
        "completed": len(ok),
        "tokens": tokens,
        "prompt_tokens": sum(len(s.job.prompt) for s in ok if s.job is not None and not isinstance(s.job.prompt, str)),
        "cached_prompt_tokens": sum(s.cached for s in ok),  # restored from the prefill workers' prefix cache
        "wall_s": round(wall, 3),
        "tok_s": round(tokens / wall, 2) if wall > 0 else None,
        "requests_per_s": round(len(ok) / wall, 3) if wall > 0 else None,
        "stream_tok_s_p50": r(pct(per, 0.5), 2) or 0.0,
        "stream_tok_s_min": r(min(per), 2) if per else None,
        "stream_tok_s_max": r(max(per), 2) if per else None,
        "ttft_s_p50": pct(ttft, 0.5),
        "ttft_s_p99": pct(ttft, 0.99),
        "ttft_s_max": pct(ttft, 1.0),
        "itl_s_p50": pct(itl, 0.5),
        "itl_s_p99": pct(itl, 0.99),
        "handoff_gap_s_p50": pct(handoff, 0.5),
        "handoff_gap_s_p99": pct(handoff, 0.99),
        # the gap split by the router's Stats: the push (first token -> landed), then the decode's start
        "router_handoff_ms_p50": pct([s.handoff_ms for s in ok if s.first_decode_ms], 0.5),
        "router_handoff_ms_p99": pct([s.handoff_ms for s in ok if s.first_decode_ms], 0.99),
        "first_decode_ms_p50": pct([s.first_decode_ms for s in ok if s.first_decode_ms], 0.5),
        "first_decode_ms_p99": pct([s.first_decode_ms for s in ok if s.first_decode_ms], 0.99),
        "tokens_per_message": round(tokens / msgs, 3) if msgs else None,
        "handoff_bytes_p50": pct([s.bridge_bytes for s in ok], 0.5),
        "draft_only_handoffs": sum(s.draft_only_handoffs for s in ok),
        "handoff_timeline_ms": timeline_ms(ok),
        "errors": dict(sorted(Counter(s.status for s in samples if s.status != "OK").items())),
        "error_details": first_details(samples),
        "short": sum(len(s.tokens) != s.job.max_new for s in ok if s.job is not None),
        "checked": len(checked),
        "mismatched": mismatched,
        "mean_inflight": round(sum(s.end - s.start for s in samples) / wall, 2) if wall > 0 else None,
        "client_cpu": round(cpu_s / wall, 2) if wall > 0 else None,
    } | (speculation(ok, *spec) if spec else {})


def closed_point(
    addr: str, token: str | None, per_client: list[list[Job]], engine: Gen | str, timeout: float = 600, spec=None
) -> dict:
    """len(per_client) clients start together; each sends its jobs one after another on its own channel.
    engine: a Gen (or an engine name: fast mode); spec: summarize's."""
    from baton.client import Client

    n = len(per_client)
    samples: list[Sample] = []
    lock = threading.Lock()
    start = threading.Barrier(n + 1)

    def client(jobs: list[Job]) -> None:
        with Client(addr, token=token) as c:
            start.wait()
            for job in jobs:
                s = run_job(c, job, engine, timeout)
                with lock:
                    samples.append(s)

    threads = [threading.Thread(target=client, args=(j,), daemon=True) for j in per_client]
    for t in threads:
        t.start()
    start.wait()
    t0, c0 = time.monotonic(), time.process_time()
    for t in threads:
        t.join()
    wall, cpu = time.monotonic() - t0, time.process_time() - c0
    return {"mode": "concurrency", "concurrency": n, "requests_per_client": len(per_client[0]) if n else 0} | summarize(
        samples, wall, cpu, spec
    )


def rate_point(
    addr: str,
    token: str | None,
    rate: float,
    jobs: list[Job],
    schedule: list[float],
    engine: Gen | str,
    timeout: float = 600,
    spec=None,
) -> dict:
    """jobs[j] sent at schedule[j] s after the start, each on its own thread, over a pool of channels."""
    from baton.client import Client

    clients = [Client(addr, token=token) for _ in range(min(len(jobs), 32))]
    samples: list[Sample] = []
    lock = threading.Lock()
    late = 0.0

    def one(j: int) -> None:
        s = run_job(clients[j % len(clients)], jobs[j], engine, timeout)
        with lock:
            samples.append(s)

    threads = []
    try:
        t0, c0 = time.monotonic(), time.process_time()
        for j, off in enumerate(schedule):
            wait = t0 + off - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            late = max(late, time.monotonic() - t0 - off)
            th = threading.Thread(target=one, args=(j,), daemon=True)
            th.start()
            threads.append(th)
        for th in threads:
            th.join()
        wall = max((s.end for s in samples), default=t0) - t0
        cpu = time.process_time() - c0
    finally:
        for c in clients:
            c.close()
    return {
        "mode": "rate",
        "rate": rate,
        "num_prompts": len(jobs),
        "arrivals_s": round(schedule[-1], 3) if schedule else 0.0,
        "dispatch_late_s_max": round(late, 4),
    } | summarize(samples, wall, cpu, spec)


def _router_cpu(serve) -> float | None:
    """CPU seconds the router's process has used so far (router_cpu), None where it cannot be read."""
    pid = serve.router_pid()  # (Serve, ControlledServe)
    return process_cpu_s(pid) if pid else None


class _StepStats:
    """Per point: the decode workers' batched steps during it (load.decode_steps), as decode_* fields,
    and the workers' gathered batches (load.gathers) as {prefill,decode}_gathered_* fields; {} when the
    workers cannot tell (an older worker, or no address line)."""

    def __init__(self, serve, token):
        self.serve, self.token, self.s0, self.g0, self.c0, self.t0 = serve, token, None, None, {}, 0.0
        self.r0: float | None = None

    def start(self) -> None:
        try:
            self.s0 = decode_steps(self.serve.workers(), self.token, reset=True)
            self.g0 = gathers(self.serve.workers(), self.token)
            self.c0, self.t0 = thread_cpu(self.serve.workers(), self.token), time.monotonic()
            self.r0 = _router_cpu(self.serve)
        except Exception:  # noqa: BLE001 - the point runs without step stats
            self.s0 = None

    def read(self) -> dict:
        if self.s0 is None:
            return {}
        try:
            s1 = decode_steps(self.serve.workers(), self.token)
            g1 = gathers(self.serve.workers(), self.token)
            c1, wall = thread_cpu(self.serve.workers(), self.token), time.monotonic() - self.t0
        except Exception:  # noqa: BLE001
            return {}
        steps, rows = s1["steps"] - self.s0["steps"], s1["rows"] - self.s0["rows"]
        out = {
            "decode_steps": steps,
            "decode_mean_rows": round(rows / steps, 2) if steps else 0.0,
            "decode_step_s_p50": round(s1["step_s_p50"], 5),
            "decode_step_s_p99": round(s1["step_s_p99"], 5),
            "decode_step_interval_s_p50": round(s1["step_interval_s_p50"], 5),
            "decode_step_interval_s_p99": round(s1["step_interval_s_p99"], 5),
            "decode_step_device_s_p50": round(s1["step_device_s_p50"], 5),
            "decode_step_device_s_p99": round(s1["step_device_s_p99"], 5),
            "decode_stall_s_p99": round(s1["stall_s_p99"], 5),
            "decode_stall_s_max": round(s1["stall_s_max"], 5),
            "decode_stall_share": round(s1["stall_share"], 4),
            "decode_held_rows_mean": round((s1["held_rows"]) / steps, 2) if steps else 0.0,
            "decode_first_tokens_ms_p50": round(1e3 * s1["first_tokens_s_p50"], 2),
            "decode_first_tokens_ms_p99": round(1e3 * s1["first_tokens_s_p99"], 2),
            "decode_called_ms_p50": round(1e3 * s1["decode_called_s_p50"], 2),
            "decode_called_ms_p99": round(1e3 * s1["decode_called_s_p99"], 2),
            "decode_first_message_ms_p50": round(1e3 * s1["decode_first_message_s_p50"], 2),
            "decode_first_message_ms_p99": round(1e3 * s1["decode_first_message_s_p99"], 2),
            "decode_setup_ms_p50": round(1e3 * s1["decode_setup_s_p50"], 2),
            "decode_setup_ms_p99": round(1e3 * s1["decode_setup_s_p99"], 2),
        }
        shares = s1["phase_share"]
        for phase, share in sorted(shares.items()):
            out[f"decode_phase_share_{phase}"] = round(share, 4)
        if shares:
            out["decode_phase_share_other"] = round(max(0.0, 1.0 - sum(shares.values())), 4)
        p1, p0 = g1.pop("prefill_pass", (0, 0, 0, 0.0, 0)), self.g0.get("prefill_pass", (0, 0, 0, 0.0, 0))
        passes, pieces, _, secs, gave = (a - b for a, b in zip(p1, p0))
        out |= {
            "prefill_passes": passes,
            "prefill_pass_gave_way": gave,
            "prefill_pass_mean_pieces": round(pieces / passes, 2) if passes else 0.0,
            "prefill_pass_ms_mean": round(1e3 * secs / passes, 2) if passes else 0.0,
        }
        pc1, pc0 = g1.pop("prefix_cache", (0, 0, 0)), self.g0.get("prefix_cache", (0, 0, 0))
        hits, evicted, reclaimed = (a - b for a, b in zip(pc1, pc0))
        out |= {"prefix_cache_hits": hits, "prefix_cache_evicted": evicted, "prefix_cache_reclaimed": reclaimed}
        k1, k0 = g1.pop("mtp_by_k", {}), self.g0.get("mtp_by_k", {})
        if any(n != k0.get(k, (0, 0.0))[0] for k, (n, _) in k1.items()):  # fast mtp rounds by K during the point
            d = {k: (n - k0.get(k, (0, 0.0))[0], t - k0.get(k, (0, 0.0))[1]) for k, (n, t) in sorted(k1.items())}
            out["mtp_rounds_by_k"] = {str(k): n for k, (n, _) in d.items() if n}
            out["mtp_round_ms_by_k"] = {str(k): round(1e3 * t / n, 2) for k, (n, t) in d.items() if n}
        seen = set(self.g0.get("mtp_spec", ()))  # the speculative rounds logged during the point
        spec = [r for r in g1.pop("mtp_spec", ()) if r not in seen]
        if spec:
            out["mtp_spec_rounds"] = [[n, k, b, round(1e3 * secs, 2), int(probe)] for n, k, b, secs, probe in spec]
        for role in ("decode", "prefill"):  # the router's round batcher: DraftMany / VerifyMany and their requests
            (r1, n1), (r0, n0) = g1.pop(role + "_batched", (0, 0)), self.g0.get(role + "_batched", (0, 0))
            out[f"{role}_batched_rpcs"] = r1 - r0
            out[f"{role}_batched_mean"] = round((n1 - n0) / (r1 - r0), 2) if r1 > r0 else 0.0
        for role, (b1, i1, t1) in sorted(g1.items()):
            b0, i0, t0 = self.g0.get(role, (0, 0, {}))
            out[f"{role}_gathered_batches"] = b1 - b0
            out[f"{role}_gathered_mean"] = round((i1 - i0) / (b1 - b0), 2) if b1 > b0 else 0.0
            for k, secs in sorted(t1.items()):
                out[f"{role}_gathered_{k}_ms"] = round(1e3 * (secs - t0.get(k, 0.0)) / (b1 - b0), 2) if b1 > b0 else 0.0
        for role in ("decode", "prefill"):
            out[f"{role}_thread_cpu"] = thread_cpu_share(self.c0.get(role, {}), c1.get(role, {}), wall)
        r1 = _router_cpu(self.serve)
        if r1 is not None and self.r0 is not None and wall > 0:
            out["router_cpu"] = round((r1 - self.r0) / wall, 3)
        return out


def _point(addr: str, token: str, n: int, requests: int, max_new: int, engine: str, ref: dict) -> dict:
    """n clients, each sending PROMPTS[i] (text) `requests` times; ref: prompt text -> tokens (tests/system)."""
    per = [
        [Job(PROMPTS[i % len(PROMPTS)], max_new, tuple(ref[PROMPTS[i % len(PROMPTS)]]))] * requests for i in range(n)
    ]
    return closed_point(addr, token, per, engine)


# ------------------------------------------------------------------------------------------ the run
def _git_commit() -> dict:
    def git(*a):
        try:
            return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    head = git("rev-parse", "HEAD")
    return {
        "commit": head or None,
        "dirty": bool(git("status", "--porcelain", "--untracked-files=no")) if head else None,
    }


def _serve_has(flag: str) -> bool:
    """Whether this checkout's `baton serve` takes `flag` (the runtime grows options in parallel)."""
    from deploy.local import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    return flag in p._option_string_actions


def _model_config(a):
    from baton.config import ModelConfig

    if a.random_init:
        from baton.random_init import config_of

        return config_of(a.random_init)
    if a.model:
        return ModelConfig.from_hf(a.model)
    import baton

    return ModelConfig.from_hf(Path(baton.__file__).parent / "assets" / "default-model")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="benchmarks/bench_serve.py", description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", default=None, help="checkpoint directory (default: the embedded default model)")
    src.add_argument(
        "--random-init",
        default=None,
        metavar="SHAPE",
        help="seeded random weights of SHAPE (qwen3.5-9b, tiny), as a checkpoint",
    )
    p.add_argument("--ckpt-dir", default=None, help="--random-init: where (default /tmp/baton-bench-ckpt/SHAPE-seedN)")
    p.add_argument("--seed", type=int, default=0, help="weights (--random-init), prompts, lengths and arrivals")
    p.add_argument(
        "--engine",
        default="bf16",
        choices=("bf16", "fp8", "mtp"),
        help="fast mode: the decode engine; exact: the drafter",
    )
    p.add_argument(
        "--mode",
        default="fast",
        choices=("fast", "exact"),
        help="exact: drafts on the decode worker, each block verified on the prefill worker (router/exact.py)",
    )
    p.add_argument(
        "--draft-k",
        type=int,
        default=None,
        metavar="K",
        help=f"draft block: GenerateRequest.draft_block and, fast mtp, the decode worker's --mtp-k (default "
        f"{DEFAULT_K}; fast mtp through plain `baton serve` drafts {DEFAULT_K} a round, so another K needs --draft-p)",
    )
    p.add_argument(
        "--draft-p",
        type=float,
        default=None,
        metavar="P",
        help="controlled acceptance: the decode worker is benchmarks/controlled_decode_worker.py, each draft the "
        "reference token with probability P (every prompt gets a `baton complete` reference); default: real drafts",
    )
    p.add_argument("--draft-seed", type=int, default=None, help="--draft-p: seed of the draws (default --seed)")
    p.add_argument(
        "--mtp-draft-length",
        default="fixed",
        choices=("fixed", "adaptive"),
        help="--draft-p with fast mtp: the controlled decode worker's --mtp-draft-length. fixed (default): every "
        "round drafts --draft-k, the figure at that K; adaptive: the worker's controller picks each round's K "
        "from the prior --draft-k (K = 0, plain steps, when drafts do not pay at the batch)",
    )
    p.add_argument(
        "--temperature", type=float, default=0.0, help="every request samples (0: greedy), seeded per prompt"
    )
    p.add_argument("--top-p", type=float, default=0.0, help="with --temperature (0: off)")
    p.add_argument("--slots", type=int, default=None, help="session slots a worker (default max(8, max N))")
    p.add_argument("--max-len", type=int, default=None, help="the workers' window (default: the longest request + 64)")
    p.add_argument("--serve-args", default="", help="more `baton serve` options, one string")
    p.add_argument(
        "--layout",
        default=None,
        choices=("split", "shared", "both"),
        help="workers on two GPUs (split: prefill GPU 0, decode GPU 1), on one (shared: both GPU 0), or both "
        "in one run, side by side (benchmarks/serve_layouts.py; default: one serve as given)",
    )
    p.add_argument("--concurrency", default=None, help="closed-loop points, e.g. 1,8,32 (empty: none)")
    p.add_argument("--requests", type=int, default=None, help="Generate calls per client, one after another")
    p.add_argument(
        "--timeline-every",
        type=int,
        default=0,
        help="every Nth request asks for its hand-off's timeline (GenerateRequest.handoff_timeline): a point's "
        "handoff_timeline_ms; 0 (default): none",
    )
    p.add_argument("--rate", default="", help="Poisson points: requests/s, e.g. 2,8,inf")
    p.add_argument("--num-prompts", type=int, default=None, help="requests of a Poisson point (default 4 x max N)")
    p.add_argument("--workload", default="fixed", help="fixed, mixed or fixed,mixed")
    p.add_argument("--input-len", type=int, default=None)
    p.add_argument("--output-len", "--max-new-tokens", dest="output_len", type=int, default=None)
    p.add_argument("--prompts", type=int, default=None, help="fixed workload: distinct prompts (default max N)")
    p.add_argument("--mixed-input", type=span, default=None, help="LO:HI (default input-len/4 : 2 x input-len)")
    p.add_argument("--mixed-output", type=span, default=None, help="LO:HI (default output-len/4 : 2 x output-len)")
    p.add_argument("--long-frac", type=float, default=0.0, help="mixed: share of prompts drawn from --long-input")
    p.add_argument(
        "--shared-prefix",
        type=int,
        default=0,
        metavar="N",
        help="every prompt begins with the same N tokens (a system prompt; the prefill workers' prefix cache "
        "reuses its whole 8,192-token pieces: cached_prompt_tokens); prompts must be longer",
    )
    p.add_argument("--long-input", type=span, default=(4096, 16384))
    p.add_argument(
        "--check", default=None, choices=("complete", "alone", "none"), help="default: complete (bf16), alone (fp8)"
    )
    p.add_argument("--no-check", dest="check", action="store_const", const="none")
    p.add_argument("--check-prompts", type=int, default=None, help="prompts checked per workload (-1: all)")
    p.add_argument(
        "--warmup", default=None, help="concurrencies of the warm-up rounds, 8 tokens a stream (CPU 1, CUDA 1,8)"
    )
    p.add_argument("--no-hf", action="store_true")
    p.add_argument("--hf-new", type=int, default=None, help="HF generate: new tokens (default 16 CPU, 32 CUDA)")
    p.add_argument("--hf-runs", type=int, default=1)
    p.add_argument("--hf-batches", default=None, help="HF generate's batches (default: the --concurrency points)")
    p.add_argument("--timeout", type=float, default=900.0, help="one Generate call's deadline (s)")
    p.add_argument("--boot-timeout", type=float, default=900.0, help="seconds for `baton serve` to start")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/serve-DEVICE-DATE.json)")
    p.add_argument("--no-plot", action="store_true", help="no .md / .png beside the JSON")
    p.add_argument("--commit", default=None, help="the git commit to record where the checkout has no .git")
    p.add_argument(
        "--report",
        nargs="+",
        default=None,
        metavar="JSON",
        help="only write the .md and .png of a result file; of several: merge them into --out first",
    )
    return p


def resolve(a) -> None:
    """Fill the per-device defaults and the derived sizes in `a`."""
    given_check_prompts = a.check_prompts
    for k, v in DEFAULTS[a.device].items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    a.points = [int(x) for x in a.concurrency.split(",") if x.strip()]
    a.hf_batches = [int(x) for x in a.hf_batches.split(",") if x.strip()] if a.hf_batches is not None else a.points
    a.rates = [float(x) for x in a.rate.split(",") if x.strip()]
    a.workloads = [w.strip() for w in a.workload.split(",") if w.strip()]
    a.layouts = layouts.parse(a.layout)
    if set(a.workloads) - {"fixed", "mixed"} or not a.workloads:
        raise SystemExit(f"--workload: fixed and/or mixed, got {a.workload!r}")
    if not a.points and not a.rates:
        raise SystemExit("nothing to measure: give --concurrency and/or --rate")
    top = max(a.points, default=1)
    a.num_prompts = a.num_prompts or 4 * top
    a.prompts = a.prompts or max(top, 1)
    a.mixed_input = a.mixed_input or (max(1, a.input_len // 4), 2 * a.input_len)
    a.mixed_output = a.mixed_output or (max(1, a.output_len // 4), 2 * a.output_len)
    a.slots = a.slots or max(8, top, *(() if not a.rates else (min(a.num_prompts, 64),)))
    a.n_requests = max(top * a.requests if a.points else 0, a.num_prompts if a.rates else 0)
    speculates = Gen(a.engine, a.mode).speculates
    a.check = a.check or ("complete" if a.engine == "bf16" or speculates else "alone")
    _resolve_drafts(a, speculates, given_check_prompts)
    a.gen = Gen(a.engine, a.mode, a.k if speculates else 0, max(0, a.timeline_every))
    longest_in = max([a.input_len] + ([a.mixed_input[1]] + ([a.long_input[1]] if a.long_frac else []))
                     * ("mixed" in a.workloads))  # fmt: skip
    longest_out = max([a.output_len] + [a.mixed_output[1]] * ("mixed" in a.workloads))
    a.max_len = a.max_len or max(512, -(-(longest_in + longest_out + 64) // 256) * 256)
    a.ckpt_dir = a.ckpt_dir or (
        f"/tmp/baton-bench-ckpt/{Path(a.random_init).name}-seed{a.seed}" if a.random_init else None
    )


def _resolve_drafts(a, speculates: bool, given_check_prompts: int | None) -> None:
    """--draft-k / --draft-p / --draft-seed against the mode and engine (SystemExit when they clash)."""
    if a.draft_k is not None and not 1 <= a.draft_k <= MAX_K:
        raise SystemExit(f"--draft-k: 1..{MAX_K} (the workers' width - 2), got {a.draft_k}")
    a.k = a.draft_k or DEFAULT_K
    a.draft_seed = a.seed if a.draft_seed is None else a.draft_seed
    fast_mtp = a.mode == "fast" and a.engine == "mtp"
    if fast_mtp and a.k != DEFAULT_K and a.draft_p is None and not _serve_has("--mtp-k"):
        raise SystemExit(
            f"--draft-k {a.k}: `baton serve` has no --mtp-k (fast mtp drafts {DEFAULT_K} a round); with --draft-p "
            "the controlled decode worker takes --mtp-k"
        )
    if a.mtp_draft_length != "fixed" and (a.draft_p is None or not fast_mtp):
        raise SystemExit("--mtp-draft-length adaptive: fast mtp with --draft-p (plain `baton serve` is adaptive)")
    if a.draft_p is None:
        return
    if not speculates:
        raise SystemExit("--draft-p controls drafts: give --engine mtp (fast) or --mode exact")
    if not 0.0 <= a.draft_p <= 1.0:
        raise SystemExit(f"--draft-p: a probability in [0, 1], got {a.draft_p}")
    if a.temperature:
        raise SystemExit("--draft-p: greedy only (the controlled drafter's references are greedy outputs)")
    if a.check != "complete":
        raise SystemExit(
            "--draft-p: the controlled worker needs every prompt's `baton complete` reference: --check complete"
        )
    distinct = a.prompts if a.workloads == ["fixed"] else a.n_requests
    if given_check_prompts not in (None, -1) and given_check_prompts < distinct:
        raise SystemExit(
            f"--draft-p: every prompt needs a reference ({distinct} prompts), --check-prompts {given_check_prompts} "
            "gives fewer: drop it, or use fewer --prompts"
        )
    a.check_prompts = -1


def reference_file(path: Path, workloads: list[Workload], refs: list[dict], p: float, seed: int) -> int:
    """The controlled worker's reference file (benchmarks/controlled_decode_worker.py): every referenced
    prompt's length and `baton complete` tokens; -> how many prompts share their (length, first token)
    with a prompt of other tokens (the drafter tells them apart as their tokens are verified)."""
    rows = [
        {"prompt_len": len(w.prompts[pi]), "tokens": list(t)} for w, r in zip(workloads, refs) for pi, t in r.items()
    ]
    path.write_text(json.dumps({"references": rows, "p": p, "seed": seed}))
    keys = Counter((r["prompt_len"], r["tokens"][0]) for r in {json.dumps(r): r for r in rows}.values() if r["tokens"])
    return sum(n for n in keys.values() if n > 1)


def make_workloads(a, vocab: int) -> list[Workload]:
    out = []
    sampling = {"temperature": a.temperature, "top_p": a.top_p, "seed": a.seed * 1_000_003 + 1} if a.temperature else {}
    for w in a.workloads:
        if w == "fixed":
            out.append(fixed_workload(a.n_requests, a.prompts, a.input_len, a.output_len, vocab, a.seed))
        else:
            out.append(
                mixed_workload(a.n_requests, a.mixed_input, a.mixed_output, vocab, a.seed, a.long_frac, a.long_input)
            )
        out[-1].sampling = sampling
    if a.shared_prefix:  # a system prompt: every prompt begins with the same tokens
        (prefix,) = random_prompts([a.shared_prefix], vocab, random.Random(f"prefix:{a.seed}"))
        for w in out:
            if min(map(len, w.prompts)) <= a.shared_prefix:
                raise SystemExit(f"bench_serve: --shared-prefix {a.shared_prefix}: a {w.name} prompt is no longer")
            w.prompts = [prefix + p[a.shared_prefix :] for p in w.prompts]
            w.info["shared_prefix"] = a.shared_prefix
    return out


def _prepare(a, workloads: list[Workload], hf_prompts: list[list[int]], tmp: Path) -> tuple[dict, list[dict]]:
    """Runs benchmarks/baselines.py in a child process; returns its JSON and, per workload, the references
    it computed (prompt index -> tokens). Only the prompts it needs are sent to it."""
    prompts, ask, where, sampling = [], {}, [], {}
    for wi, w in enumerate(workloads):
        for pi, n in (w.ref_lengths(a.check_prompts) if a.check == "complete" else {}).items():
            if w.sampled(pi):  # the reference samples with the request's own seed
                sampling[str(len(prompts))] = dict(w.sampled(pi))
            ask[str(len(prompts))] = n
            where.append((wi, pi))
            prompts.append(w.prompts[pi])
    hf_off = len(prompts)
    prompts += hf_prompts
    jobs = {
        "prompts": prompts,
        "references": ask,
        "sampling": sampling,
        "hf_batches": [] if a.no_hf else sorted(set(a.hf_batches)),
        "hf_prompts": list(range(hf_off, len(prompts))),
        "hf_new": a.hf_new,
        "hf_runs": a.hf_runs,
    }
    (tmp / "jobs.json").write_text(json.dumps(jobs))
    cmd = [sys.executable, str(ROOT / "benchmarks" / "baselines.py"), "--device", a.device, "--max-len", str(a.max_len)]
    cmd += ["--jobs", str(tmp / "jobs.json"), "--out", str(tmp / "prep.json"), "--seed", str(a.seed)]
    if a.random_init:
        cmd += ["--random-init", a.random_init, "--ckpt-dir", a.ckpt_dir]
        if a.engine == "mtp":  # the checkpoint needs the MTP head (a checkpoint with it serves bf16 / fp8 too)
            cmd += ["--mtp"]
    elif a.model:
        cmd += ["--model", a.model]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    if a.device == "cpu":
        env["OMP_NUM_THREADS"] = "1"  # as the workers (benchmarks/load.py Serve): the same CPU kernels
    print(f"bench_serve: prepare: {shlex.join(cmd)}", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    subprocess.run(cmd, env=env, check=True)
    prep = json.loads((tmp / "prep.json").read_text())
    prep["seconds"] = round(time.monotonic() - t0, 1)
    got = prep.pop("references")
    refs: list[dict] = [{} for _ in workloads]
    for j, (wi, pi) in enumerate(where):
        refs[wi][pi] = got[str(j)]
    return prep, refs


def floor_at(cfg, rows: int, context: float, bandwidth: float, engine: str, dtype: str, mode: str = "fast") -> float:
    """The floor of N rows of AR on the workers' weights: fp8 for the fp8 engine in fast mode, else their
    dtype (bf16 on CUDA, fp32 on the CPU: mtp and exact mode get the bf16 AR floor, which speculation may
    pass); KV and conv state in their dtype."""
    weights = "fp8" if engine == "fp8" and mode == "fast" else dtype
    return floor_tok_s(cfg, rows, int(context), bandwidth, weights, DTYPE_BYTES[dtype])


def _start_serve(a, args: list[str], reference: Path | None):
    """`baton serve --processes ARGS`, or with --draft-p the same topology with the controlled decode
    worker (benchmarks/topology.py ControlledServe) reading `reference`; -> (serve, its info)."""
    if a.draft_p is None:
        serve = Serve(*args)
        return serve, {"argv": "baton " + shlex.join(serve.argv[3:])}
    from benchmarks.topology import ControlledServe

    serve = ControlledServe(
        args,
        reference=str(reference),
        draft_p=a.draft_p,
        draft_seed=a.draft_seed,
        mtp_k=a.k,
        mtp_draft_length=a.mtp_draft_length,
        env=serve_env(),
    )
    return serve, {"argv": serve.label, "baton_serve_args": shlex.join(args)}


def _serve_points(
    a, args: list[str], token: str, workloads: list[Workload], refs: list[dict], reference=None, layout: str = ""
):
    """One `baton serve --processes ARGS` (--draft-p: with the controlled decode worker reading the file
    `reference`): the warm-up, the "alone" references (the first serve only: a later one is checked
    against them), then every point; -> (serve info, points, warm-up)."""
    serve, info = _start_serve(a, args, reference)
    points, warm = [], []
    spec = (a.gen, a.k, a.draft_p, a.mtp_draft_length == "adaptive") if a.gen.speculates else None
    try:
        t0 = time.monotonic()
        addr = serve.wait(a.boot_timeout)
        info["boot_s"] = round(time.monotonic() - t0, 1)
        info["capacity"] = capacity(serve.workers(), token)  # what each worker sized (KV pages, slots)
        print(f"bench_serve: capacity {json.dumps(info['capacity'])}", file=sys.stderr, flush=True)
        w0 = workloads[0]
        for n in [int(x) for x in a.warmup.split(",") if x.strip()]:
            per = [[w0.job(i % len(w0.prompts), min(8, a.output_len))] for i in range(n)]
            p = closed_point(addr, token, per, a.gen, a.timeout)
            warm.append({k: p[k] for k in ("concurrency", "tok_s", "ttft_s_p50", "errors", "error_details")})
            print(f"bench_serve: warm-up {warm[-1]}", file=sys.stderr, flush=True)
        if a.check == "alone" and not any(refs):  # each checked prompt through the router by itself
            from baton.client import Client

            t1 = time.monotonic()
            with Client(addr, token=token) as c:
                for w, r in zip(workloads, refs):
                    for pi, n in w.ref_lengths(a.check_prompts).items():
                        s = run_job(c, w.job(pi, n), a.gen, a.timeout)
                        if s.status == "OK":
                            r[pi] = s.tokens
            info["alone_reference_s"] = round(time.monotonic() - t1, 1)
        steps = _StepStats(serve, token)
        for w, r in zip(workloads, refs):
            for n in a.points:
                jobs = w.jobs(r, 0, n * a.requests)
                per = [[jobs[i + k * n] for k in range(a.requests)] for i in range(n)]
                steps.start()
                pt = closed_point(addr, token, per, a.gen, a.timeout, spec)
                points.append({"workload": w.name} | _series(a) | pt | steps.read())
                print(f"bench_serve: {json.dumps(points[-1])}", file=sys.stderr, flush=True)
            for rate in a.rates:
                jobs = w.jobs(r, 0, a.num_prompts)
                sched = poisson_schedule(len(jobs), rate, a.seed)
                steps.start()
                pt = rate_point(addr, token, rate, jobs, sched, a.gen, a.timeout, spec)
                points.append({"workload": w.name} | _series(a) | pt | steps.read())
                print(f"bench_serve: {json.dumps(points[-1])}", file=sys.stderr, flush=True)
    finally:
        info["exit_code"] = serve.stop()
        if a.draft_p is not None:
            info["argv"] = serve.label  # with the router's addresses
        info["worker_exits"] = [ln.split("baton: ", 1)[1] for ln in serve.err if " exited with code " in ln]
        if info["exit_code"] not in (0, None) or not points or any(p.get("errors") for p in points):
            info["stderr_tail"] = serve.err[-40:]
        info["err"] = list(serve.err)  # the caller reads the placement lines, then drops it
        if a.out:  # the whole log beside the result (the result keeps a tail only on failure)
            info["log"] = str(serve_log_path(a.out, layout))
            Path(info["log"]).write_text("\n".join(serve.err) + "\n")
    return info, points, warm


def serve_log_path(out: str, layout: str = "") -> Path:
    """Where a run's `baton serve` stderr goes: OUT.json -> OUT.serve.log (OUT.serve-LAYOUT.log per layout)."""
    o = Path(out)
    return o.with_name(o.stem + (f".serve-{layout}" if layout else ".serve") + ".log")


def _series(a) -> dict:
    """What every point of this run says about how it generated (module doc: serve_mode, engine)."""
    return {"serve_mode": a.mode, "engine": a.engine} | ({"controlled": True} if a.draft_p is not None else {})


def run(a, argv: list[str]) -> dict:
    cfg = _model_config(a)
    workloads = make_workloads(a, cfg.vocab_size)
    top = max(a.hf_batches, default=1)
    hf_prompts = fixed_workload(top, top, a.input_len, 1, cfg.vocab_size, a.seed + 1).prompts  # HF's batches
    res: dict = {
        "benchmark": "bench_serve",
        "command": shlex.join(["python", "benchmarks/bench_serve.py", *argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git": _git_commit() if not a.commit else {"commit": a.commit, "dirty": None, "given": True},
    }
    skip = ("report", "out", "no_plot", "gen")
    res["config"] = {k: v for k, v in vars(a).items() if k not in skip and not callable(v)}
    res["env"] = {k: v for k, v in sorted(os.environ.items()) if k.startswith("BATON_") and "TOKEN" not in k}
    res["workloads"] = {w.name: w.info for w in workloads}
    res["sampling"] = workloads[0].sampling or "greedy"
    with tempfile.TemporaryDirectory(prefix="baton-bench-serve-") as tmp:
        tmp = Path(tmp)
        prep, refs = _prepare(a, workloads, hf_prompts, tmp)
        bandwidth = prep["bandwidth"]["bytes_per_s"]
        res["prepare"] = {k: v for k, v in prep.items() if k != "hf"}
        res["hf"] = prep["hf"]
        res["model"] = {
            "dir": prep["model_dir"],
            "random_init": a.random_init,
            "vocab": cfg.vocab_size,
            "hidden": cfg.hidden_size,
            "layers": cfg.num_hidden_layers,
            "weight_bytes": weight_bytes(cfg, "fp8" if a.engine == "fp8" and a.mode == "fast" else prep["dtype"]),
        }
        token = f"serve-{os.getpid()}-{random.randrange(1 << 30)}"
        (tmp / "token").write_text(token)
        args = ["--port", "0", "--http-port", "0", "--token-file", str(tmp / "token"), "--max-len", str(a.max_len)]
        args += ["--engine", a.engine, "--slots", str(a.slots), "--device", a.device, "--model", prep["model_dir"]]
        inflight = max(a.slots, max(a.points, default=1), a.num_prompts if a.rates else 0)
        if _serve_has("--max-inflight"):
            args += ["--max-inflight", str(inflight)]
        elif inflight > 64:
            res["note_max_inflight"] = "baton serve has no --max-inflight: its router refuses past 64 in flight"
        args += shlex.split(a.serve_args)
        ref_file = None
        if a.draft_p is not None:  # the controlled decode worker's references: every prompt's `baton complete`
            ref_file = tmp / "reference.json"
            shared = reference_file(ref_file, workloads, refs, a.draft_p, a.draft_seed)
            res["controlled"] = {"draft_p": a.draft_p, "draft_k": a.k, "draft_seed": a.draft_seed}
            res["controlled"]["draft_length"] = a.mtp_draft_length
            res["controlled"] |= {"references": sum(len(r) for r in refs), "shared_first_token": shared}
        points, warm = [], []
        if not a.layouts:  # one `baton serve` as given
            res["serve"], points, warm = _serve_points(a, args, token, workloads, refs, ref_file)
            res["serve"].pop("err")
            if "alone_reference_s" in res["serve"]:
                res["prepare"]["alone_reference_s"] = res["serve"].pop("alone_reference_s")
        else:
            res["layouts"] = layouts.plan(a.layouts, a.device, a.serve_args)
            for name, lay in res["layouts"].items():
                if lay.get("skipped"):
                    print(f"bench_serve: layout {name} skipped: {lay['skipped']}", file=sys.stderr, flush=True)
                    continue
                try:
                    lay["serve"], pts, lay["warmup"] = _serve_points(
                        a, args + lay["serve_args"], token, workloads, refs, ref_file, name
                    )
                except (RuntimeError, TimeoutError) as e:  # this layout's serve did not come up: the other still runs
                    lay["failed"] = f"baton serve: {e}"[-3000:]
                    print(f"bench_serve: layout {name} FAILED: {lay['failed']}", file=sys.stderr, flush=True)
                    continue
                if "alone_reference_s" in lay["serve"]:
                    res["prepare"]["alone_reference_s"] = lay["serve"].pop("alone_reference_s")
                lay["placement"] = layouts.placement(lay["serve"].pop("err", []))
                bad = layouts.placement_problem(name, lay["placement"], a.device)
                if bad:  # the points ran elsewhere than the layout says: not reported as that layout
                    lay["failed"] = bad
                    print(f"bench_serve: layout {name} FAILED: {bad}", file=sys.stderr, flush=True)
                    continue
                points += layouts.annotate(pts, name, lay["gpus"])
                warm = warm or lay["warmup"]
                res.setdefault("serve", lay["serve"])
    res["warmup"] = warm
    from benchmarks.report import machine

    res["machine"] = machine(device=a.device)  # after the servers: torch.cuda here touches the GPU
    by_w = {w.name: w for w in workloads}
    for p in points:
        w = by_w[p["workload"]]
        if p["mode"] == "concurrency":
            base = next((q for q in points if _same_series(q, p) and q.get("concurrency") == 1), None)
            p["scaling"] = round(p["tok_s"] / base["tok_s"], 2) if base and base["tok_s"] else None
            n = p["concurrency"]
            reqs = w.requests[: n * a.requests]
        else:
            n = None
            reqs = w.requests[: p["num_prompts"]]
        ctx = sum(len(w.prompts[pi]) + m / 2 for pi, m in reqs) / max(1, len(reqs))
        p["floor_context"] = round(ctx, 1)
        if n:
            p["floor_tok_s"] = round(floor_at(cfg, n, ctx, bandwidth, a.engine, prep["dtype"], a.mode), 1)
            p["pct_of_floor"] = round(100 * p["tok_s"] / p["floor_tok_s"], 1) if p["tok_s"] else None
    attach_hf(points, res["hf"])
    res["bandwidth_bytes_per_s"] = bandwidth
    res["points"] = points
    if a.layouts:
        res["comparison"] = layouts.compare(points)
        res["verdict"] = layouts.verdict(res["comparison"], res["layouts"])
    return res


SERIES = ("workload", "layout", "serve_mode", "engine", "draft_p", "draft_k")


def _same_series(q: dict, p: dict) -> bool:
    """The same workload in the same layout (None where the run had no --layout), generated the same way
    (mode, engine, controlled p and K: merged files may hold several)."""
    return all(q.get(k) == p.get(k) for k in SERIES)


def attach_hf(points: list[dict], hf: dict) -> None:
    """HF generate at batch N beside each closed-loop point of the fixed workload at N."""
    for p in points:
        h = hf.get(str(p.get("concurrency"))) if p.get("mode") == "concurrency" and p["workload"] == "fixed" else None
        if h and "tok_s" in h:
            p["hf_tok_s"] = round(h["tok_s"], 2)
            p["hf_decode_tok_s"] = round(h["decode_tok_s"], 2) if h.get("decode_tok_s") else None


def merge(results: list[dict], paths: list[str]) -> dict:
    """Several result files of one setup (e.g. N = 1,8,32 in one command, 64,128 in another) as one: the
    first file's metadata, every point (sorted), HF's batches of all, each point's HF filled in."""
    out = dict(results[0])
    out["merged_from"] = [
        {"file": str(f), "command": r.get("command"), "date": r.get("date")} for f, r in zip(paths, results)
    ]
    out["hf"] = {k: v for r in results for k, v in r.get("hf", {}).items()}
    lays = {k: v for r in results for k, v in r.get("layouts", {}).items() if not v.get("skipped")}
    if any("layouts" in r for r in results):  # a layout run in one file, skipped in another: the one that ran
        out["layouts"] = {k: v for r in results for k, v in r.get("layouts", {}).items()} | lays
    key = lambda p: (  # noqa: E731
        p.get("layout") or "",
        p["workload"],
        p.get("serve_mode") or "",
        p.get("engine") or "",
        p.get("draft_p") if p.get("draft_p") is not None else -1.0,
        p["mode"],
        p.get("concurrency") or 0,
        p.get("rate") or 0,
    )
    out["points"] = sorted((p for r in results for p in r.get("points", [])), key=key)
    attach_hf(out["points"], out["hf"])
    for p in out["points"]:
        base = next((q for q in out["points"] if _same_series(q, p) and q.get("concurrency") == 1), None)
        if p["mode"] == "concurrency" and base and base["tok_s"]:
            p["scaling"] = round(p["tok_s"] / base["tok_s"], 2)
    if "layouts" in out:
        out["comparison"] = layouts.compare(out["points"])
        out["verdict"] = layouts.verdict(out["comparison"], out["layouts"])
    return out


# ------------------------------------------------------------------------------------------ report
def _fmt(x, nd=1) -> str:
    return "" if x is None else f"{x:.{nd}f}" if isinstance(x, float) else str(x)


def run_label(p: dict) -> str:
    """How a point generated: "fast mtp p=0.9 K=4", "exact fp8 K=4", "fast bf16" ("" for an old file)."""
    if not p.get("engine"):
        return ""
    out = f"{p.get('serve_mode', 'fast')} {p['engine']}"
    if p.get("draft_p") is not None:
        out += f" p={p['draft_p']:g}"
    out += f" K={p['draft_k']}" if p.get("draft_k") else ""
    return out + (" adaptive" if p.get("draft_length") == "adaptive" else "")


def _spec_cells(p: dict) -> str:
    """accepted / drafted (rate, the law's) | tokens a round (the law's)."""
    if "rounds" not in p:
        return " | |"
    rate = f"{p['accepted']} / {p['drafted']} ({_fmt(p.get('acceptance_rate'), 3)}"
    rate += f", law {_fmt(p['expected_acceptance_rate'], 3)})" if "expected_acceptance_rate" in p else ")"
    tpr = _fmt(p.get("tokens_per_round"), 2)
    tpr += f" (law {_fmt(p['expected_tokens_per_round'], 2)})" if "expected_tokens_per_round" in p else ""
    return f" {rate} | {tpr} |"


def _tables(points: list[dict]) -> list[str]:
    """The closed-loop and the Poisson tables; a "run" column where the points generated in more than one
    way or speculated, and the speculation columns where any did."""
    lines: list[str] = []
    spec = any("rounds" in p for p in points)
    runs = spec or len({run_label(p) for p in points}) > 1
    run_h, run_s = ("| run ", "|---") if runs else ("", "")
    spec_h, spec_s = (" accepted / drafted | tokens / round |", "---|---|") if spec else ("", "")
    run_c = lambda p: f"| {run_label(p)} " if runs else ""  # noqa: E731
    spec_c = lambda p: _spec_cells(p) if spec else ""  # noqa: E731
    closed = [p for p in points if p.get("mode") == "concurrency"]
    if closed:
        lines += [
            f"{run_h}| workload | N | all streams tok/s | x N=1 | each stream p50 (min) | TTFT p50 / p99 s | "
            "ITL p50 / p99 s | HF batch N tok/s (decode) | floor tok/s | % floor | errors | differing / checked |"
            + spec_h,
            f"{run_s}|---|---|---|---|---|---|---|---|---|---|---|---|" + spec_s,
        ]
        for p in closed:
            hf = f"{_fmt(p.get('hf_tok_s'))} ({_fmt(p.get('hf_decode_tok_s'))})" if "hf_tok_s" in p else ""
            lines.append(
                f"{run_c(p)}| {p['workload']} | {p['concurrency']} | {_fmt(p['tok_s'])} | {_fmt(p.get('scaling'), 2)} | "
                f"{_fmt(p['stream_tok_s_p50'])} ({_fmt(p.get('stream_tok_s_min'))}) | "
                f"{_fmt(p['ttft_s_p50'], 3)} / {_fmt(p['ttft_s_p99'], 3)} | {_fmt(p['itl_s_p50'], 3)} / "
                f"{_fmt(p['itl_s_p99'], 3)} | {hf} | {_fmt(p.get('floor_tok_s'))} | {_fmt(p.get('pct_of_floor'))} | "
                f"{json.dumps(p['errors']) if p['errors'] else 0} | {p['mismatched']} / {p['checked']} |{spec_c(p)}"
            )
    rated = [p for p in points if p.get("mode") == "rate"]
    if rated:
        lines += [
            "",
            f"{run_h}| workload | rate req/s | requests | tok/s | req/s done | mean in flight | TTFT p50 / p99 s | "
            "ITL p50 / p99 s | errors | differing / checked |" + spec_h,
            f"{run_s}|---|---|---|---|---|---|---|---|---|---|" + spec_s,
        ]
        for p in rated:
            lines.append(
                f"{run_c(p)}| {p['workload']} | {p['rate']:g} | {p['num_prompts']} | {_fmt(p['tok_s'])} | "
                f"{_fmt(p['requests_per_s'], 2)} | {_fmt(p['mean_inflight'])} | {_fmt(p['ttft_s_p50'], 3)} / "
                f"{_fmt(p['ttft_s_p99'], 3)} | {_fmt(p['itl_s_p50'], 3)} / {_fmt(p['itl_s_p99'], 3)} | "
                f"{json.dumps(p['errors']) if p['errors'] else 0} | {p['mismatched']} / {p['checked']} |{spec_c(p)}"
            )
    return lines


def _controlled_note(c: dict | None) -> str:
    if not c:
        return ""
    return (
        f" (controlled drafts: right with p = {c['draft_p']:g}, K = {c['draft_k']}, seed {c['draft_seed']}; "
        f"{c['references']} references, {c['shared_first_token']} sharing a prompt length and first token)"
    )


def markdown(res: dict) -> str:
    c = res.get("config", {})
    m = res.get("machine", {})
    g = res.get("git", {})
    lines = [
        f"# bench_serve, {res.get('date', '')}\n",
        f"`{res.get('command', '')}`\n",
        f"Machine: {m.get('gpu') or m.get('cpu', '')} ({m.get('host', '')}); torch {m.get('torch', '')}; "
        f"commit {(g.get('commit') or '?')[:10]}{' (dirty)' if g.get('dirty') else ''}. Model: "
        f"{res.get('model', {}).get('random_init') or res.get('model', {}).get('dir', '')}, engine {c.get('engine')}"
        f"{', ' + c['mode'] + ' mode' if c.get('mode') not in (None, 'fast') else ''}"
        f"{_controlled_note(res.get('controlled'))}, "
        f"`{res.get('serve', {}).get('argv', '')}`. Bandwidth "
        f"{res.get('bandwidth_bytes_per_s', 0) / 1e9:.0f} GB/s ({res.get('prepare', {}).get('bandwidth', {}).get('how', '')}).\n",
    ]
    for m_ in res.get("merged_from", [])[1:]:
        lines.append(f"Merged with `{m_['command']}` ({m_['date']}).\n")
    if res.get("layouts"):
        lines.append(layouts.markdown(res))
    lays = list(dict.fromkeys(p["layout"] for p in res.get("points", []) if p.get("layout")))
    for lay in lays or [None]:
        if lay:
            g = res["layouts"].get(lay, {}).get("gpus")
            lines.append(f"\n### {lay} layout ({g} GPU{'s' * (g != 1)}), every point\n")
        lines += _tables([p for p in res.get("points", []) if p.get("layout") == lay])
    hf = res.get("hf", {})
    if hf.get("skipped"):
        lines.append(f"\nHF generate skipped: {hf['skipped']}")
    for k, v in sorted(
        ((k, v) for k, v in hf.items() if isinstance(v, dict) and "skipped" in v), key=lambda kv: int(kv[0])
    ):
        lines.append(f"\nHF generate at batch {k} skipped: {v['skipped']}")
    for k in ("note_max_inflight",):
        if k in res:
            lines.append(f"\nNote: {res[k]}")
    return "\n".join(lines) + "\n"


def plot(res: dict, path: Path) -> bool:
    """Throughput against concurrency (Baton per workload, HF at batch N, the floor), latencies, and the
    Poisson points when there are any. False when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        return False
    if res.get("layouts"):  # the two layouts side by side
        layouts.plot(res, path, plt)
        return True
    pts = res.get("points", [])
    closed = [p for p in pts if p.get("mode") == "concurrency"]
    rated = [p for p in pts if p.get("mode") == "rate" and math.isfinite(p["rate"])]  # rate inf: a burst
    ncol = 2 + bool(rated)
    fig, axes = plt.subplots(1, ncol, figsize=(5.5 * ncol, 4.2))
    ax, lat = axes[0], axes[1]
    eng = res.get("config", {}).get("engine", "")
    for w, run_ in sorted({(p["workload"], run_label(p)) for p in closed}):
        rows = [p for p in closed if p["workload"] == w and run_label(p) == run_]
        xs = [p["concurrency"] for p in rows]
        ax.plot(xs, [p["tok_s"] for p in rows], marker="o", label=f"Baton {run_ or eng}, {w}")
        w = f"{w}, {run_}" if run_ else w
        lat.plot(xs, [p["ttft_s_p50"] for p in rows], marker="o", label=f"TTFT p50, {w}")
        lat.plot(xs, [p["ttft_s_p99"] for p in rows], marker="o", linestyle=":", label=f"TTFT p99, {w}")
        lat.plot(xs, [p["itl_s_p50"] for p in rows], marker="s", label=f"inter-token p50, {w}")
    fixed = [p for p in closed if p["workload"] == "fixed"] or closed
    hf = [p for p in fixed if p.get("hf_decode_tok_s") or p.get("hf_tok_s")]
    if hf:
        ax.plot(
            [p["concurrency"] for p in hf],
            [p.get("hf_decode_tok_s") or p["hf_tok_s"] for p in hf],
            marker="^",
            color="grey",
            linestyle="--",
            label="HF generate, batch N (decode rate)",
        )
    fl = [p for p in fixed if p.get("floor_tok_s")]
    if fl:
        ax.plot(
            [p["concurrency"] for p in fl], [p["floor_tok_s"] for p in fl], "k--", label="bandwidth floor (measured BW)"
        )
    for a_ in (ax, lat):
        a_.set_xscale("log", base=2)
        a_.set_yscale("log")
        a_.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        a_.set_xticks(sorted({p["concurrency"] for p in closed}))
        a_.set_xlabel("concurrent streams")
        a_.grid(True, which="both", alpha=0.3)
    ax.set_ylabel("output tokens/s, all streams")
    lat.set_ylabel("seconds")
    for a_ in (ax, lat):
        if a_.get_legend_handles_labels()[0]:
            a_.legend(fontsize=7)
    m = res.get("machine", {})
    ax.set_title(f"{m.get('gpu') or 'CPU'}: throughput", fontsize=9)
    lat.set_title("latency", fontsize=9)
    if rated:
        rx = axes[2]
        tw = rx.twinx()
        for w in sorted({p["workload"] for p in rated}):
            rows = sorted((p for p in rated if p["workload"] == w), key=lambda p: p["rate"])
            xs = [p["rate"] for p in rows]
            (line,) = rx.plot(xs, [p["tok_s"] for p in rows], marker="o", label=f"tok/s, {w}")
            tw.plot(
                xs, [p["ttft_s_p50"] for p in rows], ":", color=line.get_color(), marker="x", label=f"TTFT p50, {w}"
            )
        rx.set_xlabel("Poisson request rate (req/s)")
        rx.set_ylabel("output tokens/s (solid)")
        tw.set_ylabel("TTFT p50, s (dotted)")
        rx.legend(fontsize=7, loc="upper left")
        tw.legend(fontsize=7, loc="lower right")
        rx.set_title("Poisson arrivals", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_report(res: dict, json_path: Path) -> list[Path]:
    """The .md and (matplotlib permitting) .png beside json_path; returns what was written."""
    md = json_path.with_suffix(".md")
    md.write_text(markdown(res))
    out = [md]
    png = json_path.with_suffix(".png")
    if plot(res, png):
        out.append(png)
    else:
        print(
            "bench_serve: no matplotlib here: no plot (pip install -e '.[bench]', or --report later)", file=sys.stderr
        )
    return out


def main(argv: list[str] | None = None) -> int:
    program = argv is None  # run as a program (not called by a test or baton bench)
    argv = sys.argv[1:] if argv is None else list(argv)
    a = build_parser().parse_args(argv)
    if a.report:
        res = [json.loads(Path(f).read_text()) for f in a.report]
        if len(res) > 1 and not a.out:
            raise SystemExit("--report with several files merges them: give --out MERGED.json")
        path = Path(a.out or a.report[0])
        if len(res) > 1:
            from benchmarks.report import emit

            emit(merge(res, a.report), path)
        for f in write_report(merge(res, a.report) if len(res) > 1 else res[0], path):
            print(f)
        return 0
    resolve(a)
    layouts.refuse(a.layouts, a.device)  # before the prepare: an explicit split never runs shared instead
    from benchmarks.report import emit, exit_on_sigterm

    if program:
        exit_on_sigterm()  # a cut run stops its `baton serve` (run's finally) instead of leaving it on the GPU
    res = run(a, argv)

    stamp = datetime.datetime.now().strftime("%Y-%m-%d-%H%M%S")
    out = Path(a.out) if a.out else RESULTS / f"serve-{a.device}-{stamp}.json"
    emit(res, out)
    if not a.no_plot:
        for f in write_report(res, out):
            print(f"bench_serve: wrote {f}", file=sys.stderr)
    bad = sum(p["mismatched"] for p in res["points"])
    if bad:
        print(f"bench_serve: FAIL: {bad} streams differ from their reference", file=sys.stderr)
    failed = [n for n, lay in res.get("layouts", {}).items() if lay.get("failed")]
    if failed:
        print(f"bench_serve: FAIL: layout {', '.join(failed)} did not run as asked (JSON: layouts)", file=sys.stderr)
    return 1 if bad or failed else 0


if __name__ == "__main__":
    sys.exit(main())
