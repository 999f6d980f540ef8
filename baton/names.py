"""Proto enums <-> names, the one mapping (no torch).

Vocabulary: an *engine name* is "bf16" | "fp8" | "mtp", the decode path a session runs on; an *engine
value* is the proto `Engine` enum carrying it on the wire (ENGINE_UNSPECIFIED = the worker's default).
Values are turned into names at the RPC boundary, and only names travel inward. DecodeEngine and
ExactEngine are the classes that run sessions; variables holding them are called `engine` only inside
their own worker. Modes: "fast" | "exact" (MODE_UNSPECIFIED = fast).
"""

from __future__ import annotations

from baton.v1 import common_pb2

ENGINE_NAMES = {common_pb2.BF16: "bf16", common_pb2.FP8: "fp8", common_pb2.MTP: "mtp"}
ENGINE_VALUES = {v: k for k, v in ENGINE_NAMES.items()}
MODE_NAMES = {common_pb2.MODE_UNSPECIFIED: "fast", common_pb2.FAST: "fast", common_pb2.EXACT: "exact"}


def engine_name(value: int) -> str | None:
    """Engine enum -> "bf16" | "fp8" | "mtp"; ENGINE_UNSPECIFIED -> None (the worker's default)."""
    if value == common_pb2.ENGINE_UNSPECIFIED:
        return None
    if value not in ENGINE_NAMES:
        raise ValueError(f"engine: unknown value {value}")
    return ENGINE_NAMES[value]


def known_engine(value: int) -> bool:
    """Whether `value` is ENGINE_UNSPECIFIED or a known engine."""
    return value == common_pb2.ENGINE_UNSPECIFIED or value in ENGINE_NAMES


def engine_value(name: str | int | None) -> int:
    """ "bf16" | "fp8" | "mtp" (or an enum value, or None = unspecified) -> the Engine enum value."""
    if name is None or isinstance(name, int):
        return int(name or 0)
    try:
        return ENGINE_VALUES[name]
    except KeyError:
        raise ValueError(f"engine: unknown {name!r}; choose one of {', '.join(ENGINE_VALUES)}") from None
