"""Engines are checked against their manifest before serving; verify's exit codes; file permissions."""
from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from bie_trt import engine_format as ef
from bie_trt.cli import main
from bie_trt.config import EngineConfig
from bie_trt.errors import EngineError
from bie_trt.executor.model_runner import ModelRunner
from bie_trt.integrity import LEDGER, check_engine_files


@pytest.fixture()
def engine_copy(tmp_path, smollm2_engine, monkeypatch) -> Path:
    monkeypatch.setenv("BIE_TRT_CACHE", str(tmp_path / "cache"))   # a ledger of this test's own
    copy = tmp_path / "engine"
    shutil.copytree(smollm2_engine, copy)
    return copy


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_flipped_byte_in_the_weights_is_refused_unless_skipped(engine_copy):
    flip_byte(engine_copy / "weights.safetensors")
    with pytest.raises(EngineError, match=r"weights.safetensors: sha256 mismatch.*--skip-verify"):
        ModelRunner(EngineConfig(engine_dir=str(engine_copy), device="cpu"))
    # a byte inside tensor data still parses: the person who skips the check gets what they asked for
    ModelRunner(EngineConfig(engine_dir=str(engine_copy), device="cpu", skip_verify=True))


def test_a_missing_listed_file_is_refused(engine_copy):
    (engine_copy / "tokenizer.json").unlink()
    with pytest.raises(EngineError, match="tokenizer.json: missing"):
        check_engine_files(engine_copy, ef.read_manifest(engine_copy))


def test_verified_files_are_remembered_until_they_change(engine_copy, monkeypatch):
    hashed = []
    real = ef.sha256_file

    def counting(path):
        hashed.append(Path(path).name)
        return real(path)

    monkeypatch.setattr(ef, "sha256_file", counting)
    manifest = ef.read_manifest(engine_copy)
    check_engine_files(engine_copy, manifest)
    assert sorted(hashed) == sorted(Path(n).name for n in manifest.files)
    ledger = json.loads((Path(os.environ["BIE_TRT_CACHE"]) / LEDGER).read_text())
    assert str((engine_copy / "weights.safetensors").resolve()) in ledger
    assert not any(p.name == LEDGER for p in engine_copy.iterdir())   # the engine directory stays as built
    hashed.clear()
    check_engine_files(engine_copy, manifest)
    assert hashed == []                           # a restart over unchanged files hashes nothing
    flip_byte(engine_copy / "README.md")          # a new mtime: hashed again, and caught
    with pytest.raises(EngineError, match="README.md: sha256 mismatch"):
        check_engine_files(engine_copy, manifest)
    assert hashed == ["README.md"]


def test_verify_exit_codes_are_the_ones_its_help_states(engine_copy):
    runner = CliRunner()
    assert "0 the engine is intact, 1 a problem" in runner.invoke(main, ["verify", "--help"]).output
    assert runner.invoke(main, ["verify", str(engine_copy)]).exit_code == 0
    (engine_copy / "extra.bin").write_bytes(b"x")
    r = runner.invoke(main, ["verify", str(engine_copy)])
    assert r.exit_code == 1 and "extra.bin: not listed in the manifest" in r.stderr
    (engine_copy / "extra.bin").unlink()
    assert runner.invoke(main, ["verify", str(engine_copy), "--sm", "0"]).exit_code == 2   # a bad option


def _modes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): stat.S_IMODE(p.stat().st_mode) for p in [root, *root.rglob("*")]}


def test_built_engines_have_the_umask_permissions(smollm2_engine):
    umask = os.umask(0)
    os.umask(umask)
    want = {name: (0o777 if (smollm2_engine / name).is_dir() else 0o666) & ~umask
            for name in _modes(smollm2_engine)}
    assert _modes(smollm2_engine) == want


def test_set_umask_permissions_follows_the_umask(tmp_path):
    old = os.umask(0o027)
    try:
        root = Path(tempfile.mkdtemp(dir=tmp_path))   # 0700, as a build's temporary directory is
        (root / "sub").mkdir()
        (root / "sub" / "f").write_text("x")
        (root / "f").write_text("x")
        os.chmod(root / "f", 0o600)
        ef.set_umask_permissions(root)
    finally:
        os.umask(old)
    assert _modes(root) == {".": 0o750, "sub": 0o750, "sub/f": 0o640, "f": 0o640}


def rot(path: Path) -> None:
    """Bit rot: one byte changes, the size and the mtime (to the nanosecond) stay."""
    st = path.stat()
    flip_byte(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_a_sub_second_change_of_mtime_is_a_change(engine_copy):
    manifest = ef.read_manifest(engine_copy)
    readme = engine_copy / "README.md"
    second = readme.stat().st_mtime_ns // 10**9 * 10**9
    os.utime(readme, ns=(second, second + 100))
    check_engine_files(engine_copy, manifest)       # remembered with this mtime
    flip_byte(readme)
    os.utime(readme, ns=(second, second + 200))     # the same whole second
    with pytest.raises(EngineError, match="README.md: sha256 mismatch"):
        check_engine_files(engine_copy, manifest)


def test_bit_rot_after_a_verified_load_stops_the_server(engine_copy, caplog):
    import httpx

    from bie_trt import BieEngine
    from test_server import serving

    check_engine_files(engine_copy, ef.read_manifest(engine_copy))   # a first good load is remembered
    rot(engine_copy / "weights.safetensors")                        # inside tensor data: it still loads
    engine = BieEngine(EngineConfig(engine_dir=str(engine_copy), device="cpu", max_model_len=64))
    with serving(engine) as base:
        deadline = time.time() + 120
        while (health := httpx.get(base + "/health")).status_code == 200:
            assert time.time() < deadline, "the background check did not notice the changed weights"
            time.sleep(0.2)
        assert health.status_code == 503
        assert "weights.safetensors: sha256 mismatch" in health.json()["error"]["message"]
        r = httpx.post(base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
        assert r.status_code == 503 and "stopped serving" in r.json()["error"]["message"]
    assert any("failed its background sha256 check" in rec.getMessage() for rec in caplog.records)
    with pytest.raises(EngineError, match="weights.safetensors: sha256 mismatch"):   # nothing is trusted now
        ModelRunner(EngineConfig(engine_dir=str(engine_copy), device="cpu"))


def test_a_server_over_intact_files_stays_healthy_after_its_check(engine_copy, caplog):
    import httpx

    from bie_trt import BieEngine
    from test_server import serving

    caplog.set_level("INFO", logger="bie_trt.server")
    engine = BieEngine(EngineConfig(engine_dir=str(engine_copy), device="cpu", max_model_len=64))
    with serving(engine) as base:
        deadline = time.time() + 120
        while not any("every file matches its sha256 again" in rec.getMessage() for rec in caplog.records):
            assert time.time() < deadline, "the background check did not finish"
            time.sleep(0.2)
        assert httpx.get(base + "/health").status_code == 200
