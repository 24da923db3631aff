"""A thinking model's reply -> its reasoning and its answer, as vLLM's reasoning parsers return them
(`reasoning_content` beside `content`).

Qwen3 and DeepSeek-R1 write their reasoning in a `<think>...</think>` block before the answer. Where the
block starts depends on the chat template: Qwen3's output opens it itself; DeepSeek-R1's (and templates
whose generation prompt ends in `<think>`) start the output inside it; a prompt that already closed
the block (Qwen3 with `enable_thinking: false`) asks for no reasoning at all. The reasoning is the
block's text without the whitespace around it; the answer is what follows `</think>`, without the
blank lines the models put after it. A block that is never closed (the reply was cut short) is all
reasoning. `ReasoningStream` gives the same split incrementally: the reasoning deltas join to
`split_reasoning`'s reasoning and the content deltas to its content, and a tag cut across deltas is
never sent as text.
"""
from __future__ import annotations

from typing import Callable

from ..families import ModelFamily

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
PARSERS = ("auto", "qwen3", "deepseek_r1", "none")
PROMPT_TAIL_TOKENS = 16   # enough of the prompt's end to hold a generation prompt's "<think>\n\n</think>\n\n"


def resolve_parser(name: str, chat_template: str | None, family: ModelFamily | None = None) -> str:
    """--reasoning-parser -> the parser in use, chosen once per engine for its thinking budgets and its
    replies alike. "auto" is the one the model's family declares (ModelFamily.reasoning_parser: Qwen3.5's is
    qwen3), and where the family leaves it to the template, the one the chat template declares: qwen3's when
    it writes `<think>` (a prompt it ends inside an open block is found per request, below); DeepSeek-R1's
    when it only knows `</think>` (it cuts past turns' reasoning off at it, and its model starts each reply
    inside the block without writing the tag); else none."""
    if name not in PARSERS:
        raise ValueError(f"reasoning parser {name!r} is not one of {', '.join(PARSERS)}")
    if name == "auto" and family is not None:
        name = family.reasoning_parser
    if name == "auto":
        template = chat_template or ""
        if THINK_OPEN in template:
            return "qwen3"
        return "deepseek_r1" if THINK_CLOSE in template else "none"   # "<think>" is no part of "</think>"
    return name


def starts_inside(parser: str, prompt_tail: str) -> bool | None:
    """Where a reply begins, from the end of its prompt's text: True inside a reasoning block (the prompt
    opened it, or the parser is DeepSeek-R1's), False before one the reply may open, None when the reply
    is not split (no parser, or the prompt closed the block: thinking was switched off)."""
    if parser == "none":
        return None
    tail = prompt_tail.rstrip()
    if tail.endswith(THINK_OPEN):
        return True
    if tail.endswith(THINK_CLOSE):
        return None
    return parser == "deepseek_r1"


def reply_start(parser: str, prompt_ids: list[int], decode: Callable[[list[int]], str]) -> bool | None:
    """`starts_inside` read from the end of a prompt's token ids: where the reply to them starts, as both the
    thinking budget and the reply's split take it."""
    return starts_inside(parser, decode(prompt_ids[-PROMPT_TAIL_TOKENS:]))


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (a tag the next delta may finish)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


def _body(text: str, inside: bool) -> str | None:
    """The text after the block's opening (a leading `<think>` dropped even where the prompt opened the
    block, as R1 sometimes repeats it), or None when the reply holds no block."""
    lead = text.lstrip()
    if lead.startswith(THINK_OPEN):
        return lead[len(THINK_OPEN):]
    return text if inside else None


def split_reasoning(text: str, inside: bool = False) -> tuple[str | None, str | None]:
    """A whole reply -> (reasoning, content). Without a block the reply is all content, as written;
    with one, each part is None when empty."""
    body = _body(text, inside)
    if body is None:
        return None, text
    end = body.find(THINK_CLOSE)
    reasoning = (body if end == -1 else body[:end]).strip()
    content = "" if end == -1 else body[end + len(THINK_CLOSE):].lstrip()
    return reasoning or None, content or None


class ReasoningStream:
    """A streamed reply's deltas -> (reasoning delta, content delta) pairs. Held back until they are
    certain: the reply's start while it may still open a block, a partial `</think>` and whitespace at
    the end of the reasoning (dropped if the block closes after it), whitespace just after the block."""

    def __init__(self, inside: bool):
        self.inside = inside
        self.state = "start"      # start -> reasoning -> after -> content, or start -> content
        self.pending = ""         # text received and not yet sent
        self.sent_reasoning = False

    def feed(self, delta: str) -> tuple[str, str]:
        self.pending += delta
        if self.state == "start":
            lead = self.pending.lstrip()
            if lead.startswith(THINK_OPEN):
                self.state, self.pending = "reasoning", lead[len(THINK_OPEN):]
            elif THINK_OPEN.startswith(lead):
                return "", ""
            else:
                self.state = "reasoning" if self.inside else "content"
        if self.state == "reasoning":
            end = self.pending.find(THINK_CLOSE)
            if end == -1:
                cut = len(self.pending) - _partial_tag(self.pending, THINK_CLOSE)
                return self._reasoning(self.pending[:cut], self.pending[cut:]), ""
            after = self.pending[end + len(THINK_CLOSE):]
            reasoning = self._reasoning(self.pending[:end], "")
            self.state, self.pending = "after", after
            return reasoning, self._content()
        return "", self._content()

    def _reasoning(self, piece: str, held: str) -> str:
        """Send `piece` but its trailing whitespace (kept pending with `held`); the first piece also
        loses its leading whitespace."""
        if not self.sent_reasoning:
            piece = piece.lstrip()
        text = piece.rstrip()
        self.pending = piece[len(text):] + held
        self.sent_reasoning = self.sent_reasoning or bool(text)
        return text

    def _content(self) -> str:
        if self.state == "after":
            self.pending = self.pending.lstrip()
            if not self.pending:
                return ""
            self.state = "content"
        out, self.pending = self.pending, ""
        return out

    def finish(self) -> tuple[str, str]:
        """What the held-back tail adds once the reply is complete."""
        if self.state == "start":
            self.state = "reasoning" if self.inside else "content"
            if self.inside:
                return self._reasoning(self.pending, "").strip(), ""
            return "", self._content()
        if self.state == "reasoning":
            rest = self.pending if self.sent_reasoning else self.pending.lstrip()
            self.pending = ""
            return rest.rstrip(), ""
        return "", ""
