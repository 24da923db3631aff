"""A tiny random Qwen3.5 through the whole path: transformers writes it as real safetensors, `bie-trt quantize`
packs it, `bie-trt build` makes an engine, and the engine serves it: greedy tokens equal transformers'
Qwen3_5ForCausalLM over a multi-chunk prompt; a batch equals each prompt alone; a preempted sequence
recomputes to the same tokens; every sequence's recurrent state slot is given back when it ends or is
aborted; n-gram speculation rolls the state back past rejected proposals; a returning prompt resumes from the
state saved at its last block boundary (prefix hits), to the same tokens as without the cache."""
from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open

from bie_trt.cli import main
from bie_trt.config import EngineConfig
from bie_trt.executor.engine import BieEngine
from bie_trt.model.synthetic import write_word_tokenizer
from bie_trt.sampling_params import SamplingParams
from hf_reference import quantize_and_build
from qwen35_tiny import CHUNK, GREEDY_TOKENS, GROUP


def greedy(max_tokens: int = GREEDY_TOKENS, logprobs: int | None = None) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=logprobs)


def assert_same_logprobs(got: list[dict[int, float]], want: list[dict[int, float]]) -> None:
    """The same top ids at each step, their logprobs equal within fp32 rounding (the state is carried exactly,
    only the delta rule's chunks are cut elsewhere)."""
    assert [list(g) for g in got] == [list(w) for w in want]
    assert all(abs(g[i] - w[i]) < 1e-4 for g, w in zip(got, want) for i in g), (got, want)


def prompt(n: int, seed: int) -> list[int]:
    """Ids the word tokenizer knows (3..44), so that every prompt decodes."""
    return torch.randint(3, 45, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, qwen35_reference):
    """(transformers' model, the engine directory, the AWQ checkpoint): the model written by transformers,
    packed by `bie-trt quantize` and built; its weights are W4-exact and fp16 (qwen35_tiny.py), so the engine
    and transformers run the same numbers."""
    root = tmp_path_factory.mktemp("qwen35")
    model = qwen35_reference[0]
    model.save_pretrained(root / "hf")   # config.json and model.safetensors, as transformers writes them
    write_word_tokenizer(root / "hf")
    engine, awq = quantize_and_build(root, GROUP, "--max-model-len", "4096", "--max-num-seqs", "4",
                                     "--chunked-prefill-size", str(CHUNK))
    return model, engine, str(awq)


@pytest.fixture(scope="module")
def engine(tiny):
    return BieEngine(EngineConfig(engine_dir=str(tiny[1]), device="cpu"))


def assert_slots_free(engine: BieEngine) -> None:
    states = engine.core.runner.pools.recurrent
    assert sorted(states.free) == list(range(states.num_slots)) and not states.logs


def test_plan_prints_the_recurrent_state_of_the_checkpoint(tiny):
    plan = CliRunner().invoke(main, ["plan", "--checkpoint", tiny[2], "--profile", "cpu"])
    assert plan.exit_code == 0 and "recurrent_state" in plan.stdout, plan.output


def test_the_engine_keeps_deltanet_tensors_as_built(tiny):
    """4-bit fused linears for the DeltaNet layers as for attention; the decay's parameters fp32, the conv
    and norms fp16; a key mean for the full-attention layers (the engine's weights file, read back)."""
    with safe_open(tiny[1] / "weights.safetensors", "pt") as f:
        dtypes = {name: f.get_slice(name).get_dtype() for name in f.keys()}
    assert dtypes["layers.0.in_proj.qweight"] == "I32" and dtypes["layers.0.out_proj.qweight"] == "I32"
    assert dtypes["layers.1.qkv.qweight"] == "I32" and "layers.1.in_proj.qweight" not in dtypes
    assert dtypes["layers.0.A_log"] == dtypes["layers.2.dt_bias"] == "F32"
    assert dtypes["layers.0.conv"] == dtypes["layers.0.delta_norm"] == dtypes["layers.1.q_norm"] == "F16"
    with safe_open(f"{tiny[2]}/model.safetensors", "pt") as f:   # and in the AWQ checkpoint before it
        assert f.get_slice("model.layers.0.linear_attn.A_log").get_dtype() == "F32"
        assert f.get_slice("model.layers.0.linear_attn.in_proj_b.weight").get_dtype() == "F16"
    with safe_open(tiny[1] / "weights.safetensors", "pt") as f:   # calibrated keys of attention layers only
        key_mean = f.get_tensor("kv.key_mean")
    assert [bool(row.any()) for row in key_mean] == [False, True, False, True]


def test_greedy_tokens_equal_transformers_over_a_multi_chunk_prompt(qwen35_reference, engine):
    _, ids, continuation, _ = qwen35_reference
    assert len(ids) > 3 * CHUNK
    assert engine.generate(ids, greedy()).token_ids == continuation
    assert_slots_free(engine)


def test_a_batch_equals_each_prompt_alone_and_frees_every_slot(engine):
    """Four sequences (prompts of several chunks and of a few tokens) share steps: prefill chunks beside
    decodes, decode batches; each one's tokens are those it gets alone."""
    prompts = [prompt(n, seed) for seed, n in enumerate((100, 7, 61, 3), start=1)]
    together = [o.token_ids for o in engine.generate(prompts, greedy())]
    assert together == [engine.generate(p, greedy()).token_ids for p in prompts]
    assert_slots_free(engine)


def test_a_preempted_sequence_recomputes_its_state_to_the_same_tokens(tiny, engine):
    """A KV pool too small for three long prompts at once: the newest is preempted, its slot given back, and it
    recomputes from its first token (no state snapshot: the slot is zeroed when taken again)."""
    small = BieEngine(EngineConfig(engine_dir=str(tiny[1]), device="cpu", max_model_len=128, num_kv_blocks=12))
    prompts = [prompt(90, seed) for seed in (11, 12, 13)]
    together = [o.token_ids for o in small.generate(prompts, greedy())]
    assert small.core.scheduler.num_preemptions > 0
    assert together == [engine.generate(p, greedy()).token_ids for p in prompts]
    assert_slots_free(small)


def test_an_aborted_sequence_gives_its_slot_back(engine):
    stream = engine.stream(prompt(60, 21), greedy(50))
    next(iter(stream))
    states = engine.core.runner.pools.recurrent
    assert len(states.free) == states.num_slots - 1
    stream.close()
    assert_slots_free(engine)


@pytest.fixture(scope="module")
def uncached(tiny):
    return BieEngine(EngineConfig(engine_dir=str(tiny[1]), device="cpu", enable_prefix_caching=False))


def test_a_returning_3000_token_prompt_resumes_from_its_saved_state(engine, uncached):
    """The second time a 3,000-token prompt comes, all but its last partial block is a prefix hit: the full
    layers share their KV blocks, the linear-attention layers start from the state saved at the hit's end; the
    greedy tokens are those of an engine without a prefix cache (which computes all 3,000 again)."""
    ids, block = prompt(3000, 32), engine.core.blocks.block_size
    alone = uncached.generate(ids, greedy(logprobs=3))
    assert engine.generate(ids, greedy()).token_ids == alone.token_ids
    queried, hits = engine.core.scheduler.prefix_queried_tokens, engine.core.scheduler.prefix_hit_tokens
    again = engine.generate(ids, greedy(logprobs=3))
    assert again.token_ids == alone.token_ids
    assert_same_logprobs(again.logprobs, alone.logprobs)
    cached = engine.core.scheduler.prefix_hit_tokens - hits
    assert engine.core.scheduler.prefix_queried_tokens - queried == 3000
    assert cached == (3000 - 1) // block * block == 2992 and cached >= 0.9 * 3000
    assert uncached.core.scheduler.prefix_hit_tokens == 0 and uncached.core.blocks.snapshots is None
    assert_slots_free(engine)


def test_a_longer_prompt_resumes_from_a_shorter_ones_boundary(engine, uncached):
    """A prompt that extends an earlier one (a conversation's next turn) hits up to the boundary saved for the
    earlier one, not past it: no state was saved later, though more of its KV blocks are cached."""
    first, block = prompt(200, 33), engine.core.blocks.block_size
    engine.generate(first, greedy())
    longer = first + prompt(150, 34)
    hits = engine.core.scheduler.prefix_hit_tokens
    got, want = engine.generate(longer, greedy(logprobs=3)), uncached.generate(longer, greedy(logprobs=3))
    assert got.token_ids == want.token_ids
    assert_same_logprobs(got.logprobs, want.logprobs)
    assert engine.core.scheduler.prefix_hit_tokens - hits == (200 - 1) // block * block


def test_ngram_speculation_rolls_the_state_back_to_the_same_tokens(tiny, engine):
    """Proposals the target rejects were run through the DeltaNet layers in the verify: their state must be
    rolled back to the accepted rows, or every later token reads a state that saw them."""
    spec = BieEngine(EngineConfig(engine_dir=str(tiny[1]), device="cpu", speculative={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "adaptive": False}))
    ids = prompt(12, 52) * 4   # a prompt after which the lookup's proposals are accepted now and then
    assert spec.generate(ids, greedy(64)).token_ids == engine.generate(ids, greedy(64)).token_ids
    counts, accepted = spec.core.spec.counts, spec.core.spec.accepted_by_position
    # most proposals rejected at once (the state kept after the pending row only), some after one or two rows
    assert counts["num_draft_tokens"] > counts["num_accepted_tokens"] > 0 and accepted[1] > 0, (counts, accepted)
    assert_slots_free(spec)


def test_a_qwen35_draft_is_refused(tiny, tmp_path):
    from bie_trt.builder.build import BuildOptions, build_engine
    from bie_trt.errors import CheckpointError

    with pytest.raises(CheckpointError, match="draft is not supported"):
        build_engine(BuildOptions(checkpoint=tiny[2], out=str(tmp_path / "e"), profile="cpu",
                                  draft_checkpoint=tiny[2]), log=lambda m: None)


@pytest.mark.slow
def test_recurrent_state_memory_is_constant_over_1000_generated_tokens(engine):
    """The state slots are the same tensors, of the same bytes, at every step of a 1,000-token generation,
    while the full-attention layers' blocks grow with the text."""
    states = engine.core.runner.pools.recurrent
    tensors, nbytes = (states.conv, states.delta), states.nbytes()
    seq_blocks = []
    stream = engine.stream(prompt(20, 41), greedy(1000))
    for event in stream:
        assert states.conv is tensors[0] and states.delta is tensors[1]
        assert states.nbytes() == nbytes
        seq_blocks += [len(s.block_table) for s in engine.core.scheduler.running]
    assert len(event.output.token_ids) == 1000
    assert seq_blocks[0] <= 2 and max(seq_blocks) >= 1000 // engine.core.blocks.block_size
    assert_slots_free(engine)



def test_a_snapshot_interval_lets_a_prompt_that_shares_only_a_start_resume(tiny, uncached):
    """With state_snapshot_interval 32 a 200-token prompt also saves its state at 32, 64, 96...; a prompt that
    shares only its first 100 tokens then resumes from 96 (without the interval: from nothing, as the
    engine fixture shows), to the tokens of an engine without the cache. An interval off the block size is
    refused."""
    from bie_trt.errors import EngineError

    every = BieEngine(EngineConfig(engine_dir=str(tiny[1]), device="cpu", state_snapshot_interval=32))
    first = prompt(200, 35)
    every.generate(first, greedy())
    assert len(every.core.blocks.snapshots) == 200 // 32
    other = first[:100] + prompt(60, 36)
    hits = every.core.scheduler.prefix_hit_tokens
    got, want = every.generate(other, greedy(logprobs=3)), uncached.generate(other, greedy(logprobs=3))
    assert got.token_ids == want.token_ids
    assert_same_logprobs(got.logprobs, want.logprobs)
    assert every.core.scheduler.prefix_hit_tokens - hits == 96
    with pytest.raises(EngineError, match="multiple of the KV block size"):
        BieEngine(EngineConfig(engine_dir=str(tiny[1]), device="cpu", state_snapshot_interval=24))


def test_an_engine_planned_without_snapshots_keeps_prefix_caching_off(tiny, tmp_path):
    r = CliRunner().invoke(main, ["build", "--checkpoint", tiny[2], "--out", str(tmp_path / "engine"),
                                  "--profile", "cpu", "--max-model-len", "512", "--kv-cache-dtype", "fp16",
                                  "--max-num-seqs", "1", "--state-snapshots", "0"])
    assert r.exit_code == 0, r.output
    bare = BieEngine(EngineConfig(engine_dir=str(tmp_path / "engine"), device="cpu"))
    assert bare.core.runner.pools.recurrent.num_snapshots == 0 and bare.core.blocks.cache is None
    ids = prompt(80, 37)
    assert bare.generate(ids, greedy()).token_ids == bare.generate(ids, greedy()).token_ids
    assert bare.core.scheduler.prefix_hit_tokens == 0
