"""jinja2 templates: rendering the repository's own (`templates/`, shipped in the wheel through the link
`bie_trt/data/templates`), and reading a user's chat template and the tokenizer it goes with."""
from __future__ import annotations

from pathlib import Path

import jinja2

from .errors import RequestError

TEMPLATES_DIR = Path(__file__).parent / "data" / "templates"


def render(name: str, **context) -> str:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES_DIR), keep_trailing_newline=True,
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    return env.get_template(name).render(**context)


def load_tokenizer(engine_dir: str, chat_template: str | None = None):
    """The engine's tokenizer; `chat_template` (a jinja2 file) replaces the checkpoint's own template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(engine_dir)
    if chat_template is not None:
        tokenizer.chat_template = read_chat_template(chat_template)
    return tokenizer


def read_chat_template(path: str) -> str:
    try:
        text = Path(path).read_bytes().decode("utf-8")
        jinja2.Environment().parse(text)
    except OSError as e:
        raise RequestError(f"chat template {path}: cannot be read ({e.strerror}); pass a jinja2 file.") from None
    except UnicodeDecodeError:
        raise RequestError(f"chat template {path}: not UTF-8 text; pass a jinja2 file.") from None
    except jinja2.TemplateSyntaxError as e:
        raise RequestError(f"chat template {path}: jinja2 syntax error on line {e.lineno} ({e.message}); "
                           f"fix the template.") from None
    return text
