"""Shared fixtures: the SmolLM2 checkpoint (converted once into the user cache) and engines built from it."""
from __future__ import annotations

import os
from pathlib import Path

import torch

# Triton reads this when kernels are defined (at import): set it before anything imports them,
# so every Triton kernel runs in the interpreter on CPU-only machines (CI).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from bie_trt.build import BuildOptions, build_engine
from bie_trt.checkpoint.registry import resolve_checkpoint


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2_checkpoint():
    return resolve_checkpoint("smollm2-135m")


@pytest.fixture(scope="session")
def build(tmp_path_factory, smollm2_checkpoint):
    """build(**options) -> engine dir (of SmolLM2 unless checkpoint= says otherwise); identical
    options reuse one engine."""
    made = {}

    def _build(**kw):
        key = tuple(sorted(kw.items()))
        if key not in made:
            out = tmp_path_factory.mktemp("engine")
            kw = {"checkpoint": str(smollm2_checkpoint), "profile": "cpu", "max_model_len": 2048, **kw}
            made[key] = build_engine(BuildOptions(out=str(out), force=True, **kw),
                                     log=lambda m: None)
        return made[key]

    return _build


@pytest.fixture(scope="session")
def smollm2_engine(build):
    return build()


@pytest.fixture(scope="session")
def tiny_draft(tmp_path_factory, smollm2_checkpoint):
    """A model sharing SmolLM2's tokenizer but nothing else: random, 2 layers, RTN-quantised."""
    from bie_trt.checkpoint.quantize import quantize_checkpoint
    from tiny_model import write_tiny_hf

    root = tmp_path_factory.mktemp("tiny")
    hf = write_tiny_hf(root / "hf", smollm2_checkpoint, max_position_embeddings=8192)
    return quantize_checkpoint(hf, root / "awq", group_size=32)


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
