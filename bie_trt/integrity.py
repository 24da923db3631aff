"""Check an engine's files against its manifest before serving from it.

Hashing a 5 GB weights file takes seconds, so a file once verified is remembered by
(path, size, mtime, inode) in the user cache -- outside the engine directory, which stays
read-only and deterministic -- and a restart over unchanged files hashes nothing.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from . import engine_format as ef
from .errors import EngineError
from .user_cache import cache_dir

LEDGER = "verified-files.json"


def _ledger_path() -> Path:
    return cache_dir() / LEDGER


def _load_ledger(path: Path) -> dict[str, list]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):   # absent or damaged: start afresh, it is only a cache
        return {}
    return data if isinstance(data, dict) else {}


def _save_ledger(path: Path, ledger: dict[str, list]) -> None:
    ledger = {k: v for k, v in ledger.items() if os.path.exists(k)}   # forget deleted engines
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".verified-", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(ledger, f)
        os.replace(tmp, path)
    except OSError:   # a read-only cache only costs hashing again next time
        pass


def _stamp(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def check_engine_files(engine_dir: str | Path, manifest: ef.Manifest) -> None:
    """Raise EngineError unless every file the manifest lists is present with its sha256."""
    engine_dir = Path(engine_dir).resolve()
    ledger_path = _ledger_path()
    ledger = _load_ledger(ledger_path)
    changed = False

    def sha256(f: Path) -> str:
        nonlocal changed
        key, stamp = str(f), _stamp(f)
        entry = ledger.get(key)
        if isinstance(entry, list) and entry[:3] == stamp and len(entry) == 4:
            return entry[3]
        digest = ef.sha256_file(f)
        ledger[key], changed = [*stamp, digest], True
        return digest

    problems = ef.file_problems(engine_dir, manifest.files, sha256)
    if changed:
        _save_ledger(ledger_path, ledger)
    if problems:
        raise EngineError(f"{engine_dir} is damaged ({'; '.join(problems)}); rebuild it with `bie-trt build`, "
                          f"or pass --skip-verify to serve it anyway.")


def recheck_engine_files(engine_dir: str | Path, manifest: ef.Manifest) -> list[str]:
    """Hash every listed file again, trusting no remembered digest: bit rot changes bytes but keeps a
    file's size and mtime, which the remembered stamps cannot see. On a problem the engine's files are
    forgotten, so that the next load hashes them and refuses."""
    engine_dir = Path(engine_dir).resolve()
    problems = ef.file_problems(engine_dir, manifest.files)
    if problems:
        ledger_path = _ledger_path()
        ledger = _load_ledger(ledger_path)
        for name in manifest.files:
            ledger.pop(str(engine_dir / name), None)
        _save_ledger(ledger_path, ledger)
    return problems
