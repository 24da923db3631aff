"""The fields today's coding agents send, over real HTTP on the tiny engine, in the agents' own body shapes:
Codex CLI 0.169's Responses request (a `namespace` tool of sub-agent functions, `client_metadata`, its
`x-codex-beta-features` header, `reasoning.summary` "auto" without an effort, `include` of encrypted
reasoning, developer messages instead of instructions) and Claude Code 2.1.328's Messages request (a billing
line opening the system prompt, a `system` turn inside `messages`, a deferred tool and its ToolSearch,
adaptive thinking with `display: "omitted"`, `output_config.effort`, `clear_thinking` keeping "all",
`max_tokens: 128000`). The shapes are the ones these versions sent to `bie-trt serve` (captured by
scripts/agent_check.py), shortened.

Where a field changes the prompt, the test checks the prompt itself: the prefix cache serves a chat request
with the expected messages whole only if the agent's request before it made that very prompt, and a replayed
call's or a deferred tool's tokens show in the prompt's count. The tiny random model calls nothing by itself,
so a turn that needs a call names it in tool_choice."""
from __future__ import annotations

import json

import httpx
import pytest

from bie_trt import BieEngine, EngineConfig
from bie_trt.server.app import ServerOptions
from codex_requests import as_history, read_codex_stream, user_message
from test_server import serving

CONTEXT = 1024
BLOCK = 16   # the engine's KV block: the prefix cache serves whole blocks

# ---------------------------------------------------------------- Codex CLI 0.169

CODEX_HEADERS = {"x-codex-beta-features": "remote_compaction_v2", "originator": "codex_exec",
                 "user-agent": "codex_exec/0.169.0 (Debian 12.0.0; x86_64) xterm (codex_exec; 0.169.0)",
                 "session-id": "01a248a9-34f6-72c2-865c-6be4d29584fb", "accept": "text/event-stream"}
EXEC_COMMAND = {"type": "function", "name": "exec_command", "strict": False,
                "description": "Runs a command in a PTY, returning output or a session ID for ongoing interaction.",
                "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"],
                               "additionalProperties": False}}
MULTI_AGENT = {"type": "namespace", "name": "multi_agent_v1", "description": "Tools for spawning and managing sub-agents.",
               "tools": [{"type": "function", "name": "close_agent", "strict": False,
                          "description": "Close an agent and any open descendants.",
                          "parameters": {"type": "object", "properties": {"target": {"type": "string"}},
                                         "required": ["target"], "additionalProperties": False}},
                         {"type": "function", "name": "list_agents", "strict": False,
                          "description": "Lists the open agents.",
                          "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}]}
CODEX_TOOLS = [EXEC_COMMAND, MULTI_AGENT, {"type": "web_search", "external_web_access": False}]
CODEX_INPUT = [{"type": "message", "role": "developer", "id": "msg_5adfd8fc",
                "content": [{"type": "input_text", "text": "You are a coding agent running in the Codex CLI."}]},
               user_message("<environment_context>\n  <cwd>/tmp/w</cwd>\n</environment_context>"),
               user_message("List the open sub-agents.")]
TURN_ID = "01a248a9-3505-7890-8d23-40be39f9ef05"


def codex_body(model: str, items: list[dict], **overrides) -> dict:
    body = {"model": model, "stream": True, "input": items, "tools": CODEX_TOOLS, "tool_choice": "auto",
            "parallel_tool_calls": True, "reasoning": {"summary": "auto"}, "store": False,
            "include": ["reasoning.encrypted_content"], "prompt_cache_key": "01a248a9-34f6-72c2-865c-6be4d29584fb",
            "client_metadata": {"x-codex-installation-id": "6421c07b", "thread_id": "01a248a9-34f6",
                                "turn_id": TURN_ID, "x-codex-turn-metadata": json.dumps({"turn_id": TURN_ID})}}
    return {**body, **overrides}


@pytest.fixture(scope="module")
def served(tiny_engine):
    engine = BieEngine(EngineConfig(engine_dir=str(tiny_engine), device="cpu", max_model_len=CONTEXT,
                                    chat_template="qwen3", reasoning_parser="deepseek_r1"))
    with serving(engine, ServerOptions(reasoning_key="test-key")) as base:
        yield engine, base


def codex_turn(served, items: list[dict], **overrides):
    body = codex_body(served[0].model_name, items, **overrides)
    with httpx.stream("POST", served[1] + "/v1/responses", json=body, headers=CODEX_HEADERS, timeout=120) as r:
        assert r.status_code == 200, r.read()
        return read_codex_stream(r.iter_lines())


@pytest.fixture(scope="module")
def namespace_call(served):
    return codex_turn(served, CODEX_INPUT, tool_choice={"type": "function", "name": "multi_agent_v1__list_agents"})


def test_a_namespace_functions_call_comes_back_under_its_own_name_and_namespace(namespace_call):
    """Codex routes a call by `name` and `namespace`: the function offered as multi_agent_v1__list_agents
    comes back as list_agents in multi_agent_v1, in the item and in the arguments' done event."""
    assert namespace_call.error is None
    [call] = namespace_call.items
    assert (call["type"], call["name"], call["namespace"]) == ("function_call", "list_agents", "multi_agent_v1")
    assert json.loads(call["arguments"]) == {}
    [done] = [e for e in namespace_call.events if e["type"] == "response.function_call_arguments.done"]
    assert (done["name"], done["namespace"]) == ("list_agents", "multi_agent_v1")
    completed = namespace_call.events[-1]["response"]
    assert [t["type"] for t in completed["tools"]] == ["function", "namespace", "web_search"]
    assert completed["tools_not_offered"] == [{"type": "web_search", "reason": completed["tools_not_offered"][0]["reason"]}]


def test_a_replayed_namespace_call_reaches_the_template_under_its_flat_name(served, namespace_call):
    """The call sent back as Codex sends it (no id, with its namespace) with its output: the prompt is the
    one the flat name makes, token for token, and not the one the bare name would make."""
    call = as_history(namespace_call.items[0])
    output = {"type": "function_call_output", "call_id": call["call_id"], "output": "[]"}

    def prompt(replayed: dict) -> int:
        turn = codex_turn(served, CODEX_INPUT + [replayed, output], max_output_tokens=1)
        final = turn.events[-1]   # response.incomplete: the one token asked for
        assert final["type"] == "response.incomplete", final
        return final["response"]["usage"]["input_tokens"]

    flat = {k: v for k, v in call.items() if k != "namespace"} | {"name": "multi_agent_v1__list_agents"}
    bare = {k: v for k, v in call.items() if k != "namespace"}
    assert prompt(call) == prompt(flat) != prompt(bare)


def test_a_namespace_holds_functions_only(served):
    body = codex_body(served[0].model_name, CODEX_INPUT,
                      tools=[{**MULTI_AGENT, "tools": [{"type": "custom", "name": "patch"}]}])
    r = httpx.post(served[1] + "/v1/responses", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("tools[0]"), r.text


# ---------------------------------------------------------------- Claude Code 2.1.328

CLAUDE_HEADERS = {"anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,context-management-2025-06-27,"
                                    "mid-conversation-tool-changes-2026-07-01,advanced-tool-use-2025-11-20,"
                                    "effort-2025-11-24",
                  "x-app": "cli", "user-agent": "claude-cli/2.1.328 (external, sdk-cli)", "x-api-key": "sk-ant-unused",
                  "anthropic-version": "2023-06-01"}
HEAD = "You are a Claude agent, built on Anthropic's Claude Agent SDK."
SYSTEM = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.328.965; cc_entrypoint=sdk-cli;"},
          {"type": "text", "text": HEAD, "cache_control": {"type": "ephemeral"}}]
TASK = ("<system-reminder>\nAttribution for git commits and pull requests you create from here on.\n"
        "</system-reminder>\nRead the file hello.txt in the current directory and tell me the secret word in it.")
ENVIRONMENT = ("# Environment\nYou have been invoked in the following environment:\n - Primary working directory: "
               "/tmp/work\n - Is a git repository: false\n - Platform: linux\n - Shell: bash\n"
               "The deferred tools you can load with ToolSearch: Grep.")
OBJECT = {"$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object", "additionalProperties": False}
BASH = {"name": "Bash", "description": "Executes a given bash command.",
        "input_schema": {**OBJECT, "properties": {"command": {"type": "string"}}, "required": ["command"]}}
TOOL_SEARCH = {"name": "ToolSearch", "description": "Fetches full schema definitions for deferred tools so they can be called.",
               "input_schema": {**OBJECT, "properties": {"query": {"type": "string"}, "max_results": {"type": "number"}},
                                "required": ["query", "max_results"]}}
GREP = {"name": "Grep", "description": "Searches file contents with a regular expression.", "defer_loading": True,
        "input_schema": {**OBJECT, "properties": {"pattern": {"type": "string"}}, "required": ["pattern"]}}
PLACEHOLDER = {"name": "DeferredToolPlaceholder", "defer_loading": True,
               "description": "Reserved placeholder that keeps deferred tool loading active; never call this tool.",
               "input_schema": {"type": "object", "properties": {}}}
CLAUDE_TOOLS = [BASH, TOOL_SEARCH, GREP, PLACEHOLDER]
ASK = [{"role": "user", "content": [{"type": "text", "text": TASK}]},
       {"role": "system", "content": [{"type": "text", "text": ENVIRONMENT, "cache_control": {"type": "ephemeral"}}]}]


def claude_body(messages: list[dict], **overrides) -> dict:
    body = {"model": "claude-opus-5-5", "messages": messages, "system": SYSTEM, "tools": CLAUDE_TOOLS,
            "metadata": {"user_id": json.dumps({"device_id": "4edf6d1c", "session_id": "6f9f13ff"})},
            "max_tokens": 128000, "thinking": {"type": "adaptive", "display": "omitted"},
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            "output_config": {"effort": "high"}, "stream": True, "temperature": 0}
    return {**body, **overrides}


def as_chat_tool(tool: dict) -> dict:
    return {"type": "function", "function": {"name": tool["name"], "description": tool["description"],
                                             "parameters": tool["input_schema"]}}


def sse_events(response: httpx.Response) -> list[dict]:
    return [json.loads(line[len("data: "):]) for line in response.iter_lines() if line.startswith("data: ")]


def count(served, body: dict) -> int:
    body = {k: v for k, v in body.items() if k in ("model", "messages", "system", "tools", "thinking", "tool_choice",
                                                    "context_management", "output_config")}
    r = httpx.post(served[1] + "/v1/messages/count_tokens?beta=true", json=body, headers=CLAUDE_HEADERS, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["input_tokens"]


@pytest.fixture(scope="module")
def claude_turn(served):
    with httpx.stream("POST", served[1] + "/v1/messages?beta=true", json=claude_body(ASK), headers=CLAUDE_HEADERS,
                      timeout=300) as r:
        assert r.status_code == 200, r.read()
        return sse_events(r)


def test_claude_codes_turn_is_answered_with_its_thinking_omitted(claude_turn):
    """Adaptive thinking with display "omitted": the model still thinks (the tiny model's whole reply is an
    unclosed thinking block), the block is sent empty and no thinking delta is; max_tokens 128000 is an
    upper bound the context lowers, so the reply runs to the context's end."""
    kinds = [e["type"] for e in claude_turn]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    starts = [e["content_block"] for e in claude_turn if e["type"] == "content_block_start"]
    assert starts and starts[0] == {"type": "thinking", "thinking": "", "signature": ""}
    assert not [e for e in claude_turn if e["type"] == "content_block_delta" and e["delta"]["type"] == "thinking_delta"]
    [end] = [e for e in claude_turn if e["type"] == "message_delta"]
    usage = end["usage"]
    assert end["delta"]["stop_reason"] == "max_tokens"
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] + usage["output_tokens"] == CONTEXT
    assert end["context_management"] == {"applied_edits": []}   # keep "all": no thinking is cleared


def test_claude_codes_prompt_keeps_its_system_turn_in_place(served, claude_turn):
    """The prompt Claude Code's turn made is the chat prompt of: the system prompt without its billing line,
    the user turn, then the system turn where it occurs, with the tools that are not deferred. A chat
    request with exactly these messages is served from the prefix cache whole (all but its last block)."""
    messages = [{"role": "system", "content": HEAD}, {"role": "user", "content": TASK},
                {"role": "system", "content": ENVIRONMENT}]
    tools = [as_chat_tool(BASH), as_chat_tool(TOOL_SEARCH)]
    r = httpx.post(served[1] + "/v1/chat/completions", timeout=60, json={
        "messages": messages, "tools": tools, "max_tokens": 1, "chat_template_kwargs": {"enable_thinking": True}})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] == count(served, claude_body(ASK)) > 2 * BLOCK
    assert usage["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - BLOCK


def test_the_billing_line_is_not_in_the_prompt(served):
    """Two turns whose billing lines differ make one prompt (so the prefix cache serves the second)."""
    other = [{**SYSTEM[0], "text": "x-anthropic-billing-header: cc_version=2.1.328.e71; cc_entrypoint=cli;"}, SYSTEM[1]]
    without = [SYSTEM[1]]
    assert count(served, claude_body(ASK)) == count(served, claude_body(ASK, system=other)) \
        == count(served, claude_body(ASK, system=without))


def test_a_deferred_tool_joins_the_prompt_once_a_tool_search_names_it(served):
    """Grep is deferred: out of the prompt at first (the same count as without it), in the prompt from the
    turn whose ToolSearch result names it (a tool_reference block), as if it had never been deferred."""
    loaded = dict(GREP, defer_loading=False)
    assert count(served, claude_body(ASK)) == count(served, claude_body(ASK, tools=[BASH, TOOL_SEARCH]))
    assert count(served, claude_body(ASK)) < count(served, claude_body(ASK, tools=[BASH, TOOL_SEARCH, loaded]))
    search = ASK + [{"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_01", "name": "ToolSearch",
                                                      "input": {"query": "select:Grep", "max_results": 5}}]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01",
                                                  "content": [{"type": "tool_reference", "tool_name": "Grep"}]}]}]
    assert count(served, claude_body(search)) == count(served, claude_body(search, tools=[BASH, TOOL_SEARCH, loaded]))
    # and the model may call it now (forced here: the tiny model calls nothing by itself)
    r = httpx.post(served[1] + "/v1/messages", headers=CLAUDE_HEADERS, timeout=120, json=claude_body(
        search, stream=False, max_tokens=64, thinking={"type": "disabled"},
        tool_choice={"type": "tool", "name": "Grep"}))
    assert r.status_code == 200, r.text
    assert [b["name"] for b in r.json()["content"] if b["type"] == "tool_use"] == ["Grep"]


def test_effort_is_the_thinking_budget(served):
    """output_config.effort bounds the thinking as the Responses API's reasoning.effort does; "max" leaves it
    unbounded, budget_tokens given beside it wins. A level outside Anthropic's is a 400 naming the field."""
    from bie_trt.server.protocols.anthropic import MessagesRequest

    def budget(**fields) -> int | None:
        body = claude_body(ASK, **fields)
        return MessagesRequest.model_validate(body).chat_fields().get("thinking_token_budget")

    assert [budget(output_config={"effort": e}) for e in ("low", "medium", "high", "xhigh", "max")] == \
        [1024, 2048, 4096, 8192, None]
    assert budget(thinking={"type": "enabled", "budget_tokens": 7}, output_config={"effort": "low"}) == 7
    assert budget(thinking={"type": "disabled"}, output_config={"effort": "low"}) is None
    r = httpx.post(served[1] + "/v1/messages", headers=CLAUDE_HEADERS, timeout=60,
                   json=claude_body(ASK, stream=False, output_config={"effort": "extreme"}))
    assert r.status_code == 400 and "output_config.effort" in r.text, r.text


def test_a_system_turn_holds_text_only(served):
    bad = ASK[:1] + [{"role": "system", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "x"}]}]
    r = httpx.post(served[1] + "/v1/messages", headers=CLAUDE_HEADERS, timeout=60,
                   json=claude_body(bad, stream=False))
    assert r.status_code == 400 and "messages[1].content" in r.text, r.text



def test_a_developer_message_is_a_system_message_to_a_template_without_the_role(tiny_engine):
    """Codex sends its base prompt as a developer message; SmolLM2's template (as Qwen2.5's) has no branch
    for the role and would drop its text, so it reaches such a template as a system message, in its place.
    A template that names the role (the shipped Qwen3 one) gets it as sent."""
    from bie_trt.executor.prompt_encoder import PromptEncoder

    encoder = PromptEncoder.load(str(tiny_engine))
    assert "developer" not in encoder.tokenizer.chat_template
    ask = [{"role": "user", "content": "hi"}]
    developer = {"role": "developer", "content": "You are a coding agent running in the Codex CLI."}
    system = {**developer, "role": "system"}
    assert encoder.encode_chat([developer] + ask) == encoder.encode_chat([system] + ask) != encoder.encode_chat(ask)
    assert encoder.encode_chat(ask + [developer]) == encoder.encode_chat(ask + [system])
    qwen3 = PromptEncoder.load(str(tiny_engine), "qwen3")
    assert qwen3.encode_chat(ask + [developer]) != qwen3.encode_chat(ask + [system])
