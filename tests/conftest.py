"""Shared fixtures: the SmolLM2 checkpoint (converted once into the user cache) and engines built from it."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch

# Triton reads this when kernels are defined (at import): set it before anything imports them,
# so every Triton kernel runs in the interpreter on CPU-only machines (CI).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from filelock import FileLock  # noqa: E402

from bie_trt.builder.build import BuildOptions, build_engine
from bie_trt.builder.checkpoint.registry import resolve_checkpoint


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def kv_cache_dir(tmp_path_factory) -> Path:
    """`serve` persists prompts under the user cache by default: the suite's servers use a directory of the
    run instead (its --kv-cache-dir environment variable), never the user's home."""
    path = tmp_path_factory.mktemp("kv-cache")
    os.environ["BIE_TRT_KV_CACHE_DIR"] = str(path)
    return path


@pytest.fixture(scope="session")
def smollm2_checkpoint():
    return resolve_checkpoint("smollm2-135m")


# Under pytest-xdist each worker is a process on its own core: one torch thread each, or the two
# workers' thread pools fight over the same two cores.
WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if WORKER:
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def shared_dir(tmp_path_factory) -> Path:
    """A directory every xdist worker of this run sees (the run's base temp; its own one without xdist)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if WORKER else base


@pytest.fixture(scope="session")
def build(shared_dir, smollm2_checkpoint):
    """build(**options) -> engine dir (of SmolLM2 unless checkpoint= says otherwise); identical
    options reuse one engine, also across xdist workers (the first to ask builds it, under a lock)."""
    def _build(**kw):
        kw = {"checkpoint": str(smollm2_checkpoint), "profile": "cpu", "max_model_len": 2048, **kw}
        digest = hashlib.sha256(repr(sorted(kw.items())).encode()).hexdigest()[:16]
        out = shared_dir / "engines" / digest
        out.parent.mkdir(exist_ok=True)
        with FileLock(str(out) + ".lock"):
            if not (out.parent / f"{digest}.done").exists():
                build_engine(BuildOptions(out=str(out), force=True, **kw), log=lambda m: None)
                (out.parent / f"{digest}.done").touch()
        return out

    return _build


@pytest.fixture(scope="session")
def smollm2_engine(build):
    return build()


@pytest.fixture(scope="session")
def tiny_draft(tmp_path_factory, smollm2_checkpoint):
    """A model sharing SmolLM2's tokenizer but nothing else: random, 2 layers, RTN-quantised."""
    from bie_trt.builder.checkpoint.quantize import quantize_checkpoint
    from tiny_model import write_tiny_hf

    root = tmp_path_factory.mktemp("tiny")
    hf = write_tiny_hf(root / "hf", smollm2_checkpoint, max_position_embeddings=8192)
    return quantize_checkpoint(hf, root / "awq", group_size=32)


@pytest.fixture(scope="session")
def tiny_engine(build, tmp_path_factory, smollm2_checkpoint):
    """A tiny random model alone (head_dim 32, so every KV cache dtype fits): for what does not depend on
    the model's text (the server's protocol, limits, batching). Its near-flat logits make it the harder
    case for "batched equals alone"."""
    from bie_trt.builder.checkpoint.quantize import quantize_checkpoint
    from tiny_model import write_tiny_hf

    root = tmp_path_factory.mktemp("tiny-target")
    hf = write_tiny_hf(root / "hf", smollm2_checkpoint, num_attention_heads=2, num_key_value_heads=1,
                       max_position_embeddings=8192)
    return build(checkpoint=str(quantize_checkpoint(hf, root / "awq", group_size=32)))


@pytest.fixture(scope="session")
def tiny_gemma3_awq(tmp_path_factory, smollm2_checkpoint) -> Path:
    """A tiny random Gemma 3 (three layers, two sliding over a 24-position window; tests/tiny_model.py),
    AWQ-packed."""
    from bie_trt.builder.checkpoint.quantize import quantize_checkpoint
    from tiny_model import TINY_GEMMA3, write_tiny_hf

    root = tmp_path_factory.mktemp("tiny-gemma3")
    return quantize_checkpoint(write_tiny_hf(root / "hf", smollm2_checkpoint, **TINY_GEMMA3), root / "awq",
                               group_size=32)


@pytest.fixture(scope="session")
def tiny_gemma3_engine(build, tiny_gemma3_awq):
    """The tiny Gemma 3 as a CPU engine with an FP16 cache and a 512-token context (a BieEngine, shared)."""
    from bie_trt.config import EngineConfig
    from bie_trt.executor.engine import BieEngine

    return BieEngine(EngineConfig(engine_dir=str(build(checkpoint=str(tiny_gemma3_awq), max_model_len=512,
                                                       kv_cache_dtype="fp16")), device="cpu"))


@pytest.fixture(scope="session")
def tiny_draft_engine(build, tiny_draft):
    """The tiny model, with itself as the draft: the draft's head over 4,096 ids, a 64-token window.
    (Seconds to build, where a SmolLM2 target takes minutes on two cores.)"""
    return build(checkpoint=str(tiny_draft), draft_checkpoint=str(tiny_draft), draft_vocab_size=4096,
                 draft_window_tokens=64)


# The evaluation text lives beside the project (CI lays shared/ next to the clone), not in it.
LEE_BACKGROUND = Path(__file__).resolve().parents[2] / "shared" / "data" / "lee_background.txt"


@pytest.fixture(scope="session")
def lee_text() -> Path:
    if not LEE_BACKGROUND.exists():
        pytest.skip(f"needs the evaluation text {LEE_BACKGROUND} (300 English news articles from gensim's "
                    f"test data, LGPL-2.1; README 'The evaluation text' says how to get it) to score perplexity")
    return LEE_BACKGROUND


@pytest.fixture(scope="session")
def qwen35_reference():
    """A tiny random Qwen3.5 in transformers, a multi-chunk prompt, its greedy continuation and logits
    (tests/qwen35_tiny.py): made once for the decoder's and the built engine's comparisons."""
    from qwen35_tiny import qwen35_reference

    return qwen35_reference()


@pytest.fixture(scope="session")
def gemma4_reference():
    """A tiny random Gemma 4 in transformers, a prompt of several windows, its greedy continuation and logits
    (tests/gemma4_tiny.py): made once for the decoder's and the built engine's comparisons."""
    from gemma4_tiny import gemma4_reference

    return gemma4_reference()
