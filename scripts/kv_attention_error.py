"""Which side of the KV cache carries the quantisation error: keys or values, layer by layer.

One FP16 forward over the first --tokens tokens of a text records every full-attention layer's queries,
keys and values (the first KV head's group of queries). Then, for each INT4/FP8 setting, the relative
error of the attention output ||O' - O|| / ||O|| over rows past the sinks and window, with only the keys
quantised, only the values, and both; sinks and the recent window stay exact as in the cache. A cheap
guide to which knob to try in `bie-trt eval` (seconds of arithmetic after one forward), not a substitute.

    python scripts/kv_attention_error.py --engine engines/gemma3-270m-fp16kv --tokens 2048
"""
from __future__ import annotations

import argparse
from typing import Callable

import torch

import bie_trt.model.llama as llama
from bie_trt.config import EngineConfig, KVCacheConfig
from bie_trt.eval_texts import load_eval_text, text_token_ids
from bie_trt.executor.model_runner import ModelRunner
from bie_trt.kernels.key_offset import turned
from bie_trt.kernels.step_inputs import SeqInput
from bie_trt.kv.pool import allocate_kv
from bie_trt.kv.quant import dequantize_fp8, dequantize_int4_asym, quantize_fp8, quantize_int4_asym
from bie_trt.kv.rotation import rotate

SINKS = 8


def int4(x: torch.Tensor, group: int, rotated: bool, centre: torch.Tensor | None = None) -> torch.Tensor:
    """x through the cache's INT4 (optionally centred and Hadamard-rotated first), back in x's basis."""
    c = torch.zeros_like(x[0]) if centre is None else centre
    y = rotate(x - c) if rotated else x - c
    y = dequantize_int4_asym(*quantize_int4_asym(y, group), group)
    return (rotate(y) if rotated else y) + c


def fp8(x: torch.Tensor, rotated: bool) -> torch.Tensor:
    y = dequantize_fp8(*quantize_fp8(rotate(x) if rotated else x))
    return rotate(y) if rotated else y


def settings(mean_key: torch.Tensor) -> dict[str, tuple[Callable, Callable]]:
    """name -> (keys' round trip, values' round trip), keys Hadamard-rotated as the cache stores them; `mean_key`
    [T, D] is what centering subtracts from each key (the pre-RoPE mean turned to its position)."""
    return {
        "int4 g128": (lambda k: int4(k, 128, True), lambda v: int4(v, 128, False)),
        "int4 g64 (profile default)": (lambda k: int4(k, 64, True), lambda v: int4(v, 64, False)),
        "int4 g32": (lambda k: int4(k, 32, True), lambda v: int4(v, 32, False)),
        "int4 g64 key centering": (lambda k: int4(k, 64, True, mean_key), lambda v: int4(v, 64, False)),
        "int4 g64 hadamard_kv": (lambda k: int4(k, 64, True), lambda v: int4(v, 64, True)),
        "int4 g32 key centering": (lambda k: int4(k, 32, True, mean_key), lambda v: int4(v, 32, False)),
        "fp8": (lambda k: fp8(k, True), lambda v: fp8(v, False)),
    }


def attention(q: torch.Tensor, k: torch.Tensor, kq: torch.Tensor, v: torch.Tensor, vq: torch.Tensor,
              scale: float, window: int) -> torch.Tensor:
    """Causal attention of q [T, H, D] over one KV head, reading kq/vq outside the sinks and window."""
    pos = torch.arange(q.shape[0])
    exact = (pos[None, :] < SINKS) | (pos[None, :] > pos[:, None] - window)
    logits = torch.where(exact, torch.einsum("thd,sd->hts", q, k), torch.einsum("thd,sd->hts", q, kq)) * scale
    p = logits.masked_fill(pos[None, :] > pos[:, None], -torch.inf).softmax(-1)
    return torch.einsum("hts,sd->thd", p * exact, v) + torch.einsum("hts,sd->thd", p * ~exact, vq)


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engine", required=True)
    ap.add_argument("--text", default="builtin:python-docs")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--window", type=int, default=128, help="recent tokens kept exact (the cache's FP16 window)")
    a = ap.parse_args()
    runner = ModelRunner(EngineConfig(engine_dir=a.engine, device="cpu", max_num_seqs=1, num_kv_blocks=1,
                                      kv_cache_dtype="fp16"))
    model, cfg = runner.model, runner.model_config
    ids = text_token_ids(a.engine, load_eval_text(a.text))[:a.tokens]
    n = len(ids)
    full = [i for i in range(cfg.num_layers) if not cfg.window_of(i)]
    queries: list[torch.Tensor] = []
    epilogue = llama.ops.qkv_epilogue

    def recording(*args, **kw):   # the q each layer attends with, in layer order
        q, offset = epilogue(*args, **kw)
        queries.append(q.float().clone())
        return q, offset

    llama.ops.qkv_epilogue = recording
    kv = KVCacheConfig(dtype="fp16")
    blocks = -(-n // kv.block_size)
    pools = allocate_kv(cfg, kv, blocks, 0, blocks, runner.dtype, runner.device)
    model.forward([SeqInput(torch.tensor(ids), 0, list(range(blocks)), sliding_table=list(range(blocks)))], pools)
    llama.ops.qkv_epilogue = epilogue
    # pools.k [full layers, blocks, Hkv, block, D] -> [full layers, Hkv, n, D]
    keys = pools.k.permute(0, 2, 1, 3, 4).flatten(2, 3)[:, :, :n].float()
    values = pools.v.permute(0, 2, 1, 3, 4).flatten(2, 3)[:, :, :n].float()
    group = cfg.num_heads // cfg.num_kv_heads
    rows = slice(SINKS + a.window, n)
    for gi, li in enumerate(full):
        k = keys[gi, 0]
        print(f"layer {li}: key RMS {k.pow(2).mean().sqrt():.3f}, mean key RMS {k[16:].mean(0).pow(2).mean().sqrt():.3f},"
              f" value RMS {values[gi, 0].pow(2).mean().sqrt():.3f}")
    print(f"relative attention-output error over rows {rows.start}..{n - 1} (K only / V only / both):")
    # per layer, once: its queries, keys, values, exact output and settings (from the engine's calibrated mean key)
    layers = []
    for gi, li in enumerate(full):
        q = queries[li].reshape(n, cfg.num_heads, cfg.head_dim)[:, :group]
        k, v = keys[gi, 0], values[gi, 0]
        layers.append((li, q, k, v, attention(q, k, k, v, v, model.scale, a.window),
                       settings(turned(model.key_mean[li, 0], torch.arange(n), model.rope.inv_freq_of(li)))))
    for name in settings(torch.zeros(cfg.head_dim)):
        cells = []
        for li, q, k, v, o, quantisers in layers:
            fk, fv = quantisers[name]
            kq, vq = fk(k), fv(v)
            err = [(attention(q, k, ks, v, vs, model.scale, a.window) - o)[rows].norm() / o[rows].norm()
                   for ks, vs in ((kq, v), (k, vq), (kq, vq))]
            cells.append(f"L{li} " + " / ".join(f"{e:.4f}" for e in err))
        print(f"{name:28s} " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
