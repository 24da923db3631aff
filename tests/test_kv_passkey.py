"""Long-context retrieval through the default INT4 cache on a real model whose keys carry a large shared offset:
Qwen2.5-Coder-0.5B (Qwen2's k_proj bias). Before the build measured its keys, the INT4 cache lost a passkey at
every depth of ~10k tokens; with the settings the build now chooses (key centering, and the per-channel key
scale in the layers where it measured one helps) it must find all three (slow: a real build
and a ~10k-token prefill on the CPU; skipped, naming the install command, without the model's pieces).

One haystack carries three different secret numbers, at 10%, 50% and 90% of its depth, and each question is asked after it:
the prefix cache serves the ~10k shared tokens, so the CPU prefills them once, not three times."""
from __future__ import annotations

import json

import pytest

from bie_trt.builder.checkpoint.registry import resolve_checkpoint
from bie_trt.config import EngineConfig
from bie_trt.errors import CheckpointError
from bie_trt.eval_texts import load_eval_text
from bie_trt.executor.engine import BieEngine
from bie_trt.sampling_params import SamplingParams

CONTEXT = 10_240
# Three different facts, so that a question names one of them plainly: (depth, the fact, its question's start)
NEEDLES = ((0.1, 48213, "pass key"), (0.5, 70596, "launch code"), (0.9, 31862, "locker number"))
INTRO = "Three secret numbers are hidden inside a lot of irrelevant text. Find them and remember them.\n\n"
NEEDLE = "\nThe {what} is {key}. Remember it. {key} is the {what}.\n"
QUESTION = "\n\nWhat is the {what}? The {what} is"


def haystack(tokenizer, text: str) -> list[int]:
    """INTRO, then CONTEXT tokens of `text` with each needle at its depth."""
    def encode(s: str) -> list[int]:
        return tokenizer(s, add_special_tokens=False)["input_ids"]

    body = encode(text)[:CONTEXT]
    ids, done = encode(INTRO), 0
    for depth, key, what in NEEDLES:
        cut = int(CONTEXT * depth)
        ids += body[done:cut] + encode(NEEDLE.format(what=what, key=key))
        done = cut
    return ids + body[done:]


@pytest.mark.slow
def test_the_default_int4_cache_finds_a_passkey_at_three_depths_of_10k_tokens(build):
    try:
        checkpoint = resolve_checkpoint("qwen2.5-coder-0.5b")
    except CheckpointError as e:
        pytest.skip(f"needs the Qwen2.5-Coder-0.5B pieces: {e}")
    # Every KV option but the dtype at its default: the build decides centering from the measured keys.
    engine_dir = build(checkpoint=str(checkpoint), max_model_len=CONTEXT + 1024, kv_cache_dtype="int4_asym")
    kv = json.loads((engine_dir / "manifest.json").read_text())["kv"]
    assert (kv["dtype"], kv["key_centering"], kv["key_scale"]) == ("int4_asym", True, True)
    engine = BieEngine(EngineConfig(engine_dir=str(engine_dir), device="cpu", max_num_seqs=1))
    prefix = haystack(engine.tokenizer, load_eval_text("builtin:python-docs"))
    answers = {}
    for depth, key, what in NEEDLES:
        question = engine.tokenizer(QUESTION.format(what=what), add_special_tokens=False)["input_ids"]
        answers[depth] = engine.generate(prefix + question, SamplingParams(temperature=0, max_tokens=6)).text
    assert all(str(key) in answers[depth] for depth, key, _ in NEEDLES), answers
