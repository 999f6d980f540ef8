"""Engine names: the proto `Engine` enum <-> "bf16" | "fp8" | "mtp" (the one mapping; no torch)."""
from __future__ import annotations



from baton.v1 import common_pb2

ENGINE_NAMES = {common_pb2.BF16: "bf16", common_pb2.FP8: "fp8", common_pb2.MTP: "mtp"}
ENGINE_VALUES = {v: k for k, v in ENGINE_NAMES.items()}


def engine_name(value: int) -> str | None:
    """Engine enum -> "bf16" | "fp8" | "mtp"; ENGINE_UNSPECIFIED -> None (the worker's default)."""
    if value == common_pb2.ENGINE_UNSPECIFIED:
        return None
    if value not in ENGINE_NAMES:
        raise ValueError(f"engine: unknown value {value}")
    return ENGINE_NAMES[value]


def engine_value(name: str | int | None) -> int:
    if name is None or isinstance(name, int):
        return int(name or 0)
    try:
        return ENGINE_VALUES[name]
    except KeyError:
        raise ValueError(f"engine: unknown {name!r}; choose one of {', '.join(ENGINE_VALUES)}") from None
