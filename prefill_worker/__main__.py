"""`python -m prefill_worker --model DIR --port P [--device cpu|cuda] [--dtype bf16|fp32] ...`
(benchmarks: `--random-init SHAPE --seed N` instead of --model, the same on every worker)

Lifecycle: parse options -> settings (env + --token-file) -> load the model, log progress -> bind ->
health SERVING -> print "prefill: serving on HOST:PORT" -> SIGINT/SIGTERM: health NOT_SERVING,
drain for --grace seconds, exit 0.
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


def main(argv: list[str] | None = None) -> int:
    die_with_parent()  # started by deploy.processes.WorkerProcess: SIGTERM when it dies
    signals = StopSignals("prefill")  # a SIGTERM while starting (imports, load, warm-up) exits 0 at once
    try:
        return _main(argv, signals)
    except LoadInterrupted:
        return 0


def _main(argv, signals: StopSignals) -> int:
    p = argparse.ArgumentParser(prog="python -m prefill_worker", description="Baton prefill worker (exact engine)")
    add_common_arguments(p)
    p.add_argument("--chunk-mib", type=float, default=4.0, help="state hand-off chunk size, MiB")
    p.add_argument(
        "--handoff-sender",
        choices=["process", "thread"],
        default=None,
        help="who streams hand-offs: a sender child process or threads of this one "
        "(default: BATON_HANDOFF_SENDER, else process)",
    )
    p.add_argument(
        "--handoff-tail-chunk-mib",
        type=float,
        default=None,
        help="hand-off chunk size, MiB, for the last --handoff-tail-layers layers' state (wire format 4's "
        "tail segment; capped at --chunk-mib; 0: none; default: BATON_HANDOFF_TAIL_CHUNK_BYTES, else 1)",
    )
    p.add_argument(
        "--handoff-tail-layers",
        type=int,
        default=None,
        help="layers the tail segment covers, counted from the last (default: BATON_HANDOFF_TAIL_LAYERS, else 1)",
    )
    p.add_argument(
        "--prefill-budget",
        type=int,
        default=None,
        help="prompt tokens one batched prefill pass may hold: concurrent prompts share passes up to it, "
        "and a prompt's piece (baton/engine/prefill.py PREFILL_CHUNK) always gets one "
        "(default: prefill_worker.engine.PREFILL_BUDGET, 8192)",
    )
    p.add_argument(
        "--prefix-cache",
        type=int,
        default=None,
        metavar="N",
        help="prompt prefixes kept for later prompts that begin with them, one per 8192-token piece boundary "
        "(baton/engine/prefix_cache.py: their state restored bitwise, their KV in idle pages); 0: off "
        "(default: 16 when --max-len exceeds 8192, else off)",
    )
    p.add_argument(
        "--prefill-piece",
        type=int,
        default=None,
        metavar="N",
        help="the pieces prompts are cut into, and so the prefix cache's boundaries: a multiple of 256 tokens, "
        "taken only if a prompt cut there ends bitwise as in 8192-token pieces on this device (checked at start-up; "
        "else 8192, with a warning). Smaller pieces let a conversation's next turn restore more of its prompt, "
        "at the cost of more sequential passes for a long prompt (default: 8192)",
    )
    args = p.parse_args(argv)
    if args.prefill_piece is not None and (args.prefill_piece < 1 or args.prefill_piece % 256):
        print("prefill: --prefill-piece must be a positive multiple of 256", file=sys.stderr)
        return 2
    if args.prefill_budget is not None and args.prefill_budget < 1:
        print("prefill: --prefill-budget must be >= 1", file=sys.stderr)
        return 2
    if args.prefix_cache is not None and args.prefix_cache < 0:
        print("prefill: --prefix-cache must be >= 0", file=sys.stderr)
        return 2
    opts = options_from_args(args)
    try:
        settings = settings_for(opts.token_file)
        if args.handoff_sender:
            settings = settings.replace(handoff_sender=args.handoff_sender)
        if args.handoff_tail_chunk_mib is not None:
            settings = settings.replace(handoff_tail_chunk_bytes=round(args.handoff_tail_chunk_mib * (1 << 20)))
        if args.handoff_tail_layers is not None:
            settings = settings.replace(handoff_tail_layers=args.handoff_tail_layers)
    except ValueError as e:  # SettingsError: names the variable / file
        print(f"prefill: {e}", file=sys.stderr)
        return 2
    setup_logging(settings)

    from prefill_worker.serve import serve_prefill  # torch import after logging is set up

    try:
        model = model_from_args(args, opts, "prefill")
        handle, _ = serve_prefill(
            model,
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
            chunk_bytes=int(args.chunk_mib * (1 << 20)),
            prefill_budget=args.prefill_budget,
            prefix_cache=args.prefix_cache,
            prefill_piece=args.prefill_piece,
        )
        del model  # a random-init LoadedModel: the engines hold what they use
    except (OSError, ValueError, RuntimeError) as e:  # one line and exit 2; other runtime errors re-raised
        return cannot_start("prefill", e, opts)
    signals.serving()  # NOTE: before the serving line: a signal now drains what the worker serves
    return run_until_signal("prefill", handle, opts.grace_s, signals)


if __name__ == "__main__":
    from baton.worker.process import exit_process

    exit_process(main())
