"""What a model family decides, declared once by the family's config module (config_text.py for the plain
decoders, config_gemma3.py, config_qwen35.py, config_gemma4.py) and gathered in config.FAMILIES: the
architectures it reads, how its config.json becomes ModelConfig fields, the model class that runs it, the
KV defaults its builds take, the tokens that end its replies, the chat template an engine gets when its
checkpoint carries none, and the parsers that read its replies. The executor, the builder and the server
ask `ModelConfig.declared` instead of branching on a family's name."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

# config.json (after the family's text-tower reader) -> the ModelConfig fields the family adds; the reader
# returns (the config as the shared fields are read from it, the family's own fields).
ConfigReader = Callable[[dict[str, Any], str], tuple[dict[str, Any], dict[str, Any]]]


@dataclass(frozen=True)
class ModelFamily:
    name: str                                  # ModelConfig.family: "llama", "gemma3", "qwen3_5", ...
    architectures: tuple[str, ...]             # config.json's `architectures` entries it reads
    read_config: ConfigReader | None = None    # None: a plain Llama-style decoder, no fields of its own
    model_class: str = "LlamaModel"            # model.llama.model_class looks the class up by this name
    # KVCacheConfig fields a build takes by default in every profile (an explicit option still wins)
    kv_defaults: dict[str, Any] = field(default_factory=dict)
    # tokens (by their text) that end a reply besides the checkpoint's eos ids: the family's end of turn where
    # its releases leave it out of their end ids (vLLM reads it from generation_config)
    stop_tokens: tuple[str, ...] = ()
    # a shipped template's name (templates/chat_<name>.jinja), written into an engine whose checkpoint has none
    chat_template: str | None = None
    # what --reasoning-parser "auto" means for it: "auto" leaves it to the chat template (chat/reasoning.py)
    reasoning_parser: str = "auto"
    tool_parser: str = "hermes"                # how its replies' tool calls are read (chat/tool_calls.py)
