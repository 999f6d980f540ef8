"""Where a burst's time to first token goes: N prompts sent at once to a prefill worker, each handed
over to a decode worker process (issue 20's TTFT target: a burst of 32 x 512-token prompts, p50 <= 1 s).

    python benchmarks/bench_ttft_burst.py --random-init qwen3.5-9b --device cuda --prompt 512 --bursts 1,8,32
    python benchmarks/bench_ttft_burst.py --device cpu --prompt 32 --bursts 1,4        # the embedded model

The prefill worker serves in this process (its batched prefill gathers the burst into passes of at most
--prefill-budget tokens); the decode worker is `python -m decode_worker` (as bench_ttft.py runs it). Each
burst: N threads send their PrefillStream (FAST, a real decode_target, the hand-off's timeline asked) at one
barrier; per request the marks of baton/handoff/timeline.py are read on the host's shared monotonic
clock, as ms after the burst's first send:
    queued_ms       prefill.rpc_start: the Prefill began in the worker
    compute_end_ms  prefill.compute_end: its pass (the one that computed its last piece) finished
    loaded_ms       decode.loaded: its state verified and in its decode slot
    first_ms        the first token is back here (the TTFT the router sees: PrefillStream's first message,
                    sent once the decode worker admitted the session, before the state has landed)
    reply_ms        client.reply: the whole answer is back (the state has landed on the decode worker)
and the per-request spans compute_ms = compute_end - rpc_start (waiting for and running its pass) and
tail_ms = reply - compute_end (the hand-off after the compute). Each burst reports p50 / max over
requests and --runs; `passes_per_burst` is the prefill worker's gathered passes per burst, `passes` each
pass's pieces, tokens and wall ms (ExactEngine.passes). Unless --no-plain, each burst is sent again with no
decode_target (computed and released, no hand-off): plain_reply_ms and plain_passes, the same passes
without the state streaming beside them. --profile FILE: one more burst of the largest size under
torch.profiler, its op tables (self CPU time; device time) written to FILE. --decode-device cpu: the
decode worker on the CPU (the same bf16 model), to tell a pass slowed by this process's other threads from
one slowed by the GPU's time-slicing between the two processes. --prefill-process: the prefill worker is
`python -m prefill_worker` too, so no thread of this benchmark shares its GIL, as in a deployment; its
passes then come from WorkerStats (per burst: passes, pieces, mean pass ms; not each pass). Prints one
JSON object.
"""

from __future__ import annotations

import argparse
import datetime
import shlex
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from baton import op_profile  # noqa: E402
from baton.config import ModelConfig  # noqa: E402
from baton.loading import DEFAULT_MODEL_DIR  # noqa: E402
from baton.random_init import config_of  # noqa: E402
from baton.rpc import make_channel  # noqa: E402
from baton.settings import Settings  # noqa: E402
from baton.v1 import common_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc  # noqa: E402
from benchmarks.bench_ttft import WIDTH, build_model, decode_process, machine, worker_process  # noqa: E402
from benchmarks.report import emit, exit_on_sigterm  # noqa: E402
from prefill_worker.serve import serve_prefill  # noqa: E402

MARKS = {"queued_ms": "prefill.rpc_start", "compute_end_ms": "prefill.compute_end", "loaded_ms": "decode.loaded"}


def _stats(xs: list[float]) -> dict:
    return {"p50": round(statistics.median(xs), 2), "max": round(max(xs), 2)} if xs else {}


def burst(P, D, target: str, prompts: list[list[int]], tag: str) -> list[dict]:
    """All prompts' Prefill calls at once -> per request the marks (ms after the first send)."""
    n, out = len(prompts), [None] * len(prompts)
    gate = threading.Barrier(n)

    def one(i: int) -> None:
        gate.wait()
        sent = time.monotonic_ns()
        stream = P.PrefillStream(
            prefill_pb2.PrefillRequest(
                session_id=f"{tag}-{i}",
                prompt_ids=prompts[i],
                mode=common_pb2.FAST,
                decode_target=target,
                timeline=True,
                engine=common_pb2.BF16,
            ),
            timeout=900,
        )
        first = None
        for r in stream:  # one or two messages: the last is the whole answer
            first = first or time.monotonic_ns()
        out[i] = (sent, first, time.monotonic_ns(), dict(r.bridge.timeline.marks_ns))

    th = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in th:
        t.start()
    for t in th:
        t.join()
    for i in range(n):
        assert D.Release(common_pb2.ReleaseRequest(session_id=f"{tag}-{i}"), timeout=60).released
    t0 = min(sent for sent, _, _, _ in out)
    rows = []
    for sent, first, reply, marks in out:
        row = {k: (marks[m] - t0) / 1e6 for k, m in MARKS.items() if m in marks}
        row["first_ms"] = (first - t0) / 1e6
        row["reply_ms"] = (reply - t0) / 1e6
        row["compute_ms"] = row["compute_end_ms"] - row["queued_ms"]
        row["tail_ms"] = row["reply_ms"] - row["compute_end_ms"]
        rows.append(row)
    return rows


def burst_plain(P, prompts: list[list[int]], tag: str) -> list[float]:
    """The same burst with no decode_target (the prompt computed and released, no hand-off) -> per
    request ms from its send to its reply: the passes without the state streaming beside them."""
    n, out = len(prompts), [0.0] * len(prompts)
    gate = threading.Barrier(n)

    def one(i: int) -> None:
        gate.wait()
        sent = time.monotonic_ns()
        P.Prefill(
            prefill_pb2.PrefillRequest(
                session_id=f"{tag}-{i}", prompt_ids=prompts[i], mode=common_pb2.FAST, engine=common_pb2.BF16
            ),
            timeout=900,
        )
        out[i] = (time.monotonic_ns() - sent) / 1e6

    th = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in th:
        t.start()
    for t in th:
        t.join()
    return out


class _PrefillProcess:
    """The prefill worker as `python -m prefill_worker` (--prefill-process): what main() reads of an in-process
    one, from its WorkerStats: the passes since the last mark, as one summary entry."""

    def __init__(self, a, max_len: int, token: str, slots: int):
        extra = [("slots", slots), ("handoff_sender", a.sender)]
        extra += [("prefill_budget", a.prefill_budget)] if a.prefill_budget else []
        self.proc = worker_process(a, "prefill", max_len, token, extra, a.device)
        self.address, self._mark = self.proc.address, None

    def stats(self, P) -> common_pb2.WorkerStats:
        return P.GetStats(common_pb2.WorkerStatsRequest(), timeout=30)

    def mark(self, P) -> None:
        self._mark = self.stats(P)

    def passes(self, P) -> tuple[int, list[dict]]:
        """-> (passes since mark(), [their summary: passes, pieces, tokens, mean ms])."""
        now, was = self.stats(P), self._mark
        n, sec = now.prefill_passes - was.prefill_passes, now.prefill_pass_s - was.prefill_pass_s
        pieces, tokens = now.prefill_pieces - was.prefill_pieces, now.prefill_tokens - was.prefill_tokens
        return n, [{"passes": n, "pieces": pieces, "tokens": tokens, "ms": round(1e3 * sec / max(n, 1), 2)}]

    def stop(self) -> None:
        self.proc.stop()


class _InProcess:
    """The prefill worker served in this process (the default): each pass's log (ExactEngine.passes)."""

    def __init__(self, ps, ph):
        self.engine, self._ph, self.address, self._b0 = ps.engine, ph, ph.address, 0

    def mark(self, P) -> None:
        self._b0 = self.engine.prefills.batches
        self.engine.passes.clear()

    def passes(self, P) -> tuple[int, list[dict]]:
        return self.engine.prefills.batches - self._b0, _passes(self.engine)

    def stop(self) -> None:
        self._ph.stop(0)


def _passes(engine) -> list[dict]:
    """The prefill worker's passes since its log was last cleared: pieces, tokens, wall ms each."""
    return [{"pieces": k, "tokens": t, "ms": round(1e3 * sec, 2)} for k, t, sec in engine.passes]


def _profile(path: Path, fn) -> None:
    """Runs fn under torch.profiler (CPU and, on CUDA, kernels) and writes the op tables to path."""
    with op_profile.profiler() as prof:
        fn()
    path.write_text(op_profile.tables(prof))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--random-init", default=None, help="shape name (baton/random_init.py)")
    src.add_argument("--model", default=None, help="checkpoint directory (default: the embedded default model)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--prompt", type=int, default=512, help="tokens per prompt")
    ap.add_argument("--bursts", default="1,8,32", help="comma-separated burst sizes")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--prefill-budget", type=int, default=None, help="tokens a prefill pass may hold")
    ap.add_argument("--sender", default=Settings().handoff_sender, choices=("process", "thread"))
    ap.add_argument(
        "--decode-device",
        default=None,
        help="the decode worker's device (default --device); cpu: its LoadState never touches the GPU, so "
        "a pass slowed beside the hand-off is slowed in this process, not by the two processes sharing the GPU "
        "(the 9B shape's random init takes minutes on the CPU: over 200 s on the H200 host)",
    )
    ap.add_argument("--no-plain", action="store_true", help="skip each burst's run without a hand-off")
    ap.add_argument(
        "--prefill-process",
        action="store_true",
        help="the prefill worker in its own process (python -m prefill_worker), not in this one: no thread of "
        "the benchmark shares its GIL; passes from its WorkerStats (per burst, not each pass)",
    )
    ap.add_argument("--profile", type=Path, default=None, help="profile one more burst of the largest size: op tables")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    a.no_mtp, a.decode_gpu = False, None  # what bench_ttft's helpers read
    if argv is None:  # as a program: a cut run stops its decode worker process (the finally below)
        exit_on_sigterm()
    sizes = [int(x) for x in a.bursts.split(",") if x.strip()]
    if a.prefill_process and a.profile is not None:
        ap.error("--profile profiles this process: not with --prefill-process")
    settings = Settings(token="bench-ttft-burst", handoff_sender=a.sender)
    max_len, top = a.prompt + WIDTH + 64, max(sizes)
    if a.prefill_process:  # no model in this process: the vocabulary from the config
        cfg = config_of(a.random_init) if a.random_init else ModelConfig.from_hf(a.model or DEFAULT_MODEL_DIR)
        V, model_desc = (
            cfg.vocab_size,
            {"random_init": a.random_init} if a.random_init else {"model_dir": str(a.model or DEFAULT_MODEL_DIR)},
        )
        side = _PrefillProcess(a, max_len, settings.token, top)
    else:
        lm, model_desc = build_model(a)
        V = lm.cfg.vocab_size
        ph, ps = serve_prefill(
            lm, device=a.device, width=WIDTH, max_len=max_len, slots=top, settings=settings,
            prefill_budget=a.prefill_budget,
        )  # fmt: skip
        side = _InProcess(ps, ph)
    dh = None
    try:
        dh = decode_process(a, max_len, settings.token, slots=top)
        g = torch.Generator().manual_seed(1)
        results = []
        with make_channel(side.address, settings) as pc, make_channel(dh.address, settings) as dc:
            P, D = prefill_pb2_grpc.PrefillWorkerStub(pc), decode_pb2_grpc.DecodeWorkerStub(dc)
            for n in sizes:
                rows, passes, logs, plain, plain_logs = [], [], [], [], []
                for run in range(a.warmup + a.runs):
                    prompts = [torch.randint(0, V, (a.prompt,), generator=g).tolist() for _ in range(n)]
                    side.mark(P)
                    got = burst(P, D, dh.address, prompts, f"b{n}-{run}")
                    if run >= a.warmup:
                        rows += got
                        count, log = side.passes(P)
                        passes.append(count)
                        logs.append(log)
                    if not a.no_plain:
                        side.mark(P)
                        ms = burst_plain(P, prompts, f"p{n}-{run}")
                        if run >= a.warmup:
                            plain += ms
                            plain_logs.append(side.passes(P)[1])
                res = {"burst": n, "prompt_tokens": a.prompt, "requests": len(rows), "passes_per_burst": passes}
                res |= {
                    k: _stats([r[k] for r in rows if k in r])
                    for k in (*MARKS, "first_ms", "reply_ms", "compute_ms", "tail_ms")
                }
                # each pass's wall time in the worker, with the hand-off streaming beside it and without
                res |= {"passes": logs, "plain_reply_ms": _stats(plain), "plain_passes": plain_logs}
                results.append(res)
                print(f"bench_ttft_burst: {res}", file=sys.stderr, flush=True)
            if a.profile is not None:
                prompts = [torch.randint(0, V, (a.prompt,), generator=g).tolist() for _ in range(top)]
                _profile(a.profile, lambda: burst(P, D, dh.address, prompts, f"prof{top}"))
    finally:
        if dh is not None:
            dh.stop()
        side.stop()
    out = {
        "benchmark": "ttft_burst",
        "command": shlex.join(["python", "benchmarks/bench_ttft_burst.py", *(sys.argv[1:] if argv is None else argv)]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "device": a.device,
        "decode_device": a.decode_device or a.device,
        "model": model_desc,
        "sender": a.sender,
        "prefill_budget": a.prefill_budget if a.prefill_process else side.engine.prefills.budget,
        "prefill_process": a.prefill_process,
        "results": results,
    }
    emit(out, a.out)
    return out


if __name__ == "__main__":
    main()
