"""The disk tier of the prefix cache: a prompt's blocks in files under a directory, so that the same prompt
after a restart is read back instead of prefilled again.

One file a block (the cache-file format of cache_file.py: the engine's identity, the block's token ids, its
K and V in the pool's own layout, a SHA-256), named by the block's prefix-cache key, in a subdirectory per
engine identity (`bie-kv-<digest>`), so engines share a directory without meeting. At start only the names
and sizes are read (the index); a block is read when a prompt misses the device and host tiers. A file is
written under a temporary name and renamed, so it appears whole or not at all; one that is torn, damaged,
or saved by another engine is refused by its checksum or identity, logged in one line and deleted.

Writes run on a writer thread, never on the engine loop: the loop hands over host copies of the blocks and
goes on. The tier is bounded in bytes over every engine's files in the directory: the least recently used
go first, before a write that would pass the bound. A slow disk (more than `MAX_PENDING_BYTES` waiting), a
full or read-only one only means blocks are not persisted: logged once, never a failed request.

Two servers on one directory: the first to start holds an exclusive lock on `.bie-kv-writer.lock` (an
flock, released when its process ends, however it ends) and is the only writer, so the bound is kept by
one process and no file is written twice at once; the others read it (and hit what it wrote before they
started) but persist nothing, which they log once.
"""
from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
from collections import OrderedDict, deque
from pathlib import Path
from typing import Callable

import torch

from .cache_file import CachedBlock, CacheFileError, read_cache_file, read_header, write_cache_file

log = logging.getLogger("bie_trt.disk_cache")

SUFFIX = ".kvb"
ENGINE_PREFIX = "bie-kv-"
LOCK_NAME = ".bie-kv-writer.lock"
DEFAULT_DISK_GB = 8.0            # serve's default bound (a quarter of the free space when that is less)
# host copies waiting for the writer beyond which a prompt's blocks are not persisted (a slow disk); a
# prompt handed over while nothing waits is always taken, however long (one 30k-token Llama-3-8B prompt
# with an INT4 body is about 1.1 GiB)
MAX_PENDING_BYTES = 1 << 30


def disk_bytes(gib: float | None, directory: Path) -> int:
    """`--disk-kv-cache-gb` in bytes: None takes the default (8 GiB, at most a quarter of the disk's free
    space), 0 turns the tier off."""
    if gib is None:
        existing = next(p for p in [directory, *directory.parents] if p.exists())
        return min(int(DEFAULT_DISK_GB * 2**30), shutil.disk_usage(existing).free // 4)
    if gib < 0:
        raise ValueError(f"disk_kv_cache_gb must be >= 0 (0 turns the disk tier off); got {gib}.")
    return int(gib * 2**30)


def engine_dirname(identity: dict) -> str:
    """The subdirectory of one engine identity's files."""
    return ENGINE_PREFIX + hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


@dataclasses.dataclass
class PendingBlock:
    """A block handed to the writer: its host copies (`ready` says when a device copy has landed)."""
    key: bytes
    quantised: bool
    token_ids: list[int]
    k: torch.Tensor
    v: torch.Tensor


class DiskTier:
    def __init__(self, root: Path, identity: dict, capacity_bytes: int, header: dict | None = None):
        """`identity`: what a file must match to be read (cache_blocks.cache_identity); `header`: written
        beside it, unchecked (the model's name, for `inspect-cache`)."""
        self.root, self.identity, self.capacity = root, identity, capacity_bytes
        self.header = {**identity, **(header or {})}
        self.dir = root / engine_dirname(identity)
        self._lock = threading.Lock()          # the index: the loop thread reads, the writer adds and evicts
        self._files: OrderedDict[Path, int] = OrderedDict()   # every engine's files, least recently used first
        self._keys: set[bytes] = set()         # this engine's blocks on disk
        self._queued: set[bytes] = set()       # handed to the writer, not written yet
        self.used = 0
        # prompt blocks found on disk only, and found in no tier (counted by the engine: disk_blocks.py)
        self.hit_blocks = self.missed_blocks = 0
        self.evictions = self.bad_files = 0
        self.bytes_read = self.bytes_written = 0
        self._warned: set[str] = set()
        self._todo: deque[tuple[list[PendingBlock], Callable[[], None] | None, int]] = deque()
        self._idle = threading.Condition(self._lock)   # notified when the writer ends
        self._pending = 0                      # bytes of the blocks in `_todo` and being written
        self._writer: threading.Thread | None = None
        self._lock_file = None
        self.writable = self._take_lock()
        self._scan()

    # -- start -------------------------------------------------------------------------------------------
    def _take_lock(self) -> bool:
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            tempfile.TemporaryFile(dir=self.dir).close()   # (a directory may refuse new files, not opening ones)
            f = open(self.root / LOCK_NAME, "a+")
        except OSError as e:
            self.warn_once("readonly", f"{self.root}: cannot write there ({e.strerror}); the disk KV cache reads "
                                       f"what it holds but persists no prompt.")
            return False
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.close()
            self.warn_once("shared", f"{self.root}: another bie-trt server writes this disk KV cache; this one "
                                     f"reads it but persists no prompt (give each server its own --kv-cache-dir to persist both).")
            return False
        self._lock_file = f
        return True

    def _scan(self) -> None:
        """The index: every engine's files by least recent use (their times), this engine's keys. Temporary
        files a crashed writer left are deleted by the writer that holds the lock now."""
        found = []
        for sub in self.root.glob(ENGINE_PREFIX + "*") if self.root.is_dir() else []:
            for entry in os.scandir(sub) if sub.is_dir() else []:
                if entry.name.endswith(".tmp") and self.writable:
                    Path(entry.path).unlink(missing_ok=True)
                elif entry.name.endswith(SUFFIX) and entry.is_file():
                    stat = entry.stat()
                    found.append((stat.st_mtime, Path(entry.path), stat.st_size))
        for _, path, size in sorted(found):
            self._files[path] = size
            self.used += size
            key = self._key_of(path)
            if key is not None:
                self._keys.add(key)
        if self.writable:   # a bound lowered since the last run
            with self._lock:
                self._evict_to(self.capacity)

    def warn_once(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning(message)

    # -- reads (the engine loop) ---------------------------------------------------------------------------
    def __contains__(self, key: bytes) -> bool:
        return key in self._keys

    def _path(self, key: bytes) -> Path:
        return self.dir / f"{key.hex()}{SUFFIX}"

    def _key_of(self, path: Path) -> bytes | None:
        """The key of one of this engine's files; None for another engine's, or a name this tier never
        writes (such a file is left alone, and counted in the bound)."""
        if path.parent != self.dir:
            return None
        try:
            return bytes.fromhex(path.name.removesuffix(SUFFIX))
        except ValueError:
            return None

    def read(self, key: bytes) -> CachedBlock | None:
        """The block stored under `key`, or None: gone (another server's eviction), or refused (damaged,
        torn, another engine's, another key's), which is logged in one line and deleted."""
        path = self._path(key)
        try:
            _, blocks = read_cache_file(path, self.identity)
            if len(blocks) != 1 or blocks[0].key != key:
                raise CacheFileError(f"{path}: holds another block than its name says.")
        except CacheFileError as e:
            if path.exists():
                self.bad_files += 1
                try:
                    path.unlink()
                    log.warning(f"disk KV cache: skipped and deleted {e}")
                except OSError as why:   # a read-only directory: skipped all the same, and forgotten
                    log.warning(f"disk KV cache: skipped {e} (cannot delete it: {why.strerror})")
            self._forget(path)
            return None
        with self._lock:
            if path in self._files:
                self._files.move_to_end(path)
                self.bytes_read += self._files[path]
        try:   # its time is the LRU order the next start reads
            os.utime(path)
        except OSError:
            pass
        return blocks[0]

    def _forget(self, path: Path) -> None:
        with self._lock:
            self.used -= self._files.pop(path, 0)
        self._keys.discard(self._key_of(path))

    # -- writes --------------------------------------------------------------------------------------------
    def write(self, blocks: list[PendingBlock], ready: Callable[[], None] | None = None) -> None:
        """Hand blocks to the writer (those not on disk or on their way); `ready` waits for their device
        copies. Never blocks: with too much waiting already, they are not persisted."""
        if not self.writable:
            return
        with self._lock:
            blocks = [b for b in blocks if b.key not in self._keys and b.key not in self._queued]
            size = sum(b.k.nbytes + b.v.nbytes for b in blocks)
            if not blocks:
                return
            if self._pending and self._pending + size > MAX_PENDING_BYTES:
                self.warn_once("slow", f"{self.root}: the disk KV cache's writes fall behind (over "
                                       f"{MAX_PENDING_BYTES >> 20} MiB waiting); prompts are not persisted meanwhile.")
                return
            self._pending += size
            self._queued.update(b.key for b in blocks)
            self._todo.append((blocks, ready, size))
            if self._writer is None:   # not a daemon: an ending process writes what it handed over first
                self._writer = threading.Thread(target=self._write_loop, name="bie-disk-kv-writer")
                self._writer.start()

    def _write_loop(self) -> None:
        """Write until nothing waits, then end (the next `write` starts another)."""
        while True:
            with self._lock:
                if not self._todo:
                    self._writer = None
                    self._idle.notify_all()
                    return
                blocks, ready, size = self._todo.popleft()
            try:
                if ready is not None:
                    ready()
                for block in blocks:
                    self._write_block(block)
            except Exception as e:   # never let the writer die: the tier degrades to "not cached"
                self.warn_once("error", f"{self.root}: the disk KV cache's writer failed ({e}); prompts are not "
                                        f"persisted.")
            finally:
                with self._lock:
                    self._queued.difference_update(b.key for b in blocks)
                    self._pending -= size

    def _write_block(self, block: PendingBlock) -> None:
        estimate = block.k.nbytes + block.v.nbytes + 4096   # the header is well under this
        if estimate > self.capacity:
            self.warn_once("small", f"{self.root}: one KV block (~{estimate:,} bytes) is larger than the disk KV "
                                    f"cache's bound ({self.capacity:,} bytes); nothing is persisted.")
            return
        with self._lock:
            self._evict_to(self.capacity - estimate)
        path = self._path(block.key)
        try:
            size = write_cache_file(path, self.header, block.token_ids,
                                    [CachedBlock(block.key, block.quantised, block.k, block.v)], durable=False)
        except OSError as e:
            self.warn_once("write", f"{self.root}: cannot write the disk KV cache ({e.strerror}); prompts are "
                                    f"not persisted until it can.")
            return
        with self._lock:
            self.used += size - self._files.pop(path, 0)
            self._files[path] = size
            self.bytes_written += size
            self._keys.add(block.key)
            self._evict_to(self.capacity, keep=path)

    def _evict_to(self, limit: int, keep: Path | None = None) -> None:
        """Delete the least recently used files until the tier holds at most `limit` bytes (under the lock)."""
        for path in list(self._files):
            if self.used <= limit:
                return
            if path == keep:
                continue
            self.used -= self._files.pop(path)
            self.evictions += 1
            self._keys.discard(self._key_of(path))
            try:
                path.unlink(missing_ok=True)
            except OSError as e:
                self.warn_once("evict", f"{self.root}: cannot delete {path.name} ({e.strerror}).")

    def flush(self) -> None:
        """Wait until every block handed over so far is written (or given up)."""
        with self._idle:
            while self._writer is not None:
                self._idle.wait()

    def close(self) -> None:
        """Finish the writes handed over, stop writing and let go of the directory's lock."""
        self.writable = False
        self.flush()
        if self._lock_file is not None:
            self._lock_file.close()   # (releases the flock)
            self._lock_file = None

    def stats(self) -> dict[str, int]:
        return {"capacity_bytes": self.capacity, "used_bytes": self.used, "files": len(self._files),
                "blocks": len(self._keys), "hit_blocks": self.hit_blocks, "missed_blocks": self.missed_blocks,
                "read_bytes": self.bytes_read, "written_bytes": self.bytes_written, "evictions": self.evictions,
                "bad_files": self.bad_files, "writable": int(self.writable)}


def describe(root: Path) -> dict:
    """What a disk-tier directory holds, from the files' headers (never their blocks): each engine's
    subdirectory (model, engine digest, KV format, blocks, tokens, bytes, the last use) and the cache files
    saved beside them. For `bie-trt inspect-cache`."""
    engines, saved = [], []
    for sub in sorted(root.glob(ENGINE_PREFIX + "*")):
        entry = {"directory": sub.name, "model": None, "engine": None, "kv_dtype": None, "blocks": 0, "tokens": 0,
                 "bytes": 0, "unreadable": 0, "last_used": None}
        for path in sub.glob(f"*{SUFFIX}"):
            stat = path.stat()
            entry["bytes"] += stat.st_size
            entry["last_used"] = max(entry["last_used"] or 0.0, stat.st_mtime)
            try:
                header = read_header(path)
            except CacheFileError:
                entry["unreadable"] += 1
                continue
            entry["blocks"] += 1
            entry["tokens"] += len(header.get("token_ids", []))
            entry["model"] = entry["model"] or header.get("model")
            entry["engine"] = entry["engine"] or header.get("engine")
            entry["kv_dtype"] = entry["kv_dtype"] or (header.get("kv_layout") or {}).get("dtype")
        engines.append(entry)
    for path in sorted(p for p in root.iterdir() if p.is_file() and not p.name.startswith(".")) if root.is_dir() else []:
        try:
            header = read_header(path)
        except CacheFileError:
            continue   # not a cache file: the user's own
        saved.append({"file": path.name, "tokens": len(header.get("token_ids", [])),
                      "blocks": len(header.get("blocks", [])), "bytes": path.stat().st_size,
                      "engine": header.get("engine")})
    return {"directory": str(root), "engines": engines, "saved_files": saved,
            "bytes": sum(e["bytes"] for e in engines)}
