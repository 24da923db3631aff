"""Time the Triton W4A16 linear and the small kernels against the memory roofline, and check them.

Llama-3-8B shapes (M × K × N: rows of x × in features × out features). Decode, M = 1: qkv
1×4096×6144, o 1×4096×4096, gate_up 1×4096×28672, down 1×14336×4096, and 1×4096×14336;
speculative verification, M = 5: qkv and down; one 512-row prefill chunk of gate_up.

Bytes per call = packed weights + fp16 scales + uint8 zeros + x + the output: the bytes the op
must move. The split-K workspace is left out (fp32 partial sums written and read once: 0.5 MB for
1×14336×4096, 1.5 MB for the M = 5 down shape, which makes that row's fraction ~5% generous). The
512-row gate_up chunk is compute-bound: read its `tflops`, not its roofline fraction. GB/s and
the roofline fraction follow from the median of `triton.testing.do_bench` (L2 flushed between
runs). Alongside: torch's `_weight_int4pack_mm` (bf16, its own int4 layout) where this torch
build has it; rms_norm and silu_mul at batch 1; the int8 lm_head at batch 1 and 5 (beside torch's
chunked dequantise-then-matmul); the fused block quantiser (all 32 layers, K and V); a sweep of
`candidate_configs` per decode shape, printing the winner. Correctness on the GPU: each W4
shape against an fp32 dense matmul, the small ops against their twins, and the quantiser
byte for byte against `quantize_block` run on a CPU copy (the reference semantics: CUDA torch
divides by a Python scalar through a reciprocal, the CPU divides).

    python scripts/bench_kernels.py [--no-tune] [--no-attention] [--out benchmarks/results/kernels.json]

Then runs scripts/bench_attention.py's `main` when that file exists (its JSON goes next to
ours). Needs a CUDA GPU: without one it prints why and exits with status 2.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import platform
import sys
import traceback
from pathlib import Path
from typing import Callable

import torch

from bie_trt.config import KVCacheConfig
from bie_trt.model.synthetic import llama3_8b

DEVICE = "cuda"
GROUP = 128
DECODE = [("qkv", 4096, 4096 + 2 * 1024), ("o", 4096, 4096), ("gate_up", 4096, 2 * 14336),
          ("down", 14336, 4096), ("up_14336", 4096, 14336)]
BATCHED = [("qkv", 5, 4096, 6144), ("down", 5, 14336, 4096), ("gate_up", 512, 4096, 2 * 14336)]


def w4_bytes(m: int, k: int, n: int) -> int:
    return n * k // 2 + n * (k // GROUP) * 3 + m * k * 2 + m * n * 2


def roof(nbytes: int, ms: float, bandwidth: float) -> dict:
    return {"us": ms * 1e3, "bytes": nbytes, "gb_per_s": nbytes / ms / 1e6,
            "roofline": nbytes / (ms * 1e-3) / bandwidth}


def int4pack_baseline(m: int, k: int, n: int, time_ms: Callable[[Callable], float], bandwidth: float) -> dict:
    """torch's tinygemm int4 kernel on the same shape (random data in its own layout), or why not."""
    try:
        q = torch.randint(0, 16, (n, k), dtype=torch.int32, device=DEVICE)
        packed = torch.ops.aten._convert_weight_to_int4pack(((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8), 8)
        scales_zeros = torch.rand(k // GROUP, n, 2, dtype=torch.bfloat16, device=DEVICE)
        x = torch.randn(m, k, dtype=torch.bfloat16, device=DEVICE)
        ms = time_ms(lambda: torch.ops.aten._weight_int4pack_mm(x, packed, GROUP, scales_zeros))
    except (RuntimeError, AttributeError, NotImplementedError) as e:
        return {"unavailable": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
    return roof(n * k // 2 + (k // GROUP) * n * 4 + m * k * 2 + m * n * 2, ms, bandwidth)


def bench_w4(m: int, k: int, n: int, args: argparse.Namespace, time_ms: Callable[[Callable], float]) -> dict:
    from bie_trt.kernels.triton_w4 import default_config, device_limits, gemv_grid_for, random_w4, w4_linear_triton

    w = random_w4(n, k, GROUP, device=DEVICE)
    x = torch.randn(m, k, dtype=torch.float16, device=DEVICE)
    dense = w.dequantize(torch.float32)
    ref = x.float() @ dense.t()
    del dense
    err = (w4_linear_triton(x, w).float() - ref).abs().max().item() / ref.abs().max().item()
    cfg = default_config(m, n, k, GROUP, DEVICE)
    row = {"M": m, "K": k, "N": n, "config": cfg, "max_rel_err": err,
           **roof(w4_bytes(m, k, n), time_ms(lambda: w4_linear_triton(x, w)), args.bandwidth)}
    if m == 1:   # the default grid's waves on this GPU (`gemv_grid`)
        grid = gemv_grid_for(n, k, GROUP, device_limits(torch.device(DEVICE)))
        row.update(programs=grid.programs, resident_per_sm=grid.resident, waves=grid.waves)
    if m > 16:
        row["tflops"] = 2 * m * n * k / (row["us"] * 1e-6) / 1e12
    if args.baseline:
        row["int4pack_mm"] = int4pack_baseline(m, k, n, time_ms, args.bandwidth)
    return row


def sweep_w4(m: int, k: int, n: int, args: argparse.Namespace, time_ms: Callable[[Callable], float]) -> dict:
    from bie_trt.kernels.triton_w4 import candidate_configs, random_w4, w4_linear_triton

    w = random_w4(n, k, GROUP, device=DEVICE)
    x = torch.randn(m, k, dtype=torch.float16, device=DEVICE)
    candidates = candidate_configs(m, n, k, GROUP, DEVICE)[:args.max_candidates]  # the default first
    timed = []
    for cfg in candidates:
        try:
            timed.append((time_ms(lambda: w4_linear_triton(x, w, cfg)), cfg))
        except Exception as e:  # noqa: BLE001 - a config this GPU cannot compile or launch is skipped
            print(f"  skip {cfg}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    ms, best = min(timed, key=lambda t: t[0])
    default_ms = next((t for t, c in timed if c == candidates[0]), float("nan"))
    return {"M": m, "K": k, "N": n, "winner": best, "default_us": default_ms * 1e3,
            **roof(w4_bytes(m, k, n), ms, args.bandwidth),
            "all": [{"config": c, "us": t * 1e3} for t, c in timed]}


def calibrate_read_bandwidth(time_ms: Callable[[Callable], float]) -> float:
    """Bytes/s a plain read reaches on this GPU (a 2 GiB sum): what the kernels' fractions are also judged by."""
    x = torch.ones(2**30, dtype=torch.float16, device=DEVICE)
    ms = time_ms(lambda: x.sum(dtype=torch.float32))
    del x
    return 2**31 / (ms * 1e-3)


def bench_fused_layer(args: argparse.Namespace, time_ms: Callable[[Callable], float], cfg=None) -> dict:
    """The decoder layer's fused launches at batch 1 (norm + gate_up + SiLU·mul, down + residual,
    the qkv epilogue) at `cfg`'s shapes (Llama-3-8B's), each against its twins; max |Δ| asserted."""
    from bie_trt.kernels.reference import qkv_epilogue_ref, rms_norm_ref, silu_mul_ref, w4_linear_ref
    from bie_trt.kernels.triton_ops import qkv_epilogue_triton
    from bie_trt.kernels.triton_w4 import random_w4, w4_linear_triton
    from bie_trt.kv.pool import allocate_pools
    from bie_trt.kernels.rope import inverse_frequencies

    cfg = cfg or llama3_8b()
    hid, inter = cfg.hidden_size, cfg.intermediate_size
    rows = {}
    h = torch.randn(1, hid, dtype=torch.float16, device=DEVICE)
    nw = torch.rand(hid, dtype=torch.float16, device=DEVICE) + 0.5
    gate_up = random_w4(2 * inter, hid, GROUP, device=DEVICE)
    down = random_w4(hid, inter, GROUP, device=DEVICE)
    act = w4_linear_triton(h, gate_up, norm_weight=nw, eps=1e-5, silu_mul=True)
    want = silu_mul_ref(w4_linear_ref(rms_norm_ref(h, nw, 1e-5)[0], gate_up))
    rows[f"norm_gate_up_silu_1x{hid}x{2 * inter}"] = {
        "max_abs_err": assert_close(act, want, 2e-2),
        **roof(w4_bytes(1, hid, 2 * inter) - inter * 2,
               time_ms(lambda: w4_linear_triton(h, gate_up, norm_weight=nw, eps=1e-5, silu_mul=True)), args.bandwidth)}
    y = w4_linear_triton(act, down, residual=h)
    rows[f"down_residual_1x{inter}x{hid}"] = {
        "max_abs_err": assert_close(y, w4_linear_ref(act, down) + h, 2e-2),
        **roof(w4_bytes(1, inter, hid) + hid * 2, time_ms(lambda: w4_linear_triton(act, down, residual=h)),
               args.bandwidth)}
    kv = KVCacheConfig(dtype="int4_asym")
    pools = [allocate_pools(dataclasses.replace(cfg, num_layers=1), kv, 8, 1, torch.float16, DEVICE) for _ in range(2)]
    qkv = torch.randn(1, cfg.q_size + 2 * cfg.kv_size, dtype=torch.float16, device=DEVICE)
    pos = torch.tensor([65535], device=DEVICE)
    slot = torch.tensor([3], device=DEVICE)
    inv = inverse_frequencies(cfg).to(DEVICE)
    args_ = (cfg.num_heads, cfg.num_kv_heads, pos, inv, None, True, False)
    q, _ = qkv_epilogue_triton(qkv, *args_, pools[0], 0, slot, slot)
    q_ref, _ = qkv_epilogue_ref(qkv, *args_, pools[1], 0, slot, slot)
    rows[f"qkv_epilogue_1x{qkv.shape[1]}"] = {
        "max_abs_err": max(assert_close(q, q_ref, 2e-2), assert_close(pools[0].k, pools[1].k, 2e-2)),
        **roof(qkv.nbytes + q.nbytes + 2 * cfg.kv_size * 2,
               time_ms(lambda: qkv_epilogue_triton(qkv, *args_, pools[0], 0, slot, slot)), args.bandwidth)}
    return rows


def assert_close(got: torch.Tensor, want: torch.Tensor, tol: float) -> float:
    """max |Δ|, which must stay under tol · max(1, max |want|): a wrong kernel stops the run rather than being timed."""
    err = (got.float() - want.float()).abs().max().item()
    bound = tol * max(1.0, want.float().abs().max().item())
    assert err <= bound, f"max |Δ| {err:.3g} > {bound:.3g}"
    return err


def bench_small_ops(args: argparse.Namespace, time_ms: Callable[[Callable], float]) -> dict:
    from bie_trt.kernels.reference import rms_norm_ref, silu_mul_ref
    from bie_trt.kernels.triton_ops import rms_norm_triton, silu_mul_triton

    x = torch.randn(1, 4096, dtype=torch.float16, device=DEVICE)
    res = torch.randn_like(x)
    weight = torch.rand(4096, dtype=torch.float16, device=DEVICE) + 0.5
    gate_up = torch.randn(1, 2 * 14336, dtype=torch.float16, device=DEVICE)
    out, summed = rms_norm_triton(x, weight, 1e-5, res)
    ref_out, ref_summed = rms_norm_ref(x, weight, 1e-5, res)
    return {
        "rms_norm_residual_1x4096": {
            "max_abs_err": (out.float() - ref_out.float()).abs().max().item(),
            "residual_exact": bool(torch.equal(summed, ref_summed)),
            **roof(4 * 4096 * 2 + 4096 * 2, time_ms(lambda: rms_norm_triton(x, weight, 1e-5, res)), args.bandwidth)},
        "silu_mul_1x14336": {
            "max_abs_err": (silu_mul_triton(gate_up).float() - silu_mul_ref(gate_up).float()).abs().max().item(),
            **roof(3 * 14336 * 2, time_ms(lambda: silu_mul_triton(gate_up)), args.bandwidth)},
    }


def bench_lm_head(args: argparse.Namespace, time_ms: Callable[[Callable], float]) -> dict:
    """The int8 lm_head (128256 × 4096) at decode batch 1 and 5: the kernel against torch's chunked
    dequantise-then-matmul, which it replaced; bytes = codes + row scales + x + logits."""
    from bie_trt.kernels.int8_rows import Int8Rows, quantize_rows_int8
    from bie_trt.kernels.reference import rms_norm_ref
    from bie_trt.kernels.triton_int8 import int8_rows_linear_triton

    model = llama3_8b()
    v, k = model.vocab_size, model.hidden_size
    head = Int8Rows(*quantize_rows_int8(torch.randn(v, k, device=DEVICE) * 0.02))
    results = {}
    for m in (1, 5):
        x = torch.randn(m, k, dtype=torch.float16, device=DEVICE)
        out, want = int8_rows_linear_triton(x, head), head.linear(x)
        nbytes = v * k + 2 * v + 2 * m * k + 2 * m * v
        results[f"lm_head_int8_{m}x{k}x{v}"] = {
            "max_abs_err_vs_torch": (out.float() - want.float()).abs().max().item(),
            "torch_us": time_ms(lambda: head.linear(x)) * 1e3,
            **roof(nbytes, time_ms(lambda: int8_rows_linear_triton(x, head)), args.bandwidth)}
        # What the decode step launches: the final norm in front (its weight read once more).
        nw = torch.rand(k, device=DEVICE, dtype=torch.float16) + 0.5
        fused = int8_rows_linear_triton(x, head, norm_weight=nw, eps=1e-5)
        results[f"norm_lm_head_int8_{m}x{k}x{v}"] = {
            "max_abs_err": assert_close(fused, head.linear(rms_norm_ref(x, nw, 1e-5)[0]), 2e-2),
            **roof(nbytes + 2 * k, time_ms(lambda: int8_rows_linear_triton(x, head, norm_weight=nw, eps=1e-5)),
                   args.bandwidth)}
    return results


def bench_quantize(args: argparse.Namespace, time_ms: Callable[[Callable], float]) -> dict:
    from bie_trt.kernels.triton_ops import quantize_block_triton, write_kv_triton
    from bie_trt.kernels.reference import write_kv_ref
    from bie_trt.kv.pool import KVPools, allocate_pools
    from bie_trt.kv.quant import quantize_block

    model = llama3_8b()
    results = {}
    for name, kv in (("int4_g64", KVCacheConfig(dtype="int4_asym", group_size=64)), ("fp8", KVCacheConfig(dtype="fp8"))):
        pools = allocate_pools(model, kv, 2, 2, device=DEVICE)
        gen = torch.Generator(device=DEVICE).manual_seed(0)
        pools.k.normal_(generator=gen)
        pools.v.normal_(generator=gen)
        cpu = KVPools(kv, **{n: t.cpu() for n, t in pools.tensors().items()})
        quantize_block_triton(pools, 1, 0)
        quantize_block(cpu, None, 1, 0)
        identical = all(torch.equal(t.cpu().view(torch.uint8), getattr(cpu, n).view(torch.uint8))
                        for n, t in pools.tensors().items())
        read = pools.k[:, 1].nbytes * 2
        written = sum(t[:, 0].nbytes for n, t in pools.tensors().items() if n not in ("k", "v"))
        results[name] = {"byte_identical_to_cpu_reference": identical,
                         **roof(read + written, time_ms(lambda: quantize_block_triton(pools, 1, 0)), args.bandwidth)}
    # write_kv: one decode token, all kv heads, into slot 5 of FP16 block 7.
    pools = allocate_pools(model, KVCacheConfig(), 8, 0, device=DEVICE)
    ref = KVPools(pools.cfg, **{n: t.clone() for n, t in pools.tensors().items()})
    k = torch.randn(1, 8, 128, dtype=torch.float16, device=DEVICE)
    v = torch.randn_like(k)
    blocks = torch.tensor([7], device=DEVICE)
    offsets = torch.tensor([5], device=DEVICE)
    write_kv_triton(pools, 3, k, v, blocks, offsets)
    write_kv_ref(ref, 3, k, v, blocks, offsets)
    results["write_kv_1_token"] = {
        "exact": all(torch.equal(t, getattr(ref, n)) for n, t in pools.tensors().items()),
        **roof(4 * k.nbytes, time_ms(lambda: write_kv_triton(pools, 3, k, v, blocks, offsets)), args.bandwidth)}
    return results


def run_attention_bench(out: Path, bandwidth: float) -> dict:
    path = Path(__file__).with_name("bench_attention.py")
    if not path.exists():
        return {"skipped": "scripts/bench_attention.py is not there"}
    spec = importlib.util.spec_from_file_location("bench_attention", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    status = module.main(["--out", str(out), "--bandwidth", str(bandwidth)])
    return {"status": status, "out": str(out)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bandwidth", type=float, default=4.3e12, help="bandwidth the roofline assumes, bytes/s "
                    "(4.3e12: the copy rate measured on the lent H200; its spec is 4.8e12)")
    ap.add_argument("--warmup", type=int, default=10, help="do_bench warmup, ms")
    ap.add_argument("--rep", type=int, default=50, help="do_bench repetition time, ms")
    ap.add_argument("--no-tune", dest="tune", action="store_false", help="skip the config sweep")
    ap.add_argument("--max-candidates", type=int, default=48, help="configs timed per shape in the sweep (M=5 has 41)")
    ap.add_argument("--no-baseline", dest="baseline", action="store_false", help="skip torch's _weight_int4pack_mm")
    ap.add_argument("--no-attention", dest="attention", action="store_false", help="skip scripts/bench_attention.py")
    ap.add_argument("--no-cudagraph", dest="cudagraph", action="store_false",
                    help="time with do_bench (a launch each) instead of do_bench_cudagraph (launch overhead out)")
    ap.add_argument("--out", default="benchmarks/results/kernels.json")
    args = ap.parse_args(argv)

    if not torch.cuda.is_available():
        print("bench_kernels: no CUDA GPU here; this benchmark times GPU kernels and has nothing to do on the "
              "CPU (the kernels' CPU tests are tests/test_triton_w4.py and tests/test_triton_ops.py).",
              file=sys.stderr)
        return 2
    import triton
    import triton.testing

    def time_ms(fn: Callable[[], object]) -> float:
        if args.cudagraph:
            fn()   # compile outside the capture
            return triton.testing.do_bench_cudagraph(fn, rep=args.rep, return_mode="median")
        return triton.testing.do_bench(fn, warmup=args.warmup, rep=args.rep, return_mode="median")

    torch.manual_seed(0)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:  # after every section: a crash or a `timeout` later keeps what was measured
        out.write_text(json.dumps(report, indent=2) + "\n")

    report: dict = {
        "gpu": torch.cuda.get_device_name(0), "sms": torch.cuda.get_device_properties(0).multi_processor_count,
        "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
        "bandwidth_bytes_per_s": args.bandwidth, "group_size": GROUP, "w4": [], "w4_sweep": [],
        "timing": "do_bench_cudagraph" if args.cudagraph else "do_bench",
    }
    report["measured_read_bytes_per_s"] = calibrate_read_bandwidth(time_ms)
    print(f"read bandwidth (2 GiB sum): {report['measured_read_bytes_per_s'] / 1e9:.0f} GB/s")
    report["fused_layer"] = bench_fused_layer(args, time_ms)
    save()
    for name, row in report["fused_layer"].items():
        print(f"{name:>32} {row['us']:>7.1f} µs {row['gb_per_s']:>6.0f} GB/s "
              f"({row['bytes'] / row['us'] / 1e-6 / report['measured_read_bytes_per_s']:.0%} of measured)")
    print(f"{'shape':>10} {'M×K×N':>16} {'µs':>8} {'MB':>7} {'GB/s':>6} {'roof':>5} {'rel err':>8} {'int4pack µs':>12} "
          f"{'waves':>6}")
    for name, m, k, n in [(name, 1, k, n) for name, k, n in DECODE] + BATCHED:
        row = {"name": name, **bench_w4(m, k, n, args, time_ms)}
        report["w4"].append(row)
        save()
        base = row.get("int4pack_mm", {})
        base_txt = f"{base['us']:.1f}" if "us" in base else "n/a"
        print(f"{name:>10} {f'{m}×{k}×{n}':>16} {row['us']:>8.1f} {row['bytes'] / 1e6:>7.1f} {row['gb_per_s']:>6.0f} "
              f"{row['roofline']:>5.0%} {row['max_rel_err']:>8.1e} {base_txt:>12} {row.get('waves', float('nan')):>6.2f}")
    if args.tune:
        print("sweep (candidate_configs):")
        for name, m, k, n in [(name, 1, k, n) for name, k, n in DECODE] + [b for b in BATCHED if b[1] <= 16]:
            row = {"name": name, **sweep_w4(m, k, n, args, time_ms)}
            report["w4_sweep"].append(row)
            save()
            print(f"{name:>10} {f'{m}×{k}×{n}':>16} best {row['us']:.1f} µs ({row['roofline']:.0%}; "
                  f"default {row['default_us']:.1f} µs) {row['winner']}")
    report["small_ops"] = bench_small_ops(args, time_ms)
    report["small_ops"].update(bench_lm_head(args, time_ms))
    save()
    report["kv"] = bench_quantize(args, time_ms)
    save()
    for group in ("small_ops", "kv"):
        for name, row in report[group].items():
            checks = {k: v for k, v in row.items() if k not in ("us", "bytes", "gb_per_s", "roofline")}
            print(f"{name:>26} {row['us']:>7.1f} µs {row['gb_per_s']:>6.0f} GB/s  {checks}")

    if args.attention:
        try:
            report["attention"] = run_attention_bench(out.with_name("attention.json"), args.bandwidth)
        except Exception as e:  # noqa: BLE001 - the kernel numbers above are saved either way
            traceback.print_exc()
            report["attention"] = {"error": f"{type(e).__name__}: {e}"}
    save()
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
