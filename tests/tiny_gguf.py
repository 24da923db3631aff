"""A tiny random Llama written as a GGUF file by the `gguf` package itself (GGUFWriter, gguf.quants.quantize),
laid out as llama.cpp's converter lays it out (q/k rows interleaved for its RoPE), with the first 1,024 tokens
of SmolLM2's tokenizer copied from the bundled GGUF's metadata."""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import gguf
import numpy as np

from bie_trt.builder.checkpoint.registry import BUILTIN, _gguf_path

TINY_GGUF = dict(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, context=1024)
QWEN3_HEAD_DIM = 128   # q_size 512 over hidden 64, as Qwen3's head_dim is its own
# Gemma 3: six layers (five sliding over 16 positions, then a full one: transformers' default pattern),
# heads of 32 over hidden 64, its RoPE base for the full layers; the sliding layers' 10,000 is implied.
GEMMA3_GGUF = {"block_count": 6, "attention.sliding_window": 16, "attention.key_length": 32,
               "attention.value_length": 32, "rope.freq_base": 1_000_000.0, "attention.layer_norm_rms_epsilon": 1e-6}


@lru_cache(maxsize=1)
def smollm2_tokenizer_fields(vocab: int = 1024) -> dict:
    """SmolLM2's first `vocab` tokens (its special tokens and bytes come first) and the merges among
    them: a real byte-level BPE, small enough that every reader of the file is quick."""
    r = gguf.GGUFReader(_gguf_path(BUILTIN["smollm2-135m"]))
    fields = {k: r.fields[f"tokenizer.{k}"].contents() for k in
              ("ggml.tokens", "ggml.token_type", "ggml.merges", "chat_template")}
    tokens = fields["ggml.tokens"][:vocab]
    kept = set(tokens)
    fields["ggml.tokens"], fields["ggml.token_type"] = tokens, fields["ggml.token_type"][:vocab]
    fields["ggml.merges"] = [m for m in fields["ggml.merges"]
                             if m.count(" ") == 1 and {*m.split(" "), m.replace(" ", "")} <= kept]
    return fields


def _llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's permute of a q or k projection's rows."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# Random blocks' super-scales for the K-quants (which the `gguf` package cannot quantise to): weights of
# about the size of 0.05-sigma ones, every other byte (codes, 6-bit scales and minimums) uniformly random.
_K_SCALES = {"Q4_K": (1e-4, 8e-4), "Q5_K": (5e-5, 8e-4), "Q6_K": (2.5e-5, None)}


def k_quant_bytes(rng: np.random.Generator, kind: str, rows: int, cols: int) -> np.ndarray:
    """A random Q4_K / Q5_K / Q6_K tensor's bytes [rows, row bytes]: its codes and scales in every bit pattern."""
    weights, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    raw = rng.integers(0, 256, size=(rows * cols // weights, size), dtype=np.uint8)
    d, dmin = _K_SCALES[kind]
    scales = (d * rng.uniform(0.5, 1.5, raw.shape[0])).astype(np.float16).view(np.uint8).reshape(-1, 2)
    if kind == "Q6_K":   # d last
        raw[:, -2:] = scales
    else:                # d, then dmin, first
        raw[:, 0:2] = scales
        raw[:, 2:4] = (dmin * rng.uniform(0.5, 1.5, raw.shape[0])).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


def write_tiny_gguf(path: Path, linear_type: str | dict[str, str] = "Q4_0", seed: int = 0, arch: str = "llama",
                    chat_template: bool = True, metadata: dict | None = None,
                    rope_freqs: np.ndarray | None = None, hidden: int = TINY_GGUF["hidden"],
                    intermediate: int = TINY_GGUF["intermediate"]) -> Path:
    """Linear weights in `linear_type` (or a type for each of attn_q, attn_k, attn_v, attn_output, ffn_gate,
    ffn_up, ffn_down: a dict), the embedding and head in Q8_0, norms in F32. K-quants (random blocks) need
    in-features of 256: hidden=256, intermediate=512. `metadata` overrides
    (or adds) header keys after the architecture prefix, e.g. {"feed_forward_length": 256}, or leaves one out
    (a value of None: {"rope.freq_base": None}); `rope_freqs`
    is written as llama.cpp writes Llama 3's RoPE scaling. A gemma3 file has GEMMA3_GGUF's keys, a tied
    head, four norms a layer and q/k head norms, each stored as llama.cpp's converter stores a Gemma
    norm: 1 + w."""
    c = TINY_GGUF
    rng = np.random.default_rng(seed)
    tok = smollm2_tokenizer_fields()
    vocab = len(tok["ggml.tokens"])
    w = gguf.GGUFWriter(str(path), arch)
    keys = {"block_count": c["layers"], "context_length": c["context"], "embedding_length": hidden,
            "feed_forward_length": intermediate, "attention.head_count": c["heads"],
            "attention.head_count_kv": c["kv_heads"], "attention.layer_norm_rms_epsilon": 1e-5,
            "rope.freq_base": 10000.0, "vocab_size": vocab,
            # Qwen3 files state head_dim; transformers' GGUF reader ignores it and takes Qwen3's 128
            **({"attention.key_length": QWEN3_HEAD_DIM} if arch == "qwen3" else {}),
            **(GEMMA3_GGUF if arch == "gemma3" else {}), **(metadata or {})}
    for key, value in keys.items():
        if value is None:
            continue
        kind = gguf.GGUFValueType.FLOAT32 if isinstance(value, float) else gguf.GGUFValueType.UINT32
        w.add_key_value(f"{arch}.{key}", value, kind)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tok["ggml.tokens"])
    w.add_token_types(tok["ggml.token_type"])
    w.add_token_merges(tok["ggml.merges"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if arch == "gemma3":   # transformers saves its tokenizer as a GemmaTokenizer, which needs one
        w.add_unk_token_id(0)
    if chat_template:
        w.add_chat_template(tok["chat_template"])
    linear_types = linear_type if isinstance(linear_type, dict) else {}

    def qtype(name: str) -> gguf.GGMLQuantizationType:
        return gguf.GGMLQuantizationType[linear_types.get(name, "Q4_0") if linear_types else linear_type]

    def rnd(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    def add(name: str, t: np.ndarray, kind: gguf.GGMLQuantizationType) -> None:
        if kind == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, t)
        elif kind.name.endswith("_K"):   # the gguf package has no K-quant quantiser: random blocks of t's shape
            w.add_tensor(name, k_quant_bytes(rng, kind.name, *t.shape), raw_dtype=kind)
        else:
            w.add_tensor(name, gguf.quants.quantize(t, kind), raw_dtype=kind)

    h, i = hidden, intermediate
    d = keys.get("attention.key_length", h // c["heads"])
    add("token_embd.weight", rnd(vocab, h), gguf.GGMLQuantizationType.Q8_0)
    if arch != "gemma3":   # Gemma ties its head to the embedding
        add("output.weight", rnd(vocab, h), gguf.GGMLQuantizationType.Q8_0)
    add("output_norm.weight", 1 + rnd(h), gguf.GGMLQuantizationType.F32)
    if rope_freqs is not None:
        add("rope_freqs.weight", rope_freqs.astype(np.float32), gguf.GGMLQuantizationType.F32)
    # llama.cpp interleaves a Llama's q/k rows for its RoPE; Qwen files keep transformers' order
    q_rows, k_rows = ((lambda w: _llama_cpp_permute(w, c["heads"]), lambda w: _llama_cpp_permute(w, c["kv_heads"]))
                      if arch == "llama" else (lambda w: w, lambda w: w))
    for layer in range(keys["block_count"]):
        p = f"blk.{layer}."
        add(p + "attn_q.weight", q_rows(rnd(c["heads"] * d, h)), qtype("attn_q"))
        add(p + "attn_k.weight", k_rows(rnd(c["kv_heads"] * d, h)), qtype("attn_k"))
        if arch == "qwen2":
            for x, n in (("q", c["heads"] * d), ("k", c["kv_heads"] * d), ("v", c["kv_heads"] * d)):
                add(p + f"attn_{x}.bias", rnd(n), gguf.GGMLQuantizationType.F32)
        if arch in ("qwen3", "gemma3"):
            for x in "qk":
                add(p + f"attn_{x}_norm.weight", 1 + rnd(d), gguf.GGMLQuantizationType.F32)
        add(p + "attn_v.weight", rnd(c["kv_heads"] * d, h), qtype("attn_v"))
        add(p + "attn_output.weight", rnd(h, c["heads"] * d), qtype("attn_output"))
        add(p + "ffn_gate.weight", rnd(i, h), qtype("ffn_gate"))
        add(p + "ffn_up.weight", rnd(i, h), qtype("ffn_up"))
        add(p + "ffn_down.weight", rnd(h, i), qtype("ffn_down"))
        add(p + "attn_norm.weight", 1 + rnd(h), gguf.GGMLQuantizationType.F32)
        add(p + "ffn_norm.weight", 1 + rnd(h), gguf.GGMLQuantizationType.F32)
        if arch == "gemma3":
            for norm in ("post_attention_norm", "post_ffw_norm"):
                add(p + f"{norm}.weight", 1 + rnd(h), gguf.GGMLQuantizationType.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
