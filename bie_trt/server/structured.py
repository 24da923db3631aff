"""From a request body to what the engine enforces and how the reply is read: the one output
constraint a body may ask for (response_format, structured_outputs, vLLM's guided_* fields, or
tool_choice "required" / a named function), and chat prompts that carry tools."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ..config import StructuredOutputs
from ..errors import RequestError
from ..tool_calls import ReplyParser, parameters_of, required_schema, template_messages, template_renders_tools
from .protocol import ChatRequest, SamplingRequest


class ParamError(Exception):
    """A 400 naming the request field at fault."""

    def __init__(self, message: str, param: str | None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolPlan:
    """How a chat request's tools shape its reply: `mode` (none, auto, required, named), the tools as the
    template gets them, and the constraint tool_choice implies."""

    mode: str
    tools: list[dict] | None
    constraint: dict | None
    function: str | None = None

    def parser(self) -> ReplyParser:
        names = {t["function"]["name"] for t in self.tools or []}
        return ReplyParser(self.mode, names, self.function)


def tool_plan(req: ChatRequest) -> ToolPlan:
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    mode = req.tool_mode()
    if mode == "required":
        return ToolPlan(mode, tools, {"json": required_schema(tools, req.parallel_tool_calls is not False)})
    if mode == "named":
        name = req.tool_choice.function.name
        tool = next(t for t in tools if t["function"]["name"] == name)
        return ToolPlan(mode, tools, {"json": parameters_of(tool)}, name)
    return ToolPlan(mode, tools, None)


def output_constraint(req: SamplingRequest, tools: ToolPlan | None = None) -> tuple[StructuredOutputs | None, str | None]:
    """The body's one constraint, checked, and the field it came from; ParamError when a field is bad
    or two fields both constrain the output."""
    try:
        found = req.constraints()
    except ValueError as e:
        raise ParamError(f"response_format: {e}.", "response_format") from None
    if tools is not None and tools.constraint is not None:
        found.append(("tool_choice", tools.constraint))
    if not found:
        return None, None
    if len(found) > 1:
        raise ParamError(f"{found[0][0]} and {found[1][0]} both constrain the output; send only one of them.",
                         found[1][0])
    param, fields = found[0]
    try:
        constraint = StructuredOutputs(**fields)
        constraint.validate()
    except RequestError as e:
        raise ParamError(f"{param}: {e}", param) from None
    return constraint, param


_LEADING_FIELD = re.compile(r"^([a-z_]+)")


def error_param(message: str, fields: set[str], default: str | None) -> str | None:
    """The request field an engine error names first (`min_tokens 9 is above ...`), else `default`."""
    match = _LEADING_FIELD.match(message)
    return match.group(1) if match and match.group(1) in fields else default


class ChatEncoder:
    """Chat messages (and tools) -> prompt token ids through the checkpoint's template; tools it does not
    render go into a system prompt instead (checked once, on first use)."""

    def __init__(self, engine: Any):
        self.engine = engine
        self._native: bool | None = None

    def __call__(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        uses_tools = tools or any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
        if not uses_tools:
            return self.engine.encode(messages, True)
        tokenizer = self.engine.tokenizer
        if not tokenizer.chat_template:
            raise RequestError("this engine's tokenizer has no chat template; send a plain prompt instead.")
        if self._native is None:
            self._native = template_renders_tools(tokenizer)
        shaped = template_messages(messages, tools, self._native)
        ids = tokenizer.apply_chat_template(shaped, tools=tools if self._native else None,
                                            add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
