"""The rejection sampler is exact: every emitted token is distributed as the target's p, whatever q was.

Goodness of fit per position: among draws that reached position i (every proposal before it
accepted), the token at i must follow p_i. 200k draws, chi-square against p_i at a significance a
correct sampler passes with this seed; plausible wrong samplers fail the same test.
"""
from __future__ import annotations

import pytest
import torch

from bie_trt import SamplingParams
from bie_trt.spec_decode.proposer import Proposal
from bie_trt.spec_decode.rejection import greedy_accept, rejection_sample, verify

V, K, DRAWS = 6, 4, 200_000


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """P(chi2 >= observed) for observed counts against expected probabilities (cells with p > 0)."""
    n = counts.sum()
    keep = probs > 0
    if (counts[~keep] > 0).any():
        return 0.0   # a token the target can never emit
    expected = probs[keep] * n
    stat = ((counts[keep] - expected) ** 2 / expected).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


def random_pair(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(K + 1, V, generator=g, dtype=torch.float64) * 1.5
    p = torch.softmax(base, -1)
    # q near p, as a useful draft is, so that enough draws reach the last positions
    q = torch.softmax(base[:K] + torch.randn(K, V, generator=g, dtype=torch.float64) * 0.7, -1)
    p[1, 2] = 0.0   # a token only the draft proposes (top-k/top-p cut it from the target)
    p[1] /= p[1].sum()
    return p, q


def fit(sampler, p: torch.Tensor, q: torch.Tensor | None, seed: int = 0) -> tuple[float, int]:
    """-> (the smallest p-value over positions 0..K, the fewest draws that reached a position)."""
    g = torch.Generator().manual_seed(seed)
    # one-hot q: a deterministic proposer guessing each position's likeliest token, as a good lookup does
    proposer = q if q is not None else torch.eye(V, dtype=p.dtype)[p[:K].argmax(-1)]
    drafts = torch.stack([torch.multinomial(proposer[i], DRAWS, replacement=True, generator=g) for i in range(K)], 1)
    tokens, accepted = sampler(p.expand(DRAWS, -1, -1), drafts, None if q is None else q.expand(DRAWS, -1, -1), g)
    values, fewest = [], DRAWS
    for i in range(K + 1):
        reached = accepted >= i
        fewest = min(fewest, int(reached.sum()))
        counts = torch.bincount(tokens[reached, i], minlength=V).double()
        values.append(chi_square_p_value(counts, p[i]))
    return min(values), fewest


# A correct sampler passes at this level at every position; a wrong one is off by far more.
ALPHA = 1e-3


@pytest.mark.parametrize("seed", [1, 2])
def test_emitted_tokens_follow_the_target_with_a_draft_distribution(seed):
    p, q = random_pair(seed)
    p_value, fewest = fit(rejection_sample, p, q, seed)
    assert p_value > ALPHA and fewest > 5_000   # enough draws at every position for the test to have power


def test_emitted_tokens_follow_the_target_with_one_hot_proposals():
    p, _ = random_pair(3)
    p_value, fewest = fit(rejection_sample, p, None)
    assert p_value > ALPHA and fewest > 5_000


def _resample_from_p(target, drafts, q, g):
    """A plausible bug: on rejection, draw from p itself instead of the residual max(0, p - q)."""
    tokens, accepted = rejection_sample(target, drafts, q, g)
    B = len(drafts)
    resampled = torch.multinomial(target[torch.arange(B), accepted], 1, generator=g)[:, 0]
    rejected = accepted < drafts.shape[1]
    tokens[torch.arange(B)[rejected], accepted[rejected]] = resampled[rejected]
    return tokens, accepted


def _bonus_from_q(target, drafts, q, g):
    """A plausible bug: when every proposal passes, the bonus token drawn from the draft's last q, not p_k."""
    tokens, accepted = rejection_sample(target, drafts, q, g)
    bonus = torch.multinomial(q[:, -1], 1, generator=g)[:, 0]
    all_passed = accepted == drafts.shape[1]
    tokens[all_passed, -1] = bonus[all_passed]
    return tokens, accepted


@pytest.mark.parametrize("wrong", [_resample_from_p, _bonus_from_q])
def test_the_same_test_fails_a_wrong_sampler(wrong):
    p, q = random_pair(1)
    assert fit(wrong, p, q)[0] < 1e-6


def test_identical_p_and_q_accept_everything():
    p, _ = random_pair(4)
    g = torch.Generator().manual_seed(0)
    drafts = torch.stack([torch.multinomial(p[i], 1000, replacement=True, generator=g) for i in range(K)], 1)
    tokens, accepted = rejection_sample(p.expand(1000, -1, -1), drafts, p[:K].expand(1000, -1, -1), g)
    assert (accepted == K).all() and torch.equal(tokens[:, :K], drafts)


def test_greedy_accepts_the_longest_matching_prefix_then_the_target_token():
    assert greedy_accept([5, 6, 7, 8], [5, 6, 9]) == [5, 6, 7]
    assert greedy_accept([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]   # all pass: the bonus token
    assert greedy_accept([4, 6, 7, 8], [5, 6, 7]) == [4]


def test_penalties_at_each_position_see_the_accepted_proposals_before_it():
    """Greedy with a repetition penalty: position 1's argmax must be penalised for proposal 0's token."""
    logits = torch.tensor([[0.0, 3.0, 2.9, 0.0], [0.0, 3.0, 2.9, 0.0]])
    params = SamplingParams(temperature=0, repetition_penalty=2.0)
    # Without speculation: token 1, then token 1 is penalised (3.0 / 2 < 2.9): token 2.
    assert verify(logits, Proposal([1]), params, torch.Generator(), [0], []) == [1, 2]
    assert verify(logits, Proposal([2]), params, torch.Generator(), [0], []) == [1]


def test_verify_is_reproducible_per_seed():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=g)
    params = SamplingParams(temperature=1.0, top_p=0.9)
    runs = [verify(logits, Proposal([3, 4, 5]), params, torch.Generator().manual_seed(7), [1, 2], [])
            for _ in range(2)]
    assert runs[0] == runs[1] and 1 <= len(runs[0]) <= 4


def test_the_drafts_generator_is_independent_of_the_targets():
    """Each request samples its proposals from the draft's generator and verifies them with its own, both
    derived from one seed. Drawn from equal streams, the uniforms that accept a proposal would be the
    ones that drew it, and the emitted tokens past position 0 would stop following p."""
    from bie_trt.sampling import make_generator
    from bie_trt.spec_decode.draft import draft_generator

    p, q = random_pair(5)
    n, k = 6_000, 2
    tokens, accepted = [], []
    for seed in range(n):
        target = make_generator(SamplingParams(seed=seed), 0)
        draft = draft_generator(target.initial_seed())
        x = torch.stack([torch.multinomial(q[i], 1, generator=draft)[0] for i in range(k)])
        t, a = rejection_sample(p[None, :k + 1], x[None], q[None, :k], target)
        tokens.append(t[0])
        accepted.append(a[0])
    tokens, accepted = torch.stack(tokens), torch.stack(accepted)
    for i in range(k + 1):
        reached = accepted >= i
        counts = torch.bincount(tokens[reached, i], minlength=V).double()
        assert chi_square_p_value(counts, p[i]) > ALPHA, (i, chi_square_p_value(counts, p[i]))
