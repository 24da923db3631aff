"""The one sampler: rows of logits -> constraints (logit_bias, min_tokens, grammar) and penalties ->
the filtered distribution (temperature, top-k, min-p, top-p) -> a token, and the logprobs a request
asks for. Every function takes a batch of rows [B, V], each row with its own parameters, as tensors
on the logits' device (one launch per operation for the whole batch, no read back to the host); the
single-row forms that plain speculation and the draft use are those functions over a batch of one.

The engine's plain decoding draws each row by an exponential race (the token with the largest p/E,
E ~ Exp(1) per vocabulary entry, is drawn with probability p), its noise a counter-based hash of
(the request's seed, the output position, the token id): a seed repeats its tokens whatever else
is in the batch, on any device, with no per-request generator. Speculation and the draft model
draw from each request's `torch.Generator` (`draw`)."""
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
MIN_TEMPERATURE = 1e-5
_MASK32, _MASK64 = 0xFFFFFFFF, 0xFFFFFFFFFFFFFFFF


def make_generator(params: SamplingParams, fallback_seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A request's generator on `device`. A seed repeats its tokens on one kind of device (a CUDA
    generator's numbers are not the CPU's)."""
    g = torch.Generator(device=concrete(device))
    g.manual_seed(params.seed if params.seed is not None else fallback_seed)
    return g


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host values as a tensor on `device`, copied without waiting (`torch.tensor(..., device=cuda)` would wait
    for the stream: a sync)."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def _column(values: list, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A per-row parameter as a [B, 1] tensor beside the logits."""
    return to_device(values, dtype or like.dtype, like.device)[:, None]


def _rows_and_ids(lists: list[tuple[int, list[int]]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """[(row, token ids)] -> (row index of each id, the ids), flat, for indexing a [B, V] tensor at once."""
    rows = [row for row, ids in lists for _ in ids]
    ids = [i for _, ids in lists for i in ids]
    return to_device(rows, torch.long, device), to_device(ids, torch.long, device)


def penalise_rows(logits: torch.Tensor, params: list[SamplingParams], prompts: list[list[int]],
                  outputs: list[list[int]]) -> torch.Tensor:
    """Repetition (prompt and output tokens), presence and frequency (output tokens) penalties on logits
    [B, V], in place, each row with its own parameters and tokens."""
    rep = [(i, prompts[i] + outputs[i]) for i, p in enumerate(params)
           if p.repetition_penalty != 1.0 and (prompts[i] or outputs[i])]
    if rep:
        seen = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
        seen[_rows_and_ids(rep, logits.device)] = True
        r = _column([p.repetition_penalty for p in params], logits)
        logits.copy_(torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits))
    counted = [(i, outputs[i]) for i, p in enumerate(params)
               if outputs[i] and (p.presence_penalty or p.frequency_penalty)]
    if counted:
        counts = torch.zeros(logits.shape, dtype=logits.dtype, device=logits.device)
        where = _rows_and_ids(counted, logits.device)
        counts.index_put_(where, torch.ones(len(where[0]), dtype=logits.dtype, device=logits.device), accumulate=True)
        presence = _column([p.presence_penalty for p in params], logits)
        frequency = _column([p.frequency_penalty for p in params], logits)
        logits.sub_(torch.where(counts > 0, presence + frequency * counts, 0.0))
    return logits


def apply_penalties(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int],
                    output_ids: list[int]) -> torch.Tensor:
    """`penalise_rows` of one row [V], in place."""
    penalise_rows(logits[None], [params], [prompt_ids], [output_ids])
    return logits


def process_logits(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int], output_ids: list[int],
                   constraint: "LogitsConstraint | None" = None) -> torch.Tensor:
    """The one place a row of logits [V] is shaped before temperature and the filters, in place, on its
    device: first what the request forbids or favours (logit_bias, min_tokens, the grammar's mask at its
    current state), then the penalties."""
    if constraint is not None:
        constraint.apply(logits, len(output_ids))
    return apply_penalties(logits, params, prompt_ids, output_ids)


def probability_rows(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The filtered distributions [B, V] sampling draws from (temperature > 0), each row under its own
    temperature, top-k, min-p and top-p; speculation reuses them."""
    # a temperature near zero would overflow the logits to inf (and the softmax to NaN): below
    # MIN_TEMPERATURE the distribution is already all but one-hot
    logits = logits / _column([max(p.temperature, MIN_TEMPERATURE) for p in params], logits)
    vocab = logits.shape[-1]
    ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(ks):
        top = torch.topk(logits, max(ks)).values
        kth = top.gather(-1, _column([max(k - 1, 0) for k in ks], logits, torch.long))
        kth = kth.masked_fill(_column(ks, logits, torch.long) == 0, float("-inf"))   # rows without top-k
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if any(p.min_p > 0 for p in params):
        floor = _column([p.min_p for p in params], probs) * probs.amax(-1, keepdim=True) * (1 - _BOUNDARY_TOL)
        probs = probs.masked_fill(probs < floor, 0.0)
    if any(p.top_p < 1.0 for p in params):
        sorted_p, order = probs.sort(-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays). The sums run in
        # float64 and against the actual total: float32 softmax over a large vocabulary can be off by 1e-4.
        cum = sorted_p.double().cumsum(-1)
        drop = (cum - sorted_p) / cum[:, -1:] >= _column([p.top_p - _BOUNDARY_TOL for p in params], cum)
        drop &= _column([p.top_p < 1.0 for p in params], drop)   # (top_p 1 keeps even the tail under the slack)
        drop[:, 0] = False   # also when top_p is below the slack
        probs = probs.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
    return probs / probs.sum(-1, keepdim=True)


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """`probability_rows` of one row [V]."""
    return probability_rows(logits[None], [params])[0]


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


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def race_key(seed: int, position: int) -> tuple[int, int]:
    """The two 32-bit keys of the noise that draws output token `position` of a request seeded `seed`."""
    key = _splitmix64(_splitmix64(seed & _MASK64) ^ position)
    return key & _MASK32, key >> 32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (two multiply-xorshift rounds) of int64 tensors holding 32-bit values; the
    multiplier is below 2**31, so no product overflows int64."""
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _MASK32
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _MASK32
    return x ^ (x >> 16)


def exponential(hashes: torch.Tensor) -> torch.Tensor:
    """32-bit hashes -> Exp(1) draws, float32, all finite and > 0: a masked token's p = 0 over E = 0 would be
    NaN, which argmax takes. The top 23 bits plus a half are exact in float32 and their uniform stays below
    1 - 2**-24, whose log is not 0 (24 bits plus a half would round the largest to 1.0)."""
    return -torch.log(((hashes >> 9).float() + 0.5) * 2.0 ** -23)


def race_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """keys [B, 2] int64 (`race_key`s) -> E [B, vocab] float32, Exp(1) draws that are a function of (key,
    token id) alone."""
    ids = torch.arange(vocab, dtype=torch.long, device=keys.device)
    return exponential(_mix32(_mix32(ids ^ keys[:, :1]) ^ keys[:, 1:]))


def sample_rows(processed: torch.Tensor, params: list[SamplingParams], keys: torch.Tensor | None) -> torch.Tensor:
    """processed logits [B, V] -> tokens [B] (long, on their device): the argmax of a greedy row, else a
    draw from `probability_rows` by the race under the row's `race_key` (keys [B, 2]; None when all are
    greedy)."""
    tokens = processed.argmax(-1)
    drawn = [i for i, p in enumerate(params) if p.temperature != 0]
    if drawn:
        every = len(drawn) == len(params)
        at = slice(None) if every else to_device(drawn, torch.long, processed.device)
        probs = probability_rows(processed[at], [params[i] for i in drawn])
        tokens[at] = (probs / race_noise(keys[at], processed.shape[-1])).argmax(-1)
    return tokens


def logprob_rows(logits: torch.Tensor, tokens: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Log-probabilities of the model's distributions (raw logits [B, V], before constraints, penalties and
    filters) -> [B, 1 + 2m] float64, m = max(counts): each row's token's, then its top m ids and values.
    Read back with `top_logprobs_of`."""
    logp = torch.log_softmax(logits.float(), -1)
    values, ids = torch.topk(logp, max(counts))
    return torch.cat([logp.gather(-1, tokens[:, None]).double(), ids.double(), values.double()], -1)


def top_logprobs_of(row: list[float], token: int, n: int) -> dict[int, float]:
    """One row of `logprob_rows`, on the host, for the token and its top n -> {id: logprob}."""
    m = (len(row) - 1) // 2
    top = dict(zip((int(i) for i in row[1:1 + n]), row[1 + m:1 + m + n]))
    top[token] = row[0]
    return top


def top_logprobs(logits: torch.Tensor, token: int, n: int) -> dict[int, float]:
    """The top n and the sampled token's log-probabilities of one row [V], in one transfer from its device."""
    row = logprob_rows(logits[None], to_device([token], torch.long, logits.device), [n])[0].tolist()
    return top_logprobs_of(row, token, n)
