"""The request bodies of Anthropic's Messages API (POST /v1/messages and /v1/messages/count_tokens),
checked as strictly as the OpenAI bodies, and their one conversion into the chat request the chat
route runs: `system` and the messages' text, thinking, tool_use and tool_result blocks into chat
messages, `tools` into functions, `tool_choice` into OpenAI's, `thinking` into the chat template's
thinking switch, `output_config.format` into a JSON-schema response format. A field this server does
not implement is refused by name."""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Union

from pydantic import ConfigDict, Field, ValidationInfo, field_validator, model_validator

from ..context_edits import ContextManagement
from .openai import NAME_PATTERN, _Strict, text_shorthand

CacheControl = dict[str, Any] | None   # accepted everywhere: the prefix cache reuses every prompt on its own
# Anthropic's union fields (the ones a body's own union, not a tagged list, carries) and what they accept.
SHAPES = {"tool_choice": "{\"type\": \"auto\"}, {\"type\": \"any\"}, {\"type\": \"tool\", \"name\": ...} or "
                        "{\"type\": \"none\"}"}


def _as_text_blocks(value: Any, what: str) -> Any:
    return text_shorthand(value, "text", what)


class TextBlock(_Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControl = None
    citations: list[Any] | None = None

    @field_validator("citations")
    @classmethod
    def _no_citations(cls, citations: list | None) -> list | None:
        if citations:
            raise ValueError("are not supported: this server does not cite documents")
        return citations


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl = None


class ThinkingBlock(_Strict):
    """An earlier reply's reasoning, sent back (as Anthropic asks when a turn used tools): the chat
    template decides whether the model sees it (Qwen3's shows it only after the last user turn)."""
    type: Literal["thinking"]
    thinking: str
    signature: str = ""      # this server signs nothing; what a client sends back is not checked
    cache_control: CacheControl = None


class ToolReferenceBlock(_Strict):
    """A tool search's result naming a deferred tool (Anthropic's tool search): from this turn on, the tool
    is offered to the model with the others (`MessagesBody.offered_tools`)."""
    type: Literal["tool_reference"]
    tool_name: str
    cache_control: CacheControl = None

    @property
    def text(self) -> str:
        return f"Tool {self.tool_name} loaded: it is now in your tool list.\n"


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: list[Annotated[Union[TextBlock, ToolReferenceBlock], Field(discriminator="type")]] = \
        Field(default_factory=list)
    is_error: bool = False
    cache_control: CacheControl = None

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, value: Any) -> Any:
        return _as_text_blocks(value, "text blocks")

    def text(self) -> str:
        body = "".join(b.text for b in self.content)
        return f"Error: {body}" if self.is_error else body   # the model is told the tool failed

    def references(self) -> list[str]:
        return [b.tool_name for b in self.content if b.type == "tool_reference"]


class RefusedBlock(_Strict):
    """Content the model cannot read here (images, documents) or that needs a feature this server has not."""
    model_config = ConfigDict(extra="allow")
    type: Literal["image", "document", "search_result", "redacted_thinking", "server_tool_use",
                  "web_search_tool_result", "web_fetch_tool_result", "code_execution_tool_result",
                  "container_upload", "mcp_tool_use", "mcp_tool_result"]

    @model_validator(mode="after")
    def _refuse(self) -> RefusedBlock:
        if self.type == "redacted_thinking":
            raise ValueError("redacted_thinking blocks are not supported: this server never writes them (they "
                             "carry another service's encrypted reasoning); leave them out of the history")
        if self.type in ("image", "document", "search_result"):
            raise ValueError(f"{self.type} blocks are not supported: this server reads text only")
        raise ValueError(f"{self.type} blocks are not supported: this server runs no server tools")


ContentBlock = Annotated[Union[TextBlock, ThinkingBlock, ToolUseBlock, ToolResultBlock, RefusedBlock],
                         Field(discriminator="type")]
BLOCK_TYPES = {"text", "thinking", "tool_use", "tool_result"} | set(RefusedBlock.model_fields["type"].annotation.__args__)


class AnthropicMessage(_Strict):
    """A turn. A `system` turn (Claude Code's per-turn control) is text the chat template places where it
    occurs in the conversation, as a system message there; the `system` field stays the prompt's head."""
    role: Literal["user", "assistant", "system"]
    content: list[ContentBlock] = Field(min_length=1)

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, value: Any) -> Any:
        return _as_text_blocks(value, "content blocks")

    @field_validator("content")
    @classmethod
    def _blocks_in_their_role(cls, content: list, info: ValidationInfo) -> list:
        role = info.data.get("role")
        for i, block in enumerate(content):
            if role == "system" and block.type != "text":
                raise ValueError(f"[{i}] is a {block.type} block; a system message holds text blocks only")
            if (block.type, role) in (("tool_use", "user"), ("thinking", "user"), ("tool_result", "assistant")):
                where = "a user" if block.type == "tool_result" else "an assistant"
                raise ValueError(f"[{i}] is a {block.type} block, which belongs in {where} message")
        return content


class AnthropicTool(_Strict):
    type: str | None = None
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    input_schema: dict[str, Any]
    strict: bool | None = None     # the schema is always enforced when the tool is forced
    cache_control: CacheControl = None
    # Anthropic's tool search: a deferred tool is left out of the prompt until a tool_reference names it
    defer_loading: bool = False

    @field_validator("type")
    @classmethod
    def _client_tools_only(cls, kind: str | None) -> str | None:
        if kind not in (None, "custom"):
            raise ValueError(f"{kind!r} is a server tool, which this server does not run; send client tools "
                             f"({{\"name\", \"description\", \"input_schema\"}}) and run them yourself")
        return kind

    @field_validator("input_schema")
    @classmethod
    def _object_schema(cls, schema: dict) -> dict:
        if schema.get("type") != "object":
            raise ValueError("must be a JSON Schema of type \"object\" (a tool's input is an object)")
        return schema


class ToolChoiceAuto(_Strict):
    type: Literal["auto"]
    disable_parallel_tool_use: bool = False


class ToolChoiceAny(_Strict):
    type: Literal["any"]
    disable_parallel_tool_use: bool = False


class ToolChoiceTool(_Strict):
    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool = False


class ToolChoiceNone(_Strict):
    type: Literal["none"]


ToolChoice = Annotated[Union[ToolChoiceAuto, ToolChoiceAny, ToolChoiceTool, ToolChoiceNone],
                       Field(discriminator="type")]


class JsonOutputFormat(_Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


# output_config.effort -> the thinking budget (tokens of reasoning before the engine closes the block itself),
# the same steps as the Responses API's reasoning.effort; "max" leaves the thinking unbounded. The budget acts
# inside a thinking block only: a template that does not think writes none, and its reply is the same at
# every level.
EFFORT_BUDGETS = {"low": 1024, "medium": 2048, "high": 4096, "xhigh": 8192, "max": None}


class OutputConfig(_Strict):
    format: JsonOutputFormat | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None


class ThinkingOff(_Strict):
    type: Literal["disabled"]


# `display`: "summarized" returns the reasoning (this server has no summariser: the reasoning itself),
# "omitted" returns each thinking block empty (the model still thinks; the client is sent no text of it).
Display = Literal["summarized", "omitted"] | None


class ThinkingAdaptive(_Strict):
    """The model decides whether and how long it thinks (within max_tokens), as a Qwen3 does."""
    type: Literal["adaptive"]
    display: Display = None


class ThinkingBudget(_Strict):
    """Thinking on, its reasoning bounded: the engine closes the block itself after budget_tokens tokens.
    Anthropic's floor of 1024 is not applied: a local model's context may hold far less."""
    type: Literal["enabled"]
    budget_tokens: int = Field(ge=1)
    display: Display = None


Thinking = Annotated[Union[ThinkingOff, ThinkingAdaptive, ThinkingBudget], Field(discriminator="type")]


class Metadata(_Strict):
    user_id: str | None = None


class MessagesBody(_Strict):
    """What a Messages request and a count_tokens request share: the prompt and the tools."""
    model: str | None = None     # Anthropic's clients always send it; absent means the served model
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    cache_control: CacheControl = None
    context_management: ContextManagement | None = None   # edits to the history before the prompt is made

    @field_validator("messages")
    @classmethod
    def _a_prefill_is_text(cls, messages: list[AnthropicMessage]) -> list[AnthropicMessage]:
        """A last assistant turn is the start of the reply (a prefill), which the model continues: text only,
        without trailing whitespace, as Anthropic's API requires."""
        last = messages[-1] if messages else None
        if last is not None and last.role == "assistant":
            where = f"[{len(messages) - 1}]"
            if any(b.type != "text" for b in last.content):
                raise ValueError(f"{where} is a prefilled reply (the last turn is the assistant's), which may hold "
                                 f"text blocks only; end with a user turn to send tool_use or thinking blocks")
            if "".join(b.text for b in last.content) != "".join(b.text for b in last.content).rstrip():
                raise ValueError(f"{where}: the final assistant content cannot end with trailing whitespace")
        return messages

    @field_validator("tool_choice", "output_config")
    @classmethod
    def _not_with_a_prefill(cls, value: Any, info: ValidationInfo) -> Any:
        messages = info.data.get("messages") or []
        shapes = isinstance(value, (ToolChoiceAny, ToolChoiceTool)) or \
            (isinstance(value, OutputConfig) and value.format is not None)
        if shapes and messages and messages[-1].role == "assistant":
            raise ValueError("shapes the whole reply, so it cannot follow a prefilled one (the last turn is the "
                             "assistant's); leave out one of them")
        return value

    def prefilled(self) -> bool:
        return self.messages[-1].role == "assistant"

    @field_validator("system", mode="before")
    @classmethod
    def _system(cls, value: Any) -> Any:
        return None if value is None else _as_text_blocks(value, "text blocks")

    @field_validator("tool_choice")
    @classmethod
    def _choice_among_tools(cls, choice: Any, info: ValidationInfo) -> Any:
        tools = info.data.get("tools") or []
        if isinstance(choice, ToolChoiceTool) and choice.name not in [t.name for t in tools]:
            raise ValueError(f"names tool {choice.name!r}, which is not in tools {[t.name for t in tools]}")
        if isinstance(choice, (ToolChoiceAny, ToolChoiceTool)) and not tools:
            raise ValueError("needs tools: send the tools the model may call")
        return choice

    @property
    def thinking_omitted(self) -> bool:
        return getattr(self.thinking, "display", None) == "omitted"

    def offered_tools(self) -> list[AnthropicTool]:
        """The tools the prompt shows, in their order: all but the deferred ones, and of those the ones a
        tool search result has named (a tool_reference in any tool_result so far) or tool_choice names."""
        named = {name for m in self.messages if m.role == "user" for b in m.content if b.type == "tool_result"
                 for name in b.references()}
        if isinstance(self.tool_choice, ToolChoiceTool):
            named.add(self.tool_choice.name)
        return [t for t in self.tools or [] if not t.defer_loading or t.name in named]

    def thinking_budget(self) -> int | None:
        """budget_tokens when given, else output_config.effort's budget (EFFORT_BUDGETS)."""
        if isinstance(self.thinking, ThinkingBudget):
            return self.thinking.budget_tokens
        effort = self.output_config.effort if self.output_config is not None else None
        return None if effort is None else EFFORT_BUDGETS[effort]

    def chat_fields(self) -> dict[str, Any]:
        """The chat body this request is: messages, tools, tool_choice and the response format."""
        fields: dict[str, Any] = {"model": self.model, "messages": chat_messages(self.system, self.messages),
                                  "continue_final_message": self.prefilled()}
        if self.thinking is not None:   # the switch thinking templates read (Qwen3's); others ignore it
            fields["chat_template_kwargs"] = {"enable_thinking": self.thinking.type != "disabled"}
        if (budget := self.thinking_budget()) is not None and not isinstance(self.thinking, ThinkingOff):
            fields["thinking_token_budget"] = budget
        if offered := self.offered_tools():
            fields["tools"] = [{"type": "function", "function": {
                "name": t.name, "parameters": t.input_schema,
                **({"description": t.description} if t.description is not None else {})}} for t in offered]
        choice = self.tool_choice
        if choice is not None:
            fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or {
                "type": "function", "function": {"name": choice.name}}
            if getattr(choice, "disable_parallel_tool_use", False):
                fields["parallel_tool_calls"] = False
        forced = choice is not None and choice.type in ("any", "tool")
        if self.output_config is not None and self.output_config.format is not None and not forced:
            # a forced call is the whole reply: no text for the format to shape on this turn
            fields["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "output", "schema": self.output_config.format.schema_}}
        return fields


class MessagesRequest(MessagesBody):
    max_tokens: int = Field(ge=1)
    temperature: float = Field(1.0, ge=0, le=1)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    stop_sequences: list[str] | None = None
    stream: bool = False
    # accepted and ignored: they do not change what is generated
    metadata: Metadata | None = None
    service_tier: str | None = None

    def chat_fields(self) -> dict[str, Any]:
        return {**super().chat_fields(), "max_tokens": self.max_tokens, "temperature": self.temperature,
                "top_p": self.top_p, "top_k": self.top_k, "stop": self.stop_sequences, "stream": self.stream}


class CountTokensRequest(MessagesBody):
    pass


# Claude Code opens its system prompt with a line of per-request billing data for Anthropic's servers, not for
# the model; left in, it would end the cached prefix at the prompt's first line.
BILLING_HEADER = "x-anthropic-billing-header:"


def chat_messages(system: list[TextBlock] | None, messages: list[AnthropicMessage]) -> list[dict[str, Any]]:
    """Anthropic's turns -> chat messages: the system prompt (its billing line left out) first; a system
    turn as a system message where it occurs; a user turn's tool_result blocks become tool messages (in
    their place among its text), an assistant turn's tool_use blocks its tool_calls."""
    out: list[dict[str, Any]] = []
    head = "".join(b.text for b in system or [] if not b.text.startswith(BILLING_HEADER))
    if head:
        out.append({"role": "system", "content": head})
    for m in messages:
        if m.role == "system":
            out.append({"role": "system", "content": "".join(b.text for b in m.content)})
            continue
        if m.role == "assistant":
            text = "".join(b.text for b in m.content if b.type == "text")
            reasoning = "".join(b.thinking for b in m.content if b.type == "thinking")
            calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                     for b in m.content if b.type == "tool_use"]
            out.append({"role": "assistant", "content": text or (None if calls else ""),
                        **({"reasoning_content": reasoning} if reasoning else {}),
                        **({"tool_calls": calls} if calls else {})})
            continue
        text: list[str] = []
        for b in m.content:
            if b.type == "tool_result":
                if text:
                    out.append({"role": "user", "content": "".join(text)})
                    text = []
                out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()})
            else:
                text.append(b.text)
        if text:
            out.append({"role": "user", "content": "".join(text)})
    return out
