"""Engine directories: deterministic builds, verify, inspect, the plan in manifest and README,
and the runtime allocating exactly the plan's KV pools."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from click.testing import CliRunner

from bie_trt.builder.build import BuildOptions, build_engine
from bie_trt.cli import main
from bie_trt.config import EngineConfig
from bie_trt.engine_format import (
    SCHEMA_VERSION,
    Target,
    check_target,
    digest_files,
    read_manifest,
    verify_engine,
    write_manifest,
)
from bie_trt.errors import BieError, EngineError, PlanError
from bie_trt.executor.model_runner import ModelRunner


def assert_rebuild_is_byte_identical(engine, checkpoint, out) -> None:
    other = build_engine(BuildOptions(checkpoint=str(checkpoint), out=str(out), profile="cpu", max_model_len=2048),
                         log=lambda m: None)
    manifest = json.loads((engine / "manifest.json").read_text())
    for name in list(manifest["files"]) + ["manifest.json"]:
        assert (engine / name).read_bytes() == (other / name).read_bytes(), name
    # only build-info.json (documented as unhashed) is left out of the manifest
    listed = set(manifest["files"]) | {"manifest.json"}
    assert {p.name for p in other.iterdir()} - listed == {"build-info.json"}


def test_two_builds_are_byte_identical(tmp_path, build, tiny_draft):
    assert_rebuild_is_byte_identical(build(checkpoint=str(tiny_draft)), tiny_draft, tmp_path / "again")


@pytest.mark.slow   # a second SmolLM2 build: the bundled model's 30 layers rebuild the same
def test_two_builds_of_smollm2_are_byte_identical(tmp_path, smollm2_checkpoint, smollm2_engine):
    assert_rebuild_is_byte_identical(smollm2_engine, smollm2_checkpoint, tmp_path / "again")


def test_verify_passes_then_catches_a_flipped_byte_in_every_file(tmp_path, smollm2_engine):
    assert verify_engine(smollm2_engine).ok
    files = json.loads((smollm2_engine / "manifest.json").read_text())["files"]
    assert {"weights.safetensors", "tokenizer.json", "README.md"} <= set(files)
    for name in files:
        copy = tmp_path / name.replace("/", "_")
        shutil.copytree(smollm2_engine, copy)
        data = bytearray((copy / name).read_bytes())
        data[len(data) // 2] ^= 0x01
        (copy / name).write_bytes(bytes(data))
        report = verify_engine(copy)
        assert not report.ok and any(name in p and "sha256" in p for p in report.problems), name
        shutil.rmtree(copy)


@pytest.mark.slow   # kept out of the default suite's six minutes; CI runs it
def test_verify_cli_wrong_sm(build):
    engine = build(profile="rtx4060ti-8gb", max_model_len=4096)
    runner = CliRunner()
    ok = runner.invoke(main, ["verify", str(engine), "--sm", "89"])
    assert ok.exit_code == 0, ok.output
    bad = runner.invoke(main, ["verify", str(engine), "--sm", "86"])
    assert bad.exit_code == 1 and "built for SM 89" in bad.output and "SM 86" in bad.output


def test_schema_mismatch_is_refused(tmp_path, smollm2_engine):
    copy = tmp_path / "e"
    shutil.copytree(smollm2_engine, copy)
    m = json.loads((copy / "manifest.json").read_text())
    m["schema_version"] = 99
    (copy / "manifest.json").write_text(json.dumps(m))
    report = verify_engine(copy)
    assert not report.ok and "schema version 99" in report.problems[0]
    with pytest.raises(EngineError, match="schema version 99"):
        ModelRunner(EngineConfig(engine_dir=str(copy), device="cpu"))


def test_inspect_and_readme_show_the_plan(smollm2_engine):
    out = CliRunner().invoke(main, ["inspect", str(smollm2_engine)])
    assert out.exit_code == 0 and "kv_fp16_pool" in out.output and "smollm2" in out.output
    readme = (smollm2_engine / "README.md").read_text()
    manifest = json.loads((smollm2_engine / "manifest.json").read_text())
    assert "## Memory plan" in readme and "kv_fp16_pool" in readme
    assert manifest["plan"]["fits"] and manifest["plan"]["total_bytes"] <= manifest["plan"]["budget_bytes"]


def test_build_refuses_what_does_not_fit_before_heavy_work(tmp_path, smollm2_checkpoint):
    opts = BuildOptions(checkpoint=str(smollm2_checkpoint), out=str(tmp_path / "e"), profile="rtx4060ti-8gb",
                        max_model_len=8192, max_num_seqs=4096, kv_cache_dtype="fp16")
    with pytest.raises(PlanError, match="does not fit") as e:
        build_engine(opts, log=lambda m: None)
    assert "--max-model-len" in str(e.value)
    assert not (tmp_path / "e").exists()


def test_build_refuses_bad_options(tmp_path, smollm2_checkpoint):
    base = dict(checkpoint=str(smollm2_checkpoint), out=str(tmp_path / "e"), profile="cpu")
    with pytest.raises(PlanError, match="known profiles"):
        build_engine(BuildOptions(**{**base, "profile": "rtx9999"}), log=lambda m: None)
    with pytest.raises(PlanError, match="beyond the model's limit"):
        build_engine(BuildOptions(**base, max_model_len=100_000), log=lambda m: None)
    with pytest.raises(PlanError, match="group size"):
        build_engine(BuildOptions(**base, kv_cache_dtype="int4_asym", kv_group_size=48), log=lambda m: None)
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "keep.txt").write_text("x")
    with pytest.raises(BieError, match="--force"):
        build_engine(BuildOptions(**base), log=lambda m: None)


@pytest.mark.parametrize("options", [
    {},
    pytest.param({"kv_cache_dtype": "int4_asym", "kv_group_size": 32, "max_num_seqs": 2}, marks=pytest.mark.slow),
    pytest.param({"kv_cache_dtype": "fp8", "kv_window": 64}, marks=pytest.mark.slow),
    {"profile": "rtx4060ti-8gb", "max_model_len": 4096},   # INT4 KV by default; the engine other tests build
])
def test_runtime_allocates_exactly_the_plans_kv_pools(build, options):
    engine = build(**options)
    plan = json.loads((engine / "manifest.json").read_text())["plan"]
    items = {i["name"]: i["bytes"] for i in plan["items"]}
    runner = ModelRunner(EngineConfig(engine_dir=str(engine), device="cpu", dtype="float16"))
    measured = runner.pools.nbytes()
    assert measured["fp16"] == items["kv_fp16_pool"] and measured["quant"] == items["kv_quant_pool"]
    assert sum(t.nbytes for t in runner.pools.tensors().values()) == items["kv_fp16_pool"] + items["kv_quant_pool"]
    assert runner.pools.k.dtype == torch.float16


def test_target_check_and_schema_without_a_build(tmp_path):
    target = Target("RTX 4060 Ti", 89)
    assert check_target(target, 89) is None
    for other in (86, 90):               # any other SM, older or newer, is refused
        assert f"built for SM 89 (RTX 4060 Ti) but this GPU is SM {other}" in check_target(target, other)
    assert check_target(target, None) is None and check_target(Target("CPU", 0), 86) is None

    (tmp_path / "a.bin").write_bytes(b"a")
    (tmp_path / "b.bin").write_bytes(b"b")
    files = [tmp_path / "b.bin", tmp_path / "a.bin"]
    assert digest_files(files, tmp_path) == digest_files(files[::-1], tmp_path)   # order-free
    for version in (SCHEMA_VERSION - 1, SCHEMA_VERSION + 1, None):
        write_manifest(tmp_path, {"schema_version": version})
        with pytest.raises(EngineError, match=f"engine schema version {version}, but"):
            read_manifest(tmp_path)
    required = {"model": {}, "kv": {}, "plan": {}, "max_model_len": 16, "max_num_seqs": 1}
    write_manifest(tmp_path, {"schema_version": SCHEMA_VERSION, **required})   # every key there, but hollow
    with pytest.raises(EngineError, match="manifest.json: malformed .*; rebuild the engine with `bie-trt build`"):
        read_manifest(tmp_path)
    assert not verify_engine(tmp_path, check_gpu=False).ok
