"""The Responses API's tool kinds beyond functions, as this server runs them on a text model:

- `custom` (freeform) tools: the model's input is free text, held to the tool's own grammar (Lark or a
  regex, read by llguidance) when tool_choice names the tool, and checked against it when the model
  calls the tool on its own (a call whose input does not parse stays prose). The template sees a
  function with one string parameter, `input`; the reply item is a `custom_tool_call`.
- `local_shell`: a function named `local_shell` whose arguments are the exec action's fields; the reply
  item is a `local_shell_call` with `action: {"type": "exec", "command": [...], ...}`.
- `namespace` tools (a group of functions under one name, as Codex sends its sub-agent tools): each
  function is offered under its flat name `<namespace>__<name>` (Codex's own spelling of a namespaced
  name where a boundary cannot keep the split), the namespace's description opening its description;
  the reply item is a `function_call` with the function's own `name` and its `namespace`, which is how
  Codex routes it, and a replayed call with a `namespace` reaches the template under the flat name again.
- hosted tools (web search, file search, a code interpreter, ...): OpenAI runs them on its side; this
  server cannot, so they are never offered to the model and the response lists them under
  `tools_not_offered`.
"""
from __future__ import annotations

import json
from typing import Any, Callable, Literal, Union

import jsonschema
from pydantic import Field

from ..chat.tool_calls import CallCheck, ToolCall
from ..sampling_params import StructuredOutputs
from .protocols.openai import NAME_PATTERN, _Strict

LOCAL_SHELL = "local_shell"
HOSTED_TOOLS = frozenset({
    "web_search", "web_search_preview", "web_search_2025_08_26", "web_search_preview_2025_03_11", "file_search",
    "code_interpreter", "computer_use_preview", "computer_use", "image_generation", "mcp"})
NOT_OFFERED_REASON = "a hosted tool: OpenAI runs it on its own servers, and this server cannot, so the model was not offered it"

# The exec action of a local_shell_call, as the function's parameters (OpenAI's LocalShellCallAction).
LOCAL_SHELL_PARAMETERS = {
    "type": "object",
    "properties": {
        "command": {"type": "array", "items": {"type": "string"}, "minItems": 1,
                    "description": "The program and its arguments, one string each (argv)."},
        "timeout_ms": {"type": "integer", "minimum": 1, "description": "Milliseconds the command may run."},
        "working_directory": {"type": "string", "description": "The directory to run it in."},
        "env": {"type": "object", "additionalProperties": {"type": "string"},
                "description": "Environment variables to set."},
        "user": {"type": "string", "description": "The user to run it as."}},
    "required": ["command"], "additionalProperties": False}
LOCAL_SHELL_FUNCTION = {"name": LOCAL_SHELL, "description": "Runs a command on the user's machine and returns its output.",
                        "parameters": LOCAL_SHELL_PARAMETERS}
GrammarCheck = Callable[[StructuredOutputs, str], bool]   # whether a text is a sentence of a grammar
NAMESPACE_DELIMITER = "__"
CUSTOM_PARAMETERS = {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"],
                     "additionalProperties": False}


class TextInput(_Strict):
    type: Literal["text"]


class GrammarInput(_Strict):
    type: Literal["grammar"]
    syntax: Literal["lark", "regex"]
    definition: str = Field(min_length=1)


class CustomTool(_Strict):
    type: Literal["custom"]
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    format: Union[TextInput, GrammarInput] | None = Field(None, discriminator="type")

    def grammar(self) -> dict[str, str] | None:
        """The input's grammar as vLLM's structured_outputs (None: any text)."""
        if not isinstance(self.format, GrammarInput):
            return None
        return {"grammar" if self.format.syntax == "lark" else "regex": self.format.definition}

    def constraint(self) -> StructuredOutputs | None:
        grammar = self.grammar()
        return None if grammar is None else StructuredOutputs(**grammar)

    def chat_function(self) -> dict[str, Any]:
        """The tool as the chat template gets it: a function whose one argument is the input."""
        rule = ("Its input is free text, the `input` string"
                + (f", and must follow this {self.format.syntax} grammar:\n{self.format.definition}"
                   if isinstance(self.format, GrammarInput) else "."))
        text = f"{self.description}\n\n{rule}" if self.description else rule
        return {"name": self.name, "description": text, "parameters": CUSTOM_PARAMETERS}


def flat_name(namespace: str, name: str) -> str:
    """A namespaced function's one name, as Codex joins them (underscores at the seam trimmed)."""
    return f"{namespace.rstrip('_')}{NAMESPACE_DELIMITER}{name.lstrip('_')}"


class Toolbox:
    """A request's tools by kind: the functions (a namespace's under their flat names), custom tools and
    local_shell the model is offered, and the hosted tools it is not. A name given twice (local_shell's
    and flat names included) is a ValueError."""

    def __init__(self, tools: list[Any]):
        self.namespaced = {flat_name(t.name, f.name): (t.name, f.name)
                           for t in tools if t.type == "namespace" for f in t.tools}
        self.functions = {f.name: f for t in tools for f in self._functions(t)}   # in the request's order
        self.custom = {t.name: t for t in tools if t.type == "custom"}
        self.local_shell = any(t.type == LOCAL_SHELL for t in tools)
        self.hosted = [t for t in tools if t.type not in ("function", "custom", "namespace", LOCAL_SHELL)]
        names = [t.name for t in tools if t.type in ("function", "custom")] + [LOCAL_SHELL] * self.local_shell \
            + list(self.namespaced)
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"names {twice} more than once (local_shell counts as a name); give each tool its own")

    @staticmethod
    def _functions(tool: Any) -> list[Any]:
        """A function tool itself; a namespace's functions under their flat names."""
        if tool.type == "function":
            return [tool]
        if tool.type != "namespace":
            return []
        return [f.model_copy(update={"name": flat_name(tool.name, f.name), "description": "\n\n".join(
            d for d in (tool.description, f.description) if d)}) for f in tool.tools]

    @property
    def offered(self) -> bool:
        return bool(self.functions or self.custom or self.local_shell)

    def chat_tools(self) -> list[dict[str, Any]]:
        functions = [t.model_dump(exclude={"type"}, exclude_none=True) for t in self.functions.values()]
        functions += [t.chat_function() for t in self.custom.values()]
        functions += [LOCAL_SHELL_FUNCTION] if self.local_shell else []
        return [{"type": "function", "function": f} for f in functions]

    def kind(self, name: str) -> str:
        """What a call of `name` is in the response: custom, local_shell or function."""
        if name in self.custom:
            return "custom"
        return LOCAL_SHELL if self.local_shell and name == LOCAL_SHELL else "function"

    def call_name(self, name: str) -> dict[str, str]:
        """A function call's name fields in the reply item: a namespaced function's own name and its
        namespace, any other's name alone."""
        if name in self.namespaced:
            namespace, own = self.namespaced[name]
            return {"name": own, "namespace": namespace}
        return {"name": name}

    def not_offered(self) -> list[dict[str, str]]:
        return [{"type": t.type, "reason": NOT_OFFERED_REASON} for t in self.hosted]

    def check(self, accepts: GrammarCheck) -> CallCheck:
        """The rule a free reply's call must pass: a custom tool's input is a string its grammar accepts
        (`accepts(spec, text)`), a local_shell call's arguments are an exec action."""
        def check(call: ToolCall) -> bool:
            kind = self.kind(call.name)
            if kind == "function":
                return True
            arguments = json.loads(call.arguments)
            if kind == LOCAL_SHELL:
                return jsonschema.Draft202012Validator(LOCAL_SHELL_PARAMETERS).is_valid(arguments)
            if set(arguments) != {"input"} or not isinstance(arguments["input"], str):
                return False
            spec = self.custom[call.name].constraint()
            return spec is None or accepts(spec, arguments["input"])
        return check


def call_input(arguments: str) -> str:
    """A custom call's input from its function-shaped arguments ({"input": ...})."""
    return json.loads(arguments)["input"]


def shell_action(arguments: str) -> dict[str, Any]:
    """A local_shell call's action from its arguments: OpenAI's exec action, every field present (an
    empty command while the arguments are not whole: a call cut short by the token limit, `incomplete`)."""
    try:
        given = json.loads(arguments)
    except json.JSONDecodeError:
        given = {"command": []}
    return {"type": "exec", "command": given["command"], "timeout_ms": given.get("timeout_ms"),
            "working_directory": given.get("working_directory"), "env": given.get("env", {}),
            "user": given.get("user")}
