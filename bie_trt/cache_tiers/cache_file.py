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
from typing import Any, BinaryIO

import torch

from ..errors import BieError

MAGIC = b"BIEKVC"
VERSION = 1
_PREFIX = struct.Struct("<6sHQ")   # magic, version, header length
_DIGEST = 32
# what blocks are stored in: FP16-tier blocks in the activation dtype, quantised ones packed in bytes
_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float16, torch.bfloat16, torch.float32, torch.uint8)}


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


def write_cache_file(path: Path, identity: dict[str, Any], token_ids: list[int], blocks: list[CachedBlock],
                     durable: bool = True) -> int:
    """Write atomically (a temporary file in the same directory, then a rename). -> bytes written.
    `durable` syncs the file to the disk before the rename; without it a power cut may leave a renamed file
    whose bytes never landed, which its checksum then refuses (the disk tier's many small files skip it)."""
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
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path.stat().st_size


def read_header(path: Path) -> dict:
    """A cache file's header alone (identity, token ids, blocks), unchecked: for listing files, never for
    serving them. CacheFileError when the file does not start like one."""
    try:
        with path.open("rb") as f:
            prefix = f.read(_PREFIX.size)
            if len(prefix) < _PREFIX.size or _PREFIX.unpack(prefix)[0] != MAGIC:
                raise CacheFileError(f"{path}: not a bie-trt KV cache file.")
            header = json.loads(f.read(_PREFIX.unpack(prefix)[2]))
    except OSError as e:
        raise CacheFileError(f"{path}: cannot read it ({e.strerror}).") from None
    except ValueError:
        raise CacheFileError(f"{path}: its header does not parse (damaged).") from None
    if not isinstance(header, dict):
        raise CacheFileError(f"{path}: its header does not parse (damaged).")
    return header


def _side_bytes(spec: dict) -> int:
    """Bytes of one side (K or V) of a block with the header's {"shape", "dtype"}."""
    return torch.Size(spec["shape"]).numel() * _DTYPES[spec["dtype"]].itemsize


def _expected_size(header_len: int, header: dict) -> int:
    payload = sum(2 * _side_bytes(header["tensors"][str(b["quantised"])]) for b in header["blocks"])
    return _PREFIX.size + header_len + payload + _DIGEST


def read_cache_file(path: Path, identity: dict[str, Any]) -> tuple[list[int], list[CachedBlock]]:
    """The prompt's token ids and its blocks, or CacheFileError naming why this engine cannot use the file.
    Read block by block into the blocks' own tensors, hashing as it goes: a 64k-token prompt's file is
    gigabytes, and it is never held twice."""
    try:
        with path.open("rb") as f:
            return _read(f, os.fstat(f.fileno()).st_size, path, identity)
    except OSError as e:
        raise CacheFileError(f"{path}: cannot read it ({e.strerror}).") from None


def _read(f: BinaryIO, size: int, path: Path, identity: dict[str, Any]) -> tuple[list[int], list[CachedBlock]]:
    if size < _PREFIX.size + _DIGEST:
        raise CacheFileError(f"{path}: truncated ({size} bytes); save the cache again.")
    prefix = f.read(_PREFIX.size)
    if len(prefix) < _PREFIX.size:   # (shorter than it was a moment ago)
        raise CacheFileError(f"{path}: truncated ({len(prefix)} bytes); save the cache again.")
    magic, version, header_len = _PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise CacheFileError(f"{path}: not a bie-trt KV cache file.")
    if _PREFIX.size + header_len + _DIGEST > size:
        raise CacheFileError(f"{path}: truncated ({size:,} bytes, less than its header); save the cache again.")
    raw_header = f.read(header_len)
    try:   # a header may not parse: the checksum below tells damage from a layout this version cannot read
        header = json.loads(raw_header)
        expected = _expected_size(header_len, header)
        layout = [(bytes.fromhex(b["key"]), b["quantised"], header["tensors"][str(b["quantised"])])
                  for b in header["blocks"]]
        token_ids = [int(t) for t in header["token_ids"]]
    except (ValueError, KeyError, TypeError, AttributeError):
        expected = None
    if expected is not None and size < expected:
        raise CacheFileError(f"{path}: truncated ({size:,} of {expected:,} bytes); save the cache again.")
    damaged = CacheFileError(f"{path}: checksum mismatch, the file is damaged; save the cache again.")
    other_version = CacheFileError(f"{path}: cache file format version {version}; this bie-trt reads version "
                                   f"{VERSION}.")
    digest = hashlib.sha256(prefix)
    digest.update(raw_header)
    if expected != size:   # the header does not describe this file: damaged, or a layout this bie-trt cannot read
        if not _rest_matches(f, digest, size - _PREFIX.size - header_len - _DIGEST):
            raise damaged
        if version != VERSION:
            raise other_version
        raise CacheFileError(f"{path}: its header does not describe its blocks (not written by bie-trt?); "
                             f"save the cache again.")
    blocks = []
    for key, quantised, spec in layout:
        sides = []
        for _ in range(2):
            raw = torch.empty(_side_bytes(spec), dtype=torch.uint8)
            view = memoryview(raw.numpy())
            if f.readinto(view) != len(view):
                raise damaged   # (shorter than it was a moment ago)
            digest.update(view)
            sides.append(raw.view(_DTYPES[spec["dtype"]]).reshape(spec["shape"]))
        blocks.append(CachedBlock(key, quantised, sides[0], sides[1]))
    if digest.digest() != f.read(_DIGEST):
        raise damaged
    if version != VERSION:
        raise other_version
    for name, want in identity.items():
        if header.get(name) != want:
            raise CacheFileError(f"{path}: saved by {_describe(name, header.get(name))}, but this engine has "
                                 f"{_describe(name, want)}; restore it into the engine that saved it.")
    return token_ids, blocks


def _rest_matches(f: BinaryIO, digest: "hashlib._Hash", payload: int) -> bool:
    """Whether the rest of the file (payload bytes, then the digest) hashes as written, read in pieces."""
    while payload > 0:
        piece = f.read(min(payload, 1 << 20))
        if not piece:
            return False
        digest.update(piece)
        payload -= len(piece)
    return digest.digest() == f.read(_DIGEST)


def _describe(name: str, value: Any) -> str:
    if name == "engine":
        return f"the engine with manifest sha256 {str(value)[:12]}"
    return f"{name} {json.dumps(value, sort_keys=True)}"
