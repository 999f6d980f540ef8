"""Whether exact mode's rounds merge or pipeline through the two workers, and each worker's gather set up so.

    rounds_share_a_device(device, gpu_workers)   -> bool: the workers' Draft and Verify passes share one device
    arrange_exact_rounds(gather, ...)            -> "merged" (the gather keeps its round barrier / round groups)
                                                    or "pipelined" (Gather.pipelined), logged at start-up

The rules behind them (round barrier, round groups, PERIODIC) are baton/engine/gather.py's module doc.
"""

from __future__ import annotations

import os

ENV_PERIODIC = "BATON_GATHER_PERIODIC"


def rounds_share_a_device(device, gpu_workers: int) -> bool:
    """Whether exact mode's Draft passes (decode worker) and Verify passes (prefill worker) share one device,
    so that two groups of sessions cost twice the passes of one and PERIODIC's merging pays: on CUDA with
    the workers on one GPU (gpu_workers > 1: BATON_GPU_WORKERS, set by the launchers). Else (the CPU, each
    worker on its own cores; one GPU a worker) two groups pipeline through the two workers for free and
    merging waits are pure loss (CPU, 8 exact sessions: 151 -> 207 tok/s without). BATON_GATHER_PERIODIC forces it."""
    forced = os.environ.get(ENV_PERIODIC)
    if forced in ("0", "1"):
        return forced == "1"
    return str(device).startswith("cuda") and gpu_workers > 1


def arrange_exact_rounds(g, device, gpu_workers: int, log, role: str) -> str:
    """A worker's exact-mode gather (decode: Draft, ROUND_BARRIER; prefill: Verify, ROUND_SETTLE) made plain
    (`Gather.pipelined`) unless rounds_share_a_device; logs which, at start-up (a run's logs then say
    whether its sessions' rounds merged). -> "merged" or "pipelined"."""
    if rounds_share_a_device(device, gpu_workers):
        how = "merged"
        log.info("%s: exact rounds merged (the workers share one device: BATON_GPU_WORKERS=%d)", role, gpu_workers)
    else:
        how = "pipelined"
        g.pipelined()
        log.info("%s: exact rounds pipelined (one device a worker; BATON_GATHER_PERIODIC=1 forces merging)", role)
    return how
