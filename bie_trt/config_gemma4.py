"""Reading Gemma 4 configs: `Gemma4ForCausalLM` ones, and the text tower of `Gemma4ForConditionalGeneration`
ones (the E2B/E4B releases), into the fields `ModelConfig` adds to the Llama decoder.

Gemma 4 is Gemma 3's hybrid with these differences (transformers' models/gemma4): plain-weight RMSNorms (not
1 + w), a softmax scale of 1 (the q/k norms carry it), values RMS-normalised per head without a weight, wider
heads and their own KV head count on the full layers, keys reused as values there where `attention_k_eq_v`,
proportional RoPE on the full layers (a quarter of the frequency pairs turn, exponents over the whole head),
the last `num_kv_shared_layers` layers reading the cache of the last earlier layer of their type (and owning
none), per-layer embeddings added after each layer's MLP, and a learned scalar on each layer's output."""
from __future__ import annotations

from typing import Any

from .config_text import layer_types, text_tower
from .errors import CheckpointError
from .families import ModelFamily

# transformers' Gemma4TextConfig defaults (global_head_dim is popped from its kwargs with 512).
TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_144, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 30,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "global_head_dim": 512,
    "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6,
    "bos_token_id": 2, "eos_token_id": 1, "tie_word_embeddings": True, "sliding_window": 512,
    "final_logit_softcapping": None, "attention_bias": False, "vocab_size_per_layer_input": 262_144,
    "hidden_size_per_layer_input": 256, "attention_k_eq_v": False, "num_kv_shared_layers": 0,
    "use_double_wide_mlp": False,
}
# The 12B (transformers' Gemma4Unified*): no per-layer embeddings (its config has no such fields), a longer
# window; the text model is otherwise Gemma 4's.
UNIFIED_DEFAULTS: dict[str, Any] = {"hidden_size_per_layer_input": 0, "sliding_window": 1024,
                                    "max_position_embeddings": 262_144}
MULTIMODAL = ("Gemma4ForConditionalGeneration", "Gemma4UnifiedForConditionalGeneration")   # by `unified`
GLOBAL_ROPE = {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}
LOCAL_ROPE = {"rope_type": "default", "rope_theta": 10_000.0}
DEFAULT_PATTERN = 6
LAYER_TYPES = ("sliding_attention", "full_attention")
# What transformers' per_layer_config may override on a full layer (its writer puts both there).
_FULL_LAYER_OVERRIDES = {"head_dim": "global_head_dim", "num_key_value_heads": "num_global_key_value_heads"}


def gemma4_text_config(hf: dict[str, Any], source: str) -> dict[str, Any]:
    """The text model's config with transformers' defaults filled in, RoPE spelled as for Gemma 3 (the full
    layers' base in rope_theta, the sliding layers' in rope_local_base_freq) plus the full layers' proportion."""
    # The -it releases' top level names the end of turn as an end token too ([1, 106]); their text_config <eos> only.
    whole_eos = hf.get("eos_token_id") if "text_config" in hf else None
    unified = any(a.startswith("Gemma4Unified") for a in hf.get("architectures") or [])
    hf = text_tower(hf, MULTIMODAL[unified], TEXT_DEFAULTS | (UNIFIED_DEFAULTS if unified else {}), source)
    out = dict(hf) | ({"eos_token_id": whole_eos} if whole_eos is not None else {})
    out |= _full_layer_overrides(out, source)
    params = dict(out.pop("rope_parameters", None) or {})
    full = GLOBAL_ROPE | dict(params.get("full_attention") or {})
    local = LOCAL_ROPE | dict(params.get("sliding_attention") or {})
    if full["rope_type"] not in ("proportional", "default") or local["rope_type"] != "default":
        raise CheckpointError(f"{source}: Gemma 4 RoPE types {full['rope_type']!r} (full layers) and "
                              f"{local['rope_type']!r} (sliding) are not supported; proportional and default are.")
    if float(full.get("factor", 1.0)) != 1.0:
        raise CheckpointError(f"{source}: a scaled proportional RoPE (factor {full['factor']}) is not supported.")
    out["rope_theta"] = float(full["rope_theta"])
    out["rope_local_base_freq"] = float(local["rope_theta"])
    out["rope_proportion"] = float(full["partial_rotary_factor"]) if full["rope_type"] == "proportional" else 1.0
    return out


def _full_layer_overrides(hf: dict[str, Any], source: str) -> dict[str, Any]:
    """The full layers' head width and KV head count from `per_layer_config`, where transformers (5.25) writes
    them in place of global_head_dim / num_global_key_value_heads (and reads them from there first); {} when
    the config has none. Only the same overrides on every full layer, and none on a sliding one, are read."""
    per_layer = hf.get("per_layer_config")
    if not per_layer:
        return {}
    types = layer_types(hf, LAYER_TYPES, DEFAULT_PATTERN, source)
    overrides = {int(i): dict(o) for i, o in per_layer.items()}
    full = [i for i, kind in enumerate(types[:-1]) if kind == "full_attention"] + [len(types) - 1]
    first = overrides.get(full[0], {})
    if set(overrides) != set(full) or any(overrides[i] != first for i in full) or set(first) - set(_FULL_LAYER_OVERRIDES):
        raise CheckpointError(f"{source}: per_layer_config {per_layer!r} is not supported: bie-trt reads the same "
                              f"{' and '.join(_FULL_LAYER_OVERRIDES)} on every full-attention layer, nothing else.")
    return {"global_head_dim": first.get("head_dim", hf["head_dim"]),
            "num_global_key_value_heads": first.get("num_key_value_heads")}


def gemma4_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
    """The ModelConfig fields of a Gemma 4 text config (after `gemma4_text_config`)."""
    if hf.get("enable_moe_block") or hf.get("num_experts"):
        raise CheckpointError(f"{source}: enable_moe_block is on (Gemma 4's mixture-of-experts models); bie-trt "
                              f"runs the dense Gemma 4 models.")
    # "vision": image tokens attend both ways among themselves, text stays causal (the 12B's default)
    if hf.get("use_bidirectional_attention") not in (None, "vision"):
        raise CheckpointError(f"{source}: use_bidirectional_attention={hf['use_bidirectional_attention']!r}; "
                              f"bie-trt runs causal decoders.")
    act = hf.get("hidden_activation") or hf.get("hidden_act")
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise CheckpointError(f"{source}: hidden_activation {act!r} is not supported for Gemma 4 "
                              f"(gelu_pytorch_tanh is).")
    types = list(layer_types(hf, LAYER_TYPES, DEFAULT_PATTERN, source))
    types[-1] = "full_attention"   # transformers forces the last layer full
    layers, shared = len(types), int(hf["num_kv_shared_layers"])
    owning = types[:layers - shared]
    if shared and (shared >= layers or set(types[layers - shared:]) - set(owning)):
        raise CheckpointError(f"{source}: num_kv_shared_layers={shared} leaves no earlier layer of some shared "
                              f"layer's type to read the cache of.")
    window = int(hf["sliding_window"])
    if window < 1:
        raise CheckpointError(f"{source}: sliding_window must be a positive number of positions; got {window}.")
    k_eq_v = bool(hf["attention_k_eq_v"])
    # transformers reads it only then, or from per_layer_config whenever that names it
    global_kv = hf.get("num_global_key_value_heads") if k_eq_v or hf.get("per_layer_config") else None
    global_dim = int(hf["global_head_dim"])
    proportion = float(hf["rope_proportion"])
    if int(proportion * global_dim // 2) < 1:
        raise CheckpointError(f"{source}: partial_rotary_factor {proportion} turns no channel of a "
                              f"{global_dim}-wide head.")
    per_layer = int(hf["hidden_size_per_layer_input"] or 0)
    cap = hf.get("final_logit_softcapping")
    return dict(hidden_act="gelu_tanh", sandwich_norms=True, embed_scale=float(hf["hidden_size"]) ** 0.5,
                query_pre_attn_scalar=1.0, final_logit_softcapping=None if cap is None else float(cap),
                sliding_window=window, layer_types=tuple(types), local_rope_theta=float(hf["rope_local_base_freq"]),
                global_head_dim=global_dim, global_num_kv_heads=int(global_kv or hf["num_key_value_heads"]),
                attention_k_eq_v=k_eq_v, value_norm=True, global_rope_proportion=proportion,
                num_kv_shared_layers=shared, double_wide_mlp=bool(hf["use_double_wide_mlp"]),
                per_layer_input_size=per_layer,
                per_layer_vocab_size=int(hf["vocab_size_per_layer_input"]) if per_layer else 0)


def read_gemma4(hf: dict[str, Any], source: str) -> tuple[dict[str, Any], dict[str, Any]]:
    text = gemma4_text_config(hf, source)
    return text, gemma4_fields(text, source)


FAMILY = ModelFamily(
    "gemma4", ("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration",
               # the 12B: Gemma 4's decoder without per-layer embeddings
               "Gemma4UnifiedForCausalLM", "Gemma4UnifiedForConditionalGeneration"), read_gemma4,
    # a reply ends at the end of the model's turn, or where it stops to wait for a tool's response (the caller
    # runs the tool and sends the response back); the -it releases name only <eos> and <turn|> as end tokens
    stop_tokens=("<turn|>", "<|tool_response>"),
    chat_template="gemma4",   # templates/chat_gemma4.jinja: the engine's template when a checkpoint has none
)
