"""A GGUF file's metadata -> the Hugging Face config.json dict ModelConfig reads.

One builder per GGUF architecture name (`general.architecture`), in GGUF_ARCHITECTURES: a new family is
one entry (a function of the metadata returning its config dict), the rest of the GGUF path is shared.
"""
from __future__ import annotations

from typing import Any, Callable

from gguf import Keys

from ...errors import CheckpointError

# llama.cpp's values where a file is silent: the RoPE base of every architecture (and of Gemma 3's sliding
# layers without rope.freq_base_swa), Gemma 3's layer pattern, and the layer count that makes a Gemma 3 its 27B.
LLAMA_CPP_ROPE_BASE = 10_000.0
GEMMA3_SWA_PATTERN = 6
GEMMA3_27B_LAYERS = 62


class GGUFMeta:
    """The header's key-value pairs, read by the `gguf` package's key names (`Keys.LLM.BLOCK_COUNT`:
    "{arch}.block_count"), filled in with the file's architecture."""

    def __init__(self, fields: dict[str, Any], source: str):
        self.fields, self.source = fields, source
        self.arch = str(fields.get(Keys.General.ARCHITECTURE, ""))

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key.format(arch=self.arch), default)

    def need(self, key: str) -> Any:
        full = key.format(arch=self.arch)
        if full not in self.fields:
            raise CheckpointError(f"{self.source}: the GGUF metadata has no {full}; the file is incomplete.")
        return self.fields[full]


def _rope_scaling(meta: GGUFMeta) -> dict[str, Any] | None:
    """llama.cpp's `rope.scaling.*` keys -> config.json's rope_scaling (linear scaling is refused by ModelConfig)."""
    kind = meta.get(Keys.Rope.SCALING_TYPE)
    if kind in (None, "none"):
        return None
    scaling = {"rope_type": kind, "factor": float(meta.need(Keys.Rope.SCALING_FACTOR))}
    original = meta.get(Keys.Rope.SCALING_ORIG_CTX_LEN)
    if original:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


def _decoder(meta: GGUFMeta, hf_arch: str, model_type: str) -> dict[str, Any]:
    """The fields every Llama-family GGUF spells the same way, with llama.cpp's defaults for what a file
    leaves out (llama_model::load_hparams): KV heads = heads, head size = hidden / heads, RoPE base 10,000."""
    heads = int(meta.need(Keys.Attention.HEAD_COUNT))
    hidden = int(meta.need(Keys.LLM.EMBEDDING_LENGTH))
    hf: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": int(meta.need(Keys.LLM.FEED_FORWARD_LENGTH)),
        "num_hidden_layers": int(meta.need(Keys.LLM.BLOCK_COUNT)),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(Keys.Attention.HEAD_COUNT_KV, heads)),
        "head_dim": int(meta.get(Keys.Attention.KEY_LENGTH, hidden // heads)),
        "rms_norm_eps": float(meta.need(Keys.Attention.LAYERNORM_RMS_EPS)),
        "rope_theta": float(meta.get(Keys.Rope.FREQ_BASE, LLAMA_CPP_ROPE_BASE)),
        "max_position_embeddings": int(meta.need(Keys.LLM.CONTEXT_LENGTH)),
    }
    if meta.get(Keys.LLM.VOCAB_SIZE) is not None:
        hf["vocab_size"] = int(meta.get(Keys.LLM.VOCAB_SIZE))
    scaling = _rope_scaling(meta)
    if scaling:
        hf["rope_scaling"] = scaling
    for key, name in (("bos_token_id", Keys.Tokenizer.BOS_ID), ("eos_token_id", Keys.Tokenizer.EOS_ID)):
        if name in meta.fields:
            hf[key] = int(meta.fields[name])
    return hf


def _gemma3(meta: GGUFMeta) -> dict[str, Any]:
    """Gemma 3 as llama.cpp reads it (its LLM_ARCH_GEMMA3 hparams): the window from the file, one full layer
    in six, the sliding layers' RoPE base the file's rope.freq_base_swa (10,000 when absent: never the full
    layers' base), the full layers' the file's rope.freq_base (10,000 when absent, as for every
    architecture), and the attention scale
    1/sqrt(head size) except on the 27B (62 layers), whose scale is 1/sqrt(hidden / heads)."""
    hf = _decoder(meta, "Gemma3ForCausalLM", "gemma3_text")
    head_dim, value_dim = hf["head_dim"], meta.get(Keys.Attention.VALUE_LENGTH)
    if value_dim is not None and int(value_dim) != head_dim:
        raise CheckpointError(f"{meta.source}: gemma3.attention.value_length {value_dim} differs from key_length "
                              f"{head_dim}; Gemma 3's heads have one size.")
    hf["sliding_window"] = int(meta.need(Keys.Attention.SLIDING_WINDOW))
    hf["sliding_window_pattern"] = GEMMA3_SWA_PATTERN
    hf["rope_local_base_freq"] = float(meta.get(Keys.Rope.FREQ_BASE_SWA, LLAMA_CPP_ROPE_BASE))
    big = hf["num_hidden_layers"] == GEMMA3_27B_LAYERS
    hf["query_pre_attn_scalar"] = hf["hidden_size"] // hf["num_attention_heads"] if big else head_dim
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
