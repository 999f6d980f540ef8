"""Process settings: the ONE place Baton reads environment variables.

    BATON_TOKEN               shared bearer token (takes precedence over BATON_TOKEN_FILE)
    BATON_TOKEN_FILE          path to a file holding the token (surrounding whitespace stripped)
    BATON_TLS_CERT            server/client certificate chain, PEM path
    BATON_TLS_KEY             private key for BATON_TLS_CERT, PEM path
    BATON_TLS_CA              CA bundle, PEM path: servers require client certs signed by it;
                              clients verify the server with it
    BATON_HOST                bind host, default 127.0.0.1 (never 0.0.0.0 unless asked)
    BATON_MAX_MESSAGE_BYTES   gRPC send/receive limit, default 64 MiB
    BATON_MAX_REQUEST_BYTES   the router's public port: largest message it receives, default 4 MiB (capped at
                              BATON_MAX_MESSAGE_BYTES); workers keep BATON_MAX_MESSAGE_BYTES for state chunks
    BATON_KEEPALIVE_TIME_MS   clients: ping an idle connection this often, default 30000
    BATON_KEEPALIVE_TIMEOUT_MS  clients: close a connection whose ping is unanswered this long, default 10000
    BATON_MIN_PING_INTERVAL_MS  servers: the shortest interval between a client's pings they accept (shorter:
                              a strike; 2 strikes: GOAWAY too_many_pings), default 10000; at most
                              BATON_KEEPALIVE_TIME_MS, so a server accepts the pings of its own clients
    BATON_LOG_LEVEL           DEBUG | INFO | WARNING | ERROR | CRITICAL (any case), default INFO
    BATON_LOG_JSON            1/true/yes/on = one JSON object per log line (baton/logs.py)
    BATON_HANDOFF_SENDER      who streams a prefill worker's state hand-offs: "process" (default: a
                              sender child process, baton/handoff/sender/process.py) | "thread" (in the
                              prefill's own process, gRPC's and the wire's threads)
    BATON_HANDOFF_TAIL_CHUNK_BYTES  the state wire's tail segment (format 4): the last layers' bytes go in
                              chunks of this many bytes (at most the worker's chunk size); 0: none;
                              default 1 MiB (DEFAULT_TAIL_CHUNK_BYTES)
    BATON_HANDOFF_TAIL_LAYERS how many of the last decoder layers (with what follows them: hidden, MTP KV)
                              the tail segment covers; default 1
    BATON_HANDOFF_RING_SLOTS  the sender process's shared-memory ring: slots of one chunk each (4 MiB);
                              half as many hand-offs stage at once; default 32 (DEFAULT_RING_SLOTS, 128 MiB)
    BATON_STREAM_MESSAGES_PER_S  a decode worker's Decode streams send about this many messages a second at
                              most, together: under load a run-ahead stream's tokens group into fewer
                              messages (decode_worker/pacing.py); 0: one message per step; default
                              DEFAULT_STREAM_MESSAGES_PER_S
    BATON_SWITCH_INTERVAL_US  a worker process's GIL switch interval (sys.setswitchinterval), microseconds:
                              how long a thread that wants the GIL back waits before it asks the holder to
                              give it up; default DEFAULT_SWITCH_INTERVAL_US (CPython's own is 5000)
    BATON_GPU_WORKERS, BATON_GPU_PLAN  set by `baton serve` where it places several workers on one GPU: how
                              many, and this worker's file in that GPU's plan folder; each then sizes its
                              KV pages from an equal share of what the workers' fixed needs leave
                              (baton/engine/gpu_plan.py); default 1 and none: alone, from free memory

Other modules take a `Settings` object; tests build one with `Settings(...)` or
`Settings.from_env({}, token="t")` and never touch os.environ.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

DEFAULT_HOST = "127.0.0.1"
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# The router's public port: a 262K-token prompt is ~1 MB of packed ids; a message near 64 MiB cost ~10x its
# size in RSS while grpc and protobuf parsed it (issue 24).
DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024
DEFAULT_KEEPALIVE_TIME_MS = 30_000
DEFAULT_KEEPALIVE_TIMEOUT_MS = 10_000
DEFAULT_MIN_PING_INTERVAL_MS = 10_000
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}
HANDOFF_SENDERS = ("process", "thread")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
# The last layer's state in 1 MiB chunks: the final chunk's hashing on both ends is then short
# (benchmarks/results/2026-11-30-h200-s6.md has the TTFT with and without).
DEFAULT_TAIL_CHUNK_BYTES = 1 << 20
# The sender process's ring (slots of one 4 MiB chunk; slots / 2 hand-offs stage at once). With 8 slots a
# co-located H200 under steady load (serve-steady, 64 streams) waited 2.7 s p50 from a request's first token to
# its state landing; with 32, 0.64 s (benchmarks/results/gpu-h200-2026-12-03-ring.md).
DEFAULT_RING_SLOTS = 32
# A worker's step / pass thread gives the GIL up at every torch call and waits to get it back behind the
# gRPC threads (tokens out, state chunks in). CPython's own 5 ms: 500 and 100 us were no better for the decode
# steps and slowed the prefill's passes (benchmarks/results/gpu-h200-2026-12-03-phases.md).
DEFAULT_SWITCH_INTERVAL_US = 5000
# Each Decode message costs the decode worker ~100-160 us under the GIL on a 2-core VM, whatever its tokens
# (benchmarks/results/stream-messages-cpu-2026-12-03.json). A budget of 2,000 a second cut the step thread's
# launch phase on the H200 (47% -> 36% at 32 streams) but not its tok/s (2,021 against 2,319 at 32, 2,870
# against 2,876 at 64; benchmarks/results/gpu-h200-2026-12-03-paced.md): off by default, the knob kept.
DEFAULT_STREAM_MESSAGES_PER_S = 0


_POSITIVE_INTS = (  # (field, variable, default): the gRPC transport's settings, the GIL's switch interval
    ("max_request_bytes", "BATON_MAX_REQUEST_BYTES", DEFAULT_MAX_REQUEST_BYTES),
    ("keepalive_time_ms", "BATON_KEEPALIVE_TIME_MS", DEFAULT_KEEPALIVE_TIME_MS),
    ("keepalive_timeout_ms", "BATON_KEEPALIVE_TIMEOUT_MS", DEFAULT_KEEPALIVE_TIMEOUT_MS),
    ("min_ping_interval_ms", "BATON_MIN_PING_INTERVAL_MS", DEFAULT_MIN_PING_INTERVAL_MS),
    ("switch_interval_us", "BATON_SWITCH_INTERVAL_US", DEFAULT_SWITCH_INTERVAL_US),
    ("gpu_workers", "BATON_GPU_WORKERS", 1),
)


class SettingsError(ValueError):
    """A setting is malformed (the message names the variable)."""


def read_token_file(path: str | os.PathLike) -> str:
    """Token stored in `path`, surrounding whitespace stripped. Refuses an empty token."""
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except OSError as e:
        raise SettingsError(f"BATON_TOKEN_FILE: cannot read {path}: {e.strerror}") from e
    if not token:
        raise SettingsError(f"BATON_TOKEN_FILE: {path} holds an empty token")
    return token


def _parse_bool(name: str, raw: str) -> bool:
    val = raw.strip().lower()
    if val in _TRUE:
        return True
    if val in _FALSE:
        return False
    raise SettingsError(f"{name}: expected a boolean (1/0, true/false), got {raw!r}")


def _parse_int(name: str, raw: str, minimum: int) -> int:
    try:
        val = int(raw.strip())
    except ValueError:
        raise SettingsError(f"{name}: expected an integer, got {raw!r}") from None
    if val < minimum:
        raise SettingsError(f"{name}: must be {'> 0' if minimum == 1 else f'>= {minimum}'}, got {val}")
    return val


def _parse_positive_int(name: str, raw: str) -> int:
    return _parse_int(name, raw, 1)


@dataclass(frozen=True)
class Settings:
    token: str | None = None  # None = auth disabled
    tls_cert: str | None = None  # PEM path; TLS is on when tls_cert and tls_key are both set
    tls_key: str | None = None
    tls_ca: str | None = None  # PEM path; server: require client certs; client: trust roots
    host: str = DEFAULT_HOST
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    log_level: str = "INFO"
    log_json: bool = False
    handoff_sender: str = "process"  # HANDOFF_SENDERS
    handoff_tail_chunk_bytes: int = DEFAULT_TAIL_CHUNK_BYTES  # 0: no tail segment; capped at the chunk size
    handoff_tail_layers: int = 1
    handoff_ring_slots: int = DEFAULT_RING_SLOTS  # >= 2
    switch_interval_us: int = DEFAULT_SWITCH_INTERVAL_US  # workers' sys.setswitchinterval, > 0
    gpu_workers: int = 1  # workers sharing this worker's GPU (KV sizing: baton/engine/gpu_plan.py)
    gpu_plan: str | None = None  # this worker's file in its GPU's plan folder (baton/engine/gpu_plan.py)
    stream_messages_per_s: int = DEFAULT_STREAM_MESSAGES_PER_S  # decode worker, >= 0 (0: no grouping)
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # the router's public port only (baton.rpc max_receive_bytes)
    keepalive_time_ms: int = DEFAULT_KEEPALIVE_TIME_MS  # clients (baton.rpc.make_channel)
    keepalive_timeout_ms: int = DEFAULT_KEEPALIVE_TIMEOUT_MS
    min_ping_interval_ms: int = DEFAULT_MIN_PING_INTERVAL_MS  # servers (baton.rpc.build_server)

    def __post_init__(self) -> None:
        if self.token is not None and not self.token.strip():
            raise SettingsError("BATON_TOKEN: empty token (unset it to disable auth)")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise SettingsError("BATON_TLS_CERT and BATON_TLS_KEY must be set together")
        if self.max_message_bytes <= 0:
            raise SettingsError("BATON_MAX_MESSAGE_BYTES: must be > 0")
        if self.log_level not in LOG_LEVELS:
            raise SettingsError(f"BATON_LOG_LEVEL: expected one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        if self.handoff_sender not in HANDOFF_SENDERS:
            raise SettingsError(
                f"BATON_HANDOFF_SENDER: expected one of {', '.join(HANDOFF_SENDERS)}, got {self.handoff_sender!r}"
            )
        if not isinstance(self.handoff_tail_chunk_bytes, int) or self.handoff_tail_chunk_bytes < 0:
            raise SettingsError(
                f"BATON_HANDOFF_TAIL_CHUNK_BYTES: must be >= 0 (0: no tail segment), "
                f"got {self.handoff_tail_chunk_bytes!r}"
            )
        if not isinstance(self.handoff_tail_layers, int) or self.handoff_tail_layers < 0:
            raise SettingsError(f"BATON_HANDOFF_TAIL_LAYERS: must be >= 0, got {self.handoff_tail_layers!r}")
        if not isinstance(self.stream_messages_per_s, int) or self.stream_messages_per_s < 0:
            raise SettingsError(f"BATON_STREAM_MESSAGES_PER_S: must be >= 0, got {self.stream_messages_per_s!r}")
        if not isinstance(self.handoff_ring_slots, int) or self.handoff_ring_slots < 2:
            raise SettingsError(f"BATON_HANDOFF_RING_SLOTS: must be >= 2, got {self.handoff_ring_slots!r}")
        for name, val in (
            ("BATON_MAX_REQUEST_BYTES", self.max_request_bytes),
            ("BATON_KEEPALIVE_TIME_MS", self.keepalive_time_ms),
            ("BATON_KEEPALIVE_TIMEOUT_MS", self.keepalive_timeout_ms),
            ("BATON_MIN_PING_INTERVAL_MS", self.min_ping_interval_ms),
            ("BATON_SWITCH_INTERVAL_US", self.switch_interval_us),
            ("BATON_GPU_WORKERS", self.gpu_workers),
        ):
            if not isinstance(val, int) or val <= 0:
                raise SettingsError(f"{name}: must be > 0, got {val!r}")
        if self.min_ping_interval_ms > self.keepalive_time_ms:
            raise SettingsError(
                f"BATON_MIN_PING_INTERVAL_MS ({self.min_ping_interval_ms}) must be at most "
                f"BATON_KEEPALIVE_TIME_MS ({self.keepalive_time_ms}): servers would send GOAWAY "
                f"too_many_pings to their own clients"
            )

    @property
    def tls_enabled(self) -> bool:
        """Server side: serve TLS. (Clients use TLS when tls_ca or tls_cert is set.)"""
        return self.tls_cert is not None and self.tls_key is not None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides) -> "Settings":
        """Settings from `env` (default os.environ); keyword `overrides` win over the environment.

        An override of None means "not given" (handy for optional CLI flags); use
        `.replace(field=None)` to clear a field explicitly.
        """
        env = os.environ if env is None else env

        def get(name: str) -> str | None:
            val = env.get(name)
            return val if val not in (None, "") else None

        token = get("BATON_TOKEN")
        if token is not None:
            token = token.strip()
        elif get("BATON_TOKEN_FILE") is not None:
            token = read_token_file(get("BATON_TOKEN_FILE"))
        values = dict(
            token=token,
            tls_cert=get("BATON_TLS_CERT"),
            tls_key=get("BATON_TLS_KEY"),
            tls_ca=get("BATON_TLS_CA"),
            host=get("BATON_HOST") or DEFAULT_HOST,
            max_message_bytes=(
                _parse_positive_int("BATON_MAX_MESSAGE_BYTES", get("BATON_MAX_MESSAGE_BYTES"))
                if get("BATON_MAX_MESSAGE_BYTES") is not None
                else DEFAULT_MAX_MESSAGE_BYTES
            ),
            log_level=(get("BATON_LOG_LEVEL") or "INFO").upper(),
            log_json=_parse_bool("BATON_LOG_JSON", get("BATON_LOG_JSON") or ""),
            handoff_sender=(get("BATON_HANDOFF_SENDER") or "process").strip().lower(),
            gpu_plan=get("BATON_GPU_PLAN") or None,
            handoff_tail_chunk_bytes=_parse_int(
                "BATON_HANDOFF_TAIL_CHUNK_BYTES",
                get("BATON_HANDOFF_TAIL_CHUNK_BYTES") or str(DEFAULT_TAIL_CHUNK_BYTES),
                0,
            ),
            handoff_tail_layers=_parse_int("BATON_HANDOFF_TAIL_LAYERS", get("BATON_HANDOFF_TAIL_LAYERS") or "1", 0),
            stream_messages_per_s=_parse_int(
                "BATON_STREAM_MESSAGES_PER_S",
                get("BATON_STREAM_MESSAGES_PER_S") or str(DEFAULT_STREAM_MESSAGES_PER_S),
                0,
            ),
            handoff_ring_slots=_parse_int(
                "BATON_HANDOFF_RING_SLOTS", get("BATON_HANDOFF_RING_SLOTS") or str(DEFAULT_RING_SLOTS), 2
            ),
            **{
                field: _parse_positive_int(var, get(var)) if get(var) is not None else default
                for field, var, default in _POSITIVE_INTS
            },
        )
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(overrides) - fields
        if unknown:
            raise TypeError(f"unknown Settings field(s): {sorted(unknown)}")
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    def replace(self, **changes) -> "Settings":
        return dataclasses.replace(self, **changes)
