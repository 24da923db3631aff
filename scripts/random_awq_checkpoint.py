"""Write a random AutoAWQ-gemm checkpoint with a real model's shapes (Meta-Llama-3-8B by default):
a build, a plan or a load at full scale without downloading 5 GB of weights.

Random int32 words are valid packed 4-bit codes, so nothing is quantised; fp16 embedding and head,
one safetensors shard per layer, and the tiny word-level tokenizer of `bie_trt.model.synthetic`.

    python scripts/random_awq_checkpoint.py --out /tmp/llama3-8b-random
    bie-trt build --checkpoint /tmp/llama3-8b-random --profile rtx4060ti-8gb --max-model-len 65536 --out /tmp/e8b
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from bie_trt.model.synthetic import LLAMA3_8B_HF, write_word_tokenizer


def awq_linear(k: int, n: int, group: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    """AutoAWQ gemm tensors of an in=k, out=n linear: qweight [k, n/8], qzeros [k/G, n/8], scales [k/G, n]."""
    return {"qweight": torch.randint(-2**31, 2**31 - 1, (k, n // 8), dtype=torch.int32, generator=g),
            "qzeros": torch.randint(-2**31, 2**31 - 1, (k // group, n // 8), dtype=torch.int32, generator=g),
            "scales": (torch.rand(k // group, n, generator=g) * 0.01 + 0.001).half()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--config", type=Path, help="an HF config.json to copy the shapes of (default: Llama-3-8B)")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--config-only", action="store_true",
                    help="write config.json and the tokenizer, no weights: enough for `bie-trt plan`")
    args = ap.parse_args()
    hf = json.loads(args.config.read_text()) if args.config else dict(LLAMA3_8B_HF)
    hf.update(model_type="llama", bos_token_id=1, eos_token_id=2, torch_dtype="float16",
              quantization_config={"quant_method": "awq", "bits": 4, "group_size": args.group_size,
                                   "version": "gemm", "zero_point": True})
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "config.json").write_text(json.dumps(hf, indent=2))
    write_word_tokenizer(args.out)
    if args.config_only:
        print(f"wrote {args.out} (config and tokenizer only)")
        return
    g = torch.Generator().manual_seed(args.seed)
    h, inter, v = hf["hidden_size"], hf["intermediate_size"], hf["vocab_size"]
    head_dim = h // hf["num_attention_heads"]
    q, kv = hf["num_attention_heads"] * head_dim, hf["num_key_value_heads"] * head_dim
    outer = {"model.embed_tokens.weight": (torch.randn(v, h, generator=g) * 0.02).half(),
             "model.norm.weight": torch.ones(h, dtype=torch.float16)}
    if not hf.get("tie_word_embeddings"):
        outer["lm_head.weight"] = (torch.randn(v, h, generator=g) * 0.02).half()
    save_file(outer, str(args.out / "model-00000.safetensors"))
    shapes = {"self_attn.q_proj": (h, q), "self_attn.k_proj": (h, kv), "self_attn.v_proj": (h, kv),
              "self_attn.o_proj": (q, h), "mlp.gate_proj": (h, inter), "mlp.up_proj": (h, inter),
              "mlp.down_proj": (inter, h)}
    for layer in tqdm(range(hf["num_hidden_layers"]), desc="layers", unit="layer"):
        p = f"model.layers.{layer}."
        tensors = {p + "input_layernorm.weight": torch.ones(h, dtype=torch.float16),
                   p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.float16)}
        for name, (k, n) in shapes.items():
            tensors.update({f"{p}{name}.{key}": t for key, t in awq_linear(k, n, args.group_size, g).items()})
        save_file(tensors, str(args.out / f"model-{layer + 1:05d}.safetensors"))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
