"""The request bodies of the OpenAI API, checked strictly: a number sent as a string (`"4"`) or a bool
(`true`) is refused, not coerced; ranges are OpenAI's (temperature 0-2, penalties -2..2). A field this
server does not know is refused with its name, since it might have changed the output; the few that
never do (user, metadata, store, service_tier, ...) are accepted and ignored, as clients send them."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, field_validator

from ...chat.templates import template_kwargs_problem
from ...sampling_params import REPETITION_PENALTY_RANGE

MAX_CHOICES = 16                      # n per request: each choice is a request on the loop
SEED_RANGE = (-(2 ** 63), 2 ** 63 - 1 - MAX_CHOICES)   # choice i uses seed + i; torch takes 64-bit seeds
# message field -> (the one role that may carry it, the verb its error needs)
ROLE_OF_FIELD = {"tool_calls": ("assistant", "are"), "tool_call_id": ("tool", "is"),
                 "reasoning_content": ("assistant", "is")}
ROLES = ("system", "developer", "user", "assistant", "tool")

# Union fields get one message naming every accepted shape (pydantic reports one error per branch).
SHAPES = {
    "prompt": "a string, a list of strings, a list of token ids or a list of token-id lists",
    "stop": "a string or a list of strings",
    "content": "a string or a list of text parts ({\"type\": \"text\", \"text\": ...})",
    "tool_choice": "\"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}",
}

# Fields OpenAI or vLLM define that this server refuses, with what to send instead.
REFUSED = {
    "functions": "send tools instead (the same functions, each as {\"type\": \"function\", \"function\": {...}})",
    "function_call": "send tool_choice instead",
    "audio": "this server generates text only",
    "modalities": "this server generates text only",
    "prediction": "predicted outputs are not implemented",
    "web_search_options": "this server has no web search",
    "reasoning_effort": "effort levels are not implemented; a chat template's thinking switch is set through "
                        "chat_template_kwargs (e.g. {\"enable_thinking\": false})",
    "verbosity": "answer-length levels are not implemented; use max_tokens",
    "use_beam_search": "beam search is not implemented",
    "prompt_logprobs": "prompt log-probabilities are not computed",
}
NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"   # OpenAI's rule for function names


def _template_variables(value: Any) -> Any:
    if value is not None and (problem := template_kwargs_problem(value)):
        raise ValueError(problem)
    return value


# vLLM's chat_template_kwargs: extra variables for the chat template ({"enable_thinking": false})
TemplateKwargs = Annotated[dict[str, Any] | None, BeforeValidator(_template_variables)]


def text_shorthand(value: Any, part_type: str, what: str) -> Any:
    """Content where a string stands for one text part of `part_type` (Anthropic's and the Responses
    API's shorthand), as the list it stands for."""
    if isinstance(value, str):
        return [{"type": part_type, "text": value}]
    if not isinstance(value, list):
        raise ValueError(f"must be a string or a list of {what}")
    return value


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, populate_by_name=True)


class JsonSchemaFormat(_Strict):
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")   # OpenAI: absent means any JSON object
    strict: bool | None = None                                       # the schema is always enforced


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @field_validator("json_schema")
    @classmethod
    def _schema_for_json_schema(cls, value: Any, info: ValidationInfo) -> Any:
        if info.data.get("type") != "json_schema" and value is not None:
            raise ValueError(f"is only read with type json_schema (type is {info.data.get('type')!r})")
        return value

    def structured(self) -> dict | None:
        """As vLLM's structured_outputs: {"json": schema} or {"json_object": true}; None for text."""
        if self.type == "text":
            return None
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs json_schema: {\"name\": ..., \"schema\": {...}}")
        if self.type == "json_object" or self.json_schema.schema_ is None:
            return {"json_object": True}
        return {"json": self.json_schema.schema_}


class StructuredOutputsRequest(_Strict):
    """vLLM's structured_outputs: exactly one of these."""
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def structured(self) -> dict:
        out = self.model_dump(by_alias=True, exclude_none=True)
        if out.get("json_object") is False:
            del out["json_object"]
        return out


class FunctionDef(_Strict):
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None    # the schema is always enforced under tool_choice required or named


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class CalledFunction(_Strict):
    name: str
    arguments: str     # JSON text, as OpenAI sends it back


class MessageToolCall(_Strict):
    id: str
    type: Literal["function"]
    function: CalledFunction


class StreamOptions(_Strict):
    include_usage: bool = False


class SamplingRequest(_Strict):
    model: str | None = None
    max_tokens: int | None = Field(16, ge=1)   # None: up to the end of the context; 16 is legacy completions'
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0, le=1)
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1])
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    # token id (as a string: JSON keys are) -> bias; keys, range and vocabulary are checked where the SDK's are
    logit_bias: dict[str, float] | None = None
    min_tokens: int = Field(0, ge=0)
    # vLLM's: reasoning tokens a thinking model may write before the engine closes its block itself
    thinking_token_budget: int | None = Field(None, ge=0)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None    # vLLM's older spelling of structured_outputs
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # how a JSON schema constraint is read (this server's extension; OpenAI's clients send it in extra_body):
    # "closed" (no undeclared keys, bounded numbers, compact whitespace) or "lenient" (the schema as written)
    json_schema_mode: Literal["closed", "lenient"] | None = None
    # accepted and ignored: they do not change what is generated
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None

    def constraints(self) -> list[tuple[str, dict]]:
        """Every constraint the body asks for, as (the field that asked, vLLM's structured_outputs)."""
        found = []
        if self.response_format is not None and (so := self.response_format.structured()) is not None:
            found.append(("response_format", so))
        if self.structured_outputs is not None:
            found.append(("structured_outputs", self.structured_outputs.structured()))
        for kind in ("json", "regex", "choice", "grammar"):
            if (value := getattr(self, f"guided_{kind}")) is not None:
                found.append((f"guided_{kind}", {kind: value}))
        return found


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)   # top-N alternatives per token (0: the sampled token's only)
    echo: bool = False
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, best_of: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n", 1)
        if best_of is not None and best_of != n:
            raise ValueError(f"only best_of equal to n ({n}) is supported: choices are not ranked; "
                             f"send n={best_of} and pick among them")
        return best_of

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix: str | None) -> str | None:
        if suffix:
            raise ValueError("is not supported: this server does not fill in the middle")
        return suffix

    @field_validator("echo")
    @classmethod
    def _echo_without_logprobs(cls, echo: bool, info: ValidationInfo) -> bool:
        if echo and info.data.get("logprobs") is not None:
            raise ValueError("with logprobs is not supported: the prompt's log-probabilities are not computed; "
                             "send one or the other")
        return echo


MEDIA_PARTS = ("image_url", "input_audio", "file")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal[ROLES]
    content: str | list[TextPart] | None   # required; null only for an assistant turn
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None             # sent back by clients that replay a reply; not shown to the model
    reasoning_content: str | None = None   # a reply's reasoning, replayed: the chat template decides if it is shown

    @field_validator("content", mode="before")
    @classmethod
    def _no_media(cls, content: Any) -> Any:
        """An image, audio or file part is refused by name (of a multimodal checkpoint only the text tower runs)."""
        media = [p["type"] for p in content if isinstance(p, dict) and p.get("type") in MEDIA_PARTS] \
            if isinstance(content, list) else []
        if media:
            raise ValueError(f"{media[0]} parts are not supported: this server reads text only")
        return content

    @field_validator("content")
    @classmethod
    def _content_present(cls, content: Any, info: ValidationInfo) -> Any:
        role = info.data.get("role")
        if content is None and role != "assistant":
            raise ValueError(f"must not be null in a {role} message")
        return content

    @field_validator("tool_calls", "tool_call_id", "reasoning_content")
    @classmethod
    def _only_in_its_role(cls, value: Any, info: ValidationInfo) -> Any:
        role, verb = ROLE_OF_FIELD[info.field_name]
        if value is not None and info.data.get("role") != role:
            article = "an" if role[0] in "aeiou" else "a"
            raise ValueError(f"{verb} only allowed in {article} {role} message, not a {info.data.get('role')} one")
        return value

    def to_template(self) -> dict[str, Any]:
        """The message as a chat template reads it."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        for key in ("name", "tool_call_id", "reasoning_content"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)   # chat has no 16-token default: up to the context's end (vLLM)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    # checked against tools where the SDK's chat() checks it (ToolSetup.of, chat/tool_calls.py)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: TemplateKwargs = None
    # vLLM's: the last message is an assistant reply the client began (a prefill); the model continues it
    # (which message can be continued is the prompt encoder's to say, as for the SDK's encode_chat)
    continue_final_message: bool = False

    @field_validator("messages")
    @classmethod
    def _tool_messages_have_ids(cls, messages: list[ChatMessage]) -> list[ChatMessage]:
        for i, m in enumerate(messages):
            if m.role == "tool" and m.tool_call_id is None:
                raise ValueError(f"messages[{i}] is a tool message without tool_call_id; send the id of the call "
                                 f"it answers")
        return messages


class TokenizeRequest(_Strict):
    """vLLM's /tokenize: a prompt, or chat messages (and tools) through the chat template."""
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, validate_default=True)
    tools: list[Tool] | None = None
    add_special_tokens: bool = True
    chat_template_kwargs: TemplateKwargs = None

    @field_validator("messages")
    @classmethod
    def _one_of(cls, messages: Any, info: ValidationInfo) -> Any:
        if (messages is None) == (info.data.get("prompt") is None):
            raise ValueError("send exactly one of prompt and messages")
        return messages


CACHE_FILE_NAME = r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}"


class CacheRequest(_Strict):
    """POST /v1/cache/save and /v1/cache/restore: a file name inside the server's --kv-cache-dir, and the
    prompt (text or token ids) or chat messages it holds the KV cache of (optional for a restore, which
    then checks the file was saved for it)."""
    model: str | None = None
    file: str = Field(pattern=f"^{CACHE_FILE_NAME}$")
    prompt: str | list[int] | None = None
    messages: list[ChatMessage] | None = None

    @field_validator("messages")
    @classmethod
    def _not_both(cls, messages: Any, info: ValidationInfo) -> Any:
        if messages is not None and info.data.get("prompt") is not None:
            raise ValueError("send one of prompt and messages, not both")
        return messages


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


def describe_error(error: dict[str, Any], shapes: dict[str, str] = SHAPES,
                   tags: frozenset[str] = frozenset()) -> tuple[str, str | None]:
    """One pydantic error of a request body -> (message, param), param being the path of the bad value
    (`messages[0].role`), or None when the body as a whole is wrong. `shapes`: the API's union fields
    and what they accept; `tags`: the type names of a list's tagged items (`content[0]`, not
    `content[0].tool_use`)."""
    loc = list(error.get("loc", ()))
    if loc and loc[0] == "body":
        loc = loc[1:]
    loc = [part for i, part in enumerate(loc) if not (part in tags and i and isinstance(loc[i - 1], int))]
    kind = error.get("type", "")
    if kind == "json_invalid":
        return f"the request body is not valid JSON ({error.get('ctx', {}).get('error', 'parse error')}).", None
    if not loc or isinstance(loc[0], int):
        return "the request body must be a JSON object.", None
    path, shape = "", None
    for i, part in enumerate(loc):
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path = f"{path}.{part}" if path else part
        if part in shapes and i + 1 < len(loc) and isinstance(loc[i + 1], str):   # a union branch ('list[int]')
            shape = part
            break
    if shape is not None:
        return f"{path} must be {shapes[shape]}.", path
    if kind == "missing":
        return f"{path} is required.", path
    if kind == "extra_forbidden":
        why = REFUSED.get(str(loc[-1]), "it is not a field this server implements, and it might change the output")
        return f"{path} is not supported: {why}.", path
    message = str(error.get("msg", "is invalid")).removeprefix("Value error, ")
    got = error.get("input")
    shown = f" (got {got!r})" if isinstance(got, (int, float, str, bool)) or got is None else ""
    return f"{path}: {message[0].lower() + message[1:]}{shown}.", path
