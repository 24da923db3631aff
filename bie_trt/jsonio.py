"""Reading the small JSON files a user hands us (config.json, manifest.json) with one clear error each."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .errors import BieError


def read_json_object(path: Path, fix: str, error: type[BieError] = BieError) -> dict[str, Any]:
    """The JSON object in `path`; anything else (missing, not UTF-8, not JSON, not an object) raises
    `error` naming the file, what is wrong with it, and `fix` (what the user should do)."""
    try:
        data = json.loads(Path(path).read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise error(f"{path}: no such file; {fix}") from None
    except UnicodeDecodeError as e:
        raise error(f"{path}: not UTF-8 text (byte {e.start}); {fix}") from None
    except json.JSONDecodeError as e:
        raise error(f"{path}: not valid JSON ({e}); {fix}") from None
    if not isinstance(data, dict):
        raise error(f"{path}: holds a JSON {type(data).__name__}, not an object; {fix}")
    return data
