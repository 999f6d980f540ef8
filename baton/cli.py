"""`baton` command line: one subcommand per registered entry point.

Commands are the `baton.commands` entry points of pyproject.toml (name -> module). Each module exposes
`add_arguments(parser)` and `run(args) -> int` (or `add_arguments_for(name, parser)` / `run_for(name,
args)` when it serves several names), and its docstring's first line is the command's help. A module is
imported only when its command runs, so `baton health` stays fast and torch-free. Run from a source
checkout that is not installed (the GPU machine), the same table is read from the checkout's
pyproject.toml.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import re
import sys
from importlib import metadata
from pathlib import Path

GROUP = "baton.commands"
_PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def commands() -> dict[str, str]:
    """Registered commands: name -> module, in registration order."""
    found = {ep.name: ep.value for ep in metadata.entry_points(group=GROUP)}
    if found:
        return found
    if _PYPROJECT.is_file():  # a checkout run through PYTHONPATH, without `pip install`
        import tomllib

        table = tomllib.loads(_PYPROJECT.read_text()).get("project", {}).get("entry-points", {})
        return dict(table.get(GROUP, {}))
    return {}


def _help(module: str, command: str) -> str:
    """A command's help, read without importing its module: its COMMAND_HELP[command] literal if it has
    one, else its docstring's first line without the leading "`baton ...`: "."""
    try:
        spec = importlib.util.find_spec(module)
        tree = ast.parse(Path(spec.origin).read_text()) if spec and spec.origin else None
    except (ImportError, OSError, SyntaxError, ValueError):
        tree = None
    if tree is None:
        return ""
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "COMMAND_HELP" for t in node.targets):
            try:
                return str(ast.literal_eval(node.value).get(command, ""))
            except ValueError:
                break
    line = (ast.get_docstring(tree) or "").strip().split("\n")[0]
    return re.sub(r"^(`baton [^`]*`(, | and )?)+: *", "", line)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="baton", description="Baton: serving for hybrid recurrent LLMs")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    table = commands()
    if not table:
        p.error(f"no commands registered (entry point group {GROUP!r}): is baton installed?")
    name = next((a for a in argv if not a.startswith("-")), None)
    listing = name not in table  # the command list is shown: read every command's help, else none
    for cmd, mod in table.items():
        sp = sub.add_parser(cmd, help=_help(mod.split(":")[0], cmd) if listing else None)
        if cmd == name:
            module = importlib.import_module(mod.split(":")[0])
            if hasattr(module, "add_arguments_for"):
                module.add_arguments_for(cmd, sp)
            else:
                module.add_arguments(sp)
            sp.set_defaults(_module=module)
    args = p.parse_args(argv)
    module = args._module
    run = getattr(module, "run_for", None)
    return int((run(args.command, args) if run else module.run(args)) or 0)


if __name__ == "__main__":
    sys.exit(main())
