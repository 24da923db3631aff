"""Text that is not Unicode refused at the door: JSON's `"\\ud800"` parses into a lone surrogate, which no
tokenizer takes and no reply can carry back (UTF-8 has no bytes for it), so a reply echoing it (the
Responses API's `metadata`, `user`, tool names) would fail as it is written. Every body route's validated
body is read once for such text before its handler runs: a 400 naming the field as the body validated
(a string `input` named as the message it stands for), on every route, echoed or not."""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

from fastapi.routing import APIRoute
from pydantic import BaseModel

from ..executor.prompt_checks import unencodable
from .errors import ApiError


def check_body_text(body: BaseModel) -> None:
    """ApiError (400) naming the first field of `body` that holds text which is not Unicode."""
    found = unencodable(body.model_dump(by_alias=True, exclude_none=True))
    if found is not None:
        raise ApiError(400, str(found), found.field)


def checked(endpoint: Callable[..., Any]) -> Callable[..., Any]:
    """`endpoint` with its body arguments checked first. FastAPI reads the parameters through the
    wrapper (functools.wraps), so the route takes the same body."""
    def check(values: dict[str, Any]) -> None:
        for value in values.values():
            if isinstance(value, BaseModel):
                check_body_text(value)

    if inspect.iscoroutinefunction(endpoint):
        @functools.wraps(endpoint)
        async def run(**values: Any) -> Any:
            check(values)
            return await endpoint(**values)
    else:
        @functools.wraps(endpoint)
        def run(**values: Any) -> Any:
            check(values)
            return endpoint(**values)
    return run


class TextCheckedRoute(APIRoute):
    """A route whose body is checked for text that is not Unicode before its handler runs (install_routes
    makes every route one)."""

    def __init__(self, path: str, endpoint: Callable[..., Any], **kwargs: Any):
        super().__init__(path, checked(endpoint), **kwargs)
