"""Structured outputs without an engine: request validation, the bitmask applied to logits, the constraint
(logit_bias, min_tokens, grammar) in the host and device samplers, and speculative verification masking
row i by the grammar after drafts[:i] and leaving the grammar where it was. Real SmolLM2 tokenizer."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from transformers import AutoTokenizer

from bie_trt.errors import RequestError
from bie_trt.logits_constraint import GrammarCompiler, LogitsConstraint, apply_bitmask
from bie_trt.sampling import make_generator, sample_next, top_logprobs
from bie_trt.sampling_params import SamplingParams, StructuredOutputs
from bie_trt.spec_decode.proposer import Proposal
from bie_trt.spec_decode.rejection import verify

EOS = 2


@pytest.fixture(scope="module")
def tokenizer(smollm2_checkpoint):
    return AutoTokenizer.from_pretrained(str(smollm2_checkpoint))


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, len(tokenizer), [EOS])


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text)["input_ids"]


def constraint(compiler, so: StructuredOutputs | None = None, **kw) -> LogitsConstraint:
    params = SamplingParams(structured_outputs=so, **kw)
    return LogitsConstraint.build(params, [EOS], compiler)


# -- validation ------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    (dict(structured_outputs=StructuredOutputs(json={"type": "object", "required": "a"})), "not valid JSON Schema"),
    (dict(structured_outputs=StructuredOutputs(json="{not json")), "not valid JSON"),
    (dict(structured_outputs=StructuredOutputs(regex="a(b")), "does not compile"),
    (dict(structured_outputs=StructuredOutputs(choice=[])), "non-empty list"),
    (dict(structured_outputs=StructuredOutputs(regex="a", choice=["a"])), "exactly one"),
    (dict(structured_outputs={"jsn": {}}), "unknown keys"),
    (dict(response_format={"type": "yaml"}), "response_format.type 'yaml' is unknown"),
    (dict(response_format={"type": "json_schema"}), "needs json_schema"),
    (dict(response_format={"type": "json_object"}, structured_outputs=StructuredOutputs(regex="x")), "both"),
    (dict(response_format={"type": "json_object"}, structured_outputs=StructuredOutputs(json_object=True)), "both"),
    (dict(logit_bias={1: 101}), r"logit_bias\[1\] must be a number in \[-100, 100\]"),
    (dict(logit_bias={1: float("nan")}), "logit_bias"),
    (dict(logit_bias={"x": 1}), "keys must be token ids"),
    (dict(logit_bias={-3: 1}), "not a token id"),
    (dict(min_tokens=-1), "min_tokens must be an integer >= 0"),
    (dict(min_tokens=20, max_tokens=10), "min_tokens 20 is above max_tokens 10"),
])
def test_bad_parameters_are_refused_with_the_reason(kwargs, message):
    with pytest.raises(RequestError, match=message):
        SamplingParams(**kwargs)


def test_response_format_becomes_structured_outputs():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    p = SamplingParams(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema,
                                                                               "strict": True}})
    # read once, into the one field the engine reads: the params hold one constraint, whatever checks them again
    assert (p.structured_outputs, p.response_format) == (StructuredOutputs(json=schema), None)
    assert dataclasses.replace(p, seed=3).structured_outputs == p.structured_outputs   # the server's per choice
    p.response_format = {"type": "json_object"}   # an edit the engine would never read: refused, not ignored
    with pytest.raises(RequestError, match="response_format is read as SamplingParams are made"):
        p.validate()
    assert SamplingParams(response_format={"type": "json_object"}).structured_outputs == StructuredOutputs(
        json_object=True)
    assert SamplingParams(response_format={"type": "text"}).structured_outputs is None
    assert SamplingParams(logit_bias={"7": -5}).logit_bias == {7: -5}


@pytest.mark.parametrize("so, message", [
    (StructuredOutputs(json={"type": "array", "uniqueItems": True}), "Unimplemented keys"),
    (StructuredOutputs(json={"type": "string", "not": {"const": "a"}}), "Unimplemented keys"),
    (StructuredOutputs(grammar="root ::= undefined_rule"), "grammar cannot be compiled"),
    (StructuredOutputs(regex="(?=a)b"), "regex cannot be compiled"),   # Python compiles it; the engine cannot
])
def test_what_the_grammar_library_cannot_do_is_refused(compiler, so, message):
    with pytest.raises(RequestError, match=message):
        compiler.compile(so)


# -- the mask --------------------------------------------------------------------------------------

def test_apply_bitmask_keeps_exactly_the_set_bits():
    vocab = 100
    allowed = torch.zeros(vocab, dtype=torch.bool)
    allowed[[0, 5, 31, 32, 63, 64, 99]] = True
    words = torch.zeros((vocab + 31) // 32, dtype=torch.int64)
    for i in allowed.nonzero().flatten().tolist():
        words[i // 32] |= 1 << (i % 32)
    bitmask = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)   # as int32 words hold bit 31
    logits = torch.randn(vocab)
    out = apply_bitmask(logits.clone(), bitmask)
    assert torch.equal(torch.isfinite(out), allowed)
    assert torch.equal(out[allowed], logits[allowed])


def test_grammar_decides_the_greedy_token_and_advances(compiler, tokenizer):
    c = constraint(compiler, StructuredOutputs(choice=["yes", "no"]))
    logits = torch.zeros(len(tokenizer))
    logits[ids(tokenizer, "maybe")[0]] = 50.0   # the model's favourite is not allowed
    no = ids(tokenizer, "no")[0]
    logits[no] = 1.0
    g = make_generator(SamplingParams(), 0)
    token = sample_next(logits, SamplingParams(temperature=0), g, [1], [], c)
    assert token == no
    c.accept(token)
    assert sample_next(logits, SamplingParams(temperature=0), g, [1], [token], c) == EOS   # only EOS is left
    c.accept(EOS)
    assert c.finished


def test_device_sampler_applies_the_same_constraint(compiler, tokenizer):
    """The device sampler goes through the same function (on the CPU device here); logprobs stay raw."""
    c = constraint(compiler, StructuredOutputs(regex="[0-9]+"), logit_bias={ids(tokenizer, "7")[0]: 100})
    logits = torch.randn(len(tokenizer), generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.0, seed=3)
    gen = make_generator(params, 0, logits.device)
    token = sample_next(logits, params, gen, [1], [], c)
    top = top_logprobs(logits, token, 1)
    assert token == ids(tokenizer, "7")[0]
    assert top[token] == pytest.approx(float(torch.log_softmax(logits, -1)[token]))


def test_min_tokens_masks_eos_and_stop_ids_but_yields_to_a_complete_grammar(compiler, tokenizer):
    stop = 42
    c = constraint(None, None, min_tokens=2, stop_token_ids=[stop], max_tokens=5)
    logits = torch.zeros(len(tokenizer))
    logits[EOS], logits[stop] = 9.0, 8.0
    out = c.apply(logits.clone(), num_output=1)
    assert out[EOS] == float("-inf") and out[stop] == float("-inf") and torch.isfinite(out[3])
    assert torch.equal(c.apply(logits.clone(), num_output=2), logits)
    done = constraint(compiler, StructuredOutputs(choice=["a"]), min_tokens=3, max_tokens=5)
    done.accept(ids(tokenizer, "a")[0])
    out = done.apply(logits.clone(), num_output=1)   # the grammar allows only EOS: it wins
    assert torch.isfinite(out).nonzero().flatten().tolist() == [EOS]


def test_a_request_that_constrains_nothing_has_no_constraint(compiler):
    assert LogitsConstraint.build(SamplingParams(), [EOS], compiler) is None


def test_the_cache_returns_one_compiled_grammar_per_spec_and_each_request_its_own_state(compiler, tokenizer):
    so = StructuredOutputs(json={"type": "object", "properties": {"k": {"type": "integer"}}, "required": ["k"]})
    same = StructuredOutputs(json=json.dumps({"required": ["k"], "type": "object",
                                              "properties": {"k": {"type": "integer"}}}))
    assert compiler.compile(so) is compiler.compile(same)
    a, b = compiler.matcher(so), compiler.matcher(same)
    assert a.accept(ids(tokenizer, "{")[0])
    assert torch.equal(b.allowed(), compiler.matcher(so).allowed())   # b did not move with a



def test_a_grammar_reused_early_stays_cached_past_the_caches_capacity(tokenizer):
    small = GrammarCompiler(tokenizer, len(tokenizer), [EOS], cache_size=2)
    a, b, c = (StructuredOutputs(regex=r) for r in ("a+", "b+", "c+"))
    first, first_b = small.compile(a), small.compile(b)
    assert small.compile(a) is first   # a hit: a is now the most recently used
    small.compile(c)                   # a third spec: the least recently used (b) makes room
    assert small.compile(a) is first
    assert small.compile(b) is not first_b

# -- speculative verification ----------------------------------------------------------------------

def grammar_rows(tokenizer, wanted: list[int]) -> torch.Tensor:
    """Logits [k+1, V] whose argmax at row i is wanted[i]."""
    rows = torch.zeros(len(wanted), len(tokenizer))
    for i, t in enumerate(wanted):
        rows[i, t] = 10.0
    return rows


def test_verify_masks_each_row_with_the_state_after_the_drafts_before_it(compiler, tokenizer):
    """Grammar "ab" | "ba". Each row's unconstrained argmax is `x`: only the grammar's mask (at the right
    state) makes the target choose a, then b, then EOS."""
    a, b, x = ids(tokenizer, "a")[0], ids(tokenizer, "b")[0], ids(tokenizer, "x")[0]
    c = constraint(compiler, StructuredOutputs(regex="ab|ba"))
    rows = grammar_rows(tokenizer, [x, x, x])
    rows[0, a], rows[1, b], rows[2, EOS] = 5.0, 5.0, 5.0
    rows[0, b] = rows[1, a] = 4.0   # allowed at row 0 too, but below a; at row 1 the grammar forbids a
    before = c.grammar.allowed().clone()
    tokens = verify(rows, Proposal([a, b]), SamplingParams(temperature=0), make_generator(SamplingParams(), 0),
                    [1], [], c)
    assert tokens == [a, b, EOS]
    assert torch.equal(c.grammar.allowed(), before) and c.grammar.num_accepted == 0   # rolled back


def test_verify_rejects_a_forbidden_draft_even_when_the_model_wants_it(compiler, tokenizer):
    a, b, x = ids(tokenizer, "a")[0], ids(tokenizer, "b")[0], ids(tokenizer, "x")[0]
    c = constraint(compiler, StructuredOutputs(regex="ab|ba"))
    rows = grammar_rows(tokenizer, [x, x, x])
    rows[0, b] = 5.0
    for params in (SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=0)):
        # the draft x is what the raw logits favour at row 0; the grammar forbids it
        tokens = verify(rows, Proposal([x, a]), params, make_generator(params, 0), [1], [], c)
        assert tokens[0] != x and len(tokens) == 1
        assert c.grammar.num_accepted == 0
        assert c.try_accept(tokens[0])   # what it drew instead is allowed
        c.rollback(1)


def test_verify_under_sampling_keeps_allowed_drafts_and_rolls_back(compiler, tokenizer):
    a, b = ids(tokenizer, "a")[0], ids(tokenizer, "b")[0]
    c = constraint(compiler, StructuredOutputs(regex="ab|ba"))
    rows = grammar_rows(tokenizer, [a, b, EOS]) * 3   # peaked: allowed drafts are accepted
    params = SamplingParams(temperature=1.0, seed=1)
    tokens = verify(rows, Proposal([a, b]), params, make_generator(params, 1), [1], [], c)
    assert tokens == [a, b, EOS]
    assert c.grammar.num_accepted == 0
    for t in tokens:   # the engine then advances the grammar with what was emitted
        c.accept(t)
    assert c.finished


def test_allowed_prefix_counts_what_the_grammar_takes_and_keeps_its_state(compiler, tokenizer):
    """What the engine cuts proposals with: a draft the grammar refuses, and all after it, are never verified."""
    a, b = ids(tokenizer, "a")[0], ids(tokenizer, "b")[0]
    c = constraint(compiler, StructuredOutputs(regex="ab|ba"))
    assert c.allowed_prefix([a, b, EOS, a]) == 3   # nothing follows the stop token
    assert c.allowed_prefix([a, a, b]) == 1
    assert c.allowed_prefix([EOS]) == 0            # not before the grammar is complete
    assert c.grammar.num_accepted == 0 and not c.finished
    c.accept(b)
    assert c.allowed_prefix([a, EOS]) == 2 and c.grammar.num_accepted == 1
    assert constraint(compiler, logit_bias={a: -5.0}).allowed_prefix([a, b, a]) == 3   # no grammar: all of them


def test_a_finished_grammar_stays_finished_when_nothing_more_is_taken(compiler, tokenizer):
    """allowed_prefix after the stop token takes nothing and rolls back zero tokens: the stop stays."""
    a, b = ids(tokenizer, "a")[0], ids(tokenizer, "b")[0]
    c = constraint(compiler, StructuredOutputs(regex="ab|ba"))
    for t in (a, b, EOS):
        c.accept(t)
    assert c.allowed_prefix([a]) == 0 and c.allowed_prefix([EOS]) == 0
    assert c.finished and c.grammar.num_accepted == 3 and c.grammar.allowed() is None
    c.rollback(1)   # the stop token itself: the grammar is open again, complete
    assert not c.finished and c.allowed_prefix([EOS]) == 1


def test_a_constraint_with_no_kind_set_is_a_request_error_not_stop_iteration():
    """An empty structured_outputs ({}) reached `kind` before validation on the server, whose async route
    turned the bare next()'s StopIteration into a 500."""
    with pytest.raises(RequestError, match="exactly one of"):
        StructuredOutputs().kind
