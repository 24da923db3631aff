"""llama.cpp as the reference: node-llama-cpp's CPU build and bie-trt, on the same real Q4_K_M file and the
same prompt token ids, continue greedily to the same tokens (slow: a real build and two engines on the CPU;
skipped, naming the install command, without node or the package)."""
from __future__ import annotations

import math

import pytest

from bie_trt.builder.checkpoint.registry import resolve_checkpoint
from bie_trt.config import EngineConfig
from bie_trt.errors import CheckpointError
from bie_trt.eval_texts import load_eval_text, text_token_ids
from bie_trt.executor.engine import BieEngine
from bie_trt.sampling_params import SamplingParams
from scripts_dir import load_script

llama_cpp = load_script("llama_cpp")

PROMPTS, PROMPT_TOKENS, TOKENS = 2, 400, 16


@pytest.mark.slow
def test_greedy_tokens_equal_llama_cpps_on_the_coder_file(build):
    if why := llama_cpp.missing():
        pytest.skip(why)
    try:
        path = resolve_checkpoint("qwen2.5-coder-0.5b.gguf")
    except CheckpointError as e:
        pytest.skip(f"needs the Qwen2.5-Coder-0.5B pieces: {e}")
    engine_dir = build(checkpoint=str(path), max_model_len=2048, kv_cache_dtype="fp16")
    engine = BieEngine(EngineConfig(engine_dir=str(engine_dir), device="cpu"))
    prompts = llama_cpp.prompt_windows(text_token_ids(engine_dir, load_eval_text("builtin:python-docs")[:40_000]),
                                       text_token_ids(engine_dir, ""), PROMPTS, PROMPT_TOKENS)
    theirs = llama_cpp.greedy(path, prompts, TOKENS, context=PROMPT_TOKENS + TOKENS + 16)["tokens"]
    ours = [engine.generate(p, SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)).token_ids
            for p in prompts]
    # both run the file's own weights; what may differ is float summation order, so a near-tie may flip once
    same = sum(a == b for o, t in zip(ours, theirs) for a, b in zip(o, t))
    assert same >= PROMPTS * TOKENS - 1, (ours, theirs)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gemma3-270m.gguf", "qwen2.5-coder-0.5b.gguf"])
def test_each_greedy_token_is_llama_cpps_given_its_own_before_it(build, name):
    """Five 1,500-token prompts, llama.cpp continuing each greedily for 16 tokens: given the prompt and
    llama.cpp's own tokens before it, bie-trt's greedy next token is llama.cpp's at 15 of 16 positions or more
    on every prompt (scripts/gguf_agreement.py's `forced`; a departure is a near-tie under llama.cpp's
    rounding, whose own decode path leaves its prompt path's choice as often: docs/gguf.md)."""
    if why := llama_cpp.missing():
        pytest.skip(why)
    try:
        path = resolve_checkpoint(name)
    except CheckpointError as e:
        pytest.skip(f"needs {name}: {e}")
    engine_dir = build(checkpoint=str(path), max_model_len=2048, kv_cache_dtype="fp16")
    engine = BieEngine(EngineConfig(engine_dir=str(engine_dir), device="cpu", max_num_seqs=1))
    prompts = llama_cpp.prompt_windows(text_token_ids(engine_dir, load_eval_text("builtin:python-docs")),
                                       text_token_ids(engine_dir, ""), 5, 1500)
    theirs = llama_cpp.greedy(path, prompts, TOKENS, context=1500 + TOKENS + 16)["tokens"]
    forced = load_script("gguf_agreement").forced(engine, prompts, theirs)
    assert min(forced["same"]) >= TOKENS - 1, forced


@pytest.mark.slow
def test_llama_cpps_next_token_logprobs_are_transformers_on_the_same_file():
    """llama.cpp's teacher-forced log-probabilities (normalised over the whole vocabulary, not its top tokens) are
    transformers' on the file's weights, up to llama.cpp's rounding, and its context options reach it."""
    if why := llama_cpp.missing():
        pytest.skip(why)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_checkpoint("smollm2-135m.gguf")
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    text = load_eval_text("builtin:python-docs")[:2_000]
    seq = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)(text).input_ids[:120]
    start = 100
    with torch.no_grad():
        ours = torch.log_softmax(model(torch.tensor([seq])).logits[0, start:].double(), -1)
    runs = [llama_cpp.next_token_logprobs(path, [seq], [start], top=20, context=256, options=opts)[0]
            for opts in ({}, {"flashAttention": False})]
    assert runs[0] != runs[1]   # the option reached llama.cpp: its other attention path rounds otherwise
    for rows in runs:
        assert len(rows) == len(seq) - start
        spread = []
        for i, row in enumerate(rows):
            top5 = sorted(row, key=row.get, reverse=True)[:5]
            # normalised over the vocabulary: the 20 listed carry at most all of its mass
            assert sum(math.exp(v) for v in row.values()) <= 1 + 1e-6
            # llama.cpp rounds its activations to 8 bits before each product: near, not equal
            assert top5[0] == int(ours[i].argmax()) or float(ours[i].max() - ours[i, top5[0]]) < 0.3, (i, row)
            spread += [abs(row[t] - float(ours[i, t])) for t in top5]
        assert max(spread) < 0.5 and sum(spread) / len(spread) < 0.15, spread


def test_llama_cpps_kv_divergence_is_kl_of_both_renormalised_over_shared_top_tokens():
    """scripts/llama_cpp_kv.py's divergence, against torch's arithmetic: token 4 (listed by one run only) is left
    out, a log-prob of -900 does not underflow into a domain error, and a position with nothing shared is
    skipped."""
    import torch

    kl_over_top = load_script("llama_cpp_kv").kl_over_top
    a, b = {1: -0.1, 2: -2.5, 3: -900.0, 4: -3.0}, {1: -0.2, 2: -1.9, 3: -5.0}
    p = torch.tensor([-0.1, -2.5, -900.0], dtype=torch.float64).log_softmax(0)
    q = torch.tensor([-0.2, -1.9, -5.0], dtype=torch.float64).log_softmax(0)
    want = float((p.exp() * (p - q)).sum())
    assert kl_over_top([a, {7: -0.1}], [b, {8: -0.1}]) == pytest.approx(want, rel=1e-9)
