"""Kernels compiled at build time: the runtime compiles nothing the build could have.

On a GPU the build loads the finished engine with Triton's cache pointed into `<engine>/kernels/`
and warms the runner up; a fresh process then loads the engine, serves requests, and lists every
kernel in the cache Triton used: nothing may have been added. On the CPU: the warm-up runs each
kind of step, and the cache plumbing (copy, version check) works on a real folder.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bie_trt.builder.build import BuildOptions, build_engine
from bie_trt.builder.checkpoint.quantize import quantize_checkpoint
from bie_trt.config import EngineConfig
from bie_trt.executor import model_runner
from bie_trt.executor.model_runner import ModelRunner
from bie_trt.kernels.kernel_cache import KERNELS_DIR, compiled_kernels, installed_triton, use_engine_kernels
from bie_trt.model.synthetic import write_word_tokenizer
from tiny_model import write_tiny_hf


def tiny_awq(root: Path) -> Path:
    """A tiny AWQ checkpoint with its own tokenizer: nothing it needs is missing on the GPU machine."""
    hf = write_tiny_hf(root / "hf", write_word_tokenizer(root / "tok"), num_attention_heads=2, num_key_value_heads=1,
                       vocab_size=64)
    return quantize_checkpoint(hf, root / "awq", group_size=32)


@pytest.fixture(scope="module")
def cpu_engine(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tiny")
    return build_engine(BuildOptions(checkpoint=str(tiny_awq(root)), out=str(root / "engine"), profile="cpu",
                                     max_model_len=512, kv_cache_dtype="int4_asym", kv_group_size=32),
                        log=lambda m: None)


def test_warm_up_runs_each_kind_of_step(cpu_engine, monkeypatch):
    runner = ModelRunner(EngineConfig(engine_dir=str(cpu_engine), device="cpu", max_num_seqs=3, chunked_prefill_size=64))
    steps = []
    forward = runner.forward
    monkeypatch.setattr(runner, "forward", lambda inputs, quantise=(): steps.append([len(i.token_ids) for i in inputs])
                        or forward(inputs, quantise))
    quantised, quantise = [], model_runner.quantise_blocks
    monkeypatch.setattr(model_runner, "quantise_blocks", lambda pools, pairs: quantised.extend(pairs)
                        or quantise(pools, pairs))
    runner.warm_up()
    # chunks of each kind of size, a prompt beside a decode (twice), then decodes of 1, 2 and 3 rows
    assert [sum(s) for s in steps] == [64, 63, 15, 16, 31, 32, 17 + 1, 17 + 1, 1, 2, 3]
    assert sum(sum(s) for s in steps[:6]) > runner.kv_config.sink_tokens + runner.kv_config.window
    assert any(len(s) > 1 for s in steps[:6])   # a chunk past the window in runs, as serving cuts it
    assert quantised   # blocks that left the window went through the quantiser, as in serving


def test_warm_up_runs_what_a_shrunk_pool_fits(cpu_engine, monkeypatch):
    runner = ModelRunner(EngineConfig(engine_dir=str(cpu_engine), device="cpu", max_num_seqs=3, chunked_prefill_size=64,
                                      num_kv_blocks=3))
    steps = []
    forward = runner.forward
    monkeypatch.setattr(runner, "forward", lambda inputs, quantise=(): steps.append(len(inputs)) or forward(inputs, quantise))
    runner.warm_up()   # 64 tokens need 4 blocks of 16: the first chunk is skipped, not an error
    assert steps and len(steps) < 11


def fake_triton_cache(root: Path) -> Path:
    """Files laid out as Triton's cache lays them out: a folder per compilation."""
    for h, name in (("abc", "rms_norm_kernel"), ("def", "w4_gemv_kernel")):
        (root / h).mkdir(parents=True)
        (root / h / f"{name}.json").write_text("{}")
        (root / h / f"__grp__{name}.json").write_text("{}")
        (root / h / f"{name}.cubin").write_bytes(b"\0")
    return root


def test_engine_kernels_are_used_through_a_writable_copy(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    engine = tmp_path / "engine"
    fake_triton_cache(engine / KERNELS_DIR)
    files = {f"{KERNELS_DIR}/abc/rms_norm_kernel.json": "1", f"{KERNELS_DIR}/def/w4_gemv_kernel.json": "2"}
    assert use_engine_kernels(engine, files, "0.0-not-this", tmp_path / "cache") is None
    assert "TRITON_CACHE_DIR" not in os.environ

    used = use_engine_kernels(engine, files, installed_triton(), tmp_path / "cache")
    assert used is not None and used.is_relative_to(tmp_path / "cache")
    assert os.environ["TRITON_CACHE_DIR"] == str(used)
    assert compiled_kernels(used) == {"abc/rms_norm_kernel", "def/w4_gemv_kernel"} == compiled_kernels(engine / KERNELS_DIR)
    assert use_engine_kernels(engine, files, installed_triton(), tmp_path / "cache") == used   # a second load reuses the copy


SERVE = """
import json, os, sys
from triton import knobs
compiled = []   # every compilation Triton's on-disk cache did not answer (a hit reports cache_hit=True)
knobs.compilation.listener = lambda **kw: None if kw["cache_hit"] else compiled.append(kw["src"].name)
from bie_trt import BieEngine, EngineConfig, SamplingParams
engine = BieEngine(EngineConfig(engine_dir=sys.argv[1]))
engine.generate(["the cat is on a mat " * 40, "of and to"], SamplingParams(max_tokens=24, temperature=0))
print(json.dumps({"cache": os.environ.get("TRITON_CACHE_DIR"), "compiled": compiled}))
"""


@pytest.mark.gpu
def test_run_compiles_no_kernel_the_build_compiled(tmp_path):
    engine = build_engine(BuildOptions(checkpoint=str(tiny_awq(tmp_path)), out=str(tmp_path / "engine"), profile="auto",
                                       max_model_len=1024, max_num_seqs=4, kv_cache_dtype="int4_asym",
                                       kv_group_size=32), log=print)
    built = compiled_kernels(engine / KERNELS_DIR)
    assert built, "the GPU build compiled no kernel into the engine"
    env = dict(os.environ, BIE_TRT_CACHE=str(tmp_path / "user-cache"), PYTHONPATH=os.pathsep.join(sys.path))
    env.pop("TRITON_CACHE_DIR", None)
    res = subprocess.run([sys.executable, "-c", SERVE, str(engine)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(res.stdout.strip().splitlines()[-1])
    used = Path(report["cache"])
    assert used.is_relative_to(tmp_path / "user-cache")
    # A kernel recompiled into the same hash folder (the engine's copy not found) adds no folder: count compilations.
    assert report["compiled"] == [], f"compiled at run time: {report['compiled']}"
    assert compiled_kernels(used) - built == set(), "compiled at run time, missed by the build's warm-up"


COPIED = """
import os, sys
from pathlib import Path
import torch, triton
from triton import knobs
from triton.backends.compiler import GPUTarget
import compile_check as cc
from bie_trt.kernels import triton_ops
from bie_trt.kernels.kernel_cache import installed_triton, use_engine_kernels
root = Path(sys.argv[1])
hits = []
knobs.compilation.listener = lambda **kw: hits.append(kw["cache_hit"])
h, w = torch.empty(4, 64, dtype=torch.float16), torch.empty(64, dtype=torch.float16)
launch = cc.record_launches(lambda: triton_ops.rms_norm_triton(h, w, 1e-5), "rms_norm")[0]
target = GPUTarget("cuda", 90, 32)
def compile_once():
    src, options = cc.specialise(launch, target)
    triton.compile(src, target=target, options=options)
os.environ["TRITON_CACHE_DIR"] = str(root / ".engine-build" / "kernels")   # build_engine builds in a temp dir
compile_once()
(root / ".engine-build").rename(root / "engine")                               # ... and renames it
files = {str(p.relative_to(root / "engine")): "x" for p in (root / "engine").rglob("*") if p.is_file()}
use_engine_kernels(root / "engine", files, installed_triton(), root / "user")
compile_once()
print(hits)
"""


def test_a_copied_engine_cache_is_a_cache_hit(tmp_path):
    """Triton's `__grp__` files name a compilation's files by absolute path: the engine's kernels are
    compiled in a temp dir that is renamed, and `run` reads a copy. Compiled for sm_90 without a GPU."""
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TRITON_CACHE_DIR")}
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(root / "scripts")] + sys.path)
    res = subprocess.run([sys.executable, "-c", COPIED, str(tmp_path)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip().splitlines()[-1] == "[False, True]"   # compiled at build, a hit at run
