"""Loading the engine's tokenizer (transformers' AutoTokenizer over the engine directory), with a chat
template in place of the checkpoint's own when one is given."""
from __future__ import annotations

from .templates import read_chat_template


def load_tokenizer(engine_dir: str, chat_template: str | None = None):
    """The engine's tokenizer; `chat_template` (a jinja2 file or a shipped template's name) replaces the
    checkpoint's own template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(engine_dir)
    if chat_template is not None:
        tokenizer.chat_template = read_chat_template(chat_template)
    return tokenizer
