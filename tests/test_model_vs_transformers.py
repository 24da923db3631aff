"""The engine's logits equal transformers' LlamaForCausalLM on the same dequantised weights."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bie_trt.builder.checkpoint.loader import Checkpoint
from bie_trt.config import EngineConfig
from bie_trt.executor.engine import BieEngine
from bie_trt.sampling_params import SamplingParams
from hf_reference import hf_model, run_engine_logits

DECODE_STEPS = 32


def prompt_ids(tokenizer, text_file: Path, n: int) -> list[int]:
    text = " ".join(text_file.read_text().splitlines()[:6])
    ids = tokenizer(text)["input_ids"]
    assert len(ids) >= n
    return ids[:n]


@pytest.fixture(scope="module")
def reference(smollm2_checkpoint, smollm2_engine, lee_text):
    engine = BieEngine(EngineConfig(engine_dir=str(smollm2_engine), device="cpu"))
    ids = prompt_ids(engine.tokenizer, lee_text, 320)
    model = hf_model(Checkpoint(smollm2_checkpoint))
    # greedy continuation by transformers, then one pass over everything for per-position logits
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False, min_new_tokens=64)
        full = out[0].tolist()
        logits = model(torch.tensor([full[: len(ids) + DECODE_STEPS]])).logits[0]
    return engine, ids, full[len(ids):], logits


@pytest.mark.parametrize("scatter,chunk", [pytest.param(False, 512, marks=pytest.mark.slow), pytest.param(True, 100, marks=pytest.mark.slow)])
def test_logits_match_transformers(reference, scatter, chunk):
    engine, ids, continuation, hf_logits = reference
    ours = torch.cat(run_engine_logits(engine, ids, continuation[:DECODE_STEPS], scatter, chunk))
    # ours[i] predicts position i+1; hf_logits covers prompt + 32 decode inputs
    hf = hf_logits[: len(ids) + DECODE_STEPS]
    assert ours.shape == hf.shape
    diff = (ours - hf).abs().max().item()
    assert diff <= 1e-3, f"max |Δlogit| = {diff}"


@pytest.mark.slow
def test_64_greedy_tokens_identical(reference):
    engine, ids, continuation, _ = reference
    out = engine.generate(ids, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    assert out.token_ids == continuation
