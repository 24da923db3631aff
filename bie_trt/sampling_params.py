"""What a request asks of the engine, with its validation: SamplingParams (OpenAI/vLLM-style knobs) and the
StructuredOutputs constraint it may carry."""
from __future__ import annotations

import functools
import json
import math
import re
from dataclasses import dataclass, field

from .errors import RequestError

# Dividing (or multiplying) logits by a penalty further out overflows them to inf, and the softmax to NaN;
# the HTTP API checks the same range.
REPETITION_PENALTY_RANGE = (0.01, 10.0)

STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
LOGIT_BIAS_RANGE = (-100.0, 100.0)


class ConstraintError(RequestError):
    """A StructuredOutputs that is no usable constraint. Checked in one place (SamplingParams, through
    StructuredOutputs.validate), for the SDK and the server alike; the server names the request field the
    constraint came from (response_format, guided_json, tool_choice, ...)."""


@dataclass(frozen=True)
class StructuredOutputs:
    """A constraint on what may be generated, as vLLM's `structured_outputs`: exactly one field set.

    json: a JSON Schema (a dict, or its JSON text); json_object: any JSON object; regex: a regular
    expression the whole output matches; choice: one of these strings; grammar: an EBNF grammar in
    the grammar library's dialect (GBNF-style `root ::= ...`).

    lenient (json and json_object only): the schema as JSON Schema reads it (undeclared keys, unbounded
    numbers) with flexible whitespace, instead of the closed form `closed_schema` makes of it.
    """

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    lenient: bool = False

    @property
    def kind(self) -> str:
        """The one field that is set; a RequestError naming the fields when not exactly one is (a bare
        next() would raise StopIteration, which an async route turns into a 500)."""
        set_ = self.kinds()
        if len(set_) != 1:
            raise ConstraintError(f"structured_outputs must set exactly one of {list(STRUCTURED_KINDS)}; "
                                   f"got {set_ or 'none'}.")
        return set_[0]

    def kinds(self) -> list[str]:
        """The fields that are set (any number: `kind` is the checked one)."""
        return [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]

    def key(self) -> str:
        """A canonical text of the constraint: equal constraints, equal keys (the compiled-grammar cache's)."""
        value = getattr(self, self.kind)
        if self.kind == "json" and isinstance(value, str):
            value = json.loads(value)
        form = ":lenient" if self.lenient else ""
        return self.kind + form + ":" + json.dumps(value, sort_keys=True, separators=(",", ":"))

    def schema(self) -> dict | None:
        """The JSON Schema as a dict (json only)."""
        if self.json is None:
            return None
        return json.loads(self.json) if isinstance(self.json, str) else self.json

    def validate(self) -> None:
        """Cheap checks that need no tokenizer; the grammar compiler checks the rest (unsupported keywords)."""
        self.kind   # exactly one set
        if self.json_object is not True and self.json_object is not False:
            raise ConstraintError(f"structured_outputs.json_object must be true or false; got {self.json_object!r}.")
        if not isinstance(self.lenient, bool):
            raise ConstraintError(f"structured_outputs.lenient must be true or false; got {self.lenient!r}.")
        if self.json is not None:
            check_json_schema(self.json)
        if self.regex is not None:
            if not isinstance(self.regex, str) or not self.regex:
                raise ConstraintError(f"structured_outputs.regex must be a non-empty string; got {self.regex!r}.")
            try:
                re.compile(self.regex)
            except re.error as e:
                raise ConstraintError(f"structured_outputs.regex does not compile ({e}); send a valid regular "
                                       f"expression.") from None
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise ConstraintError(f"structured_outputs.choice must be a non-empty list of non-empty strings; "
                                       f"got {self.choice!r}.")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise ConstraintError(f"structured_outputs.grammar must be a non-empty grammar text; got {self.grammar!r}.")

    @classmethod
    def from_response_format(cls, response_format: dict) -> "StructuredOutputs | None":
        """OpenAI's `response_format` -> the constraint it asks for (None for "text")."""
        if not isinstance(response_format, dict):
            raise RequestError(f"response_format must be an object with a 'type'; got {response_format!r}.")
        kind = response_format.get("type")
        if kind not in RESPONSE_FORMAT_TYPES:
            raise RequestError(f"response_format.type {kind!r} is unknown; choose one of "
                               f"{list(RESPONSE_FORMAT_TYPES)}.")
        if kind == "text":
            return None
        if kind == "json_object":
            return cls(json_object=True)
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise RequestError("response_format of type 'json_schema' needs json_schema: {\"name\": ..., "
                               "\"schema\": {...}}.")
        return cls(json=spec["schema"])


def check_json_schema(schema: object) -> dict:
    """A JSON Schema (dict or JSON text) -> the dict; RequestError naming the problem if it is not one."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ConstraintError(f"the JSON schema is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); "
                                   f"send a JSON object.") from None
    if not isinstance(schema, (dict, bool)):
        raise ConstraintError(f"the JSON schema must be an object; got {type(schema).__name__}.")
    try:
        text = json.dumps(schema, sort_keys=True)
    except (TypeError, ValueError) as e:
        raise ConstraintError(f"the JSON schema cannot be written as JSON ({e}); send plain JSON values.") from None
    _check_schema_text(text)
    return schema


@functools.lru_cache(maxsize=256)
def _check_schema_text(text: str) -> None:
    """Against the JSON Schema meta-schema (milliseconds each): a request's SamplingParams are checked as
    they are made and again as they are submitted, and the same schemas come back request after request."""
    import jsonschema

    schema = json.loads(text)
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/" + "/".join(str(p) for p in e.absolute_path)
        raise ConstraintError(f"the JSON schema is not valid JSON Schema (at {where}: {e.message}); "
                               f"fix the schema.") from None


@dataclass
class SamplingParams:
    """OpenAI/vLLM-style sampling knobs. temperature 0 means greedy."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                  # 0 or -1: off
    min_p: float = 0.0
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None     # return the top-N log-probabilities of each sampled token (0..20)
    # a constraint on the output (vLLM's structured_outputs); OpenAI's response_format is turned into one as
    # the params are made (and reads None after)
    structured_outputs: StructuredOutputs | None = None
    response_format: dict | None = None
    logit_bias: dict[int, float] | None = None   # token id -> bias in [-100, 100], added to the logits
    min_tokens: int = 0             # EOS and stop_token_ids masked, stop strings not searched, until this many tokens
    # reasoning tokens a thinking model may write before the engine closes its <think> block itself
    # (thinking_budget.py); None: unbounded. A reply without a block (or a prompt that closed it) ignores it.
    thinking_budget: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = StructuredOutputs(**self.structured_outputs)
            except TypeError:
                raise RequestError(f"structured_outputs has unknown keys; known: {list(STRUCTURED_KINDS)}.") from None
        if isinstance(self.logit_bias, dict):   # JSON object keys arrive as strings
            try:
                self.logit_bias = {int(k): v for k, v in self.logit_bias.items()}
            except (TypeError, ValueError):
                raise RequestError(f"logit_bias keys must be token ids (integers); got "
                                   f"{sorted(map(str, self.logit_bias))[:5]}.") from None
        if self.response_format is not None:
            # OpenAI's spelling of a constraint, read once into the one field the engine reads, so that the
            # params hold one meaning and validate() is a pure check however often it runs
            converted = StructuredOutputs.from_response_format(self.response_format)
            if self.structured_outputs is not None:
                raise RequestError("both response_format and structured_outputs are set; send one of them.")
            self.structured_outputs, self.response_format = converted, None
        self.validate()

    def validate(self) -> None:
        def bad(msg: str) -> RequestError:
            return RequestError(msg)

        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)) or self.temperature < 0:
            raise bad(f"temperature must be a finite number >= 0 (0 is greedy); got {self.temperature!r}.")
        if not 0 < self.top_p <= 1:
            raise bad(f"top_p must be in (0, 1]; got {self.top_p!r}.")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad(f"top_k must be an integer >= 0 (0 or -1 disables it); got {self.top_k!r}.")
        if not 0 <= self.min_p <= 1:
            raise bad(f"min_p must be in [0, 1]; got {self.min_p!r}.")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad(f"max_tokens must be an integer >= 1; got {self.max_tokens!r}.")
        low, high = REPETITION_PENALTY_RANGE
        if not low <= self.repetition_penalty <= high:   # NaN fails the comparison too
            raise bad(f"repetition_penalty must be in [{low:g}, {high:g}] (1 is off); got {self.repetition_penalty!r}.")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise bad(f"{name} must be in [-2, 2]; got {getattr(self, name)!r}.")
        # torch.Generator.manual_seed's range: beyond it the request would fail inside the engine
        if self.seed is not None and (not isinstance(self.seed, int) or not -2**63 <= self.seed < 2**64):
            raise bad(f"seed must be an integer in [-2**63, 2**64); got {self.seed!r}.")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            raise bad(f"logprobs must be an integer in [0, 20]; got {self.logprobs!r}.")
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or self.min_tokens < 0:
            raise bad(f"min_tokens must be an integer >= 0; got {self.min_tokens!r}.")
        if self.min_tokens > self.max_tokens:
            raise bad(f"min_tokens {self.min_tokens} is above max_tokens {self.max_tokens}; make min_tokens <= "
                      f"max_tokens.")
        if self.thinking_budget is not None and (not isinstance(self.thinking_budget, int)
                                                 or isinstance(self.thinking_budget, bool) or self.thinking_budget < 0):
            raise bad(f"thinking_budget must be an integer >= 0 (0 closes the block at once); got "
                      f"{self.thinking_budget!r}.")
        self._validate_logit_bias()
        self._validate_structured()
        if self.thinking_budget is not None and self.structured_outputs is not None:
            raise bad("thinking_budget with structured_outputs: a constrained reply is shaped whole by its grammar "
                      "and has no reasoning block to bound; send one of them.")

    def _validate_logit_bias(self) -> None:
        if self.logit_bias is None:
            return
        if not isinstance(self.logit_bias, dict):
            raise RequestError(f"logit_bias must map token ids to numbers; got {type(self.logit_bias).__name__}.")
        low, high = LOGIT_BIAS_RANGE
        for token, bias in self.logit_bias.items():
            if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                raise RequestError(f"logit_bias key {token!r} is not a token id (an integer >= 0).")
            if (not isinstance(bias, (int, float)) or isinstance(bias, bool) or not math.isfinite(bias)
                    or not low <= bias <= high):
                raise RequestError(f"logit_bias[{token}] must be a number in [{low:g}, {high:g}]; got {bias!r}.")

    def _validate_structured(self) -> None:
        if self.response_format is not None:   # set on an instance after it was made: never read into a constraint
            raise RequestError("response_format is read as SamplingParams are made; on an instance already made, "
                               "set structured_outputs (StructuredOutputs.from_response_format converts one).")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputs):
                raise RequestError(f"structured_outputs must be a StructuredOutputs (or a dict of its fields); got "
                                   f"{type(self.structured_outputs).__name__}.")
            self.structured_outputs.validate()
