"""Prompt lookup: the continuation of the latest earlier occurrence of the longest matching suffix."""
from __future__ import annotations

from bie_trt import SamplingParams, SpeculativeConfig
from bie_trt.executor.sequence import Sequence
from bie_trt.sampling import make_generator
from bie_trt.spec_decode.ngram import NgramProposer, ngram_lookup


def test_the_longest_suffix_wins_over_a_later_shorter_match():
    #        0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [1, 2, 3, 9, 8, 5, 2, 3, 7, 1, 2, 3]
    # suffix (1, 2, 3) occurred at 0 -> 9, 8, ...; the 2-gram (2, 3) occurred later, at 6 -> 7
    assert ngram_lookup(tokens, 3, max_n=3, min_n=2) == [9, 8, 5]
    assert ngram_lookup(tokens, 3, max_n=2, min_n=2) == [7, 1, 2]   # the latest 2-gram occurrence


def test_proposals_stop_at_the_requested_count_and_at_the_end():
    tokens = [4, 5, 6, 4, 5]
    assert ngram_lookup(tokens, 1, 4, 2) == [6]
    assert ngram_lookup(tokens, 9, 4, 2) == [6, 4, 5]
    assert ngram_lookup(tokens, 0, 4, 2) == []


def test_no_match_of_at_least_min_tokens_proposes_nothing():
    assert ngram_lookup([1, 2, 3, 4, 3], 5, 4, 2) == []      # only the 1-gram (3) repeats
    assert ngram_lookup([1, 2, 3, 4, 3], 5, 4, 1) == [4, 3]
    assert ngram_lookup([7, 7], 5, 4, 2) == []


def test_the_proposer_looks_at_prompt_and_output():
    seq = Sequence([10, 11, 12, 13], SamplingParams(), make_generator(SamplingParams(), 0), output_ids=[10, 11])
    proposer = NgramProposer(SpeculativeConfig("ngram", prompt_lookup_max=3, prompt_lookup_min=2))
    assert [p.token_ids for p in proposer.propose([seq.proposal_request(2)])] == [[12, 13]]
    assert proposer.propose([seq.proposal_request(2)])[0].probs is None   # deterministic: one-hot q


def test_a_proposal_request_slices_prompt_and_output_as_one_list():
    seq = Sequence([1, 2, 3], SamplingParams(), make_generator(SamplingParams(), 0))
    seq.output_ids += [4, 5]
    request = seq.proposal_request(2)
    whole = [1, 2, 3, 4, 5]
    for start in range(6):
        for stop in range(start, 7):
            assert request.token_slice(start, stop) == whole[start:stop]
    assert request.num_total == 5 and request.key is seq and request.num_tokens == 2
