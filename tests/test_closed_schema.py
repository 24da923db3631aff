"""The closed reading of JSON schemas, held directly against llguidance with the real SmolLM2 tokenizer:
an undeclared key is refused unless the schema asks for others, integers stop at the int64 bound,
numbers at 15 digits and 6 decimals, whitespace is json.dumps' only; the lenient form admits all of those."""
from __future__ import annotations

import json

import jsonschema
import pytest

from bie_trt.closed_schema import INT64_BOUND, close_schema
from bie_trt.sampling_params import StructuredOutputs
from test_structured_unit import EOS, compiler, tokenizer  # noqa: F401 (the SmolLM2 tokenizer and its compiler)

CITY = {"type": "object", "properties": {"name": {"type": "string"}, "population": {"type": "integer"}},
        "required": ["name"]}   # pydantic's and LangChain's shape: no additionalProperties


@pytest.fixture(scope="module")
def admits(compiler, tokenizer):
    def _admits(schema: dict, text: str, lenient: bool = False) -> bool:
        """Whether the grammar takes the text's tokens and then the end of the sequence."""
        state = compiler.matcher(StructuredOutputs(json=schema, lenient=lenient))
        tokens = tokenizer(text, add_special_tokens=False)["input_ids"] + [EOS]
        return all(state.accept(t) for t in tokens)
    return _admits


def test_undeclared_keys_are_refused_unless_the_schema_asks(admits):
    extra = '{"name": "Rome", "type": "city"}'
    assert admits(CITY, '{"name": "Rome", "population": 2800000}')
    assert not admits(CITY, extra)
    assert admits(CITY, extra, lenient=True)
    assert admits({**CITY, "additionalProperties": True}, extra)
    assert admits({**CITY, "additionalProperties": {"type": "string"}}, extra)
    assert not admits({**CITY, "additionalProperties": {"type": "integer"}}, extra)
    nested = {"type": "object", "properties": {"city": CITY}}
    assert not admits(nested, '{"city": {"name": "Rome", "weather": "sun"}}')
    assert admits({"type": "array", "items": CITY}, '[{"name": "Rome"}]')
    assert not admits({"type": "array", "items": CITY}, '[{"name": "Rome", "x": 1}]')


def test_integers_stop_at_the_int64_bound(admits):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    assert admits(schema, f'{{"n": {INT64_BOUND}}}') and admits(schema, f'{{"n": -{INT64_BOUND}}}')
    assert not admits(schema, f'{{"n": {2 ** 63}}}')
    assert not admits(schema, '{"n": ' + "1" * 20 + "}")
    assert admits(schema, '{"n": ' + "1" * 20 + "}", lenient=True)
    one_sided = {"type": "integer", "minimum": 0}   # the schema's own bound stays; the other side is int64's
    assert not admits(one_sided, "-1") and admits(one_sided, str(INT64_BOUND)) and not admits(one_sided, "1" * 20)


def test_numbers_have_a_bounded_digit_count(admits):
    schema = {"type": "number"}
    assert admits(schema, "-12.5") and admits(schema, "3.141593") and admits(schema, "7")
    assert not admits(schema, "3.1415926")                       # a 7th decimal
    assert not admits(schema, "1" * 16)                          # beyond 1e15
    assert not admits(schema, "1e400")
    assert admits(schema, "3.14159265358979", lenient=True)


def test_whitespace_is_compact_and_one_way(admits):
    schema = {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer"}}}}
    assert admits(schema, '{"a": [1, 2]}')
    for loose in ('{"a":[1,2]}', '{ "a": [1, 2]}', '{"a": [1, 2]}\n', '{\n  "a": [1, 2]\n}'):
        assert not admits(schema, loose), loose
    assert admits(schema, '{\n  "a": [1, 2]\n}', lenient=True)


def test_close_schema_only_adds_constraints():
    schema = {"type": "object", "properties": {"p": {"type": "number", "minimum": 0}, "q": {"$ref": "#/$defs/q"},
                                               "r": {"allOf": [{"properties": {"x": {}}}, {"properties": {"y": {}}}]}},
              "$defs": {"q": {"type": "object", "properties": {"n": {"type": ["integer", "null"]}}}}}
    before = json.dumps(schema)
    closed = close_schema(schema)
    assert json.dumps(schema) == before   # the request's schema is not changed
    assert closed["additionalProperties"] is False
    assert closed["$defs"]["q"]["additionalProperties"] is False
    assert closed["$defs"]["q"]["properties"]["n"]["minimum"] == -INT64_BOUND
    assert closed["properties"]["p"]["minimum"] == 0 and closed["properties"]["p"]["maximum"] == 1e15
    assert "additionalProperties" not in closed["properties"]["r"]["allOf"][0]   # branches of one object
    instance = {"p": 1.5, "q": {"n": None}, "r": {"x": 1, "y": 2}}
    jsonschema.validate(instance, closed)
    jsonschema.validate(instance, schema)


def test_a_single_allof_member_closes_its_objects():
    """One member is the object itself (pydantic's `allOf: [{"$ref": ...}]` for a described field): nothing
    is left for another branch to declare, so its undeclared keys are refused as anywhere else."""
    schema = {"type": "object", "properties": {"city": {"allOf": [CITY]}}, "required": ["city"]}
    closed = close_schema(schema)
    assert closed["properties"]["city"]["allOf"][0]["additionalProperties"] is False
    jsonschema.validate({"city": {"name": "Rome"}}, closed)
    with pytest.raises(jsonschema.ValidationError, match="Additional properties"):
        jsonschema.validate({"city": {"name": "Rome", "weather": "sun"}}, closed)


@pytest.mark.parametrize("kind, bound", [("number", 1e15), ("integer", INT64_BOUND)])
def test_a_one_sided_bound_keeps_the_other_side_wide(kind, bound):
    """A schema's own bound stays; the open side gets the closed form's, not the given one mirrored."""
    below = close_schema({"type": kind, "maximum": 10})
    assert (below["minimum"], below["maximum"]) == (-bound, 10)
    above = close_schema({"type": kind, "minimum": -10})
    assert (above["minimum"], above["maximum"]) == (-10, bound)
    jsonschema.validate(-12, below)      # values far below the maximum are still admitted
    jsonschema.validate(12, above)
    far = close_schema({"type": kind, "maximum": -2 * bound})   # a bound beyond ours: the range stays non-empty
    assert far["minimum"] <= far["maximum"] == -2 * bound
