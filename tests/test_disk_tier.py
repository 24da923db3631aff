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
import subprocess
from pathlib import Path

import httpx
import pytest
import torch

from bie_trt import BieEngine, EngineConfig, SamplingParams
from bie_trt.executor.cache_blocks import cache_identity
from bie_trt.executor.cache_file import read_cache_file, read_header, write_cache_file
from bie_trt.executor.disk_cache import SUFFIX, engine_dirname
from bie_trt.server.app import ServerOptions
from test_server import serving

PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
BODY = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 20000) for _ in range(length)]


def engine(tiny_engine: Path, directory: Path | None, **config) -> BieEngine:
    return BieEngine(EngineConfig(engine_dir=str(tiny_engine), device="cpu", kv_cache_dtype="int4_asym",
                                  kv_group_size=32, kv_window=64, kv_sink_tokens=16, max_num_seqs=2, host_kv_cache_gb=0,
                                  kv_cache_dir=None if directory is None else str(directory), **config))


def files(directory: Path) -> list[Path]:
    return sorted(directory.glob(f"bie-kv-*/*{SUFFIX}"))


def tier_bytes(directory: Path) -> int:
    return sum(f.stat().st_size for f in files(directory))


def cold(tiny_engine: Path, ids: list[int]):
    """The reply with no cache at all: what every damaged directory must still give."""
    return engine(tiny_engine, None).generate(ids, PARAMS)


def persisted(tiny_engine: Path, directory: Path, ids: list[int], **config) -> None:
    """Serve `ids` once on `directory` and stop (the writes finished, the directory let go)."""
    first = engine(tiny_engine, directory, **config)
    first.generate(ids, PARAMS)
    first.close()


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
    block.k = block.k + 1 if block.k.is_floating_point() else block.k ^ 0x55   # other weights, other K/V
    write_cache_file(path, identity, ids, [block])


@pytest.mark.parametrize("damage", [flip_a_byte, truncate, another_engines])
def test_a_damaged_or_foreign_file_is_skipped_logged_and_deleted(tiny_engine, tmp_path, caplog, damage):
    ids = prompt(2, 200)
    persisted(tiny_engine, tmp_path, ids)
    want = cold(tiny_engine, ids)
    victim = files(tmp_path)[len(files(tmp_path)) // 2]
    damage(victim)
    again = engine(tiny_engine, tmp_path)
    with logged(caplog) as records:
        got = again.generate(ids, PARAMS)
    assert got.token_ids == want.token_ids
    assert 0 < got.usage.cached_tokens < want.usage.prompt_tokens - 16   # the blocks before the bad one hit
    assert [r.getMessage() for r in records if victim.name in r.getMessage()] != []
    assert len(records) == 1 and "skipped and deleted" in records[0].getMessage()
    assert not victim.exists() and again.stats().disk_kv["bad_files"] == 1
    again.close()


def test_a_read_only_directory_is_read_and_never_written(tiny_engine, tmp_path, caplog):
    ids, other = prompt(3, 200), prompt(4, 100)
    persisted(tiny_engine, tmp_path, ids)
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
        assert hit.usage.cached_tokens == (len(ids) - 1) // 16 * 16
        assert fresh.token_ids == cold(tiny_engine, other).token_ids
        assert len(records) == 1 and "cannot write there" in records[0].getMessage()
        assert {f: f.stat().st_size for f in files(tmp_path)} == before
        again.close()
    finally:
        if lock:
            subprocess.run(lock[1] + [str(d) for d in dirs], check=True)
        else:
            for d in dirs:
                d.chmod(0o755)


def test_a_bound_smaller_than_a_block_persists_nothing_and_says_so(tiny_engine, tmp_path, caplog):
    ids = prompt(5, 100)
    with logged(caplog) as records:
        bie = engine(tiny_engine, tmp_path, disk_kv_cache_gb=1000 / 2**30)
        got = bie.generate(ids, PARAMS)
        bie.close()
    assert got.token_ids == cold(tiny_engine, ids).token_ids and files(tmp_path) == []
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


def test_a_full_disk_degrades_to_not_cached(tiny_engine, small_tmpfs, caplog):
    ids = [prompt(6 + i, 300) for i in range(3)]
    want = [cold(tiny_engine, p).token_ids for p in ids]
    with logged(caplog) as records:
        bie = engine(tiny_engine, small_tmpfs, disk_kv_cache_gb=1)
        got = [bie.generate(p, PARAMS).token_ids for p in ids]
        bie.close()
    assert got == want
    assert len(records) == 1 and "No space left on device" in records[0].getMessage()
    assert not list(small_tmpfs.glob("bie-kv-*/.*.tmp"))   # a failed write leaves no temporary file


def test_the_bound_holds_under_a_stream_of_distinct_prompts(tiny_engine, tmp_path):
    ids = prompt(9, 120)
    persisted(tiny_engine, tmp_path, ids)
    one = max(f.stat().st_size for f in files(tmp_path))
    bound = 12 * one
    bie = engine(tiny_engine, tmp_path, disk_kv_cache_gb=bound / 2**30)
    for seed in range(10, 16):
        bie.generate(prompt(seed, 120), PARAMS)
        bie.disk.flush()
        assert tier_bytes(tmp_path) <= bound
    stats = bie.stats().disk_kv
    assert stats["evictions"] > 0 and stats["used_bytes"] == tier_bytes(tmp_path)
    bie.close()
    # the newest prompt survives; the oldest went first
    again = engine(tiny_engine, tmp_path, disk_kv_cache_gb=bound / 2**30)
    assert again.generate(prompt(15, 120), PARAMS).usage.cached_tokens == 112
    assert again.generate(ids, PARAMS).usage.cached_tokens == 0
    again.close()


def test_two_servers_on_one_directory_one_writes_the_other_reads(tiny_engine, tmp_path, caplog):
    ids, other = prompt(20, 150), prompt(21, 150)
    persisted(tiny_engine, tmp_path, ids)
    writer = engine(tiny_engine, tmp_path)
    with logged(caplog) as records:
        reader = engine(tiny_engine, tmp_path)
    assert len(records) == 1 and "another bie-trt server writes" in records[0].getMessage()
    assert reader.generate(ids, PARAMS).usage.cached_tokens == 144
    reader.generate(other, PARAMS)
    writer.generate(other, PARAMS)
    writer.disk.flush()
    assert writer.stats().disk_kv["written_bytes"] > 0 and reader.stats().disk_kv["written_bytes"] == 0
    writer.close()
    reader.close()


def test_inspect_cache_lists_each_engines_blocks(tiny_engine, tmp_path):
    import json

    from click.testing import CliRunner

    from bie_trt.cli import main

    persisted(tiny_engine, tmp_path, prompt(30, 100))
    out = CliRunner().invoke(main, ["inspect-cache", str(tmp_path), "--json"])
    assert out.exit_code == 0, out.output
    (entry,) = json.loads(out.stdout)["engines"]
    assert entry["blocks"] == len(files(tmp_path)) == 6 + 2   # the INT4 body and the FP16 sinks and window
    assert entry["bytes"] == tier_bytes(tmp_path) and entry["model"]
    table = CliRunner().invoke(main, ["inspect-cache", str(tmp_path)]).stdout
    assert entry["directory"] in table and "8 blocks" in table


def test_the_engines_identity_names_its_directory(tiny_engine, tmp_path):
    bie = engine(tiny_engine, tmp_path)
    assert bie.disk.dir == tmp_path / engine_dirname(cache_identity(bie.runner))
    other = engine(tiny_engine, tmp_path, kv_cache_dtype="fp8")
    assert other.disk is not None and other.disk.dir != bie.disk.dir
    bie.close()
    other.close()
    off = engine(tiny_engine, tmp_path, disk_kv_cache_gb=0)
    assert off.disk is None and off.stats().disk_kv == {}
