"""The request body of OpenAI's Responses API (POST /v1/responses), checked as strictly as the chat
body, and its one conversion into the chat request the chat route runs: `instructions` and the input
items (messages, reasoning, function_call, function_call_output) into chat messages, function tools
into chat tools, `text.format` into a response format. A field this server does not implement is refused by name."""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import ConfigDict, Field, ValidationInfo, field_validator, model_validator

from .protocol import NAME_PATTERN, _Strict, text_shorthand

# The Responses API's union fields and what they accept.
SHAPES = {"tool_choice": "\"none\", \"auto\", \"required\" or {\"type\": \"function\", \"name\": ...}"}


# reasoning.effort -> the thinking budget the engine enforces (tokens of reasoning before it closes the block
# itself), as LiteLLM maps effort onto Anthropic's budget_tokens; "none" switches the template's thinking off.
EFFORT_BUDGETS = {"minimal": 128, "low": 1024, "medium": 2048, "high": 4096, "xhigh": 8192}

# Fields refused unless they are left out or empty, with why.
REFUSED_WHEN_SET = {
    "include": "no extra output data (logprobs, encrypted reasoning, sources) is produced",
    "top_logprobs": "the Responses route returns no log-probabilities; use /v1/chat/completions",
    "reasoning": "summaries are not implemented (a thinking template's reasoning comes back whole, as a "
                 "reasoning item); reasoning.effort is",
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
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(_Strict):
    """An earlier reply's reasoning, replayed: its text (or, from a service that summarises, its summary)
    goes to the chat template with the assistant turn after it."""
    type: Literal["reasoning"]
    summary: list[ReasoningText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None
    id: str | None = None
    status: str | None = None

    @field_validator("encrypted_content")
    @classmethod
    def _not_encrypted(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("is not supported: this server never encrypts reasoning, and cannot read "
                             "another service's; send the reasoning's content, or leave the item out")
        return value

    def text(self) -> str:
        return "".join(p.text for p in (self.content or self.summary))


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: list[InputText]
    id: str | None = None
    status: str | None = None

    @field_validator("output", mode="before")
    @classmethod
    def _output(cls, value: Any) -> Any:
        return text_shorthand(value, "input_text", "input_text parts")


class RefusedItem(_Strict):
    model_config = ConfigDict(extra="allow")
    type: Literal["item_reference", "file_search_call", "web_search_call", "computer_call",
                  "computer_call_output", "image_generation_call", "code_interpreter_call", "local_shell_call",
                  "local_shell_call_output", "mcp_call", "mcp_list_tools", "mcp_approval_request",
                  "mcp_approval_response", "custom_tool_call", "custom_tool_call_output", "compaction"]

    @model_validator(mode="after")
    def _refuse(self) -> RefusedItem:
        if self.type == "item_reference":
            raise ValueError("item_reference items are not supported: send the items themselves, or "
                             "previous_response_id")
        raise ValueError(f"{self.type} items are not supported: this server runs function tools only")


Item = Annotated[Union[MessageItem, ReasoningItem, FunctionCallItem, FunctionCallOutputItem, RefusedItem],
                 Field(discriminator="type")]
ITEM_TYPES = ({"message", "reasoning", "function_call", "function_call_output", "input_text", "output_text",
               "refusal", "reasoning_text", "summary_text"}
              | set(RefusedItem.model_fields["type"].annotation.__args__)
              | set(RefusedPart.model_fields["type"].annotation.__args__))


class FunctionTool(_Strict):
    type: str
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None     # the schema is always enforced under tool_choice required or a named function

    @field_validator("type")
    @classmethod
    def _functions_only(cls, kind: str) -> str:
        if kind != "function":
            raise ValueError(f"{kind!r} tools are not supported: this server runs function tools only "
                             f"({{\"type\": \"function\", \"name\", \"parameters\"}})")
        return kind


class ToolChoiceFunction(_Strict):
    type: Literal["function"]
    name: str


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
    verbosity: str | None = None

    @field_validator("verbosity")
    @classmethod
    def _no_verbosity(cls, value: str | None) -> str | None:
        return _refuse_set(value, "answer-length levels are not implemented; use max_output_tokens")


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
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction | None = None
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
    reasoning: dict[str, Any] | None = None
    background: bool | None = None
    max_tool_calls: int | None = None
    # accepted and ignored: they do not change what is generated
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    service_tier: str | None = None

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
        if info.field_name == "reasoning":   # {"effort": null} asks for nothing; an effort is a budget
            _refuse_set({k: v for k, v in (value or {}).items() if v is not None and k != "effort"},
                        REFUSED_WHEN_SET["reasoning"])
            return value
        return _refuse_set(value, REFUSED_WHEN_SET[info.field_name])

    @field_validator("reasoning")
    @classmethod
    def _effort(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        effort = (value or {}).get("effort")
        if effort is not None and (not isinstance(effort, str) or effort != "none" and effort not in EFFORT_BUDGETS):
            raise ValueError(f"effort must be one of none, {', '.join(EFFORT_BUDGETS)} (got {effort!r})")
        return value

    def effort_fields(self) -> dict[str, Any]:
        """reasoning.effort as the chat body's thinking switch and budget (nothing when absent)."""
        effort = (self.reasoning or {}).get("effort")
        if effort is None:
            return {}
        if effort == "none":
            return {"chat_template_kwargs": {"enable_thinking": False}}
        return {"chat_template_kwargs": {"enable_thinking": True}, "thinking_token_budget": EFFORT_BUDGETS[effort]}

    @field_validator("tool_choice")
    @classmethod
    def _choice_among_tools(cls, choice: Any, info: ValidationInfo) -> Any:
        names = [t.name for t in info.data.get("tools") or []]
        if choice in ("required",) or isinstance(choice, ToolChoiceFunction):
            if not names:
                raise ValueError("needs tools: send the functions the model may call")
        if isinstance(choice, ToolChoiceFunction) and choice.name not in names:
            raise ValueError(f"names function {choice.name!r}, which is not in tools {names}")
        return choice

    def chat_fields(self, history: list[dict[str, Any]]) -> dict[str, Any]:
        """The chat body this request is, after `history` (the stored conversation it continues)."""
        fields: dict[str, Any] = {"model": self.model, "messages": self.messages(history),
                                  "max_tokens": self.max_output_tokens, "temperature": self.temperature,
                                  "top_p": self.top_p, "stream": self.stream, **self.effort_fields()}
        if self.tools:
            fields["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                               for t in self.tools]
        if isinstance(self.tool_choice, ToolChoiceFunction):
            fields["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            fields["tool_choice"] = self.tool_choice
        if self.parallel_tool_calls is not None:
            fields["parallel_tool_calls"] = self.parallel_tool_calls
        forced = self.tool_choice == "required" or isinstance(self.tool_choice, ToolChoiceFunction)
        if self.text is not None and self.text.format is not None and not forced:
            # a forced call is the whole reply: no message for the format to shape on this turn
            fields["response_format"] = self.text.format.response_format()
        return fields

    def messages(self, history: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """instructions (never carried over from a previous response, as OpenAI's), the history, the input."""
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        return system + history + input_messages(self.input)


def input_messages(items: list[Item]) -> list[dict[str, Any]]:
    """Input items -> chat messages: a reasoning item opens an assistant turn, which the assistant message
    and function_call items after it join (a function_call item opens one too), function_call_output
    items become tool messages."""
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
        elif item.type == "function_call":
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": "".join(p.text for p in item.output)})
    return out
