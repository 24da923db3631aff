"""From a request body to what the engine enforces and how the reply is read: the one output
constraint a body may ask for (response_format, structured_outputs, vLLM's guided_* fields, or
tool_choice "required" / a named function)."""
from __future__ import annotations

import dataclasses
import re

from ..chat.tool_calls import ToolsError, ToolSetup
from ..errors import RequestError
from ..sampling_params import StructuredOutputs
from .protocols.openai import ChatRequest, SamplingRequest


class ParamError(Exception):
    """A 400 naming the request field at fault."""

    def __init__(self, message: str, param: str | None):
        super().__init__(message)
        self.param = param


def tool_setup(req: ChatRequest) -> ToolSetup:
    """The body's tools as the engine resolves them (the body's checks already refused what it would)."""
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    choice = req.tool_choice if isinstance(req.tool_choice, (str, type(None))) else req.tool_choice.model_dump()
    try:
        return ToolSetup.of(tools, choice, req.parallel_tool_calls is True)
    except RequestError as e:
        raise ParamError(str(e), "tools" if isinstance(e, ToolsError) else "tool_choice") from None


def output_constraint(req: SamplingRequest, tools: ToolSetup | None = None, json_schema_mode: str = "closed"
                      ) -> tuple[StructuredOutputs | None, str | None]:
    """The body's one constraint and the field it came from; ParamError when a field is malformed or two
    fields both constrain the output. The constraint itself is checked where every request's is, as its
    SamplingParams are made (a ConstraintError, which the caller names this field in). A JSON one is read
    in the body's `json_schema_mode`, else in the server's (`json_schema_mode`: "closed" or "lenient")."""
    try:
        found = req.constraints()
    except ValueError as e:
        raise ParamError(f"response_format: {e}.", "response_format") from None
    if len(found) > 1:
        raise ParamError(f"{found[0][0]} and {found[1][0]} both constrain the output; send only one of them.",
                         found[1][0])
    param, fields = found[0] if found else (None, None)
    constraint = None if fields is None else StructuredOutputs(**fields)
    if tools is not None and tools.constraint is not None:   # merged as the SDK's chat() merges them
        try:
            constraint, param = tools.constrain(constraint, param), "tool_choice"
        except RequestError as e:
            raise ParamError(str(e), "tool_choice") from None
    if constraint is None:
        if req.json_schema_mode is not None:
            raise ParamError("json_schema_mode is only read with a JSON schema or JSON object constraint "
                             "(response_format, structured_outputs, guided_json or tool_choice); drop it.",
                             "json_schema_mode")
        return None, None
    # read, not checked: whether exactly one kind is set is SamplingParams' to say, as for the SDK's
    if constraint.json is not None or constraint.json_object:
        lenient = (req.json_schema_mode or json_schema_mode) == "lenient"
        constraint = dataclasses.replace(constraint, lenient=lenient)
    elif req.json_schema_mode is not None and len(constraint.kinds()) == 1:
        raise ParamError(f"json_schema_mode is only read with a JSON schema or JSON object constraint, not "
                         f"{param}'s {constraint.kind}; drop it.", "json_schema_mode")
    return constraint, param


_LEADING_FIELD = re.compile(r"^([a-z_]+)")


def error_param(message: str, fields: set[str], default: str | None) -> str | None:
    """The request field an engine error names first (`min_tokens 9 is above ...`), else `default`."""
    match = _LEADING_FIELD.match(message)
    return match.group(1) if match and match.group(1) in fields else default
