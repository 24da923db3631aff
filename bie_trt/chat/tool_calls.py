"""Function calling in OpenAI's shape over a plain text model: tools into the prompt, the model's
reply back into tool calls, and the JSON Schemas that make `tool_choice` "required" or a named
function a grammar the sampler cannot leave.

Two reply formats are parsed, the ones instruction-tuned checkpoints are trained on: Hermes / Qwen
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` tags, and Llama-3.1 bare JSON
`{"name": ..., "parameters": {...}}` (alone, or several separated by `;`). Anything that does not
parse as a call to a known function stays prose.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import RequestError
from ..sampling_params import StructuredOutputs

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"     # Llama-3.1 may open a JSON call with it
EMPTY_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
_PROBE = "bie_trt_probe_function"


CallCheck = Callable[["ToolCall"], bool]   # whether a parsed call is one (a tool's own rule on its arguments)
# A model family's reader of a free reply: (text, the tools' names, a CallCheck) -> (prose, calls).
FreeParser = Callable[[str, "set[str] | None", "CallCheck | None"], "tuple[str | None, list[ToolCall]]"]


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str                 # JSON text, as OpenAI's function.arguments
    id: str = ""

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class ToolsError(RequestError):
    """A request's `tools` (not its tool_choice) is what is wrong."""


def parameters_of(tool: dict) -> dict:
    """A tool's parameter schema as a forced call's grammar takes it: a function without one takes no
    arguments (OpenAI's reading), and the type is "object" even where the schema leaves it open (no
    `type`, or a list holding "object"), since every API sends a call's arguments as a JSON object."""
    schema = tool["function"].get("parameters") or EMPTY_PARAMETERS
    return schema if schema.get("type") == "object" else {**schema, "type": "object"}


def _admits_objects(schema: dict) -> bool:
    kind = schema.get("type", "object")
    return kind == "object" or (isinstance(kind, list) and "object" in kind)


# -- enforcing tool_choice -------------------------------------------------------------------------

def required_schema(tools: list[dict], parallel: bool = False) -> dict:
    """The reply under tool_choice="required": a JSON array of calls, each one of the tools by name with
    arguments that match its schema; exactly one call unless parallel calls are asked for."""
    calls = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                             "parameters": parameters_of(t)},
              "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    schema: dict[str, Any] = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
                              "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def parse_required(text: str, names: set[str] | None = None) -> list[ToolCall] | None:
    """The array `required_schema` constrains the reply to -> its complete calls, up to the first repeat
    (`until_repeat`); a call that max_tokens cut mid-way is dropped. None when no call is complete or any
    complete item is not a call of one of `names` with object arguments: a reply is its calls whole,
    never the valid part of them."""
    items = _complete_items(text)
    if not items or not all(isinstance(item, dict) for item in items):
        return None
    calls = [_call(item.get("name"), item.get("parameters"), names) for item in items]
    return None if None in calls else until_repeat(calls)


def _complete_items(text: str) -> list | None:
    """The items of a JSON array that are complete, also when the text stops inside a later one; None
    when the text is no JSON array (or its items are not separated by commas)."""
    decoder, items = json.JSONDecoder(), []
    pos = _skip_space(text, 0)
    if not text.startswith("[", pos):
        return None
    pos = _skip_space(text, pos + 1)
    while pos < len(text):
        try:
            item, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:   # under the grammar, only where max_tokens cut the reply
            return items
        items.append(item)
        pos = _skip_space(text, pos)
        if text.startswith("]", pos):
            return items
        if pos < len(text) and text[pos] != ",":
            return None
        pos = _skip_space(text, pos + 1)
    return items


def _skip_space(text: str, pos: int) -> int:
    return len(text) - len(text[pos:].lstrip())


def until_repeat(calls: list[ToolCall]) -> list[ToolCall]:
    """The calls before the first that repeats an earlier one (same function, same arguments): a model
    that calls the same thing twice in one reply is looping, and the rest of its reply is the loop."""
    seen: set[tuple[str, str]] = set()
    for i, call in enumerate(calls):
        key = (call.name, json.dumps(json.loads(call.arguments), sort_keys=True))
        if key in seen:
            return calls[:i]
        seen.add(key)
    return calls


# -- parsing a free reply (tool_choice="auto") -----------------------------------------------------

def _call(name: object, arguments: object, names: set[str] | None = None) -> ToolCall | None:
    if not isinstance(name, str) or (names is not None and name not in names):
        return None
    if arguments is None:
        arguments = {}
    if isinstance(arguments, str):            # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False), new_call_id())


def _json_call(obj: object, names: set[str] | None) -> ToolCall | None:
    if not isinstance(obj, dict) or set(obj) - {"name", "arguments", "parameters", "type"}:
        return None
    return _call(obj.get("name"), obj.get("arguments", obj.get("parameters")), names)


def _bare_json_calls(text: str, names: set[str] | None, check: CallCheck | None = None) -> list[ToolCall] | None:
    """Llama-3.1's format: the whole reply is one JSON call, a list of them, or calls joined by ';'."""
    body = text.strip().removeprefix(PYTHON_TAG).strip()
    if not body.startswith(("{", "[")):
        return None
    try:
        parsed = json.loads(body)
        objs = parsed if isinstance(parsed, list) else [parsed]
    except json.JSONDecodeError:
        try:
            objs = [json.loads(part) for part in body.split(";") if part.strip()]
        except json.JSONDecodeError:
            return None
    calls = [_checked(_json_call(o, names), check) for o in objs]
    return until_repeat(calls) if calls and None not in calls else None


def _checked(call: ToolCall | None, check: CallCheck | None) -> ToolCall | None:
    return call if call is None or check is None or check(call) else None


def parse_tool_calls(text: str, names: set[str] | None = None, check: CallCheck | None = None
                     ) -> tuple[str | None, list[ToolCall]]:
    """A model's free reply -> (prose, tool calls). Hermes tags may sit among prose; a tag whose body is
    not a call to one of `names` (or not JSON, or never closed, or one `check` refuses) stays in the
    prose as written. Prose that is only whitespace is None, as OpenAI sends `content: null` beside
    tool calls."""
    bare = _bare_json_calls(text, names, check)
    if bare is not None:
        return None, bare
    prose, calls, pos = [], [], 0
    while (start := text.find(TOOL_CALL_OPEN, pos)) != -1:
        end = text.find(TOOL_CALL_CLOSE, start)
        if end == -1:
            break
        body = text[start + len(TOOL_CALL_OPEN):end]
        try:
            call = _checked(_json_call(json.loads(body), names), check)
        except json.JSONDecodeError:
            call = None
        stop = end + len(TOOL_CALL_CLOSE)
        if call is None:
            prose.append(text[pos:stop])
        else:
            prose.append(text[pos:start])
            calls.append(call)
        pos = stop
    prose.append(text[pos:])
    content = "".join(prose)
    return (content if content.strip() else None), until_repeat(calls)


# The reply formats a model family may declare (ModelFamily.tool_parser), each the reader of a free ("auto")
# reply: "hermes" reads both formats above. A reply tool_choice's grammar shapes is never handed to one.
TOOL_PARSERS: dict[str, FreeParser] = {"hermes": parse_tool_calls}


def held_back(text: str) -> int:
    """Where streamed prose must pause: the start of a Hermes tag, or of a partial one at the end
    (`<tool_c`), or 0 while the reply may still be a bare JSON call or is only whitespace so far."""
    body = text.lstrip()
    if not body or body.startswith(("{", "[")) or PYTHON_TAG.startswith(body[:len(PYTHON_TAG)]):
        return 0
    start = text.find(TOOL_CALL_OPEN)
    if start != -1:
        return start
    for k in range(min(len(TOOL_CALL_OPEN) - 1, len(text)), 0, -1):
        if TOOL_CALL_OPEN.startswith(text[-k:]):
            return len(text) - k
    return len(text)


# -- tools into the prompt -------------------------------------------------------------------------

def _probe_tool() -> dict:
    return {"type": "function", "function": {"name": _PROBE, "description": "probe",
                                             "parameters": {"type": "object", "properties": {}}}}


def template_renders_tools(tokenizer: Any) -> bool:
    """Whether the checkpoint's chat template writes `tools` into the prompt (Llama-3.1's and Qwen2.5's
    do; many small models' ignore them, and then the fallback prompt below is used)."""
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=[_probe_tool()],
                                             add_generation_prompt=True, tokenize=False)
    except Exception:   # a template that fails on tools renders none
        return False
    return _PROBE in text


def tools_prompt(tools: list[dict]) -> str:
    """A Hermes-style system prompt describing the tools and the tag format `parse_tool_calls` reads."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("You can call functions to answer the user. Their signatures, as JSON Schema, are inside "
            f"<tools></tools>:\n<tools>\n{listed}\n</tools>\n"
            "To call one, reply with a JSON object holding its name and arguments inside "
            "<tool_call></tool_call> tags, one tag per call:\n"
            '<tool_call>\n{"name": "<function name>", "arguments": {<arguments>}}\n</tool_call>')


def _tagged_call(call: dict) -> str:
    fn = call["function"]
    return f'{TOOL_CALL_OPEN}\n{json.dumps({"name": fn["name"], "arguments": fn["arguments"]}, ensure_ascii=False)}\n{TOOL_CALL_CLOSE}'


def template_messages(messages: list[dict], tools: list[dict] | None, native: bool) -> list[dict]:
    """OpenAI messages -> what the chat template gets. Tool-call arguments become objects (templates
    serialise them with `tojson`). Without `native` tool support, tools become a system prompt,
    an assistant's calls become Hermes tags in its content and tool results `<tool_response>` user
    turns, so that any template renders them."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": _arguments_object(c["function"]["arguments"])}}
                               for c in m["tool_calls"]]
        if not native:
            if m.get("tool_calls"):
                tags = "\n".join(_tagged_call(c) for c in m.pop("tool_calls"))
                m["content"] = f"{m['content']}\n{tags}" if m.get("content") else tags
            elif m["role"] == "tool":
                m = {"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
        out.append(m)
    if tools and not native:
        prompt = tools_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _arguments_object(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:   # left as sent: the template writes what the client wrote
        return arguments


# -- the reply, whole or streamed ------------------------------------------------------------------

class ReplyParser:
    """One choice's reply -> OpenAI's message (`message`) or its stream of deltas (`feed`, then `finish`).

    mode "none": all prose. "auto": the model's own call format among prose, read by `free` (the model
    family's parser). Under tool_choice's grammar the calls are taken from the grammar's structure, whatever
    the family writes: "required": the JSON array of `required_schema`; "named": the reply is the arguments
    of `function` (the object `parameters_of` constrains it to), streamed as they come.
    A stream reassembles to what `message` gives for the same text, call ids aside. `check`: a rule a
    free ("auto") reply's call must also pass to be one (a custom tool's grammar)."""

    def __init__(self, mode: str, names: set[str] | None = None, function: str | None = None,
                 check: CallCheck | None = None, free: FreeParser = parse_tool_calls):
        self.mode, self.names, self.function, self.check, self.free = mode, names, function, check, free
        self.text, self.sent, self.calls = "", 0, 0
        self._named_id = new_call_id() if mode == "named" else ""

    def message(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if self.mode == "named":   # arguments cut mid-way by max_tokens are no call
            return None, [ToolCall(self.function, text, self._named_id or new_call_id())] if _is_object(text) else []
        if self.mode == "required":
            calls = parse_required(text, self.names)
            return (text, []) if calls is None else (None, calls)
        if self.mode == "auto":
            return self.free(text, self.names, self.check)
        return text, []

    @staticmethod
    def finish_reason(reason: str | None, called: bool) -> str | None:
        """OpenAI's "tool_calls" for a reply that ended by itself with calls; a cut-short one stays "length"."""
        return "tool_calls" if called and reason == "stop" else reason

    def feed(self, delta: str) -> list[dict]:
        self.text += delta
        if self.mode == "none":
            return [{"content": delta}] if delta else []
        if self.mode == "named":
            out = [] if self.calls else [self._header(ToolCall(self.function, "", self._named_id))]
            self.calls = 1
            return out + ([_arguments_delta(0, delta)] if delta else [])
        if self.mode == "auto":
            upto = held_back(self.text)
            if upto > self.sent:
                piece, self.sent = self.text[self.sent:upto], upto
                return [{"content": piece}]
        return []

    def finish(self) -> list[dict]:
        """What the held-back tail of the reply adds once it is complete."""
        if self.mode in ("none", "named"):
            return []
        content, calls = self.message(self.text)
        out = [{"content": content[self.sent:]}] if content and len(content) > self.sent else []
        for call in calls:
            out += [self._header(call), _arguments_delta(self.calls - 1, call.arguments)]
        return out

    def _header(self, call: ToolCall) -> dict:
        self.calls += 1
        return {"tool_calls": [{"index": self.calls - 1, "id": call.id, "type": "function",
                                "function": {"name": call.name, "arguments": ""}}]}


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


def _arguments_delta(index: int, fragment: str) -> dict:
    return {"tool_calls": [{"index": index, "function": {"arguments": fragment}}]}


def resolve_tool_choice(tools: list[dict] | None, tool_choice: str | dict | None, parallel: bool = False
               ) -> tuple[str, str | None, StructuredOutputs | None]:
    """OpenAI's tools and tool_choice -> (reply mode: none, auto, required or named; the named function;
    the constraint that enforces it). `parallel`: "required" admits several calls, not exactly one."""
    if not tools:
        if tool_choice not in (None, "none"):   # OpenAI refuses "auto" without tools too
            raise RequestError(f"tool_choice {tool_choice!r} needs tools; send the functions in tools.")
        return "none", None, None
    if not all(isinstance(t, dict) and isinstance(t.get("function"), dict)
               and isinstance(t["function"].get("name"), str) for t in tools):
        raise ToolsError('each tool must be {"type": "function", "function": {"name": ..., "parameters": {...}}}.')
    for i, t in enumerate(tools):   # (OpenAI refuses these too; Anthropic's input_schema is checked on its body)
        schema = t["function"].get("parameters") or EMPTY_PARAMETERS
        if not isinstance(schema, dict) or not _admits_objects(schema):
            got = f"type {schema.get('type')!r}" if isinstance(schema, dict) else repr(schema)
            raise ToolsError(f"tools[{i}] ({t['function']['name']!r}): parameters must be a JSON Schema of type "
                             f"\"object\" (a call's arguments are a JSON object); got {got}.")
    if tool_choice in (None, "auto", "none"):
        return tool_choice or "auto", None, None
    if tool_choice == "required":
        return "required", None, StructuredOutputs(json=required_schema(tools, parallel))
    name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    if name is None:
        raise RequestError(f'tool_choice must be "none", "auto", "required" or {{"type": "function", "function": '
                           f'{{"name": ...}}}}; got {tool_choice!r}.')
    tool = next((t for t in tools if t["function"]["name"] == name), None)
    if tool is None:
        raise RequestError(f"tool_choice names function {name!r}, which is not in tools "
                           f"({sorted(t['function']['name'] for t in tools)}).")
    return "named", name, StructuredOutputs(json=parameters_of(tool))


@dataclass(frozen=True)
class ToolSetup:
    """How a chat request's tools shape its reply, resolved once on the way in: `mode` (none, auto, required,
    named), the tools as the template gets them, the constraint tool_choice implies and the named function."""

    mode: str
    tools: list[dict] | None
    constraint: StructuredOutputs | None
    function: str | None = None

    @classmethod
    def of(cls, tools: list[dict] | None, tool_choice: str | dict | None, parallel: bool = False) -> "ToolSetup":
        """OpenAI's tools and tool_choice, checked (RequestError, ToolsError for the tools themselves)."""
        mode, function, constraint = resolve_tool_choice(tools, tool_choice, parallel)
        return cls(mode, tools, constraint, function)

    def constrain(self, other: StructuredOutputs | None, field: str) -> StructuredOutputs | None:
        """The reply's one output constraint: tool_choice's (required, a named function) or `other`, the one
        the request sets elsewhere (`field` names where, for the error). Both: a RequestError naming the two.
        The server and the SDK's chat() merge them here alike."""
        if self.constraint is not None and other is not None:
            raise RequestError(f"{field} and tool_choice both constrain the output; send only one of them.")
        return self.constraint or other

    def parser(self, check: CallCheck | None = None, tool_parser: str = "hermes") -> ReplyParser:
        """A reply's parser: a free reply's calls read in the model family's format (`tool_parser`, one of
        TOOL_PARSERS); a reply tool_choice's grammar shapes read by the grammar's structure alone, so that
        a family's parser never decides what a forced call was."""
        names = {t["function"]["name"] for t in self.tools or []}
        if self.mode != "auto":
            return ReplyParser(self.mode, names, self.function, check)
        if tool_parser not in TOOL_PARSERS:
            raise ValueError(f"tool parser {tool_parser!r} is not one of {', '.join(TOOL_PARSERS)}")
        return ReplyParser(self.mode, names, self.function, check, TOOL_PARSERS[tool_parser])
