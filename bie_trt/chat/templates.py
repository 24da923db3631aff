"""Chat templates: reading one (a user's file or a shipped `chat_<name>.jinja` from the repository's
`templates/`, in the wheel through the link `bie_trt/data/templates`), whether a tokenizer carries one,
and the extra variables a request passes into it."""
from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import jinja2

from ..errors import RequestError

TEMPLATES_DIR = Path(__file__).resolve().parents[1] / "data" / "templates"


def has_chat_template(tokenizer_dir: Path) -> bool:
    """Whether a tokenizer directory carries a chat template (its own file, or in tokenizer_config.json)."""
    config = tokenizer_dir / "tokenizer_config.json"
    return (tokenizer_dir / "chat_template.jinja").exists() or (
        config.exists() and bool(json.loads(config.read_text()).get("chat_template")))


def shipped_chat_templates() -> list[str]:
    """The names `--chat-template` takes besides a file: `qwen3` for templates/chat_qwen3.jinja."""
    return sorted(p.name.removeprefix("chat_").removesuffix(".jinja") for p in TEMPLATES_DIR.glob("chat_*.jinja"))


def read_chat_template(path: str) -> str:
    """A chat template file's text, or a shipped template's when `path` is its name (and no such file)."""
    if not Path(path).exists() and path in shipped_chat_templates():
        path = str(TEMPLATES_DIR / f"chat_{path}.jinja")
    try:
        text = Path(path).read_bytes().decode("utf-8")
        jinja2.Environment().parse(text)
    except OSError as e:
        raise RequestError(f"chat template {path}: cannot be read ({e.strerror}); pass a jinja2 file "
                           f"or the name of a shipped template ({', '.join(shipped_chat_templates())}).") from None
    except UnicodeDecodeError:
        raise RequestError(f"chat template {path}: not UTF-8 text; pass a jinja2 file.") from None
    except jinja2.TemplateSyntaxError as e:
        raise RequestError(f"chat template {path}: jinja2 syntax error on line {e.lineno} ({e.message}); "
                           f"fix the template.") from None
    return text


def _reserved_variables() -> frozenset[str]:
    """What a request may not set through chat_template_kwargs: the variables the engine renders with
    (messages, tools, add_generation_prompt, ...) and transformers' own rendering options."""
    from transformers import PreTrainedTokenizerBase

    names = set(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters)
    return frozenset(names - {"self", "kwargs", "conversation"} | {"messages"})


def template_kwargs_problem(kwargs: Any) -> str | None:
    """What is wrong with extra chat-template variables ({"enable_thinking": false}), as a predicate
    after their name; None when they are an object whose keys are not variables the engine sets itself."""
    if not isinstance(kwargs, dict):
        return 'must be a JSON object of chat template variables, e.g. {"enable_thinking": false}'
    if taken := sorted(set(kwargs) & _reserved_variables()):
        return f"sets {', '.join(taken)}, which the engine sets itself; send the template's own variables only"
    return None


def parse_template_kwargs(text: str, what: str) -> dict[str, Any]:
    """--chat-template-kwargs JSON -> its checked object."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise RequestError(f"{what} is not valid JSON ({e.msg} at character {e.pos}); "
                           f"""send an object, e.g. '{{"enable_thinking": false}}'.""") from None
    if problem := template_kwargs_problem(value):
        raise RequestError(f"{what} {problem}; got {text}.")
    return value
