"""The one sampler: one row of logits -> constraints (logit_bias, min_tokens, grammar) and penalties ->
the filtered distribution (temperature, top-k, min-p, top-p) -> a token, and the logprobs a request
asks for. Plain decoding, the draft's proposals and verification all go through these functions, on
the host or on the device the logits are on (drawing there with a generator on that device, so only
the token id crosses to the host)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .devices import concrete
from .sampling_params import SamplingParams

if TYPE_CHECKING:
    from .logits_constraint import LogitsConstraint

# Probabilities from float32 softmax carry rounding of about 1e-7, so a threshold met exactly in
# intent (top_p 0.75 over [0.5, 0.25, 0.25]; a token at exactly min_p x the top one) can miss by an
# ulp either way. Comparisons give the boundary this much slack, far below any useful knob setting.
_BOUNDARY_TOL = 1e-6


def make_generator(params: SamplingParams, fallback_seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A request's generator on `device`. A seed repeats its tokens on one kind of device (a CUDA
    generator's numbers are not the CPU's)."""
    g = torch.Generator(device=concrete(device))
    g.manual_seed(params.seed if params.seed is not None else fallback_seed)
    return g


def apply_penalties(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int],
                    output_ids: list[int]) -> torch.Tensor:
    # Index tensors on the logits' device: the same ops run on the host or on the GPU.
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
    current state), then the penalties."""
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


def draw(processed: torch.Tensor, params: SamplingParams, generator: torch.Generator
         ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """From processed logits [V]: (the token, a one-element tensor on their device; the distribution it was
    drawn from, None when greedy: the argmax, a one-hot distribution)."""
    if params.temperature == 0:
        return torch.argmax(processed).view(1), None
    probs = probabilities(processed, params)
    return torch.multinomial(probs, 1, generator=generator), probs


def sample_next(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator,
                prompt_ids: list[int], output_ids: list[int], constraint: "LogitsConstraint | None" = None) -> int:
    """logits [V] -> one token id, drawn where `generator` is: a CPU generator takes the row to the host, one
    on the logits' device draws there."""
    if generator.device.type == "cpu":
        logits = logits.cpu()
    elif generator.device != logits.device:
        raise ValueError(f"the generator is on {generator.device} but the logits on {logits.device}: "
                         "make it with make_generator(params, seed, logits.device).")
    processed = process_logits(logits.float().clone(), params, prompt_ids, output_ids, constraint)
    return int(draw(processed, params, generator)[0])


def top_logprobs(logits: torch.Tensor, token: int, n: int) -> dict[int, float]:
    """Log-probabilities of the model's distribution (before constraints, penalties and filters): the top n
    and the sampled token, in one transfer from the logits' device."""
    logp = torch.log_softmax(logits.float(), -1)
    values, ids = torch.topk(logp, n)
    host = torch.cat([logp[token].view(1).double(), ids.double(), values.double()]).tolist()
    top = dict(zip((int(i) for i in host[1:1 + n]), host[1 + n:]))
    top[token] = host[0]
    return top
