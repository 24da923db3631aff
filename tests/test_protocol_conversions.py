"""The Messages and Responses bodies as the chat template gets them, their replies' endings, and a tool
call's arguments on each API (always a JSON object), as pure functions: no server, no engine."""
from __future__ import annotations

import json

import jsonschema
import pydantic
import pytest

from bie_trt.chat.tool_calls import ToolsError, resolve_tool_choice
from bie_trt.server.reply_blocks import TOOL_CALL, Block
from bie_trt.server.chat_path import as_chat_request
from bie_trt.server.messages import content_block, stop_reason
from bie_trt.server.protocols.anthropic import MessagesRequest
from bie_trt.server.protocols.openai import ChatRequest
from bie_trt.server.protocols.openai_responses import ResponsesRequest
from bie_trt.server.reply_format import ParamError, tool_setup

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def template_messages(fields: dict) -> list[dict]:
    """What the chat template gets for another API's body (converted as its route converts it)."""
    return [m.to_template() for m in as_chat_request(fields).messages]


def messages_body(content: list[dict]) -> MessagesRequest:
    return MessagesRequest.model_validate({"max_tokens": 8, "messages": [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Oslo"}}]},
        {"role": "user", "content": content}]})


def test_a_user_turns_text_and_tool_results_keep_their_order():
    """Claude Code sends a reminder before the tool's result and a question after it, in one user turn."""
    got = template_messages(messages_body([
        {"type": "text", "text": "Before. "},
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "12 C"},
        {"type": "text", "text": "After."}]).chat_fields())
    assert [(m["role"], m["content"]) for m in got[2:]] == [("user", "Before. "), ("tool", "12 C"), ("user", "After.")]
    assert got[3]["tool_call_id"] == "toolu_1"


def test_a_failed_tool_result_tells_the_model_it_failed():
    failed, ok = (template_messages(messages_body([{"type": "tool_result", "tool_use_id": "toolu_1",
                                                    "content": "city not found", "is_error": e}]).chat_fields())[-1]
                  for e in (True, False))
    assert ok["content"] == "city not found"
    assert failed["content"] != ok["content"] and failed["content"].startswith("Error") and "city not found" in failed["content"]


@pytest.mark.parametrize("finish, called, sequence, reason", [
    ("length", True, None, "max_tokens"),        # a call made, then cut: the client must not run a cut reply's calls
    ("length", False, None, "max_tokens"),
    ("stop", True, None, "tool_use"),
    ("stop", False, "\n\n", "stop_sequence"),
    ("stop", False, None, "end_turn")])
def test_a_messages_reply_cut_by_max_tokens_stops_for_max_tokens(finish, called, sequence, reason):
    assert stop_reason(finish, called, sequence) == reason


def test_responses_instructions_come_before_the_history():
    history = [{"role": "user", "content": "Earlier question"}, {"role": "assistant", "content": "Earlier answer"}]
    req = ResponsesRequest.model_validate({"instructions": "Be brief.", "input": "Now?"})
    got = template_messages(req.chat_fields(history))
    assert [(m["role"], m["content"]) for m in got] == [
        ("system", "Be brief."), ("user", "Earlier question"), ("assistant", "Earlier answer"), ("user", "Now?")]


# -- a call's arguments are an object on every API ------------------------------------------------

def named(parameters: dict | None) -> list[dict]:
    return [{"type": "function", "function": {"name": "get_weather",
                                              **({"parameters": parameters} if parameters is not None else {})}}]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
@pytest.mark.parametrize("parameters", [{"properties": {"city": {"type": "string"}}},   # no type: open to any JSON
                                        {**CITY, "type": ["object", "null"]}, CITY, None])
def test_a_forced_calls_grammar_admits_objects_only(parameters, choice):
    """The grammar of a forced call is the tool's schema with type "object": without it, a schema that
    declares no type lets the model write `"Oslo"` as the arguments (llguidance admits it)."""
    mode, _, constraint = resolve_tool_choice(named(parameters), choice)
    schema = constraint.schema()
    arguments = schema if mode == "named" else schema["items"]["properties"]["parameters"]
    assert arguments["type"] == "object"
    for value in ("Oslo", ["Oslo"], None, 12):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(value, arguments)


@pytest.mark.parametrize("parameters", [{"type": "array", "items": {"type": "string"}}, {"type": "string"},
                                        {"type": ["string", "null"]}])
def test_a_tool_whose_arguments_cannot_be_an_object_is_refused_on_each_openai_api(parameters):
    """As OpenAI answers it: 400 on `tools` naming the function, on the chat route and the Responses route
    (whose body becomes the chat body), in every tool_choice mode; the library's chat() raises the same."""
    chat = ChatRequest.model_validate({"messages": [{"role": "user", "content": "Hi"}], "tools": named(parameters)})
    responses = as_chat_request(ResponsesRequest.model_validate(
        {"input": "Hi", "tools": [{"type": "function", "name": "get_weather", "parameters": parameters}]}
    ).chat_fields([]))
    for req in (chat, responses):
        with pytest.raises(ParamError, match=r"tools\[0\] \('get_weather'\): parameters must be .*\"object\"") as e:
            tool_setup(req)
        assert e.value.param == "tools"
    with pytest.raises(ToolsError):
        resolve_tool_choice(named(parameters), "none")
    with pytest.raises(pydantic.ValidationError, match="input_schema"):   # Anthropic's body refuses it itself
        MessagesRequest.model_validate({"max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}],
                                        "tools": [{"name": "get_weather", "input_schema": parameters}]})


@pytest.mark.parametrize("arguments", ['["Oslo"]', '"Oslo"', "12", "null", '{"city": "Os'])
def test_a_tool_use_block_never_carries_input_that_is_no_object(arguments):
    """Anthropic's tool_use.input must be an object: arguments that are none (only a named call cut by
    max_tokens now: the grammar admits nothing else) go out as the text they are."""
    block = Block(TOOL_CALL, 0, arguments, "call_1", "get_weather")
    assert content_block(block) == {"type": "text", "text": arguments}
    whole = content_block(Block(TOOL_CALL, 0, json.dumps({"city": "Oslo"}), "call_1", "get_weather"))
    assert whole == {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}
