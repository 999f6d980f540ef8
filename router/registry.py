"""Worker pools of the router: discovery, health, least-outstanding-work choice.

Lifecycle:
    reg = Registry(settings, prefill=["h:p", ...], decode=[...], ray_namespace=None, on_change=cb)
    reg.start()          # one synchronous poll, then a background poller every `poll_interval` s:
                         #   grpc.health.v1 Check("") on every worker (short deadline, in parallel);
                         #   on a down->up edge GetStats learns engines / window / fingerprint;
                         #   with a Ray namespace, named actors `baton-{prefill,decode}-*` are
                         #   re-listed every `ray_every` s and the pools follow them
                         #   cb(serving, n_prefill_up, n_decode_up) fires when any of those change
    w = reg.pick("decode", engine="fp8", exclude={dead})    # NoWorker when none is up
    with reg.lease(w): ...                                   # counts w's outstanding requests
    reg.mark_down(w)     # a call saw UNAVAILABLE / a hang: w is skipped until a Check says SERVING
    reg.stop()

`serving` is True only while >= 1 prefill and >= 1 decode worker answer SERVING.
"""

from __future__ import annotations

import itertools
import logging
import re
import threading
import time
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from baton.rpc import make_channel
from baton.settings import Settings
from baton.v1 import common_pb2, decode_pb2_grpc, prefill_pb2_grpc

log = logging.getLogger("baton.router.registry")

UNSEEN_NOTE_S = 30.0  # a worker never up yet: one "not up yet" line at its first failed check, then one per this
ROLES = ("prefill", "decode")
_STUBS = {"prefill": prefill_pb2_grpc.PrefillWorkerStub, "decode": decode_pb2_grpc.DecodeWorkerStub}
# A restarted worker on the same address must be found again quickly, not after grpc's 120 s backoff.
_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
_SERVING = health_pb2.HealthCheckResponse.SERVING


class NoWorker(Exception):
    """No worker of the role (offering the engine) is up: the request ends UNAVAILABLE."""


def parse_engines(text: str) -> tuple[tuple[str, ...], bool]:
    """WorkerStats.engine -> (engine names, complete). "fp8,bf16,mtp" lists what the worker offers
    (first = its default): complete. A single name is only its default: others unknown."""
    names = tuple(e for e in re.split(r"[\s,]+", text.strip().lower()) if e)
    return names, len(names) > 1 or "," in text


@dataclass(eq=False)
class Worker:
    role: str  # "prefill" | "decode"
    address: str  # host:port, also what the prefill worker dials as decode_target
    channel: grpc.Channel
    stub: Any  # PrefillWorkerStub | DecodeWorkerStub
    health: health_pb2_grpc.HealthStub
    source: str = "static"  # "static" | "ray"
    up: bool = False
    seen: bool = False  # has answered SERVING at least once
    late: int = 0  # consecutive health checks past their deadline
    unseen_note: float = 0.0  # never up yet: when its "not up yet" line is next due (probe)
    last_answer: float = 0.0  # monotonic time of its last answer to a request call (router.calls)
    full_at: int = 0  # decode: our requests on it when it last refused for full slots ...
    full_until: float = 0.0  # ... and until when that keeps new requests off it (router.session)
    outstanding: int = 0  # requests holding a lease
    last_pick: int = 0  # tie-break: least recently picked first
    engines: tuple[str, ...] = ()  # decode: engines it reported (first = its default)
    engines_complete: bool = False  # True: `engines` is all it offers; False: others may exist
    max_len: int = 0  # window reported by GetStats; 0 = unknown
    slots: int = 0  # sessions it holds at once (WorkerStats.slots: per runner; a session takes one); 0 = unknown
    prefill_piece: int = 0  # prefill: the tokens of a prompt's pieces (WorkerStats.prefill_piece); 0 = unknown
    fingerprint: str = ""
    prefill_stream: bool = True  # prefill: answers PrefillStream (False once it said UNIMPLEMENTED: Prefill)
    draft_only_states: bool = False  # decode: its LoadState takes draft-only states (WorkerStats.draft_only_states)
    batchers: dict = field(default_factory=dict)  # method -> router.batcher.RoundBatcher (DraftMany, VerifyMany)

    def offers(self, engine: str | None) -> bool:
        """Known to offer it, or might (incomplete list)."""
        return engine is None or engine in self.engines or not self.engines_complete


class Registry:
    def __init__(
        self,
        settings: Settings,
        *,
        prefill: Iterable[str] = (),
        decode: Iterable[str] = (),
        ray_namespace: str | None = None,
        poll_interval: float = 0.5,
        check_timeout: float = 0.3,
        ray_every: float = 2.0,
        busy_s: float = 2.0,
        on_change: Callable[[bool, int, int], None] | None = None,
    ):
        self.settings = settings
        self.poll_interval, self.check_timeout, self.busy_s = poll_interval, check_timeout, busy_s
        self.ray_namespace, self.ray_every = ray_namespace, ray_every
        self.on_change = on_change
        self._lock = threading.Lock()
        self._workers: dict[str, list[Worker]] = {r: [] for r in ROLES}
        self._seq = itertools.count(1)
        self._last_summary: tuple[bool, int, int] | None = None
        self._publish_lock = threading.Lock()  # on_change calls happen in summary order
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pool = futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="baton-health")
        self._last_ray = 0.0
        # Ray discovery runs on its own thread: a slow or hung GCS call must never delay health probes
        # (it did: under CPU load a blocked discovery kept a dead decode actor "up" for 30 s)
        self._ray_pool = futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="baton-ray-sync")
        self._ray_future: futures.Future | None = None
        for addr in prefill:
            self.add("prefill", addr)
        for addr in decode:
            self.add("decode", addr)

    # ---- membership ------------------------------------------------------------------------------
    def add(self, role: str, address: str, source: str = "static") -> Worker:
        if role not in ROLES:
            raise ValueError(f"role: {role!r} is not one of {ROLES}")
        with self._lock:
            for w in self._workers[role]:
                if w.address == address:
                    return w
            ch = make_channel(address, self.settings, options=_CHANNEL_OPTIONS)
            w = Worker(role, address, ch, _STUBS[role](ch), health_pb2_grpc.HealthStub(ch), source)
            self._workers[role].append(w)
        log.info("worker added: %s %s (%s)", role, address, source)
        return w

    def remove(self, worker: Worker) -> None:
        with self._lock:
            if worker in self._workers[worker.role]:
                self._workers[worker.role].remove(worker)
        worker.up = False
        worker.channel.close()
        log.info("worker removed: %s %s", worker.role, worker.address)

    def workers(self, role: str) -> list[Worker]:
        with self._lock:
            return list(self._workers[role])

    def up(self, role: str) -> list[Worker]:
        return [w for w in self.workers(role) if w.up]

    @property
    def serving(self) -> bool:
        return bool(self.up("prefill")) and bool(self.up("decode"))

    # ---- choice ----------------------------------------------------------------------------------
    def pick(
        self,
        role: str,
        engine: str | None = None,
        exclude: Iterable[Worker] = (),
        affinity: Hashable = None,
        slack: int | None = None,
    ) -> Worker:
        """Least outstanding work among up workers (offering `engine`), least recently picked on ties. With an
        `affinity` key, the up worker that key hashes highest with instead (rendezvous hashing: every call of
        one key goes to one worker while the set is the same), whatever the load: the choices of one
        prompt (start_session's equal_prompts) meet on one prefill worker, which computes it once. slack:
        the affinity's worker only while it has at most `slack` more calls in flight than the least loaded
        (a prompt's cached prefix is worth a short wait, not a hot spot)."""
        skip = set(map(id, exclude))
        with self._lock:
            cands = [w for w in self._workers[role] if w.up and id(w) not in skip and w.offers(engine)]
            if not cands:
                what = f"{role} worker" + (f" offering engine {engine}" if engine else "")
                raise NoWorker(f"no {what} is available")
            # workers known to offer the engine first, then least outstanding, then least recently picked
            least = min(
                cands, key=lambda c: (engine is not None and engine not in c.engines, c.outstanding, c.last_pick)
            )
            w = least
            if affinity is not None:
                w = max(cands, key=lambda c: (engine is None or engine in c.engines, hash((affinity, c.address))))
                if slack is not None and w.outstanding > least.outstanding + slack:
                    w = least
            w.last_pick = next(self._seq)
            return w

    def wait_pick(self, role: str, engine: str | None, exclude: Iterable[Worker], timeout: float) -> Worker:
        """pick(), waiting up to `timeout` s for a worker to come up (e.g. a restarting actor)."""
        exclude = list(exclude)
        end = time.monotonic() + max(0.0, timeout)
        while True:
            try:
                return self.pick(role, engine, exclude)
            except NoWorker:
                if time.monotonic() >= end or self._stop.wait(0.05):
                    raise

    @contextmanager
    def lease(self, worker: Worker):
        with self._lock:
            worker.outstanding += 1
        try:
            yield worker
        finally:
            with self._lock:
                worker.outstanding -= 1

    def mark_down(self, worker: Worker) -> None:
        if worker.up:
            log.warning("worker down: %s %s", worker.role, worker.address)
        worker.up = False
        self._publish()

    def engines(self) -> set[str]:
        """Engines up decode workers reported (all of them when engines_known())."""
        return {e for w in self.up("decode") for e in w.engines}

    def engines_known(self) -> bool:
        """True when every up decode worker reported its complete engine list."""
        return all(w.engines_complete for w in self.up("decode"))

    def max_context(self, default: int) -> int:
        """The smallest window among up workers that reported one (`default` when none did)."""
        lens = [w.max_len for r in ROLES for w in self.up(r) if w.max_len]
        return min(lens) if lens else default

    def prefill_piece(self, default: int) -> int:
        """The smallest piece among up prefill workers that reported one (`default` when none did): prompts
        that share their first this many tokens share prefix-cache entries (router/session.py prefix_affinity)."""
        pieces = [w.prefill_piece for w in self.up("prefill") if w.prefill_piece]
        return min(pieces) if pieces else default

    def capacity(self) -> int:
        """Sessions the up workers can hold at once: the smaller of the prefill and the decode workers' summed
        slots (a request holds one of each while it starts); 0 when a role has none that reported its slots."""
        sums = [sum(w.slots for w in self.up(r)) for r in ROLES]
        return min(sums) if all(sums) else 0

    def fingerprint(self) -> str:
        return next((w.fingerprint for w in self.up("prefill") + self.up("decode") if w.fingerprint), "")

    # ---- health ----------------------------------------------------------------------------------
    def probe(self, worker: Worker) -> bool:
        """One Check("") now; updates worker.up (and learns its stats on a down->up edge).

        NOTE: an up worker is marked down at once on NOT_SERVING or a failed connection, but only after
        two consecutive late answers (one slow check under CPU load is not a death), and not while it
        answered a request call within `busy_s` (busy, not hung: under load its health checks queue
        behind real work, and marking it down turned every new request into UNAVAILABLE). A frozen
        worker stops answering anything: down after busy_s at most; its in-flight calls are caught by
        router.calls' timeouts. A worker never seen up gets a longer first deadline: it includes
        connection set-up."""
        timeout = self.check_timeout if worker.seen else max(self.check_timeout, 2.0)
        try:
            resp = worker.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
            ok, worker.late = resp.status == _SERVING, 0
        except grpc.RpcError as e:
            ok = False
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and worker.up:
                worker.late += 1
                ok = worker.late < 2 or time.monotonic() - worker.last_answer < self.busy_s
            elif not worker.seen and time.monotonic() >= worker.unseen_note:  # a wrong address says so
                worker.unseen_note = time.monotonic() + UNSEEN_NOTE_S
                log.warning("worker not up yet: %s %s: %s: %s", worker.role, worker.address, e.code().name, e.details())
        if ok and not worker.up:
            self._learn(worker)
            log.info("worker up: %s %s engines=%s", worker.role, worker.address, ",".join(worker.engines))
        elif not ok and worker.up:
            log.warning("worker down: %s %s", worker.role, worker.address)
        changed, worker.up = worker.up != ok, ok
        worker.seen |= ok
        if changed and self._thread is not None:
            self._publish()
        return ok

    def _learn(self, worker: Worker) -> None:
        try:
            st = worker.stub.GetStats(common_pb2.WorkerStatsRequest(), timeout=max(1.0, self.check_timeout))
        except grpc.RpcError as e:
            log.warning("GetStats %s failed: %s", worker.address, e.code().name)
            return
        if worker.role == "decode":
            # WorkerStats.engines lists all it offers, even one; a worker without it: its `engine` text
            worker.engines, worker.engines_complete = (
                (tuple(st.engines), True) if st.engines else parse_engines(st.engine)
            )
            worker.draft_only_states = st.draft_only_states
        worker.max_len, worker.fingerprint = int(st.max_len), st.model_fingerprint
        worker.slots = int(st.slots)
        worker.prefill_piece = int(st.prefill_piece) if worker.role == "prefill" else 0

    def poll_once(self) -> None:
        due = self.ray_namespace and time.monotonic() - self._last_ray >= self.ray_every
        if due and (self._ray_future is None or self._ray_future.done()):
            self._last_ray = time.monotonic()
            if self._thread is None:  # start(): synchronous, so the pools are filled before serving
                self._sync_ray()
            else:
                self._ray_future = self._ray_pool.submit(self._sync_ray)
        everyone = self.workers("prefill") + self.workers("decode")
        list(self._pool.map(self.probe, everyone))
        self._publish()

    def _publish(self) -> None:
        with self._publish_lock:
            summary = (self.serving, len(self.up("prefill")), len(self.up("decode")))
            changed, self._last_summary = summary != self._last_summary, summary
            if changed and self.on_change is not None:
                self.on_change(*summary)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_interval):
            try:
                self.poll_once()
            except Exception:  # the poller must outlive any single bad round
                log.exception("health poll failed")

    def start(self) -> None:
        self.poll_once()
        self._thread = threading.Thread(target=self._run, name="baton-router-health", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._ray_pool.shutdown(wait=False, cancel_futures=True)
        for w in self.workers("prefill") + self.workers("decode"):
            w.channel.close()

    # ---- Ray -------------------------------------------------------------------------------------
    def _sync_ray(self) -> None:
        try:
            found = discover_ray_workers(self.ray_namespace)
        except Exception as e:  # Ray down or restarting: keep the pools we have
            log.warning("ray discovery failed: %s", e)
            return
        for role in ROLES:
            for addr in found[role]:
                self.add(role, addr, source="ray")
            for w in self.workers(role):
                if w.source == "ray" and w.address not in found[role]:
                    self.remove(w)


def discover_ray_workers(namespace: str, timeout: float = 5.0) -> dict[str, list[str]]:
    """Named Ray actors `baton-prefill-*` / `baton-decode-*` in `namespace` -> their `address()`.

    Joins the cluster (RAY_ADDRESS or a local one) when this process is not connected yet. Actors
    that do not answer within `timeout` (e.g. restarting) are left out of this round."""
    import ray

    if not ray.is_initialized():
        ray.init(address="auto", namespace=namespace, log_to_driver=False, logging_level=logging.WARNING)
    refs = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry.get("namespace") != namespace:
            continue
        name = entry["name"]
        role = next((r for r in ROLES if name.startswith(f"baton-{r}-")), None)
        if role is not None:
            try:
                refs[ray.get_actor(name, namespace=namespace).address.remote()] = role
            except ValueError:  # the actor died between listing and lookup
                continue
    found: dict[str, list[str]] = {r: [] for r in ROLES}
    ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout) if refs else ([], [])
    for ref in ready:
        try:
            found[refs[ref]].append(str(ray.get(ref)))
        except Exception as e:  # an actor that raised is treated as absent
            log.warning("ray actor address() failed: %s", e)
    for addrs in found.values():
        addrs.sort()
    return found
