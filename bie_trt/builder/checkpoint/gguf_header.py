"""The key-value metadata at the start of a GGUF file, read without its tensors: enough to check a
quantisation's group size against the model's sizes before loading any weights."""
from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, BinaryIO

from ...errors import CheckpointError

# GGUF value types -> struct format of one scalar (8 string, 9 array are read by hand)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


def _read(f: BinaryIO, fmt: str) -> Any:
    size = struct.calcsize("<" + fmt)
    data = f.read(size)
    if len(data) != size:
        raise EOFError
    return struct.unpack("<" + fmt, data)[0]


def _string(f: BinaryIO) -> str:
    return f.read(_read(f, "Q")).decode("utf-8", errors="replace")


def _value(f: BinaryIO, kind: int) -> Any:
    if kind in _SCALARS:
        return _read(f, _SCALARS[kind])
    if kind == _STRING:
        return _string(f)
    if kind == _ARRAY:
        item, count = _read(f, "I"), _read(f, "Q")
        if item in _SCALARS:   # skipped in one read: vocabularies hold tens of thousands of entries
            f.seek(count * struct.calcsize("<" + _SCALARS[item]), 1)
            return None
        for _ in range(count):
            _value(f, item)
        return None
    raise ValueError(f"unknown GGUF value type {kind}")


def read_gguf_metadata(path: Path) -> dict[str, Any]:
    """Every scalar and string key of the header (arrays map to None)."""
    try:
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise ValueError("not a GGUF file (no GGUF magic)")
            _read(f, "I")                      # version
            _read(f, "Q")                      # tensor count
            meta = {}
            for _ in range(_read(f, "Q")):
                key = _string(f)
                meta[key] = _value(f, _read(f, "I"))
            return meta
    except (OSError, EOFError, ValueError, struct.error) as e:
        raise CheckpointError(f"{path}: cannot read the GGUF header ({e or 'truncated'}).") from None


def gguf_linear_sizes(path: Path) -> dict[str, int]:
    """The sizes a 4-bit group must divide: hidden, intermediate and attention output (heads x head_dim)."""
    meta = read_gguf_metadata(path)
    arch = meta.get("general.architecture")
    try:
        hidden = int(meta[f"{arch}.embedding_length"])
        heads = int(meta[f"{arch}.attention.head_count"])
        sizes = {"hidden_size": hidden, "intermediate_size": int(meta[f"{arch}.feed_forward_length"])}
    except KeyError as e:
        raise CheckpointError(f"{path}: the GGUF header has no {e.args[0]}; is it a Llama-family model?") from None
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // heads))
    sizes["attention output (heads*head_dim)"] = heads * head_dim
    return sizes
