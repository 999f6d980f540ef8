"""The workers' load and capacity on the router's /metrics, read when /metrics is scraped.

Lifecycle:
    WorkerCollector(registry).register(metrics.registry)   # once, in serve_router
    each scrape: collect() asks every up worker's GetStats at once (deadline DEADLINE_S each) and yields
                 one gauge family per figure, labelled role and worker (its address); a worker that does
                 not answer in time is left out of that scrape and counted in baton_worker_scrape_errors
                 (no stale figure is ever shown as current)

The figures (WorkerStats; docs/CONTRACTS.md, "KV pages"):
    baton_worker_sessions          sessions holding state now
    baton_worker_outstanding       RPCs in flight
    baton_worker_slots             session slots of each runner
    baton_worker_kv_pages          attention KV pages of its pools (256 tokens each)
    baton_worker_kv_pages_free     of them, free now
    baton_worker_kv_usage          1 - free / pages: what vLLM calls KV-cache usage
    baton_worker_gathered_batches_total, baton_worker_gathered_items_total
                                   counters since the worker started: its gathered batches (exact mode's
                                   Verify on a prefill worker; Draft calls and fast mtp rounds on a decode
                                   worker) and the calls in them
    baton_worker_gathered_seconds_total{part="wait"|"lock"|"run"|"run_PART"}
                                   their summed seconds: each batch's leader waiting for the calls it expects,
                                   then for the compute lock, then the batch (baton/engine/gather.py); run_PART:
                                   the run by part (baton/engine/parts.py: a Verify batch's run_checks,
                                   run_snapshot, run_pass, run_restore, run_replay, run_finish; a Draft batch's
                                   run_checks, run_verdicts, run_snapshot, run_chains, run_ar)
    baton_worker_batched_rpcs_total, baton_worker_batched_items_total
                                   the batched round RPCs it served (DraftMany, VerifyMany: router/batcher.py)
                                   and the requests in them
    baton_worker_mtp_rounds_total{k}, baton_worker_mtp_round_seconds_total{k}
                                   a decode worker's fast mtp rounds by the draft length K its controller ran
                                   (0: a plain batched step; baton/engine/draft_length.py) and their seconds
    baton_worker_prefix_cache_entries, baton_worker_prefix_cache_pages
                                   a prefill worker's prefix cache now (baton/engine/prefix_cache.py): the
                                   prompt prefixes it holds and the KV pages they hold (lent: not free, but
                                   given back to a request that needs them)
    baton_worker_prefix_cache_hits_total, baton_worker_prefix_cache_tokens_total
                                   prompts that started from a cached prefix, and the prompt tokens restored
                                   instead of computed, since the worker started
    baton_worker_prefix_cache_evictions_total{reason}
                                   entries evicted since start: "pages" when a request found too few free KV
                                   pages (the cache losing its prefixes to load), "capacity" for newer entries
    baton_worker_decode_wait_seconds{part, quantile}
                                   a decode worker's fast Decode calls before their first tokens, p50 / p99
                                   (quantile "0.5" / "0.99") of its recent calls: part "called" (LoadState's
                                   commit -> the call), "first_message" (the call -> its first message) and, within
                                   it, "setup" (the handler's, until it asks the engine) and "first_tokens" (the
                                   join of the step scheduler -> its first tokens):
                                   decode_worker/call_waits.py; the router's first_decode_ms in parts
Labels stay low-cardinality: a deployment has few workers, and their addresses change only on a restart.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor, wait

import grpc
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from baton.v1 import common_pb2

DEADLINE_S = 1.0  # per GetStats: a scrape never waits longer than this for the slowest worker
_FIGURES = (
    ("sessions", "Sessions holding state on the worker"),
    ("outstanding", "RPCs in flight on the worker"),
    ("slots", "Session slots of each of the worker's runners"),
    ("kv_pages", "Attention KV pages of the worker's pools (256 tokens each)"),
    ("kv_pages_free", "Free attention KV pages of the worker's pools"),
    ("prefix_cache_entries", "Prompt prefixes in the prefill worker's prefix cache"),
    ("prefix_cache_pages", "KV pages the prefill worker's prefix cache holds (given back on demand)"),
)


class WorkerCollector:
    """A prometheus_client collector over the router's Registry (router/registry.py)."""

    def __init__(self, registry, deadline_s: float = DEADLINE_S):
        self.registry, self.deadline_s = registry, deadline_s
        self.errors = 0  # GetStats calls that failed or missed the deadline, since start
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="baton-metrics")

    def register(self, prom_registry) -> WorkerCollector:
        prom_registry.register(self)
        return self

    def describe(self):
        return []  # no describe-time calls: the registry's auto-describe must not reach the workers

    def _stats(self, worker) -> common_pb2.WorkerStats | None:
        try:
            return worker.stub.GetStats(common_pb2.WorkerStatsRequest(), timeout=self.deadline_s)
        except grpc.RpcError:
            return None

    def collect(self):
        workers = self.registry.up("prefill") + self.registry.up("decode")
        futs = {self._pool.submit(self._stats, w): w for w in workers}
        wait(futs, timeout=self.deadline_s + 0.5)
        got = []
        for fut, w in futs.items():
            st = fut.result() if fut.done() else None
            if st is None:
                with self._lock:
                    self.errors += 1
            else:
                got.append((w, st))
        for name, doc in _FIGURES:
            fam = GaugeMetricFamily("baton_worker_" + name, doc, labels=["role", "worker"])
            for w, st in got:
                fam.add_metric([w.role, w.address], float(getattr(st, name)))
            yield fam
        usage = GaugeMetricFamily(
            "baton_worker_kv_usage", "Share of the worker's KV pages in use", labels=["role", "worker"]
        )
        for w, st in got:
            if st.kv_pages:
                usage.add_metric([w.role, w.address], 1.0 - st.kv_pages_free / st.kv_pages)
        yield usage
        yield from _gathered(got)
        yield _decode_waits(got)
        yield CounterMetricFamily(
            "baton_worker_scrape_errors", "Worker GetStats calls of /metrics scrapes that failed", value=self.errors
        )

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _gathered(got):
    """The gathered-batch counters of the workers that answered (module doc)."""
    labels = ["role", "worker"]
    batches = CounterMetricFamily("baton_worker_gathered_batches", "Gathered batches the worker ran", labels=labels)
    items = CounterMetricFamily("baton_worker_gathered_items", "Calls in the worker's gathered batches", labels=labels)
    secs = CounterMetricFamily(
        "baton_worker_gathered_seconds", "Seconds of the worker's gathered batches, by part", labels=[*labels, "part"]
    )
    rpcs = CounterMetricFamily(
        "baton_worker_batched_rpcs", "Batched round RPCs (DraftMany, VerifyMany) served", labels=labels
    )
    reqs = CounterMetricFamily("baton_worker_batched_items", "Requests in the batched round RPCs", labels=labels)
    by_k = CounterMetricFamily("baton_worker_mtp_rounds", "Fast mtp rounds by draft length K", labels=[*labels, "k"])
    k_secs = CounterMetricFamily(
        "baton_worker_mtp_round_seconds", "Seconds of the fast mtp rounds by draft length K", labels=[*labels, "k"]
    )
    hits = CounterMetricFamily("baton_worker_prefix_cache_hits", "Prompts started from a cached prefix", labels=labels)
    reused = CounterMetricFamily(
        "baton_worker_prefix_cache_tokens", "Prompt tokens restored from the prefix cache", labels=labels
    )
    evicted = CounterMetricFamily(
        "baton_worker_prefix_cache_evictions",
        "Prefix cache entries evicted: for a request's KV pages (reason pages) or for newer entries (capacity)",
        labels=[*labels, "reason"],
    )
    for w, st in got:
        if w.role == "prefill":
            hits.add_metric([w.role, w.address], float(st.prefix_cache_hits))
            reused.add_metric([w.role, w.address], float(st.prefix_cache_tokens))
            pages = st.prefix_cache_reclaimed
            evicted.add_metric([w.role, w.address, "pages"], float(pages))
            evicted.add_metric([w.role, w.address, "capacity"], float(st.prefix_cache_evicted - pages))
        for k, n in sorted(st.mtp_rounds_by_k.items()):
            by_k.add_metric([w.role, w.address, str(k)], float(n))
            k_secs.add_metric([w.role, w.address, str(k)], st.mtp_round_s_by_k.get(k, 0.0))
        batches.add_metric([w.role, w.address], float(st.gathered_batches))
        items.add_metric([w.role, w.address], float(st.gathered_items))
        for part, v in sorted(st.gathered_s.items()):
            secs.add_metric([w.role, w.address, part], v)
        rpcs.add_metric([w.role, w.address], float(st.batched_rpcs))
        reqs.add_metric([w.role, w.address], float(st.batched_items))
    yield from (batches, items, secs, rpcs, reqs, by_k, k_secs, hits, reused, evicted)


_WAITS = (
    ("called", "decode_called_s"),
    ("first_message", "decode_first_message_s"),
    ("setup", "decode_setup_s"),
    ("first_tokens", "first_tokens_s"),
)


def _decode_waits(got) -> GaugeMetricFamily:
    """baton_worker_decode_wait_seconds of the decode workers that answered (module doc)."""
    fam = GaugeMetricFamily(
        "baton_worker_decode_wait_seconds",
        "A decode worker's Decode calls before their first tokens, by part, p50 / p99 of recent calls",
        labels=["role", "worker", "part", "quantile"],
    )
    for w, st in got:
        if w.role == "decode":
            for part, field in _WAITS:
                for q, suffix in (("0.5", "p50"), ("0.99", "p99")):
                    fam.add_metric([w.role, w.address, part, q], getattr(st, f"{field}_{suffix}"))
    return fam
