"""`bie-trt plan` and `bie-trt build` read the KV-cache options one way: the same options price the same
cache (bytes per token, pools, the whole format) in the plan printed and in the engine built."""
from __future__ import annotations

import dataclasses
import json

import pytest
from click.testing import CliRunner

from bie_trt.cli import main
from bie_trt.config import KVOverrides
from bie_trt.profiles import load_profile

# each option set off its default (the cpu profile's: fp16, group 64, 8 sinks, window 128, hadamard, off);
# the other options quantise the body, so that the group, sinks and window have something to change
INT4 = ["--kv-cache-dtype", "int4_asym"]
OPTIONS = {
    "kv_cache_dtype": ["--kv-cache-dtype", "fp8"],
    "kv_group_size": INT4 + ["--kv-group-size", "32"],
    "kv_sink_tokens": INT4 + ["--kv-sink-tokens", "64"],
    "kv_window": INT4 + ["--kv-window", "256"],
    "kv_rotation": INT4 + ["--kv-rotation", "none"],
    "kv_key_centering": INT4 + ["--kv-key-centering"],
    "kv_key_scale": INT4 + ["--kv-key-scale"],
}
COMMON = ["--profile", "cpu", "--max-model-len", "512"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, smollm2_checkpoint):
    """A tiny AWQ checkpoint with 64-channel heads, so that both INT4 group sizes divide them."""
    from bie_trt.builder.checkpoint.quantize import quantize_checkpoint
    from tiny_model import write_tiny_hf

    root = tmp_path_factory.mktemp("kv-options")
    hf = write_tiny_hf(root / "hf", smollm2_checkpoint, num_attention_heads=1, num_key_value_heads=1)
    return str(quantize_checkpoint(hf, root / "awq", group_size=32))


def priced(plan: dict) -> dict:
    """What a plan says the KV cache costs, and the format it priced."""
    return {key: plan[key] for key in ("kv_bytes_per_token", "num_fp_blocks", "num_quant_blocks", "total_bytes")} | {
        "kv": plan["inputs"]["kv"]}


@pytest.mark.parametrize("option", OPTIONS)
def test_plan_and_build_price_the_same_cache(checkpoint, tmp_path, option):
    flags = OPTIONS[option]
    runner = CliRunner()
    planned = runner.invoke(main, ["plan", "--checkpoint", checkpoint, "--json", *COMMON, *flags])
    assert planned.exit_code == 0, planned.output
    built = runner.invoke(main, ["build", "--checkpoint", checkpoint, "--out", str(tmp_path / "e"), *COMMON, *flags])
    assert built.exit_code == 0, built.output
    manifest = json.loads((tmp_path / "e" / "manifest.json").read_text())
    assert priced(json.loads(planned.stdout)) == priced(manifest["plan"])
    assert manifest["kv"] == manifest["plan"]["inputs"]["kv"]
    # the option took effect, so the comparison above is not between two defaults
    (field,) = KVOverrides(**{option: True}).given()
    assert manifest["kv"][field] != dataclasses.asdict(load_profile("cpu").defaults.kv_config())[field]


def test_the_kv_options_are_declared_once():
    """Build's options and the engine's take their KV fields from KVOverrides (none restated), so a new
    option added there reaches build, plan and the runtime alike: every option it maps to a cache field is one
    of its fields."""
    from bie_trt.builder.build import BuildOptions
    from bie_trt.config import _KV_OPTION_FIELDS, EngineConfig

    names = {f.name for f in dataclasses.fields(KVOverrides)}
    assert names == set(_KV_OPTION_FIELDS) == set(OPTIONS)   # and plan and build price each one alike
    for options in (BuildOptions, EngineConfig):
        assert issubclass(options, KVOverrides) and not names & set(vars(options)["__annotations__"])
    given = BuildOptions("ckpt", "out", kv_window=256, kv_rotation="none")
    assert given.given() == {"window": 256, "rotation": "none"}
    assert EngineConfig("engine", kv_cache_dtype="fp8").given() == {"dtype": "fp8"}
