"""A GGUF file's metadata -> the Hugging Face config.json dict ModelConfig reads.

One builder per GGUF architecture name (`general.architecture`), in GGUF_ARCHITECTURES: a new family is
one entry (a function of the metadata returning its config dict), the rest of the GGUF path is shared.
"""
from __future__ import annotations

from typing import Any, Callable

from ...errors import CheckpointError


class GGUFMeta:
    """The header's key-value pairs, read through the architecture's prefix (`llama.block_count`)."""

    def __init__(self, fields: dict[str, Any], source: str):
        self.fields, self.source = fields, source
        self.arch = str(fields.get("general.architecture", ""))

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(f"{self.arch}.{key}", default)

    def need(self, key: str) -> Any:
        full = f"{self.arch}.{key}"
        if full not in self.fields:
            raise CheckpointError(f"{self.source}: the GGUF metadata has no {full}; the file is incomplete.")
        return self.fields[full]


def _rope_scaling(meta: GGUFMeta) -> dict[str, Any] | None:
    """llama.cpp's `rope.scaling.*` keys -> config.json's rope_scaling (linear scaling is refused by ModelConfig)."""
    kind = meta.get("rope.scaling.type")
    if kind in (None, "none"):
        return None
    scaling = {"rope_type": kind, "factor": float(meta.need("rope.scaling.factor"))}
    original = meta.get("rope.scaling.original_context_length")
    if original:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


def _decoder(meta: GGUFMeta, hf_arch: str, model_type: str) -> dict[str, Any]:
    """The fields every Llama-family GGUF spells the same way."""
    heads = int(meta.need("attention.head_count"))
    hidden = int(meta.need("embedding_length"))
    hf: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": int(meta.need("feed_forward_length")),
        "num_hidden_layers": int(meta.need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get("attention.head_count_kv", heads)),
        "head_dim": int(meta.get("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(meta.need("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(meta.get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta.need("context_length")),
    }
    if meta.get("vocab_size") is not None:
        hf["vocab_size"] = int(meta.get("vocab_size"))
    scaling = _rope_scaling(meta)
    if scaling:
        hf["rope_scaling"] = scaling
    for key, name in (("bos_token_id", "tokenizer.ggml.bos_token_id"), ("eos_token_id", "tokenizer.ggml.eos_token_id")):
        if name in meta.fields:
            hf[key] = int(meta.fields[name])
    return hf


def _gemma3(meta: GGUFMeta) -> dict[str, Any]:
    """Gemma 3 as transformers' GGUF loader reads it: the file states the full layers' RoPE base
    (rope.freq_base) and the window; what it leaves out (the sliding layers' base 10,000, one full layer
    in six, query_pre_attn_scalar 256, GELU-tanh) takes Gemma3TextConfig's defaults (config_gemma3.py)."""
    hf = _decoder(meta, "Gemma3ForCausalLM", "gemma3_text")
    if meta.get("rope.freq_base") is None:
        del hf["rope_theta"]   # Gemma 3's own default (1,000,000), not the Llama one
    head_dim, value_dim = hf["head_dim"], meta.get("attention.value_length")
    if value_dim is not None and int(value_dim) != head_dim:
        raise CheckpointError(f"{meta.source}: gemma3.attention.value_length {value_dim} differs from key_length "
                              f"{head_dim}; Gemma 3's heads have one size.")
    hf["sliding_window"] = int(meta.need("attention.sliding_window"))
    return hf


# GGUF architecture -> its config builder.
GGUF_ARCHITECTURES: dict[str, Callable[[GGUFMeta], dict[str, Any]]] = {
    "llama": lambda meta: _decoder(meta, "LlamaForCausalLM", "llama"),
    "qwen2": lambda meta: _decoder(meta, "Qwen2ForCausalLM", "qwen2") | {"attention_bias": True},
    "qwen3": lambda meta: _decoder(meta, "Qwen3ForCausalLM", "qwen3"),
    "gemma3": _gemma3,
}


def hf_config_from_gguf(meta: GGUFMeta) -> dict[str, Any]:
    builder = GGUF_ARCHITECTURES.get(meta.arch)
    if builder is None:
        raise CheckpointError(f"{meta.source}: unsupported GGUF architecture {meta.arch!r}; bie-trt reads "
                              f"{', '.join(sorted(GGUF_ARCHITECTURES))}.")
    return builder(meta)
