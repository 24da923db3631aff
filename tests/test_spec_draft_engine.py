"""Speculation with a draft model, end to end through the engine: greedy output identical to plain
decoding with the target's own weights as the draft (which then accepts nearly every guess within its
window) and with a
genuinely different draft (which is mostly wrong), across prompts longer than the draft's window, a
batch of mixed lengths and a sampled request; blocks back to idle afterwards."""
from __future__ import annotations

import pytest

from bie_trt import BieEngine, EngineConfig, SamplingParams
from bie_trt.builder.checkpoint.quantize import quantize_checkpoint
from tiny_model import write_tiny_hf

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory, smollm2_checkpoint):
    """Another random model with SmolLM2's tokenizer: shares nothing with the target but the vocabulary."""
    root = tmp_path_factory.mktemp("other-draft")
    hf = write_tiny_hf(root / "hf", smollm2_checkpoint, seed=1, max_position_embeddings=8192)
    return quantize_checkpoint(hf, root / "awq", group_size=64)


def engines(engine_dir) -> tuple[BieEngine, BieEngine]:
    def make(speculative):
        return BieEngine(EngineConfig(engine_dir=str(engine_dir), device="cpu", speculative=speculative))

    return make({"method": "none"}), make(None)   # None: the engine's default, its draft as planned


def prompts(engine: BieEngine, lee_text) -> list[list[int]]:
    ids = engine.encode(" ".join(lee_text.read_text().split()[:400]))
    return [ids[:12], ids[40:70], ids[100:300]]   # the last is longer than sinks + window (16 + 64)


def idle(engine: BieEngine) -> bool:
    return all(pool["used"] == 0 for pool in engine.stats().kv_blocks.values())


def test_the_target_as_its_own_draft_is_accepted_and_changes_nothing(build, tiny_draft, lee_text):
    engine_dir = build(checkpoint=str(tiny_draft), draft_checkpoint=str(tiny_draft), draft_vocab_size=49152,
                       draft_window_tokens=64)
    plain, spec = engines(engine_dir)
    batch = prompts(plain, lee_text)
    want = [o.token_ids for o in plain.generate(batch, GREEDY)]
    got = spec.generate(batch, GREEDY)
    assert [o.token_ids for o in got] == want
    # Inside its window the draft sees what the target sees, so it guesses the target's tokens; past it
    # (the long prompt) a random model's nearly flat logits flip with the context it lacks.
    within = [o.spec_decode for o in got[:2]]
    assert all(d["num_drafts"] > 0 for d in within)
    assert sum(d["num_accepted_tokens"] for d in within) >= 0.95 * sum(d["num_draft_tokens"] for d in within)
    s = spec.stats().spec_decode
    assert sum(o.spec_decode["num_accepted_tokens"] for o in got) == s["num_accepted_tokens"]
    assert sum(s["accepted_by_position"]) == s["num_accepted_tokens"]
    assert idle(spec)


@pytest.mark.slow
def test_a_different_draft_changes_no_greedy_token(build, tiny_draft, other_draft, lee_text):
    engine_dir = build(checkpoint=str(tiny_draft), draft_checkpoint=str(other_draft), draft_vocab_size=4096,
                       draft_window_tokens=64)
    plain, spec = engines(engine_dir)
    batch = prompts(plain, lee_text)
    assert [o.token_ids for o in spec.generate(batch, GREEDY)] == [o.token_ids for o in plain.generate(batch, GREEDY)]
    s = spec.stats().spec_decode
    assert s["num_drafts"] > 0 and s["num_accepted_tokens"] < s["num_draft_tokens"]
    sampled = spec.generate(batch[1], SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=3))
    assert len(sampled.token_ids) == 16 or sampled.finish_reason == "stop"
    assert idle(spec)


DRAFT_VOCAB = 49152            # SmolLM2's ids
PADDED_VOCAB = DRAFT_VOCAB + 64   # a target padded past them, as Qwen2.5-7B pads 151,936 ids to 152,064


@pytest.fixture(scope="module")
def padded_pair(build, tmp_path_factory, smollm2_checkpoint):
    """A target whose vocabulary is padded past its tokenizer's, and as its draft the same weights
    without the padded rows (the Qwen2.5-7B / 0.5B pair's shape)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("padded")
    target = write_tiny_hf(root / "target", smollm2_checkpoint, vocab_size=PADDED_VOCAB, max_position_embeddings=8192)
    draft = root / "draft"
    shutil.copytree(target, draft)
    weights = load_file(str(draft / "model.safetensors"))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        weights[name] = weights[name][:DRAFT_VOCAB].contiguous()
    save_file(weights, str(draft / "model.safetensors"))
    cfg = json.loads((draft / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps({**cfg, "vocab_size": DRAFT_VOCAB}))
    target, draft = (quantize_checkpoint(hf, root / f"{hf.name}-awq", group_size=64) for hf in (target, draft))
    # A head of all but 512 ids: the rest are each request's own rows, which padded ids must not take.
    return build(checkpoint=str(target), draft_checkpoint=str(draft), draft_vocab_size=DRAFT_VOCAB - 512,
                 draft_window_tokens=64)


def test_a_draft_without_its_targets_padded_rows_proposes_and_changes_nothing(padded_pair, lee_text):
    plain, spec = engines(padded_pair)
    batch = prompts(plain, lee_text)[:2]
    # ids the draft cannot read, in the prompt: the first padded one (exactly its vocabulary size) and the last
    batch.append([DRAFT_VOCAB] + batch[0] + [PADDED_VOCAB - 1])
    want = [o.token_ids for o in plain.generate(batch, GREEDY)]
    got = spec.generate(batch, GREEDY)
    assert [o.token_ids for o in got] == want
    within = [o.spec_decode for o in got[:2]]   # the same weights as the target's, inside the window
    assert sum(d["num_accepted_tokens"] for d in within) >= 0.9 * sum(d["num_draft_tokens"] for d in within) > 0
    # The target made to emit a padded id: the draft reads it as a stand-in and goes on proposing.
    forced = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logit_bias={DRAFT_VOCAB: 100})
    assert spec.generate(batch[0], forced).token_ids == [DRAFT_VOCAB] * 8
    sampled = spec.generate(batch[1], SamplingParams(temperature=1.0, max_tokens=16, seed=5, ignore_eos=True))
    assert len(sampled.token_ids) == 16 and spec.stats().spec_decode["num_drafts"] > 0
    assert idle(spec)
