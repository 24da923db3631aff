"""Anthropic's Messages API and OpenAI's Responses API, driven by the official `anthropic` and `openai`
clients against one real server on 127.0.0.1 (the tiny random model: the protocol, not the prose, is
under test). Each reply is checked against the chat route's for the same conversation, since both APIs
are conversions onto its request path."""
from __future__ import annotations

import json
from typing import Annotated, Literal

import anthropic
import httpx
import jsonschema
import openai
import pydantic
import pytest

from bie_trt import BieEngine, EngineConfig, SamplingParams
from bie_trt.server.app import ServerOptions
from bie_trt.server.context_edits import PLACEHOLDER
from bie_trt.server.response_store import ResponseStore, StoredResponse
from test_server import serving

WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                   "unit": {"enum": ["celsius", "fahrenheit"]}},
                  "required": ["city", "unit"], "additionalProperties": False}
CLAUDE_TOOL = {"name": "get_weather", "description": "Current weather in a city", "input_schema": WEATHER_SCHEMA}
OPENAI_TOOL = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
               "parameters": WEATHER_SCHEMA}
CHAT_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                              "parameters": WEATHER_SCHEMA}}
ASK = "What is the weather in Oslo?"
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def server(tiny_engine):
    engine = BieEngine(EngineConfig(engine_dir=str(tiny_engine), device="cpu", max_model_len=1024))
    with serving(engine, ServerOptions(api_key="k3y")) as base:
        yield engine, base


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server[1], api_key="k3y", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server[1] + "/v1", api_key="k3y", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(server):
    return server[0].model_name


def chat_reply(oai, model, messages, max_tokens, **kw):
    return oai.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0, **kw)


def tokenize(server, messages, tools=None) -> list[int]:
    r = httpx.post(server[1] + "/tokenize", json={"messages": messages, "tools": tools},
                   headers={"Authorization": "Bearer k3y"})
    return r.json()["tokens"]


# -- Anthropic Messages ----------------------------------------------------------------------------

def test_message_is_the_chat_reply(claude, oai, model):
    """system as a string and as blocks, a plain message: the chat route's greedy reply, Anthropic's usage."""
    chat = chat_reply(oai, model, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}], 6)
    for system in ("Be brief.", [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]):
        r = claude.messages.create(model=model, max_tokens=6, system=system,
                                   messages=[{"role": "user", "content": "Hello"}], extra_body=GREEDY)
        assert r.type == "message" and r.role == "assistant" and r.id.startswith("msg_")
        assert [b.type for b in r.content] == ["text"] and r.content[0].text == chat.choices[0].message.content
        assert r.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]
        assert r.usage.output_tokens == chat.usage.completion_tokens
        # the prompt was served before: Anthropic counts its cached tokens apart
        assert r.usage.cache_read_input_tokens > 0
        assert r.usage.input_tokens + r.usage.cache_read_input_tokens == chat.usage.prompt_tokens


def test_streamed_message_reassembles(claude, model):
    kw = dict(model=model, max_tokens=8, messages=[{"role": "user", "content": "Tell me a story"}], extra_body=GREEDY)
    whole = claude.messages.create(**kw)
    with claude.messages.stream(**kw) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert events.count("content_block_start") == events.count("content_block_stop") == 1
    assert final.content[0].text == whole.content[0].text and final.stop_reason == whole.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 8


def test_stop_sequence(claude, model):
    kw = dict(model=model, max_tokens=10, messages=[{"role": "user", "content": "Count"}], extra_body=GREEDY)
    text = claude.messages.create(**kw).content[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    r = claude.messages.create(**kw, stop_sequences=["zzzzqq", stop])
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop
    assert r.content[0].text == text[:text.index(stop)]


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_forced_tool_input_validates(claude, model, streamed):
    kw = dict(model=model, max_tokens=60, messages=[{"role": "user", "content": ASK}], tools=[CLAUDE_TOOL],
              tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY)
    if streamed:
        with claude.messages.stream(**kw) as stream:
            deltas = [e.delta.partial_json for e in stream if e.type == "content_block_delta"]
            r = stream.get_final_message()
        assert json.loads("".join(deltas)) == r.content[0].input
    else:
        r = claude.messages.create(**kw)
    assert r.stop_reason == "tool_use" and [b.type for b in r.content] == ["tool_use"]
    call = r.content[0]
    assert call.name == "get_weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, WEATHER_SCHEMA)


def test_output_format_shapes_text_turns_only(claude, model):
    """output_config.format: a text reply matches the schema; a forced call's turn is the call alone."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                               "rain": {"type": "boolean"}},
              "required": ["city", "rain"], "additionalProperties": False}
    kw = dict(model=model, max_tokens=40, messages=[{"role": "user", "content": ASK}], extra_body=GREEDY,
              output_config={"format": {"type": "json_schema", "schema": schema}})
    r = claude.messages.create(**kw)
    assert r.stop_reason == "end_turn"
    jsonschema.validate(json.loads(r.content[0].text), schema)
    forced = claude.messages.create(**kw, tools=[CLAUDE_TOOL], tool_choice={"type": "tool", "name": "get_weather"})
    assert forced.stop_reason == "tool_use"
    jsonschema.validate(forced.content[0].input, WEATHER_SCHEMA)


def test_a_prefilled_reply_is_continued_not_repeated(server, claude, oai, model):
    """Claude Code's topic side call ends with an assistant turn "{": the prompt leaves that turn open, the
    model continues it, and the reply is only what the model wrote after the prefill (as Anthropic's API
    answers); vLLM's continue_final_message does the same on the chat route."""
    engine = server[0]
    ask = [{"role": "user", "content": "Give this conversation a title as JSON."}, {"role": "assistant", "content": "{"}]
    ids = engine.encode_chat(ask, continue_final=True)
    assert engine.tokenizer.decode(ids).endswith("assistant\n{")   # the turn is open: no end of turn after it
    sdk = engine.generate(ids, SamplingParams(temperature=0, max_tokens=6))
    reply = claude.messages.create(model="claude-3-5-haiku-20241022", max_tokens=6, messages=ask, extra_body=GREEDY)
    assert [b.type for b in reply.content] == ["text"] and reply.content[0].text == sdk.text
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == len(ids) == \
        claude.messages.count_tokens(model=model, messages=ask).input_tokens
    chat = chat_reply(oai, model, ask, 6, extra_body={"continue_final_message": True})
    assert chat.choices[0].message.content == sdk.text and chat.usage.prompt_tokens == len(ids)


# A coding session in progress: four weather lookups answered, each turn with its thinking.
CITIES = ("Oslo", "Rome", "Paris", "Lima")
SESSION = [{"role": "user", "content": "Weather in Oslo, Rome, Paris and Lima, one by one."}]
for _i, _city in enumerate(CITIES):
    SESSION += [{"role": "assistant", "content": [
                    {"type": "thinking", "thinking": f"Next: {_city}.", "signature": ""},
                    {"type": "tool_use", "id": f"toolu_{_i}", "name": "get_weather",
                     "input": {"city": _city, "unit": "celsius"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{_i}",
                                              "content": f"{_city}: 21 degrees, clear sky, light wind from the west."}]}]


def test_context_management_clears_old_tool_results_and_reports_it(claude, model):
    """Claude Code's context_management: past the trigger the oldest results give way to a placeholder, the
    `keep` most recent stay; the reply reports each applied edit as Anthropic's API does, and count_tokens
    counts the edited prompt with the original beside it."""
    before = claude.messages.count_tokens(model=model, messages=SESSION, tools=[CLAUDE_TOOL]).input_tokens
    clear = {"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": 50},
             "keep": {"type": "tool_uses", "value": 1}, "exclude_tools": ["read_file"]}
    kw = dict(model=model, max_tokens=2, messages=SESSION, tools=[CLAUDE_TOOL], betas=["context-management-2025-06-27"])
    counted = claude.beta.messages.count_tokens(**{k: v for k, v in kw.items() if k != "max_tokens"},
                                                context_management={"edits": [clear]})
    after = counted.input_tokens
    assert counted.context_management.original_input_tokens == before > after
    reply = claude.beta.messages.create(**kw, context_management={"edits": [clear]}, extra_body=GREEDY)
    assert [e.model_dump() for e in reply.context_management.applied_edits] == [
        {"type": "clear_tool_uses_20250919", "cleared_tool_uses": 3, "cleared_input_tokens": before - after}]
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == after
    # below the trigger, or freeing less than clear_at_least: nothing is cleared, and the reply says so
    for edit in ({**clear, "trigger": {"type": "input_tokens", "value": before}},
                 {**clear, "clear_at_least": {"type": "input_tokens", "value": before}},
                 {**clear, "exclude_tools": ["get_weather"]}):
        untouched = claude.beta.messages.create(**kw, context_management={"edits": [edit]}, extra_body=GREEDY)
        assert untouched.context_management.applied_edits == []
        assert untouched.usage.input_tokens + untouched.usage.cache_read_input_tokens == before
    # the calls' inputs too, and older thinking turns (this template shows no reasoning: 0 tokens freed)
    edits = [{"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 1}},
             {**clear, "trigger": {"type": "tool_uses", "value": 3}, "clear_tool_inputs": True}]
    both = claude.beta.messages.create(**kw, context_management={"edits": edits}, extra_body=GREEDY)
    thinking, tools = [e.model_dump() for e in both.context_management.applied_edits]
    assert thinking == {"type": "clear_thinking_20251015", "cleared_thinking_turns": 3, "cleared_input_tokens": 0}
    assert tools["cleared_tool_uses"] == 3 and tools["cleared_input_tokens"] > before - after


def test_keep_zero_clears_every_tool_use_past_the_trigger(claude, model):
    """keep {"value": 0}: past the trigger all four tool uses are cleared, and the prompt the model gets is the
    session with each result replaced by the placeholder (counted apart, with the edit written out by hand)."""
    clear = {"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": 50},
             "keep": {"type": "tool_uses", "value": 0}}
    by_hand = [{**m, "content": [{**b, "content": PLACEHOLDER} for b in m["content"]]} if m["role"] == "user"
               and isinstance(m["content"], list) else m for m in SESSION]
    before, after = (claude.messages.count_tokens(model=model, messages=messages, tools=[CLAUDE_TOOL]).input_tokens
                     for messages in (SESSION, by_hand))
    reply = claude.beta.messages.create(model=model, max_tokens=1, messages=SESSION, tools=[CLAUDE_TOOL],
                                        betas=["context-management-2025-06-27"], extra_body=GREEDY,
                                        context_management={"edits": [clear]})
    assert [e.model_dump() for e in reply.context_management.applied_edits] == [
        {"type": "clear_tool_uses_20250919", "cleared_tool_uses": 4, "cleared_input_tokens": before - after}]
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == after < before


def test_context_edits_it_cannot_perform_are_refused_by_name(claude, model):
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.beta.messages.create(model=model, max_tokens=2, messages=SESSION, tools=[CLAUDE_TOOL],
                                    context_management={"edits": [{"type": "compact_20260112"}]})
    assert "compact_20260112 edit, which this server cannot perform" in caught.value.body["error"]["message"]


def test_tool_result_round_trip_and_count_tokens(server, claude, model):
    """The forced call, then its result: both reach the prompt as the chat route renders them (count_tokens
    equals /tokenize of the same chat history), and the reply's usage counts that prompt."""
    ask = [{"role": "user", "content": ASK}]
    call = claude.messages.create(model=model, max_tokens=60, messages=ask, tools=[CLAUDE_TOOL],
                                  tool_choice={"type": "any"}, extra_body=GREEDY).content[0]
    assert call.type == "tool_use"
    jsonschema.validate(call.input, WEATHER_SCHEMA)
    history = ask + [{"role": "assistant", "content": [call]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                   "content": "12 degrees, rain"},
                                                  {"type": "text", "text": "Thanks."}]}]
    counted = claude.messages.count_tokens(model=model, messages=history, tools=[CLAUDE_TOOL]).input_tokens
    chat = [{"role": "user", "content": ASK},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": call.id, "type": "function",
                 "function": {"name": call.name, "arguments": json.dumps(call.input)}}]},
            {"role": "tool", "tool_call_id": call.id, "content": "12 degrees, rain"},
            {"role": "user", "content": "Thanks."}]
    ids = tokenize(server, chat, [CHAT_TOOL])
    assert counted == len(ids)
    assert "<tool_response>\n12 degrees, rain\n</tool_response>" in server[0].tokenizer.decode(ids)
    r = claude.messages.create(model=model, max_tokens=4, messages=history, tools=[CLAUDE_TOOL], extra_body=GREEDY)
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == counted
    assert r.usage.cache_read_input_tokens > 0   # the tools and the question were prefilled by the call
    assert claude.messages.count_tokens(model=model, messages=ask).input_tokens == len(tokenize(server, ask))


@pytest.mark.parametrize("body, fragment", [
    ({"thinking": {"type": "enabled", "budget_tokens": 0}}, "thinking.enabled.budget_tokens"),
    ({"thinking": {"type": "sometimes"}}, "thinking"),
    ({"messages": [{"role": "user", "content": [{"type": "thinking", "thinking": "x"}]}]}, "belongs in an assistant"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": [
        {"type": "redacted_thinking", "data": "x"}]}, {"role": "user", "content": "Go on"}]}, "redacted_thinking"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image blocks"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "server tool"),
    ({"tools": [CLAUDE_TOOL], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice"),
    ({"temperature": 1.5}, "temperature"),
    ({"max_tokens": None}, "max_tokens"),
    ({"mcp_servers": []}, "mcp_servers"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "x", "name": "f", "input": {}}]}]},
     "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages[0].content[0].text"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The answer is "}]},
     "cannot end with trailing whitespace"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "x", "name": "get_weather", "input": {}}]}]}, "text blocks only"),
    # a prefill with text beside a tool_use or thinking block: refused by name as well, not a 500
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": [
        {"type": "text", "text": "Checking."}, {"type": "tool_use", "id": "x", "name": "get_weather", "input": {}}]}]},
     "text blocks only; end with a user turn to send tool_use or thinking blocks"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "Oslo first.", "signature": ""}, {"type": "text", "text": "In Oslo it is"}]}]},
     "text blocks only; end with a user turn to send tool_use or thinking blocks"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "{"}], "tools": [CLAUDE_TOOL],
      "tool_choice": {"type": "any"}}, "tool_choice: shapes the whole reply, so it cannot follow a prefilled one"),
])
def test_bad_message_bodies_get_anthropic_errors(claude, model, body, fragment):
    full = {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}], **body}
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.post("/v1/messages", body=full, cast_to=httpx.Response)
    error = caught.value.body
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert fragment in error["error"]["message"]


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_raw_bad_bodies_and_keys_on_anthropic_routes(server, model, path):
    base, key = server[1], {"x-api-key": "k3y"}
    for raw in (b"{", b"[]", b'{"messages": 3}'):
        r = httpx.post(base + path, content=raw, headers={**key, "content-type": "application/json"})
        assert r.status_code == 400 and r.json()["type"] == "error", r.text
        assert r.json()["error"]["type"] == "invalid_request_error"
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}],
            **({} if path.endswith("count_tokens") else {"max_tokens": 1})}
    r = httpx.post(base + path, json={**body, "model": "claude-nope"}, headers=key)   # any name: the one engine
    assert r.status_code == 200 and r.json().get("model", model) == model, r.text
    r = httpx.post(base + path, json=body, headers={"x-api-key": "wrong"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.post(base + path, json=body, headers={"Authorization": "Bearer k3y"}).status_code == 200
    assert httpx.post(base + path, json=body, headers=key).status_code == 200


# -- OpenAI Responses ------------------------------------------------------------------------------

def test_response_is_the_chat_reply(oai, model):
    chat = chat_reply(oai, model, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}], 6)
    r = oai.responses.create(model=model, instructions="Be brief.", input="Hello", max_output_tokens=6, **GREEDY)
    assert r.object == "response" and r.id.startswith("resp_") and r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.output_tokens == chat.usage.completion_tokens == 6
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.input_tokens_details.cached_tokens > 0
    same = oai.responses.create(model=model, input=[{"role": "system", "content": "Be brief."},
                                                    {"type": "message", "role": "user",
                                                     "content": [{"type": "input_text", "text": "Hello"}]}],
                                max_output_tokens=6, **GREEDY)
    assert same.output_text == r.output_text


def test_streamed_response_reassembles(oai, model):
    kw = dict(model=model, input="Tell me a story", max_output_tokens=8, **GREEDY)
    whole = oai.responses.create(**kw)
    events = list(oai.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert events[-1].response.output_text == whole.output_text
    with oai.responses.stream(model=model, input="Tell me a story", max_output_tokens=60, **GREEDY,
                              text={"format": {"type": "json_object"}}) as stream:
        final = stream.get_final_response()
    assert final.status == "completed" and isinstance(json.loads(final.output_text), dict)


def test_function_call_then_its_output(server, oai, model):
    """A named function's call (whole and streamed), then its output sent back two ways: after
    previous_response_id, and as the whole history. Both are the same prompt, mostly cached."""
    kw = dict(model=model, input=ASK, tools=[OPENAI_TOOL], tool_choice={"type": "function", "name": "get_weather"},
              max_output_tokens=60, **GREEDY)
    r = oai.responses.create(**kw)
    assert r.status == "completed" and [item.type for item in r.output] == ["function_call"]
    call = r.output[0]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER_SCHEMA)
    events = list(oai.responses.create(**kw, stream=True))
    streamed = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert streamed == call.arguments == events[-1].response.output[0].arguments

    result = {"type": "function_call_output", "call_id": call.call_id, "output": "12 degrees, rain"}
    after = oai.responses.create(model=model, previous_response_id=r.id, input=[result], tools=[OPENAI_TOOL],
                                 max_output_tokens=4, **GREEDY)
    replayed = oai.responses.create(model=model, input=[{"role": "user", "content": ASK}, *r.output, result],
                                    tools=[OPENAI_TOOL], max_output_tokens=4, **GREEDY)
    assert after.previous_response_id == r.id and after.output_text == replayed.output_text
    assert after.usage.input_tokens == replayed.usage.input_tokens > r.usage.input_tokens
    assert after.usage.input_tokens_details.cached_tokens >= r.usage.input_tokens - 16   # all but a partial block
    chat = [{"role": "user", "content": ASK},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "12 degrees, rain"}]
    assert after.usage.input_tokens == len(tokenize(server, chat, [CHAT_TOOL]))
    assert oai.responses.retrieve(after.id).output_text == after.output_text
    oai.responses.delete(after.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(after.id)


def test_store_false_is_not_kept(oai, model):
    r = oai.responses.create(model=model, input="Hi", max_output_tokens=1, store=False)
    with pytest.raises(openai.BadRequestError) as caught:
        oai.responses.create(model=model, input="Hi", previous_response_id=r.id, max_output_tokens=1)
    assert caught.value.body["param"] == "previous_response_id" and "store" in caught.value.body["message"]


def test_parse_gives_a_pydantic_object(oai, model):
    class City(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=10)
        population_millions: int = pydantic.Field(ge=0, le=40)

    r = oai.responses.parse(model=model, input="Describe Paris.", text_format=City, max_output_tokens=40, **GREEDY)
    assert r.status == "completed" and isinstance(r.output_parsed, City)


@pytest.mark.parametrize("body, param", [
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"include": ["reasoning.encrypted_content", "file_search_call.results"]}, "include"),
    ({"reasoning": {"summary": "verbose"}}, "reasoning.summary"),
    ({"text": {"verbosity": "loud"}}, "text.verbosity"),
    ({"tools": [{"type": "teleport"}]}, "tools[0].type"),
    ({"tools": [{"type": "custom", "name": "p", "format": {"type": "grammar", "syntax": "lark",
                                                           "definition": "start: (("}}]},
     "tools[0].format.definition"),
    ({"tools": [OPENAI_TOOL, {**OPENAI_TOOL, "description": "again"}]}, "tools"),
    ({"tools": [{"type": "custom", "name": "p"}], "tool_choice": "required"}, "tool_choice"),
    ({"tools": [OPENAI_TOOL], "tool_choice": {"type": "local_shell"}}, "tool_choice"),
    ({"reasoning": {"effort": "huge"}}, "reasoning.effort"),
    ({"tools": [OPENAI_TOOL], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
    ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "gAAA"}]}, "input[0].encrypted_content"),
    ({"input": [{"type": "reasoning", "summary": [{"type": "summary_text"}]}]}, "input[0].summary[0].text"),
    ({"input": 5}, "input"),
    ({"text": {"format": {"type": "json_schema"}}}, "text.format"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"background": True}, "background"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"truncation": "auto"}, "truncation"),
])
def test_bad_response_bodies_get_openai_errors(oai, model, body, param):
    with pytest.raises(openai.BadRequestError) as caught:
        oai.post("/responses", body={"model": model, "input": "Hi", "max_output_tokens": 1, **body},
                 cast_to=httpx.Response)
    error = caught.value.body
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, error


def test_the_response_store_is_bounded():
    store = ResponseStore(capacity=2)
    for i in range(3):
        store.put(f"resp_{i}", StoredResponse({"id": f"resp_{i}"}, []))
    assert len(store) == 2 and store.get("resp_0") is None and store.get("resp_2").body == {"id": "resp_2"}
    store.put("resp_1", StoredResponse({"id": "resp_1"}, []))   # stored again: now the newest
    store.put("resp_3", StoredResponse({"id": "resp_3"}, []))
    assert store.get("resp_2") is None and store.get("resp_1") is not None
    assert store.delete("resp_1") and not store.delete("resp_1")
    with pytest.raises(ValueError, match="capacity"):
        ResponseStore(capacity=0)


def test_an_openai_agents_run_calls_its_tool_and_answers(server, model):
    """openai-agents speaks the Responses API by default: a run with a forced function tool gets a call
    whose arguments validate, runs the tool, sends its output back, and ends on the model's reply."""
    import agents

    agents.set_tracing_disabled(True)
    seen = []

    @agents.function_tool
    def get_weather(city: Annotated[str, pydantic.Field(max_length=12)], unit: Literal["celsius", "fahrenheit"]) -> str:
        """Current weather in a city."""
        seen.append((city, unit))
        return "12 degrees, rain"

    class Report(pydantic.BaseModel):
        city: str = pydantic.Field(max_length=10)
        degrees: int = pydantic.Field(ge=-40, le=40)

    client = openai.AsyncOpenAI(base_url=server[1] + "/v1", api_key="k3y", max_retries=0, timeout=120)
    agent = agents.Agent(name="weather", instructions="Answer briefly.", tools=[get_weather], output_type=Report,
                         model=agents.OpenAIResponsesModel(model, openai_client=client),
                         model_settings=agents.ModelSettings(tool_choice="get_weather", max_tokens=40, temperature=0))
    result = agents.Runner.run_sync(agent, ASK, max_turns=3)
    assert len(seen) == 1
    calls = [item for item in result.new_items if item.type == "tool_call_item"]
    outputs = [item for item in result.new_items if item.type == "tool_call_output_item"]
    assert len(calls) == 1 and outputs[0].output == "12 degrees, rain"
    # the forced turn is the call alone; the next one answers in the agent's output type
    assert isinstance(result.final_output, Report) and len(result.raw_responses) == 2
