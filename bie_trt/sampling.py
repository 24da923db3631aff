"""Turning one sequence's logits into the next token: constraints (logit_bias, min_tokens, grammar),
penalties, temperature, top-k/p, min-p, seed."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .config import SamplingParams

if TYPE_CHECKING:
    from .structured import LogitsConstraint

# Probabilities from float32 softmax carry rounding of about 1e-7, so a threshold met exactly in
# intent (top_p 0.75 over [0.5, 0.25, 0.25]; a token at exactly min_p x the top one) can miss by an
# ulp either way. Comparisons give the boundary this much slack, far below any useful knob setting.
_BOUNDARY_TOL = 1e-6


def make_generator(params: SamplingParams, fallback_seed: int) -> torch.Generator:
    """Per-request generator on the CPU: the same seed gives the same tokens on any device."""
    g = torch.Generator()
    g.manual_seed(params.seed if params.seed is not None else fallback_seed)
    return g


def apply_penalties(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int],
                    output_ids: list[int]) -> torch.Tensor:
    # Index tensors on the logits' device: the same ops run on the host or on the GPU (device_sampling.py).
    if params.repetition_penalty != 1.0 and (prompt_ids or output_ids):
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.long, device=logits.device)
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty)
    if output_ids and (params.presence_penalty or params.frequency_penalty):
        ids, counts = torch.tensor(output_ids, dtype=torch.long, device=logits.device).unique(return_counts=True)
        logits[ids] -= params.presence_penalty + params.frequency_penalty * counts.to(logits.dtype)
    return logits


def process_logits(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int], output_ids: list[int],
                   constraint: "LogitsConstraint | None" = None) -> torch.Tensor:
    """The one place a row of logits [V] is shaped before temperature and the filters, in place, on its
    device: first what the request forbids or favours (logit_bias, min_tokens, the grammar's mask at its
    current state), then the penalties. The host sampler, the device sampler and verification share it."""
    if constraint is not None:
        constraint.apply(logits, len(output_ids))
    return apply_penalties(logits, params, prompt_ids, output_ids)


MIN_TEMPERATURE = 1e-5


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The filtered distribution sampling draws from (temperature > 0); speculation reuses it."""
    # a temperature near zero would overflow the logits to inf (and the softmax to NaN): below
    # MIN_TEMPERATURE the distribution is already all but one-hot
    logits = logits / max(params.temperature, MIN_TEMPERATURE)
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.min_p > 0:
        probs = probs.masked_fill(probs < params.min_p * probs.max() * (1 - _BOUNDARY_TOL), 0.0)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays). The sums run in
        # float64 and against the actual total: float32 softmax over a large vocabulary can be off by 1e-4.
        cum = sorted_p.double().cumsum(-1)
        drop = (cum - sorted_p) / cum[-1] >= params.top_p - _BOUNDARY_TOL
        drop[0] = False   # also when top_p is below the slack
        probs = probs.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
    return probs / probs.sum()


def sample_next(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator,
                prompt_ids: list[int], output_ids: list[int], constraint: "LogitsConstraint | None" = None) -> int:
    """logits [V] float32 -> one token id."""
    logits = process_logits(logits.float().cpu().clone(), params, prompt_ids, output_ids, constraint)
    if params.temperature == 0:
        return int(torch.argmax(logits))
    return int(torch.multinomial(probabilities(logits, params), 1, generator=generator))
