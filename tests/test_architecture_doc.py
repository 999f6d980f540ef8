"""docs/ARCHITECTURE.md names only code that exists (issue 19, "every function it names exists").

Every backticked `path/to/file.py: Name` or `path/to/file.py: Class.method` must name a file that
defines it (found with ast, nothing imported), and every backticked path to a .py / .md file or a
folder must exist."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "ARCHITECTURE.md"

_TICKED = re.compile(r"`([^`\n]+)`")
_REF = re.compile(r"([\w./-]+\.py): ([A-Za-z_][\w.]*)")
_PATH = re.compile(r"[\w.-]+(?:/[\w.-]+)*\.(?:py|md)|[\w.-]+(?:/[\w.-]+)*/")
_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def _names(body: list[ast.stmt]) -> dict[str, ast.AST]:
    """Names bound at this level: functions, classes, assignments (a class's attributes included)."""
    out: dict[str, ast.AST] = {}
    for node in body:
        if isinstance(node, _DEFS):
            out[node.name] = node
        elif isinstance(node, ast.Assign):
            out.update({t.id: node for t in node.targets if isinstance(t, ast.Name)})
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = node
    return out


def defines(path: Path, dotted: str) -> bool:
    """Whether the module at `path` defines `dotted` (Name, Class.method, function.inner ...)."""
    scope: list[ast.stmt] = ast.parse(path.read_text()).body
    for part in dotted.split("."):
        node = _names(scope).get(part)
        if node is None:
            return False
        scope = node.body if isinstance(node, _DEFS) else []
    return True


def problems(text: str, root: Path = ROOT) -> list[str]:
    """What in `text` (markdown) points at nothing under `root`."""
    out = []
    for ticked in _TICKED.findall(text):
        ticked = ticked.strip()
        ref = _REF.fullmatch(ticked)
        if ref is not None:
            path, name = root / ref.group(1), ref.group(2)
            if not path.is_file():
                out.append(f"{ticked}: no file {ref.group(1)}")
            elif not defines(path, name):
                out.append(f"{ticked}: {ref.group(1)} defines no {name}")
        elif _PATH.fullmatch(ticked) and not (root / ticked).exists():
            out.append(f"{ticked}: no such path")
    return out


def test_every_reference_in_the_architecture_doc_exists():
    text = DOC.read_text()
    assert len(_REF.findall(text)) > 100  # the walk-throughs were found
    assert problems(text) == []


def test_the_checker_catches_wrong_references(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text(
        "X = 1\n\nclass A:\n    y: int = 0\n\n    def m(self):\n        def inner():\n            pass\n\n"
        "def f():\n    pass\n"
    )
    (tmp_path / "README.md").write_text("")
    good = (
        "`pkg/mod.py: A.m` `pkg/mod.py: f` `pkg/mod.py: X` `pkg/mod.py: A.y` `pkg/mod.py: A.m.inner` "
        "`pkg/mod.py` `pkg/` `README.md` `not a path` `A.m`"
    )
    assert problems(good, tmp_path) == []
    bad = "`pkg/mod.py: A.nope` `pkg/mod.py: g` `pkg/other.py: A` `pkg/mod.py: f.m` `docs/NOPE.md` `gone/`"
    assert problems(bad, tmp_path) == [
        "pkg/mod.py: A.nope: pkg/mod.py defines no A.nope",
        "pkg/mod.py: g: pkg/mod.py defines no g",
        "pkg/other.py: A: no file pkg/other.py",
        "pkg/mod.py: f.m: pkg/mod.py defines no f.m",
        "docs/NOPE.md: no such path",
        "gone/: no such path",
    ]


def test_the_checker_sees_a_wrong_reference_to_the_real_tree():
    assert problems("`baton/engine/runner.py: ModelRunner.prefill`") == []
    assert problems("`baton/engine/runner.py: ModelRunner.no_such_method`") != []
    assert problems("`baton/runner.py: ModelRunner`") != []  # the path before the move
