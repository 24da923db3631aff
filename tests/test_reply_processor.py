"""The one reader of a chat reply (chat/reply_processor.py), which the server's routes and BieEngine.chat share:
a streamed reply's deltas join to the whole reply's reasoning, prose and calls, with the same finish reason."""
from __future__ import annotations

import json

import pytest

from bie_trt.chat.reply_processor import ReplyProcessor
from bie_trt.chat.tool_calls import TOOL_PARSERS, ToolSetup

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
REPLIES = [
    (f"<think>\nRain likely.\n</think>\n\nLet me check.\n{CALL}", False, "stop"),
    ("still reasoning when cut", True, "length"),
    (f"No block here. {CALL}", None, "stop"),
    ("Just prose.", False, "stop"),
    ("<thi", False, "length"),                                # cut inside the opening tag: held back, then prose
    ("<think>\nStill thinking about </thi", False, "length"),  # cut inside the closing tag
]


def joined(reader: ReplyProcessor, text: str, size: int) -> dict:
    pieces = [text[i:i + size] for i in range(0, len(text), size)]
    out = {"reasoning_content": "", "content": "", "calls": {}}
    for i, piece in enumerate(pieces):
        for delta in reader.feed(piece, i == len(pieces) - 1):
            out["reasoning_content"] += delta.get("reasoning_content", "")
            out["content"] += delta.get("content") or ""
            for call in delta.get("tool_calls", ()):
                entry = out["calls"].setdefault(call["index"], {"name": "", "arguments": ""})
                entry["name"] += call["function"].get("name", "")
                entry["arguments"] += call["function"]["arguments"]
    return out


@pytest.mark.parametrize("size", [1, 4, 1000])
@pytest.mark.parametrize("text, inside, reason", REPLIES)
def test_a_stream_joins_to_the_whole_reply(text, inside, reason, size):
    setup = ToolSetup.of(TOOLS, "auto")
    whole = ReplyProcessor(setup.parser(), inside).reply(text, reason)
    reader = ReplyProcessor(setup.parser(), inside)
    streamed = joined(reader, text, size)
    assert streamed["reasoning_content"] == (whole.reasoning or "")
    assert streamed["content"].strip() == (whole.content or "").strip()
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed["calls"].values()] == \
        [(c.name, json.loads(c.arguments)) for c in whole.tool_calls]
    assert reader.finish_reason(reason) == whole.finish_reason


def test_the_whole_reply():
    setup = ToolSetup.of(TOOLS, "auto")
    reply = ReplyProcessor(setup.parser(), False).reply(REPLIES[0][0], "stop")
    assert (reply.reasoning, reply.content.strip(), reply.finish_reason) == ("Rain likely.", "Let me check.",
                                                                             "tool_calls")
    assert [(c.name, json.loads(c.arguments)) for c in reply.tool_calls] == [("get_weather", {"city": "Oslo"})]
    # not split: the tags stay prose; cut short with calls: still "length"
    unsplit = ReplyProcessor(setup.parser(), None).reply(REPLIES[0][0], "length")
    assert unsplit.reasoning is None and unsplit.content.startswith("<think>") and unsplit.finish_reason == "length"
    # a named function: the reply is its arguments
    named = ToolSetup.of(TOOLS, {"type": "function", "function": {"name": "get_weather"}})
    call = ReplyProcessor(named.parser(), None).reply('{"city": "Oslo"}', "stop")
    assert call.content is None and call.tool_calls[0].name == "get_weather" and call.finish_reason == "tool_calls"


def test_an_unknown_tool_parser_is_refused():
    with pytest.raises(ValueError, match="tool parser 'pythonic'"):
        ToolSetup.of(TOOLS, "auto").parser(tool_parser="pythonic")


def reads_no_calls(text: str, names, check) -> tuple[str | None, list]:
    """A model family's tool parser that never finds a call (as one for another family's format would)."""
    return text, []


@pytest.mark.parametrize("size", [3, 1000])
@pytest.mark.parametrize("choice, text", [
    ({"type": "function", "function": {"name": "get_weather"}}, '{"city": "Oslo"}'),
    ("required", '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]')])
def test_calls_under_tool_choices_grammar_are_taken_from_its_structure_not_the_familys_parser(
        monkeypatch, choice, text, size):
    monkeypatch.setitem(TOOL_PARSERS, "no_calls", reads_no_calls)
    setup = ToolSetup.of(TOOLS, choice)
    whole = ReplyProcessor(setup.parser(tool_parser="no_calls"), None).reply(text, "stop")
    assert (whole.content, whole.finish_reason) == (None, "tool_calls")
    assert [(c.name, json.loads(c.arguments)) for c in whole.tool_calls] == [("get_weather", {"city": "Oslo"})]
    streamed = joined(ReplyProcessor(setup.parser(tool_parser="no_calls"), None), text, size)
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed["calls"].values()] == \
        [("get_weather", {"city": "Oslo"})] and streamed["content"] == ""
    # the same family parser is the one a free reply is read by: there, the call it cannot read stays prose
    free = ReplyProcessor(ToolSetup.of(TOOLS, "auto").parser(tool_parser="no_calls"), None).reply(CALL, "stop")
    assert (free.content, free.tool_calls, free.finish_reason) == (CALL, [], "stop")
