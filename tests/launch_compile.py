"""Compiles the kernel launches an interpreted test recorded (tests/launch_record.py) for sm_90, with Triton's
own compiler and the ptxas of its wheel: no GPU needed. Exit 1 naming each launch that does not compile.

    python tests/launch_compile.py RECORDS.json"""

from __future__ import annotations

import importlib
import json
import sys

import triton
import triton.language as tl

CODES = {
    "float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float64": "fp64", "int64": "i64", "int32": "i32",
    "int16": "i16", "int8": "i8", "uint8": "u8", "bool": "i1", "float8_e4m3fn": "fp8e4nv", "float8_e5m2": "fp8e5",
}  # fmt: skip


def _value(kind):
    tag, v = kind
    return tl.dtype(v) if tag == "dtype" else v  # a Triton dtype by its name ("fp32", "bf16", ...)


def _type(kind) -> str:
    tag, v = kind
    if tag == "tensor":
        return "*" + CODES[v]
    if tag == "desc":  # recorded as its signature type
        return v
    if tag == "int":
        return "i32" if -(2**31) <= v < 2**31 else "i64"
    return {"float": "fp32", "bool": "i1"}[tag]


def main(path: str) -> int:
    try:
        from triton.backends.compiler import GPUTarget
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
        from triton.compiler import ASTSource
    except ImportError as e:
        print(f"launch_compile: no NVIDIA backend in this Triton ({e}): nothing compiled")
        return 0
    failed = 0
    records = json.load(open(path))
    for rec in records:
        try:
            jit = getattr(importlib.import_module(rec["module"]), rec["name"])
            sig, consts = {}, {}
            for p in jit.params:
                kind = rec["args"].get(p.name)
                if kind is None:  # a parameter left to its default
                    consts[p.name], sig[p.name] = p.default, "constexpr"
                elif p.is_constexpr or kind[0] in ("none", "dtype", "str"):
                    consts[p.name], sig[p.name] = _value(kind), "constexpr"
                else:
                    sig[p.name] = _type(kind)
            triton.compile(
                ASTSource(fn=jit, signature=sig, constexprs=consts),
                target=GPUTarget("cuda", 90, 32),
                options=dict(rec["options"]),
            )
        except Exception as e:  # noqa: BLE001 - every failure is named, then the run fails
            failed += 1
            print(f"launch_compile: {rec['module']}.{rec['name']} {rec['options']} does not compile for sm_90:\n{e}")
    print(f"launch_compile: {len(records) - failed} of {len(records)} launches compiled for sm_90")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
