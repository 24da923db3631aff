"""A thinking budget, enforced by the engine: once a reply's reasoning has used its budget of tokens, the
engine writes the model's own end of thinking itself (`THINK_END`, tokenised by the engine's tokenizer,
one forced token a step) and the model answers after it, as it would after closing the block itself.

The reasoning is the `<think>` block the reasoning parser splits off (reasoning.py): it starts where the
prompt opened the block (a template that ends its generation prompt in `<think>`), or where the reply
opens it with a leading `<think>` (Qwen3's). A prompt that closed the block (thinking switched off), or
a reply that starts without one, has no reasoning to bound: the budget is not used. The budget counts
the tokens after the opening, up to the model's own `</think>`; a reply whose reasoning reaches it has
exactly that many reasoning tokens, then the end text. Budget 0 closes the block at once.

The state moves with each emitted token and can be rolled back, so speculative verification (which walks
the proposals and rolls back) sees at every position what plain decoding would see there.
"""
from __future__ import annotations

from typing import Callable

from .reasoning import THINK_CLOSE, THINK_OPEN, reply_start

# What the engine writes when the budget is spent: Qwen3's own close, the newline before the tag and the
# blank line after it as its replies and its template's empty block (`<think>\n\n</think>\n\n`) have them.
THINK_END = f"\n{THINK_CLOSE}\n\n"
BEFORE, THINKING, AFTER = "before", "thinking", "after"   # the reply's place relative to its block


class ThinkingBudget:
    def __init__(self, budget: int, inside: bool, end_ids: list[int], decode: Callable[[list[int]], str]):
        self.budget, self.end_ids, self.decode = budget, end_ids, decode
        self.phase = THINKING if inside else BEFORE
        self.used = 0          # reasoning tokens the model wrote
        self.forced = 0        # tokens of the end text written so far (once used == budget)
        self.tokens: list[int] = []
        self._history: list[tuple[str, int, int]] = []   # the state before each token, for rollback

    @classmethod
    def build(cls, budget: int, prompt_ids: list[int], tokenizer, parser: str) -> "ThinkingBudget | None":
        """The budget of a reply to `prompt_ids`, its block found by the reasoning `parser` that splits the
        reply (the engine's); None when there is no reasoning to bound (the prompt closed the block, or no
        parser)."""
        inside = reply_start(parser, prompt_ids, tokenizer.decode)
        if inside is None:
            return None
        end_ids = list(tokenizer(THINK_END, add_special_tokens=False)["input_ids"])
        return cls(budget, inside, end_ids, tokenizer.decode)

    def forced_token(self) -> int | None:
        """The token the next position must be: the end text's next one once the budget is spent."""
        if self.phase == THINKING and self.used >= self.budget:
            return self.end_ids[self.forced]
        return None

    def accept(self, token: int) -> None:
        """Advance with an emitted token."""
        self._history.append((self.phase, self.used, self.forced))
        self.tokens.append(token)
        if self.phase == BEFORE:
            lead = self.decode(self.tokens).lstrip()
            if lead.startswith(THINK_OPEN):
                self.phase = THINKING
            elif not THINK_OPEN.startswith(lead):   # the reply answers without a block
                self.phase = AFTER
        elif self.phase == THINKING:
            if self.used >= self.budget:
                self.forced += 1
                if self.forced == len(self.end_ids):
                    self.phase = AFTER
                return
            self.used += 1
            # every token is at least one character: the tag, once written, ends within its length in tokens
            if THINK_CLOSE in self.decode(self.tokens[-len(THINK_CLOSE):]):
                self.phase = AFTER   # the model closed the block itself, within its budget

    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens accepted tokens."""
        for _ in range(num_tokens):
            self.phase, self.used, self.forced = self._history.pop()
            self.tokens.pop()
