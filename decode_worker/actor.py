"""Ray actor of the decode worker: the same gRPC server as `python -m decode_worker`, in an actor.

Lifecycle:
    cls = make_actor_class(num_gpus=1, max_restarts=-1)   ray imported here, not at module import
    a = cls.options(name=...).remote(model_dir="/ckpt", engine="fp8", device="cuda")
        constructor: load model (+ FP8 copy) -> capture graphs (cuda) -> server bound -> SERVING
    ray.get(a.address.remote()) -> "10.0.0.6:40555"   LoadState / Decode / Draft go over gRPC
    a.health / a.stats / a.stop   as the prefill actor
"""

from __future__ import annotations

from baton.engine.pages import DEFAULT_GPU_MEMORY_FRACTION
from baton.engine.runner import DEFAULT_MAX_LEN, DEFAULT_WIDTH
from baton.worker.actor import WorkerActor, make_remote
from baton.worker.options import DEFAULT_SLOTS, DEFAULT_TTL_S, default_dtype
from baton.worker.process import ready

ENGINES = "bf16,fp8,mtp"


class DecodeActor(WorkerActor):
    role = "decode"

    def __init__(
        self,
        model_dir: str | None = None,
        port: int = 0,
        host: str | None = None,
        device: str = "cpu",
        dtype: str | None = None,
        engine: str | None = None,
        engines: str = ENGINES,
        width: int = DEFAULT_WIDTH,
        max_len: int = DEFAULT_MAX_LEN,
        slots: int = DEFAULT_SLOTS,
        ttl: float = DEFAULT_TTL_S,
        token_file: str | None = None,
        fp8_mode: str = "full",
        mtp_k: int = 4,
        mtp_draft_length: str = "adaptive",
        capture_graphs: bool = True,
        pipeline: bool = False,
        kv_pages: int | None = None,
        gpu_memory_fraction: float = DEFAULT_GPU_MEMORY_FRACTION,
    ):
        from decode_worker.serve import serve_decode

        settings = self._settings(token_file)
        names = tuple(e.strip() for e in str(engines).split(",") if e.strip())
        if engine and engine not in names:
            names += (engine,)
        self.handle, self.servicer = serve_decode(
            model_dir or None,
            engines=names,
            default_engine=engine or None,
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
            fp8_mode=fp8_mode,
            mtp_k=int(mtp_k),
            mtp_draft_length=mtp_draft_length,
            capture_graphs=_flag(capture_graphs),
            pipeline=_flag(pipeline),
        )
        ready(self.role, settings)  # the actor's process is this worker's


def _flag(value) -> bool:
    """A constructor flag given as a bool or a string ("0" / "false" / "no" / "off" = off)."""
    return str(value).strip().lower() not in ("0", "false", "no", "off")


def make_actor_class(**options):
    """The Ray actor class of DecodeActor: baton/worker/actor.py make_remote's options (num_gpus, resources,
    max_restarts, max_task_retries, num_cpus)."""
    return make_remote(DecodeActor, **options)
