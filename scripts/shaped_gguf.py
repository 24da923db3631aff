"""Write a GGUF file shaped as a real release (its header and tensor table, written by the `gguf` package)
without its weights: the tensor data is a sparse hole of the right length, so the file reads as the real
one does for everything that does not look at a weight (`bie-trt plan --checkpoint`, the config).

Tensor types follow llama.cpp's Q4_K_M recipe (llama_tensor_get_type): Q4_K everywhere, Q6_K for the
head and for attn_v and ffn_down in the first and last eighth of the layers and every third layer
between, F32 norms and biases; Q5_0 for Q4_K and Q8_0 for Q6_K where a row is not whole 256-weight
blocks (Gemma 3 1B's hidden 1,152).

    python scripts/shaped_gguf.py llama-3.1-8b /work/scratch/llama-3.1-8b-q4_k_m-shaped.gguf
    bie-trt plan --checkpoint /work/scratch/llama-3.1-8b-q4_k_m-shaped.gguf --profile rtx4060ti-8gb --max-model-len 65536
"""
from __future__ import annotations

import argparse
from pathlib import Path

import gguf
import numpy as np

Q4_K, Q6_K, F32 = gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K, gguf.GGMLQuantizationType.F32
# llama.cpp's fallback for a row whose length is not a whole number of 256-weight blocks
_FALLBACK = {Q4_K: gguf.GGMLQuantizationType.Q5_0, Q6_K: gguf.GGMLQuantizationType.Q8_0}
# The published configs: (architecture, header keys after the architecture prefix, vocabulary, tied head).
SHAPES: dict[str, tuple[str, dict, int, bool]] = {
    "llama-3.1-8b": ("llama", {"block_count": 32, "context_length": 131072, "embedding_length": 4096,
                               "feed_forward_length": 14336, "attention.head_count": 32,
                               "attention.head_count_kv": 8, "rope.freq_base": 500000.0,
                               "attention.layer_norm_rms_epsilon": 1e-5}, 128256, False),
    # with the YaRN scaling (factor 4 over 32,768 positions) Qwen's model card gives for long inputs, as the
    # 128K GGUF releases state it in their header
    "qwen2.5-7b": ("qwen2", {"block_count": 28, "context_length": 131072, "embedding_length": 3584,
                             "feed_forward_length": 18944, "attention.head_count": 28,
                             "attention.head_count_kv": 4, "rope.freq_base": 1000000.0,
                             "attention.layer_norm_rms_epsilon": 1e-6, "rope.scaling.type": "yarn",
                             "rope.scaling.factor": 4.0, "rope.scaling.original_context_length": 32768},
                   152064, False),
    "gemma-3-27b": ("gemma3", {"block_count": 62, "context_length": 131072, "embedding_length": 5376,
                               "feed_forward_length": 21504, "attention.head_count": 32,
                               "attention.head_count_kv": 16, "attention.key_length": 128,
                               "attention.value_length": 128, "attention.sliding_window": 1024,
                               "rope.freq_base": 1000000.0, "attention.layer_norm_rms_epsilon": 1e-6}, 262208, True),
    "gemma-3-1b": ("gemma3", {"block_count": 26, "context_length": 32768, "embedding_length": 1152,
                              "feed_forward_length": 6912, "attention.head_count": 4,
                              "attention.head_count_kv": 1, "attention.key_length": 256,
                              "attention.value_length": 256, "attention.sliding_window": 512,
                              "rope.freq_base": 1000000.0, "attention.layer_norm_rms_epsilon": 1e-6}, 262144, True),
}


def _more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's use_more_bits: the layers Q4_K_M gives Q6_K attn_v and ffn_down."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def tensor_table(arch: str, keys: dict, vocab: int, tied: bool) -> list[tuple[str, tuple[int, int] | tuple[int], gguf.GGMLQuantizationType]]:
    """(name, numpy-order shape, type) of every tensor of the release."""
    h, f, layers = keys["embedding_length"], keys["feed_forward_length"], keys["block_count"]
    heads, kv = keys["attention.head_count"], keys["attention.head_count_kv"]
    d = keys.get("attention.key_length", h // heads)
    table = [("token_embd.weight", (vocab, h), Q4_K), ("output_norm.weight", (h,), F32)]
    if not tied:
        table.append(("output.weight", (vocab, h), Q6_K))
    norms = ["attn_norm", "ffn_norm"] + (["post_attention_norm", "post_ffw_norm"] if arch == "gemma3" else [])
    for i in range(layers):
        p, wide = f"blk.{i}.", Q6_K if _more_bits(i, layers) else Q4_K
        table += [(p + "attn_q.weight", (heads * d, h), Q4_K), (p + "attn_k.weight", (kv * d, h), Q4_K),
                  (p + "attn_v.weight", (kv * d, h), wide), (p + "attn_output.weight", (h, heads * d), Q4_K),
                  (p + "ffn_gate.weight", (f, h), Q4_K), (p + "ffn_up.weight", (f, h), Q4_K),
                  (p + "ffn_down.weight", (h, f), wide)]
        table += [(p + f"{n}.weight", (h,), F32) for n in norms]
        if arch == "qwen2":
            table += [(p + f"attn_{x}.bias", (n,), F32) for x, n in (("q", heads * d), ("k", kv * d), ("v", kv * d))]
        if arch == "gemma3":
            table += [(p + f"attn_{x}_norm.weight", (d,), F32) for x in "qk"]
    return [(n, shape, _FALLBACK[kind] if kind in _FALLBACK and shape[-1] % 256 else kind)
            for n, shape, kind in table]


def write_shaped_gguf(name: str, path: Path) -> Path:
    arch, keys, vocab, tied = SHAPES[name]
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in {**keys, "vocab_size": vocab}.items():
        kind = (gguf.GGUFValueType.STRING if isinstance(value, str) else
                gguf.GGUFValueType.FLOAT32 if isinstance(value, float) else gguf.GGUFValueType.UINT32)
        w.add_key_value(f"{arch}.{key}", value, kind)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    data = 0
    for tensor, shape, kind in tensor_table(arch, keys, vocab, tied):
        weights, size = gguf.GGML_QUANT_SIZES[kind]
        nbytes = int(np.prod(shape)) // weights * size
        w.add_tensor_info(tensor, shape, np.dtype(np.float32), nbytes, raw_dtype=kind)
        data += gguf.GGUFWriter.ggml_pad(nbytes, w.data_alignment)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    with open(path, "r+b") as f:   # the tensor data: a hole, as long as the table says
        f.truncate(gguf.GGUFWriter.ggml_pad(f.seek(0, 2), w.data_alignment) + data)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("out", type=Path)
    args = ap.parse_args()
    path = write_shaped_gguf(args.shape, args.out)
    print(f"{path}: {path.stat().st_size:,} bytes ({SHAPES[args.shape][0]}, Q4_K_M-shaped, no weights)")


if __name__ == "__main__":
    main()
