"""The HTTP API against gRPC on the CPU stack: per-token latency at 1 stream, and N streaming HTTP clients.

    python benchmarks/bench_http.py [--streams 12] [--max-tokens 48] [--load-clients 0] [--out FILE]

Starts `baton serve --processes --port 0 --http-port P` (the embedded model, a bearer token, window 512,
OMP_NUM_THREADS=1), then:
  latency   --streams requests of --max-tokens tokens (ignore_eos, fast mode, the default engine), one at a
            time, alternating gRPC (baton.client.Client) and HTTP (the openai package, streaming
            /v1/completions), the same prompt each time. Per-token latency of one stream = (arrival of the
            last token - arrival of the first) / (tokens - 1), measured by the client; reported: median
            over the streams of each API, and http / grpc - 1 (the issue wants <= +10%); the texts must agree.
  load      with --load-clients N > 0 (also BATON_HTTP_LOAD_CLIENTS): N threads, each its own openai
            client (no retries), stream /v1/completions for --load-seconds over a few prompts; a 429 is
            counted and retried after a jittered back-off. Each completed stream's text must be the gRPC
            text of its prompt and its usage must be --load-tokens tokens: lost = streams that differ.
  choices   with --choices N > 0: one /v1/completions of n = N choices of one --choice-prompt-token prompt
            against N concurrent requests of N distinct prompts of that length (--choice-reps each, --load-tokens
            new tokens): the wall time of each and the prompt tokens the prefill worker computed (GetStats
            prefill_tokens; equal prompts in one pass are computed once, baton/engine/prefill.py shared_pieces).
  doors     with --doors R > 0: R streaming requests of one chat (a system and a user message, --max-tokens
            tokens, ignore_eos) through each HTTP door in turn: /v1/chat/completions (openai), /v1/responses
            (openai) and /v1/messages (anthropic, when installed): each door's time to its first text and
            per-token latency (medians), against chat's; every door's text must be chat's.
Prints one JSON object (benchmarks.report.emit). `load(...)` is what tests/router/test_http_api.py runs.
"""

from __future__ import annotations

import argparse
import datetime
import os
import random
import shlex
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.load import Serve  # noqa: E402
from benchmarks.report import emit  # noqa: E402

PROMPT = "def fibonacci(n):"
LOAD_PROMPTS = [
    "import os\nimport sys\n",
    "class Config:\n    def __init__(self",
    "for i in range(",
    "with open(path) as f:",
]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Stack:
    """`baton serve --processes` with the HTTP API; .grpc (HOST:PORT), .url (http://...), .token, .workers."""

    def __init__(self, *args: str, max_len: int = 512):
        self._tmp = tempfile.TemporaryDirectory(prefix="baton-http-")
        self.token = f"http-{os.getpid()}-{random.randrange(1 << 30)}"
        tf = Path(self._tmp.name) / "token"
        tf.write_text(self.token)
        self.http_port = free_port()
        self.serve = Serve(
            "--port",
            "0",
            "--http-port",
            str(self.http_port),
            "--token-file",
            str(tf),
            "--max-len",
            str(max_len),
            "--grace",
            "3",
            *args,
        )
        self.grpc = self.url = None
        self.workers: dict[str, str] = {}

    def wait(self, timeout: float = 300.0) -> "Stack":
        self.grpc = self.serve.wait(timeout)
        self.url = f"http://127.0.0.1:{self.http_port}"
        self.workers = self.serve.workers()
        return self

    def openai(self, **kw):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.token, **kw)

    def close(self) -> int:
        try:
            return self.serve.stop()
        finally:
            self._tmp.cleanup()


def grpc_text(addr: str, token: str, prompt: str, n: int, mode: str = "fast") -> tuple[str, list[float]]:
    from baton.client import Client

    with Client(addr, token=token) as c:
        text, stamps = [], []
        for d in c.generate(prompt, max_new_tokens=n, mode=mode, ignore_eos=True, timeout=120):
            stamps += [time.monotonic()] * len(d.token_ids)
            text.append(d.text)
    return "".join(text), stamps


def http_text(client, prompt: str, n: int, mode: str = "fast") -> tuple[str, list[float], dict | None]:
    """One streaming /v1/completions; the arrival time of each chunk counted once per token it carries
    (usage tells the total; chunks carry one message each, i.e. one token in fast mode)."""
    text, stamps, usage = [], [], None
    stream = client.completions.create(
        model="default-model",
        prompt=prompt,
        max_tokens=n,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"baton": {"mode": mode, "ignore_eos": True}},
    )
    for chunk in stream:
        if chunk.choices and (chunk.choices[0].text or chunk.choices[0].finish_reason is None):
            stamps.append(time.monotonic())
            text.append(chunk.choices[0].text)
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
    return "".join(text), stamps, usage


def per_token(stamps: list[float]) -> float | None:
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else None


def latency(stack: Stack, streams: int, n: int) -> dict:
    client = stack.openai(max_retries=0)
    grpc_text(stack.grpc, stack.token, PROMPT, 4)  # warm both paths
    http_text(client, PROMPT, 4)
    g, h, texts = [], [], set()
    for i in range(streams):
        for which in ("grpc", "http") if i % 2 == 0 else ("http", "grpc"):
            if which == "grpc":
                text, stamps = grpc_text(stack.grpc, stack.token, PROMPT, n)
                g.append(per_token(stamps))
            else:
                text, stamps, usage = http_text(client, PROMPT, n)
                assert usage and usage["completion_tokens"] == n, usage
                h.append(per_token(stamps))
            texts.add(text)
    mg, mh = statistics.median(g), statistics.median(h)
    return {
        "streams_each": streams,
        "tokens_per_stream": n,
        "texts_identical": len(texts) == 1,
        "grpc_ms_per_token_median": round(mg * 1e3, 3),
        "http_ms_per_token_median": round(mh * 1e3, 3),
        "grpc_ms_per_token_all": [round(x * 1e3, 3) for x in g],
        "http_ms_per_token_all": [round(x * 1e3, 3) for x in h],
        "http_over_grpc": round(mh / mg - 1, 4),
    }


DOOR_SYSTEM, DOOR_USER = "You write Python.", "fibonacci"


def door_text(stack: Stack, door: str, n: int) -> tuple[str, float, list[float]]:
    """One streamed request of the doors' chat through `door`: (text, its start time, each text piece's arrival)."""
    ext, t0, stamps = {"baton": {"ignore_eos": True}}, time.monotonic(), []
    if door == "chat":
        msgs = [{"role": "system", "content": DOOR_SYSTEM}, {"role": "user", "content": DOOR_USER}]
        stream = stack.openai(max_retries=0).chat.completions.create(
            model="default-model", messages=msgs, max_tokens=n, stream=True, extra_body=ext
        )
        pieces = (c.choices[0].delta.content for c in stream if c.choices)
    elif door == "responses":
        stream = stack.openai(max_retries=0).responses.create(
            model="default-model", instructions=DOOR_SYSTEM, input=DOOR_USER, max_output_tokens=n, stream=True,
            extra_body=ext,
        )  # fmt: skip
        pieces = (e.delta for e in stream if e.type == "response.output_text.delta")
    else:
        import anthropic

        client = anthropic.Anthropic(base_url=stack.url, api_key=stack.token, max_retries=0)
        msgs = [{"role": "user", "content": DOOR_USER}]
        with client.messages.stream(
            model="default-model", system=DOOR_SYSTEM, messages=msgs, max_tokens=n, extra_body=ext
        ) as stream:
            pieces = list(_stamped(stream.text_stream, stamps))
        return "".join(pieces), t0, stamps
    return "".join(_stamped(pieces, stamps)), t0, stamps


def _stamped(pieces, stamps: list[float]):
    for p in pieces:
        if p:
            stamps.append(time.monotonic())
            yield p


def doors(stack: Stack, reps: int, n: int) -> dict:
    """The doors section (module doc): each door's first-text time and per-token latency, medians."""
    try:
        import anthropic  # noqa: F401

        names = ["chat", "responses", "messages"]
    except ImportError:
        names = ["chat", "responses"]
    for d in names:  # warm each path
        door_text(stack, d, 4)
    first, per, texts = {d: [] for d in names}, {d: [] for d in names}, {d: set() for d in names}
    for i in range(reps):
        for d in names[i % len(names) :] + names[: i % len(names)]:  # each door first in turn
            text, t0, stamps = door_text(stack, d, n)
            first[d].append(stamps[0] - t0)
            per[d].append(per_token(stamps))
            texts[d].add(text)
    out = {"requests_each": reps, "max_tokens": n, "texts_equal_chat": all(texts[d] == texts["chat"] for d in names)}
    for d in names:
        out[d] = {
            "first_text_ms_median": round(statistics.median(first[d]) * 1e3, 2),
            "ms_per_piece_median": round(statistics.median(x for x in per[d] if x is not None) * 1e3, 3),
        }
    for d in names[1:]:
        out[f"{d}_first_text_over_chat"] = round(
            out[d]["first_text_ms_median"] / out["chat"]["first_text_ms_median"] - 1, 4
        )
    return out


def load(stack: Stack, *, clients: int, seconds: float, n: int, prompts=LOAD_PROMPTS) -> dict:
    """N concurrent streaming HTTP clients; statuses, completed streams checked against gRPC."""
    import openai

    ref = {p: grpc_text(stack.grpc, stack.token, p, n)[0] for p in prompts}
    status, lost, miscounted, lock = Counter(), [], [0], threading.Lock()
    stop_at = time.monotonic() + seconds

    def loop(i: int) -> None:
        rng, k, backoff = random.Random(i), i, 0.05
        client = stack.openai(max_retries=0, timeout=120)
        while time.monotonic() < stop_at:
            prompt = prompts[k % len(prompts)]
            try:
                text, _, usage = http_text(client, prompt, n)
                code = 200
            except openai.APIStatusError as e:
                code = e.status_code
            except openai.APIError as e:  # connection errors: not an HTTP status
                code = type(e).__name__
            with lock:
                status[str(code)] += 1
                if code == 200:
                    if text != ref[prompt]:
                        lost.append({"prompt": prompt, "got": text, "want": ref[prompt]})
                    if not usage or usage["completion_tokens"] != n:
                        miscounted[0] += 1
            if code == 200:
                k, backoff = k + 1, 0.05
            else:  # back off, then retry the same prompt
                time.sleep(rng.uniform(0.5, 1.0) * backoff)
                backoff = min(2.0, backoff * 2)

    threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(clients)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 150)
    return {
        "clients": clients,
        "seconds": round(time.monotonic() - t0, 2),
        "tokens_per_stream": n,
        "status": dict(status),
        "completed": status["200"],
        "streams_differing": len(lost),
        "differing_examples": lost[:3],
        "usage_mismatches": miscounted[0],
        "hung_clients": sum(t.is_alive() for t in threads),
    }


def prefill_stats(stack: Stack):
    """The prefill worker's WorkerStats (the stack has one)."""
    from baton.rpc import make_channel
    from baton.settings import Settings
    from baton.v1 import common_pb2, prefill_pb2_grpc

    (addr,) = [a for name, a in stack.workers.items() if name.startswith("prefill")]
    with make_channel(addr, Settings(token=stack.token)) as ch:
        return prefill_pb2_grpc.PrefillWorkerStub(ch).GetStats(common_pb2.WorkerStatsRequest(), timeout=5)


def choices(stack: Stack, *, n: int, prompt_tokens: int, tokens: int, reps: int) -> dict:
    """An n-choice request against n concurrent requests of distinct prompts (module doc)."""
    rng = random.Random(0)
    client = stack.openai(max_retries=0, timeout=300)
    kw = dict(model="default-model", max_tokens=tokens, temperature=1.0, extra_body={"baton": {"ignore_eos": True}})

    def prompt() -> list[int]:
        return [rng.randrange(1, 1000) for _ in range(prompt_tokens)]

    def one(ids, **more):
        return client.completions.create(prompt=ids, **kw, **more)

    def timed(fn) -> tuple[float, int]:
        before = prefill_stats(stack).prefill_tokens
        t0 = time.monotonic()
        fn()
        return time.monotonic() - t0, prefill_stats(stack).prefill_tokens - before

    def distinct() -> None:
        ps = [prompt() for _ in range(n)]
        threads = [threading.Thread(target=one, args=(q,), kwargs={"seed": 1}) for q in ps]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)

    one(prompt(), n=n, seed=0)  # warm-up
    shared = [timed(lambda: one(prompt(), n=n, seed=7)) for _ in range(reps)]
    apart = [timed(distinct) for _ in range(reps)]
    return {
        "n": n,
        "prompt_tokens": prompt_tokens,
        "new_tokens": tokens,
        "reps": reps,
        "n_choices_s_median": round(statistics.median(t for t, _ in shared), 3),
        "n_requests_s_median": round(statistics.median(t for t, _ in apart), 3),
        "n_choices_prompt_tokens_computed": [c for _, c in shared],
        "n_requests_prompt_tokens_computed": [c for _, c in apart],
    }


def main(argv: list[str] | None = None) -> int:
    import platform

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=12, help="latency: streams of each API")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--load-clients", type=int, default=int(os.environ.get("BATON_HTTP_LOAD_CLIENTS", "0")))
    p.add_argument("--load-seconds", type=float, default=30.0)
    p.add_argument("--load-tokens", type=int, default=16)
    p.add_argument("--choices", type=int, default=0, help="choices: n of one request against n requests")
    p.add_argument("--choice-prompt-tokens", type=int, default=300)
    p.add_argument("--choice-reps", type=int, default=3)
    p.add_argument("--doors", type=int, default=0, help="doors: requests through each HTTP door")
    p.add_argument("--machine", default=platform.platform(), help="recorded in the JSON")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    stack = Stack().wait()
    try:
        res = {
            "benchmark": "http",
            "command": shlex.join(["python", "benchmarks/bench_http.py", *(argv or sys.argv[1:])]),
            "machine": a.machine,
            "cpus": os.cpu_count(),
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "topology": "OMP_NUM_THREADS=1 baton serve --processes --max-len 512 (1 prefill + 1 decode worker, "
            "embedded model, CPU), clients in this process over loopback",
            "latency": latency(stack, a.streams, a.max_tokens),
        }
        if a.load_clients:
            res["load"] = load(stack, clients=a.load_clients, seconds=a.load_seconds, n=a.load_tokens)
        if a.doors:
            res["doors"] = doors(stack, a.doors, a.max_tokens)
        if a.choices:
            res["choices"] = choices(
                stack, n=a.choices, prompt_tokens=a.choice_prompt_tokens, tokens=a.load_tokens, reps=a.choice_reps
            )
    finally:
        res_rc = stack.close()
    res["serve_exit_code"] = res_rc
    emit(res, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
