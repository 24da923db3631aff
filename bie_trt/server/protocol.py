"""The request bodies of the OpenAI API, checked strictly: a number sent as a string (`"4"`) or a bool
(`true`) is refused, not coerced; ranges are OpenAI's (temperature 0-2, penalties -2..2). Fields this
server does not use (user, logit_bias, ...) are accepted and ignored, as OpenAI clients send them."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from ..config import REPETITION_PENALTY_RANGE

MAX_CHOICES = 16                      # n per request: each choice is a request on the loop
SEED_RANGE = (-(2 ** 63), 2 ** 63 - 1 - MAX_CHOICES)   # choice i uses seed + i; torch takes 64-bit seeds
ROLES = ("system", "developer", "user", "assistant", "tool")

# Union fields get one message naming every accepted shape (pydantic reports one error per branch).
SHAPES = {
    "prompt": "a string, a list of strings, a list of token ids or a list of token-id lists",
    "stop": "a string or a list of strings",
    "content": "a string or a list of text parts ({\"type\": \"text\", \"text\": ...})",
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


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


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)   # top-N alternatives per token (0: the sampled token's only)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal[ROLES]
    content: str | list[TextPart] | None   # required; null only for an assistant turn

    @field_validator("content")
    @classmethod
    def _content_present(cls, content: Any, info: ValidationInfo) -> Any:
        role = info.data.get("role")
        if content is None and role != "assistant":
            raise ValueError(f"must not be null in a {role} message")
        return content

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


def describe_error(error: dict[str, Any]) -> tuple[str, str | None]:
    """One pydantic error of a request body -> (message, param), param being the path of the bad value
    (`messages[0].role`), or None when the body as a whole is wrong."""
    loc = list(error.get("loc", ()))
    if loc and loc[0] == "body":
        loc = loc[1:]
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
        if part in SHAPES and i + 1 < len(loc):   # what follows names a union branch ('list[int]')
            shape = part
            break
    if shape is not None:
        return f"{path} must be {SHAPES[shape]}.", path
    if kind == "missing":
        return f"{path} is required.", path
    if kind == "extra_forbidden":
        return f"{path} is not a known field.", path
    message = str(error.get("msg", "is invalid")).removeprefix("Value error, ")
    got = error.get("input")
    shown = f" (got {got!r})" if isinstance(got, (int, float, str, bool)) or got is None else ""
    return f"{path}: {message[0].lower() + message[1:]}{shown}.", path
