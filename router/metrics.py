"""Prometheus metrics of one router.

Lifecycle:
    m = RouterMetrics()                  # own CollectorRegistry: several routers may live in one process
    m.watch_workers(registry)            # + the workers' load and capacity, read at each scrape
                                         #   (baton_worker_*: router/worker_metrics.py)
    m.start(port, host)                  # /metrics over HTTP on host:port (port 0 = off)
    ... RouterServicer records: request_done(), first_token(), tokens(), exact(), bridge(), migration()
    m.stop()

Every name of the router's own starts with `baton_router_`, the workers' with `baton_worker_`. Labels stay low-cardinality (mode, engine, status), never
request ids. `baton_router_queued` (requests waiting in line for a session slot) is read from the servicer's
SlotLine at each scrape (watch_line).
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
    start_http_server,
)

# NOTE: no `*_created` series (one more gauge per counter / histogram child, the creation time, that no
# dashboard reads; vLLM turns them off too). Process-wide: the router's process has only this registry.
disable_created_metrics()

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
_ITL_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        p = "baton_router_"
        self.requests = Counter(p + "requests", "Generate calls by final status", ["mode", "status"], registry=r)
        self.inflight = Gauge(p + "inflight", "Generate calls in flight", registry=r)
        self.queued = Gauge(p + "queued", "Generate calls waiting in line for a session slot", registry=r)
        self.latency = Histogram(
            p + "request_seconds",
            "Request arrival to its end, by final status",
            ["mode", "status"],
            buckets=_E2E_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            p + "ttft_seconds", "Request arrival to first token sent", ["mode"], buckets=_LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            p + "inter_token_seconds", "Gap between streamed tokens", ["mode"], buckets=_ITL_BUCKETS, registry=r
        )
        self.tokens_out = Counter(p + "tokens", "Completion tokens streamed", ["mode", "engine"], registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens admitted", registry=r)
        self.drafted = Counter(p + "drafted_tokens", "Exact mode: draft tokens verified", ["engine"], registry=r)
        self.accepted = Counter(p + "accepted_tokens", "Exact mode: draft tokens accepted", ["engine"], registry=r)
        self.bridge_bytes = Counter(p + "bridge_bytes", "State bytes handed from prefill to decode", registry=r)
        self.bridge_seconds = Histogram(
            p + "bridge_seconds", "Duration of one state hand-off", buckets=_LATENCY_BUCKETS, registry=r
        )
        # by what they shipped: state="full" or "draft_only" (exact mode, mtp drafts: hidden row and MTP KV alone)
        self.handoffs = Counter(p + "handoffs", "State hand-offs by what they shipped", ["state"], registry=r)
        self.handoff_bytes = Counter(p + "handoff_bytes", "State bytes by what was shipped", ["state"], registry=r)
        self.migrations = Counter(p + "migrations", "Requests moved to another decode worker", ["mode"], registry=r)
        self.prefill_retries = Counter(p + "prefill_retries", "Prefills retried on another worker", registry=r)
        self.workers_up = Gauge(p + "workers_up", "Workers answering SERVING", ["role"], registry=r)
        self._server = None
        self._workers = None

    def watch_workers(self, registry) -> None:
        """The workers' figures (router/worker_metrics.py) join this registry: read from `registry`'s up
        workers whenever /metrics is rendered."""
        from router.worker_metrics import WorkerCollector

        self._workers = WorkerCollector(registry).register(self.registry)

    # ---- HTTP endpoint ---------------------------------------------------------------------------
    def start(self, port: int, host: str = "127.0.0.1") -> int:
        """Serve /metrics on host:port; port 0 = off. Returns the bound port (0 when off)."""
        if not port:
            return 0
        self._server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return int(self._server.server_port)

    def stop(self) -> None:
        if self._workers is not None:
            self._workers.close()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def render(self) -> bytes:
        """The text exposition (what /metrics serves); tests read it directly."""
        return generate_latest(self.registry)

    # ---- recording -------------------------------------------------------------------------------
    def request_done(self, mode: str, status: str, seconds: float | None = None) -> None:
        self.requests.labels(mode, status).inc()
        if seconds is not None:
            self.latency.labels(mode, status).observe(seconds)

    def watch_line(self, line) -> None:
        """baton_router_queued reads len(line) (router/slot_line.py SlotLine) at each scrape."""
        self.queued.set_function(lambda: len(line))

    def first_token(self, mode: str, seconds: float) -> None:
        self.ttft.labels(mode).observe(seconds)

    def tokens(self, mode: str, engine: str, n: int, gap_s: float | None) -> None:
        """n tokens sent in one message, gap_s after the previous message (None for the first)."""
        self.tokens_out.labels(mode, engine).inc(n)
        if gap_s is not None and n:
            self.itl.labels(mode).observe(gap_s / n)

    def exact(self, engine: str, drafted: int, accepted: int) -> None:
        self.drafted.labels(engine).inc(drafted)
        self.accepted.labels(engine).inc(accepted)

    def bridge(self, nbytes: int, seconds: float, draft_only: bool = False) -> None:
        self.bridge_bytes.inc(nbytes)
        self.bridge_seconds.observe(seconds)
        state = "draft_only" if draft_only else "full"
        self.handoffs.labels(state).inc()
        self.handoff_bytes.labels(state).inc(nbytes)

    def migration(self, mode: str) -> None:
        self.migrations.labels(mode).inc()

    def workers(self, prefill_up: int, decode_up: int) -> None:
        self.workers_up.labels("prefill").set(prefill_up)
        self.workers_up.labels("decode").set(decode_up)
