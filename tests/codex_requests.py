"""Codex CLI's Responses requests, as its source builds them (openai/codex, codex-rs: `ResponsesApiRequest`
in codex-api/src/common.rs, the tool specs in core/src/tools, `ResponseItem` in protocol/src/models.rs,
the headers of codex-api/src/requests), and its rules for reading the stream back
(codex-api/src/sse/responses.rs `process_sse`), so the tests can send exactly what Codex sends and
judge the reply as Codex would."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

# core/src/tools/handlers/tool_apply_patch.lark, as Codex sends it in the custom tool's format.definition
APPLY_PATCH_LARK = r'''start: begin_patch hunk+ end_patch
begin_patch: "*** Begin Patch" LF
end_patch: "*** End Patch" LF?

hunk: add_hunk | delete_hunk | update_hunk
add_hunk: "*** Add File: " filename LF add_line+
delete_hunk: "*** Delete File: " filename LF
update_hunk: "*** Update File: " filename LF change_move? change?

filename: /(.+)/
add_line: "+" /(.*)/ LF -> line

change_move: "*** Move to: " filename LF
change: (change_context | change_line)+ eof_line?
change_context: ("@@" | "@@ " /(.+)/) LF
change_line: ("+" | "-" | " ") /(.*)/ LF
eof_line: "*** End of File" LF

%import common.LF
'''

APPLY_PATCH_TOOL = {
    "type": "custom", "name": "apply_patch",
    "description": "Use the `apply_patch` tool to edit files. This is a FREEFORM tool, so do not wrap the patch in JSON.",
    "format": {"type": "grammar", "syntax": "lark", "definition": APPLY_PATCH_LARK}}

SHELL_TOOL = {
    "type": "function", "name": "shell", "description": "Runs a shell command and returns its output.",
    "strict": False,
    "parameters": {"type": "object", "properties": {
        "command": {"type": "array", "items": {"type": "string"}, "description": "The command to execute"},
        "workdir": {"type": "string", "description": "The working directory to execute the command in"},
        "timeout_ms": {"type": "number", "description": "The timeout for the command in milliseconds"}},
        "required": ["command"], "additionalProperties": False}}

UPDATE_PLAN_TOOL = {
    "type": "function", "name": "update_plan", "strict": False,
    "description": "Updates the task plan.",
    "parameters": {"type": "object", "properties": {
        "explanation": {"type": "string"},
        "plan": {"type": "array", "items": {"type": "object", "properties": {
            "step": {"type": "string"}, "status": {"type": "string"}},
            "required": ["step", "status"], "additionalProperties": False}}},
        "required": ["plan"], "additionalProperties": False}}

# Codex's base instructions open like this (core/prompt.md); the test keeps the prompt short.
INSTRUCTIONS = ("You are Codex, based on GPT-5. You are running as a coding agent in the Codex CLI on a "
                "user's computer.")

ENVIRONMENT = ("<environment_context>\n  <cwd>/home/user/project</cwd>\n  <approval_policy>on-request"
               "</approval_policy>\n  <sandbox_mode>workspace-write</sandbox_mode>\n  <network_access>restricted"
               "</network_access>\n  <shell>bash</shell>\n</environment_context>")

CONVERSATION_ID = "0199a5a4-6b1e-7c52-9d3a-2f4e8c1b7a10"

# codex-api/src/requests: its client's headers on every Responses request
HEADERS = {"OpenAI-Beta": "responses=experimental", "originator": "codex_cli_rs",
           "User-Agent": "codex_cli_rs/0.46.0 (Ubuntu 24.4.0; x86_64) xterm-256color",
           "conversation_id": CONVERSATION_ID, "session_id": CONVERSATION_ID, "Accept": "text/event-stream"}


def user_message(text: str) -> dict:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def codex_body(model: str, input_items: list[dict], tools: list[dict] | None = None, **overrides) -> dict:
    """A turn as Codex sends it (a reasoning model: reasoning, include, text.verbosity set)."""
    body = {"model": model, "instructions": INSTRUCTIONS, "input": input_items,
            "tools": [SHELL_TOOL, APPLY_PATCH_TOOL, UPDATE_PLAN_TOOL, {"type": "local_shell"},
                      {"type": "web_search"}] if tools is None else tools,
            "tool_choice": "auto", "parallel_tool_calls": False,
            "reasoning": {"effort": "medium", "summary": "auto"}, "store": False, "stream": True,
            "include": ["reasoning.encrypted_content"], "prompt_cache_key": CONVERSATION_ID,
            "text": {"verbosity": "low"}}
    return {**body, **overrides}


def first_turn(model: str, **overrides) -> dict:
    return codex_body(model, [user_message(ENVIRONMENT), user_message("Add a hello.txt file.")], **overrides)


@dataclass
class CodexTurn:
    """One turn read as Codex's process_sse reads it: the items of `response.output_item.done` (each
    checked to be a ResponseItem Codex parses), the text deltas, and the completed response's id and
    usage. `error` is what Codex would fail the turn with (no response.completed, or response.failed)."""
    items: list[dict] = field(default_factory=list)
    added: list[dict] = field(default_factory=list)
    text_deltas: list[str] = field(default_factory=list)
    reasoning_deltas: list[str] = field(default_factory=list)
    summary_deltas: list[str] = field(default_factory=list)
    custom_input_deltas: list[str] = field(default_factory=list)
    created: bool = False
    response_id: str | None = None
    usage: dict | None = None
    error: str | None = None
    events: list[dict] = field(default_factory=list)


# protocol/src/models.rs: the fields each ResponseItem variant must have for Codex to parse it
ITEM_FIELDS = {"message": {"role", "content"}, "reasoning": {"summary"}, "function_call": {"name", "arguments", "call_id"},
               "custom_tool_call": {"call_id", "name", "input"}, "local_shell_call": {"status", "action"}}


def read_codex_stream(lines) -> CodexTurn:
    """An SSE body (its lines) read by Codex's rules."""
    turn, failed, completed = CodexTurn(), None, None
    for line in lines:
        if not line.startswith("data: "):
            continue
        event = json.loads(line[len("data: "):])
        turn.events.append(event)
        kind = event.get("type")
        if kind in ("response.output_item.done", "response.output_item.added"):
            item = event["item"]
            missing = ITEM_FIELDS.get(item["type"], set()) - set(item)
            assert not missing, f"Codex cannot parse {item['type']} without {missing}: {item}"
            if item["type"] == "local_shell_call":
                action = item["action"]
                assert action["type"] == "exec" and isinstance(action["command"], list)
                assert item["status"] in ("completed", "in_progress", "incomplete")
            (turn.items if kind.endswith("done") else turn.added).append(item)
        elif kind == "response.output_text.delta":
            turn.text_deltas.append(event["delta"])
        elif kind == "response.reasoning_text.delta":
            assert isinstance(event["content_index"], int)
            turn.reasoning_deltas.append(event["delta"])
        elif kind == "response.reasoning_summary_text.delta":
            assert isinstance(event["summary_index"], int)
            turn.summary_deltas.append(event["delta"])
        elif kind == "response.custom_tool_call_input.delta":
            turn.custom_input_deltas.append(event["delta"])
        elif kind == "response.created":
            turn.created = event.get("response") is not None
        elif kind == "response.failed":
            failed = (event["response"].get("error") or {}).get("message", "response.failed event received")
        elif kind == "response.completed":
            completed = event["response"]
            assert isinstance(completed["id"], str)
    if completed is None:
        turn.error = failed or "stream closed before response.completed"
    else:
        turn.response_id, turn.usage = completed["id"], completed.get("usage")
        for key in ("input_tokens", "output_tokens", "total_tokens"):   # ResponseCompletedUsage's required fields
            assert isinstance(turn.usage[key], int), turn.usage
    return turn


def as_history(item: dict) -> dict:
    """An output item as Codex sends it back in the next turn's input (its `id` is never serialized)."""
    return {k: v for k, v in item.items() if k != "id"}
