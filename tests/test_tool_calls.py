"""Tool-call formats: parsing a model's reply (Hermes tags, Llama-3.1 JSON, prose among calls, malformed
output), the schemas that enforce tool_choice, the fallback prompt, and streamed deltas that reassemble
to the whole reply's message. Pure functions: no engine."""
from __future__ import annotations

import json

import jsonschema
import pytest
from transformers import AutoTokenizer

from bie_trt.chat.tool_calls import (ReplyParser, held_back, parse_required, parse_tool_calls, required_schema,
                                template_messages, template_renders_tools, tools_prompt)
from bie_trt.server.protocols.openai import ChatRequest
from bie_trt.server.reply_format import tool_setup

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
NAMES = {"get_weather", "get_time"}


def calls_of(text: str, names=NAMES):
    content, calls = parse_tool_calls(text, names)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


def test_hermes_tags():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert calls_of(text) == (None, [("get_weather", {"city": "Oslo"})])


def test_hermes_several_calls_among_prose():
    text = ('Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>\n'
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call> Done.')
    assert calls_of(text) == ("Let me check. \n Done.", [("get_weather", {"city": "Oslo"}), ("get_time", {})])


def test_llama_json_call():
    assert calls_of('{"name": "get_weather", "parameters": {"city": "Rome"}}') == (
        None, [("get_weather", {"city": "Rome"})])
    assert calls_of('<|python_tag|>{"name": "get_time", "parameters": {}}') == (None, [("get_time", {})])
    assert calls_of('{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": {"city": "X"}}') == (
        None, [("get_time", {}), ("get_weather", {"city": "X"})])


def test_arguments_written_as_a_json_string():
    assert calls_of('<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}</tool_call>') == (
        None, [("get_weather", {"city": "Oslo"})])


def test_a_call_with_its_type_is_a_call():
    """Models trained on OpenAI's tool_calls write the call with its "type" beside name and arguments."""
    call = {"type": "function", "name": "get_weather", "arguments": {"city": "Oslo"}}
    want = (None, [("get_weather", {"city": "Oslo"})])
    assert calls_of(json.dumps(call)) == want
    assert calls_of(f"<tool_call>{json.dumps(call)}</tool_call>") == want
    assert calls_of(json.dumps({**call, "weather": "sun"}))[1] == []   # any other key: not a call


@pytest.mark.parametrize("text", [
    "Plain prose, no call.",
    '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>',      # not JSON
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}',           # never closed
    '<tool_call>{"name": "launch_rockets", "arguments": {}}</tool_call>',          # not one of the tools
    '{"name": "get_weather", "parameters": {"city": "Oslo"}',                      # truncated JSON
    '{"city": "Oslo"}',                                                            # JSON, but no call
    '<tool_call>["get_weather"]</tool_call>',
])
def test_malformed_output_stays_prose(text):
    assert calls_of(text) == (text, [])


def test_required_schema_validates_calls_and_parses():
    schema = required_schema([WEATHER, TIME], parallel=False)
    good = [{"name": "get_weather", "parameters": {"city": "Oslo"}}]
    jsonschema.validate(good, schema)
    for bad in ([], good * 2, [{"name": "get_weather", "parameters": {}}], [{"name": "nope", "parameters": {}}],
                [{"name": "get_time", "parameters": {"x": 1}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    jsonschema.validate(good * 2, required_schema([WEATHER, TIME], parallel=True))
    calls = parse_required(json.dumps(good))
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"})]
    assert calls[0].id.startswith("call_")
    assert parse_required('[{"name": "get_weather", "parameters": {"ci') is None



@pytest.mark.parametrize("bad", [
    {"name": "launch_rockets", "parameters": {}},     # not one of the tools
    {"name": "get_time", "parameters": 5},            # arguments that are no object
    {"name": "get_time", "parameters": "[1, 2]"},     # a JSON string of no object
    "get_time",                                       # no call at all
])
def test_required_refuses_a_call_array_with_any_bad_item(bad):
    """Not quietly reduced to its valid calls: the reply stays content, as a reply cut short does."""
    good = {"name": "get_weather", "parameters": {"city": "Oslo"}}
    for items in ([bad], [good, bad], [bad, good]):
        text = json.dumps(items)
        assert parse_required(text, NAMES) is None, items
        assert ReplyParser("required", NAMES).message(text) == (text, []), items
    assert [c.name for c in parse_required(json.dumps([good, good]), NAMES)] == ["get_weather"]   # a repeat ends it

def test_required_keeps_the_complete_calls_of_a_cut_reply():
    """max_tokens cut the array inside its second call: the first is a call, the cut one is dropped."""
    one = '{"name": "get_weather", "parameters": {"city": "Oslo"}}'
    for cut in ('[' + one + ', {"name": "get_ti', '[' + one + ',', '[' + one, '[\n' + one + ',\n{"name"'):
        assert [(c.name, json.loads(c.arguments)) for c in parse_required(cut, NAMES)] == [
            ("get_weather", {"city": "Oslo"})], cut
    assert parse_required('[{"name": "get_weather", "param', NAMES) is None
    assert parse_required('[' + one + ' ' + one + ']', NAMES) is None   # no comma: not the array


def test_a_repeated_call_ends_the_calls():
    """The first repeat (same function, same arguments in any key order) ends the array, in every mode."""
    oslo, rome = ({"name": "get_weather", "parameters": {"city": c}} for c in ("Oslo", "Rome"))
    time = {"name": "get_time", "parameters": {}}
    got = parse_required(json.dumps([oslo, time, rome, oslo, time, rome]), NAMES)
    assert [(c.name, json.loads(c.arguments)) for c in got] == [
        ("get_weather", {"city": "Oslo"}), ("get_time", {}), ("get_weather", {"city": "Rome"})]
    two_keys = {"name": "add", "parameters": {"a": 1, "b": 2}}
    swapped = {"name": "add", "parameters": {"b": 2, "a": 1}}
    assert len(parse_required(json.dumps([two_keys, swapped]), {"add"})) == 1
    tags = "".join(f'<tool_call>{json.dumps({"name": "get_time", "arguments": {}})}</tool_call>' for _ in range(3))
    assert calls_of(tags) == (None, [("get_time", {})])
    assert calls_of(json.dumps([oslo, oslo])) == (None, [("get_weather", {"city": "Oslo"})])


def test_complete_calls_cut_short_finish_with_length():
    """A reply whose calls were complete when max_tokens cut it (the array never closed) still finishes with
    "length": the client learns the reply was cut (it may have had more calls), not that it ended by itself."""
    parser = ReplyParser("required", NAMES)
    content, calls = parser.message('[{"name": "get_time", "parameters": {}}, {"name": "get_wea')
    assert content is None and [c.name for c in calls] == ["get_time"]
    assert parser.finish_reason("length", called=True) == "length"
    assert parser.finish_reason("stop", called=True) == "tool_calls"
    assert parser.finish_reason("stop", called=False) == "stop"


def test_named_arguments_cut_mid_way_are_no_call():
    assert ReplyParser("named", NAMES, "get_weather").message('{"city": "Os') == (None, [])
    content, calls = ReplyParser("named", NAMES, "get_weather").message('{"city": "Oslo"}')
    assert content is None and [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Oslo"}')]


@pytest.mark.parametrize("parallel, max_items", [(None, 1), (False, 1), (True, None)])
def test_required_allows_one_call_unless_parallel_calls_are_asked_for(parallel, max_items):
    """What LangChain and the Agents SDK send (no parallel_tool_calls) gets one call."""
    body = {"messages": [{"role": "user", "content": "Weather?"}], "tools": [WEATHER], "tool_choice": "required",
            **({} if parallel is None else {"parallel_tool_calls": parallel})}
    plan = tool_setup(ChatRequest.model_validate_json(json.dumps(body)))
    assert plan.constraint.schema().get("maxItems") == max_items


def test_held_back_pauses_at_a_possible_call():
    assert held_back("Hello <tool_c") == len("Hello ")
    assert held_back("Hello <tool_call>{") == len("Hello ")
    assert held_back("Hello <b>") == len("Hello <b>")
    assert held_back("  ") == 0 and held_back(' {"name"') == 0 and held_back("<|pyth") == 0


def stream(parser: ReplyParser, pieces: list[str]) -> tuple[str | None, list[tuple[str, str]]]:
    """Replay deltas as an OpenAI client does: content concatenated, calls by index."""
    content, calls = [], {}
    deltas = [d for p in pieces for d in parser.feed(p)] + parser.finish()
    for d in deltas:
        if "content" in d:
            content.append(d["content"])
        for tc in d.get("tool_calls", []):
            entry = calls.setdefault(tc["index"], {"name": "", "arguments": ""})
            entry["name"] += tc["function"].get("name", "")
            entry["arguments"] += tc["function"]["arguments"]
    return "".join(content) or None, [(c["name"], c["arguments"]) for _, c in sorted(calls.items())]


@pytest.mark.parametrize("mode, text", [
    ("auto", 'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call> Bye <b>x</b>'),
    ("auto", '{"name": "get_weather", "parameters": {"city": "Rome"}}'),
    ("auto", "Just prose <tool_c and more."),
    ("auto", '  <tool_call>{"bad json</tool_call> tail'),
    ("required", '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "A"}}]'),
    ("required", '[{"name": "get_time", "par'),
    ("required", '[{"name": "get_time", "parameters": {}}, {"name": "get_time", "parameters": {}}, {"name": "ge'),
    ("named", '{"city": "Oslo"}'),
    ("none", 'Hi <tool_call>{"name": "get_time", "arguments": {}}</tool_call>'),
])
def test_stream_reassembles_to_the_message(mode, text):
    fn = "get_weather" if mode == "named" else None
    want_content, want_calls = ReplyParser(mode, NAMES, fn).message(text)
    for size in (1, 3, 7):
        pieces = [text[i:i + size] for i in range(0, len(text), size)]
        got = stream(ReplyParser(mode, NAMES, fn), pieces)
        assert got == (want_content, [(c.name, c.arguments) for c in want_calls]), size


def test_fallback_prompt_and_history():
    """Tools as a system prompt, an assistant's calls as tags, results as tool_response turns."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                {"role": "tool", "content": "12 C", "tool_call_id": "call_1"}]
    out = template_messages(messages, [WEATHER], native=False)
    assert out[0]["content"] == "Be brief.\n\n" + tools_prompt([WEATHER])
    assert '"name": "get_weather"' in out[0]["content"] and "<tool_call>" in out[0]["content"]
    assert out[2] == {"role": "assistant",
                      "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'}
    assert out[3] == {"role": "user", "content": "<tool_response>\n12 C\n</tool_response>"}
    native = template_messages(messages, [WEATHER], native=True)
    assert native[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}   # templates `tojson` it
    assert native[3] == messages[3] and native[0] == messages[0]


def test_template_renders_tools(smollm2_checkpoint):
    """SmolLM2's template ignores tools (so the fallback prompt is used); a Hermes-style one renders them."""
    tokenizer = AutoTokenizer.from_pretrained(smollm2_checkpoint)
    assert not template_renders_tools(tokenizer)
    tokenizer.chat_template = ("{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>"
                               "{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}")
    assert template_renders_tools(tokenizer)
