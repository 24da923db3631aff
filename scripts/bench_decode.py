"""Decode tokens/s and chunked prefill at Llama-3-8B shapes, under an 8 GiB cap, on one GPU.

Random AWQ-shaped weights in the runtime layout (no checkpoint needed), the memory plan's
placement (int8 lm_head, embedding rows from pinned host memory), KV pools sized by the plan,
decode replayed from CUDA graphs. For each context (4k / 32k / 64k) and KV dtype it reports
tokens/s, the roofline (weights + KV bytes a step reads ÷ bandwidth), its fraction, and peak
memory; then a chunked prefill of a --prefill-len prompt with its peak activation memory.

    python scripts/bench_decode.py --out benchmarks/results/decode.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from bie_trt.config import KVCacheConfig, ModelConfig, SamplingParams
from bie_trt.executor.block_manager import BlockManager
from bie_trt.executor.cuda_graphs import DecodeGraphs
from bie_trt.executor.sequence import Sequence
from bie_trt.kernels.int8_rows import quantize_rows_int8
from bie_trt.kv.pool import allocate_pools, encode_quant_block
from bie_trt.model.llama import LlamaModel, SeqInput
from bie_trt.plan import kv_bytes_per_token, kv_pool_blocks
from bie_trt.sampling import make_generator

GiB = 2**30
LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
             "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
             "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
             "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 8192}, "tie_word_embeddings": False}


def random_weights(cfg: ModelConfig, group: int = 128) -> dict[str, torch.Tensor]:
    """Runtime-layout tensors with AWQ-like statistics (scales ~1e-2, zero points near 8)."""
    g = torch.Generator().manual_seed(0)
    w = {"embed_tokens": (torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g) * 0.02).half(),
         "norm": torch.ones(cfg.hidden_size, dtype=torch.float16)}
    q, s = quantize_rows_int8(torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g) * 0.02)
    w.update({"lm_head.q": q, "lm_head.scale": s})
    shapes = {"qkv": (cfg.q_size + 2 * cfg.kv_size, cfg.hidden_size), "o": (cfg.hidden_size, cfg.q_size),
              "gate_up": (2 * cfg.intermediate_size, cfg.hidden_size), "down": (cfg.hidden_size, cfg.intermediate_size)}
    for i in range(cfg.num_layers):
        w[f"layers.{i}.attn_norm"] = torch.ones(cfg.hidden_size, dtype=torch.float16)
        w[f"layers.{i}.mlp_norm"] = torch.ones(cfg.hidden_size, dtype=torch.float16)
        for name, (n, k) in shapes.items():
            w[f"layers.{i}.{name}.qweight"] = torch.randint(-2**31, 2**31 - 1, (n, k // 8), dtype=torch.int32, generator=g)
            w[f"layers.{i}.{name}.scales"] = (torch.rand(n, k // group, generator=g) * 0.02 + 0.005).half()
            w[f"layers.{i}.{name}.zeros"] = torch.randint(6, 10, (n, k // group), dtype=torch.uint8, generator=g)
    return w


def weight_bytes(model: LlamaModel) -> int:
    total = sum(t.nbytes for layer in model.layers for lin in layer.linears.values()
                for t in (lin.qweight, lin.scales, lin.zeros))
    return total + model.lm_head.q.nbytes + model.lm_head.scale.nbytes


def fill_cache(pools, context: int, kv: KVCacheConfig) -> list[int]:
    """A block table for `context` tokens: FP16 sinks and recent window, the body quantised."""
    for name, t in pools.tensors().items():
        if name in ("k", "v"):
            t.normal_(0, 0.5)
        elif t.dtype == torch.float8_e4m3fn:
            t.view(torch.uint8).random_(0, 120)   # finite e4m3 codes
        elif name.endswith("_q"):
            t.random_(0, 256)
        else:
            t.uniform_(0.005, 0.02)                # scales and zeros
    blocks = -(-context // kv.block_size)
    if kv.dtype == "fp16":
        return list(range(blocks))
    sinks = -(-kv.sink_tokens // kv.block_size)
    tail = -(-kv.window // kv.block_size) + 1
    body = blocks - sinks - tail
    return list(range(sinks)) + [encode_quant_block(i) for i in range(body)] + list(range(sinks, sinks + tail))


def bench_decode(model, cfg, kv, context, bandwidth, steps) -> dict:
    n_fp, n_q = kv_pool_blocks(cfg, kv, context, 1, 512)
    torch.cuda.reset_peak_memory_stats()
    pools = allocate_pools(cfg, kv, n_fp, n_q, torch.float16, "cuda", scratch_block=True)
    table = fill_cache(pools, context, kv)
    graphs = DecodeGraphs(model, pools, [1], context, pools.scratch_block)
    step = [SeqInput(torch.tensor([1]), context - 1, table)]
    for _ in range(3):
        graphs.run(step)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        graphs.run(step)
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / steps
    read = weight_bytes(model) + context * kv_bytes_per_token(cfg, kv)
    roofline = bandwidth / read
    result = {"context": context, "kv": kv.dtype, "tokens_per_s": 1 / seconds, "ms_per_token": 1e3 * seconds,
              "bytes_per_token": read, "roofline_tokens_per_s": roofline, "roofline_fraction": (1 / seconds) / roofline,
              "peak_memory_gib": torch.cuda.max_memory_allocated() / GiB}
    del graphs, pools
    torch.cuda.empty_cache()
    return result


def bench_prefill(model, cfg, kv, length: int, chunk: int) -> dict:
    """A `length`-token prompt in `chunk`-token pieces, blocks leaving the window quantised as it goes."""
    n_fp, n_q = kv_pool_blocks(cfg, kv, length, 1, chunk)
    pools = allocate_pools(cfg, kv, n_fp, n_q, torch.float16, "cuda")
    blocks = BlockManager(kv, n_fp, n_q)
    ids = torch.randint(0, cfg.vocab_size, (length,)).tolist()
    seq = Sequence(ids, SamplingParams(), make_generator(SamplingParams(), 0))
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for pos in range(0, length, chunk):
        part = ids[pos:pos + chunk]
        blocks.grow(seq, pos + len(part))
        model.forward([SeqInput(torch.tensor(part), pos, seq.block_table)], pools)
        seq.num_cached = pos + len(part)
        blocks.compact(seq, pools)
    torch.cuda.synchronize()
    return {"prompt_tokens": length, "chunk": chunk, "kv": kv.dtype, "seconds": time.perf_counter() - start,
            "tokens_per_s": length / (time.perf_counter() - start),
            "peak_activation_mib": (torch.cuda.max_memory_allocated() - base) / 2**20,
            "peak_memory_gib": torch.cuda.max_memory_allocated() / GiB}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="4096,32768,65536")
    ap.add_argument("--kv", default="int4_asym,fp16")
    ap.add_argument("--cap-gib", type=float, default=8.0, help="emulate a card of this size")
    ap.add_argument("--bandwidth", type=float, default=4.3e12, help="bytes/s for the roofline")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--prefill-len", type=int, default=65536)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/decode.json"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_decode needs a CUDA GPU (none here); see scripts/device_check.sh.", file=sys.stderr)
        sys.exit(2)
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * GiB / total))
    cfg = ModelConfig.from_hf(LLAMA3_8B)
    model = LlamaModel(cfg, random_weights(cfg), torch.device("cuda"), torch.float16, embedding_on_host=True)
    rows = []
    for dtype in args.kv.split(","):
        kv = KVCacheConfig(dtype=dtype)
        for ctx in map(int, args.contexts.split(",")):
            try:
                row = bench_decode(model, cfg, kv, ctx, args.bandwidth, args.steps)
            except torch.OutOfMemoryError:
                row = {"context": ctx, "kv": dtype, "error": f"does not fit under {args.cap_gib} GiB"}
                torch.cuda.empty_cache()
            rows.append(row)
            print(json.dumps(row), flush=True)
    prefill = bench_prefill(model, cfg, KVCacheConfig(dtype="int4_asym"), args.prefill_len, 512)
    print(json.dumps(prefill), flush=True)
    out = {"gpu": torch.cuda.get_device_name(), "cap_gib": args.cap_gib, "bandwidth": args.bandwidth,
           "torch": torch.__version__, "decode": rows, "prefill": prefill,
           "date": time.strftime("%Y-%m-%d")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
