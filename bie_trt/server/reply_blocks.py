"""A reply as the ordered blocks the Anthropic Messages and OpenAI Responses APIs both speak of: a
thinking model's reasoning, text, and tool calls (a call's id, name and arguments), as the reply's
ReplyProcessor reads them: a whole reply (`reply_blocks`), or a streamed one from its deltas (`BlockStream`), opened, grown and closed in order, and it closes into the same blocks. Each API
renders a Block its own way (a content block, an output item)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from ..chat.reply_processor import ReplyProcessor

REASONING, TEXT, TOOL_CALL = "reasoning", "text", "tool_call"


@dataclass
class Block:
    kind: str            # REASONING, TEXT or TOOL_CALL
    index: int           # its place among the reply's blocks
    text: str = ""       # the text, or a call's arguments (JSON text), so far
    call_id: str = ""
    name: str = ""


@dataclass(frozen=True)
class BlockEvent:
    what: Literal["start", "delta", "stop"]
    block: Block
    delta: str = ""


def reply_blocks(reader: ReplyProcessor, text: str) -> list[Block]:
    """A whole reply -> its blocks: its reasoning (where the reader splits it off), the prose, then each call."""
    reply = reader.reply(text, None)
    blocks: list[Block] = []
    for kind, part in ((REASONING, reply.reasoning), (TEXT, reply.content)):
        if part:
            blocks.append(Block(kind, len(blocks), part))
    return blocks + [Block(TOOL_CALL, len(blocks) + i, c.arguments, c.id, c.name)
                     for i, c in enumerate(reply.tool_calls)]


class BlockStream:
    """One reply's stream: its text in (read by `reader`, as in `reply_blocks`), the blocks' start / delta /
    stop events out."""

    def __init__(self, reader: ReplyProcessor):
        self.reader = reader
        self.blocks: list[Block] = []
        self._open: Block | None = None

    def feed(self, delta: str, final: bool) -> list[BlockEvent]:
        """The events of the reply's next text (all of them, the last ones closed, when `final`)."""
        events = []
        for d in self.reader.feed(delta, final):
            if d.get("reasoning_content"):
                events += self._grow(REASONING, d["reasoning_content"])
            if d.get("content"):
                events += self._grow(TEXT, d["content"])
            for call in d.get("tool_calls", ()):
                if "id" in call:   # a call's header: a new block
                    events += self._start(Block(TOOL_CALL, len(self.blocks), "", call["id"], call["function"]["name"]))
                elif fragment := call["function"]["arguments"]:
                    events += self._grow(TOOL_CALL, fragment)
        return events + (self._close() if final else [])

    def _grow(self, kind: str, fragment: str) -> list[BlockEvent]:
        events = [] if self._open is not None and self._open.kind == kind else self._start(Block(kind, len(self.blocks)))
        self._open.text += fragment
        return events + [BlockEvent("delta", self._open, fragment)]

    def _start(self, block: Block) -> list[BlockEvent]:
        events = self._close()
        self.blocks.append(block)
        self._open = block
        return events + [BlockEvent("start", block)]

    def _close(self) -> list[BlockEvent]:
        block, self._open = self._open, None
        return [] if block is None else [BlockEvent("stop", block)]


def assistant_message(blocks: list[Block]) -> dict[str, Any]:
    """A reply's blocks as the chat message that replays it (a stored conversation's last turn)."""
    text = "".join(b.text for b in blocks if b.kind == TEXT)
    reasoning = "".join(b.text for b in blocks if b.kind == REASONING)
    calls = [{"id": b.call_id, "type": "function", "function": {"name": b.name, "arguments": b.text}}
             for b in blocks if b.kind == TOOL_CALL]
    return {"role": "assistant", "content": text or (None if calls else ""),
            **({"reasoning_content": reasoning} if reasoning else {}), **({"tool_calls": calls} if calls else {})}


def call_input(block: Block) -> dict[str, Any] | None:
    """A call's arguments as an object; None when they are not one (a reply cut short by its token limit)."""
    try:
        value = json.loads(block.text)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None
