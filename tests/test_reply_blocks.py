"""The reply blocks Messages and Responses render: a streamed reply, fed in pieces of every size, closes
into the blocks of the whole reply (reasoning, prose, calls, in that order), and no piece of a tag is
ever text."""
from __future__ import annotations

import pytest

from bie_trt.chat.reply_processor import ReplyProcessor
from bie_trt.chat.tool_calls import ReplyParser
from bie_trt.server.reply_blocks import REASONING, TEXT, TOOL_CALL, BlockStream, reply_blocks

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Berlin"}}\n</tool_call>'
REPLIES = {
    "thinks, answers, calls": f"<think>\nI need the weather in Berlin.\n</think>\n\nChecking Berlin.\n{CALL}",
    "thinks only (cut short)": "<think>\nStill thinking about",
    "cut inside the closing tag": "<think>\nStill thinking about </thi",
    "cut inside the opening tag": "<thi",
    "no block": f"Checking Berlin.\n{CALL}",
}


def reader(inside: bool | None) -> ReplyProcessor:
    return ReplyProcessor(ReplyParser("auto", {"get_weather"}), inside)


def streamed(text: str, inside: bool | None, size: int) -> tuple[list, list[str]]:
    stream = BlockStream(reader(inside))
    pieces = [text[i:i + size] for i in range(0, len(text), size)] or [""]
    events = [e for i, p in enumerate(pieces) for e in stream.feed(p, i == len(pieces) - 1)]
    return stream.blocks, [e.delta for e in events if e.what == "delta" and e.block.kind == TEXT]


def shape(blocks) -> list[tuple]:
    return [(b.kind, b.index, b.text if b.kind != TOOL_CALL else b.name) for b in blocks]


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
@pytest.mark.parametrize("reply", sorted(REPLIES))
def test_a_stream_closes_into_the_whole_replys_blocks(reply, size):
    text = REPLIES[reply]
    whole = reply_blocks(reader(False), text)
    blocks, text_deltas = streamed(text, False, size)
    assert shape(blocks) == shape(whole)
    assert not any("think" in d for d in text_deltas)


def test_the_blocks_of_a_thinking_reply_and_of_an_unsplit_one():
    text = REPLIES["thinks, answers, calls"]
    assert shape(reply_blocks(reader(False), text)) == [
        (REASONING, 0, "I need the weather in Berlin."), (TEXT, 1, "Checking Berlin.\n"), (TOOL_CALL, 2, "get_weather")]
    # not split (no parser, or the prompt closed the block): the tags stay in the text
    assert shape(reply_blocks(reader(None), text))[0] == (TEXT, 0, text[:text.index("<tool_call>")])
    # the prompt opened the block: everything up to </think> is reasoning
    assert shape(reply_blocks(reader(True), "All reasoning")) == [(REASONING, 0, "All reasoning")]
