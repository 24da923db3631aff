"""A step's plain rows of logits -> their next tokens (and the logprobs asked for), all rows in one batch on
the logits' device, read back to the host once."""
from __future__ import annotations

import torch

from ..sampling import logprob_rows, penalise_rows, race_key, sample_rows, to_device, top_logprobs_of
from ..logits_constraint import RowConstraint, apply_constraints
from .sequence import Sequence


def sample_step(seqs: list[Sequence], rows: list[torch.Tensor], constraints: list[RowConstraint | None]
                ) -> tuple[list[int], list[dict[int, float] | None]]:
    """Each sequence's next token from its row [V] under its constraint's row (`LogitsConstraint.row`), its
    penalties and its sampling parameters; a draw is keyed by (its seed, its output position), so it is the
    same whatever else is in the batch. -> (tokens, each token's logprobs or None)."""
    raw = torch.stack(rows)
    params = [seq.params for seq in seqs]
    asking = [i for i, p in enumerate(params) if p.logprobs is not None]
    logits = raw.float()
    if asking and logits is raw:   # the raw logits are read again for the logprobs
        logits = logits.clone()
    if any(c is not None for c in constraints):
        apply_constraints(logits, constraints)
    penalise_rows(logits, params, [seq.prompt_ids for seq in seqs], [seq.output_ids for seq in seqs])
    keys = None
    if any(p.temperature != 0 for p in params):
        keys = to_device([race_key(seq.generator.initial_seed(), len(seq.output_ids)) for seq in seqs], torch.long,
                         logits.device)
    tokens = sample_rows(logits, params, keys)
    if not asking:
        return tokens.tolist(), [None] * len(seqs)   # the step's one read back
    counts = [params[i].logprobs for i in asking]
    at = to_device(asking, torch.long, raw.device)
    logprobs = logprob_rows(raw[at], tokens[at], counts)
    host = torch.cat([tokens.double(), logprobs.flatten()]).tolist()   # the step's one read back
    ids, width = [int(t) for t in host[:len(seqs)]], logprobs.shape[1]
    tops: list[dict[int, float] | None] = [None] * len(seqs)
    for j, (i, n) in enumerate(zip(asking, counts)):
        tops[i] = top_logprobs_of(host[len(seqs) + j * width:len(seqs) + (j + 1) * width], ids[i], n)
    return ids, tops
