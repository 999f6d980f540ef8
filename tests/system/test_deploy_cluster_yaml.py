"""deploy/cluster.yaml passes Ray's own cluster-launcher validation (what `ray up` runs first), and
its launch command matches deploy/launch.py's options and the node types' custom resources."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
pytest.importorskip("jsonschema")  # Ray's validator needs it

ROOT = Path(__file__).resolve().parents[2]
CLUSTER_YAML = ROOT / "deploy" / "cluster.yaml"


def _load() -> dict:
    return yaml.safe_load(CLUSTER_YAML.read_text())


def _launch_command() -> list[str]:
    lines = [ln for ln in CLUSTER_YAML.read_text().splitlines() if ln.startswith("# LAUNCH:")]
    assert len(lines) == 1, "cluster.yaml documents exactly one launch command"
    return shlex.split(lines[0].removeprefix("# LAUNCH:"))


def test_cluster_yaml_passes_ray_validation():
    from ray.autoscaler._private.util import prepare_config, validate_config

    raw = _load()
    validate_config(prepare_config(raw))  # fills defaults, merges setup commands, schema + checks
    assert raw["head_node_type"] in raw["available_node_types"]


def test_cluster_yaml_roles_and_commands():
    cfg = _load()
    types = cfg["available_node_types"]
    head = types[cfg["head_node_type"]]
    assert not head["resources"].get("GPU"), "the head (router) is a CPU node"
    offered = {r for t in types.values() for r in t.get("resources", {})}
    assert {"prefill_node", "decode_node"} <= offered
    setup = " ".join(cfg["setup_commands"])
    assert "pip install" in setup and "-e ~/baton" in setup
    assert "." in cfg["file_mounts"].values()
    assert any("ray start --head" in c for c in cfg["head_start_ray_commands"])
    assert any("ray start --address" in c for c in cfg["worker_start_ray_commands"])


def test_cluster_yaml_launch_command_parses():
    import argparse

    from deploy.launch import add_arguments

    argv = _launch_command()
    assert argv[:2] == ["python", "~/baton/deploy/launch.py"]
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(argv[2:])
    offered = {r for t in _load()["available_node_types"].values() for r in t.get("resources", {})}
    assert args.prefill_resource in offered and args.decode_resource in offered
    assert args.gpus_per_worker >= 1
