"""The KV cache's host tier, measured; JSON on stdout (and --out).

Engine mode: a long prompt A, then B (as long, evicting A from a device pool sized for one of them),
then A again, once with the host tier and once without: the time to first token of A's return is a
copy back from host memory in the first run and a re-prefill in the second. Also the tokens of both
returns (they must be equal) and what the tier copied.

    python scripts/bench_host_tier.py --engine engines/smollm2 --prompt-tokens 1800 --out host_tier_cpu.json

Copy mode (--copy): offload and restore every block of a quantised pool at a model's shapes (default
Llama-3-8B, INT4 body: 4,096 blocks are a 64k-token document) through the runner's host pool; on a GPU
the host side is pinned memory, so this is PCIe bandwidth and the time a 64k document takes to come back.

    python scripts/bench_host_tier.py --copy --blocks 4096 --out host_tier_copy.json
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

from bie_trt.config import KVCacheConfig, ModelConfig
from report import emit

LLAMA3_8B = ModelConfig(architecture="LlamaForCausalLM", hidden_size=4096, intermediate_size=14336, num_layers=32,
                        num_heads=32, num_kv_heads=8, head_dim=128, vocab_size=128256, rms_norm_eps=1e-5,
                        rope_theta=5e5, max_position_embeddings=131072, tie_word_embeddings=False)


def a_b_a(engine_dir: str, prompt_tokens: int, host_gb: float, device: str, seed: int) -> dict:
    """A, B, A on an engine whose pools hold about one of them; the return's numbers."""
    from bie_trt import BieEngine, EngineConfig, SamplingParams

    engine = BieEngine(EngineConfig(engine_dir=engine_dir, device=device, max_num_seqs=1,
                                    max_model_len=prompt_tokens + 64, host_kv_cache_gb=host_gb,
                                    speculative={"method": "none"}))
    vocab = engine.core.runner.model_config.vocab_size
    rng = random.Random(seed)
    a, b = ([rng.randrange(10, vocab) for _ in range(prompt_tokens)] for _ in range(2))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine.generate(a[:32], params)   # first-call costs out of the way
    engine.reset_prefix_cache()
    first = engine.generate(a, params)
    engine.generate(b, params)
    back = engine.generate(a, params)
    stats = engine.stats()
    return {"ttft_first_s": round(first.time_to_first_token_s, 4),
            "ttft_return_s": round(back.time_to_first_token_s, 4),
            "cached_tokens": back.usage.cached_tokens, "token_ids": back.token_ids, "host_kv": stats.host_kv,
            "pools": stats.kv_blocks}


def bench_engine(args: argparse.Namespace) -> dict:
    tier = a_b_a(args.engine, args.prompt_tokens, args.host_kv_cache_gb, args.device, args.seed)
    recompute = a_b_a(args.engine, args.prompt_tokens, 0, args.device, args.seed)
    return {"mode": "engine", "engine": args.engine, "device": args.device, "prompt_tokens": args.prompt_tokens,
            "with_host_tier": tier, "without_host_tier": recompute,
            "ttft_return_speedup": round(recompute["ttft_return_s"] / tier["ttft_return_s"], 2),
            "same_tokens": tier["token_ids"] == recompute["token_ids"]}


def bench_copy(args: argparse.Namespace) -> dict:
    from bie_trt.kv.host_pool import HostPool, block_bytes
    from bie_trt.kv.pool import allocate_pools, encode_quant_block

    device = torch.device("cuda" if args.device in ("auto", "cuda") and torch.cuda.is_available() else "cpu")
    kv = KVCacheConfig(dtype="int4_asym", group_size=64, sink_tokens=8, window=128)
    pools = allocate_pools(LLAMA3_8B, kv, 1, args.blocks, torch.float16, device)
    pools.k_pack.random_(0, 255)
    pools.v_pack.random_(0, 255)
    host = HostPool(pools)
    entries = [encode_quant_block(b) for b in range(args.blocks)]

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def timed(fn) -> float:
        sync()
        start = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - start

    before = pools.k_pack.clone()
    out_s = timed(lambda: [host.offload(e, i) for i, e in enumerate(entries)])
    pools.k_pack.zero_()
    in_s = timed(lambda: [host.restore(i, e) for i, e in enumerate(entries)])
    assert torch.equal(pools.k_pack, before), "a restored block differs from the one offloaded"
    size = block_bytes(pools)[True] * args.blocks
    return {"mode": "copy", "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "pinned": host.pin, "shapes": "Llama-3-8B, INT4 body (group 64)", "blocks": args.blocks,
            "tokens": args.blocks * kv.block_size, "bytes": size, "offload_s": round(out_s, 4),
            "restore_s": round(in_s, 4), "offload_gb_s": round(size / out_s / 1e9, 2),
            "restore_gb_s": round(size / in_s / 1e9, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", help="Engine directory (engine mode).")
    ap.add_argument("--copy", action="store_true", help="Copy mode: a quantised pool's blocks down and back.")
    ap.add_argument("--device", default="cpu", help="cpu, cuda or auto.")
    ap.add_argument("--prompt-tokens", type=int, default=1800, help="Engine mode: the length of A and of B.")
    ap.add_argument("--host-kv-cache-gb", type=float, default=1.0, help="Engine mode: the tier's size.")
    ap.add_argument("--blocks", type=int, default=4096, help="Copy mode: quantised blocks (16 tokens each).")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help="Write the JSON here too.")
    args = ap.parse_args()
    if args.copy == bool(args.engine):
        sys.exit("error: give --engine DIR (engine mode) or --copy (copy mode).")
    result = bench_copy(args) if args.copy else bench_engine(args)
    emit(result, args.out)


if __name__ == "__main__":
    main()
