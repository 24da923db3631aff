"""Sampling where the logits are: on the GPU, only the token id (and the logprobs a request asks
for) cross to the host, in one copy, instead of the whole fp32 row (0.5 MB at a 128k vocabulary)
and a sync before any work on it.

The semantics are `sampling.py`'s, by construction: the same `process_logits` and `probabilities`
run on the device tensors, then `torch.multinomial` with a per-request generator on that device
(`device_generator`), so a seed gives the same tokens on every run on the same kind of device.
Greedy requests take the argmax. Logprobs are those of the model's distribution before the
sampling filters, as `engine._top_logprobs` reports them.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .config import SamplingParams
from .sampling import probabilities, process_logits

if TYPE_CHECKING:
    from .structured import LogitsConstraint


def device_generator(params: SamplingParams, fallback_seed: int, device: torch.device) -> torch.Generator:
    """A request's generator on the device its logits live on (seed as `sampling.make_generator`)."""
    g = torch.Generator(device=device)
    g.manual_seed(params.seed if params.seed is not None else fallback_seed)
    return g


def sample_on_device(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator,
                     prompt_ids: list[int], output_ids: list[int],
                     top_logprobs: int | None = None, constraint: "LogitsConstraint | None" = None
                     ) -> tuple[int, dict[int, float] | None]:
    """logits [V] on any device -> (token id, {id: logprob} of the top n and the token, or None)."""
    if generator.device != logits.device:
        raise ValueError(f"the generator is on {generator.device} but the logits on {logits.device}: "
                         "make it with device_generator(params, seed, logits.device).")
    raw = logits.float()
    penalised = process_logits(raw.clone(), params, prompt_ids, output_ids, constraint)
    if params.temperature == 0:
        token = torch.argmax(penalised).view(1)
    else:
        token = torch.multinomial(probabilities(penalised, params), 1, generator=generator)
    if top_logprobs is None:
        return int(token), None
    logp = torch.log_softmax(raw, -1)
    values, ids = torch.topk(logp, top_logprobs)
    # one transfer: the token, its logprob, then the top n ids and values
    host = torch.cat([token.to(torch.float64), logp[token].double(), ids.double(), values.double()]).tolist()
    token_id, n = int(host[0]), top_logprobs
    top = dict(zip((int(i) for i in host[2:2 + n]), host[2 + n:]))
    top[token_id] = host[1]
    return token_id, top
