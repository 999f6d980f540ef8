"""Regenerate the checked-in gRPC/protobuf stubs in ``baton/v1/`` from ``protos/baton/v1/*.proto``.

    python -m baton.protogen           # rewrite baton/v1/*_pb2.py, *_pb2_grpc.py, *_pb2.pyi, __init__.py
    python -m baton.protogen --check   # regenerate into a temp dir; exit 1 naming stale files

Protos are the source of truth (docs/ARCHITECTURE.md, protos/). protoc runs through grpc_tools with
``proto_path = protos/``, so the generated modules are ``baton.v1.<name>_pb2``. Post-processing:

1. Imports become package-relative (``from . import common_pb2 as ...``), so the stubs do not
   depend on where ``baton`` is on sys.path.
2. The protobuf runtime-version guard (``_runtime_version.ValidateProtobufRuntimeVersion(...)``)
   is removed. protoc pins it to its own protobuf release (7.x for grpcio-tools 1.85), which would
   refuse the older protobuf on the GPU machine. The stubs only use the serialized-descriptor
   builder API, present and stable since protobuf 5.26, which is the floor we support.
3. The grpcio guard (``GRPC_GENERATED_VERSION``) is lowered to ``GRPC_FLOOR``: the oldest grpcio
   whose API the stubs call (``_registered_method=`` on channels,
   ``server.add_registered_method_handlers``), instead of the exact grpcio-tools release.
4. The "Protobuf Python Version" header line is dropped, so patch releases of grpcio-tools within
   one minor series produce byte-identical files and ``--check`` stays stable.

The generator's major.minor is recorded in ``baton/v1/__init__.py`` as ``GENERATED_WITH``; the test
skips the staleness check when the installed grpcio-tools is from another series.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
OUT_DIR = ROOT / "baton" / "v1"
NAMES = ("common", "state", "prefill", "decode", "router")
GRPC_FLOOR = "1.64.0"

_RUNTIME_IMPORT = re.compile(r"^from google\.protobuf import runtime_version as _runtime_version\n", re.M)
_RUNTIME_CALL = re.compile(r"^_runtime_version\.ValidateProtobufRuntimeVersion\(\n(?:    .*\n)*?\)\n", re.M)
_PB_VERSION_LINE = re.compile(r"^# Protobuf Python Version: .*\n", re.M)
_ABS_IMPORT = re.compile(r"^from baton\.v1 import (\w+_pb2) as ", re.M)
_GRPC_VERSION = re.compile(r"^GRPC_GENERATED_VERSION = '[^']*'$", re.M)


def tools_series() -> str:
    """'grpcio-tools X.Y' of the installed generator (raises ImportError when absent)."""
    from importlib.metadata import version

    import grpc_tools  # noqa: F401  (ImportError is the signal callers use)

    major, minor = version("grpcio-tools").split(".")[:2]
    return f"grpcio-tools {major}.{minor}"


def postprocess(filename: str, text: str) -> str:
    """Apply the rewrites listed in the module docstring to one generated file."""
    text = _ABS_IMPORT.sub(r"from . import \1 as ", text)
    text = _PB_VERSION_LINE.sub("", text)
    if filename.endswith("_pb2.py"):
        text, n_import = _RUNTIME_IMPORT.subn("", text)
        text, n_call = _RUNTIME_CALL.subn(
            "# NOTE: protobuf runtime-version guard removed by baton.protogen (runs on protobuf >= 5.26)\n",
            text,
        )
        if n_import != n_call or n_call > 1:
            raise RuntimeError(f"{filename}: unexpected runtime-version guard layout")
    if filename.endswith("_pb2_grpc.py"):
        text, n = _GRPC_VERSION.subn(f"GRPC_GENERATED_VERSION = '{GRPC_FLOOR}'  # lowered by baton.protogen", text)
        if n != 1:
            raise RuntimeError(f"{filename}: GRPC_GENERATED_VERSION not found")
    if "from baton.v1" in text or "import baton.v1" in text:
        raise RuntimeError(f"{filename}: absolute baton.v1 import left after rewrite")
    return text


def init_text(series: str) -> str:
    mods = "\n".join(f"#   {n}_pb2, {n}_pb2_grpc" for n in NAMES)
    return (
        '"""Generated gRPC/protobuf stubs for baton.v1. Do not edit: run `python -m baton.protogen`."""\n'
        f"# Modules (import explicitly, e.g. `from baton.v1 import decode_pb2`):\n{mods}\n"
        f'GENERATED_WITH = "{series}"\n'
    )


def generate() -> dict[str, str]:
    """Run protoc into a temp dir; return {filename: post-processed text} for baton/v1/."""
    from grpc_tools import protoc

    proto_include = Path(protoc.__file__).resolve().parent / "_proto"
    sources = [str(PROTO_ROOT / "baton" / "v1" / f"{n}.proto") for n in NAMES]
    out: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        argv = [
            "grpc_tools.protoc",
            f"--proto_path={PROTO_ROOT}",
            f"--proto_path={proto_include}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *sources,
        ]
        rc = protoc.main(argv)
        if rc != 0:
            raise RuntimeError(f"protoc failed with exit code {rc}")
        gen_dir = Path(tmp) / "baton" / "v1"
        for n in NAMES:
            for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
                fname = n + suffix
                out[fname] = postprocess(fname, (gen_dir / fname).read_text())
    out["__init__.py"] = init_text(tools_series())
    return out


def stale_files(generated: dict[str, str], out_dir: Path = OUT_DIR) -> list[str]:
    """Names in `generated` whose checked-in copy is missing or differs."""
    stale = []
    for fname, text in sorted(generated.items()):
        path = out_dir / fname
        if not path.is_file() or path.read_text() != text:
            stale.append(fname)
    return stale


def write(generated: dict[str, str], out_dir: Path = OUT_DIR) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    for fname, text in generated.items():
        (out_dir / fname).write_text(text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m baton.protogen", description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if checked-in stubs are stale")
    args = ap.parse_args(argv)
    generated = generate()
    if args.check:
        stale = stale_files(generated)
        if stale:
            rel = OUT_DIR.relative_to(ROOT)
            print("stale generated files (run `python -m baton.protogen`):", file=sys.stderr)
            for fname in stale:
                print(f"  {rel / fname}", file=sys.stderr)
            return 1
        print(f"baton/v1 up to date ({len(generated)} files)")
        return 0
    write(generated)
    print(f"wrote {len(generated)} files to {OUT_DIR.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
