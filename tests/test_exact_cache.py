"""Every row reads the KV cache exactly as plain one-token-at-a-time decoding would at its position:
block b (past the sinks) quantised iff b < (p - window) // block_size. So with an INT4 or FP8 body,
speculation (n-gram and draft), prefill chunk sizes, a prefix-cache hit and preemption all give the
greedy tokens of one plain decode. Checked on a tiny random model whose logits are flat (near-ties
everywhere), where any row that reads one block differently soon flips a token."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from bie_trt import BieEngine, EngineConfig, SamplingParams
from bie_trt.builder.build import BuildOptions, build_engine
from bie_trt.builder.checkpoint.quantize import quantize_checkpoint
from bie_trt.model.synthetic import write_word_tokenizer
from tiny_model import TINY_GEMMA3, write_tiny_hf

VOCAB = 48
NEW_TOKENS = 100
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def _tiny(root: Path, tokenizer: Path, seed: int) -> Path:
    # head_dim 32 so that a KV group of 32 channels fits; the default small random weights give flat logits
    hf = write_tiny_hf(root / f"hf{seed}", tokenizer, seed=seed, num_attention_heads=2, num_key_value_heads=1,
                       vocab_size=VOCAB, max_position_embeddings=1024)
    return quantize_checkpoint(hf, root / f"awq{seed}", group_size=32)


@pytest.fixture(scope="module")
def flat_engine(tmp_path_factory) -> Path:
    """The flat model, with itself as the draft: the draft's FP16 cache sees what the quantised target does
    not, so near-ties make it propose tokens the target rejects."""
    root = tmp_path_factory.mktemp("flat")
    tokenizer = write_word_tokenizer(root / "tok")
    awq = str(_tiny(root, tokenizer, 0))
    return build_engine(BuildOptions(checkpoint=awq, out=str(root / "engine"),
                                     profile="cpu", max_model_len=512, max_num_seqs=24, kv_cache_dtype="int4_asym",
                                     kv_group_size=32, kv_sink_tokens=8, kv_window=32,
                                     draft_checkpoint=awq, draft_vocab_size=VOCAB,
                                     draft_window_tokens=64),
                        log=lambda m: None)


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    """Random prompts that repeat a phrase (so prompt lookup proposes), of lengths around `length`."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        phrase = [rng.randrange(3, VOCAB) for _ in range(rng.randrange(4, 9))]
        body = [rng.randrange(3, VOCAB) for _ in range(rng.randrange(length // 2, length))]
        out.append((body + phrase * 4)[-length:])
    return out


def _run(engine_dir: Path, prompts: list[list[int]], dtype: str, window: int, params: SamplingParams = GREEDY,
         **config) -> list[list[int]]:
    engine = BieEngine(EngineConfig(engine_dir=str(engine_dir), device="cpu", kv_cache_dtype=dtype, kv_window=window,
                                    speculative={"method": "none"},
                                    **{"max_num_seqs": len(prompts), **config}))
    outs = engine.generate(prompts, params)
    assert engine.stats().kv_blocks["fp16"]["used"] == 0
    return [o.token_ids for o in outs]


def _assert_same(got: list[list[int]], want: list[list[int]]) -> None:
    bad = [(i, next(j for j, (a, b) in enumerate(zip(g, w)) if a != b)) for i, (g, w) in enumerate(zip(got, want))
           if g != w]
    assert not bad, f"{len(bad)} of {len(want)} prompts differ from plain decoding (prompt, first token): {bad}"


SHORT = _prompts(20, 40, seed=0)   # prompts shorter than sinks + window: their prefill reads no quantised block

_plain_cache: dict = {}


def _plain(engine_dir: Path, dtype: str, window: int) -> list[list[int]]:
    key = (engine_dir, dtype, window)
    if key not in _plain_cache:
        _plain_cache[key] = _run(engine_dir, SHORT, dtype, window)
    return _plain_cache[key]


SPEC = {"ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1},
        # a fixed γ: these runs must cross block boundaries with proposals both accepted and rejected
        "draft": {"method": "draft_model", "num_speculative_tokens": 3, "adaptive": False}}


@pytest.mark.parametrize("dtype,window,method", [
    ("int4_asym", 32, "ngram"), ("fp8", 40, "draft"),
    pytest.param("int4_asym", 40, "draft", marks=pytest.mark.slow),
    pytest.param("fp8", 32, "ngram", marks=pytest.mark.slow),
    pytest.param("int4_asym", 32, "draft", marks=pytest.mark.slow),
    pytest.param("fp8", 40, "ngram", marks=pytest.mark.slow),
])
def test_speculation_gives_the_greedy_tokens_of_plain_decoding(flat_engine, dtype, window, method):
    engine = BieEngine(EngineConfig(engine_dir=str(flat_engine), device="cpu", kv_cache_dtype=dtype, kv_window=window,
                                    max_num_seqs=len(SHORT), speculative=SPEC[method]))
    got = [o.token_ids for o in engine.generate(SHORT, GREEDY)]
    spec = engine.stats().spec_decode
    # both outcomes happened often: runs accepted (rows past a block boundary) and rejected
    assert spec["num_draft_tokens"] > 500
    assert 0.1 < spec["num_accepted_tokens"] / spec["num_draft_tokens"] < 0.98
    _assert_same(got, _plain(flat_engine, dtype, window))


LONG = _prompts(8, 150, seed=1)   # prompts well past sinks + window: prefill rows read quantised blocks
LONG_GREEDY = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)


@pytest.fixture(scope="module")
def token_by_token(flat_engine) -> list[list[int]]:
    """The reference: the prompt too fed one token per step, as plain decoding would."""
    return _run(flat_engine, LONG, "int4_asym", 40, LONG_GREEDY, chunked_prefill_size=1)


@pytest.mark.parametrize("chunk", [256, pytest.param(16, marks=pytest.mark.slow)])   # 16: below, with preemption
def test_prefill_chunk_size_does_not_change_the_tokens(flat_engine, token_by_token, chunk):
    _assert_same(_run(flat_engine, LONG, "int4_asym", 40, LONG_GREEDY, chunked_prefill_size=chunk), token_by_token)


def test_a_prefix_hit_and_preemption_do_not_change_the_tokens(flat_engine, token_by_token):
    engine = BieEngine(EngineConfig(engine_dir=str(flat_engine), device="cpu", kv_cache_dtype="int4_asym",
                                    kv_window=40, max_num_seqs=len(LONG), speculative={"method": "none"}))
    # First each prompt cut short and decoded past its cut: the cache then holds the prompts' blocks,
    # partly quantised by the time these end; then the whole prompts, hitting them.
    engine.generate([p[:100] for p in LONG], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    before = engine.stats().prefix_hit_tokens
    got = [o.token_ids for o in engine.generate(LONG, LONG_GREEDY)]
    assert engine.stats().prefix_hit_tokens - before >= 48 * len(LONG)
    _assert_same(got, token_by_token)
    # A pool of 12 FP16 blocks for 8 sequences: they preempt each other and recompute.
    small = BieEngine(EngineConfig(engine_dir=str(flat_engine), device="cpu", kv_cache_dtype="int4_asym",
                                   kv_window=40, max_num_seqs=len(LONG), num_kv_blocks=12, chunked_prefill_size=16,
                                   speculative={"method": "none"}))
    got = [o.token_ids for o in small.generate(LONG, LONG_GREEDY)]
    assert small.stats().preemptions > 0
    _assert_same(got, token_by_token)


@pytest.fixture(scope="module")
def flat_gemma3(tmp_path_factory) -> Path:
    """A hybrid model (tiny Gemma 3: two sliding layers over 24 positions, one full layer) with the flat
    model's vocabulary, INT4 on its full layer (the sliding layers' own cache group stays FP16)."""
    root = tmp_path_factory.mktemp("flat-gemma3")
    hf = write_tiny_hf(root / "hf", write_word_tokenizer(root / "tok"), seed=0, **TINY_GEMMA3, vocab_size=VOCAB,
                       max_position_embeddings=1024)
    return build_engine(BuildOptions(checkpoint=str(quantize_checkpoint(hf, root / "awq", group_size=32)),
                                     out=str(root / "engine"), profile="cpu", max_model_len=512, max_num_seqs=4,
                                     kv_cache_dtype="int4_asym", kv_group_size=32, kv_sink_tokens=8, kv_window=32),
                        log=lambda m: None)


def test_a_hybrid_model_keeps_speculation_prefix_hits_chunks_and_preemption_exact(flat_gemma3):
    """The sliding layers give back blocks as their window passes while n-gram speculation verifies rows
    across block boundaries, prefills run in 16-token chunks, prompts hit cached prefixes (the sliding
    layers' last window included) and a small pool preempts: the tokens of plain decoding still."""
    prompts = LONG[:4]
    want = _run(flat_gemma3, prompts, "int4_asym", 32, LONG_GREEDY)
    config = dict(engine_dir=str(flat_gemma3), device="cpu", max_num_seqs=len(prompts), speculative=SPEC["ngram"])
    engine = BieEngine(EngineConfig(**config))
    engine.generate([p[:100] for p in prompts], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    got = [o.token_ids for o in engine.generate(prompts, LONG_GREEDY)]
    stats = engine.stats()
    assert stats.prefix_hit_tokens >= 96 * len(prompts) and stats.spec_decode["num_accepted_tokens"] > 0
    _assert_same(got, want)
    # 16-token chunks, and a pool of 8 FP16 blocks for 4 sequences: they preempt each other and recompute
    small = BieEngine(EngineConfig(**config, num_kv_blocks=8, chunked_prefill_size=16))
    got = [o.token_ids for o in small.generate(prompts, LONG_GREEDY)]
    assert small.stats().preemptions > 0 and small.stats().kv_blocks["sliding"]["used"] == 0
    _assert_same(got, want)
