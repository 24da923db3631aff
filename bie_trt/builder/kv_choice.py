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
from ..kernels.key_offset import turned, unturned
from ..kernels.rope import Rope, cos_sin
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


def relative_key_error(keys: torch.Tensor, offsets: torch.Tensor | None, kv: KVCacheConfig) -> torch.Tensor:
    """Per layer and KV head [L, Hkv]: RMS of the rounding error of keys [L, Hkv, T, D] (with `offsets` (the
    centering's, `key_offsets`) subtracted first, when given) over the RMS of the keys' variation about their own
    mean."""
    centred = keys - (offsets if offsets is not None else 0)
    err = round_trip_keys(centred, kv) - centred
    variation = keys - keys.mean(dim=2, keepdim=True)
    return err.pow(2).mean(dim=(2, 3)).sqrt() / variation.pow(2).mean(dim=(2, 3)).sqrt().clamp_min(1e-12)


def quantised_layers(model: Any) -> list[int]:
    """The layers whose keys the cache stores quantised: those owning a full-attention cache. A hybrid model's
    sliding layers keep theirs in FP16 (their own bounded pool), a KV-shared or linear-attention layer owns none,
    so nothing about their keys is rounded and nothing is measured or decided for them."""
    return [li for li in range(model.num_layers) if model.cache_kind(li) == "full_attention"]


def choose_key_centering(keys: torch.Tensor, offsets: torch.Tensor, kv: KVCacheConfig, explicit: bool | None,
                         bound: float | None = None, layers: list[int] | None = None
                         ) -> tuple[KVCacheConfig, dict[str, Any]]:
    """The KV config with key centering decided, and the record the manifest keeps as `kv_choice`.

    `offsets` [L, Hkv, T, D]: what centering subtracts from each calibration key (`key_offsets`).
    `explicit`: the build option (None: not given). A family default already on (Gemma 3) stays on.
    `bound`: None is KEY_ERROR_BOUND. `layers`: those the decision weighs (quantised_layers; None: every one);
    the record lists every layer's error."""
    bound = KEY_ERROR_BOUND if bound is None else bound
    off = relative_key_error(keys, None, kv)
    on = relative_key_error(keys, offsets, kv)
    weighed = list(range(keys.shape[0])) if layers is None else layers
    worst_off, worst_on = off[weighed].max().item(), on[weighed].max().item()
    layer, head = divmod(int(off[weighed].argmax()), off.shape[1])
    layer = weighed[layer]
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


# --- The key scale (per channel, one value for both channels of a RoPE pair) ---------------------------------
# A layer's keys are divided by the scale only where that moves its attention output at least this fraction less
# than without (measured through the cache's quantiser on the calibration text); elsewhere it stores ones.
KEY_SCALE_MIN_GAIN = 0.25
# How far one channel's scale may sit from its head's geometric mean: a channel that barely varies (or a query
# channel that is nearly zero) must not get a scale that overflows fp16 keys or queries.
KEY_SCALE_RANGE = 2.0 ** 6


def balanced_key_scale(queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The scale s [Hkv, D] that balances each RoPE pair's share of the INT4 error in q·k, from queries [H, T, D]
    and keys [Hkv, T, D] as they are quantised (centred, when centering is on).

    Keys stored as k/s and queries read as q·s leave q·k unchanged. After the Hadamard rotation INT4's rounding
    error e is spread evenly over the channels, its size set by the stored keys' magnitude, so the score's error
    (q∘s)·e grows with ‖q∘s‖·‖k/s‖; by Cauchy–Schwarz that is smallest when s² = rms(k)/rms(q), here taken
    over each RoPE pair (channels i and i + D/2), the queries of each KV head's group pooled. One scale for both
    channels of a pair commutes with RoPE, which turns each pair by its position: a per-channel scale fits how
    the calibration's first 512 positions happen to split a slow pair's energy, and thousands of positions on
    RoPE has moved it to the other channel (on SmolLM2 the attention error grew from 0.17 to 0.49 at 32k with
    per-channel scales, and stays at 0.18 with per-pair ones). Normalised to a geometric mean of 1 per head,
    within KEY_SCALE_RANGE."""
    h_kv, d = keys.shape[0], keys.shape[-1]

    def pair_rms(ms: torch.Tensor) -> torch.Tensor:   # [Hkv, D] mean squares -> each pair's rms, on both channels
        return ms.unflatten(-1, (2, d // 2)).mean(-2).repeat(1, 2).sqrt()

    q_rms = pair_rms(queries.unflatten(0, (h_kv, -1)).pow(2).mean(dim=(1, 2)))
    k_rms = pair_rms(keys.pow(2).mean(dim=1))
    floor = 1e-6
    s = (k_rms.clamp_min(floor) / q_rms.clamp_min(floor)).sqrt()
    s = s / s.log().mean(dim=-1, keepdim=True).exp()
    return s.clamp(1 / KEY_SCALE_RANGE, KEY_SCALE_RANGE)


def attention_error(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, read_keys: torch.Tensor,
                    softmax_scale: float) -> float:
    """‖O′ − O‖ / ‖O‖ of causal attention over one layer: queries [H, T, D] against keys and values [Hkv, T, D],
    O reading `keys`, O′ reading `read_keys` (what the cache returns); query head h reads KV head h // group."""
    group = queries.shape[0] // keys.shape[0]
    T = keys.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool).tril()

    def out(k: torch.Tensor) -> torch.Tensor:
        scores = torch.einsum("htd,hsd->hts", queries, k.repeat_interleave(group, 0)) * softmax_scale
        p = scores.masked_fill(~causal, -torch.inf).softmax(-1)
        return torch.einsum("hts,hsd->htd", p, values.repeat_interleave(group, 0))

    exact = out(keys)
    return ((out(read_keys) - exact).norm() / exact.norm().clamp_min(1e-12)).item()


def layer_key_scale(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, kv: KVCacheConfig,
                    softmax_scale: float, offsets: torch.Tensor | float = 0.0) -> tuple[torch.Tensor, float, float]:
    """One layer: its balanced key scale [Hkv, D] (fp16-rounded, as stored) and the attention error through the
    cache's quantiser without and with it. `keys` as they reach the quantiser (centred when centering is on);
    `offsets` [Hkv, T, D]: what centering took from them, which attention adds back."""
    s = balanced_key_scale(queries, keys).half().float()
    exact = keys + offsets
    without = attention_error(queries, exact, values, round_trip_keys(keys, kv) + offsets, softmax_scale)
    with_scale = attention_error(queries, exact, values, round_trip_keys(keys / s[:, None], kv) * s[:, None] + offsets,
                                 softmax_scale)
    return s, without, with_scale


def choose_key_scale(calibration: Any, model: Any, mean: torch.Tensor | None, kv: KVCacheConfig,
                     explicit: bool | None, min_gain: float | None = None
                     ) -> tuple[KVCacheConfig, torch.Tensor, dict[str, Any]]:
    """The KV config with the key scale decided, the scale to store [L, Hkv, D] (ones in every layer left
    unscaled) and the record the manifest keeps as `kv_choice.key_scale`.

    `calibration`: key_centering.Calibration; `model`: its ModelConfig (each layer's KV heads and head_dim);
    `mean`: the pre-RoPE mean key the cache subtracts ([L, Hkv, D], or None without centering). A quantised layer
    (quantised_layers) is scaled where its measured attention error falls by at least `min_gain` (None:
    KEY_SCALE_MIN_GAIN); `explicit` (the build option) True scales every quantised layer, False none, and the
    measurements are recorded either way."""
    min_gain = KEY_SCALE_MIN_GAIN if min_gain is None else min_gain
    offsets = key_offsets(calibration, model, mean) if mean is not None else torch.zeros_like(calibration.keys)
    keys = calibration.keys - offsets
    scale = torch.ones(keys.shape[0], keys.shape[1], keys.shape[3])
    errors: list[list[float] | None] = []
    layers = []
    quantised = set(quantised_layers(model))
    for li in range(keys.shape[0]):
        q = calibration.queries.get(li)
        if q is None or li not in quantised:   # keys kept in FP16, or none of its own
            errors.append(None)
            continue
        h, d = model.kv_heads_of(li), model.head_dim_of(li)
        s, without, with_scale = layer_key_scale(q[..., :d], keys[li, :h, :, :d], calibration.values[li, :h, :, :d],
                                                 kv, calibration.softmax_scale, offsets[li, :h, :, :d])
        errors.append([round(without, 4), round(with_scale, 4)])
        if explicit if explicit is not None else with_scale < (1 - min_gain) * without:
            scale[li, :h, :d] = s
            layers.append(li)
    why = ("set by the build option" if explicit is not None else
           f"measured: attention error through the cache's quantiser falls by at least {min_gain:.0%} in "
           f"{len(layers)} of {sum(e is not None for e in errors)} layers")
    record = {"layers": layers, "why": why, "min_gain": min_gain,
              # per layer, the attention error [without, with] the scale (None: a layer whose keys are not quantised)
              "attention_error_per_layer": errors}
    return dataclasses.replace(kv, key_scale=bool(layers)), scale, record


# --- What the chosen settings still leave ---------------------------------------------------------------------
# The attention error (as measured above) a layer may keep once centering and the key scale are chosen. Measured
# engines: Qwen2.5-Coder-0.5B as chosen (worst layer 0.12 as calibrated) KL divergence 0.0026 at 2k, +0.38%
# perplexity at 8k, and +3.5% at 32k, where RoPE has turned its layer 0 to about 1.0; with centering only (layer 0
# at 0.72) +2.8% at 2k; Gemma-3-270M (worst 0.23 over 32k positions with per-channel scales) +0.51% at 32k
# (docs/kv-cache-quality.md).
ATTENTION_ERROR_BOUND = 0.2


def choose_key_transforms(calibration: Any, model: Any, mean: torch.Tensor, kv: KVCacheConfig,
                          centering: bool | None, scale: bool | None
                          ) -> tuple[KVCacheConfig, torch.Tensor, dict[str, Any]]:
    """Key centering, then the key scale over keys centred as decided: the KV config, the scale to store and the
    manifest's `kv_choice` record. `mean` [L, Hkv, D] is the pre-RoPE mean the cache subtracts; `centering`,
    `scale`: the build options (None: measured)."""
    kv, choice = choose_key_centering(calibration.keys, key_offsets(calibration, model, mean), kv, centering,
                                      layers=quantised_layers(model))
    kv, key_scale, choice["key_scale"] = choose_key_scale(calibration, model, mean if kv.key_centering else None,
                                                          kv, scale)
    return kv, key_scale, choice


def calibration_positions(calibration: Any) -> torch.Tensor:
    """The positions [T] the calibration's keys and queries sat at (past its skipped first ones)."""
    return torch.arange(calibration.keys.shape[2]) + calibration.first_position


def pre_rope_mean(calibration: Any, model: Any) -> torch.Tensor:
    """[L, Hkv, D]: each layer's mean key before RoPE (the calibration's keys turned back by their positions), the
    offset key centering subtracts before RoPE turns it (kernels/key_offset.py)."""
    rope, positions = Rope(model, torch.device("cpu")), calibration_positions(calibration)
    return torch.stack([unturned(calibration.keys[li], positions, rope.inv_freq_of(li)).mean(dim=1)
                        for li in range(calibration.keys.shape[0])])


def key_offsets(calibration: Any, model: Any, mean: torch.Tensor, shift: int = 0) -> torch.Tensor:
    """[L, Hkv, T, D]: what centering subtracts from each calibration key (the keys moved `shift` positions on):
    the pre-RoPE mean `mean` [L, Hkv, D] turned to the key's position."""
    rope, positions = Rope(model, torch.device("cpu")), calibration_positions(calibration) + shift
    return torch.stack([turned(mean[li], positions, rope.inv_freq_of(li)) for li in range(mean.shape[0])])


def shifted(x: torch.Tensor, inv_freq: torch.Tensor, positions: int) -> torch.Tensor:
    """Post-RoPE queries or keys [..., T, D] as the same text would give them `positions` further on: RoPE turned
    on by as much. q·k of every pair is unchanged; what moves is how the keys' rounding falls."""
    cos, sin = cos_sin(torch.tensor([positions]), inv_freq, torch.float32)
    return Rope.apply(x, cos[0], sin[0])


def attention_errors(calibration: Any, model: Any, mean: torch.Tensor, kv: KVCacheConfig, key_scale: torch.Tensor,
                     shifts: list[int]) -> dict[int, tuple[float, int]]:
    """Quantised layer -> (its worst attention error through `kv`'s quantiser over the calibration text moved to
    each of `shifts` positions further on, the shift of the worst). `kv.key_centering` says whether `mean` (the
    pre-RoPE mean, turned to each key's position) is subtracted; `key_scale` [L, Hkv, D] is the stored scale (ones
    where a layer is unscaled).

    Why shifts: RoPE turns each key pair with its position, so what the quantiser sees of a key (its channels'
    split of each pair's energy, against a fixed scale) is not what the calibration's first 512 positions showed:
    a post-RoPE mean subtracted as a fixed vector moved Qwen2.5-Coder-0.5B's layer 0 INT4 error from 0.12 there to
    0.97 at 32,768 positions on; the pre-RoPE mean turned with each key keeps it at 0.04 (docs/kv-cache-quality.md)."""
    rope, positions = Rope(model, torch.device("cpu")), calibration_positions(calibration)
    out = {}
    for li in quantised_layers(model):
        q = calibration.queries.get(li)
        if q is None:
            continue
        h, d = model.kv_heads_of(li), model.head_dim_of(li)
        inv, s = rope.inv_freq_of(li), key_scale[li, :h, None, :d]
        worst = (-1.0, 0)
        for shift in shifts:
            keys = shifted(calibration.keys[li, :h, :, :d], inv, shift)
            # what the cache stores keys without, and attention adds back exactly (kernels/key_offset.py)
            off = turned(mean[li, :h, :d], positions + shift, inv) if kv.key_centering else 0
            read = round_trip_keys((keys - off) / s, kv) * s + off
            e = attention_error(shifted(q[..., :d], inv, shift), keys, calibration.values[li, :h, :, :d], read,
                                calibration.softmax_scale)
            worst = max(worst, (e, shift))
        out[li] = (round(worst[0], 4), worst[1])
    return out


def position_shifts(max_position: int, calibrated: int) -> list[int]:
    """Where the bound is checked: the calibration text where it is, and moved an eighth, a quarter, half and all
    the way to the engine's last positions."""
    far = max(max_position - calibrated, 0)
    return sorted({0, far // 8, far // 4, far // 2, far})


def check_attention_bound(calibration: Any, model: Any, mean: torch.Tensor, kv: KVCacheConfig,
                          centering: bool | None, scale: bool | None, chosen: dict[str, Any],
                          key_scale: torch.Tensor, max_position: int = 0, bound: float | None = None
                          ) -> dict[str, Any]:
    """Whether the chosen settings (`chosen`: choose_key_transforms' record for `kv`'s cache type, `key_scale` the
    scale it chose) keep every quantised layer's attention error within `bound` (None: ATTENTION_ERROR_BOUND) at
    every position up to `max_position` (position_shifts), and where they do not, which cache type does: FP8 as
    its own build would choose centering and scale for it (measured the same way), else FP16. `kv` is the
    config before centering and the scale were chosen, `centering`/`scale` the build options."""
    bound = ATTENTION_ERROR_BOUND if bound is None else bound
    fmt = chosen["measured_format"]
    if kv.dtype == "fp16":
        return {"bound": bound, "met": True, "why": "an FP16 cache: nothing is quantised"}
    shifts = position_shifts(max_position, calibration.keys.shape[2])
    as_chosen = dataclasses.replace(kv, key_centering=chosen["key_centering"])
    measured = attention_errors(calibration, model, mean, as_chosen, key_scale, shifts)
    errors = {li: e for li, (e, _) in measured.items()}
    over = sorted(li for li, e in errors.items() if e > bound)
    worst = max(errors, key=errors.get)
    record: dict[str, Any] = {"bound": bound, "format": fmt, "met": not over, "layers_over": over,
                              "positions_shifted": shifts,
                              "worst": {"layer": worst, "attention_error": errors[worst],
                                        "shifted_by": measured[worst][1]},
                              # per quantised layer, its worst error over the shifts
                              "attention_error_per_layer": {str(li): e for li, e in errors.items()}}
    if not over:
        return record
    fix = "fp16"
    if kv.dtype != "fp8":
        fp8_kv, fp8_scale, fp8 = choose_key_transforms(calibration, model, mean, dataclasses.replace(kv, dtype="fp8"),
                                                       centering, scale)
        fp8_worst = max(e for e, _ in attention_errors(calibration, model, mean, fp8_kv, fp8_scale, shifts).values())
        record["fp8_worst_attention_error"] = fp8_worst
        if fp8_worst <= bound:
            fix = "fp8"
    record["fix"] = f"--kv-cache-dtype {fix}"
    where = f" at up to {shifts[-1]:,} positions on" if shifts[-1] else ""
    record["why"] = (f"{fmt} keys with the chosen centering and key scale still move attention by more than "
                     f"{bound} in layers {over}{where} (worst {errors[worst]:.3f}, layer {worst}); "
                     + (f"FP8 measured {record['fp8_worst_attention_error']:.3f} at worst"
                        + (", over it too" if fix == "fp16" else "") + ": " if "fp8_worst_attention_error" in record
                        else "")
                     + f"build with {record['fix']}")
    return record
