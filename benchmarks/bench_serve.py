"""Serving benchmark: N concurrent fast-mode streams through the router over gRPC, at several N.

    python benchmarks/bench_serve.py [--concurrency 1,2,4,8] [--requests 2] [--max-new-tokens 48]
                                     [--engine bf16] [--out FILE]

Starts `baton serve --processes` (CPU, the embedded model unless --model; --slots max(8, N) a worker),
then for each N: N client threads, each sending --requests Generate calls one after another (a fixed
prompt per client, ignore_eos, max_new_tokens tokens). Every stream is checked against `baton complete`
of its prompt: the batch must not change a token. Prints one JSON object, per N:
    tok_s          output tokens of all streams / wall time of the point
    stream_tok_s   p50 of each stream's tokens / (last token - first token)
    ttft_s         p50 / p99 time to the first token
    itl_s          p50 / p99 gap between streamed tokens
    errors         by gRPC status; mismatched: streams whose tokens differ from `baton complete`
    scaling        tok_s / tok_s at N = 1
What is not here yet (the continuous-batching issue): the Poisson-rate and mixed-length sweeps, HF
`generate` at batch N and the bandwidth floor side by side, and the GPU run (the fused CUDA path does
not batch yet: its sessions still step one at a time).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.load import Serve, make_reference, pct  # noqa: E402

PROMPTS = [f"def f{i}(x):\n    return x + {i}\n\n\ndef g{i}(" for i in range(32)]


def _point(addr: str, token: str, n: int, requests: int, max_new: int, engine: str, ref: dict) -> dict:
    from baton.client import Client

    ttft, itl, stream_tok_s, errors, mismatched, total = [], [], [], {}, 0, 0
    lock = threading.Lock()
    start = threading.Barrier(n + 1)

    def client(i: int) -> None:
        nonlocal mismatched, total
        prompt = PROMPTS[i % len(PROMPTS)]
        with Client(addr, token=token) as c:
            start.wait()
            for _ in range(requests):
                t0, times, toks = time.monotonic(), [], []
                try:
                    for d in c.generate(prompt, max_new_tokens=max_new, engine=engine, ignore_eos=True, timeout=300):
                        if d.token_ids:
                            times.append(time.monotonic())
                            toks += d.token_ids
                except Exception as e:  # noqa: BLE001 - counted by status
                    code = getattr(e, "code", lambda: None)()
                    key = str(getattr(code, "name", type(e).__name__))
                    with lock:
                        errors[key] = errors.get(key, 0) + 1
                    continue
                with lock:
                    total += len(toks)
                    mismatched += toks != ref[prompt]
                    ttft.append(times[0] - t0)
                    itl.extend(b - a for a, b in zip(times, times[1:]))
                    if len(times) > 1:
                        stream_tok_s.append((len(toks) - 1) / (times[-1] - times[0]))

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.monotonic()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    return {
        "concurrency": n,
        "streams": n * requests,
        "tokens": total,
        "wall_s": round(wall, 3),
        "tok_s": round(total / wall, 2),
        "stream_tok_s_p50": round(pct(stream_tok_s, 0.5) or 0.0, 2),
        "ttft_s_p50": pct(ttft, 0.5),
        "ttft_s_p99": pct(ttft, 0.99),
        "itl_s_p50": pct(itl, 0.5),
        "itl_s_p99": pct(itl, 0.99),
        "errors": errors,
        "mismatched": mismatched,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks/bench_serve.py", description=__doc__.split("\n")[0])
    p.add_argument("--concurrency", default="1,2,4,8")
    p.add_argument("--requests", type=int, default=2, help="Generate calls per client, one after another")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--engine", default="bf16", choices=("bf16", "fp8"))
    p.add_argument("--model", default=None)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    points = [int(x) for x in a.concurrency.split(",")]
    with tempfile.TemporaryDirectory(prefix="baton-serve-") as tmp:
        token = f"serve-{os.getpid()}-{random.randrange(1 << 30)}"
        tf = Path(tmp) / "token"
        tf.write_text(token)
        args = ["--port", "0", "--http-port", "0", "--token-file", str(tf), "--max-len", str(a.max_len)]
        args += ["--engine", a.engine, "--slots", str(max(8, max(points)))] + (["--model", a.model] if a.model else [])
        serve = Serve(*args)
        try:
            ref = make_reference(a.model, a.max_len, PROMPTS[: max(points)], a.max_new_tokens)
            addr = serve.wait()
            _point(addr, token, 1, 1, a.max_new_tokens, a.engine, ref)  # warm-up
            rows = [_point(addr, token, n, a.requests, a.max_new_tokens, a.engine, ref) for n in points]
        finally:
            serve.stop()
    base = rows[0]["tok_s"] if rows and rows[0]["concurrency"] == 1 else None
    for r in rows:
        r["scaling"] = round(r["tok_s"] / base, 2) if base else None
    out = {
        "benchmark": "bench_serve",
        "command": "python " + " ".join([os.path.relpath(__file__, Path.cwd()), *(argv or sys.argv[1:])]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "engine": a.engine,
        "max_new_tokens": a.max_new_tokens,
        "points": rows,
    }
    text = json.dumps(out, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
