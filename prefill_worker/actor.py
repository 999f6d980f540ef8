"""Ray actor of the prefill worker: the same gRPC server as `python -m prefill_worker`, in an actor.

Lifecycle:
    cls = make_actor_class(num_gpus=1, max_restarts=-1)   ray imported here, not at module import
    a = cls.options(name=...).remote(model_dir="/ckpt", port=0, device="cuda")
        constructor: load model -> ExactEngine -> server bound -> health SERVING
    ray.get(a.address.remote()) -> "10.0.0.5:40123"   the router talks gRPC to it, never via Ray
    a.health / a.stats           plain str / dict
    a.stop()                     health NOT_SERVING, drain, stop; a restarted actor (max_restarts)
                                 runs the constructor again (new port unless one was fixed)
"""

from __future__ import annotations

from baton.engine.pages import DEFAULT_GPU_MEMORY_FRACTION
from baton.engine.runner import DEFAULT_MAX_LEN, DEFAULT_WIDTH
from baton.worker.actor import WorkerActor, make_remote
from baton.worker.options import DEFAULT_SLOTS, DEFAULT_TTL_S, default_dtype
from baton.worker.process import ready


class PrefillActor(WorkerActor):
    role = "prefill"

    def __init__(
        self,
        model_dir: str | None = None,
        port: int = 0,
        host: str | None = None,
        device: str = "cpu",
        dtype: str | None = None,
        width: int = DEFAULT_WIDTH,
        max_len: int = DEFAULT_MAX_LEN,
        slots: int = DEFAULT_SLOTS,
        ttl: float = DEFAULT_TTL_S,
        token_file: str | None = None,
        chunk_mib: float = 4.0,
        kv_pages: int | None = None,
        gpu_memory_fraction: float = DEFAULT_GPU_MEMORY_FRACTION,
        prefill_budget: int | None = None,
        prefix_cache: int | None = None,
        prefill_piece: int | None = None,
    ):
        from prefill_worker.serve import serve_prefill

        settings = self._settings(token_file)
        self.handle, self.servicer = serve_prefill(
            model_dir or None,
            host=host or None,
            port=int(port),
            device=device,
            dtype=dtype or default_dtype(device),
            width=int(width),
            max_len=int(max_len),
            slots=int(slots),
            ttl_s=float(ttl),
            settings=settings,
            kv_pages=int(kv_pages) if kv_pages not in (None, "") else None,
            gpu_memory_fraction=float(gpu_memory_fraction),
            chunk_bytes=int(float(chunk_mib) * (1 << 20)),
            prefill_budget=int(prefill_budget) if prefill_budget not in (None, "") else None,
            prefix_cache=int(prefix_cache) if prefix_cache not in (None, "") else None,
            prefill_piece=int(prefill_piece) if prefill_piece not in (None, "") else None,
        )
        ready(self.role, settings)  # the actor's process is this worker's


def make_actor_class(**options):
    """The Ray actor class of PrefillActor: baton/worker/actor.py make_remote's options (num_gpus, resources,
    max_restarts, max_task_retries, num_cpus)."""
    return make_remote(PrefillActor, **options)
