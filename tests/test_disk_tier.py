"""The disk tier of the KV cache: a prompt's blocks persisted to files under --kv-cache-dir survive a restart
(the same prompt is then read back, not prefilled), and the directory never serves a wrong block nor grows
past its bound, whatever lies in it or however the disk fails.

On the shared tiny random model with an INT4 body (FP16 sinks and window), where a block read one bit
differently soon flips a greedy token."""
from __future__ import annotations

import contextlib
import logging
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from bie_trt import BieEngine, EngineConfig, SamplingParams
from bie_trt.executor.cache_blocks import cache_identity
from bie_trt.cache_tiers.cache_file import read_cache_file, read_header, write_cache_file
from bie_trt.cache_tiers import disk_cache
from bie_trt.cache_tiers.disk_cache import SUFFIX, DiskTier, PendingBlock, engine_dirname
from bie_trt.cache_tiers.prefix_cache import block_key
from bie_trt.server.app import ServerOptions
from test_server import serving

PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
BODY = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 20000) for _ in range(length)]


def engine(tiny_engine: Path, directory: Path | None, **config) -> BieEngine:
    kv = {"kv_cache_dtype": "int4_asym", "kv_group_size": 32, "kv_window": 64, "kv_sink_tokens": 16, **config}
    return BieEngine(EngineConfig(engine_dir=str(tiny_engine), device="cpu", max_num_seqs=2, host_kv_cache_gb=0,
                                  kv_cache_dir=None if directory is None else str(directory), **kv))


def files(directory: Path) -> list[Path]:
    return sorted(directory.glob(f"bie-kv-*/*{SUFFIX}"))


def tier_bytes(directory: Path) -> int:
    return sum(f.stat().st_size for f in files(directory))


@pytest.fixture(scope="module")
def reference(tiny_engine) -> BieEngine:
    """The engine with no disk tier: the replies every damaged directory must still give."""
    bie = engine(tiny_engine, Path("unused"), disk_kv_cache_gb=0)
    assert bie.core.disk is None and bie.stats().disk_kv == {}
    return bie


@pytest.fixture(scope="module")
def tiered(tiny_engine, tmp_path_factory) -> BieEngine:
    """One engine with a disk tier for the tests that damage it: each with prompts of its own."""
    bie = engine(tiny_engine, tmp_path_factory.mktemp("tiered"))
    yield bie
    bie.close()


def cold(reference: BieEngine, ids: list[int]) -> list[int]:
    reference.reset_prefix_cache()
    return reference.generate(ids, PARAMS).token_ids


def block_file(bie: BieEngine, ids: list[int], b: int) -> Path:
    """The file of block b of prompt `ids` (found by the token ids its header records)."""
    want = ids[b * 16:(b + 1) * 16]
    return next(f for f in files(bie.core.disk.root) if read_header(f)["token_ids"] == want)


def restart_through_the_server(tiny_engine: Path, directory: Path, length: int) -> dict:
    """The prompt over HTTP, the server stopped, a new one on the same directory, the prompt again."""
    ids = prompt(1, length)
    replies = []
    for _ in range(2):
        bie = engine(tiny_engine, directory)
        with serving(bie) as base:
            r = httpx.post(base + "/v1/completions", json={"prompt": ids, **BODY}, timeout=300)
            assert r.status_code == 200, r.text
            replies.append(r.json())
            metrics = httpx.get(base + "/metrics").text
        bie.close()
    first, again = replies
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 0.9 * length and cached == (length - 1) // 16 * 16
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    assert f"bie_disk_kv_cache_hits_total {float(cached)}" in metrics
    return {"cached": cached, "metrics": metrics}


def test_a_restarted_server_reads_the_prompt_back_from_disk(tiny_engine, tmp_path):
    out = restart_through_the_server(tiny_engine, tmp_path, 400)
    assert "bie_disk_kv_cache_misses_total 0.0" in out["metrics"]   # the second run's: every block was on disk
    read = next(line for line in out["metrics"].splitlines() if line.startswith('bie_disk_kv_bytes_total{direction="read"}'))
    assert float(read.split()[-1]) > 0


@pytest.mark.slow
def test_a_restarted_server_reads_a_2000_token_prompt_back_from_disk(tiny_engine, tmp_path):
    restart_through_the_server(tiny_engine, tmp_path, 2000)


@contextlib.contextmanager
def logged(caplog):
    with caplog.at_level(logging.WARNING, logger="bie_trt.disk_cache"):
        yield caplog.records


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def another_engines(path: Path) -> None:
    """The same block, as an engine with other weights (another manifest digest) would have saved it."""
    header = read_header(path)
    identity = {"engine": "0" * 64, "kv_layout": header["kv_layout"]}
    ids, (block,) = read_cache_file(path, {})
    g = torch.Generator().manual_seed(0)   # other weights: other K/V, of the same shape
    block.k, block.v = (torch.randn(t.shape, generator=g) * 8 if t.is_floating_point()
                        else torch.randint(0, 256, t.shape, generator=g, dtype=torch.uint8) for t in (block.k, block.v))
    write_cache_file(path, identity, ids, [block])


def another_blocks(path: Path) -> None:
    """A whole, checksummed file of this engine, under another block's name."""
    size = path.stat().st_size   # an FP16 block too, which a hit would read as this one
    other = next(f for f in sorted(path.parent.glob(f"*{SUFFIX}")) if f != path and abs(f.stat().st_size - size) < 256)
    path.write_bytes(other.read_bytes())


DAMAGES = [flip_a_byte, truncate, another_engines, another_blocks]


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_or_foreign_file_is_skipped_logged_and_deleted(tiered, reference, caplog, damage):
    ids = prompt(40 + DAMAGES.index(damage), 200)
    tiered.generate(ids, PARAMS)
    tiered.core.disk.flush()
    victim = block_file(tiered, ids, 11)   # the last block a hit covers: FP16, in the window
    damage(victim)
    tiered.reset_prefix_cache()   # the device forgets the prompt; the disk is read as after a restart
    bad = tiered.stats().disk_kv["bad_files"]
    with logged(caplog) as records:
        got = tiered.generate(ids, PARAMS)
    assert got.token_ids == cold(reference, ids)
    assert got.usage.cached_tokens < 192   # not the whole prompt: the damaged block was computed again
    assert len(records) == 1 and f"skipped and deleted {victim}" in records[0].getMessage()
    assert tiered.stats().disk_kv["bad_files"] == bad + 1
    tiered.core.disk.flush()   # ... and persisted again, whole
    assert read_cache_file(victim, cache_identity(tiered.core.runner))[0] == ids[176:192]


def test_a_read_only_directory_is_read_and_never_written(tiny_engine, tiered, reference, tmp_path, caplog):
    ids, other = prompt(5, 200), prompt(6, 100)
    tiered.generate(ids, PARAMS)
    tiered.core.disk.flush()
    (tmp_path / tiered.core.disk.dir.name).mkdir()
    for b in range(12):   # the prompt's files, as a server that ran on this directory left them
        f = block_file(tiered, ids, b)
        (tmp_path / tiered.core.disk.dir.name / f.name).write_bytes(f.read_bytes())
    before = {f: f.stat().st_size for f in files(tmp_path)}
    lock = (["chattr", "+i"], ["chattr", "-i"]) if os.geteuid() == 0 else None   # root writes past mode bits
    dirs = [tmp_path, *tmp_path.glob("bie-kv-*")]
    try:
        if lock:
            subprocess.run(lock[0] + [str(d) for d in dirs], check=True)
        else:
            for d in dirs:
                d.chmod(0o555)
        with logged(caplog) as records:
            again = engine(tiny_engine, tmp_path)
            hit = again.generate(ids, PARAMS)
            fresh = again.generate(other, PARAMS)
            again.close()
        assert hit.usage.cached_tokens == 192 and hit.token_ids == cold(reference, ids)
        assert fresh.token_ids == cold(reference, other)
        assert len(records) == 1 and "cannot write there" in records[0].getMessage()
        assert {f: f.stat().st_size for f in files(tmp_path)} == before
    finally:
        if lock:
            subprocess.run(lock[1] + [str(d) for d in dirs], check=True)
        else:
            for d in dirs:
                d.chmod(0o755)


def test_a_bound_smaller_than_a_block_persists_nothing_and_says_so(tiny_engine, reference, tmp_path, caplog):
    ids = prompt(7, 100)
    with logged(caplog) as records:
        bie = engine(tiny_engine, tmp_path, disk_kv_cache_gb=1000 / 2**30)
        got = bie.generate(ids, PARAMS)
        bie.close()
    assert got.token_ids == cold(reference, ids) and files(tmp_path) == []
    assert len(records) == 1 and "larger than the disk KV cache's bound" in records[0].getMessage()


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 64 KiB file system: writes past it fail with ENOSPC, as on a full disk."""
    mount = tmp_path / "full"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)],
                      capture_output=True).returncode:
        pytest.skip("needs to mount a small tmpfs (root with CAP_SYS_ADMIN)")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_a_full_disk_degrades_to_not_cached(tiny_engine, reference, small_tmpfs, caplog):
    ids = [prompt(8 + i, 300) for i in range(3)]
    with logged(caplog) as records:
        bie = engine(tiny_engine, small_tmpfs, disk_kv_cache_gb=1)
        got = [bie.generate(p, PARAMS).token_ids for p in ids]
        bie.close()
    assert got == [cold(reference, p) for p in ids]
    assert len(records) == 1 and "No space left on device" in records[0].getMessage()
    assert not list(small_tmpfs.glob("bie-kv-*/.*.tmp"))   # a failed write leaves no temporary file


def test_the_bound_holds_under_a_stream_of_distinct_prompts(tiny_engine, tiered, tmp_path):
    tiered.generate(prompt(9, 120), PARAMS)
    tiered.core.disk.flush()
    one = max(f.stat().st_size for f in files(tiered.core.disk.root))   # an FP16 block's file
    bound = 12 * one
    bie = engine(tiny_engine, tmp_path, disk_kv_cache_gb=bound / 2**30)
    for seed in range(10, 16):
        bie.generate(prompt(seed, 120), PARAMS)
        bie.core.disk.flush()
        assert tier_bytes(tmp_path) <= bound
    stats = bie.stats().disk_kv
    assert stats["evictions"] > 0 and stats["used_bytes"] == tier_bytes(tmp_path)
    bie.reset_prefix_cache()   # the newest prompt is read back from disk; the oldest went first
    assert bie.generate(prompt(15, 120), PARAMS).usage.cached_tokens == 112
    assert bie.generate(prompt(10, 120), PARAMS).usage.cached_tokens == 0
    bie.close()


def test_two_servers_on_one_directory_one_writes_the_other_reads(tiny_engine, tiered, caplog):
    ids, other = prompt(20, 150), prompt(21, 150)
    tiered.generate(ids, PARAMS)
    tiered.core.disk.flush()
    with logged(caplog) as records:
        reader = engine(tiny_engine, tiered.core.disk.root)
    assert len(records) == 1 and "another bie-trt server writes" in records[0].getMessage()
    assert reader.generate(ids, PARAMS).usage.cached_tokens == 144   # what the writer wrote before it started
    reader.generate(other, PARAMS)
    reader.close()
    first_block = tiered.core.disk.dir / f"{block_key(None, other[:16]).hex()}{SUFFIX}"
    assert reader.stats().disk_kv["written_bytes"] == 0 and not first_block.exists()


def test_inspect_cache_lists_each_engines_blocks(tiered):
    import json

    from click.testing import CliRunner

    from bie_trt.cli import main

    root = tiered.core.disk.root
    assert tiered.core.disk.dir == root / engine_dirname(cache_identity(tiered.core.runner))
    tiered.generate(prompt(30, 100), PARAMS)
    tiered.core.disk.flush()
    out = CliRunner().invoke(main, ["inspect-cache", str(root), "--json"])
    assert out.exit_code == 0, out.output
    (entry,) = json.loads(out.stdout)["engines"]
    assert entry["blocks"] == len(files(root)) and entry["tokens"] == 16 * entry["blocks"]
    assert entry["bytes"] == tier_bytes(root) and entry["model"] == tiered.model_name
    table = CliRunner().invoke(main, ["inspect-cache", str(root)]).stdout
    assert entry["directory"] in table and f"{entry['blocks']} blocks" in table


def pending(key: int) -> PendingBlock:
    return PendingBlock(bytes([key]) * 16, False, list(range(16)), torch.zeros(2, 64), torch.zeros(2, 64))


def test_a_slow_disk_never_blocks_the_loop_and_drops_what_falls_behind(tmp_path, caplog, monkeypatch):
    """The loop hands blocks over and goes on while the writer waits (here on a copy that has not landed);
    more handed over while too much waits is not persisted, and said once."""
    monkeypatch.setattr(disk_cache, "MAX_PENDING_BYTES", 1000)
    tier = DiskTier(tmp_path, {"engine": "ab" * 32}, 1 << 20)
    landed = threading.Event()
    with logged(caplog) as records:
        start = time.perf_counter()
        tier.write([pending(1)], ready=landed.wait)   # the writer now waits on it
        tier.write([pending(2)])
        tier.write([pending(3)])
        assert time.perf_counter() - start < 1
        landed.set()
        tier.flush()
    assert pending(1).key in tier and pending(2).key not in tier and pending(3).key not in tier
    assert len(records) == 1 and "writes fall behind" in records[0].getMessage()
    tier.close()


def test_a_crashed_writers_temporary_files_are_deleted_at_start(tmp_path):
    tier = DiskTier(tmp_path, {"engine": "ab" * 32}, 1 << 20)
    tier.write([pending(1)])
    tier.close()
    torn = tier.dir / f".{pending(2).key.hex()}{SUFFIX}.x1y2.tmp"   # as write_cache_file names them
    torn.write_bytes(b"BIEKVC half a file")
    again = DiskTier(tmp_path, {"engine": "ab" * 32}, 1 << 20)
    assert not torn.exists() and pending(1).key in again and pending(2).key not in again
    assert again.read(pending(1).key).k.shape == (2, 64)
    again.close()


# A writer in a process of its own: it takes the directory's lock, has a block half written (its temporary
# file, named as write_cache_file names them), says so, and holds the lock until told to end.
WRITER = """
import sys
from pathlib import Path
from bie_trt.cache_tiers.disk_cache import SUFFIX, DiskTier
tier = DiskTier(Path(sys.argv[1]), {"engine": "ab" * 32}, 1 << 20)
assert tier.writable
(tier.dir / f".{'07' * 16}{SUFFIX}.x1y2.tmp").write_bytes(b"BIEKVC half a file")
print("writing", flush=True)
sys.stdin.readline()
tier.close()
"""


def test_a_reader_leaves_the_writers_temporary_files_alone(tmp_path):
    """A second server starting on the directory while the first writes only reads it: the writer's file in
    flight stays (deleting it would fail the writer's rename); once the writer is gone, the next writer to
    start deletes what it left."""
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline() == "writing\n"
        (in_flight,) = tmp_path.glob("bie-kv-*/.*.tmp")
        reader = DiskTier(tmp_path, {"engine": "ab" * 32}, 1 << 20)
        assert not reader.writable and in_flight.exists()
        reader.close()
    finally:
        writer.communicate("end\n", timeout=60)
    assert writer.returncode == 0
    after = DiskTier(tmp_path, {"engine": "ab" * 32}, 1 << 20)
    assert after.writable and not in_flight.exists()
    after.close()


def big_block(key: int) -> PendingBlock:
    """A block whose file is far larger than the 4 KiB the writer allows its header."""
    return PendingBlock(bytes([key]) * 16, False, list(range(16)), torch.zeros(2, 2048), torch.zeros(2, 2048))


def test_a_block_read_back_is_evicted_after_those_not_read_since(tmp_path):
    """The bound evicts the least recently used file, not the oldest written: a block read back goes to the
    end of the order, in this process and (by its file's time) in the next one to start on the directory."""
    identity = {"engine": "ab" * 32}
    tier = DiskTier(tmp_path, identity, 1 << 20)
    tier.write([big_block(9)])
    tier.flush()
    size = files(tmp_path)[0].stat().st_size
    tier.close()
    shutil.rmtree(tier.dir)
    tier = DiskTier(tmp_path, identity, 3 * size + 4096)   # three files, not four
    tier.write([big_block(1), big_block(2), big_block(3)])
    tier.flush()
    assert tier.read(big_block(1).key) is not None
    tier.write([big_block(4)])
    tier.flush()
    assert [k for k in (1, 2, 3, 4) if big_block(k).key in tier] == [1, 3, 4]
    tier.close()
    path = {k: tier.dir / f"{big_block(k).key.hex()}{SUFFIX}" for k in (1, 3, 4)}
    now = time.time()
    for age, k in ((300, 1), (200, 3), (100, 4)):   # 1 now the oldest on disk, read back by the next start
        os.utime(path[k], (now - age, now - age))
    again = DiskTier(tmp_path, identity, 3 * size + 4096)
    assert again.read(big_block(1).key) is not None
    again.close()
    last = DiskTier(tmp_path, identity, 3 * size + 4096)
    last.write([big_block(5)])
    last.flush()
    assert [k for k in (1, 3, 4, 5) if big_block(k).key in last] == [1, 4, 5]
    assert sorted(files(tmp_path)) == sorted([path[1], path[4], tier.dir / f"{big_block(5).key.hex()}{SUFFIX}"])
    last.close()


def test_engines_whose_identities_differ_in_one_value_keep_apart(tiny_engine, tiered):
    """Two engines of one model whose KV layouts differ in a value (the window), on one directory: each has a
    folder of its own, so neither reads the other's file of the same prompt block, refuses it as foreign and
    deletes it; the first still reads its prompt back whole."""
    ids = prompt(50, 150)
    tiered.generate(ids, PARAMS)
    tiered.core.disk.flush()
    mine = {f: f.stat().st_size for f in files(tiered.core.disk.root) if f.parent == tiered.core.disk.dir}
    other = engine(tiny_engine, tiered.core.disk.root, kv_window=32)
    ours, theirs = cache_identity(tiered.core.runner), cache_identity(other.core.runner)
    assert ours.keys() == theirs.keys() and ours["kv_layout"].keys() == theirs["kv_layout"].keys() and ours != theirs
    assert other.core.disk.dir != tiered.core.disk.dir
    assert other.generate(ids, PARAMS).usage.cached_tokens == 0
    other.close()
    assert {f: f.stat().st_size for f in mine if f.exists()} == mine and other.stats().disk_kv["bad_files"] == 0
    tiered.reset_prefix_cache()
    assert tiered.generate(ids, PARAMS).usage.cached_tokens == 144
