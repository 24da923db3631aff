"""`bie-trt quantize`: a group size that does not divide is refused before any weight is read, the
default group size divides, the result appears only when complete, and --force works as build's."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from bie_trt.builder.checkpoint import quantize as quantize_module
from bie_trt.builder.checkpoint.registry import BUILTIN, _gguf_path
from bie_trt.cli import main
from tiny_model import write_tiny_hf


def quantize(*args):
    return CliRunner().invoke(main, ["quantize", *map(str, args)])


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory, smollm2_checkpoint):
    return write_tiny_hf(tmp_path_factory.mktemp("hf") / "hf", smollm2_checkpoint, hidden_size=96,
                         intermediate_size=192, num_attention_heads=3, num_key_value_heads=1)


def test_a_group_size_that_does_not_divide_is_refused_before_the_weights_load(tmp_path, monkeypatch):
    def no_load(*a, **k):
        raise AssertionError("the weights were read before the group size was checked")

    monkeypatch.setattr(quantize_module, "_load_gguf", no_load)
    gguf = _gguf_path(BUILTIN["smollm2-135m"])
    r = quantize("--model", gguf, "--out", tmp_path / "out", "--group-size", 128)
    assert r.exit_code == 2, r.output
    assert "group size 128 does not divide hidden_size = 576; use --group-size 64 or 32." in r.output
    assert list(tmp_path.iterdir()) == []   # no --out folder, no leftovers


def test_the_default_group_size_is_the_largest_that_divides(tiny_hf, tmp_path):
    r = quantize("--model", tiny_hf, "--out", tmp_path / "out")
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]["group_size"] == 32


def test_a_non_empty_out_needs_force_and_a_failure_leaves_nothing(tiny_hf, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    r = quantize("--model", tiny_hf, "--out", out, "--group-size", 32)
    assert r.exit_code == 2 and "exists and is not empty; pass --force" in r.output
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    r = quantize("--model", tiny_hf, "--out", out, "--group-size", 32, "--force")
    assert r.exit_code == 0, r.output
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").exists()

    broken = tmp_path / "broken"
    broken.mkdir()
    for f in tiny_hf.iterdir():
        (broken / f.name).write_bytes(f.read_bytes()[:1000] if f.suffix == ".safetensors" else f.read_bytes())
    r = quantize("--model", broken, "--out", tmp_path / "new", "--group-size", 32)
    assert r.exit_code != 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken", "out"]   # no partial "new", no temp folder
