"""Load test: N concurrent streaming clients against `baton serve --processes` (CPU, embedded model).

    python benchmarks/load.py [--clients 64] [--duration 60] [--max-new-tokens 32] [--max-len 512]
                              [--addr HOST:PORT --workers ADDR,ADDR --token-file F] [--out FILE]

Without --addr it starts `baton serve --processes --port 0` with a fresh token file and stops it at
the end (SIGTERM). Each client is a thread with its own channel (baton.client.Client) that loops for
--duration seconds over a fixed schedule of (prompt, mode, engine): fast bf16 / mtp / fp8 and exact
fp8 / mtp, max_new_tokens tokens each, ignore_eos. A RESOURCE_EXHAUSTED refusal (router max_inflight
or full worker slots) is counted and the request retried after a jittered exponential back-off
(50 ms doubling to 2 s, reset by a success); any other error is counted (and backed off too).

Checked, per completed stream:
  * fast bf16, fast mtp and every exact stream against `baton.complete.complete` of its prompt (same
    window, precomputed while the servers boot): lost tokens (reference tokens missing), duplicated
    tokens (extra tokens), wrong tokens (substituted), from a difflib alignment; 0 when identical;
  * every stream: usage.completion_tokens == tokens received == max_new_tokens.
After the run: sessions on every worker (GetStats; waits up to --settle s for late Releases).
Prints one JSON object: requests, errors by status, the checks, sessions left, p50/p99 TTFT, inter-token
latency (gaps between streamed messages, per token), time per output token, tokens/s.
`run(...)` returns the same dict (tests/system/test_reliability_load.py runs the short version).
"""

from __future__ import annotations

import argparse
import datetime
import difflib
import json
import os
import platform
import random
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n",
    "class Config:\n    def __init__(self",
    "for i in range(",
    "def parse_args(argv=None):",
    "    return self._data[",
    "with open(path) as f:",
    "if __name__ == ",
    "try:\n    import json\nexcept ImportError:",
    "def __repr__(self):",
    "raise ValueError(",
    "@property\ndef",
    "lines = text.splitlines()",
    "def _check(self, value):",
    "from collections import",
    "while True:\n",
]
MIX = [("fast", "bf16"), ("exact", "fp8"), ("fast", "mtp"), ("exact", "mtp"), ("fast", "fp8")]
CHECKED = {("fast", "bf16"), ("fast", "mtp"), ("exact", "fp8"), ("exact", "mtp")}
SERVING_RE = re.compile(r"^baton: serving on (\S+)$")
READY_RE = re.compile(r"^baton: ((?:prefill|decode)-\d+) ready(?: again)? on (\S+) ")


# ------------------------------------------------------------------------------------------ server
def serve_env(env: dict | None = None) -> dict[str, str]:
    """The environment of the served processes (Serve, benchmarks/topology.py ControlledServe)."""
    # NOTE: one intra-op thread per worker: on a small shared CPU box torch's default (all cores per
    # process) oversubscribes and OpenMP spin-waits make each step 10-50x slower
    return {
        **os.environ,
        # NOTE: ROOT first, the caller's path kept: on the GPU machine it holds /tmp/gpu-site (fla, grpc wheels)
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "PYTHONUNBUFFERED": "1",
        "BATON_LOG_LEVEL": os.environ.get("BATON_LOG_LEVEL", "WARNING"),  # quiet, unless the caller asks
        "OMP_NUM_THREADS": "1",
        **(env or {}),
    }


class Serve:
    """`baton serve --processes` in its own process group; stdout/stderr lines collected."""

    def __init__(self, *args: str, env: dict | None = None):
        self.env = serve_env(env)
        self.argv = [sys.executable, "-m", "baton.cli", "serve", "--processes", *args]
        self.proc = subprocess.Popen(
            self.argv,
            cwd=ROOT,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.out: list[str] = []
        self.err: list[str] = []
        for stream, sink in ((self.proc.stdout, self.out), (self.proc.stderr, self.err)):
            threading.Thread(
                target=lambda s=stream, k=sink: [k.append(ln.rstrip("\n")) for ln in s], daemon=True
            ).start()

    def wait(self, timeout: float = 300.0) -> str:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            hit = next((m.group(1) for ln in self.out if (m := SERVING_RE.match(ln))), None)
            if hit:
                return hit
            if self.proc.poll() is not None:
                raise RuntimeError(f"baton serve exited with {self.proc.returncode}:\n" + "\n".join(self.err[-30:]))
            time.sleep(0.1)
        raise TimeoutError("baton serve printed no serving line in time:\n" + "\n".join(self.err[-30:]))

    def router_pid(self) -> int:
        """The router's process: `baton serve` runs it in its own (the workers are its children)."""
        return self.proc.pid

    def workers(self) -> dict[str, str]:
        """name (prefill-0, decode-0, ...) -> address, from the progress lines (latest wins)."""
        return {m.group(1): m.group(2) for ln in self.err if (m := READY_RE.match(ln))}

    def stop(self, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)  # the workers follow (PR_SET_PDEATHSIG)
                self.proc.wait()
        return self.proc.returncode


def worker_sessions(addresses: dict[str, str], token: str | None) -> dict[str, int]:
    from baton.rpc import make_channel
    from baton.settings import Settings
    from baton.v1 import common_pb2, decode_pb2_grpc, prefill_pb2_grpc

    out = {}
    for name, addr in addresses.items():
        stub_cls = (
            prefill_pb2_grpc.PrefillWorkerStub if name.startswith("prefill") else decode_pb2_grpc.DecodeWorkerStub
        )
        with make_channel(addr, Settings(token=token)) as ch:
            out[name] = stub_cls(ch).GetStats(common_pb2.WorkerStatsRequest(), timeout=5).sessions
    return out


_STEP_TIMES = (  # WorkerStats' step durations, s: the worst decode worker's of each
    "step_s_p50",
    "step_s_p99",
    "step_interval_s_p50",
    "step_interval_s_p99",
    "step_device_s_p50",
    "step_device_s_p99",
    "stall_s_p99",
    "stall_s_max",
    "first_tokens_s_p50",
    "first_tokens_s_p99",
    "decode_called_s_p50",
    "decode_called_s_p99",
    "decode_first_message_s_p50",
    "decode_first_message_s_p99",
    "decode_setup_s_p50",
    "decode_setup_s_p99",
    "stall_share",
)


def decode_steps(addresses: dict[str, str], token: str | None, reset: bool = False) -> dict:
    """The decode workers' batched-step stats (WorkerStats): steps, mean rows a step, the largest step,
    step duration, step period and (CUDA) device time of a step, p50 / p99 (the worst worker's), since the
    last reset; held_rows (joined sessions left out of steps) and phase_share (the step threads' time per
    phase, baton/engine/scheduler.py, as a share of their windows' wall time); reset=True starts a new window."""
    from baton.rpc import make_channel
    from baton.settings import Settings
    from baton.v1 import common_pb2, decode_pb2_grpc

    steps = rows = biggest = held = 0
    worst = dict.fromkeys(_STEP_TIMES, 0.0)
    phases: dict[str, float] = {}  # the step thread's seconds per phase, the busiest worker's share
    window = 0.0
    for name, addr in addresses.items():
        if not name.startswith("decode"):
            continue
        with make_channel(addr, Settings(token=token)) as ch:
            st = decode_pb2_grpc.DecodeWorkerStub(ch).GetStats(
                common_pb2.WorkerStatsRequest(reset_steps=reset), timeout=5
            )
        steps, rows, biggest = steps + st.steps, rows + st.step_rows, max(biggest, st.max_step_rows)
        held += st.step_held_rows
        worst = {k: max(v, getattr(st, k)) for k, v in worst.items()}
        for phase, secs in st.step_phase_s.items():
            phases[phase] = phases.get(phase, 0.0) + secs
        window += st.step_phase_window_s
    shares = {p: secs / window for p, secs in phases.items()} if window > 0 else {}
    return {"steps": steps, "rows": rows, "max_rows": biggest, "held_rows": held, "phase_share": shares} | worst


def gathers(addresses: dict[str, str], token: str | None) -> dict[str, tuple]:
    """Per role (prefill, decode): the workers' Gather batches, the calls in them and their summed seconds by
        part ({"wait", "lock", "run"}: WorkerStats gathered_batches / gathered_items / gathered_s: Verify on a
        prefill worker, Draft and mtp rounds on a decode worker), summed over the role's workers; counters since
        the worker started. Also "ROLE_batched": its batched round RPCs and the requests in them. Also "prefill_pass": the
        prefill workers' batched prefill passes, their pieces, tokens, summed seconds and the times they gave
        the compute lock to a waiting Verify batch (WorkerStats.gathered_gave_way). Also "prefix_cache": the
        prefill workers' prefix cache hits, evictions and evictions for a request's pages. Also "mtp_by_k": the decode
    workers' fast mtp rounds by K, {K: (rounds, seconds)} (WorkerStats.mtp_rounds_by_k / mtp_round_s_by_k), and
    "mtp_spec": their controllers' last speculative rounds, (round, K, batch, seconds, probe) each
    (WorkerStats.mtp_spec_rounds)."""
    out: dict[str, tuple] = {}
    for role, st in _role_stats(addresses, token):
        b, i, t = out.get(role, (0, 0, {}))
        t = dict(t)
        for part, secs in st.gathered_s.items():
            t[part] = t.get(part, 0.0) + secs
        out[role] = (b + st.gathered_batches, i + st.gathered_items, t)
        r, n = out.get(role + "_batched", (0, 0))
        out[role + "_batched"] = (r + st.batched_rpcs, n + st.batched_items)  # DraftMany / VerifyMany
        by_k = dict(out.get("mtp_by_k", {}))  # fast mtp rounds by K: (rounds, seconds) (WorkerStats.mtp_*_by_k)
        for k, n in st.mtp_rounds_by_k.items():
            r0, s0 = by_k.get(k, (0, 0.0))
            by_k[k] = (r0 + n, s0 + st.mtp_round_s_by_k.get(k, 0.0))
        out["mtp_by_k"] = by_k
        spec = st.mtp_spec_rounds  # the controllers' last speculative rounds: (round, K, batch, seconds, probe)
        out["mtp_spec"] = (*out.get("mtp_spec", ()), *((r.round, r.k, r.batch, r.seconds, r.probe) for r in spec))
        if role == "prefill":
            prev = out.get("prefill_pass", (0, 0, 0, 0.0, 0))
            now_ = (st.prefill_passes, st.prefill_pieces, st.prefill_tokens, st.prefill_pass_s, st.gathered_gave_way)
            out["prefill_pass"] = tuple(a + b for a, b in zip(prev, now_))
            prev = out.get("prefix_cache", (0, 0, 0))
            now_ = (st.prefix_cache_hits, st.prefix_cache_evicted, st.prefix_cache_reclaimed)
            out["prefix_cache"] = tuple(a + b for a, b in zip(prev, now_))
    return out


def _role_stats(addresses: dict[str, str], token: str | None):
    """Yields (role, WorkerStats) of each worker: role "prefill" or "decode" from its name."""
    from baton.rpc import make_channel
    from baton.settings import Settings
    from baton.v1 import common_pb2, decode_pb2_grpc, prefill_pb2_grpc

    for name, addr in addresses.items():
        role = "prefill" if name.startswith("prefill") else "decode"
        stub = prefill_pb2_grpc.PrefillWorkerStub if role == "prefill" else decode_pb2_grpc.DecodeWorkerStub
        with make_channel(addr, Settings(token=token)) as ch:
            yield role, stub(ch).GetStats(common_pb2.WorkerStatsRequest(), timeout=5)


def capacity(addresses: dict[str, str], token: str | None) -> dict[str, dict]:
    """Per worker name: what it sized at start-up and holds free now (WorkerStats engines, slots, kv_pools,
    kv_pages, kv_pages_free, kv_page_tokens: docs/CONTRACTS.md, "KV pages")."""
    out = {}
    for name, (role, st) in zip(addresses, _role_stats(addresses, token)):
        out[name] = {
            "engines": list(st.engines),
            "slots": st.slots,
            "kv_pools": st.kv_pools,
            "kv_pages": st.kv_pages,
            "kv_pages_free": st.kv_pages_free,
            "kv_page_tokens": st.kv_page_tokens,
        }
    return out


def process_cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system) process `pid` has used, its own threads only (not its children's); None
    where there is no /proc or the process is gone (baton/thread_cpu.py stat_cpu_s)."""
    from baton.thread_cpu import stat_cpu_s

    return stat_cpu_s(f"/proc/{pid}/stat")


def thread_cpu(addresses: dict[str, str], token: str | None) -> dict[str, dict[str, float]]:
    """Per role (prefill, decode): CPU seconds per thread group of the role's workers, summed
    (WorkerStats thread_cpu_s, baton/thread_cpu.py); counters since each thread started."""
    out: dict[str, dict[str, float]] = {}
    for role, st in _role_stats(addresses, token):
        mine = out.setdefault(role, {})
        for group, secs in st.thread_cpu_s.items():
            mine[group] = mine.get(group, 0.0) + secs
    return out


def settle_sessions(addresses, token, timeout: float) -> tuple[dict[str, int], float]:
    t0 = time.monotonic()
    while True:
        left = worker_sessions(addresses, token)
        if not any(left.values()) or time.monotonic() - t0 > timeout:
            return left, time.monotonic() - t0
        time.sleep(0.1)


# ------------------------------------------------------------------------------------------ checks
def make_reference(model_dir: str | None, max_len: int, prompts: list[str], n: int) -> dict[str, list[int]]:
    """prompt -> `baton complete` tokens (ignore_eos, n tokens, window max_len)."""
    import torch

    from baton.complete import complete
    from baton.loading import load_model, resolve_model_dir
    from baton.tokenizer import Tokenizer

    d = resolve_model_dir(model_dir)
    lm = load_model(d, dtype="fp32", device="cpu", mtp=False)
    tok = Tokenizer.from_dir(d)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {p: complete(d, tok.encode(p), n, max_len=max_len, ignore_eos=True, loaded=lm) for p in prompts}
    finally:
        torch.set_num_threads(threads)


def diff_counts(got: list[int], want: list[int]) -> dict[str, int]:
    """lost (in want, not got), duplicated (extra in got), wrong (substituted) from a difflib alignment."""
    out = Counter(lost=0, duplicated=0, wrong=0)
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(a=want, b=got, autojunk=False).get_opcodes():
        if op == "delete":
            out["lost"] += i2 - i1
        elif op == "insert":
            out["duplicated"] += j2 - j1
        elif op == "replace":
            out["wrong"] += min(i2 - i1, j2 - j1)
            out["lost"] += max(0, (i2 - i1) - (j2 - j1))
            out["duplicated"] += max(0, (j2 - j1) - (i2 - i1))
    return dict(out)


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 3)


# ------------------------------------------------------------------------------------------ clients
class Tally:
    def __init__(self):
        self.lock = threading.Lock()
        self.status = Counter()  # final status of every Generate call
        self.by_kind = Counter()  # "mode/engine" of completed streams
        self.ttft, self.itl, self.tpot = [], [], []
        self.tokens = 0
        self.checked = 0
        self.diff = Counter(lost=0, duplicated=0, wrong=0)
        self.count_mismatch = 0  # usage/tokens/max_new_tokens disagree
        self.bad: list[dict] = []  # first few mismatching streams
        self.details: dict[str, str] = {}  # status -> the first error message seen
        self.messages = Counter()  # "STATUS: message" (digits folded) -> count


def client_loop(
    i: int, addr: str, token: str | None, stop_at: float, n: int, ref: dict, tally: Tally, timeout: float
) -> None:
    import grpc

    from baton.client import Client

    rng = random.Random(i)
    k, backoff = i, 0.05
    with Client(addr, token=token) as c:
        while time.monotonic() < stop_at:
            prompt, (mode, engine) = PROMPTS[k % len(PROMPTS)], MIX[k % len(MIX)]
            k += 1
            t0 = time.monotonic()
            got, stamps, last, details = [], [], None, ""
            try:
                for d in c.generate(
                    prompt, max_new_tokens=n, mode=mode, engine=engine, ignore_eos=True, timeout=timeout
                ):
                    stamps.append((time.monotonic(), len(d.token_ids)))
                    got += d.token_ids
                    last = d
                code = "OK"
            except grpc.RpcError as e:
                code, details = e.code().name, e.details()
            with tally.lock:
                tally.status[code] += 1
                if code != "OK":
                    tally.details.setdefault(code, details)
                    tally.messages[f"{code}: " + re.sub(r"\d+", "N", details)[:90]] += 1
            if code != "OK":  # back off exponentially (jittered), as clients should
                time.sleep(rng.uniform(0.5, 1.0) * backoff)
                backoff = min(2.0, backoff * 2)
                k -= code == "RESOURCE_EXHAUSTED"  # retry the same request after a refusal
                continue
            backoff = 0.05
            gaps = [(b - a) / max(1, nb) for (a, _), (b, nb) in zip(stamps, stamps[1:])]
            with tally.lock:
                tally.by_kind[f"{mode}/{engine}"] += 1
                tally.ttft.append((stamps[0][0] - t0) * 1e3)
                tally.itl += [g * 1e3 for g in gaps]
                if len(got) > 1:
                    tally.tpot.append((stamps[-1][0] - stamps[0][0]) / (len(got) - 1) * 1e3)
                tally.tokens += len(got)
                if not (len(got) == n == last.usage.get("completion_tokens")):
                    tally.count_mismatch += 1
                if (mode, engine) in CHECKED:
                    tally.checked += 1
                    dc = diff_counts(got, ref[prompt])
                    tally.diff.update(dc)
                    if any(dc.values()) and len(tally.bad) < 5:
                        tally.bad.append(
                            {
                                "prompt": prompt,
                                "mode": mode,
                                "engine": engine,
                                "got": got,
                                "want": ref[prompt],
                                "migrations": last.stats.get("migrations"),
                            }
                        )


def run(
    *,
    clients: int,
    duration: float,
    max_new_tokens: int = 32,
    max_len: int = 512,
    addr: str | None = None,
    workers: dict[str, str] | None = None,
    token: str | None = None,
    model_dir: str | None = None,
    settle: float = 10.0,
    request_timeout: float = 120.0,
    serve_args: tuple[str, ...] = (),
) -> dict:
    serve, tmp = None, None
    t_start = time.monotonic()
    if addr is None:
        tmp = tempfile.TemporaryDirectory(prefix="baton-load-")
        token = token or f"load-{os.getpid()}-{random.randrange(1 << 30)}"
        tf = Path(tmp.name) / "token"
        tf.write_text(token)
        args = [
            "--port",
            "0",
            "--http-port",
            "0",
            "--token-file",
            str(tf),
            "--max-len",
            str(max_len),
            "--grace",
            "5",
            *serve_args,
        ]
        if model_dir:
            args += ["--model", str(model_dir)]
        serve = Serve(*args)
    try:
        ref = make_reference(model_dir, max_len, PROMPTS, max_new_tokens)  # while the servers boot
        if serve is not None:
            addr = serve.wait()
            workers = serve.workers()
        boot_s = time.monotonic() - t_start
        tally = Tally()
        stop_at = time.monotonic() + duration
        t0 = time.monotonic()
        threads = [
            threading.Thread(
                target=client_loop,
                args=(i, addr, token, stop_at, max_new_tokens, ref, tally, request_timeout),
                daemon=True,
            )
            for i in range(clients)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(duration + request_timeout + 30)
        wall = time.monotonic() - t0
        hung = sum(t.is_alive() for t in threads)
        left, settle_s = settle_sessions(workers or {}, token, settle)
        rc = serve.stop() if serve is not None else None
        exits = [ln.split("baton: ", 1)[1] for ln in (serve.err if serve else []) if " exited with code " in ln]
    finally:
        if serve is not None and serve.proc.poll() is None:
            serve.stop()
        if tmp is not None:
            tmp.cleanup()
    ok = tally.status["OK"]
    return {
        "config": {
            "clients": clients,
            "duration_s": duration,
            "max_new_tokens": max_new_tokens,
            "max_len": max_len,
            "mix": [f"{m}/{e}" for m, e in MIX],
            "prompts": len(PROMPTS),
            "checked_kinds": sorted(f"{m}/{e}" for m, e in CHECKED),
            "topology": ("OMP_NUM_THREADS=1 baton serve --processes " + " ".join(serve.argv[5:]) if serve else addr),
        },
        "boot_s": round(boot_s, 1),
        "wall_s": round(wall, 2),
        "requests": sum(tally.status.values()),
        "completed": ok,
        "completed_by_kind": dict(sorted(tally.by_kind.items())),
        "errors_by_status": {k: v for k, v in sorted(tally.status.items()) if k != "OK"},
        "error_examples": tally.details,
        "errors_by_message": dict(tally.messages.most_common()),
        "checked_streams": tally.checked,
        "lost_tokens": tally.diff["lost"],
        "duplicated_tokens": tally.diff["duplicated"],
        "wrong_tokens": tally.diff["wrong"],
        "count_mismatches": tally.count_mismatch,
        "mismatch_examples": tally.bad,
        "hung_clients": hung,
        "sessions_left": left,
        "sessions_settle_s": round(settle_s, 2),
        "serve_exit_code": rc,
        "worker_exits": exits,  # "<name> exited with code N" lines of baton serve: none = all 0
        "ttft_ms": {"p50": pct(tally.ttft, 0.5), "p99": pct(tally.ttft, 0.99), "max": pct(tally.ttft, 1.0)},
        "itl_ms": {"p50": pct(tally.itl, 0.5), "p99": pct(tally.itl, 0.99)},
        "tpot_ms": {"p50": pct(tally.tpot, 0.5), "p99": pct(tally.tpot, 0.99)},
        "tokens": tally.tokens,
        "tokens_per_s": round(tally.tokens / wall, 1) if wall else None,
        "requests_per_s": round(ok / wall, 2) if wall else None,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--max-len", type=int, default=512, help="workers' window (and the reference's)")
    p.add_argument("--model", default=None, help="model directory (default: the embedded model)")
    p.add_argument("--addr", default=None, help="an existing router (then give --workers and --token-file)")
    p.add_argument("--workers", default="", help="name=ADDR,... of the existing router's workers (GetStats)")
    p.add_argument("--token-file", default=None)
    p.add_argument("--machine", default=platform.platform(), help="recorded in the JSON")
    p.add_argument("--out", default=None, help="also write the JSON here")
    a = p.parse_args(argv)
    token = Path(a.token_file).read_text().strip() if a.token_file else None
    workers = dict(w.split("=", 1) for w in a.workers.split(",") if w) or None
    res = run(
        clients=a.clients,
        duration=a.duration,
        max_new_tokens=a.max_new_tokens,
        max_len=a.max_len,
        addr=a.addr,
        workers=workers,
        token=token,
        model_dir=a.model,
    )
    res = {
        "benchmark": "load",
        "command": shlex.join(["python", "benchmarks/load.py", *(argv or sys.argv[1:])]),
        "machine": a.machine,
        "cpus": os.cpu_count(),
        "date": datetime.date.today().isoformat(),
        **res,
    }
    text = json.dumps(res, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    bad = res["lost_tokens"] or res["duplicated_tokens"] or res["wrong_tokens"] or any(res["sessions_left"].values())
    return 1 if bad or set(res["errors_by_status"]) - {"RESOURCE_EXHAUSTED"} else 0


if __name__ == "__main__":
    sys.exit(main())
