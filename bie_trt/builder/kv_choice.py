"""Key centering chosen at build time from the model's own keys, not from a family table.

Some models give their keys a large offset shared by every token: Qwen2's k_proj bias makes the mean key
of a few layers nearly the whole key (on Qwen2.5-Coder-0.5B layer 8, KV head 0, the mean key's RMS is 34.61
of the keys' 34.66). A per-token quantiser spends its range on that offset, so what varies from token to
token -- all that attention sees, since a shared part adds one constant per query -- drowns in rounding:
INT4 moved that layer's attention output by 123% of its norm, FP8 with rotated keys by 12%; with the mean
subtracted, 0.9% and 0.3% (docs/kv-cache-quality.md).

The build already runs the model over a calibration text for the mean key. Here the same keys go through
the cache's own quantiser with and without the mean subtracted, and the error is measured against the
token-to-token variation of each layer and KV head. Centering is turned on where, without it, the worst
layer's error exceeds the bound and centering lowers it. An explicit option always wins; the manifest
records the measurements and the reason either way.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from ..config import KVCacheConfig
from ..kv.quant import dequantize_fp8, dequantize_int4_asym, quantize_fp8, quantize_int4_asym
from ..kv.rotation import rotate

# Relative key rounding error (RMS of the error over RMS of the keys' token-to-token variation) that the worst
# layer may show without centering. SmolLM2's INT4 keys sit near 0.13 (rounding RMS 0.187 of variation 1.41),
# where centering did not improve perplexity; Qwen2.5-Coder-0.5B's offset layers sit far above 1.
KEY_ERROR_BOUND = 0.3


def int4_group(kv: KVCacheConfig, head_dim: int) -> int:
    """The INT4 group the keys are measured in: the format's, or for an FP16 build (whose group was never
    checked against head_dim) the largest that divides head_dim."""
    return math.gcd(kv.group_size, head_dim)


def round_trip_keys(keys: torch.Tensor, kv: KVCacheConfig) -> torch.Tensor:
    """keys [..., D] through the cache's quantiser as it stores them (rotated when the format rotates keys),
    back in the keys' own basis. An FP16 cache is measured in INT4, the format it is most often read in."""
    rotated = kv.rotation in ("hadamard", "hadamard_kv")
    x = rotate(keys) if rotated else keys
    if kv.dtype == "fp8":
        y = dequantize_fp8(*quantize_fp8(x))
    else:
        group = int4_group(kv, keys.shape[-1])
        y = dequantize_int4_asym(*quantize_int4_asym(x, group), group)
    return rotate(y) if rotated else y


def relative_key_error(keys: torch.Tensor, mean: torch.Tensor | None, kv: KVCacheConfig) -> torch.Tensor:
    """Per layer and KV head [L, Hkv]: RMS of the rounding error of keys [L, Hkv, T, D] (with `mean` [L, Hkv, D]
    subtracted first, when given) over the RMS of the keys' variation about their own mean."""
    centred = keys - (mean.unsqueeze(2) if mean is not None else 0)
    err = round_trip_keys(centred, kv) - centred
    variation = keys - keys.mean(dim=2, keepdim=True)
    return err.pow(2).mean(dim=(2, 3)).sqrt() / variation.pow(2).mean(dim=(2, 3)).sqrt().clamp_min(1e-12)


def choose_key_centering(keys: torch.Tensor, mean: torch.Tensor, kv: KVCacheConfig, explicit: bool | None,
                         bound: float | None = None) -> tuple[KVCacheConfig, dict[str, Any]]:
    """The KV config with key centering decided, and the record the manifest keeps as `kv_choice`.

    `explicit`: the build option (None: not given). A family default already on (Gemma 3) stays on.
    `bound`: None is KEY_ERROR_BOUND."""
    bound = KEY_ERROR_BOUND if bound is None else bound
    off = relative_key_error(keys, None, kv)
    on = relative_key_error(keys, mean, kv)
    worst_off, worst_on = off.max().item(), on.max().item()
    layer, head = divmod(int(off.argmax()), off.shape[1])
    measured = f"worst key error without centering {worst_off:.3f} (layer {layer}, KV head {head}), with {worst_on:.3f}"
    if explicit is not None:
        centering, why = explicit, "set by the build option"
    elif kv.key_centering:
        centering, why = True, "the model family's default"
    elif worst_off > bound and worst_on < worst_off:
        centering, why = True, f"measured: {measured}; bound {bound}"
    else:
        centering, why = False, f"measured: {measured}; within bound {bound}" if worst_off <= bound else \
            f"measured: {measured}; centering does not lower it"
    record = {
        "key_centering": centering,
        "why": why,
        "bound": bound,
        "measured_format": "fp8" if kv.dtype == "fp8" else f"int4_asym group {int4_group(kv, keys.shape[-1])}",
        "worst_key_error": {"without_centering": round(worst_off, 4), "with_centering": round(worst_on, 4)},
        # per layer, the worst KV head: what `inspect` lists
        "key_error_per_layer": {"without_centering": [round(x, 4) for x in off.amax(1).tolist()],
                                "with_centering": [round(x, 4) for x in on.amax(1).tolist()]},
    }
    return dataclasses.replace(kv, key_centering=centering), record
