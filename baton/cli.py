"""`baton` command line. Each subcommand lives in its own module exposing
`add_arguments(parser)` and `run(args) -> int`; modules are imported only when their command runs."""
from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "make-tiny": ("baton.random_checkpoint", "write a tiny random Qwen3.5-architecture checkpoint"),
    "complete": ("baton.complete", "greedy completion in-process with the exact engine (the reference)"),
    "serve": ("deploy.local", "serve a model: router + prefill and decode workers (Ray or --processes)"),
    "generate": ("baton.client_cli", "stream a completion from a running router"),
    "health": ("baton.client_cli", "check a router's gRPC health"),
    "bench": ("benchmarks.suite", "run the benchmark suite"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="baton", description="Baton: serving for hybrid recurrent LLMs")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    # Only the chosen command's module is imported (keeps `baton health` fast and torch-free).
    name = next((a for a in argv if not a.startswith("-")), None)
    for cmd, (mod, help_) in COMMANDS.items():
        sp = sub.add_parser(cmd, help=help_)
        if cmd == name:
            module = importlib.import_module(mod)
            if hasattr(module, "add_arguments_for"):
                module.add_arguments_for(cmd, sp)
            else:
                module.add_arguments(sp)
            sp.set_defaults(_module=module)
    args = p.parse_args(argv)
    module = args._module
    run = getattr(module, "run_for", None)
    return int((run(args.command, args) if run else module.run(args)) or 0)


if __name__ == "__main__":
    sys.exit(main())
