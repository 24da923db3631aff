"""A tiny random Qwen3.5 (both layer kinds, GQA in both, partial rotary) as transformers builds it, with
linears whose values W4 holds exactly (every group spans codes 0..15, so rounding them to W4 gives them
back): the engine and transformers then run the same weights. And the engine's side of it: the decoder
over an FP16 cache and recurrent state slots."""
from __future__ import annotations

import torch

from bie_trt.builder.checkpoint.qwen35_weights import runtime_weights
from bie_trt.config import KVCacheConfig, ModelConfig
from bie_trt.kv.pool import allocate_kv
from bie_trt.kv.recurrent import allocate_recurrent
from bie_trt.model.llama import LlamaModel
from hf_reference import greedy_reference

GROUP = 32
PROMPT_TOKENS = 150      # three 48-token chunks and a part; the delta rule's 64-token chunks, and a part
CHUNK = 48
GREEDY_TOKENS = 8
TINY_QWEN35 = {
    "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "vocab_size": 256, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 32, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
    "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    # full attention in layers 1 and 3: each cache group holds two layers, interleaved
    "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
}


def exact_w4(out_features: int, in_features: int, g: torch.Generator) -> torch.Tensor:
    q = torch.randint(0, 16, (out_features, in_features // GROUP, GROUP), generator=g)
    q[..., 0], q[..., 1] = 0, 15
    zeros = torch.randint(0, 16, (out_features, in_features // GROUP, 1), generator=g)
    scales = (torch.rand(out_features, in_features // GROUP, 1, generator=g) + 0.5) * (0.5 / in_features ** 0.5)
    # scales of 6 significant bits: each (q - zero) * scale (at most 10 bits) is then exact in fp16 as well, so
    # the fp16 checkpoint holds these very weights
    mantissa, exponent = torch.frexp(scales)
    scales = torch.ldexp(torch.round(mantissa * 64) / 64, exponent)
    return ((q - zeros) * scales).reshape(out_features, in_features)


def hf_tiny_qwen35(seed: int = 0):
    """transformers' Qwen3_5ForCausalLM with random weights (fp32, eager attention), each a value fp16 holds
    (as a checkpoint stores them) but A_log and dt_bias, which the engine keeps in fp32."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(TINY_QWEN35)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2 and "embed" not in name and "lm_head" not in name:
                p.copy_(exact_w4(*p.shape, g))
            elif name.endswith("norm.weight"):   # (1 + w) norms and the gated norm: away from their defaults
                p.copy_(1.0 * ("linear_attn.norm" in name) + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("A_log"):   # slow decays (exp(A_log) 0.002..0.02, not transformers' 0..16): the
                # state keeps what came hundreds of tokens back, so a state restored wrong shows in the tokens
                p.copy_(torch.log(0.002 + 0.018 * torch.rand(p.shape, generator=g)))
            elif "conv1d" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif name.endswith("embed_tokens.weight") or name.endswith("lm_head.weight"):
                p.copy_(torch.randn(p.shape, generator=g))
            if not name.endswith(("A_log", "dt_bias")):
                p.copy_(p.half().float())
    return model


def qwen35_reference() -> tuple[object, list[int], list[int], torch.Tensor]:
    """(the tiny model, a prompt of PROMPT_TOKENS, transformers' greedy continuation of GREEDY_TOKENS, its logits
    over prompt and continuation): what the decoder and the built engine are compared with."""
    model = hf_tiny_qwen35()
    return (model, *greedy_reference(model, PROMPT_TOKENS, GREEDY_TOKENS))


def engine_model(hf_model, slots: int = 2, blocks: int = 64) -> tuple[LlamaModel, object]:
    """The engine's decoder on the same weights, and its cache: FP16-format KV (fp32 storage, as the CPU path
    keeps activations) and `slots` recurrent state slots."""
    cfg = ModelConfig.from_hf(TINY_QWEN35)
    state = {k: v.detach() for k, v in hf_model.state_dict().items()}
    weights = runtime_weights(cfg, state, GROUP)
    model = LlamaModel(cfg, weights, torch.device("cpu"), torch.float32)
    pools = allocate_kv(cfg, KVCacheConfig(dtype="fp16"), blocks, 0, 0, dtype=torch.float32)
    pools.recurrent = allocate_recurrent(cfg, slots, dtype=torch.float32)
    return model, pools
