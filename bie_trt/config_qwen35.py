"""Reading Qwen3.5 configs: `Qwen3_5ForCausalLM` ones, and the text tower of `Qwen3_5ForConditionalGeneration`
ones (the published releases), into the fields `ModelConfig` adds to the Llama decoder.

Qwen3.5 is hybrid: most layers are Gated DeltaNet linear attention (a fixed recurrent state per sequence,
no KV cache), one in `full_attention_interval` (4) is gated full attention (a query gate on the attention
output, q/k norms, RoPE on the first quarter of each head). Every RMSNorm but the DeltaNet's own gated one
scales by (1 + w)."""
from __future__ import annotations

from typing import Any

from .config_text import layer_types, text_tower
from .errors import CheckpointError
from .families import ModelFamily

# transformers' Qwen3_5TextConfig defaults, for fields a config.json may leave out.
TEXT_DEFAULTS: dict[str, Any] = {
    "head_dim": 256, "hidden_act": "silu", "rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
    "tie_word_embeddings": False, "attention_bias": False, "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
}
DEFAULT_FULL_ATTENTION_INTERVAL = 4
DEFAULT_PARTIAL_ROTARY_FACTOR = 0.25
LAYER_TYPES = ("linear_attention", "full_attention")


def qwen35_text_config(hf: dict[str, Any], source: str) -> dict[str, Any]:
    """The text model's config with transformers' defaults filled in (the multimodal releases nest it in
    text_config)."""
    return text_tower(hf, "Qwen3_5ForConditionalGeneration", TEXT_DEFAULTS, source)


def qwen35_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    """The ModelConfig fields of a Qwen3.5 text config (after `qwen35_text_config`)."""
    if hf.get("hidden_act") != "silu":
        raise CheckpointError(f"{source}: hidden_act {hf.get('hidden_act')!r} is not supported for Qwen3.5 (silu is).")
    if hf.get("num_experts"):
        raise CheckpointError(f"{source}: num_experts={hf['num_experts']}: the Qwen3.5 MoE models are not supported; "
                              f"the dense Qwen3.5 models are.")
    every = int(hf.get("full_attention_interval") or DEFAULT_FULL_ATTENTION_INTERVAL)
    types = layer_types(hf, LAYER_TYPES, every, source)
    rope = hf.get("rope_parameters") or {}
    # Text-only positions are the same on mRoPE's three axes, so mrope_section changes nothing: plain RoPE.
    factor = float(rope.get("partial_rotary_factor") or hf.get("partial_rotary_factor")
                   or DEFAULT_PARTIAL_ROTARY_FACTOR)
    head_dim = int(hf["head_dim"])
    rotary = int(head_dim * factor)
    if not 0 < rotary <= head_dim or rotary % 2:
        raise CheckpointError(f"{source}: partial_rotary_factor {factor} rotates {rotary} of head_dim {head_dim} "
                              f"channels; it must be an even number above 0.")
    k_heads, v_heads = int(hf["linear_num_key_heads"]), int(hf["linear_num_value_heads"])
    if v_heads % k_heads:
        raise CheckpointError(f"{source}: linear_num_value_heads={v_heads} is not a multiple of "
                              f"linear_num_key_heads={k_heads}.")
    return dict(norm_offset=1.0, layer_types=types, partial_rotary_factor=factor, attn_output_gate=True,
                linear_num_key_heads=k_heads, linear_num_value_heads=v_heads,
                linear_key_head_dim=int(hf["linear_key_head_dim"]),
                linear_value_head_dim=int(hf["linear_value_head_dim"]),
                linear_conv_kernel=int(hf["linear_conv_kernel_dim"]))


def read_qwen35(hf: dict[str, Any], source: str) -> tuple[dict[str, Any], dict[str, Any]]:
    text = qwen35_text_config(hf, source)
    return text, qwen35_fields(text, source)


# Qwen3.5 thinks in Qwen3's <think> block; its template ends the generation prompt inside one (found per request).
FAMILY = ModelFamily("qwen3_5", ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"), read_qwen35,
                     reasoning_parser="qwen3")
