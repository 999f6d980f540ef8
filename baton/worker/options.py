"""WorkerOptions: what a prefill or decode worker is configured with (frozen), and its defaults.

dtype default: bf16 on cuda, fp32 on cpu (both roles). Settings (baton.settings, the one place env vars
are read) come with them: settings_for(token_file)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Mapping

from baton.engine.pages import DEFAULT_GPU_MEMORY_FRACTION
from baton.engine.runner import DEFAULT_MAX_LEN, DEFAULT_WIDTH
from baton.settings import Settings, read_token_file

log = logging.getLogger("baton.worker")

DEFAULT_SLOTS = 8
DEFAULT_TTL_S = 300.0
DEFAULT_GRACE_S = 5.0


def default_dtype(device: str) -> str:
    """bf16 on cuda, fp32 on cpu: the same rule on both workers and `baton complete` (exactness)."""
    return "bf16" if str(device).startswith("cuda") else "fp32"


@dataclass(frozen=True)
class WorkerOptions:
    model: str | None
    port: int = 0
    host: str | None = None  # None = settings.host (127.0.0.1 unless BATON_HOST says otherwise)
    device: str = "cpu"
    dtype: str | None = None  # None = default_dtype(device)
    width: int = DEFAULT_WIDTH
    max_len: int = DEFAULT_MAX_LEN  # NOTE: must equal the other worker's and `baton complete`'s
    slots: int = DEFAULT_SLOTS
    ttl_s: float = DEFAULT_TTL_S
    token_file: str | None = None
    grace_s: float = DEFAULT_GRACE_S
    kv_pages: int | None = None  # None: sized from gpu_memory_fraction on cuda, slots x window on cpu
    gpu_memory_fraction: float = DEFAULT_GPU_MEMORY_FRACTION

    @property
    def resolved_dtype(self) -> str:
        return self.dtype or default_dtype(self.device)


def settings_for(token_file: str | None = None, env: Mapping[str, str] | None = None) -> Settings:
    """Settings from the environment; a --token-file wins over BATON_TOKEN / BATON_TOKEN_FILE."""
    return Settings.from_env(env, token=read_token_file(token_file) if token_file else None)
