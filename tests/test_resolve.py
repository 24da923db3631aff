"""The settings an engine runs with come from one place (`resolve`): unsaid means the engine's, above the
engine's is refused with the built value and the fix, the same for the SDK, `serve` and `serve --replicas`;
and `--replicas` without Ray installed is one line naming the extra."""
from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from bie_trt.cli import main
from bie_trt.config import EngineConfig, KVCacheConfig, ModelConfig, SpeculativeConfig
from bie_trt.engine_format import DraftInfo, Manifest, PlanSummary, Source, Target, read_manifest
from bie_trt.errors import EngineError, SettingsError
from bie_trt.resolve import resolve

ROOT = Path(__file__).resolve().parents[1]
LLAMA = ModelConfig.from_hf(json.loads((ROOT / "docs/examples/llama-3.1-8b-instruct-awq.config.json").read_text()))


def built(**kw) -> Manifest:
    """A manifest as a GPU build writes it (no weights needed to resolve against it)."""
    fields = dict(path=Path("engine/manifest.json"), schema_version=2, bie_trt_version="0", model_name="llama",
                  model=LLAMA, kv=KVCacheConfig(dtype="int4_asym"), max_model_len=8192, max_num_seqs=4,
                  chunked_prefill_size=256, profile_name="rtx4060ti-8gb", cuda_graph_batch_sizes=(1, 2, 4, 8),
                  target=Target("RTX 4060 Ti", 89),
                  plan=PlanSummary(1, 1, (), "gpu", 0, {}), files={"weights.safetensors": "0"},
                  source=Source("ckpt", 128, None), w4_gemv_configs=None, triton_version=None, speculative=None,
                  draft=None)
    return Manifest(**{**fields, **kw})


def config(**kw) -> EngineConfig:
    return EngineConfig(engine_dir="engine", **kw)


def test_unsaid_settings_are_the_engines():
    r = resolve(config(), built())
    assert (r.max_model_len, r.max_num_seqs, r.chunked_prefill_size) == (8192, 4, 256)
    assert r.cuda_graph_batch_sizes == (1, 2, 4)        # none captured beyond max_num_seqs
    assert r.kv == KVCacheConfig(dtype="int4_asym") and r.speculative == SpeculativeConfig()


def test_at_or_below_the_built_value_is_taken():
    r = resolve(config(max_model_len=8192, max_num_seqs=1, chunked_prefill_size=64), built())
    assert (r.max_model_len, r.max_num_seqs, r.chunked_prefill_size, r.cuda_graph_batch_sizes) == (8192, 1, 64, (1,))


@pytest.mark.parametrize("setting, asked, option", [
    ("max_model_len", 8193, "--max-model-len"),
    ("max_num_seqs", 5, "--max-num-seqs"),
    ("chunked_prefill_size", 512, "--chunked-prefill-size"),
])
def test_above_the_built_value_is_refused_naming_it_and_the_fix(setting, asked, option):
    with pytest.raises(SettingsError) as e:
        resolve(config(**{setting: asked}), built())
    assert isinstance(e.value, ValueError) and e.value.setting == setting
    value = getattr(built(), setting)
    assert str(e.value).startswith(f"{setting} {asked} is above this engine's {value} (")
    assert str(e.value).endswith(f"lower it or rebuild with `bie-trt build {option} {asked}`.")


def test_kv_overrides_apply_to_the_engines_format_and_are_checked():
    assert resolve(config(kv_window=64, kv_cache_dtype="fp8"), built()).kv == \
        KVCacheConfig(dtype="fp8", window=64)
    with pytest.raises(EngineError, match="kv group size 48 is not allowed"):
        resolve(config(kv_group_size=48), built())


def test_speculation_defaults_from_the_manifest_and_fits_the_drafts_window():
    draft = DraftInfo("draft", LLAMA, 4096, 0, 4, 8)
    planned = dataclasses.replace(built().plan, num_speculative_tokens=3)
    assert resolve(config(), built(draft=draft, plan=planned)).speculative == SpeculativeConfig("draft_model", 3)
    assert resolve(config(), built(speculative={"method": "ngram", "num_speculative_tokens": 2})).speculative == \
        SpeculativeConfig("ngram", 2)
    with pytest.raises(SettingsError, match="num_speculative_tokens 8 does not fit the draft's 8-token window"):
        resolve(config(speculative={"method": "draft_model", "num_speculative_tokens": 8}), built(draft=draft))


def test_the_sdk_refuses_a_context_above_the_engines(tiny_engine):
    limit = read_manifest(tiny_engine).max_model_len
    from bie_trt import BieEngine

    with pytest.raises(ValueError, match=f"max_model_len {limit + 1} is above this engine's {limit} .*"
                                         f"`bie-trt build --max-model-len {limit + 1}`"):
        BieEngine(EngineConfig(engine_dir=str(tiny_engine), device="cpu", max_model_len=limit + 1))


def _stderr_lines(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.strip()]


def test_replicas_refuse_a_context_above_the_engines_like_one_engine(tiny_engine):
    limit = read_manifest(tiny_engine).max_model_len
    with socket.socket() as taken:   # were the option let through, serving would stop at the bind, not run on
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        args = ["serve", str(tiny_engine), "--device", "cpu", "--max-model-len", str(limit + 1),
                "--port", str(taken.getsockname()[1])]
        one, many = CliRunner().invoke(main, args), CliRunner().invoke(main, args + ["--replicas", "2"])
    assert one.exit_code == many.exit_code == 2
    assert _stderr_lines(one) == _stderr_lines(many) == [
        f"error: Invalid value for '--max-model-len': {limit + 1} is above this engine's {limit} (its memory plan "
        f"holds that context); lower it or rebuild with `bie-trt build --max-model-len {limit + 1}`. "
        f"(see `main serve --help`)"]
    assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()   # refused before Ray started


# `import ray` fails exactly as when Ray is not installed
WITHOUT_RAY = "import sys; sys.modules['ray'] = None; from bie_trt.cli import main; main()"


@pytest.mark.parametrize("option", [["--replicas", "2"], pytest.param(["--ray-address", "127.0.0.1:6379"], marks=pytest.mark.slow)])
def test_replicas_without_ray_name_the_extra_in_one_line(tiny_engine, option):
    r = subprocess.run([sys.executable, "-c", WITHOUT_RAY, "serve", str(tiny_engine), "--device", "cpu", *option],
                       capture_output=True, text=True, timeout=120, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    lines = _stderr_lines(r)
    assert len(lines) == 1 and lines[0].startswith(f"error: {option[0]}"), lines
    assert "not installed" in lines[0] and "pip install 'bie-trt[ray]'" in lines[0]
