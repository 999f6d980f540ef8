"""The one way a benchmark reports: its JSON object on stdout, and the same in --out when given."""
from __future__ import annotations

import json
from pathlib import Path


def emit(result: dict, out: str | Path | None) -> None:
    print(json.dumps(result, indent=1), flush=True)
    if out:
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
