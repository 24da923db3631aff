"""Claude Code and OpenCode, replayed as they really call, through the real HTTP server on the tiny engine
under the shipped Qwen3 template, each reply judged by the parser that agent uses.

The request shapes come from the agents' published traffic and source: Claude Code (the `anthropic` SDK's
beta client: `POST /v1/messages?beta=true`, its `anthropic-beta` / `x-app` headers, system blocks with
cache_control, tools with draft-07 input schemas, `metadata.user_id`, `max_tokens: 32000`, `thinking`
with a budget, `stream: true`; its haiku side calls for the topic, with the reply prefilled by `{`; its
count_tokens) and OpenCode (the AI SDK's openai-compatible provider: `/v1/chat/completions` under the
model name the user configured, `max_tokens: 32000`, tools, `stream_options.include_usage`). Each agent
runs a full loop: the model's tool call (forced through tool_choice: the tiny random model calls nothing
by itself) comes back as `tool_use` / `tool_calls`, and the follow-up that carries its result is answered.

The context is small (704 tokens), so that a reply that runs to its end (max_tokens 32000, clamped) takes
a moment on the tiny model."""
from __future__ import annotations

import json

import anthropic
import jsonschema
import openai
import pytest

from bie_trt import BieEngine, EngineConfig
from test_server import serving

CONTEXT = 704
DRAFT_07 = "http://json-schema.org/draft-07/schema#"


def schema(properties: dict, required: list[str]) -> dict:
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False,
            "$schema": DRAFT_07}


# Claude Code's tools (names, and input schemas as its requests carry them; descriptions shortened)
CLAUDE_TOOLS = [
    {"name": "Bash", "description": "Executes a given bash command in a persistent shell session.",
     "input_schema": schema({"command": {"type": "string", "description": "The command to execute"},
                             "timeout": {"type": "number", "description": "Optional timeout in milliseconds"},
                             "description": {"type": "string", "description": "What this command does"}},
                            ["command"])},
    {"name": "Read", "description": "Reads a file from the local filesystem.",
     "input_schema": schema({"file_path": {"type": "string", "description": "The absolute path to the file"},
                             "offset": {"type": "number"}, "limit": {"type": "number"}}, ["file_path"])},
    {"name": "Edit", "description": "Performs exact string replacements in files.",
     "input_schema": schema({"file_path": {"type": "string"}, "old_string": {"type": "string"},
                             "new_string": {"type": "string"},
                             "replace_all": {"type": "boolean", "default": False}},
                            ["file_path", "old_string", "new_string"])},
]
CLAUDE_HEADERS = {"anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,"
                                    "fine-grained-tool-streaming-2025-05-14,context-management-2025-06-27",
                  "x-app": "cli", "user-agent": "claude-cli/2.0.14 (external, cli)",
                  "anthropic-dangerous-direct-browser-access": "true"}
CLAUDE_SYSTEM = [
    {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude.",
     "cache_control": {"type": "ephemeral"}},
    {"type": "text", "text": "You are an interactive CLI tool that helps users with software engineering tasks. "
                             "Use the instructions below and the tools available to you to assist the user.",
     "cache_control": {"type": "ephemeral"}}]
CLAUDE_ASK = [{"role": "user", "content": [
    {"type": "text", "text": "<system-reminder>\nAs you answer the user's questions, you can use this context.\n"
                             "</system-reminder>"},
    {"type": "text", "text": "Why does the test suite fail?", "cache_control": {"type": "ephemeral"}}]}]
CLAUDE_MAIN = dict(model="claude-sonnet-4-5-20250929", max_tokens=32000, system=CLAUDE_SYSTEM, tools=CLAUDE_TOOLS,
                   metadata={"user_id": "user_2f1c0e_account__session_6a4e1c2b-0d7f-4f0e-9a53-3b0c3c2f8d11"},
                   thinking={"type": "enabled", "budget_tokens": 31999},
                   context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
                   extra_headers=CLAUDE_HEADERS, extra_body={"temperature": 0})

# OpenCode's tools, as the AI SDK's openai-compatible provider sends them
OPENCODE_TOOLS = [
    {"type": "function", "function": {"name": "bash", "description": "Executes a bash command",
                                      "parameters": schema({"command": {"type": "string"},
                                                            "description": {"type": "string"}},
                                                           ["command", "description"])}},
    {"type": "function", "function": {"name": "read", "description": "Reads a file",
                                      "parameters": schema({"filePath": {"type": "string"},
                                                            "offset": {"type": "number"}}, ["filePath"])}},
    {"type": "function", "function": {"name": "todoread", "description": "Use this tool to read your todo list",
                                      "parameters": schema({}, [])}},
]
OPENCODE_SYSTEM = [{"role": "system", "content": "You are opencode, an agent - please keep going until the user's "
                                                 "query is completely resolved."},
                   {"role": "system", "content": "Here is some useful information about the environment you are "
                                                 "running in:\n<env>\n  Platform: linux\n</env>"}]


@pytest.fixture(scope="module")
def served(tiny_engine):
    engine = BieEngine(EngineConfig(engine_dir=str(tiny_engine), device="cpu", max_model_len=CONTEXT,
                                    chat_template="qwen3"))
    with serving(engine) as base:
        yield engine, base


@pytest.fixture(scope="module")
def claude(served):
    # Claude Code's beta client calls /v1/messages?beta=true with its own key header
    return anthropic.Anthropic(base_url=served[1], api_key="sk-ant-unused", max_retries=0, timeout=120)


def tool_input_valid(tools: list[dict], name: str, arguments: dict) -> None:
    spec = next(t for t in tools if t["name"] == name)
    jsonschema.validate(arguments, spec["input_schema"])


def test_claude_code_loop_tool_use_then_its_result(served, claude):
    """The main turn streamed (thinking with Claude Code's budget, context_management), judged by the SDK's
    stream accumulator; the model's Bash/Read/Edit call (forced) is a tool_use whose input fits its schema;
    the follow-up carrying the tool_result is answered; count_tokens counts the first turn's prompt."""
    engine = served[0]
    with claude.beta.messages.stream(**CLAUDE_MAIN, messages=CLAUDE_ASK, tool_choice={"type": "any"}) as stream:
        kinds = [e.type for e in stream]
        first = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert first.model == engine.model_name and first.stop_reason == "tool_use"
    assert first.context_management.applied_edits == []   # keep "all": nothing to clear
    call = first.content[-1]
    assert call.type == "tool_use" and call.id.startswith("toolu_")
    tool_input_valid(CLAUDE_TOOLS, call.name, call.input)
    counted = claude.beta.messages.count_tokens(model="claude-sonnet-4-5-20250929", system=CLAUDE_SYSTEM,
                                                tools=CLAUDE_TOOLS, messages=CLAUDE_ASK, betas=["token-counting-2024-11-01"],
                                                thinking=CLAUDE_MAIN["thinking"], extra_headers=CLAUDE_HEADERS)
    assert counted.input_tokens == first.usage.input_tokens + first.usage.cache_read_input_tokens
    follow = CLAUDE_ASK + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                      "content": "FAILED tests/test_x.py::test_y - AssertionError"}]}]
    with claude.beta.messages.stream(**CLAUDE_MAIN, messages=follow) as stream:
        answer = stream.get_final_message()
    assert answer.stop_reason in ("end_turn", "max_tokens") and answer.content
    assert all(b.type in ("text", "thinking", "tool_use") for b in answer.content)
    assert answer.usage.cache_read_input_tokens > 0   # the first turn's prompt was served from the cache
    used = answer.usage.input_tokens + answer.usage.cache_read_input_tokens + answer.usage.output_tokens
    assert answer.stop_reason == "end_turn" or used == CONTEXT   # 32000 clamped to what the context left


def test_claude_code_side_calls(served, claude):
    """The haiku side calls: the quota probe (max_tokens 1) and the topic check, whose reply is prefilled by
    `{` and comes back as the rest of the JSON text the model writes after it."""
    quota = claude.messages.create(model="claude-3-5-haiku-20241022", max_tokens=1, extra_headers=CLAUDE_HEADERS,
                                   messages=[{"role": "user", "content": "quota"}],
                                   metadata={"user_id": CLAUDE_MAIN["metadata"]["user_id"]})
    assert quota.stop_reason == "max_tokens" and quota.usage.output_tokens == 1
    topic = claude.messages.create(
        model="claude-3-5-haiku-20241022", max_tokens=16, extra_body={"temperature": 0}, extra_headers=CLAUDE_HEADERS,
        system=[{"type": "text", "text": "Analyze if this message indicates a new conversation topic. Format your "
                                         "response as a JSON object with two fields: 'isNewTopic' (boolean) and "
                                         "'title' (string, or null if isNewTopic is false)."}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "Why does the test suite fail?"}]},
                  {"role": "assistant", "content": [{"type": "text", "text": "{"}]}])
    assert topic.model == served[0].model_name and [b.type for b in topic.content] == ["text"]
    assert topic.usage.output_tokens == 16 and topic.stop_reason == "max_tokens"


def opencode_client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served[1] + "/v1", api_key="opencode", max_retries=0, timeout=120,
                         default_headers={"User-Agent": "opencode/0.15.0 ai-sdk/provider-utils/3.0.9"})


def test_opencode_loop_tool_calls_then_the_result(served):
    """OpenCode's turn (its own model name, max_tokens 32000, tools, usage in the stream), judged by the
    openai client's chat stream accumulator; the forced call is a tool_calls entry whose arguments fit
    its schema; the follow-up carrying the tool message is answered, the usage chunk last."""
    client = opencode_client(served)
    ask = OPENCODE_SYSTEM + [{"role": "user", "content": "Why does the test suite fail?"}]
    kw = dict(model="llama3.1:8b", max_tokens=32000, temperature=0, tools=OPENCODE_TOOLS,
              stream_options={"include_usage": True})
    # forced by name (the AI SDK's toolChoice {type: "tool"}): a tool without arguments, since the tiny random
    # model, greedy, never ends a free string argument (under "required" it writes bash's command forever)
    named = {"type": "function", "function": {"name": "todoread"}}
    with client.chat.completions.stream(messages=ask, tool_choice=named, **kw) as stream:
        for _ in stream:
            pass
        first = stream.get_final_completion()
    choice = first.choices[0]
    assert first.model == served[0].model_name and choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    spec = next(t["function"] for t in OPENCODE_TOOLS if t["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), spec["parameters"])
    follow = ask + [{"role": "assistant", "content": choice.message.content,
                     "tool_calls": [{"id": call.id, "type": "function", "function": {
                         "name": call.function.name, "arguments": call.function.arguments}}]},
                    {"role": "tool", "tool_call_id": call.id, "content": "FAILED tests/test_x.py::test_y"}]
    chunks = list(client.chat.completions.create(messages=follow, tool_choice="auto", stream=True, **kw))
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens > first.usage.prompt_tokens
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish in (["stop"], ["length"], ["tool_calls"])
    usage = chunks[-1].usage
    assert finish != ["length"] or usage.prompt_tokens + usage.completion_tokens == CONTEXT
