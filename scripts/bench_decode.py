"""Decode tokens/s and chunked prefill at Llama-3-8B shapes, under an 8 GiB cap, on one GPU.

Random AWQ-shaped weights in the runtime layout (no checkpoint needed), the memory plan's
placement (int8 lm_head, embedding rows from pinned host memory), KV pools sized by the plan,
decode replayed from CUDA graphs. For each context (4k / 32k / 64k) and KV dtype it reports
tokens/s, the roofline (weights + KV bytes a step reads ÷ bandwidth), its fraction, and peak
memory beside what the memory plan of an 8 GB profile allots; then a chunked prefill of a
--prefill-len prompt with its peak activation memory. `--smoke` runs the same code on a tiny
model (on the CPU when there is no GPU) so that the script is tested before a GPU is lent.
`--trace` profiles one more step with torch.profiler and writes its kernels (launches, device
time each) into the row: the real step's launch count beside `scripts/count_step.py`'s.

    python scripts/bench_decode.py --out benchmarks/results/decode.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from bie_trt.config import KVCacheConfig, ModelConfig
from bie_trt.cache_tiers.block_manager import BlockManager
from bie_trt.executor.model_runner import quantise_blocks
from bie_trt.executor.sequence import Sequence
from bie_trt.kv.pool import allocate_pools, encode_quant_block
from bie_trt.model.cuda_graphs import DecodeGraphs
from bie_trt.model.llama import LlamaModel, SeqInput
from bie_trt.model.synthetic import llama3_8b, random_weights, tiny_llama
from bie_trt.plan import kv_bytes_per_token, kv_pool_blocks, solve_plan
from bie_trt.profiles import load_profile
from bie_trt.sampling import make_generator
from bie_trt.sampling_params import SamplingParams

GiB = 2**30


def weight_bytes(model: LlamaModel) -> int:
    total = sum(t.nbytes for layer in model.layers for lin in layer.linears.values()
                for t in (lin.qweight, lin.scales, lin.zeros))
    return total + model.lm_head.q.nbytes + model.lm_head.scale.nbytes


def fill_cache(pools, context: int, kv: KVCacheConfig) -> list[int]:
    """A block table for `context` tokens: FP16 sinks and recent window, the body quantised."""
    pools.k.normal_(0, 0.5)
    pools.v.normal_(0, 0.5)
    for name, t in pools.quant_views().items():
        if t.dtype == torch.float8_e4m3fn:
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


def cuda_peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated() / GiB if device.type == "cuda" else None


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def plan_gib(cfg: ModelConfig, kv: KVCacheConfig, context: int, profile: str) -> float:
    """What the memory plan allots an engine of these shapes at this context, batch 1, one graph."""
    plan = solve_plan(cfg, load_profile(profile), max_model_len=context, kv=kv, max_num_seqs=1, chunked_prefill_size=512,
                      cuda_graph_batch_sizes=[1])
    return plan.total_bytes / GiB


def trace_step(step, device: torch.device) -> dict:
    """One step under torch.profiler: per kernel (device kernels on CUDA, ops on the CPU) its count
    and total time, and the step's number of launches."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        step()
        sync(device)
    kernels: dict[str, dict] = {}
    for e in prof.events():
        on_device = e.device_type.name == "CUDA"
        if on_device != (device.type == "cuda") or (not on_device and e.cpu_parent is not None):
            continue   # device kernels on CUDA; top-level ops on the CPU
        k = kernels.setdefault(e.name, {"count": 0, "us": 0.0})
        k["count"] += 1
        k["us"] += e.device_time if on_device else e.cpu_time
    return {"launches": sum(k["count"] for k in kernels.values()),
            "kernels": dict(sorted(kernels.items(), key=lambda kv: -kv[1]["us"]))}


def bench_decode(model: LlamaModel, kv: KVCacheConfig, context: int, args: argparse.Namespace) -> dict:
    cfg, dev = model.cfg, model.device
    n_fp, n_q = kv_pool_blocks(cfg, kv, context, 1, 512)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    pools = allocate_pools(cfg, kv, n_fp, n_q, model.dtype, dev, scratch_block=True)
    table = fill_cache(pools, context, kv)
    graphs = DecodeGraphs(model, pools, [1], context, pools.scratch_block, capture=dev.type == "cuda")
    step = [SeqInput(torch.tensor([1]), context - 1, table)]
    for _ in range(3):
        graphs.run(step)
    sync(dev)
    start = time.perf_counter()
    for _ in range(args.steps):
        graphs.run(step)
    sync(dev)
    seconds = (time.perf_counter() - start) / args.steps
    read = weight_bytes(model) + context * kv_bytes_per_token(cfg, kv)
    roofline = args.bandwidth / read
    peak = cuda_peak_gib(dev)
    planned = plan_gib(cfg, kv, context, args.profile)
    row = {"context": context, "kv": kv.dtype, "tokens_per_s": 1 / seconds, "ms_per_token": 1e3 * seconds,
           "bytes_per_token": read, "roofline_tokens_per_s": roofline, "roofline_fraction": (1 / seconds) / roofline,
           "peak_memory_gib": peak, "plan_gib": planned,
           "within_plan": None if peak is None else peak <= planned}
    if args.trace:
        row["trace"] = trace_step(lambda: graphs.run(step), dev)
    return row


def bench_prefill(model: LlamaModel, kv: KVCacheConfig, length: int, chunk: int) -> dict:
    """A `length`-token prompt in `chunk`-token pieces, blocks leaving the window quantised as it goes."""
    cfg, dev = model.cfg, model.device
    n_fp, n_q = kv_pool_blocks(cfg, kv, length, 1, chunk)
    pools = allocate_pools(cfg, kv, n_fp, n_q, model.dtype, dev)
    blocks = BlockManager(kv, n_fp, n_q)
    ids = torch.randint(0, cfg.vocab_size, (length,)).tolist()
    seq = Sequence(ids, SamplingParams(), make_generator(SamplingParams(), 0))
    sync(dev)
    base = torch.cuda.memory_allocated() if dev.type == "cuda" else 0
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for pos in range(0, length, chunk):
        part = ids[pos:pos + chunk]
        blocks.grow(seq, pos + len(part))
        model.forward([SeqInput(torch.tensor(part), pos, seq.block_table)], pools)
        seq.num_cached = pos + len(part)
        quantise_blocks(pools, blocks.compact(seq))
    sync(dev)
    seconds = time.perf_counter() - start
    peak = cuda_peak_gib(dev)
    return {"prompt_tokens": length, "chunk": chunk, "kv": kv.dtype, "seconds": seconds,
            "tokens_per_s": length / seconds, "peak_memory_gib": peak,
            "peak_activation_mib": None if peak is None else (peak * GiB - base) / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="4096,32768,65536")
    ap.add_argument("--kv", default="int4_asym,fp16")
    ap.add_argument("--cap-gib", type=float, default=8.0, help="emulate a card of this size")
    ap.add_argument("--profile", default="rtx4060ti-8gb", help="build profile whose memory plan peaks are judged by")
    ap.add_argument("--bandwidth", type=float, default=4.3e12, help="bytes/s for the roofline")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--trace", action="store_true", help="profile one step per row: kernels, launches, device time")
    ap.add_argument("--no-prefill", dest="prefill", action="store_false", help="decode rows only")
    ap.add_argument("--prefill-len", type=int, default=65536)
    ap.add_argument("--smoke", action="store_true",
                    help="a tiny model, short contexts and few steps, on the CPU when there is no GPU: "
                         "checks this script end to end in seconds (the tests run it)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/decode.json"))
    args = ap.parse_args()
    if args.smoke:
        cfg, group = tiny_llama(hidden_size=128, num_heads=2, num_kv_heads=1), 64
        args.contexts, args.steps, args.prefill_len = "256,512", 3, 512
    elif not torch.cuda.is_available():
        print("bench_decode needs a CUDA GPU (none here; --smoke runs a tiny model on the CPU); "
              "see scripts/device_check.sh.", file=sys.stderr)
        sys.exit(2)
    else:
        cfg, group = llama3_8b(), 128
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * GiB / total))
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    model = LlamaModel(cfg, random_weights(cfg, group, device=device), device, dtype, embedding_on_host=True)
    rows = []
    out = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "smoke": args.smoke,
           "model": cfg.to_dict(), "weight_group_size": group, "cap_gib": args.cap_gib, "bandwidth": args.bandwidth,
           "torch": torch.__version__, "decode": rows, "prefill": None, "date": time.strftime("%Y-%m-%d")}
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:  # after every row: a crash or a `timeout` later keeps what was measured
        args.out.write_text(json.dumps(out, indent=2))

    for kv_dtype in args.kv.split(","):
        kv = KVCacheConfig(dtype=kv_dtype)
        for ctx in map(int, args.contexts.split(",")):
            try:
                row = bench_decode(model, kv, ctx, args)
            except torch.OutOfMemoryError:
                row = {"context": ctx, "kv": kv_dtype, "error": f"does not fit under {args.cap_gib} GiB"}
            except RuntimeError as e:   # e.g. an allocation failing inside a graph capture: record, go on
                row = {"context": ctx, "kv": kv_dtype, "error": f"{type(e).__name__}: {e}"[:1000]}
            if device.type == "cuda":
                torch.cuda.empty_cache()
            rows.append(row)
            save()
            print(json.dumps(row), flush=True)
    if not args.prefill:
        return
    out["prefill"] = bench_prefill(model, KVCacheConfig(dtype="int4_asym"), args.prefill_len, 512)
    save()
    print(json.dumps(out["prefill"]), flush=True)


if __name__ == "__main__":
    main()
