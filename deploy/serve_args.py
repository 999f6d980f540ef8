"""`baton serve`'s options: the argument parser (`add_arguments`) and the checks run before anything starts
(`check`: a message for the first bad option, or None; it also resolves the model and token paths; `ports_error`:
the router's ports are free, checked before any worker loads).
deploy/local.py runs what they describe."""

from __future__ import annotations

import argparse
import errno
import os
import socket
from pathlib import Path

from baton.engine.draft_length import POLICIES
from baton.rpc import port_arg
from deploy.supervisor import DEFAULT_MAX_RESTARTS
from router.http.reasoning import PARSERS as REASONING_PARSERS

ENGINES = ("bf16", "fp8", "mtp")


def add_router_options(p: argparse.ArgumentParser, http_port: int) -> None:
    """The router's options that `baton serve` and the Ray cluster launcher (deploy/launch.py) share: its HTTP
    door (default `http_port`; 0 = off), the chat reasoning parser, exact mode's K policy, the Responses API's
    store."""
    p.add_argument(
        "--http-port",
        type=port_arg,
        default=http_port,
        help=f"OpenAI-compatible HTTP API port on the router's host (0 = off; default {http_port})",
    )
    p.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        default="none",
        help="the router's --reasoning-parser: qwen3 returns a chat's <think> reasoning as "
        "message.reasoning_content, the answer as content; none: all content (default)",
    )
    p.add_argument(
        "--draft-length",
        choices=POLICIES,
        default=None,
        help="exact mode's K per round (the router's --draft-length; default: fixed, the request's K)",
    )
    p.add_argument(
        "--responses-store-mb",
        type=int,
        default=None,
        help="the router's --responses-store-mb: MiB of the Responses API's stored responses (store: true) kept "
        "for GET /v1/responses/{id} and previous_response_id (default 256; 0: off)",
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF checkpoint directory (default: the embedded model)")
    p.add_argument("--port", type=int, default=50051, help="router port (0 = a free port)")
    p.add_argument("--host", default=None, help="router bind host (default: BATON_HOST or 127.0.0.1)")
    add_router_options(p, http_port=8000)
    p.add_argument("--prefill", type=int, default=1, metavar="N", help="prefill workers")
    p.add_argument("--decode", type=int, default=1, metavar="M", help="decode workers")
    p.add_argument("--engine", default=None, choices=ENGINES, help="decode engine (default: the worker's)")
    p.add_argument(
        "--engines",
        default=None,
        metavar="LIST",
        help="engines each decode worker offers, comma-separated (default: bf16,fp8,mtp, those the checkpoint "
        "supports); leaving out fp8 saves its FP8 weight copy (~9 GB for a 9B model) for KV pages",
    )
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where the workers run (default cpu)")
    p.add_argument(
        "--dtype", default=None, choices=("bf16", "fp32"), help="worker dtype (default: bf16 on cuda, fp32 on cpu)"
    )
    p.add_argument("--max-len", type=int, default=None, help="context window of each worker")
    p.add_argument(
        "--slots",
        type=int,
        default=None,
        metavar="N",
        help="concurrent sessions each worker holds (default: the workers' 8); a decode worker steps them together",
    )
    p.add_argument(
        "--kv-pages", type=int, default=None, help="attention KV pages of 256 tokens per worker runner (default: sized)"
    )
    add_prefill_options(p)
    p.add_argument(
        "--gpu-memory-fraction",
        type=float,
        default=None,
        help="cuda: share of each worker's free GPU memory its KV pages may take (default: the workers' 0.9; "
        "workers sharing one GPU need a smaller share each)",
    )
    p.add_argument(
        "--max-inflight",
        type=int,
        default=None,
        metavar="N",
        help="Generate calls the router admits at once, past it RESOURCE_EXHAUSTED (default: the larger of 64 "
        "and the decode workers' sessions)",
    )
    p.add_argument(
        "--queue-timeout",
        type=float,
        default=None,
        metavar="S",
        help="seconds a new request waits in line (first come first served) while the workers' session slots "
        "are full, before RESOURCE_EXHAUSTED (default 30; 0: refused at once)",
    )
    p.add_argument("--processes", action="store_true", help="plain subprocesses instead of Ray actors")
    p.add_argument("--colocate", action="store_true", help="--processes, cuda: all workers on the first GPU")
    p.add_argument(
        "--mps",
        action="store_true",
        help="--processes, cuda: start an NVIDIA MPS daemon of this serve's own (nvidia-cuda-mps-control) so workers "
        "sharing a GPU run their kernels side by side, not in turns; stopped when serve ends (deploy/mps.py)",
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        default=None,
        metavar="N",
        help=f"--processes: a worker that exits more than N times in 10 minutes (a failed restart counts) is "
        f"given up on: serve stops and exits 1 (default {DEFAULT_MAX_RESTARTS}; 0: never restart; -1: restart "
        "forever). Ray: each actor is restarted at most N times over its life, then stays dead and the router "
        "serves with the others (default -1: forever)",
    )
    p.add_argument("--token-file", default=None, help="shared bearer token file (or set BATON_TOKEN)")
    p.add_argument(
        "--namespace", default=None, help="Ray namespace (default: baton, or baton-serve-PID when joining RAY_ADDRESS)"
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for workers to load")
    p.add_argument("--grace", type=float, default=2.5, help="seconds in-flight requests get at shutdown")
    p.add_argument(
        "--ask",
        default=None,
        metavar="TEXT",
        help="once serving, send TEXT through the router as a client would and print the answer "
        "(`baton: answer {json}` on stdout); serving goes on",
    )
    p.add_argument("--ask-tokens", type=int, default=32, metavar="N", help="max new tokens of the --ask request")


def add_prefill_options(p: argparse.ArgumentParser) -> None:
    """The prefill workers' options of `baton serve` and deploy/launch.py (prefill_extra passes them on)."""
    p.add_argument(
        "--prefill-budget",
        type=int,
        default=None,
        help="prompt tokens a prefill worker's batched pass may hold (default: the worker's, 8192)",
    )
    p.add_argument(
        "--prefix-cache",
        type=int,
        default=None,
        metavar="N",
        help="prompt prefixes each prefill worker keeps for later prompts that begin with them, one per "
        "8192-token piece boundary (restored bitwise; their KV in idle pages); 0: off (default: 16 when "
        "--max-len exceeds 8192, else off)",
    )

    p.add_argument(
        "--prefill-piece",
        type=int,
        default=None,
        metavar="N",
        help="the pieces each prefill worker cuts prompts into, and so its prefix cache's boundaries: a multiple "
        "of 256, taken only if cut there a prompt ends bitwise as in 8192-token pieces on that device (checked at "
        "start-up; else 8192, with a warning) (default: 8192)",
    )


def prefill_error(args) -> str | None:
    if getattr(args, "prefill_budget", None) is not None and args.prefill_budget < 1:
        return "--prefill-budget must be >= 1"
    if getattr(args, "prefix_cache", None) is not None and args.prefix_cache < 0:
        return "--prefix-cache must be >= 0"
    piece = getattr(args, "prefill_piece", None)
    if piece is not None and (piece < 1 or piece % 256):
        return "--prefill-piece must be a positive multiple of 256"
    return None


def prefill_extra(args) -> tuple[tuple[str, str], ...]:
    """The prefill options given, as a WorkerSpec's extra (name, value) pairs (deploy/processes.py)."""
    names = ("prefill_budget", "prefix_cache", "prefill_piece")  # NOTE: callers may build args without newer ones
    return tuple((n, str(getattr(args, n))) for n in names if getattr(args, n, None) is not None)


def options_error(args) -> str | None:
    """The worker and router options `baton serve` and deploy/launch.py share: engines, slots, KV sizing, the
    prefill workers' options, the router's limits -> the first bad one's message, else None."""
    if err := engines_error(args):
        return err
    if getattr(args, "slots", None) is not None and args.slots < 1:
        return "--slots must be >= 1"
    kv_pages, fraction = getattr(args, "kv_pages", None), getattr(args, "gpu_memory_fraction", None)
    if kv_pages is not None and kv_pages < 1:
        return "--kv-pages must be >= 1"
    if err := prefill_error(args):
        return err
    if fraction is not None and not 0.0 < fraction <= 1.0:
        return "--gpu-memory-fraction must be in (0, 1]"
    return router_limits_error(args)


def engines_error(args) -> str | None:
    """Checks --engines (comma-separated names of ENGINES, at least one) against --engine, and normalizes it
    to "a,b" (args.engines stays None when not given: the workers' default). A message, or None."""
    text = getattr(args, "engines", None)
    if text is None:
        return None
    names = [e.strip() for e in text.split(",") if e.strip()]
    bad = [e for e in names if e not in ENGINES]
    if bad or not names:
        return f"--engines: {', '.join(bad) or 'empty'}: give one or more of {', '.join(ENGINES)}, comma-separated"
    if args.engine is not None and args.engine not in names:
        return f"--engine {args.engine} is not among --engines {','.join(names)}"
    args.engines = ",".join(dict.fromkeys(names))
    return None


def router_limits_error(args) -> str | None:
    """The router's admission options of `baton serve` / deploy/launch.py that cannot work, as a usage message
    (and --max-restarts, which both take)."""
    if getattr(args, "max_restarts", None) is not None and args.max_restarts < -1:
        return "--max-restarts must be >= -1 (-1: restart forever)"
    if getattr(args, "queue_timeout", None) is not None and not args.queue_timeout >= 0:
        return "--queue-timeout must be >= 0"
    if getattr(args, "max_inflight", None) is not None and args.max_inflight < 1:
        return "--max-inflight must be >= 1"
    if getattr(args, "responses_store_mb", None) is not None and args.responses_store_mb < 0:
        return "--responses-store-mb must be >= 0"
    return None


def check(args) -> str | None:
    if args.prefill < 1 or args.decode < 1:
        return "--prefill and --decode must be >= 1"
    if not 0 <= args.port < 65536:
        return "--port must be in 0..65535"
    if args.ask_tokens < 1:
        return "--ask-tokens must be >= 1"
    if err := options_error(args):
        return err
    if getattr(args, "colocate", False) and not args.processes:
        return "--colocate places worker processes: use it with --processes (Ray places actors itself)"
    if getattr(args, "mps", False) and (not args.processes or args.device != "cuda"):
        return "--mps runs CUDA worker processes under an MPS daemon: use it with --processes --device cuda"
    import baton

    # NOTE: baton.loading.DEFAULT_MODEL_DIR without importing torch (this process never needs it)
    d = Path(args.model) if args.model else Path(baton.__file__).parent / "assets" / "default-model"
    if not (d / "config.json").is_file():
        return f"model: no config.json in {d} (pass --model DIR: an HF checkpoint directory)"
    args.model = str(d.resolve())
    if args.token_file:
        if not os.path.isfile(args.token_file):
            return f"--token-file: no file {args.token_file}"
        args.token_file = os.path.abspath(args.token_file)  # actors do not share our working directory
    return None


def ports_error(host: str, port: int, http_port: int) -> str | None:
    """A message when the router's gRPC or HTTP port cannot be bound on `host`, or None. Checked before the
    workers start: a taken port is found in a second, not after minutes of loading a checkpoint. (The
    router binds them again later; a port taken in between still fails there, with the same message.)"""
    for flag, p in (("--port", port), ("--http-port", http_port)):
        if not p:  # 0: a free port (--port) or off (--http-port)
            continue
        try:
            socket.create_server((host, p), family=socket.getaddrinfo(host, p, type=socket.SOCK_STREAM)[0][0]).close()
        except OSError as e:
            why = (e.strerror or str(e)).split(" (while attempting")[0]
            hint = f"pass another {flag}" if e.errno == errno.EADDRINUSE else "check --host / BATON_HOST"
            return f"{flag} {p}: cannot listen on {host}:{p}: {why} ({hint})"
    return None
