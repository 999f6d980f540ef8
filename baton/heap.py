"""The start-up heap, frozen out of the garbage collector's passes, once a process is ready to serve.

Why: after loading the model, capturing its graphs and compiling its kernels, a worker's heap holds a few
hundred thousand objects the collector tracks (~400K with the embedded model on the CPU), and they live as
long as the process. A full (generation 2) collection walks every one of them with the GIL held: 243 ms on
a 2-core VM, a pause of every thread of the process (the decode steps, every Decode stream, the hand-off's
receiver). gc.freeze() moves them to the permanent generation, which collections skip; objects made later
are collected as before.

Called by the process mains (baton/worker/process.py: ready; router/__main__.py) and the Ray actors, never
by serve_*() themselves: a test process starts many servers and must keep collecting what they leave behind.
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger("baton")


def freeze_startup_heap(role: str) -> int:
    """One full collection, then every surviving object frozen; -> how many were frozen (logged with the
    collection's time: what each full collection would have paused the process for)."""
    t0 = time.perf_counter()
    gc.collect()
    took = time.perf_counter() - t0
    gc.freeze()
    n = gc.get_freeze_count()
    log.info(
        "%s: %d start-up objects frozen out of the garbage collector (a full collection took %.0f ms)",
        role,
        n,
        took * 1e3,
    )
    return n
