"""End to end, sampling at temperature 1 with top-p 0.9: the tokens at output positions 1-4 follow the same
distribution with n-gram speculation, and with a draft model whose distributions differ from the
target's, as without (two-sample chi-square per position), on a tiny random model whose next-token
distributions are peaked enough for the histograms to tell samplers apart (drawing from p instead of
the residual on a rejection fails this test by orders of magnitude)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from bie_trt import BieEngine, EngineConfig, SamplingParams, SpeculativeConfig
from bie_trt.builder.build import BuildOptions, build_engine
from bie_trt.builder.checkpoint.quantize import quantize_checkpoint
from bie_trt.model.synthetic import write_word_tokenizer
from tiny_model import write_tiny_hf

N = 800           # requests per engine
POSITIONS = 4


def peaked_model(root: Path, tokenizer: Path, head_scale: float) -> Path:
    """Peaked next-token distributions (a few likely tokens), and attention nearly silent so the next token
    depends mostly on the last one: lookup proposals from the model's own chains are then often right."""
    hf = write_tiny_hf(root / "hf", tokenizer, num_attention_heads=2, num_key_value_heads=1, vocab_size=48)
    weights = load_file(str(hf / "model.safetensors"))
    weights["lm_head.weight"] = weights["lm_head.weight"] * head_scale
    for name in weights:
        if "o_proj" in name:
            weights[name] = weights[name] * 0.1
    save_file(weights, str(hf / "model.safetensors"))
    return quantize_checkpoint(hf, root / "awq", group_size=32)


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tiny-spec")
    tokenizer = write_word_tokenizer(root / "tok")
    awq = peaked_model(root / "target", tokenizer, 9)
    # The same weights with a sharper head as the draft: q over-weights the likeliest tokens, so a sampler
    # that drew from p instead of the residual after a rejection would over-weight them too.
    draft = peaked_model(root / "draft", tokenizer, 14)
    # The engine's default speculation, stored at build: the n-gram run below asks for no other.
    default = SpeculativeConfig("ngram", num_speculative_tokens=3, prompt_lookup_max=2, prompt_lookup_min=1)
    # The draft's head: 16 static ids and the 4 most recently seen of each request's own, so its q is zero
    # outside a set that moves as the request goes on.
    return build_engine(BuildOptions(checkpoint=str(awq), out=str(root / "engine"), profile="cpu", max_model_len=256,
                                     max_num_seqs=64, speculative=default, draft_checkpoint=str(draft),
                                     draft_vocab_size=16, draft_request_vocab=4, draft_window_tokens=64),
                        log=lambda m: None)


@pytest.fixture(scope="module")
def plain(tiny_engine) -> torch.Tensor:
    return histograms(tiny_engine, {"method": "none"})[0]


def histograms(engine_dir: Path, speculative: dict | None, logit_bias: dict[int, float] | None = None
               ) -> tuple[torch.Tensor, dict]:
    engine = BieEngine(EngineConfig(engine_dir=str(engine_dir), device="cpu", max_num_seqs=64,
                                    speculative=speculative))
    # The model's own greedy chains from every token: lookup then proposes what the model finds likely, so
    # proposals are accepted often and rejected often.
    heads = [[t] for t in range(3, 48)]
    chains = engine.generate(heads, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    prompt = [t for head, out in zip(heads, chains) for t in head + out.token_ids]
    params = [SamplingParams(temperature=1.0, top_p=0.9, max_tokens=POSITIONS, ignore_eos=True, seed=i,
                             logit_bias=logit_bias) for i in range(N)]
    outs = engine.generate([prompt] * N, params)
    tokens = torch.tensor([o.token_ids for o in outs])   # [N, POSITIONS]
    vocab = engine.core.runner.model_config.vocab_size
    counts = torch.stack([torch.bincount(tokens[:, i], minlength=vocab) for i in range(POSITIONS)])
    return counts, engine.stats().spec_decode


def two_sample_p_value(a: torch.Tensor, b: torch.Tensor) -> float:
    """Chi-square test that two histograms (equal totals) come from one distribution; bins with fewer than
    10 draws in all are pooled into one."""
    a, b = a.double(), b.double()
    big = (a + b) >= 10
    a = torch.cat([a[big], a[~big].sum(0, keepdim=True)])
    b = torch.cat([b[big], b[~big].sum(0, keepdim=True)])
    keep = (a + b) > 0
    a, b = a[keep], b[keep]
    expected = (a + b) / 2
    stat = (((a - expected) ** 2 + (b - expected) ** 2) / expected).sum()
    dof = len(a) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


@pytest.mark.parametrize("speculative", [None, pytest.param({"method": "draft_model", "num_speculative_tokens": 3},
                                                       marks=pytest.mark.slow)],
                         ids=["ngram", "draft"])
def test_positions_1_to_4_have_the_same_distribution_with_and_without_speculation(tiny_engine, plain,
                                                                                  speculative):
    spec, counters = histograms(tiny_engine, speculative)   # None: the engine's default, n-gram with num_speculative_tokens 3
    assert len(counters["accepted_by_position"]) == 3
    # Speculation ran and both outcomes happened often: proposals accepted and rejected.
    assert counters["num_draft_tokens"] > N
    assert 0.05 < counters["num_accepted_tokens"] / counters["num_draft_tokens"] < 0.95
    p_values = [two_sample_p_value(plain[i], spec[i]) for i in range(POSITIONS)]
    assert min(p_values) > 1e-3, p_values


# Up on some of the likeliest tokens, down on others: the draft now proposes under the request's logit_bias
# (as it does under its grammar), so its q is the biased one, and the target's p is biased too.
BIAS = {5: 1.5, 9: -2.0, 17: 1.0, 30: -1.0}


@pytest.mark.slow
def test_a_draft_proposing_under_logit_bias_keeps_the_distribution(tiny_engine):
    plain, _ = histograms(tiny_engine, {"method": "none"}, BIAS)
    spec, counters = histograms(tiny_engine, {"method": "draft_model", "num_speculative_tokens": 3}, BIAS)
    assert counters["num_draft_tokens"] > N
    assert 0.05 < counters["num_accepted_tokens"] / counters["num_draft_tokens"] < 0.95
    p_values = [two_sample_p_value(plain[i], spec[i]) for i in range(POSITIONS)]
    assert min(p_values) > 1e-3, p_values
