"""The layout's rules, checked on the source tree: runtime code never imports benchmarks, tests or
deploy; no runtime module grows past the size limit; `baton` finds its commands with or without an
install."""

from __future__ import annotations

import ast
from importlib import metadata
from pathlib import Path

from baton import cli

ROOT = Path(__file__).resolve().parents[1]
RUNTIME = ("baton", "prefill_worker", "decode_worker", "router")
FORBIDDEN = ("benchmarks", "tests", "deploy")
MAX_LINES = 400


def runtime_modules():
    for d in RUNTIME:
        for f in sorted((ROOT / d).rglob("*.py")):
            if "v1" not in f.relative_to(ROOT).parts:  # generated stubs
                yield f


def imported_modules(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield node.module
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            yield str(node.args[0].value)


def test_runtime_imports_no_benchmarks_tests_or_deploy():
    hits = [
        f"{f.relative_to(ROOT)}: {m}"
        for f in runtime_modules()
        for m in imported_modules(ast.parse(f.read_text()))
        if m.split(".")[0] in FORBIDDEN
    ]
    assert hits == []


def test_the_import_check_sees_every_form():
    code = "import deploy.local\nfrom benchmarks import suite\nimportlib.import_module('tests.x')\nfrom . import y\n"
    assert [m.split(".")[0] for m in imported_modules(ast.parse(code))] == ["deploy", "benchmarks", "tests"]


def test_no_runtime_module_is_over_the_limit():
    sizes = {str(f.relative_to(ROOT)): len(f.read_text().splitlines()) for f in runtime_modules()}
    assert {f: n for f, n in sizes.items() if n > MAX_LINES} == {}
    assert len(sizes) > 50  # the walk found the tree


def test_commands_come_from_the_entry_points_and_from_pyproject_alike(monkeypatch):
    installed = {ep.name: ep.value for ep in metadata.entry_points(group=cli.GROUP)}
    assert {"serve", "generate", "health", "complete", "make-tiny", "bench"} <= set(installed)
    assert cli.commands() == installed
    monkeypatch.setattr(cli.metadata, "entry_points", lambda group: [])  # a checkout run via PYTHONPATH
    assert cli.commands() == installed
    assert cli._help("baton.client_cli", "health") == "check a router's gRPC health"
    assert cli._help("baton.complete", "complete").startswith("greedy decoding")
