"""A chat reply's text -> what the APIs return of it, decoded once for every caller (the server's chat,
Messages and Responses routes, and `BieEngine.chat`): a thinking model's reasoning split off, the prose,
the tool calls in the model family's format, and OpenAI's finish reason. Whole (`reply`) or streamed
(`feed`): a stream's deltas join to the whole reply's parts."""
from __future__ import annotations

from dataclasses import dataclass

from .reasoning import ReasoningStream, split_reasoning
from .tool_calls import ReplyParser, ToolCall


@dataclass(frozen=True)
class Reply:
    reasoning: str | None      # None: the model wrote none, or the reply is not split
    content: str | None
    tool_calls: list[ToolCall]
    finish_reason: str | None  # "tool_calls" for a reply that ended by itself with calls


class ReplyProcessor:
    """One reply's reader. `inside`: where the reply starts for the engine's reasoning parser (inside a block,
    before one, or None: not split, as for a reply an output constraint shapes whole)."""

    def __init__(self, parser: ReplyParser, inside: bool | None):
        self.parser, self.inside = parser, inside
        self.splitter = None if inside is None else ReasoningStream(inside)

    def reply(self, text: str, finish_reason: str | None) -> Reply:
        reasoning, rest = (None, text) if self.inside is None else split_reasoning(text, self.inside)
        content, calls = (None, []) if rest is None else self.parser.message(rest)
        return Reply(reasoning, content, calls, self.finish_reason(finish_reason, bool(calls)))

    def feed(self, delta: str, final: bool) -> list[dict]:
        """The reply's next text -> its deltas in OpenAI's chat shapes ({"reasoning_content": ...},
        {"content": ...}, {"tool_calls": [...]}), what was held back added when `final`."""
        reasoning, content = ("", delta) if self.splitter is None else self.splitter.feed(delta)
        if final and self.splitter is not None:
            reasoning, content = (a + b for a, b in zip((reasoning, content), self.splitter.finish()))
        deltas = ([{"reasoning_content": reasoning}] if reasoning else []) + self.parser.feed(content)
        return deltas + (self.parser.finish() if final else [])

    def finish_reason(self, reason: str | None, called: bool | None = None) -> str | None:
        """OpenAI's finish reason of the reply; `called`: whether it made calls (default: the stream so far)."""
        return ReplyParser.finish_reason(reason, self.parser.calls > 0 if called is None else called)
