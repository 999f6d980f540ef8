"""Fake prefill / decode workers for router unit tests: real gRPC servers on loopback, no model.

The "model" is a formula over the token context, so every test knows the exact output:
    exact_next(ctx)   the exact engine's greedy token (Prefill, Verify, the bf16 engine)
    draft_next(ctx)   fp8 / mtp drafts: equal to exact_next except at some positions (rejections)
    reference(prompt, n, ...)  what exact greedy decoding emits (stop ids / EOS inclusive)

A session is (ctx = consumed tokens, pending = next token to feed). The state "hand-off" is a real
LoadState client stream from the fake prefill to the fake decode worker: a header, the context as
uint32 bytes, a trailer. Knobs (plain attributes) make a fake fail, die (server stopped: clients see
UNAVAILABLE), or hang at a given point; GetStats.sessions counts live sessions.
"""

from __future__ import annotations

import array
import threading
import time

import grpc

from baton import rpc
from baton.settings import Settings
from baton.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc, state_pb2

VOCAB = 100
EOS = 99
SAY_EOS = 98  # a prompt holding this token makes the model emit EOS where len(ctx) % 5 == 0
WIDTH = 16


def exact_next(ctx: list[int]) -> int:
    if SAY_EOS in ctx and len(ctx) % 5 == 0:
        return EOS
    return (31 * ctx[-1] + 17 * len(ctx)) % 97 + 1  # 1..97


def draft_next(ctx: list[int], engine: str) -> int:
    t = exact_next(ctx)
    h = 13 * ctx[-1] + len(ctx)
    wrong = {"fp8": h % 4 == 0, "mtp": h % 3 == 0}.get(engine, False)
    return (t % 97) + 1 if wrong else t  # a different token in 1..97


def reference(prompt, n: int, stop=(), eos: bool = True, engine: str = "exact") -> list[int]:
    ctx, out = list(prompt), []
    while len(out) < n:
        t = exact_next(ctx) if engine in ("exact", "bf16") else draft_next(ctx, engine)
        out.append(t)
        ctx.append(t)
        if t in stop or (eos and t == EOS):
            break
    return out


class _Base:
    def __init__(self):
        self.sessions: dict[str, dict] = {}
        self.lock = threading.Lock()
        self.calls: list[tuple[str, object]] = []
        self.handle: rpc.ServerHandle | None = None
        self.delay = 0.0  # seconds per produced token / per call
        self.hang: set[str] = set()  # method names that hang until cancelled
        self.fail: dict[str, grpc.StatusCode | tuple] = {}  # method -> status [, message] of its next call
        self.die_on: dict[str, int] = {}  # method -> die at its n-th call (1-based) from now
        self.freeze_after: int | None = None  # Decode: stop sending (until cancelled) after n tokens

    def _enter(self, method: str, request, context):
        self.calls.append((method, request))
        if method in self.die_on:
            self.die_on[method] -= 1
            if self.die_on[method] <= 0:
                del self.die_on[method]
                self.die(context)
        code = self.fail.pop(method, None)
        if code is not None:
            code, msg = code if isinstance(code, tuple) else (code, f"fake {method} failure")
            context.abort(code, msg)
        if method in self.hang:
            while context.is_active():
                time.sleep(0.01)
            context.abort(grpc.StatusCode.CANCELLED, "hung call cancelled")
        if self.delay:
            time.sleep(self.delay)

    def die(self, context=None):
        """Stops the server at once (like SIGKILL for the peers), ending the current call UNAVAILABLE."""
        threading.Thread(target=self.handle.stop, args=(0,), daemon=True).start()
        with self.lock:
            self.sessions.clear()
        if context is not None:
            time.sleep(0.05)
            context.abort(grpc.StatusCode.UNAVAILABLE, "worker died")

    def Release(self, request, context):
        with self.lock:
            gone = self.sessions.pop(request.session_id, None)
        return common_pb2.ReleaseResponse(released=gone is not None)

    def GetStats(self, request, context):
        return common_pb2.WorkerStats(
            sessions=len(self.sessions), engine=self.engine_text, max_len=self.max_len, model_fingerprint="fake-fp"
        )


def _push_state(target: str, settings: Settings, sid: str, ctx, pending: int, mode, engine, timeout):
    data = array.array("I", ctx).tobytes()
    chunks = [
        state_pb2.StateChunk(
            header=state_pb2.StateHeader(
                session_id=sid,
                position=len(ctx),
                total_bytes=len(data),
                mode=mode,
                engine=engine,
                model_fingerprint="fake-fp",
            )
        ),
        state_pb2.StateChunk(data=data),
        state_pb2.StateChunk(trailer=state_pb2.StateTrailer(total_bytes=len(data), data_chunks=1, next_token=pending)),
    ]
    with rpc.make_channel(target, settings) as ch:
        t0 = time.perf_counter()
        decode_pb2_grpc.DecodeWorkerStub(ch).LoadState(iter(chunks), timeout=timeout)
    return common_pb2.BridgeReport(seconds=time.perf_counter() - t0, total_bytes=len(data), tokens=len(ctx), chunks=1)


class FakePrefill(_Base, prefill_pb2_grpc.PrefillWorkerServicer):
    engine_text = ""

    def __init__(self, settings: Settings, max_len: int = 4096):
        super().__init__()
        self.settings, self.max_len = settings, max_len

    early = False  # PrefillStream sends the first token before the hand-off (the real worker's early first token)
    fail_after_first: grpc.StatusCode | None = None  # with early: the next hand-off fails after the first token
    queued_s = 0.0  # with early: the prompt waits this long before its first token (heartbeats if asked)
    heartbeats = True  # False: a worker that sends none however asked (an older build)

    def Prefill(self, request, context):
        *_, last = self._prefill(request, context, early=False)
        return last

    def PrefillStream(self, request, context):
        """As the real worker: with `early`, the first token first (no bridge), then the whole answer once the
        hand-off is done (or its failure, `fail_after_first`); else the whole answer alone. Logged as "Prefill"."""
        if not self.early:  # through Prefill: a test's override of it (tests/router/test_start_session.py) holds
            yield self.Prefill(request, context)
            return
        yield from self._prefill(request, context, early=True)

    def _prefill(self, request, context, early: bool):
        self._enter("Prefill", request, context)
        ctx = list(request.prompt_ids)
        if not ctx:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt_ids: empty prompt")
        first = exact_next(ctx)
        end = time.monotonic() + (self.queued_s if early else 0.0)
        while time.monotonic() < end:  # queued behind other prompts: the real worker's heartbeats
            time.sleep(min(request.heartbeat_ms / 1e3 or 1.0, max(0.0, end - time.monotonic())))
            if request.heartbeat_ms and self.heartbeats and time.monotonic() < end:
                yield prefill_pb2.PrefillResponse(heartbeat=True)
        if request.mode == common_pb2.EXACT:
            with self.lock:
                self.sessions[request.session_id] = {"ctx": ctx, "pending": first}
        if early and request.decode_target:
            yield prefill_pb2.PrefillResponse(first_token=first, prompt_tokens=len(ctx))
            with self.lock:
                fail, self.fail_after_first = self.fail_after_first, None
            if fail is not None:
                context.abort(fail, f"decode_target {request.decode_target}: hand-off failed: {fail.name}")
        try:
            bridge = _push_state(
                request.decode_target,
                self.settings,
                request.session_id,
                ctx,
                first,
                request.mode,
                request.engine,
                context.time_remaining(),
            )
        except grpc.RpcError as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"decode_target: hand-off failed: {e.code().name}")
        yield prefill_pb2.PrefillResponse(first_token=first, bridge=bridge, prompt_tokens=len(ctx))

    def _session(self, sid, context):
        s = self.sessions.get(sid)
        if s is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"session_id: unknown session {sid!r}")
        return s

    def Verify(self, request, context):
        self._enter("Verify", request, context)
        s = self._session(request.session_id, context)
        toks = list(request.tokens)
        K = len(toks) - 1
        if not 1 <= K < WIDTH or toks[0] != s["pending"]:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"tokens: bad block {toks} (pending {s['pending']})")
        greedy = [exact_next(s["ctx"] + toks[: i + 1]) for i in range(K + 1)]
        m = 0
        while m < K and toks[m + 1] == greedy[m]:
            m += 1
        s["ctx"] += toks[: m + 1]
        s["pending"] = greedy[m]
        return prefill_pb2.VerifyResponse(accepted=m, next_token=greedy[m], position=len(s["ctx"]))

    def ExportState(self, request, context):
        self._enter("ExportState", request, context)
        s = self._session(request.session_id, context)
        try:
            bridge = _push_state(
                request.decode_target,
                self.settings,
                request.target_session_id or request.session_id,
                s["ctx"],
                s["pending"],
                common_pb2.EXACT,
                0,
                context.time_remaining(),
            )
        except grpc.RpcError as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"decode_target: hand-off failed: {e.code().name}")
        return prefill_pb2.ExportStateResponse(bridge=bridge, position=len(s["ctx"]), next_token=s["pending"])


class FakeDecode(_Base, decode_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, settings: Settings, engines=("bf16", "fp8", "mtp"), max_len: int = 4096):
        super().__init__()
        self.engines, self.max_len = tuple(engines), max_len
        self.engine_text = ",".join(self.engines)

    def _engine(self, enum: int, context) -> str:
        name = {0: self.engines[0], 1: "bf16", 2: "fp8", 3: "mtp"}[enum]
        if name not in self.engines:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"engine: {name} not available")
        return name

    def LoadState(self, request_iterator, context):
        msgs = list(request_iterator)
        h = msgs[0].header
        ctx = list(array.array("I", msgs[1].data))
        self._enter("LoadState", h, context)
        with self.lock:
            self.sessions[h.session_id] = {
                "ctx": ctx,
                "pending": msgs[-1].trailer.next_token,
                "engine": self._engine(h.engine, context),
                "drafts": [],
            }
        return decode_pb2.LoadStateResponse(session_id=h.session_id, position=len(ctx))

    def _session(self, sid, context):
        s = self.sessions.get(sid)
        if s is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"session_id: unknown session {sid!r}")
        return s

    def Decode(self, request, context):
        self._enter("Decode", request, context)
        s = self._session(request.session_id, context)
        engine = self._engine(request.engine, context) if request.engine else s["engine"]
        stop = set(request.stop_token_ids) | (set() if request.ignore_eos else {EOS})
        n = 0
        try:
            while n < request.max_new_tokens:
                s["ctx"].append(s["pending"])
                t = exact_next(s["ctx"]) if engine == "bf16" else draft_next(s["ctx"], engine)
                s["pending"] = t
                n += 1
                if n == self.freeze_after:
                    while context.is_active():
                        time.sleep(0.01)
                    return
                if "Decode.token" in self.die_on:
                    self._enter("Decode.token", request, context)
                elif self.delay:
                    time.sleep(self.delay)
                done = t in stop or n == request.max_new_tokens
                reason = (
                    (
                        common_pb2.STOP
                        if t in request.stop_token_ids
                        else common_pb2.EOS
                        if t in stop
                        else common_pb2.LENGTH
                    )
                    if done
                    else 0
                )
                yield decode_pb2.DecodeResponse(token_ids=[t], finish_reason=reason)
                if t in stop:
                    return
        finally:
            if request.release_at_end:
                with self.lock:
                    self.sessions.pop(request.session_id, None)

    def Draft(self, request, context):
        self._enter("Draft", request, context)
        s = self._session(request.session_id, context)
        if not 1 <= request.k <= WIDTH - 2:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"k: {request.k} out of range")
        if request.has_verdict:
            s["ctx"] += [s["pending"]] + s["drafts"][: request.accepted]
            s["pending"] = request.next_token
        engine = self._engine(request.engine, context) if request.engine else s["engine"]
        c, drafts = s["ctx"] + [s["pending"]], []
        for _ in range(request.k):
            drafts.append(draft_next(c, engine))
            c.append(drafts[-1])
        s["drafts"] = drafts
        return decode_pb2.DraftResponse(draft_tokens=drafts, position=len(s["ctx"]))


class FakeWorker:
    """A fake servicer on its own loopback server (SERVING)."""

    def __init__(self, servicer, settings: Settings, port: int = 0):
        self.servicer, self.settings = servicer, settings
        if isinstance(servicer, FakePrefill):
            add, name = prefill_pb2_grpc.add_PrefillWorkerServicer_to_server, "baton.v1.PrefillWorker"
        else:
            add, name = decode_pb2_grpc.add_DecodeWorkerServicer_to_server, "baton.v1.DecodeWorker"
        self.handle = rpc.build_server(
            [(add, servicer)], service_names=[name], port=port, settings=settings, max_workers=16, serving=True
        )
        servicer.handle = self.handle
        self.address = self.handle.address

    @property
    def sessions(self) -> int:
        return len(self.servicer.sessions)

    def stop(self):
        self.handle.stop(0)


def prefill_worker(settings: Settings, port: int = 0, **kw) -> FakeWorker:
    return FakeWorker(FakePrefill(settings, **kw), settings, port)


def decode_worker(settings: Settings, port: int = 0, **kw) -> FakeWorker:
    return FakeWorker(FakeDecode(settings, **kw), settings, port)


class Cluster:
    """n fake prefill + m fake decode workers and an in-process router over loopback (health poll 0.1 s)."""

    def __init__(self, n_prefill=2, n_decode=2, *, token=None, config=None, engines=("bf16", "fp8", "mtp"), meta=None):
        from baton.client import Client
        from router.__main__ import serve_router
        from router.service import ModelMeta, RouterConfig

        self.settings = Settings(token=token)
        self.prefill = [prefill_worker(self.settings) for _ in range(n_prefill)]
        self.decode = [decode_worker(self.settings, engines=engines) for _ in range(n_decode)]
        config = config or RouterConfig(call_timeout_s=2.0, migrate_wait_s=1.0)
        self.handle, self.servicer = serve_router(
            prefill=[w.address for w in self.prefill],
            decode=[w.address for w in self.decode],
            meta=meta or ModelMeta("fake", VOCAB, (EOS,)),
            settings=self.settings,
            config=config,
            poll_interval=0.1,
        )
        self.address = self.handle.address
        self.client = Client(self.address, settings=self.settings)

    @property
    def workers(self):
        return self.prefill + self.decode

    def sessions(self) -> int:
        return sum(w.sessions for w in self.workers)

    def wait_up(self, timeout: float = 10.0) -> bool:
        """Until the router's registry has every worker up (its health poll: a fault marks a worker down until
        the next poll answers; on a loaded machine the first poll may come after the servers listen)."""
        reg, end = self.servicer.registry, time.monotonic() + timeout
        while time.monotonic() < end:
            if len(reg.up("prefill")) == len(self.prefill) and len(reg.up("decode")) == len(self.decode):
                return True
            time.sleep(0.02)
        return False

    def wait_sessions_zero(self, timeout: float = 2.0) -> bool:
        end = time.monotonic() + timeout
        while self.sessions() and time.monotonic() < end:
            time.sleep(0.02)
        return self.sessions() == 0

    def run(self, prompt, **kw):
        """-> (all token ids, list of deltas)."""
        deltas = list(self.client.generate(prompt, timeout=kw.pop("timeout", 10), **kw))
        return [t for d in deltas for t in d.token_ids], deltas

    def close(self):
        from router.__main__ import stop_router

        self.client.close()
        stop_router(self.handle, self.servicer, 0)
        for w in self.workers:
            w.stop()
