"""The Ray side of a worker: `make_remote(cls, ...)` and `WorkerActor`.

Inside a Ray actor (prefill_worker/actor.py, decode_worker/actor.py) the same serve_*() as the process
runs in the actor's constructor; `WorkerActor` gives address() / health() / stats() / stop(), and
`make_remote(cls, ...)` decorates it (ray is imported only there: the GPU machine has no Ray)."""

from __future__ import annotations

import logging

import grpc

from baton.settings import Settings
from baton.worker.command_line import setup_logging
from baton.worker.options import DEFAULT_GRACE_S, settings_for
from baton.worker.process import WorkerHandle

log = logging.getLogger("baton.worker")


def make_remote(
    cls,
    *,
    num_gpus: float = 0,
    resources: dict | None = None,
    max_restarts: int = -1,
    max_task_retries: int | None = None,
    num_cpus: float | None = None,
):
    """ray.remote(...)(cls). max_task_retries defaults to -1 (retry across restarts) when the actor
    may restart: every actor method is idempotent."""
    import ray

    opts = dict(
        num_gpus=num_gpus,
        max_restarts=max_restarts,
        max_task_retries=(-1 if max_restarts else 0) if max_task_retries is None else max_task_retries,
    )
    if resources:
        opts["resources"] = dict(resources)
    if num_cpus is not None:
        opts["num_cpus"] = num_cpus
    return ray.remote(**opts)(cls)


class WorkerActor:
    """Base of the worker actor classes: subclasses set self.handle (a WorkerHandle) and self.role.
    Constructor arguments are plain str/int/float (NOTE: never pass the token itself: use token_file
    or BATON_TOKEN in the actor's runtime_env)."""

    role = "worker"
    handle: WorkerHandle

    def _settings(self, token_file: str | None) -> Settings:
        settings = settings_for(token_file or None)
        setup_logging(settings)
        return settings

    def _advertised(self) -> str:
        """The address to give others: a wildcard bind host is replaced by this node's IP."""
        host = self.handle.host
        if host in ("", "0.0.0.0", "::", "[::]"):
            import ray

            host = ray.util.get_node_ip_address()
        return f"[{host}]:{self.handle.port}" if ":" in host else f"{host}:{self.handle.port}"

    def address(self) -> str:
        return self._advertised()

    def health(self) -> str:
        """grpc.health.v1 status of the server, asked over its own socket: "SERVING", "NOT_SERVING", or
        "UNREACHABLE" (stopped)."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        from baton.rpc import make_channel

        with make_channel(self.handle.address, self.handle.servicer.settings) as ch:
            try:
                r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            except grpc.RpcError:
                return "UNREACHABLE"
        return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)

    def stats(self) -> dict:
        s = self.handle.servicer.stats()
        return {
            "role": self.role,
            "address": self.address(),
            "sessions": s.sessions,
            "session_bytes": s.session_bytes,
            "outstanding": s.outstanding,
            "engine": s.engine,
            "model_fingerprint": s.model_fingerprint,
            "max_len": s.max_len,
            "requests_total": s.requests_total,
        }

    def stop(self, grace: float = DEFAULT_GRACE_S) -> bool:
        self.handle.stop(grace)
        return True
