"""The host tier of the KV cache: prefix blocks the device evicts wait in host memory (their own layout:
quantised bodies as they are, FP16 sinks and window) and come back with a copy instead of a re-prefill.

A (a long prompt) -> B (another, which evicts A from a small device pool) -> A: the second A is served
from the host tier, and its tokens and logprobs equal those of a warm device-pool hit. Checked on a tiny
random model with flat logits, where a block read one bit differently soon flips a token."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from bie_trt import BieEngine, EngineConfig, SamplingParams
from bie_trt.build import BuildOptions, build_engine
from bie_trt.checkpoint.quantize import quantize_checkpoint
from bie_trt.model.synthetic import write_word_tokenizer
from tiny_model import write_tiny_hf

VOCAB = 48
PROMPT_LEN = 417          # 26 full blocks and one token: a hit can cover 416 of them
MAX_LEN = 512             # with one sequence, the quantised pool holds 32 blocks: B's body evicts A's
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
SPEC = {"none": {"method": "none"},
        "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}}


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("host_tier")
    tokenizer = write_word_tokenizer(root / "tok")
    hf = write_tiny_hf(root / "hf", tokenizer, num_attention_heads=2, num_key_value_heads=1, vocab_size=VOCAB,
                       max_position_embeddings=1024)
    awq = quantize_checkpoint(hf, root / "awq", group_size=32)
    return build_engine(BuildOptions(checkpoint=str(awq), out=str(root / "engine"), profile="cpu",
                                     max_model_len=MAX_LEN, max_num_seqs=4, kv_cache_dtype="int4_asym",
                                     kv_group_size=32, kv_sink_tokens=8, kv_window=32), log=lambda m: None)


def prompt(seed: int, length: int = PROMPT_LEN) -> list[int]:
    """Random ids with a repeated phrase at the end (so prompt lookup proposes)."""
    rng = random.Random(seed)
    phrase = [rng.randrange(3, VOCAB) for _ in range(6)]
    return [rng.randrange(3, VOCAB) for _ in range(length - 24)] + phrase * 4


A, B = prompt(1), prompt(2, 490)


def engine(tiny_engine: Path, dtype: str, spec: str, **config) -> BieEngine:
    small = {"max_num_seqs": 1, "max_model_len": MAX_LEN, "num_kv_blocks": 36}
    return BieEngine(EngineConfig(engine_dir=str(tiny_engine), device="cpu", kv_cache_dtype=dtype,
                                  speculative=SPEC[spec], **{**small, **config}))


def same_output(got, want) -> None:
    assert got.token_ids == want.token_ids
    assert got.logprobs == want.logprobs


@pytest.mark.parametrize("dtype,spec", [("int4_asym", "none"), ("fp8", "ngram"), ("fp16", "none"),
                                        pytest.param("int4_asym", "ngram", marks=pytest.mark.slow),
                                        pytest.param("fp8", "none", marks=pytest.mark.slow),
                                        pytest.param("fp16", "ngram", marks=pytest.mark.slow)])
def test_a_prompt_evicted_to_the_host_comes_back_exactly(tiny_engine, dtype, spec):
    warm = engine(tiny_engine, dtype, spec, max_num_seqs=4, num_kv_blocks=None, host_kv_cache_gb=0)
    warm.generate(A, PARAMS)
    want = warm.generate(A, PARAMS)
    assert want.usage.cached_tokens == PROMPT_LEN - 1   # the reference is a warm device-pool hit

    tiered = engine(tiny_engine, dtype, spec, host_kv_cache_gb=0.01)
    first = tiered.generate(A, PARAMS)
    assert first.usage.cached_tokens == 0
    tiered.generate(B, PARAMS)
    host = tiered.stats().host_kv
    assert host["offloaded_bytes"] > 0 and host["blocks"] > 0
    again = tiered.generate(A, PARAMS)
    assert again.usage.cached_tokens >= 0.95 * PROMPT_LEN
    hit_from_host = tiered.stats().host_kv["hit_tokens"]
    assert hit_from_host >= 0.6 * PROMPT_LEN   # most of the hit was copied back, not found on the device
    same_output(again, want)
    assert first.token_ids == want.token_ids    # a cold prefill sums in another order: the same tokens


def test_without_the_tier_the_same_pool_recomputes(tiny_engine):
    """The pool above is small enough that B really evicts A: with the tier off, A's return misses."""
    untiered = engine(tiny_engine, "int4_asym", "none", host_kv_cache_gb=0)
    untiered.generate(A, PARAMS)
    untiered.generate(B, PARAMS)
    assert untiered.generate(A, PARAMS).usage.cached_tokens < 0.5 * PROMPT_LEN
    assert untiered.stats().host_kv["capacity_bytes"] == 0
