"""The cache-file format on its own: a round trip, every damaged byte refused in one line, and a file read
block by block (never held whole beside its blocks)."""
from __future__ import annotations

import hashlib
import json
import struct
import tracemalloc
from pathlib import Path

import pytest
import torch

from bie_trt.cache_tiers.cache_file import CachedBlock, CacheFileError, read_cache_file, write_cache_file

IDENTITY = {"engine": "ab" * 32, "kv_layout": {"dtype": "int4_asym", "block_size": 16}}


def blocks(n: int, numel: int = 64, seed: int = 0) -> list[CachedBlock]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        if i % 2:   # a quantised block: its own shape and dtype
            k, v = (torch.randint(0, 255, (2, numel // 2), generator=g, dtype=torch.uint8) for _ in range(2))
        else:
            k, v = (torch.randn(4, numel // 4, generator=g).half() for _ in range(2))
        out.append(CachedBlock(bytes([i]) * 8, bool(i % 2), k, v))
    return out


def same(a: list[CachedBlock], b: list[CachedBlock]) -> bool:
    return all(x.key == y.key and x.quantised == y.quantised and x.k.dtype == y.k.dtype and torch.equal(x.k, y.k)
               and torch.equal(x.v, y.v) for x, y in zip(a, b, strict=True))


def test_a_file_reads_back_its_ids_and_blocks(tmp_path):
    want = blocks(5)
    path = tmp_path / "a.kvc"
    size = write_cache_file(path, IDENTITY, [1, 2, 3], want)
    assert size == path.stat().st_size
    ids, got = read_cache_file(path, IDENTITY)
    assert ids == [1, 2, 3] and same(got, want)


def test_every_damaged_header_byte_and_a_damaged_block_are_refused_in_one_line(tmp_path):
    path = tmp_path / "a.kvc"
    write_cache_file(path, IDENTITY, list(range(20)), blocks(3))
    data = path.read_bytes()
    header_end = 16 + int.from_bytes(data[8:16], "little")
    places = [(at, bit) for at in range(header_end) for bit in (0x04, 0x40)]   # (0x40 makes a hex digit no digit)
    for at, bit in places + [(header_end + 5, 0x04), (len(data) - 40, 0x04), (len(data) - 1, 0x04)]:
        flipped = bytearray(data)
        flipped[at] ^= bit
        path.write_bytes(bytes(flipped))
        with pytest.raises(CacheFileError) as e:
            read_cache_file(path, IDENTITY)
        message = str(e.value)
        assert "\n" not in message and message.startswith(f"{path}: "), at
        # the magic is read first; a header length or block size past the end is truncation; all else, a checksum
        causes = ["not a bie-trt KV cache file"] if at < 6 else ["truncated", "checksum mismatch"] if at < 16 \
            else ["checksum mismatch", "truncated"] if at < header_end else ["checksum mismatch"]
        assert any(c in message for c in causes), (at, message)


def written(path: Path, header: dict, version: int = 1, payload: bytes = b"") -> Path:
    """A file whose checksum holds over whatever header it is given."""
    raw = json.dumps(header).encode()
    body = struct.pack("<6sHQ", b"BIEKVC", version, len(raw)) + raw + payload
    path.write_bytes(body + hashlib.sha256(body).digest())
    return path


def test_a_whole_file_with_a_header_this_version_cannot_read_says_so(tmp_path):
    no_ids = written(tmp_path / "no-ids.kvc", {**IDENTITY, "tensors": {}, "blocks": []})
    with pytest.raises(CacheFileError, match="its header does not describe its blocks"):
        read_cache_file(no_ids, IDENTITY)
    later = written(tmp_path / "v2.kvc", {**IDENTITY, "token_ids": [1], "layers": [{"k": 4}]}, 2, b"\0" * 64)
    with pytest.raises(CacheFileError, match="format version 2; this bie-trt reads version 1"):
        read_cache_file(later, IDENTITY)



def test_an_older_format_version_is_refused_by_name_when_all_else_holds(tmp_path):
    """A file as this version writes it, stamped version 0 with its checksum made good: only the version
    check can refuse it."""
    path = tmp_path / "v0.kvc"
    write_cache_file(path, IDENTITY, [1, 2, 3], blocks(3))
    body = bytearray(path.read_bytes()[:-32])
    body[6:8] = struct.pack("<H", 0)
    path.write_bytes(bytes(body) + hashlib.sha256(body).digest())
    with pytest.raises(CacheFileError, match="format version 0; this bie-trt reads version 1") as e:
        read_cache_file(path, IDENTITY)
    assert "\n" not in str(e.value)

def test_a_file_is_read_block_by_block(tmp_path):
    path = tmp_path / "big.kvc"
    write_cache_file(path, IDENTITY, [1], blocks(16, numel=128 * 1024))   # 16 blocks of 2 x 128-256 KiB
    size = path.stat().st_size
    tracemalloc.start()
    try:
        read_cache_file(path, IDENTITY)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert size > 4 * 2**20 and peak < size / 8, (size, peak)


def test_another_engines_file_is_refused_after_its_checksum_holds(tmp_path):
    path = tmp_path / "a.kvc"
    write_cache_file(path, IDENTITY, [1], blocks(2))
    with pytest.raises(CacheFileError, match="the engine with manifest sha256 abababababab"):
        read_cache_file(path, {**IDENTITY, "engine": "cd" * 32})
    with pytest.raises(CacheFileError, match="cannot read it"):
        read_cache_file(Path(tmp_path / "missing.kvc"), IDENTITY)
