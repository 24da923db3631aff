"""Reasoning blocks: the whole-reply split, the streaming splitter cut at every boundary (it must give the
same parts and never send a piece of a tag as text), where a reply starts from its prompt, the parser
`auto` picks, and Hermes tool calls after a thinking block. Pure functions: no engine."""
from __future__ import annotations

import itertools
import json

import pytest

from bie_trt.chat.reasoning import ReasoningStream, resolve_parser, split_reasoning, starts_inside
from bie_trt.chat.tool_calls import ReplyParser

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


@pytest.mark.parametrize("text, inside, expected", [
    ("<think>\nThe user greets me.\n</think>\n\nHello!", False, ("The user greets me.", "Hello!")),
    ("  <think>a</think>b", False, ("a", "b")),                          # whitespace before the tag
    ("Hello, no thinking here.", False, (None, "Hello, no thinking here.")),
    ("Hello <think>late</think> tag", False, (None, "Hello <think>late</think> tag")),  # only a leading block
    ("<think>\nstill thinking when cut sh", False, ("still thinking when cut sh", None)),
    ("<think>\n\n</think>\n\nAnswer.", False, (None, "Answer.")),         # an empty block
    ("<think>only thought</think>\n\n", False, ("only thought", None)),
    ("<think>x < y </thin and on</think>z", False, ("x < y </thin and on", "z")),  # a false start of the close
    ("<think>a</think>b</think>c", False, ("a", "b</think>c")),          # the first close ends the block
    ("", False, (None, "")),
    # DeepSeek-R1 style: the prompt opened the block
    ("The prompt opened it.\n</think>\n\nAnswer.", True, ("The prompt opened it.", "Answer.")),
    ("<think>\nR1 repeats the tag.</think>Answer.", True, ("R1 repeats the tag.", "Answer.")),
    ("cut short inside", True, ("cut short inside", None)),
    ("<thi", True, ("<thi", None)),
    ("", True, (None, None)),
])
def test_split_reasoning(text, inside, expected):
    assert split_reasoning(text, inside) == expected


def streamed(chunks: list[str], inside: bool) -> tuple[list[str], list[str]]:
    stream = ReasoningStream(inside)
    reasoning, content = [], []
    for out in [*map(stream.feed, chunks), stream.finish()]:
        reasoning += [out[0]] if out[0] else []
        content += [out[1]] if out[1] else []
    return reasoning, content


def chunkings(text: str):
    """Every way to cut `text` in two and in three, and one character at a time."""
    n = len(text)
    yield list(text)
    for i in range(n + 1):
        yield [text[:i], text[i:]]
    for i, j in itertools.combinations(range(1, n), 2):
        yield [text[:i], text[i:j], text[j:]]


CASES = [
    ("<think>\nThe user greets me.\n</think>\n\nHello!", False),
    (" <think> a  b </think>  c ", False),
    ("Plain answer <b>bold</b>", False),
    ("<thinking is not the tag", False),
    ("<think>\ncut sh", False),
    ("<think>x </thin y</think>z", False),
    ("<think></</think>", False),
    ("  \n ", False),
    ("The prompt opened it.\n</think>\n\nAnswer.", True),
    ("<think>R1</think>A", True),
    ("cut </thi", True),
    ("<thi", True),
    ("\n\n", True),
]


@pytest.mark.parametrize("text, inside", CASES)
def test_the_stream_joins_to_the_split_at_every_cut(text, inside):
    reasoning, content = split_reasoning(text, inside)
    for chunks in chunkings(text):
        r, c = streamed(chunks, inside)
        assert ("".join(r) or None, "".join(c)) == (reasoning, content or ""), chunks


def test_no_piece_of_a_tag_is_ever_sent():
    """Neither part of this reply holds '<' or '>', so any delta with one leaked part of a tag."""
    text = "<think>\nweigh it\n</think>\n\nAnswer"
    for inside in (False, True):
        for chunks in chunkings(text):
            r, c = streamed(chunks, inside)
            assert not any(ch in piece for piece in r + c for ch in "<>"), chunks
            assert ("".join(r), "".join(c)) == ("weigh it", "Answer")


def test_content_waits_for_the_block_to_close():
    stream = ReasoningStream(inside=False)
    assert stream.feed("<th") == ("", "")          # may still open a block
    assert stream.feed("ink>") == ("", "")
    assert stream.feed("step one ") == ("step one", "")   # its trailing space is held: the block may close next
    assert stream.feed("</thi") == ("", "")
    assert stream.feed("nk>\n\n") == ("", "")
    assert stream.feed("Done") == ("", "Done")
    assert stream.finish() == ("", "")


@pytest.mark.parametrize("parser, tail, expected", [
    ("qwen3", "<|im_start|>assistant\n", False),                       # Qwen3 thinking: the reply opens it
    ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", None),   # enable_thinking false: closed already
    ("qwen3", "<|im_start|>assistant\n<think>\n", True),                # a template that opens it (R1, 2507)
    ("deepseek_r1", "<｜Assistant｜>", True),                           # R1 always starts thinking
    ("deepseek_r1", "<｜Assistant｜></think>", None),
    ("qwen3", "</think>\n\n4<|im_end|>\n<|im_start|>assistant\n", False),  # a tag earlier in the history
    ("none", "<|im_start|>assistant\n<think>\n", None),
])
def test_where_a_reply_starts(parser, tail, expected):
    assert starts_inside(parser, tail) is expected


def test_auto_turns_on_for_templates_that_think():
    assert resolve_parser("auto", "{{ '<think>\\n\\n</think>' }}") == "qwen3"
    assert resolve_parser("auto", "{{ messages }}") == "none"
    # DeepSeek-R1's template only cuts past turns' reasoning off at </think>: its replies start inside the block
    assert resolve_parser("auto", "{{ m['content'].split('</think>')[-1] }}") == "deepseek_r1"
    assert resolve_parser("auto", None) == "none"
    assert resolve_parser("deepseek_r1", None) == "deepseek_r1"
    with pytest.raises(ValueError, match="'r1' is not one of auto, qwen3, deepseek_r1, none"):
        resolve_parser("r1", None)


def test_hermes_calls_after_a_thinking_block():
    """The tool-call parser reads the content only: a call drafted inside the block stays reasoning."""
    draft = CALL.replace("Oslo", "Bergen")
    text = f"<think>\nI could call {draft} but Oslo is asked.\n</think>\n\n{CALL}"
    reasoning, content = split_reasoning(text)
    assert reasoning == f"I could call {draft} but Oslo is asked."
    prose, calls = ReplyParser("auto", {"get_weather"}).message(content)
    assert prose is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"})]
    # streamed, the content deltas go through the tool-call parser's own stream
    for chunks in chunkings(text):
        if len(chunks) > 3 or "" in chunks:   # the two- and three-piece cuts are enough here
            continue
        stream, parser, deltas = ReasoningStream(False), ReplyParser("auto", {"get_weather"}), []
        for piece in chunks:
            deltas += parser.feed(stream.feed(piece)[1])
        deltas += parser.feed(stream.finish()[1]) + parser.finish()
        assert [d["tool_calls"][0]["function"] for d in deltas if "tool_calls" in d] == [
            {"name": "get_weather", "arguments": ""}, {"arguments": '{"city": "Oslo"}'}]
        assert not any(d.get("content") for d in deltas), chunks
