"""The KV budgets of workers that share one GPU, agreed before any of them sizes its pool.

Each worker sizes its KV pages from GPU memory once its weights are loaded (pages.choose_pages). Alone on a
GPU it takes a fraction of the memory free then. Two workers on one GPU cannot do that: the first to size
would take the fraction of what the other has not loaded yet (on an 80 GiB H100 the decode worker was left
41 pages, 2026-12-05). Nor can each take fraction x total / N less its own weights: the decode worker holds
more (an FP8 copy, O(1) state for two runners) than half of an H100 leaves it.

So they agree through files. The launcher (deploy/processes.py start_processes; for Ray actors
deploy/ray_gpus.py) gives each worker placed on a shared GPU BATON_GPU_WORKERS=N and BATON_GPU_PLAN=DIR/NAME, one DIR per GPU. A worker writes its fixed
bytes (what its process holds, plus the O(1) state it will still allocate) to its own file, waits until N
files are there, and takes

    budget = (fraction x total - sum of every worker's fixed bytes) / N

the same split whichever worker starts first. A restarted worker rewrites its own file (the same NAME), so a
restart sees the others' figures at once. If the others never write (one failed to load), the worker gives
up waiting after timeout_s and returns None: the caller sizes from free memory, as alone, and logs it.
"""

from __future__ import annotations

import logging
import os
import time

log = logging.getLogger("baton.worker")

PLAN_TIMEOUT_S = 600.0  # the other workers' model loads: a 9B checkpoint takes ~1 min


def write_fixed(path: str, fixed: int) -> None:
    """This worker's fixed bytes into its plan file, atomically (a reader never sees half a number)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)  # a Ray actor on another node makes its own
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(str(int(fixed)))
    os.replace(tmp, path)


def read_fixed(folder: str) -> dict[str, int]:
    """Every worker's fixed bytes written so far: file name -> bytes (unfinished .tmp files skipped)."""
    out = {}
    for name in os.listdir(folder):
        if ".tmp" in name:
            continue
        try:
            with open(os.path.join(folder, name)) as f:
                out[name] = int(f.read().strip())
        except (OSError, ValueError):
            continue
    return out


def agreed_budget(
    path: str,
    workers: int,
    fixed: int,
    total: int,
    fraction: float,
    *,
    timeout_s: float = PLAN_TIMEOUT_S,
    poll_s: float = 0.1,
) -> int | None:
    """This worker's KV bytes: (fraction x total - every worker's fixed bytes) / workers, at least 0, once
    all `workers` wrote theirs (module doc); None if they did not within timeout_s."""
    write_fixed(path, fixed)
    folder = os.path.dirname(path) or "."
    deadline = time.monotonic() + timeout_s
    said = False
    while True:
        got = read_fixed(folder)
        if len(got) >= workers:
            break
        if time.monotonic() >= deadline:
            log.warning(
                "KV plan: %d of %d workers on this GPU wrote their needs in %.0f s", len(got), workers, timeout_s
            )
            return None
        if not said:
            log.info("KV plan: waiting for %d more worker(s) on this GPU to load", workers - len(got))
            said = True
        time.sleep(poll_s)
    left = int(total * fraction) - sum(got.values())
    budget = max(left, 0) // workers
    log.info(
        "KV plan: %d workers on this GPU need %.1f GiB fixed of %.1f GiB x %.2f: %.1f GiB of KV each",
        workers, sum(got.values()) / 2**30, total / 2**30, fraction, budget / 2**30,
    )  # fmt: skip
    return budget
