"""The plain decoders' family declarations, and what the hybrid families' config readers (config_gemma3.py,
config_qwen35.py, config_gemma4.py) share: the text tower of a multimodal config with the defaults filled in,
and each layer's type."""
from __future__ import annotations

from typing import Any

from .errors import CheckpointError
from .families import ModelFamily

# The Llama-style decoders with no fields of their own (Qwen2's qkv bias and Qwen3's q/k norms are read per
# architecture in config.py): their chat templates decide the reasoning parser.
PLAIN_DECODER = ModelFamily("llama", ("LlamaForCausalLM", "MistralForCausalLM"))
QWEN2_DECODER = ModelFamily("qwen2", ("Qwen2ForCausalLM",))
QWEN3_DECODER = ModelFamily("qwen3", ("Qwen3ForCausalLM",))


def text_tower(hf: dict[str, Any], multimodal: str, defaults: dict[str, Any], source: str) -> dict[str, Any]:
    """A `multimodal` architecture's config: its text_config, under the ids and the head tying of the whole
    model where the text config leaves them out; a text model's config as it is. Then the defaults for fields
    left out or null."""
    if multimodal in (hf.get("architectures") or []):
        text = hf.get("text_config")
        if not isinstance(text, dict):
            raise CheckpointError(f"{source}: a {multimodal} config needs its text_config object.")
        top = {k: hf[k] for k in ("eos_token_id", "bos_token_id", "tie_word_embeddings") if k in hf}
        hf = {**top, **text, "architectures": hf["architectures"]}
    return {k: v for k, v in defaults.items() if hf.get(k) is None} | {k: v for k, v in hf.items() if v is not None}


def layer_types(hf: dict[str, Any], kinds: tuple[str, str], every: int, source: str) -> tuple[str, ...]:
    """config.json's layer_types, or when it has none the pattern `every`-th layer is kinds[1], the others
    kinds[0]; checked to name every layer with one of `kinds`."""
    layers = int(hf["num_hidden_layers"])
    types = hf.get("layer_types")
    if types is None:
        types = [kinds[(i + 1) % every == 0] for i in range(layers)]
    if len(types) != layers or set(types) - set(kinds):
        raise CheckpointError(f"{source}: layer_types must name {layers} layers, each one of {kinds}; "
                              f"got {types!r}.")
    return tuple(types)
