"""A tiny random Gemma 4 as transformers builds it, with every Gemma 4 difference on: six layers (sliding,
sliding, full, sliding | sliding, full) of which the last two share the KV of layers 3 and 2, a 24-position
window, 32-wide sliding heads and 64-wide full ones with their own KV head count, keys reused as values on the
full layers, proportional RoPE (a quarter) there, per-layer embeddings, doubled MLPs on the shared layers,
layer scalars, soft-capped logits. Linears whose values W4 holds exactly (every group spans codes 0..15) and
every value one fp16 holds, so the engine (built, or from the state dict) and transformers run the same weights. And the engine's side: the decoder over an FP16 cache."""
from __future__ import annotations

import torch

from bie_trt.builder.checkpoint.gemma4_weights import runtime_weights
from bie_trt.config import KVCacheConfig, ModelConfig
from bie_trt.kv.pool import allocate_kv
from bie_trt.model.llama import LlamaModel
from hf_reference import greedy_reference
from qwen35_tiny import GROUP, exact_w4

WINDOW = 24
PROMPT_TOKENS = 100      # four windows, not a whole number of 16-token blocks
GREEDY_TOKENS = 8
TINY_GEMMA4 = {
    "architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text", "vocab_size": 256, "hidden_size": 64,
    "intermediate_size": 64, "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 32, "global_head_dim": 64, "num_global_key_value_heads": 1, "attention_k_eq_v": True,
    "num_kv_shared_layers": 2, "use_double_wide_mlp": True, "hidden_size_per_layer_input": 16,
    "vocab_size_per_layer_input": 256, "sliding_window": WINDOW, "final_logit_softcapping": 30.0,
    "rms_norm_eps": 1e-6, "max_position_embeddings": 1024, "tie_word_embeddings": True,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
                    "sliding_attention", "full_attention"],
    "rope_parameters": {"full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                           "rope_theta": 10000.0},
                        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}},
}


# The 12B's text model (transformers' Gemma4Unified): the same without per-layer embeddings.
TINY_GEMMA4_UNIFIED = {k: v for k, v in TINY_GEMMA4.items() if "per_layer" not in k} | {
    "architectures": ["Gemma4UnifiedForCausalLM"], "model_type": "gemma4_unified_text"}


def hf_tiny_gemma4(seed: int = 0, config: dict = TINY_GEMMA4):
    """transformers' Gemma4ForCausalLM (or Gemma4UnifiedForCausalLM, by `config`) with random weights (fp32,
    eager attention)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = {k: v for k, v in config.items() if k != "architectures"}
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg),
                                             attn_implementation="eager").float().eval()
    assert type(model).__name__ == config["architectures"][0]
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2 and "embed" not in name and "per_layer" not in name:
                p.copy_(exact_w4(*p.shape, g))
            elif name.endswith("norm.weight"):   # plain-weight norms: away from their defaults
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:   # the embeddings and the per-layer projections
                p.copy_(torch.randn(p.shape, generator=g) * (0.1 if "per_layer" in name else 1.0))
            p.copy_(p.half().float())   # values fp16 holds, as a checkpoint (and the built engine) stores them
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_((0.5 + torch.rand(b.shape, generator=g)).half().float())
    return model


def gemma4_reference() -> tuple[object, list[int], list[int], torch.Tensor]:
    """(the tiny model, a prompt of PROMPT_TOKENS, transformers' greedy continuation of GREEDY_TOKENS, its logits
    over prompt and continuation): what the decoder and the built engine are compared with."""
    model = hf_tiny_gemma4()
    return (model, *greedy_reference(model, PROMPT_TOKENS, GREEDY_TOKENS))


def engine_model(hf_model, blocks: int = 64, config: dict = TINY_GEMMA4) -> tuple[LlamaModel, object]:
    """The engine's decoder on the same weights (`config` read as the engine reads it), and its cache:
    FP16-format KV (fp32 storage, as the CPU path keeps activations), `blocks` blocks in each group."""
    cfg = ModelConfig.from_hf(config)
    state = {k: v.detach() for k, v in hf_model.state_dict().items()}
    model = LlamaModel(cfg, runtime_weights(cfg, state, GROUP), torch.device("cpu"), torch.float32)
    pools = allocate_kv(cfg, KVCacheConfig(dtype="fp16"), blocks, 0, blocks, dtype=torch.float32)
    return model, pools
