"""Sampling on the logits' device keeps the host's semantics: a generator made for a device draws
there exactly what a host generator of the same seed draws on the CPU, logprobs are the model's raw
distribution, and on a GPU a seed repeats its tokens and greedy equals the host."""
from __future__ import annotations

import pytest
import torch

from bie_trt.sampling import make_generator, sample_next, top_logprobs
from bie_trt.sampling_params import SamplingParams

PARAMS = [
    SamplingParams(temperature=0.0, repetition_penalty=1.3),
    SamplingParams(temperature=0.8, top_k=20, seed=5),
    SamplingParams(temperature=1.1, top_p=0.7, min_p=0.02, presence_penalty=2.0, frequency_penalty=2.0, seed=9),
    SamplingParams(temperature=0.6, top_k=50, top_p=0.9, repetition_penalty=3.0),
]


def logits_rows(n: int, vocab: int = 300, seed: int = 0) -> list[torch.Tensor]:
    """n steps over the same few rows, so penalties on tokens seen before change what is drawn."""
    g = torch.Generator().manual_seed(seed)
    base = [torch.randn(vocab, generator=g) * 3 for _ in range(3)]
    return [base[i % 3] for i in range(n)]


@pytest.mark.parametrize("params", PARAMS)
def test_same_tokens_as_host_sampling(params: SamplingParams) -> None:
    prompt = [int(r.argmax()) for r in logits_rows(3)]   # the likeliest tokens, penalised from the start
    host_out, dev_out = [], []
    host_gen, dev_gen = make_generator(params, 1), make_generator(params, 1, torch.device("cpu"))
    for row in logits_rows(12):
        host_out.append(sample_next(row, params, host_gen, prompt, host_out))
        token = sample_next(row, params, dev_gen, prompt, dev_out)
        logp = torch.log_softmax(row, -1)
        top = top_logprobs(row, token, 3)
        assert list(top)[:3] == logp.topk(3).indices.tolist()
        assert top == pytest.approx({i: float(logp[i]) for i in [*logp.topk(3).indices.tolist(), token]})
        dev_out.append(token)
    assert dev_out == host_out
    assert len(set(dev_out)) > 1 or params.temperature == 0


def test_generator_on_another_device_is_refused() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a second device kind")
    with pytest.raises(ValueError, match="make_generator"):
        sample_next(torch.zeros(4), SamplingParams(), make_generator(SamplingParams(), 0, torch.device("cuda")),
                    [], [])


@pytest.mark.gpu
def test_on_the_gpu_a_seed_repeats_and_greedy_equals_the_host() -> None:
    rows = logits_rows(16, vocab=128256)
    params = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, min_p=0.01, repetition_penalty=1.1, seed=3)
    runs = []
    for _ in range(2):
        g, out = make_generator(params, 0, torch.device("cuda")), []
        for row in rows:
            out.append(sample_next(row.cuda(), params, g, [1, 2], out))
        runs.append(out)
    assert runs[0] == runs[1]
    greedy = SamplingParams(temperature=0.0, presence_penalty=0.4)
    g = make_generator(greedy, 0, torch.device("cuda"))
    for row in rows:
        assert sample_next(row.cuda(), greedy, g, [5], [9, 9]) == \
            sample_next(row, greedy, make_generator(greedy, 0), [5], [9, 9])
