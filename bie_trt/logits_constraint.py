"""Structured outputs: grammars by llguidance, and the per-request constraint on the logits.

A request's `StructuredOutputs` is compiled once per distinct spec (cached by its canonical text) in
the caller's thread, so a bad grammar fails the request before it reaches the engine loop and a slow
compile never holds up other requests' steps. Each sequence then carries a `LogitsConstraint`:
logit_bias, min_tokens and its own copy of the compiled grammar's matcher, applied to the logits in
`apply` -- the one place the host sampler, the device sampler and speculative verification go through.
"""
from __future__ import annotations

import collections
import json
import threading
from dataclasses import dataclass
from typing import Iterable

import torch

from .chat.thinking_budget import ThinkingBudget
from .closed_schema import close_schema
from .errors import RequestError
from .sampling_params import SamplingParams, StructuredOutputs

# The closed form's whitespace is json.dumps' (`{"a": 1, "b": [1, 2]}`): one way to write each value, so
# no token goes to layout. The lenient form's, between JSON tokens: nothing, one space, or one line break
# and up to 20 spaces or tabs of indentation (llama.cpp's JSON grammars allow the same).
CLOSED_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
LENIENT_JSON_OPTIONS = {"whitespace_pattern": r"[ ]|\n[ \t]{0,20}"}
ANY_OBJECT = {"type": "object"}


class GrammarError(RuntimeError):
    """A request's grammar failed while it generated (the library's error state or limits): that request
    ends with the error; the others in its batch go on."""


def grammar_text(spec: StructuredOutputs) -> str:
    """The llguidance grammar for a spec SamplingParams has checked (StructuredOutputs.validate, not repeated
    here); RequestError for a spec the library cannot express."""
    from llguidance import LLMatcher, gbnf_to_lark

    try:
        if spec.kind in ("json", "json_object"):
            schema = spec.schema() if spec.kind == "json" else ANY_OBJECT
            if spec.lenient:
                return LLMatcher.grammar_from_json_schema(schema, defaults=LENIENT_JSON_OPTIONS)
            return LLMatcher.grammar_from_json_schema(close_schema(schema), defaults=CLOSED_JSON_OPTIONS)
        if spec.kind == "regex":
            return LLMatcher.grammar_from_regex(spec.regex)
        if spec.kind == "choice":
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
        return LLMatcher.grammar_from_lark(gbnf_to_lark.any_to_lark(spec.grammar))
    except RequestError:
        raise
    except Exception as e:   # llguidance reports unsupported schemas and bad grammar text as ValueError
        raise RequestError(f"the {_WHAT[spec.kind]} cannot be compiled: {_first_line(e)}") from None


_WHAT = {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regex", "choice": "choice",
         "grammar": "grammar"}


def _first_line(error: object) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


class GrammarCompiler:
    """Compiles StructuredOutputs for one tokenizer; thread-safe, with an LRU cache of compiled grammars."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Iterable[int], cache_size: int = 64):
        import llguidance.hf

        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=self.stop_token_ids)
        self._cache: collections.OrderedDict[str, object] = collections.OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutputs):
        """-> a pristine llguidance LLMatcher for the spec (copy it per request); RequestError naming the
        problem when the spec cannot be compiled."""
        from llguidance import LLMatcher

        key = spec.key()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        # outside the lock (llguidance drops the GIL while it builds): others' compiles are not held up
        matcher = LLMatcher(self.tokenizer, grammar_text(spec), log_level=0)
        if matcher.is_error():
            raise RequestError(f"the {_WHAT[spec.kind]} cannot be compiled: {_first_line(matcher.get_error())}")
        # The first mask builds the lexer's states (milliseconds); copies share them. Build them here, not
        # in the engine loop's first step of the request.
        try:
            GrammarState(matcher, self.vocab_size, ()).allowed()
        except GrammarError as e:
            raise RequestError(f"the {_WHAT[spec.kind]} cannot be compiled: {e}") from None
        with self._lock:
            self._cache[key] = matcher
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return matcher

    def matcher(self, spec: StructuredOutputs) -> "GrammarState":
        return GrammarState(self.compile(spec).deep_copy(), self.vocab_size, self.stop_token_ids)

    def accepts(self, spec: StructuredOutputs, text: str) -> bool:
        """Whether `text` is a whole sentence of the spec's grammar (read by the same compiled grammar that
        constrains generation; llguidance matches bytes, so any tokenization of the text will do)."""
        matcher = self.compile(spec).deep_copy()
        tokens = self.tokenizer.tokenize_str(text)
        return matcher.try_consume_tokens(tokens) == len(tokens) and matcher.is_accepting()


class GrammarState:
    """One sequence's position in its grammar, with the bitmask of the tokens allowed next."""

    def __init__(self, matcher, vocab_size: int, stop_token_ids: Iterable[int]):
        self.matcher = matcher
        self.bitmask = torch.zeros(1, (vocab_size + 31) // 32, dtype=torch.int32)
        self.stop_token_ids = frozenset(stop_token_ids)
        self.num_accepted = 0
        self.stopped_at: int | None = None   # num_accepted once a stop token was taken: the grammar is over

    def allowed(self) -> torch.Tensor | None:
        """The bitmask [ceil(V/32)] int32 of the tokens allowed next, or None after the grammar ended."""
        if self.terminated:
            return None
        # what llguidance.torch.fill_next_token_bitmask does, without importing that module (it sets up
        # torch.compile at import, seconds of start-up)
        row = self.bitmask[0]
        self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
        if self.matcher.is_error() or not bool(row.any()):
            raise GrammarError(f"the grammar allows no next token: {self.matcher.get_error() or 'empty mask'}")
        return row

    def accept(self, token: int) -> bool:
        """Advance with token if the grammar allows it; False (and no change) if not."""
        if self.terminated:
            return False
        # a stop token ends a complete grammar; it is kept here, not in the matcher (whose history has no stops)
        if token in self.stop_token_ids:
            if not self.matcher.is_accepting():
                return False
        elif self.matcher.try_consume_tokens([token]) != 1:
            return False
        self.num_accepted += 1
        if token in self.stop_token_ids:
            self.stopped_at = self.num_accepted
        return True

    def rollback(self, num_tokens: int) -> None:
        in_matcher = num_tokens
        if self.stopped_at is not None and self.stopped_at > self.num_accepted - num_tokens:
            self.stopped_at, in_matcher = None, num_tokens - 1
        if in_matcher and not self.matcher.rollback(in_matcher):
            raise GrammarError(f"llguidance could not roll back {in_matcher} tokens: {self.matcher.get_error()}")
        self.num_accepted -= num_tokens

    @property
    def terminated(self) -> bool:
        """A stop token was accepted (the grammar was complete)."""
        return self.stopped_at is not None


_SHIFTS: dict[torch.device, torch.Tensor] = {}


def allowed_tokens(bitmasks: torch.Tensor, vocab: int, device: torch.device) -> torch.Tensor:
    """bitmasks [B, ceil(V/32)] int32 -> [B, V] bool on `device`: bit (i % 32) of word i // 32 of each row."""
    shifts = _SHIFTS.get(device)
    if shifts is None:
        shifts = _SHIFTS[device] = torch.arange(32, dtype=torch.int32, device=device)
    bits = (bitmasks.to(device, non_blocking=True)[..., None] >> shifts) & 1
    return bits.view(bits.shape[0], -1)[:, :vocab].bool()


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [V] in place: -inf where bit (i % 32) of bitmask[i // 32] is 0. Runs on the logits' device."""
    allowed = allowed_tokens(bitmask[None], logits.shape[-1], logits.device)[0]
    return logits.masked_fill_(~allowed, float("-inf"))


@dataclass
class RowConstraint:
    """What a request's constraint does to its next row of logits, read at one state (see apply_constraints)."""

    bias_ids: torch.Tensor            # logit_bias: ids and the values added to them
    bias_values: torch.Tensor
    bitmask: torch.Tensor | None      # the grammar's allowed tokens; None without a live grammar
    banned: torch.Tensor | None       # stop tokens min_tokens still forbids
    forced: int | None                # the one token a spent thinking budget allows


def _flat(rows: list[tuple[int, torch.Tensor]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """[(row, ids)] -> (the row of each id, the ids), flat on `device`."""
    at = torch.cat([torch.full((len(ids),), row, dtype=torch.long) for row, ids in rows])
    return at.to(device, non_blocking=True), torch.cat([ids for _, ids in rows]).to(device, non_blocking=True)


def apply_constraints(logits: torch.Tensor, rows: list[RowConstraint | None]) -> torch.Tensor:
    """logits [B, V] in place, each row under its request's constraint (None: none), a few launches for the
    batch and no read back: logit_bias added, the grammar's mask, min_tokens' ban on stop tokens (unless
    the grammar then allows nothing: it is complete, and the grammar wins), a spent thinking budget's
    forced token."""
    device = logits.device
    if bias := [(i, r.bias_ids) for i, r in enumerate(rows) if r is not None and len(r.bias_ids)]:
        values = torch.cat([rows[i].bias_values for i, _ in bias]).to(device, logits.dtype, non_blocking=True)
        logits.index_put_(_flat(bias, device), values, accumulate=True)
    grammar = [i for i, r in enumerate(rows) if r is not None and r.bitmask is not None]
    if grammar:
        words = torch.full((len(rows), rows[grammar[0]].bitmask.shape[-1]), -1, dtype=torch.int32)
        words[grammar] = torch.stack([rows[i].bitmask for i in grammar])
        logits.masked_fill_(~allowed_tokens(words, logits.shape[-1], device), float("-inf"))
    if bans := [(i, r.banned) for i, r in enumerate(rows) if r is not None and r.banned is not None]:
        at = _flat(bans, device)
        if not any(rows[i].bitmask is not None for i, _ in bans):   # no grammar to outrank the ban
            logits[at] = float("-inf")
        else:
            ban = torch.zeros(logits.shape, dtype=torch.bool, device=device)
            ban[at] = True
            banned = logits.masked_fill(ban, float("-inf"))
            has_grammar = torch.zeros(len(rows), dtype=torch.bool)
            has_grammar[grammar] = True
            keep = has_grammar.to(device, non_blocking=True) & ~torch.isfinite(banned).any(-1)
            logits.copy_(torch.where(keep[:, None], logits, banned))
    if forced := [(i, r.forced) for i, r in enumerate(rows) if r is not None and r.forced is not None]:
        at = torch.tensor([i for i, _ in forced]).to(device, non_blocking=True)
        logits[at] = float("-inf")   # the budget is spent: the end of thinking, whatever the model prefers
        logits[at, torch.tensor([t for _, t in forced]).to(device, non_blocking=True)] = 0.0
    return logits


class LogitsConstraint:
    """What a request's parameters forbid or favour on top of the model: logit_bias, min_tokens, a grammar
    and a thinking budget (which forces the end of thinking once the reasoning has spent it).

    `apply(logits, num_output)` edits a row in place for the state after `num_output` generated tokens
    (the grammar's and the budget's current state); `accept(token)` advances them with an emitted token.
    """

    def __init__(self, params: SamplingParams, eos_ids: Iterable[int], grammar: GrammarState | None,
                 budget: ThinkingBudget | None = None):
        self.grammar, self.budget = grammar, budget
        bias = params.logit_bias or {}
        self.bias_ids = torch.tensor(list(bias), dtype=torch.long)
        self.bias_values = torch.tensor(list(bias.values()), dtype=torch.float32)
        self.min_tokens = params.min_tokens
        self.banned_until_min = torch.tensor(sorted(set(eos_ids) | set(params.stop_token_ids)), dtype=torch.long)

    @classmethod
    def build(cls, params: SamplingParams, eos_ids: Iterable[int], compiler: GrammarCompiler | None,
              budget: ThinkingBudget | None = None) -> "LogitsConstraint | None":
        """None when the request constrains nothing (the common case costs nothing per step)."""
        grammar = None
        if params.structured_outputs is not None:
            if compiler is None:
                raise RequestError("structured outputs need the llguidance package; pip install llguidance.")
            grammar = compiler.matcher(params.structured_outputs)
        if grammar is None and budget is None and not params.logit_bias and params.min_tokens == 0:
            return None
        return cls(params, eos_ids, grammar, budget)

    def row(self, num_output: int) -> RowConstraint:
        """What `apply` does to the next row after `num_output` generated tokens; GrammarError when the
        grammar allows nothing."""
        banned = self.banned_until_min if num_output < self.min_tokens and len(self.banned_until_min) else None
        return RowConstraint(self.bias_ids, self.bias_values,
                             self.grammar.allowed() if self.grammar is not None else None, banned,
                             self.budget.forced_token() if self.budget is not None else None)

    def apply(self, logits: torch.Tensor, num_output: int) -> torch.Tensor:
        """One row [V] in place, for the state after `num_output` generated tokens."""
        apply_constraints(logits[None], [self.row(num_output)])
        return logits

    def accept(self, token: int) -> None:
        """Advance the grammar with an emitted token (sampled from a row `apply` masked)."""
        if not self.try_accept(token):
            raise GrammarError(f"the grammar rejected token {token}, which its mask allowed")

    def try_accept(self, token: int) -> bool:
        """Advance the grammar and the budget with a proposed token if they allow it; False (and no change)
        if not."""
        if self.budget is not None and self.budget.forced_token() not in (None, token):
            return False
        if self.grammar is not None and not self.grammar.accept(token):
            return False
        if self.budget is not None:
            self.budget.accept(token)
        return True

    def allowed_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens`, in order, the grammar takes from its current state (which it keeps)."""
        taken = 0
        try:
            while taken < len(tokens) and self.try_accept(tokens[taken]):
                taken += 1
        finally:
            self.rollback(taken)
        return taken

    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens accepted tokens."""
        if self.grammar is not None:
            self.grammar.rollback(num_tokens)
        if self.budget is not None:
            self.budget.rollback(num_tokens)

    @property
    def finished(self) -> bool:
        """The grammar accepted a stop token: nothing more may follow."""
        return self.grammar is not None and self.grammar.terminated
