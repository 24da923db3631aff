"""Structured outputs: grammars compiled by xgrammar, and the per-request constraint on the logits.

A request's `StructuredOutputs` is compiled once per distinct spec (cached by its canonical text) in
the caller's thread, so a bad grammar fails the request before it reaches the engine loop and a slow
compile never holds up other requests' steps. Each sequence then carries a `LogitsConstraint`:
logit_bias, min_tokens and the grammar matcher, applied to the logits in `apply` -- the one place the
host sampler, the device sampler and speculative verification all go through.
"""
from __future__ import annotations

import collections
import json
import threading
from typing import Iterable

import torch

from .config import SamplingParams, StructuredOutputs, check_json_schema
from .errors import RequestError

# Keywords xgrammar accepts without enforcing them: a grammar would let through outputs that break the
# schema, so such a schema is refused rather than silently weakened.
UNENFORCED_KEYWORDS = ("not", "if", "then", "else", "allOf")
# A run of whitespace between JSON tokens is at most this long: room for indented output, but a small
# model cannot spend its whole budget on blank lines.
MAX_WHITESPACE = 16


def unenforced_keywords(schema: object) -> list[str]:
    """The keywords of UNENFORCED_KEYWORDS used anywhere in a schema (inside `properties` names are data)."""
    found: set[str] = set()

    def walk(node: object, names_only: bool = False) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if not names_only and key in UNENFORCED_KEYWORDS and not (key == "allOf" and len(value) <= 1):
                    found.add(key)
                walk(value, names_only=not names_only and key in ("properties", "$defs", "definitions",
                                                                   "patternProperties", "dependentSchemas"))
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(schema)
    return sorted(found)


def json_schema_outputs(schema: dict | str) -> StructuredOutputs:
    """The constraint for "output this JSON Schema" (a tool's parameters, a response format)."""
    return StructuredOutputs(json=schema)


def _ebnf_literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


class GrammarCompiler:
    """Compiles StructuredOutputs for one tokenizer; thread-safe, with an LRU cache of compiled grammars."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Iterable[int], cache_size: int = 64):
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=self.stop_token_ids)
        self._compiler = xgr.GrammarCompiler(self.info, cache_enabled=False)
        self._cache: collections.OrderedDict[str, object] = collections.OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutputs):
        """-> an xgrammar CompiledGrammar; RequestError naming the problem when the spec cannot be compiled."""
        spec.validate()
        key = spec.key()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        compiled = self._compile(spec)   # outside the lock: two threads may compile one spec, never block others
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: StructuredOutputs):
        what = {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regex",
                "choice": "choice", "grammar": "grammar"}[spec.kind]
        try:
            if spec.kind == "json":
                schema = check_json_schema(spec.json)
                if bad := unenforced_keywords(schema):
                    raise RequestError(f"the JSON schema uses {bad}, which structured outputs cannot enforce; "
                                       f"rewrite it without them (anyOf, enum, const and required are supported).")
                return self._compiler.compile_json_schema(json.dumps(schema), any_whitespace=True,
                                                          max_whitespace_cnt=MAX_WHITESPACE)
            if spec.kind == "json_object":
                return self._compiler.compile_json_schema('{"type": "object"}', any_whitespace=True,
                                                          max_whitespace_cnt=MAX_WHITESPACE)
            if spec.kind == "regex":
                return self._compiler.compile_regex(spec.regex)
            if spec.kind == "choice":
                return self._compiler.compile_grammar("root ::= " + " | ".join(map(_ebnf_literal, spec.choice)))
            return self._compiler.compile_grammar(spec.grammar)
        except RequestError:
            raise
        except Exception as e:   # xgrammar reports bad input as RuntimeError/ValueError with a C++ location
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            reason = reason.split(": ", 1)[1] if reason.startswith("[") and ": " in reason else reason
            raise RequestError(f"the {what} cannot be compiled: {reason}") from None

    def matcher(self, spec: StructuredOutputs) -> "GrammarState":
        return GrammarState(self._xgr.GrammarMatcher(self.compile(spec)), self.vocab_size)


class GrammarState:
    """One sequence's position in its grammar, with the bitmask of the tokens allowed next."""

    def __init__(self, matcher, vocab_size: int):
        self.matcher = matcher
        self.bitmask = torch.zeros(1, (vocab_size + 31) // 32, dtype=torch.int32)

    def allowed(self) -> torch.Tensor | None:
        """The bitmask [ceil(V/32)] int32 of the tokens allowed next, or None after the grammar ended."""
        if self.matcher.is_terminated():
            return None
        self.matcher.fill_next_token_bitmask(self.bitmask)
        return self.bitmask[0]

    def accept(self, token: int) -> bool:
        return bool(self.matcher.accept_token(token))

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.matcher.rollback(num_tokens)

    @property
    def terminated(self) -> bool:
        return bool(self.matcher.is_terminated())


_SHIFTS: dict[torch.device, torch.Tensor] = {}


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [V] in place: -inf where bit (i % 32) of bitmask[i // 32] is 0. Runs on the logits' device."""
    shifts = _SHIFTS.get(logits.device)
    if shifts is None:
        shifts = _SHIFTS[logits.device] = torch.arange(32, dtype=torch.int32, device=logits.device)
    bits = (bitmask.to(logits.device, non_blocking=True)[:, None] >> shifts) & 1
    allowed = bits.view(-1)[:logits.shape[-1]].bool()
    return logits.masked_fill_(~allowed, float("-inf"))


class LogitsConstraint:
    """What a request's parameters forbid or favour on top of the model: logit_bias, min_tokens and a grammar.

    `apply(logits, num_output)` edits a row in place for the state after `num_output` generated tokens
    (the grammar's current state); `accept(token)` advances the grammar with an emitted token.
    """

    def __init__(self, params: SamplingParams, eos_ids: Iterable[int], grammar: GrammarState | None):
        self.grammar = grammar
        bias = params.logit_bias or {}
        self.bias_ids = torch.tensor(list(bias), dtype=torch.long)
        self.bias_values = torch.tensor(list(bias.values()), dtype=torch.float32)
        self.min_tokens = params.min_tokens
        self.banned_until_min = torch.tensor(sorted(set(eos_ids) | set(params.stop_token_ids)), dtype=torch.long)

    @classmethod
    def build(cls, params: SamplingParams, eos_ids: Iterable[int],
              compiler: GrammarCompiler | None) -> "LogitsConstraint | None":
        """None when the request constrains nothing (the common case costs nothing per step)."""
        grammar = None
        if params.structured_outputs is not None:
            if compiler is None:
                raise RequestError("structured outputs need the xgrammar package; pip install xgrammar.")
            grammar = compiler.matcher(params.structured_outputs)
        if grammar is None and not params.logit_bias and params.min_tokens == 0:
            return None
        return cls(params, eos_ids, grammar)

    def apply(self, logits: torch.Tensor, num_output: int) -> torch.Tensor:
        if len(self.bias_ids):
            logits[self.bias_ids.to(logits.device)] += self.bias_values.to(logits.device)
        mask = self.grammar.allowed() if self.grammar is not None else None
        if mask is not None:
            apply_bitmask(logits, mask)
        if num_output < self.min_tokens and len(self.banned_until_min):
            banned = self.banned_until_min.to(logits.device)
            kept = logits[banned].clone()
            logits[banned] = float("-inf")
            # the grammar may allow nothing but EOS (it is complete): the grammar wins over min_tokens
            if mask is not None and not bool(torch.isfinite(logits).any()):
                logits[banned] = kept
        return logits

    def accept(self, token: int) -> None:
        """Advance the grammar with an emitted token (sampled from a row `apply` masked)."""
        if not self.try_accept(token):
            raise RuntimeError(f"the grammar rejected token {token}, which its mask allowed (a grammar bug)")

    def try_accept(self, token: int) -> bool:
        """Advance the grammar with a proposed token if it allows it; False (and no change) if not."""
        return self.grammar is None or self.grammar.accept(token)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens accepted tokens."""
        if self.grammar is not None:
            self.grammar.rollback(num_tokens)

    @property
    def finished(self) -> bool:
        """The grammar accepted a stop token: nothing more may follow."""
        return self.grammar is not None and self.grammar.terminated
