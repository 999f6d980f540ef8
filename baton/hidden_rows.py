"""The wire form of hidden rows (baton.v1.HiddenRows): exact mode's verdict hidden rows, from the exact
worker's Verify through the router to the decode worker's next Draft (docs/CONTRACTS.md, "Verdict hidden
rows").

    encode(rows)                        [n, width] tensor (any device) -> HiddenRows (one host copy)
    decode(msg, rows, width, dtype)     HiddenRows -> [rows, width] CPU tensor of `dtype`, or ValueError

The values travel as they are (no cast): the decode worker's MTP head reads bitwise the rows the exact
worker computed, which are bitwise the ones it would have computed itself (row and batch invariance).
"""

from __future__ import annotations

import torch

from baton.v1 import common_pb2

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_NAMES = {v: k for k, v in DTYPES.items()}


def encode(rows: torch.Tensor) -> common_pb2.HiddenRows:
    """rows [n, width] float32 | bfloat16 | float16 -> the message (little-endian, row-major)."""
    if rows.dim() != 2 or rows.dtype not in _NAMES:
        raise ValueError(f"hidden rows: a [n, width] tensor of {sorted(DTYPES)}, got {rows.dtype} {tuple(rows.shape)}")
    host = rows.detach().to("cpu").contiguous()
    data = host.view(torch.uint8).numpy().tobytes()
    return common_pb2.HiddenRows(rows=host.shape[0], width=host.shape[1], dtype=_NAMES[host.dtype], data=data)


def decode(msg: common_pb2.HiddenRows, rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """The [rows, width] tensor of `dtype` in msg, which must say exactly that; ValueError naming the field
    otherwise (the caller answers INVALID_ARGUMENT)."""
    if msg.rows != rows:
        raise ValueError(f"verdict_hidden.rows: {msg.rows}, expected {rows} (the kept tokens t0, d1..dm)")
    if msg.width != width:
        raise ValueError(f"verdict_hidden.width: {msg.width}, expected the model's hidden size {width}")
    if DTYPES.get(msg.dtype) != dtype:
        raise ValueError(f"verdict_hidden.dtype: {msg.dtype!r}, expected {_NAMES.get(dtype, str(dtype))!r}")
    size = rows * width * dtype.itemsize
    if len(msg.data) != size:
        raise ValueError(f"verdict_hidden.data: {len(msg.data)} bytes, expected {size}")
    return torch.frombuffer(bytearray(msg.data), dtype=torch.uint8).view(dtype).reshape(rows, width)
