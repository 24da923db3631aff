"""Codex CLI on the Responses API, replayed from its source (tests/codex_requests.py): its request
bodies and headers through the real HTTP server on the tiny engine, each streamed reply read by Codex's
own SSE rules (`read_codex_stream`). The tiny random model makes no call of its own, so each turn that
needs one names it in tool_choice; its `apply_patch` grammar is a sub-language of Codex's (one short
delete hunk) so that a random model's patch ends, and every patch is checked against Codex's full grammar.
The template thinks (Qwen3, DeepSeek-R1 parser: the tiny model never closes the block, so a free reply is
all reasoning)."""
from __future__ import annotations

import base64
import json

import httpx
import pytest

from bie_trt import BieEngine, EngineConfig, StructuredOutputs
from bie_trt.server.app import ServerOptions
from bie_trt.server.sealing import ReasoningSeal
from codex_requests import (APPLY_PATCH_LARK, APPLY_PATCH_TOOL, ENVIRONMENT, HEADERS, SHELL_TOOL, UPDATE_PLAN_TOOL,
                            as_history, codex_body, read_codex_stream, user_message)
from test_server import serving

# Codex's apply_patch tool with a grammar whose every sentence is one of Codex's grammar's
SHORT_PATCH = dict(APPLY_PATCH_TOOL, format={"type": "grammar", "syntax": "lark", "definition":
                                             'start: "*** Begin Patch\\n*** Delete File: " NAME "\\n*** End Patch\\n"\n'
                                             'NAME: /[a-z]{1,6}\\.txt/\n'})
TOOLS = [SHELL_TOOL, SHORT_PATCH, UPDATE_PLAN_TOOL, {"type": "local_shell"}, {"type": "web_search"}]
PATCH = {"type": "custom", "name": "apply_patch"}
ASK = [user_message(ENVIRONMENT), user_message("Delete the scratch file.")]


@pytest.fixture(scope="module")
def codex_server(tiny_engine):
    engine = BieEngine(EngineConfig(engine_dir=str(tiny_engine), device="cpu", max_model_len=2048,
                                    chat_template="qwen3", reasoning_parser="deepseek_r1"))
    options = ServerOptions(reasoning_key="test-key")
    with serving(engine, options) as base:
        yield engine, base, options


def codex_turn(server, items: list[dict], **overrides):
    body = codex_body(server[0].model_name, items, TOOLS, **overrides)
    with httpx.stream("POST", server[1] + "/v1/responses", json=body, headers=HEADERS, timeout=120) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return read_codex_stream(r.iter_lines())


def prompt_tokens(server, messages: list[dict], tools: list[dict]) -> int:
    r = httpx.post(server[1] + "/tokenize", json={"messages": messages, "tools": tools})
    assert r.status_code == 200, r.text
    return r.json()["count"]


def parses_as_codex_patch(engine: BieEngine, text: str) -> bool:
    return engine.grammar_compiler().accepts(StructuredOutputs(grammar=APPLY_PATCH_LARK), text)


@pytest.fixture(scope="module")
def patch_turn(codex_server):
    return codex_turn(codex_server, ASK, tool_choice=PATCH)


def test_a_forced_patch_is_a_custom_tool_call_by_codexs_rules(codex_server, patch_turn):
    """Codex's first turn (its tools, reasoning, include, store false, verbosity, headers), the patch
    forced: a completed response with usage, one custom_tool_call whose input streamed in deltas and
    parses by Codex's own apply_patch grammar; web_search was never offered and is listed as such."""
    turn = patch_turn
    assert turn.created and turn.error is None and turn.usage["output_tokens"] > 0
    [call] = turn.items
    assert (call["type"], call["name"], call["status"]) == ("custom_tool_call", "apply_patch", "completed")
    assert call["call_id"].startswith("call_") and "".join(turn.custom_input_deltas) == call["input"]
    assert call["input"].startswith("*** Begin Patch\n*** Delete File: ")
    assert parses_as_codex_patch(codex_server[0], call["input"])
    assert not parses_as_codex_patch(codex_server[0], call["input"].replace("*** End Patch\n", ""))
    completed = turn.events[-1]["response"]
    assert completed["tools_not_offered"][0]["type"] == "web_search"
    assert [t["type"] for t in completed["tools"]] == [t["type"] for t in TOOLS]   # echoed as sent


def test_the_loop_reads_custom_and_local_shell_items_back(codex_server, patch_turn):
    """The patch's output sent back (as Codex sends it: no ids), a local_shell call forced, its output sent
    back, and the next turn answered: every item reaches the template as the chat route's tool calls and
    tool messages, token for token."""
    call = patch_turn.items[0]
    history = ASK + [as_history(call), {"type": "custom_tool_call_output", "call_id": call["call_id"],
                                        "output": "Success. Updated the following files:\nD scratch.txt\n"}]
    shell = codex_turn(codex_server, history, tool_choice={"type": "local_shell"}, max_output_tokens=24)
    [item] = shell.items
    assert item["type"] == "local_shell_call" and item["action"]["type"] == "exec"
    shell_call = {"type": "local_shell_call", "call_id": "call_ls1", "status": "completed",
                  "action": {"type": "exec", "command": ["ls", "-a"], "timeout_ms": 10000,
                             "working_directory": None, "env": {}, "user": None}}
    history += [shell_call, {"type": "local_shell_call_output", "id": "call_ls1", "output": "a.txt\n"}]
    answer = codex_turn(codex_server, history, tool_choice=PATCH)
    assert answer.error is None and answer.items[0]["type"] == "custom_tool_call"
    assert parses_as_codex_patch(codex_server[0], answer.items[0]["input"])

    from bie_trt.server.protocols.openai_responses import ResponsesRequest
    body = ResponsesRequest.model_validate(codex_body(codex_server[0].model_name, history, TOOLS))
    chat = body.chat_fields([])
    system = chat["messages"][0]["content"]
    assert system.endswith("Be concise: answer in as few words as fully answer the request.")   # verbosity low
    messages = [{"role": "system", "content": system}, *[{"role": "user", "content": t["content"][0]["text"]} for t in ASK],
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": call["call_id"], "type": "function",
                     "function": {"name": "apply_patch", "arguments": json.dumps({"input": call["input"]})}}]},
                {"role": "tool", "tool_call_id": call["call_id"],
                 "content": "Success. Updated the following files:\nD scratch.txt\n"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_ls1", "type": "function", "function": {
                        "name": "local_shell", "arguments": json.dumps({"command": ["ls", "-a"], "timeout_ms": 10000, "env": {}})}}]},
                {"role": "tool", "tool_call_id": "call_ls1", "content": "a.txt\n"}]
    assert chat["messages"] == messages
    assert answer.usage["input_tokens"] == prompt_tokens(codex_server, messages, chat["tools"])
    assert "web_search" not in json.dumps(chat["tools"])


def test_sealed_reasoning_round_trip_and_tampering(codex_server):
    """include reasoning.encrypted_content with store false: the reasoning item comes back sealed (and as
    its summary); replayed, it reaches the template as the model's own reasoning (the prompt is the
    chat route's with reasoning_content); a flipped byte, or another server's key, is a 400."""
    engine, base, _ = codex_server
    first = httpx.post(base + "/v1/responses", headers=HEADERS, json=codex_body(
        engine.model_name, ASK[1:], [], stream=False, max_output_tokens=6, temperature=0)).json()
    [reasoning] = first["output"]
    text = reasoning["content"][0]["text"]
    assert reasoning["type"] == "reasoning" and reasoning["summary"] == [{"type": "summary_text", "text": text}]
    sealed = reasoning["encrypted_content"]
    assert text and text not in sealed and ReasoningSeal("test-key").open(sealed) == text

    replay = {"type": "reasoning", "summary": [], "encrypted_content": sealed}   # Codex drops content it did not show
    history = ASK[1:] + [replay, {"type": "function_call", "call_id": "call_1", "name": "shell",
                                  "arguments": '{"command": ["ls"]}'},
                         {"type": "function_call_output", "call_id": "call_1", "output": "a.txt"}]

    def send(items):
        return httpx.post(base + "/v1/responses", headers=HEADERS, json=codex_body(
            engine.model_name, items, [SHELL_TOOL], stream=False, max_output_tokens=1, text={}))

    r = send(history)
    assert r.status_code == 200, r.text
    chat = [{"role": "system", "content": first["instructions"]}, {"role": "user", "content": "Delete the scratch file."},
            {"role": "assistant", "content": None, "reasoning_content": text, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "shell", "arguments": '{"command": ["ls"]}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "a.txt"}]
    tools = [{"type": "function", "function": {k: v for k, v in SHELL_TOOL.items() if k != "type"}}]
    assert r.json()["usage"]["input_tokens"] == prompt_tokens(codex_server, chat, tools)
    assert prompt_tokens(codex_server, chat, tools) > prompt_tokens(
        codex_server, [m if m["role"] != "assistant" else {**m, "reasoning_content": None} for m in chat], tools)

    raw = bytearray(base64.urlsafe_b64decode(sealed.removeprefix("bie1.")))
    raw[-20] ^= 0x01   # one flipped bit of the ciphertext
    flipped = "bie1." + base64.urlsafe_b64encode(bytes(raw)).decode()
    foreign = ReasoningSeal("another-server").seal(text)
    for bad in (flipped, foreign, "gAAAAABo_" + sealed[5:]):
        r = send([*history[:1], {**replay, "encrypted_content": bad}, *history[2:]])
        assert r.status_code == 400 and r.json()["error"]["param"] == "input[1].encrypted_content", r.text


def test_a_free_replys_calls_pass_their_tools_rules(codex_server):
    """tool_choice auto: a Hermes call of a custom tool is a call only when its input parses by the tool's
    grammar, a local_shell call only when its arguments are an exec action; otherwise the text stays prose."""
    from bie_trt.server.protocols.openai_responses import ResponsesRequest
    from bie_trt.chat.tool_calls import ToolSetup

    box = ResponsesRequest.model_validate(codex_body("m", ASK, [APPLY_PATCH_TOOL, {"type": "local_shell"}])).toolbox()
    plan = ToolSetup("auto", box.chat_tools(), None)
    parser = plan.parser(box.check(codex_server[0].grammar_compiler().accepts))

    def tagged(name: str, arguments: dict) -> str:
        return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'

    patch = "*** Begin Patch\n*** Add File: a.txt\n+a\n*** End Patch\n"
    good = [tagged("apply_patch", {"input": patch}), tagged("local_shell", {"command": ["ls"]})]
    bad = [tagged("apply_patch", {"input": "*** Begin Patch\nrm -rf /\n"}), tagged("local_shell", {"command": "ls"}),
           tagged("apply_patch", {"input": patch, "extra": 1})]
    prose, calls = parser.message("Done.\n" + "\n".join(good + bad))
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("apply_patch", {"input": patch}),
                                                                  ("local_shell", {"command": ["ls"]})]
    assert prose.startswith("Done.") and all(b in prose for b in bad) and not any(g in prose for g in good)


def test_a_streamed_free_reply_is_reasoning_with_its_summary(codex_server):
    """A free turn (the tiny model only reasons): reasoning_text and reasoning_summary_text deltas, the
    item sealed; cut by max_output_tokens it ends `incomplete`, which Codex reads as a failed turn."""
    turn = codex_turn(codex_server, ASK, max_output_tokens=4, temperature=0)
    [item] = turn.items
    assert item["type"] == "reasoning" and item["encrypted_content"].startswith("bie1.")
    assert "".join(turn.reasoning_deltas) == "".join(turn.summary_deltas) == item["summary"][0]["text"]
    assert turn.error == "stream closed before response.completed"
    assert turn.events[-1]["type"] == "response.incomplete"


def test_a_free_replys_calls_stream_as_codex_reads_them():
    """The events of a free reply that calls apply_patch and local_shell on its own (the tiny model never
    does, so the reply text is fed to the renderer in pieces): Codex parses each done item, the custom
    call's input deltas rebuild its input, and the items are those the whole reply renders."""
    from bie_trt.chat.reply_processor import ReplyProcessor
    from bie_trt.server.reply_blocks import BlockStream, reply_blocks
    from bie_trt.server.responses import Rendering
    from bie_trt.server.protocols.openai_responses import ResponsesRequest
    from bie_trt.chat.tool_calls import ToolSetup

    box = ResponsesRequest.model_validate(codex_body("m", ASK, TOOLS)).toolbox()
    plan = ToolSetup("auto", box.chat_tools(), None)
    patch = "*** Begin Patch\n*** Delete File: a.txt\n*** End Patch\n"
    text = ('Deleting it.\n<tool_call>\n{"name": "apply_patch", "arguments": ' + json.dumps({"input": patch})
            + '}\n</tool_call>\n<tool_call>\n{"name": "local_shell", "arguments": {"command": ["ls"]}}\n</tool_call>')
    rendering, stream = Rendering("resp_x", box), BlockStream(ReplyProcessor(plan.parser(), None))
    events = []
    for i in range(0, len(text), 7):
        for event in stream.feed(text[i:i + 7], final=i + 7 >= len(text)):
            events += rendering.events(event, "completed")
    events.append({"type": "response.completed", "response": {"id": "resp_x", "usage": {
        "input_tokens": 1, "output_tokens": 1, "total_tokens": 2}}})
    turn = read_codex_stream("data: " + json.dumps(e) for e in events)
    assert turn.error is None and [i["type"] for i in turn.items] == ["message", "custom_tool_call", "local_shell_call"]
    assert "".join(turn.custom_input_deltas) == turn.items[1]["input"] == patch
    assert turn.items[2]["action"] == {"type": "exec", "command": ["ls"], "timeout_ms": None,
                                       "working_directory": None, "env": {}, "user": None}
    whole = [rendering.item(b, "completed") for b in reply_blocks(ReplyProcessor(plan.parser(), None), text)]
    strip = ("id", "call_id")
    assert [{k: v for k, v in i.items() if k not in strip} for i in turn.items] == \
        [{k: v for k, v in i.items() if k not in strip} for i in whole]


def test_a_stream_that_fails_ends_with_response_failed(codex_server):
    """A turn the server's --request-timeout cuts once streaming has begun ends with response.failed, the
    event Codex reads the failure from (its error's message)."""
    options = codex_server[2]
    options.request_timeout = 0.3
    try:
        turn = codex_turn(codex_server, ASK, max_output_tokens=400)
    finally:
        options.request_timeout = None
    failed = turn.events[-1]
    assert failed["type"] == "response.failed" and failed["response"]["status"] == "failed"
    assert failed["response"]["error"]["code"] == "timeout" and "--request-timeout" in turn.error


def test_a_tool_whose_type_is_not_a_string_is_a_400(codex_server):
    """A tool type that is a list or an object names no tool: refused, naming the field (a set lookup of the
    unhashable value once answered 500)."""
    engine, base, _ = codex_server
    for kind in ([], {"name": "shell"}, 3):
        r = httpx.post(base + "/v1/responses", json={"model": engine.model_name, "input": "hi", "max_output_tokens": 1,
                                                     "tools": [{"type": kind}]}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("tools[0]"), r.text
