"""The request body of OpenAI's Responses API (POST /v1/responses), checked as strictly as the chat
body, and its one conversion into the chat request the chat route runs: `instructions` (and
`text.verbosity`'s line) and the input items (messages, reasoning, function, custom-tool and local-shell
calls and their outputs) into chat messages, the tools the model can call (function, custom, local_shell;
`responses_tools` says how) into chat tools, `text.format` into a response format. Hosted tools this
server cannot run are set aside, never offered to the model. A field this server does not implement is
refused by name."""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Union

from pydantic import ConfigDict, Discriminator, Field, Tag, ValidationInfo, field_validator, model_validator

from ..responses_tools import HOSTED_TOOLS, LOCAL_SHELL, CustomTool, Toolbox, flat_name
from .openai import NAME_PATTERN, _Strict, text_shorthand

# The Responses API's union fields and what they accept.
SHAPES = {"tool_choice": "\"none\", \"auto\", \"required\", {\"type\": \"function\", \"name\": ...}, "
                         "{\"type\": \"custom\", \"name\": ...} or {\"type\": \"local_shell\"}"}

# What `include` may ask for: the reasoning item sealed for a stateless client (the module
# `sealing`). Each other value is refused by name.
INCLUDABLE = {"reasoning.encrypted_content"}

# `text.verbosity` as a line after the instructions: the model's own default length is "medium".
VERBOSITY_LINES = {"low": "Be concise: answer in as few words as fully answer the request.",
                   "medium": None,
                   "high": "Be thorough: answer in detail, explaining each step."}

# reasoning.effort -> the thinking budget the engine enforces (tokens of reasoning before it closes the block
# itself), as LiteLLM maps effort onto Anthropic's budget_tokens; "none" switches the template's thinking off.
EFFORT_BUDGETS = {"minimal": 128, "low": 1024, "medium": 2048, "high": 4096, "xhigh": 8192}

# Fields refused unless they are left out or empty, with why.
REFUSED_WHEN_SET = {
    "top_logprobs": "the Responses route returns no log-probabilities; use /v1/chat/completions",
    "background": "background responses are not implemented; stream instead",
    "max_tool_calls": "it is not implemented; set parallel_tool_calls to false for at most one call",
}


def _refuse_set(value: Any, why: str) -> Any:
    if value not in (None, False, [], {}):
        raise ValueError(f"is not supported: {why}")
    return value


class InputText(_Strict):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None     # sent back by clients that replay an output message
    logprobs: list[Any] | None = None


class Refusal(_Strict):
    type: Literal["refusal"]
    refusal: str                             # a replayed refusal; not shown to the model


class RefusedPart(_Strict):
    model_config = ConfigDict(extra="allow")
    type: Literal["input_image", "input_file", "input_audio"]

    @model_validator(mode="after")
    def _refuse(self) -> RefusedPart:
        raise ValueError(f"{self.type} parts are not supported: this server reads text only")


Part = Annotated[Union[InputText, Refusal, RefusedPart], Field(discriminator="type")]


class MessageItem(_Strict):
    type: Literal["message"]
    role: Literal["user", "assistant", "system", "developer"]
    content: list[Part]
    id: str | None = None
    status: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, value: Any) -> Any:
        return text_shorthand(value, "input_text", "input_text parts")

    def text(self) -> str:
        return "".join(p.text for p in self.content if p.type != "refusal")


class ReasoningText(_Strict):
    type: Literal["reasoning_text", "summary_text", "text"]
    text: str


class ReasoningItem(_Strict):
    """An earlier reply's reasoning, replayed: its text (or, from a service that summarises, its summary)
    goes to the chat template with the assistant turn after it. A sealed one (`encrypted_content`, from
    this server) is opened before it is read, and its sealed text is what the template gets."""
    type: Literal["reasoning"]
    summary: list[ReasoningText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return "".join(p.text for p in (self.content or self.summary))


class FunctionCallItem(_Strict):
    """An earlier reply's function call; one of a namespace's functions names its `namespace` too."""
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    namespace: str | None = None
    id: str | None = None
    status: str | None = None


class CustomToolCallItem(_Strict):
    """An earlier reply's call of a custom tool: its input as the model wrote it."""
    type: Literal["custom_tool_call"]
    call_id: str
    name: str
    input: str
    id: str | None = None
    status: str | None = None


class LocalShellAction(_Strict):
    type: Literal["exec"]
    command: list[str] = Field(min_length=1)
    timeout_ms: int | None = None
    working_directory: str | None = None
    env: dict[str, str] | None = None
    user: str | None = None


class LocalShellCallItem(_Strict):
    """An earlier reply's local_shell call (Codex sends it back without its `id`; its `call_id` answers)."""
    type: Literal["local_shell_call"]
    action: LocalShellAction
    call_id: str | None = None
    id: str | None = None
    status: str | None = None

    @model_validator(mode="after")
    def _has_an_id(self) -> LocalShellCallItem:
        if self.call_id is None and self.id is None:
            raise ValueError("local_shell_call needs its call_id (or id), which its output names")
        return self


class CallOutputItem(_Strict):
    """A tool's output: a function's and a custom tool's by `call_id`; a local shell's by `id` (OpenAI's
    documented shape) or `call_id`. The text becomes a tool message."""
    type: Literal["function_call_output", "custom_tool_call_output", "local_shell_call_output"]
    output: list[InputText]
    call_id: str | None = None
    id: str | None = None
    status: str | None = None

    @field_validator("output", mode="before")
    @classmethod
    def _output(cls, value: Any) -> Any:
        return text_shorthand(value, "input_text", "input_text parts")

    @model_validator(mode="after")
    def _names_its_call(self) -> CallOutputItem:
        if self.call_id is None and (self.type != "local_shell_call_output" or self.id is None):
            raise ValueError(f"{self.type} needs the call_id of the call it answers")
        return self


class RefusedItem(_Strict):
    model_config = ConfigDict(extra="allow")
    type: Literal["item_reference", "file_search_call", "web_search_call", "computer_call",
                  "computer_call_output", "image_generation_call", "code_interpreter_call", "mcp_call",
                  "mcp_list_tools", "mcp_approval_request", "mcp_approval_response", "compaction"]

    @model_validator(mode="after")
    def _refuse(self) -> RefusedItem:
        if self.type == "item_reference":
            raise ValueError("item_reference items are not supported: send the items themselves, or "
                             "previous_response_id")
        raise ValueError(f"{self.type} items are not supported: this server runs function, custom and "
                         f"local_shell tools only (hosted tools are never offered to the model here)")


Item = Annotated[Union[MessageItem, ReasoningItem, FunctionCallItem, CustomToolCallItem, LocalShellCallItem,
                       CallOutputItem, RefusedItem], Field(discriminator="type")]


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None     # the schema is always enforced under tool_choice required or a named function


class LocalShellTool(_Strict):
    type: Literal["local_shell"]


class NamespaceTool(_Strict):
    """Functions grouped under one name (`responses_tools` says how they are offered and called)."""
    type: Literal["namespace"]
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    tools: list[FunctionTool] = Field(min_length=1)


class HostedTool(_Strict):
    """A tool OpenAI runs on its own side (web search, file search, a code interpreter...): this server
    cannot, so it is never offered to the model; the response lists it under `tools_not_offered`."""
    model_config = ConfigDict(extra="allow")
    type: str


class UnknownTool(_Strict):
    model_config = ConfigDict(extra="allow")
    type: Any

    @field_validator("type")
    @classmethod
    def _refuse(cls, kind: Any) -> Any:
        raise ValueError(f"{kind!r} tools are not supported: send function, custom, namespace or local_shell tools "
                         f"(hosted tools: {', '.join(sorted(HOSTED_TOOLS))})")


def _tool_tag(tool: Any) -> str:
    kind = tool.get("type") if isinstance(tool, dict) else getattr(tool, "type", None)
    if not isinstance(kind, str):   # a list or an object: no tool type (and no set member: unhashable)
        return "unknown"
    if kind in ("function", "custom", "local_shell", "namespace"):
        return kind
    return "hosted" if kind in HOSTED_TOOLS else "unknown"


Tool = Annotated[Union[Annotated[FunctionTool, Tag("function")], Annotated[CustomTool, Tag("custom")],
                       Annotated[LocalShellTool, Tag("local_shell")], Annotated[NamespaceTool, Tag("namespace")],
                       Annotated[HostedTool, Tag("hosted")],
                       Annotated[UnknownTool, Tag("unknown")]], Discriminator(_tool_tag)]
ITEM_TYPES = ({"message", "reasoning", "function_call", "custom_tool_call", "local_shell_call",
               "function_call_output", "custom_tool_call_output", "local_shell_call_output", "input_text",
               "output_text", "refusal", "reasoning_text", "summary_text", "function", "custom",
               "local_shell", "namespace", "hosted", "unknown"}
              | set(RefusedItem.model_fields["type"].annotation.__args__)
              | set(RefusedPart.model_fields["type"].annotation.__args__))


class ToolChoiceFunction(_Strict):
    type: Literal["function"]
    name: str


class ToolChoiceCustom(_Strict):
    type: Literal["custom"]
    name: str


class ToolChoiceLocalShell(_Strict):
    type: Literal["local_shell"]


class ReasoningConfig(_Strict):
    """`reasoning`: `summary` returns the reasoning as the item's summary (this server has no summariser:
    the summary is the reasoning text itself, whichever level is asked); `effort` bounds the thinking
    (`EFFORT_BUDGETS`; "none" switches the template's thinking off)."""
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed", "none"] | None = None

    @property
    def summarised(self) -> bool:
        return self.summary not in (None, "none")


class TextFormat(_Strict):
    type: Literal["text", "json_schema", "json_object"]
    name: str | None = Field(None, pattern=NAME_PATTERN)
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None     # the schema is always enforced

    @model_validator(mode="after")
    def _schema_for_json_schema(self) -> TextFormat:
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            raise ValueError("json_schema needs name and schema")
        if self.type != "json_schema" and (self.name, self.schema_) != (None, None):
            raise ValueError(f"name and schema are only read with type json_schema (type is {self.type!r})")
        return self

    def response_format(self) -> dict[str, Any] | None:
        """As the chat API's response_format (None for text)."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return {"type": "json_object"}
        spec = {"name": self.name, "schema": self.schema_, "strict": self.strict, "description": self.description}
        return {"type": "json_schema", "json_schema": {k: v for k, v in spec.items() if v is not None}}


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None   # a line after the instructions: VERBOSITY_LINES


class ResponsesStreamOptions(_Strict):
    include_obfuscation: bool = False

    @field_validator("include_obfuscation")
    @classmethod
    def _no_obfuscation(cls, value: bool) -> bool:
        return _refuse_set(value, "stream events carry no obfuscation padding here (this server is on your network)")


class ResponsesRequest(_Strict):
    model: str | None = None
    input: list[Item] = Field(min_length=1)
    instructions: str | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction | ToolChoiceCustom | ToolChoiceLocalShell \
        | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    previous_response_id: str | None = None
    store: bool = True
    truncation: Literal["disabled"] | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    reasoning: ReasoningConfig | None = None
    background: bool | None = None
    max_tool_calls: int | None = None
    # accepted and ignored: they do not change what is generated
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    service_tier: str | None = None
    client_metadata: dict[str, str] | None = None   # Codex's thread and turn ids

    @field_validator("input", mode="before")
    @classmethod
    def _input(cls, value: Any) -> Any:
        """A string is one user message; a message item may leave out its type (the SDK's easy form)."""
        if isinstance(value, str):
            return [{"type": "message", "role": "user", "content": value}]
        if not isinstance(value, list):
            raise ValueError("must be a string or a list of input items")
        return [{"type": "message", **item} if isinstance(item, dict) and "role" in item and "type" not in item
                else item for item in value]

    @field_validator(*REFUSED_WHEN_SET)
    @classmethod
    def _refused_when_set(cls, value: Any, info: ValidationInfo) -> Any:
        return _refuse_set(value, REFUSED_WHEN_SET[info.field_name])

    @field_validator("include")
    @classmethod
    def _includable(cls, values: list[str] | None) -> list[str] | None:
        for value in values or []:
            if value not in INCLUDABLE:
                raise ValueError(f"{value!r} is not supported: this server produces no such data; it can include "
                                 f"{sorted(INCLUDABLE)}")
        return values

    @field_validator("tools")
    @classmethod
    def _tools_named_once(cls, tools: list[Any] | None) -> list[Any] | None:
        Toolbox(tools or [])   # raises on a name given twice
        return tools

    def effort_fields(self) -> dict[str, Any]:
        """reasoning.effort as the chat body's thinking switch and budget (nothing when absent)."""
        effort = self.reasoning.effort if self.reasoning is not None else None
        if effort is None:
            return {}
        if effort == "none":
            return {"chat_template_kwargs": {"enable_thinking": False}}
        return {"chat_template_kwargs": {"enable_thinking": True}, "thinking_token_budget": EFFORT_BUDGETS[effort]}

    @field_validator("tool_choice")
    @classmethod
    def _choice_among_tools(cls, choice: Any, info: ValidationInfo) -> Any:
        box = Toolbox(info.data.get("tools") or [])
        if choice == "required" or isinstance(choice, (ToolChoiceFunction, ToolChoiceCustom, ToolChoiceLocalShell)):
            if not box.offered:
                raise ValueError("needs tools: send the functions the model may call")
        if choice == "required" and box.custom:
            raise ValueError(f"required cannot hold custom tools ({sorted(box.custom)}) to their grammars "
                             f"alongside other calls; name the one to call ({{\"type\": \"custom\", \"name\": ...}}), "
                             f"or send auto")
        wanted = {ToolChoiceFunction: ("function", box.functions), ToolChoiceCustom: ("custom tool", box.custom)}
        if type(choice) in wanted:
            what, names = wanted[type(choice)]
            if choice.name not in names:
                raise ValueError(f"names {what} {choice.name!r}, which is not in tools {sorted(names)}")
        if isinstance(choice, ToolChoiceLocalShell) and not box.local_shell:
            raise ValueError("names local_shell, which is not in tools; send {\"type\": \"local_shell\"} in tools")
        return choice

    def toolbox(self) -> Toolbox:
        return Toolbox(self.tools or [])

    @property
    def forced_custom(self) -> CustomTool | None:
        """The custom tool tool_choice names: the whole reply is its input."""
        if isinstance(self.tool_choice, ToolChoiceCustom):
            return self.toolbox().custom[self.tool_choice.name]
        return None

    def chat_fields(self, history: list[dict[str, Any]]) -> dict[str, Any]:
        """The chat body this request is, after `history` (the stored conversation it continues). Custom and
        local_shell tools reach the template as functions (`Toolbox.chat_tools`); a named custom tool's
        reply is its input alone, held to the tool's grammar (`structured_outputs`), with the tools still
        in the prompt."""
        fields: dict[str, Any] = {"model": self.model, "messages": self.messages(history),
                                  "max_tokens": self.max_output_tokens, "temperature": self.temperature,
                                  "top_p": self.top_p, "stream": self.stream, **self.effort_fields()}
        box = self.toolbox()
        if box.offered:
            fields["tools"] = box.chat_tools()
        choice = self.tool_choice
        if isinstance(choice, ToolChoiceFunction):
            fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        elif isinstance(choice, ToolChoiceLocalShell):
            fields["tool_choice"] = {"type": "function", "function": {"name": LOCAL_SHELL}}
        elif isinstance(choice, ToolChoiceCustom):
            fields["tool_choice"] = "none"
            grammar = box.custom[choice.name].grammar()
            if grammar is not None:
                fields["structured_outputs"] = grammar
        elif choice is not None and box.offered:
            fields["tool_choice"] = choice
        if self.parallel_tool_calls is not None and box.offered:
            fields["parallel_tool_calls"] = self.parallel_tool_calls
        forced = choice not in (None, "none", "auto")
        if self.text is not None and self.text.format is not None and not forced:
            # a forced call is the whole reply: no message for the format to shape on this turn
            fields["response_format"] = self.text.format.response_format()
        return fields

    def messages(self, history: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """instructions (never carried over from a previous response, as OpenAI's) with text.verbosity's
        line, the history, the input."""
        verbosity = VERBOSITY_LINES[self.text.verbosity] if self.text and self.text.verbosity else None
        system = "\n\n".join(part for part in (self.instructions, verbosity) if part)
        return ([{"role": "system", "content": system}] if system else []) + history + input_messages(self.input)


def _call_of(item: FunctionCallItem | CustomToolCallItem | LocalShellCallItem) -> dict[str, Any]:
    """A call item as the chat tool call the model would have written (custom and local_shell calls in
    their functions' shapes, `Toolbox.chat_tools`)."""
    if item.type == "function_call":
        name = item.name if item.namespace is None else flat_name(item.namespace, item.name)
        arguments = item.arguments
    elif item.type == "custom_tool_call":
        name, arguments = item.name, json.dumps({"input": item.input}, ensure_ascii=False)
    else:
        name = LOCAL_SHELL
        arguments = json.dumps(item.action.model_dump(exclude={"type"}, exclude_none=True), ensure_ascii=False)
    return {"id": item.call_id or item.id, "type": "function", "function": {"name": name, "arguments": arguments}}


def input_messages(items: list[Item]) -> list[dict[str, Any]]:
    """Input items -> chat messages: a reasoning item opens an assistant turn, which the assistant message
    and call items (function, custom tool, local shell) after it join (a call item opens one too); their
    outputs become tool messages."""
    out: list[dict[str, Any]] = []
    for item in items:
        if item.type == "reasoning":
            out.append({"role": "assistant", "content": None, "reasoning_content": item.text()})
        elif item.type == "message":
            turn = out[-1] if out else {}
            if item.role == "assistant" and turn.get("reasoning_content") is not None and turn["content"] is None \
                    and "tool_calls" not in turn:   # the answer after its reasoning
                turn["content"] = item.text()
            else:
                out.append({"role": item.role, "content": item.text()})
        elif item.type in ("function_call", "custom_tool_call", "local_shell_call"):
            call = _call_of(item)
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            out.append({"role": "tool", "tool_call_id": item.call_id or item.id,
                        "content": "".join(p.text for p in item.output)})
    return out
