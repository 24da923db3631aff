"""Time the Triton paged decode attention against the memory roofline and against torch SDPA.

Llama-3-8B attention shapes (32 query heads, 8 kv heads, head_dim 128), batch 1 by default,
one layer, each attention tile loop (`--variants`: v1 and v2; over an FP16 cache v2 runs v1's, so
only v1 is timed there). For each KV format and context length the cache is random data laid out as the
engine lays it out: with a quantised format, the sink block and the recent window are FP16 and
everything between lives in the quantised pool; blocks are scattered over the pools.

Bytes read per call = the K and V rows of every cached token in the format it is stored in
(INT4: packed nibbles + fp16 scale and zero per group) + the block table + q + the output; the
partial-softmax workspace is left out (it is written and read once, ~1 MB at 64k). GB/s and the
roofline fraction follow from the median time of `triton.testing.do_bench` (L2 flushed between
runs). torch SDPA over a contiguous fp16 cache of the same length is timed alongside.

    python scripts/bench_attention.py [--tune] [--variants v1,v2] [--centred] [--out benchmarks/results/attention.json]

Needs a CUDA GPU: without one it prints why and exits with status 2.
"""
from __future__ import annotations

import argparse
import itertools
import json
import platform
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from bie_trt.config import KVCacheConfig, ModelConfig
from bie_trt.kernels.key_offset import KeyOffset
from bie_trt.kv.pool import KVPools, allocate_pools, encode_quant_block

BLOCK = 16


def model_config(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM", hidden_size=args.heads * args.head_dim, intermediate_size=14336,
        num_layers=1, num_heads=args.heads, num_kv_heads=args.kv_heads, head_dim=args.head_dim,
        vocab_size=128256, rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072,
        tie_word_embeddings=False,
    )


def build_cache(args: argparse.Namespace, kv_dtype: str, context: int, gen: torch.Generator
                ) -> tuple[KVPools, torch.Tensor, torch.Tensor, int]:
    """Pools, block tables [batch, blocks], context lengths, and the quantised blocks per sequence."""
    kv = KVCacheConfig(dtype=kv_dtype, group_size=args.group_size, sink_tokens=args.sink, window=args.window)
    blocks = -(-context // BLOCK)
    if kv_dtype == "fp16":
        fp_per_seq = blocks
    else:  # sink blocks and the window's blocks (plus the partial tail) stay FP16
        fp_per_seq = min(blocks, -(-args.sink // BLOCK) + -(-args.window // BLOCK) + 1)
    q_per_seq = blocks - fp_per_seq
    pools = allocate_pools(model_config(args), kv, max(1, args.batch * fp_per_seq), args.batch * q_per_seq,
                           device="cuda")
    pools.k.normal_(generator=gen)
    pools.v.normal_(generator=gen)
    if pools.k_q is not None:
        for name, t in pools.quant_views().items():
            if name.endswith("_q") and t.dtype == torch.uint8:  # INT4: any byte is two valid nibbles
                t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, device="cuda", generator=gen))
            elif name.endswith("_q"):  # FP8: from normals, as random bytes would include NaN codes
                t.copy_(torch.randn(t.shape, device="cuda", generator=gen).to(t.dtype))
            elif name.endswith("_scale"):
                t.uniform_(0.01, 0.05, generator=gen)
            else:
                t.uniform_(-0.4, -0.2, generator=gen)
    sinks = -(-args.sink // BLOCK) if q_per_seq else 0
    fp_ids = torch.randperm(pools.num_fp_blocks, device="cuda", generator=gen).tolist()
    q_ids = torch.randperm(pools.num_quant_blocks, device="cuda", generator=gen).tolist() if q_per_seq else []
    tables = []
    for s in range(args.batch):
        fp = fp_ids[s * fp_per_seq:(s + 1) * fp_per_seq]
        body = [encode_quant_block(b) for b in q_ids[s * q_per_seq:(s + 1) * q_per_seq]]
        tables.append(fp[:sinks] + body + fp[sinks:])
    table = torch.tensor(tables, dtype=torch.int32, device="cuda")
    lens = torch.full((args.batch,), context, dtype=torch.int32, device="cuda")
    return pools, table, lens, q_per_seq


def bytes_read(args: argparse.Namespace, kv_dtype: str, context: int, quant_blocks: int) -> int:
    """K+V rows of every cached token in its storage format, the block table, q and the output."""
    d, hkv = args.head_dim, args.kv_heads
    q_tokens = quant_blocks * BLOCK
    fp_tokens = context - q_tokens
    per_q_row = {"fp16": 2 * d, "fp8": d + 2, "int4_asym": d // 2 + 4 * (d // args.group_size)}[kv_dtype]
    kv_bytes = 2 * hkv * (fp_tokens * 2 * d + q_tokens * per_q_row)
    table = 4 * -(-context // BLOCK)
    return args.batch * (kv_bytes + table + 2 * args.heads * d * 2)


def time_ms(fn, args: argparse.Namespace) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=args.warmup, rep=args.rep, return_mode="median")


def bench_sdpa(args: argparse.Namespace, context: int, gen: torch.Generator) -> float:
    q = torch.randn(args.batch, args.heads, 1, args.head_dim, device="cuda", dtype=torch.float16, generator=gen)
    k = torch.randn(args.batch, args.kv_heads, context, args.head_dim, device="cuda", dtype=torch.float16,
                    generator=gen)
    v = torch.randn_like(k)
    return time_ms(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), args)


def check(args: argparse.Namespace, kv_dtype: str, variant: str, gen: torch.Generator) -> float:
    """max |Δ| of the kernel against the reference twin on a short context of the same layout, split into the
    default partitions and into one (one program reading every tile ahead of the next)."""
    from bie_trt.kernels.triton_attention import paged_decode_attention, paged_decode_attention_ref

    pools, table, lens, _ = build_cache(args, kv_dtype, args.check_context, gen)
    q = torch.randn(args.batch, args.heads, args.head_dim, device="cuda", dtype=torch.float16, generator=gen)
    scale = args.head_dim**-0.5
    offset = key_offset(args, q, gen)
    ref = paged_decode_attention_ref(q, pools, 0, table, lens, scale, offset=offset).float()
    return max((paged_decode_attention(q, pools, 0, table, lens, scale, num_partitions=parts,
                                       config={"variant": variant}, offset=offset).float() - ref).abs().max().item()
               for parts in (None, 1))


def key_offset(args: argparse.Namespace, q: torch.Tensor, gen: torch.Generator) -> KeyOffset | None:
    """With --centred, offset coefficients for q's rows (of the size a large offset gives) and Llama's RoPE
    frequencies; else None."""
    if not args.centred:
        return None
    inv = 500000.0 ** (-torch.arange(0, args.head_dim, 2, device="cuda", dtype=torch.float32) / args.head_dim)
    return KeyOffset(30 * torch.randn(q.shape, device="cuda", generator=gen), inv)


def tune_grid(default_parts: int) -> list[dict]:
    parts = sorted({max(1, default_parts // 2), default_parts, 2 * default_parts})
    return [{"num_partitions": p, "tile_blocks": t, "num_warps": w}
            for p, t, w in itertools.product(parts, (1, 2, 4), (4, 8))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="4096,32768,65536", help="comma-separated context lengths")
    ap.add_argument("--kv", default="fp16,int4_asym", help="comma-separated KV formats (fp16, int4_asym, fp8)")
    ap.add_argument("--variants", default="v1,v2", help="comma-separated attention tile loops (v1, v2)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--sink", type=int, default=8, help="sink tokens kept FP16")
    ap.add_argument("--window", type=int, default=128, help="recent tokens kept FP16")
    ap.add_argument("--bandwidth", type=float, default=4.3e12, help="bandwidth the roofline assumes, bytes/s "
                    "(4.3e12: the copy rate measured on the lent H200; its spec is 4.8e12)")
    ap.add_argument("--warmup", type=int, default=25, help="do_bench warmup, ms")
    ap.add_argument("--rep", type=int, default=100, help="do_bench repetition time, ms")
    ap.add_argument("--tune", action="store_true", help="sweep partitions x tile_blocks x num_warps; report the best")
    ap.add_argument("--centred", action="store_true",
                    help="keys centred (bie_trt/kernels/key_offset.py): every score gets its q·R(p)m back, what "
                         "an engine whose build turned key centering on runs")
    ap.add_argument("--check-context", type=int, default=1000, help="context of the correctness check (0: skip)")
    ap.add_argument("--out", default="benchmarks/results/attention.json")
    args = ap.parse_args(argv)

    if not torch.cuda.is_available():
        print("bench_attention: no CUDA GPU here; this benchmark times GPU kernels and has nothing to do "
              "on the CPU (the kernels' CPU tests are tests/test_triton_attention.py).", file=sys.stderr)
        return 2
    import triton

    from bie_trt.kernels.triton_attention import default_config, default_num_partitions, paged_decode_attention

    gen = torch.Generator(device="cuda").manual_seed(0)
    contexts = [int(c) for c in args.contexts.split(",")]
    kv_dtypes = args.kv.split(",")
    scale = args.head_dim**-0.5
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    report: dict = {
        "gpu": torch.cuda.get_device_name(0), "sms": sms, "torch": torch.__version__, "triton": triton.__version__,
        "python": platform.python_version(), "bandwidth_bytes_per_s": args.bandwidth,
        "shapes": {"batch": args.batch, "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
                   "group_size": args.group_size, "sink": args.sink, "window": args.window, "block": BLOCK},
        "centred": args.centred, "check_max_abs_diff": {}, "results": [],
    }
    runs = [(kv, variant) for kv in kv_dtypes for variant in args.variants.split(",") if kv != "fp16" or variant == "v1"]
    if args.check_context:
        for kv_dtype, variant in runs:
            diff = report["check_max_abs_diff"][f"{kv_dtype} {variant}"] = check(args, kv_dtype, variant, gen)
            print(f"check {kv_dtype:>9} {variant} ctx {args.check_context}: max |Δ| vs reference {diff:.2e}")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:  # after every row: a crash or a `timeout` later keeps what was measured
        out.write_text(json.dumps(report, indent=2) + "\n")

    save()
    header = (f"{'kv':>12} {'ctx':>6} {'config':>34} {'µs':>8} {'MB':>8} {'GB/s':>7} {'roof':>5} "
              f"{'sdpa µs':>8} {'sdpa roof':>9}")
    print(header)
    sdpa_cache: dict[int, float] = {}
    for (kv_dtype, variant), context in itertools.product(runs, contexts):
        pools, table, lens, quant_blocks = build_cache(args, kv_dtype, context, gen)
        q = torch.randn(args.batch, args.heads, args.head_dim, device="cuda", dtype=torch.float16, generator=gen)
        offset = key_offset(args, q, gen)
        nbytes = bytes_read(args, kv_dtype, context, quant_blocks)
        tiles = default_config(True, triton.next_power_of_2(args.heads // args.kv_heads), quantised=kv_dtype != "fp16",
                               variant=variant)
        default = {"num_partitions": default_num_partitions(args.batch * args.kv_heads,
                                                            triton.cdiv(table.shape[1], tiles["tile_blocks"]), sms),
                   "tile_blocks": tiles["tile_blocks"], "num_warps": tiles["num_warps"]}
        configs = tune_grid(default["num_partitions"]) if args.tune else [default]
        timed = []
        for cfg in configs:
            run_cfg = {"variant": variant, **{k: v for k, v in cfg.items() if k != "num_partitions"}}
            fn = lambda: paged_decode_attention(q, pools, 0, table, lens, scale,  # noqa: E731
                                                num_partitions=cfg["num_partitions"], config=run_cfg, offset=offset)
            try:
                timed.append((time_ms(fn, args), cfg))
            except Exception as e:  # a config the compiler rejects (e.g. out of shared memory) is skipped
                print(f"  skip {cfg}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        if not timed:
            raise RuntimeError(f"no config of {kv_dtype} {variant} at context {context} ran (see the skips above)")
        ms, best = min(timed, key=lambda t: t[0])
        if context not in sdpa_cache:
            sdpa_cache[context] = bench_sdpa(args, context, gen)
        sdpa_ms = sdpa_cache[context]
        sdpa_bytes = args.batch * (2 * args.kv_heads * context * args.head_dim * 2 + 2 * args.heads * args.head_dim * 2)
        row = {
            "kv": kv_dtype, "variant": variant, "context": context, "batch": args.batch, "config": best, "us": ms * 1e3,
            "bytes": nbytes, "gb_per_s": nbytes / ms / 1e6, "roofline": nbytes / (ms * 1e-3) / args.bandwidth,
            "sdpa_us": sdpa_ms * 1e3, "sdpa_roofline": sdpa_bytes / (sdpa_ms * 1e-3) / args.bandwidth,
            "speedup_vs_sdpa": sdpa_ms / ms,
            "tuning": [{"config": c, "us": t * 1e3} for t, c in timed] if args.tune else None,
        }
        report["results"].append(row)
        save()
        cfg_txt = f"P={best['num_partitions']} tile={best['tile_blocks']} warps={best['num_warps']}"
        print(f"{kv_dtype + ' ' + variant:>12} {context:>6} {cfg_txt:>34} {row['us']:>8.1f} {nbytes / 1e6:>8.1f} "
              f"{row['gb_per_s']:>7.0f} {row['roofline']:>5.0%} {row['sdpa_us']:>8.1f} {row['sdpa_roofline']:>9.0%}")
        del pools

    save()
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
