"""Exact speculative sampling (Leviathan et al. 2023, Chen et al. 2023): keep what the target would
have sampled, and only that.

Draft token x_i, drawn from q_i, is accepted with probability min(1, p_i(x_i) / q_i(x_i)); the first
rejected position draws from normalise(max(0, p_i - q_i)) instead, and when every proposal passes a
bonus token comes from p_{k}. Each emitted token is then distributed exactly as p, the target's
processed distribution (penalties, temperature, top-k/p, min-p applied as `sampling.py` applies them).
A deterministic proposer (n-gram lookup) has q one-hot on its token: x is kept with probability p(x),
else the token is drawn from p with x removed.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..sampling import probabilities, process_logits
from ..sampling_params import SamplingParams
from .proposer import Proposal

if TYPE_CHECKING:
    from ..logits_constraint import LogitsConstraint


def rejection_sample(target: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                     generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched over B independent proposals of k tokens each.

    target [B, k+1, V]: p at each proposal position and one past the last; draft_tokens [B, k] long;
    draft_probs [B, k, V] the q each was drawn from, or None for one-hot q.
    Returns (tokens [B, k+1], num_accepted [B]): row b emits tokens[b, :num_accepted[b] + 1] (the
    accepted drafts, then the recovered or bonus token); the rest is -1.
    """
    B, k = draft_tokens.shape
    rows = torch.arange(B)
    p_draft = target[:, :k].gather(-1, draft_tokens[..., None])[..., 0]
    q_draft = (torch.ones_like(p_draft) if draft_probs is None
               else draft_probs.gather(-1, draft_tokens[..., None])[..., 0])
    u = torch.rand(B, k, generator=generator, dtype=target.dtype)
    accepted = u * q_draft < p_draft   # u < p/q without dividing by a q that may underflow
    num_accepted = accepted.long().cumprod(-1).sum(-1)
    p_next = target[rows, num_accepted]   # [B, V]
    rejected = num_accepted < k
    at = num_accepted.clamp(max=k - 1)
    if draft_probs is None:
        q_next = torch.nn.functional.one_hot(draft_tokens[rows, at], target.shape[-1]).to(target.dtype)
    else:
        q_next = draft_probs[rows, at]
    residual = torch.where(rejected[:, None], (p_next - q_next).clamp_min(0), p_next)
    mass = residual.sum(-1, keepdim=True)
    # p <= q everywhere means p == q: a rejection had probability 0, yet rounding can get here; p is then right
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p_next)
    last = torch.multinomial(residual, 1, generator=generator)[:, 0]
    tokens = torch.full((B, k + 1), -1, dtype=torch.long)
    tokens[:, :k] = torch.where(accepted.long().cumprod(-1).bool(), draft_tokens, -1)
    tokens[rows, num_accepted] = last
    return tokens, num_accepted


def _processed_rows(logits: torch.Tensor, drafts: list[int], params: SamplingParams, prompt_ids: list[int],
                    output_ids: list[int], constraint: "LogitsConstraint | None") -> list[torch.Tensor]:
    rows, walked = [], 0
    try:
        for i in range(len(drafts) + 1):
            rows.append(process_logits(logits[i].float().cpu().clone(), params, prompt_ids, output_ids + drafts[:i],
                                       constraint))
            # Row i+1 needs the grammar after drafts[i]. A draft the grammar forbids has p = 0 in row i, so it
            # is rejected there and the rows after it are never used: they keep the state before it.
            if constraint is not None and i < len(drafts) and walked == i and constraint.try_accept(drafts[i]):
                walked += 1
    finally:
        if constraint is not None:
            constraint.rollback(walked)
    return rows


def greedy_accept(target_argmax: list[int], draft_tokens: list[int]) -> list[int]:
    """Greedy fast path: the longest prefix of the drafts equal to the target's argmaxes, then the
    target's own next token (identical to decoding one token at a time)."""
    out = []
    for want, got in zip(target_argmax, draft_tokens):
        out.append(want)
        if want != got:
            return out
    return out + [target_argmax[len(draft_tokens)]]


def verify(logits: torch.Tensor, proposal: Proposal, params: SamplingParams, generator: torch.Generator,
           prompt_ids: list[int], output_ids: list[int], constraint: "LogitsConstraint | None" = None) -> list[int]:
    """The target's logits [k+1, V] at the last token and each of k proposed tokens -> the tokens to
    emit (accepted proposals, then one more). Position i's penalties and constraint (its grammar state)
    see the output through proposal i, which is what they see without speculation whenever position i
    is reached (all before it accepted). The grammar is left where it was: the caller advances it with
    what is emitted."""
    drafts = proposal.token_ids
    rows = _processed_rows(logits, drafts, params, prompt_ids, output_ids, constraint)
    if params.temperature == 0:
        return greedy_accept([int(torch.argmax(r)) for r in rows], drafts)
    target = torch.stack([probabilities(r, params) for r in rows])
    q = None
    if proposal.probs is not None:
        q = proposal.probs.float().cpu()
        if q.shape[-1] < target.shape[-1]:   # a draft vocabulary padded shorter than the target's
            q = torch.nn.functional.pad(q, (0, target.shape[-1] - q.shape[-1]))
        q = q[None, :, :target.shape[-1]]
    tokens, accepted = rejection_sample(target[None], torch.tensor([drafts]), q, generator)
    return tokens[0, :int(accepted[0]) + 1].tolist()
