"""Key centering chosen at build time from measured keys (builder/kv_choice.py): the measurement decides, an
explicit option wins, and the engine runs with the setting its manifest records."""
from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from bie_trt.builder import kv_choice
from bie_trt.builder.build import BuildOptions, build_engine
from bie_trt.builder.kv_choice import choose_key_centering, relative_key_error
from bie_trt.cli import main
from bie_trt.config import EngineConfig, KVCacheConfig
from bie_trt.executor.model_runner import ModelRunner


def keys_with_offset(offset: float) -> torch.Tensor:
    """[L=3, Hkv=2, T=64, D=64] keys of unit variation; layer 1, head 0 also carries a shared `offset` in one
    channel (as Qwen2's k_proj bias gives a few layers)."""
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(3, 2, 64, 64, generator=g)
    keys[1, 0, :, 5] += offset
    return keys


def test_error_is_rounding_over_variation_measured_independently():
    """Unrotated INT4, one group a token: x̂ = round((x - min) / s)·s + min with s = (max - min) / 15, in float64
    here; the shared offset stretches each token's range and so its step, and nothing else."""
    kv = KVCacheConfig(dtype="int4_asym", rotation="none")
    keys = keys_with_offset(100.0)
    err = relative_key_error(keys, None, kv)
    x = keys[1, 0].double()
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    step = (hi - lo) / 15
    rounding = ((x - lo) / step).round() * step + lo - x
    variation = x - x.mean(0)
    expected = rounding.pow(2).mean().sqrt() / variation.pow(2).mean().sqrt()
    assert err[1, 0].item() == pytest.approx(expected.item(), rel=0.01)
    assert err[0, 0] < 0.2 and err[1, 0] > 1


def test_the_measurement_decides():
    kv = KVCacheConfig(dtype="int4_asym")
    records = {}
    for offset, want in ((100.0, True), (0.0, False)):
        keys = keys_with_offset(offset)
        chosen, records[offset] = choose_key_centering(keys, keys.mean(dim=2), kv, explicit=None)
        assert chosen.key_centering is want and records[offset]["key_centering"] is want, (offset, records[offset])
        assert records[offset]["why"].startswith("measured")
    # the offset layer is the worst one without centering, and centering brings it to the others' level
    per_layer = records[100.0]["key_error_per_layer"]
    assert per_layer["without_centering"][1] == max(per_layer["without_centering"]) > 0.5
    assert max(per_layer["with_centering"]) < 0.2


def test_fp8_is_measured_but_not_centred():
    """FP8's error is relative to each value: a rotated offset spreads into every channel and the varying part
    drowns, and the measurement shows it; centring is not chosen for FP8 (measured worse on the engine)."""
    keys = keys_with_offset(100.0)
    chosen, record = choose_key_centering(keys, keys.mean(dim=2), KVCacheConfig(dtype="fp8"), explicit=None)
    assert not chosen.key_centering and record["measured_format"] == "fp8"
    w = record["worst_key_error"]
    assert w["with_centering"] < w["without_centering"] / 3


def test_an_explicit_option_and_a_family_default_win():
    keys = keys_with_offset(100.0)
    chosen, record = choose_key_centering(keys, keys.mean(dim=2), KVCacheConfig(dtype="int4_asym"), explicit=False)
    assert not chosen.key_centering and record["why"] == "set by the build option"
    flat = keys_with_offset(0.0)
    chosen, record = choose_key_centering(flat, flat.mean(dim=2), KVCacheConfig(dtype="int4_asym", key_centering=True),
                                          explicit=None)
    assert chosen.key_centering and record["why"] == "the model family's default"


@pytest.mark.slow
def test_the_engine_runs_with_the_recorded_choice(smollm2_checkpoint, tmp_path, monkeypatch):
    """SmolLM2's keys are within the bound (centering stays off); with the bound at 0 the build must turn it
    on, and the manifest's kv, its kv_choice, the runner and `inspect` must all say so."""
    monkeypatch.setattr(kv_choice, "KEY_ERROR_BOUND", 0.0)
    out = build_engine(BuildOptions(checkpoint=str(smollm2_checkpoint), out=str(tmp_path / "e"), profile="cpu",
                                    max_model_len=2048, kv_cache_dtype="int4_asym"), log=lambda m: None)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["kv_choice"]["key_centering"] is True and manifest["kv_choice"]["bound"] == 0.0
    assert manifest["kv"]["key_centering"] is True
    runner = ModelRunner(EngineConfig(engine_dir=str(out), device="cpu", max_num_seqs=1, num_kv_blocks=4))
    assert runner.kv_config.key_centering is True
    shown = CliRunner().invoke(main, ["inspect", str(out)])
    assert shown.exit_code == 0, shown.output
    assert "key centering on: measured: worst key error without centering" in shown.output


@pytest.mark.parametrize("dtype", ["int4_asym", "fp8"])
def test_every_key_shifts_by_the_same_mean(tiny_engine, dtype):
    """Centering is exact only if every key a query reads -- sinks, the FP16 window, quantised blocks -- had the
    same mean subtracted. With the window over the whole prompt nothing is quantised, so the logits with
    centering on must equal those with it off."""
    from bie_trt.model.llama import SeqInput

    tokens = torch.arange(3, 43)

    def logits(centering: bool) -> torch.Tensor:
        runner = ModelRunner(EngineConfig(engine_dir=str(tiny_engine), device="cpu", max_num_seqs=1,
                                          kv_cache_dtype=dtype, kv_group_size=32, kv_window=1024,
                                          kv_key_centering=centering))
        assert runner.model.key_mean.abs().max() > 0.01   # a mean that moves the keys
        return runner.forward([SeqInput(tokens, 0, list(range(3)), all_logits=True)])[0]

    torch.testing.assert_close(logits(True), logits(False), atol=1e-4, rtol=1e-4)
