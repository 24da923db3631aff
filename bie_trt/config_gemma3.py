"""Reading Gemma 3 configs: `Gemma3ForCausalLM` ones, and the text tower of `Gemma3ForConditionalGeneration`
ones (the 4B/12B/27B releases), into the fields `ModelConfig` adds to the Llama decoder."""
from __future__ import annotations

from typing import Any

from .config_text import layer_types, text_tower
from .errors import CheckpointError
from .families import ModelFamily

# transformers' Gemma3TextConfig defaults: the published multimodal configs leave most of them out of
# text_config (heads, head_dim, vocabulary, RoPE bases, the layer pattern).
TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6, "bos_token_id": 2, "eos_token_id": 1,
    "tie_word_embeddings": True, "query_pre_attn_scalar": 256, "sliding_window": 4096,
    "final_logit_softcapping": None, "attn_logit_softcapping": None, "attention_bias": False,
}
GLOBAL_THETA, LOCAL_THETA = 1_000_000.0, 10_000.0
DEFAULT_PATTERN = 6   # one full layer in every six (sliding_window_pattern)
LAYER_TYPES = ("sliding_attention", "full_attention")


def gemma3_text_config(hf: dict[str, Any], source: str) -> dict[str, Any]:
    """The text model's config with transformers' defaults filled in and RoPE spelled as for a Llama: the
    full layers' base and scaling in rope_theta / rope_scaling, the sliding layers' in rope_local_base_freq."""
    # the top level carries the ids of the whole model (eos [1, 106] in the -it releases)
    hf = text_tower(hf, "Gemma3ForConditionalGeneration", TEXT_DEFAULTS, source)
    out = dict(hf)
    params = dict(out.pop("rope_parameters", None) or {})
    full = dict(params.get("full_attention") or {})
    local = dict(params.get("sliding_attention") or {})
    out["rope_theta"] = float(full.get("rope_theta") or hf.get("rope_theta") or GLOBAL_THETA)
    out["rope_local_base_freq"] = float(local.get("rope_theta") or hf.get("rope_local_base_freq") or LOCAL_THETA)
    if local.get("rope_type", "default") != "default":
        raise CheckpointError(f"{source}: the sliding layers' RoPE type {local['rope_type']!r} is not supported "
                              f"(Gemma 3 uses plain RoPE there).")
    scaling = hf.get("rope_scaling") or ({k: v for k, v in full.items() if k != "rope_theta"}
                                          if full.get("rope_type", "default") != "default" else None)
    out["rope_scaling"] = scaling
    return out


def gemma3_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    """The ModelConfig fields of a Gemma 3 text config (after `gemma3_text_config`)."""
    if hf.get("attn_logit_softcapping") is not None:
        raise CheckpointError(f"{source}: attn_logit_softcapping={hf['attn_logit_softcapping']} (Gemma 2's score "
                              f"capping) is not supported; Gemma 3 configs leave it null.")
    if hf.get("use_bidirectional_attention"):
        raise CheckpointError(f"{source}: use_bidirectional_attention is on (an embedding model); bie-trt runs "
                              f"causal decoders.")
    act = hf.get("hidden_activation") or hf.get("hidden_act")
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise CheckpointError(f"{source}: hidden_activation {act!r} is not supported for Gemma 3 "
                              f"(gelu_pytorch_tanh is).")
    types = layer_types(hf, LAYER_TYPES, int(hf.get("sliding_window_pattern") or DEFAULT_PATTERN), source)
    window = int(hf["sliding_window"])
    if window < 1:
        raise CheckpointError(f"{source}: sliding_window must be a positive number of positions; got {window}.")
    cap = hf.get("final_logit_softcapping")
    return dict(hidden_act="gelu_tanh", norm_offset=1.0, sandwich_norms=True,
                embed_scale=float(hf["hidden_size"]) ** 0.5,
                query_pre_attn_scalar=float(hf["query_pre_attn_scalar"]),
                final_logit_softcapping=None if cap is None else float(cap),
                sliding_window=window, layer_types=types, local_rope_theta=float(hf["rope_local_base_freq"]))


def read_gemma3(hf: dict[str, Any], source: str) -> tuple[dict[str, Any], dict[str, Any]]:
    text = gemma3_text_config(hf, source)
    return text, gemma3_fields(text, source)


FAMILY = ModelFamily(
    "gemma3", ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"), read_gemma3,
    # Gemma 3's k-normed keys share a large mean direction (on Gemma-3-270M's full layers the mean key's RMS is
    # 77-82% of the keys' own) and its full layers lean on their last few hundred positions: INT4 there stays
    # within +0.5% perplexity of FP16 only with key centering and a 512-token FP16 window
    # (docs/kv-cache-quality.md). The window costs a fixed 7.5 MiB a sequence on Gemma-3-4B, nothing per token.
    kv_defaults={"key_centering": True, "window": 512},
    # a reply ends at the end of the model's turn; the GGUF releases name only <eos> as their end token
    stop_tokens=("<end_of_turn>",),
    chat_template="gemma3",   # templates/chat_gemma3.jinja: the GGUF releases carry no template
)
