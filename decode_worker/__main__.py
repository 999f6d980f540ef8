"""`python -m decode_worker --model DIR --port P --engine bf16|fp8|mtp [--engines bf16,mtp] ...`
(benchmarks: `--random-init SHAPE --seed N` instead of --model, the same on every worker)
bf16 / fp8 sessions step together (the batched step scheduler) by default; `--pipeline`: each session
alone in the pipelined AR loop (batch 1's fastest, no batching).

Lifecycle: parse options -> settings (env + --token-file) -> load the model (+ FP8 copy), capture
CUDA graphs on cuda, log progress -> bind -> health SERVING -> print "decode: serving on HOST:PORT"
-> SIGINT/SIGTERM: health NOT_SERVING, drain for --grace seconds, exit 0.
"""

from __future__ import annotations

import argparse
import sys

from baton.lifeline import die_with_parent
from baton.worker.command_line import (
    add_common_arguments,
    cannot_start,
    model_from_args,
    options_from_args,
    setup_logging,
)
from baton.worker.options import settings_for
from baton.worker.process import LoadInterrupted, StopSignals, run_until_signal

ENGINES = ("bf16", "fp8", "mtp")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m decode_worker", description="Baton decode worker")
    add_common_arguments(p)
    p.add_argument("--engine", default=None, choices=ENGINES, help="default engine (default: the first available)")
    p.add_argument(
        "--engines",
        default=",".join(ENGINES),
        help="engines to offer, comma-separated (filtered to what the checkpoint supports)",
    )
    p.add_argument(
        "--fp8-mode",
        default="full",
        choices=["full", "tail"],
        help="fp8: all projections, or the state-safe tail (last MLP + LM head)",
    )
    p.add_argument(
        "--mtp-k", type=int, default=4, help="mtp engine: drafts per verify round in Decode (default %(default)s)"
    )
    p.add_argument(
        "--mtp-draft-length",
        choices=("adaptive", "fixed"),
        default="adaptive",
        help="mtp engine, fast mode: K per round, adaptive (from the session's acceptance and its rounds' "
        "cost in the batch, --mtp-k the prior, K = 0 a plain step when speculation does not pay) or "
        "fixed (--mtp-k every round)",
    )
    p.add_argument("--no-graphs", action="store_true", help="do not capture CUDA graphs (eager decode)")
    p.add_argument(
        "--pipeline",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="bf16 / fp8: each session alone in the pipelined AR loop (each step launched before the "
        "previous token is read; ping-pong GDN buffers: one more GDN state per slot; no batching; tokens "
        "identical). Default off: every session steps together in batched steps",
    )
    return p


def main(argv: list[str] | None = None, *, drafter=None) -> int:
    """drafter: a baton.engine.speculation.Drafter for every session (benchmarks only; None = the model's own)."""
    die_with_parent()  # started by deploy.processes.WorkerProcess: SIGTERM when it dies
    signals = StopSignals("decode")  # a SIGTERM while starting (imports, load, warm-up) exits 0 at once
    try:
        return _main(argv, signals, drafter)
    except LoadInterrupted:
        return 0


def _main(argv, signals: StopSignals, drafter) -> int:
    args = build_parser().parse_args(argv)
    opts = options_from_args(args)
    engines = tuple(e.strip() for e in args.engines.split(",") if e.strip())
    if args.engine and args.engine not in engines:
        engines += (args.engine,)
    try:
        settings = settings_for(opts.token_file)
    except ValueError as e:  # SettingsError: names the variable / file
        print(f"decode: {e}", file=sys.stderr)
        return 2
    setup_logging(settings)

    from decode_worker.serve import serve_decode  # torch import after logging is set up

    try:
        model = model_from_args(args, opts, "decode")
        handle, _ = serve_decode(
            model,
            engines=engines,
            default_engine=args.engine,
            host=opts.host,
            port=opts.port,
            device=opts.device,
            dtype=opts.resolved_dtype,
            width=opts.width,
            max_len=opts.max_len,
            slots=opts.slots,
            ttl_s=opts.ttl_s,
            settings=settings,
            kv_pages=opts.kv_pages,
            gpu_memory_fraction=opts.gpu_memory_fraction,
            capture_graphs=not args.no_graphs,
            fp8_mode=args.fp8_mode,
            mtp_k=args.mtp_k,
            mtp_draft_length=args.mtp_draft_length,
            pipeline=args.pipeline,
            drafter=drafter,
        )
        del model  # a random-init LoadedModel: the engines hold what they use
    except (OSError, ValueError, RuntimeError) as e:  # one line and exit 2; other runtime errors re-raised
        return cannot_start("decode", e, opts)
    signals.serving()  # NOTE: before the serving line: a signal now drains what the worker serves
    return run_until_signal("decode", handle, opts.grace_s, signals)


if __name__ == "__main__":
    from baton.worker.process import exit_process

    exit_process(main())
