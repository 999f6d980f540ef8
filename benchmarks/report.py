"""The one way a benchmark reports: its JSON object on stdout, and the same in --out when given; and how a
benchmark that starts workers ends when it is told to stop (exit_on_sigterm)."""

from __future__ import annotations

import json
import os
import platform
import signal
import socket
from pathlib import Path


def emit(result: dict, out: str | Path | None) -> None:
    print(json.dumps(result, indent=1), flush=True)
    if out:
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")


def header(script: str, argv: list[str] | None) -> dict:
    """The fields every result starts with: benchmark (the script's name), command (as run: argv, or the
    process's own arguments), date (UTC) and machine."""
    import datetime
    import sys

    name = Path(script).stem
    return {
        "benchmark": name,
        "command": " ".join(["python", f"benchmarks/{name}.py", *(argv if argv is not None else sys.argv[1:])]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
    }


def machine(**extra) -> dict:
    """Where a benchmark ran: host, CPU model, usable cores, Python/torch/grpc versions, GPU; plus `extra`."""
    import grpc
    import torch

    cpu = platform.processor()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    out = {
        "host": socket.gethostname(),
        "cpu": cpu,
        "cores_usable": len(os.sched_getaffinity(0)),
        "cores_host": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "grpc": grpc.__version__,
        **extra,
    }
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
    return out


def exit_on_sigterm() -> None:
    """SIGTERM (a `timeout`, the device call's limit) raises SystemExit(143) in the main thread, so the
    benchmark's finally blocks stop the worker processes it started. Python's default SIGTERM ends the
    process at once: its `baton serve` kept running and holding GPU memory (on the H200, a stage cut by
    its time limit left 79 GB held and the next stage ran out of memory)."""

    def _exit(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _exit)
