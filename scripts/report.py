"""How the benchmark scripts hand over their results: JSON on stdout, and the same in a file when asked."""
from __future__ import annotations

import json
from pathlib import Path


def emit(result: dict, out: Path | None, indent: int = 2) -> None:
    text = json.dumps(result, indent=indent)
    print(text)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
