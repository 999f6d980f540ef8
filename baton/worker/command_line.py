"""The workers' shared command line: `python -m prefill_worker | python -m decode_worker` options.

add_common_arguments(parser)     the options both roles take
options_from_args(args)          -> WorkerOptions (checks the combination)
model_from_args(args, opts)      -> baton.loading.LoadedModel (a checkpoint, or --random-init SPEC)
cannot_start(role, error, opts)  -> 2, after one log line on why the worker cannot start (or re-raises)
start_oom(error, opts)           -> why a start-up ran out of GPU memory and what to change, or None
setup_logging(settings)"""

from __future__ import annotations

import argparse
import logging
import sys

from baton.engine.pages import DEFAULT_GPU_MEMORY_FRACTION, PAGE
from baton.engine.runner import DEFAULT_MAX_LEN, DEFAULT_WIDTH
from baton.gpus import pin_device
from baton.rpc import port_arg
from baton.settings import Settings
from baton.worker.options import DEFAULT_GRACE_S, DEFAULT_SLOTS, DEFAULT_TTL_S, WorkerOptions

log = logging.getLogger("baton.worker")


def add_common_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF checkpoint directory (default: the embedded model)")
    p.add_argument("--port", type=port_arg, default=0, help="port to bind (0 = pick a free one and print it)")
    p.add_argument("--host", default=None, help="bind host (default: BATON_HOST or 127.0.0.1)")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    p.add_argument("--dtype", default=None, choices=["bf16", "fp32"], help="default: bf16 on cuda, fp32 on cpu")
    p.add_argument("--width", type=int, default=DEFAULT_WIDTH, help="fixed row width W (default %(default)s)")
    p.add_argument(
        "--max-len", type=int, default=DEFAULT_MAX_LEN, help="window: prompt + generated tokens (default %(default)s)"
    )
    p.add_argument(
        "--slots", type=int, default=DEFAULT_SLOTS, help="concurrent sessions (static state slots; default %(default)s)"
    )
    p.add_argument(
        "--kv-pages",
        type=int,
        default=None,
        help=f"attention KV pages of {PAGE} tokens per runner (default: on cuda from --gpu-memory-fraction, "
        "on cpu slots x window)",
    )
    p.add_argument(
        "--gpu-memory-fraction",
        type=float,
        default=DEFAULT_GPU_MEMORY_FRACTION,
        help="cuda: share of the free GPU memory at start-up the KV pages may take (default %(default)s; "
        "lower it when workers share a GPU)",
    )
    p.add_argument(
        "--ttl", type=float, default=DEFAULT_TTL_S, help="idle seconds before a session is reaped (default %(default)s)"
    )
    p.add_argument("--token-file", default=None, help="bearer token file (default: BATON_TOKEN[_FILE])")
    p.add_argument(
        "--grace", type=float, default=DEFAULT_GRACE_S, help="seconds to drain RPCs on shutdown (default %(default)s)"
    )
    p.add_argument(
        "--random-init",
        default=None,
        metavar="SHAPE",
        help="benchmarks: seeded random weights of a named shape (baton/random_init.py) or of the "
        "config.json in a directory, instead of --model",
    )
    p.add_argument("--seed", type=int, default=0, help="--random-init: weight seed (same on every worker)")


def model_from_args(a: argparse.Namespace, opts: "WorkerOptions", role: str):
    """What serve_prefill / serve_decode load: --model DIR (None = the embedded model), or with
    --random-init a LoadedModel of seeded random weights, bitwise the same in every process."""
    if not a.random_init:
        return opts.model
    from baton.random_init import random_init

    log.info("%s: random weights of %s (seed %d)", role, a.random_init, a.seed)
    return random_init(a.random_init, seed=a.seed, dtype=opts.resolved_dtype, device=opts.device)


def _usage(message: str):
    """A bad option: its message on stderr and exit 2, as argparse's own errors."""
    print(message, file=sys.stderr)
    return SystemExit(2)


def options_from_args(a: argparse.Namespace) -> WorkerOptions:
    if a.random_init and a.model:
        raise _usage("give --model or --random-init, not both")
    for name in ("width", "max_len", "slots"):
        if getattr(a, name) < 1:
            raise _usage(f"--{name.replace('_', '-')}: must be >= 1")
    try:
        device = pin_device(a.device)  # cuda:N -> this process sees only GPU N (baton/gpus.py)
    except ValueError as e:
        raise _usage(str(e)) from None
    if a.kv_pages is not None and a.kv_pages < 1:
        raise _usage("--kv-pages: must be >= 1")
    if a.width < 3:  # K = W - 2 drafts at least one token
        raise _usage("--width: must be >= 3")
    if a.max_len <= a.width:  # W rows are reserved: a smaller window holds no prompt
        raise _usage(f"--max-len: must be more than --width ({a.width})")
    if not a.ttl > 0:  # 0 reaped every session as soon as it was made
        raise _usage("--ttl: must be > 0")
    if not a.grace >= 0:
        raise _usage("--grace: must be >= 0")
    if not 0.0 < a.gpu_memory_fraction <= 1.0:
        raise _usage("--gpu-memory-fraction: must be in (0, 1]")
    return WorkerOptions(
        a.model,
        a.port,
        a.host,
        device,
        a.dtype,
        a.width,
        a.max_len,
        a.slots,
        a.ttl,
        a.token_file,
        a.grace,
        a.kv_pages,
        a.gpu_memory_fraction,
    )


def setup_logging(settings: Settings) -> None:
    from baton.logs import setup_logging as setup

    setup(settings)


def start_oom(e: BaseException, opts: WorkerOptions) -> str | None:
    """A start-up's CUDA out-of-memory error (torch.OutOfMemoryError, or a CUDA call's "out of memory" error,
    e.g. creating a stream while capturing graphs) -> a one-line reason with the options that size the memory;
    None for any other error. The KV pages are sized first from what is free, so running out later means the
    rest of the start-up (graphs, buffers) or another process took more than the sizing left."""
    import torch

    if not isinstance(e, torch.OutOfMemoryError) and "out of memory" not in str(e).lower():
        return None
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return (
        f"out of GPU memory after sizing the KV pages ({first}): lower --gpu-memory-fraction (now "
        f"{opts.gpu_memory_fraction}), --max-len (now {opts.max_len}) or --slots (now {opts.slots}), set "
        "--kv-pages, or free the GPU (another process on it?)"
    )


def cannot_start(role: str, e: BaseException, opts: WorkerOptions) -> int:
    """A worker's start-up error, called in its except block: a bad file or option (OSError, ValueError) or
    CUDA out of memory (start_oom) -> one ERROR line "ROLE: cannot start: ..." and 2 (the exit code); any
    other RuntimeError is re-raised with its traceback (a bug, not an operator's mistake)."""
    why = start_oom(e, opts) if isinstance(e, RuntimeError) else str(e)
    if why is None:
        raise e
    logging.getLogger(f"baton.{role}").error("%s: cannot start: %s", role, why)
    return 2
