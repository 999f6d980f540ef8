"""Generated stubs in baton/v1 match protos/ (codegen --check) and all import."""

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from baton import protogen

ROOT = Path(__file__).resolve().parent.parent


def test_generated_modules_import():
    for name in protogen.NAMES:
        pb2 = importlib.import_module(f"baton.v1.{name}_pb2")
        importlib.import_module(f"baton.v1.{name}_pb2_grpc")
        assert pb2.DESCRIPTOR.package == "baton.v1"
        assert pb2.DESCRIPTOR.name == f"baton/v1/{name}.proto"
    from baton.v1 import decode_pb2_grpc, prefill_pb2_grpc, router_pb2_grpc

    assert hasattr(router_pb2_grpc, "RouterStub")
    assert hasattr(prefill_pb2_grpc, "add_PrefillWorkerServicer_to_server")
    assert hasattr(decode_pb2_grpc, "DecodeWorkerServicer")


def test_generated_files_are_postprocessed():
    for path in sorted((ROOT / "baton" / "v1").glob("*_pb2*.py*")):
        text = path.read_text()
        assert "from baton.v1" not in text, path.name  # package-relative imports only
        assert "ValidateProtobufRuntimeVersion" not in text, path.name
        if path.name.endswith("_pb2_grpc.py"):
            assert f"GRPC_GENERATED_VERSION = '{protogen.GRPC_FLOOR}'" in text


def test_postprocess_rewrites():
    src = (
        "from google.protobuf import runtime_version as _runtime_version\n"
        "_runtime_version.ValidateProtobufRuntimeVersion(\n    _runtime_version.Domain.PUBLIC,\n    7,\n)\n"
        "from baton.v1 import common_pb2 as baton_dot_v1_dot_common__pb2\n"
    )
    out = protogen.postprocess("x_pb2.py", src)
    assert "_runtime_version" not in out
    assert "from . import common_pb2 as baton_dot_v1_dot_common__pb2\n" in out


def test_codegen_check_is_clean():
    pytest.importorskip("grpc_tools")
    from baton.v1 import GENERATED_WITH

    if protogen.tools_series() != GENERATED_WITH:
        pytest.skip(f"installed {protogen.tools_series()}, stubs made with {GENERATED_WITH}")
    proc = subprocess.run(
        [sys.executable, "-m", "baton.protogen", "--check"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr


def test_check_names_stale_files(tmp_path):
    pytest.importorskip("grpc_tools")
    generated = protogen.generate()
    protogen.write(generated, tmp_path)
    assert protogen.stale_files(generated, tmp_path) == []
    (tmp_path / "router_pb2.py").write_text("# edited\n")
    (tmp_path / "state_pb2.pyi").unlink()
    assert protogen.stale_files(generated, tmp_path) == ["router_pb2.py", "state_pb2.pyi"]
