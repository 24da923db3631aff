"""KV cache files: a prompt's cached blocks on disk, to restore into another run of the same engine.

Layout: the magic `BIEKVC`, a little-endian u16 format version, a u64 header length, the header (UTF-8
JSON: the engine's manifest digest, the KV layout, the prompt's token ids, each block's key and
precision), every block's K then V bytes in header order, and a SHA-256 of everything before it. A
file is written to a temporary name beside its target and renamed over it, so a reader never sees
half of one; loading checks the length, the checksum, the version, the engine and the layout, and
refuses with one line that says which.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import BieError

MAGIC = b"BIEKVC"
VERSION = 1
_PREFIX = struct.Struct("<6sHQ")   # magic, version, header length
_DIGEST = 32


class CacheFileError(BieError):
    """A cache file this engine cannot use; the message is one line naming why."""


@dataclass
class CachedBlock:
    key: bytes
    quantised: bool
    k: torch.Tensor   # on the CPU, in the pool's own layout for one block
    v: torch.Tensor


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def write_cache_file(path: Path, identity: dict[str, Any], token_ids: list[int], blocks: list[CachedBlock]) -> int:
    """Write atomically (a temporary file in the same directory, then a rename). -> bytes written."""
    shapes = {}
    for b in blocks:
        shapes[str(b.quantised)] = {"shape": list(b.k.shape), "dtype": str(b.k.dtype).removeprefix("torch.")}
    header = json.dumps({**identity, "token_ids": token_ids, "tensors": shapes,
                         "blocks": [{"key": b.key.hex(), "quantised": b.quantised} for b in blocks]}).encode()
    digest = hashlib.sha256()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            for part in [_PREFIX.pack(MAGIC, VERSION, len(header)), header,
                         *(_raw(t) for b in blocks for t in (b.k, b.v))]:
                digest.update(part)
                f.write(part)
            f.write(digest.digest())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path.stat().st_size


def _side_bytes(spec: dict) -> int:
    """Bytes of one side (K or V) of a block with the header's {"shape", "dtype"}."""
    return torch.Size(spec["shape"]).numel() * torch.empty(0, dtype=getattr(torch, spec["dtype"])).element_size()


def _expected_size(header_len: int, header: dict) -> int:
    payload = sum(2 * _side_bytes(header["tensors"][str(b["quantised"])]) for b in header["blocks"])
    return _PREFIX.size + header_len + payload + _DIGEST


def read_cache_file(path: Path, identity: dict[str, Any]) -> tuple[list[int], list[CachedBlock]]:
    """The prompt's token ids and its blocks, or CacheFileError naming why this engine cannot use the file."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CacheFileError(f"{path}: cannot read it ({e.strerror}).") from None
    if len(data) < _PREFIX.size + _DIGEST:
        raise CacheFileError(f"{path}: truncated ({len(data)} bytes); save the cache again.")
    magic, version, header_len = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise CacheFileError(f"{path}: not a bie-trt KV cache file.")
    if _PREFIX.size + header_len + _DIGEST > len(data):
        raise CacheFileError(f"{path}: truncated ({len(data):,} bytes, less than its header); save the cache again.")
    header = None
    try:
        header = json.loads(data[_PREFIX.size:_PREFIX.size + header_len])
        expected = _expected_size(header_len, header)
    except (ValueError, KeyError, TypeError, AttributeError):
        expected = None
    if expected is not None and len(data) < expected:
        raise CacheFileError(f"{path}: truncated ({len(data):,} of {expected:,} bytes); save the cache again.")
    if hashlib.sha256(data[:-_DIGEST]).digest() != data[-_DIGEST:] or expected != len(data):
        raise CacheFileError(f"{path}: checksum mismatch, the file is damaged; save the cache again.")
    if version != VERSION:
        raise CacheFileError(f"{path}: cache file format version {version}; this bie-trt reads version {VERSION}.")
    for name, want in identity.items():
        if header.get(name) != want:
            raise CacheFileError(f"{path}: saved by {_describe(name, header.get(name))}, but this engine has "
                                 f"{_describe(name, want)}; restore it into the engine that saved it.")
    blocks, at = [], _PREFIX.size + header_len
    for b in header["blocks"]:
        spec = header["tensors"][str(b["quantised"])]
        n, sides = _side_bytes(spec), []
        for _ in range(2):
            raw = torch.frombuffer(bytearray(data[at:at + n]), dtype=torch.uint8)
            sides.append(raw.view(getattr(torch, spec["dtype"])).reshape(spec["shape"]))
            at += n
        blocks.append(CachedBlock(bytes.fromhex(b["key"]), b["quantised"], sides[0], sides[1]))
    return header["token_ids"], blocks


def _describe(name: str, value: Any) -> str:
    if name == "engine":
        return f"the engine with manifest sha256 {str(value)[:12]}"
    return f"{name} {json.dumps(value, sort_keys=True)}"
