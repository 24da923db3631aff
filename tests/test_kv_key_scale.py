"""The key scale (per channel, one value for both channels of a RoPE pair) chosen per layer at build
(builder/kv_choice.py): the scale against the math it claims, the attention error against a float64 loop, the
choice against what it measured, and an engine that runs with the scale its manifest records -- exact for
attention where nothing is quantised."""
from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from bie_trt.builder.key_centering import Calibration
from bie_trt.builder.kv_choice import (KEY_SCALE_MIN_GAIN, KEY_SCALE_RANGE, attention_error, balanced_key_scale,
                                       choose_key_scale)
from bie_trt.cli import main
from bie_trt.config import EngineConfig, KVCacheConfig
from bie_trt.executor.model_runner import ModelRunner
from bie_trt.model.llama import SeqInput
from bie_trt.model.synthetic import tiny_llama
from cache_reads import assert_cache_holds_transformed_keys


def product(q: torch.Tensor, k: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Σ_c rms(q_c s_c)² · Σ_c rms(k_c / s_c)² per KV head: what the score's INT4 error grows with."""
    q_ms = q.double().unflatten(0, (k.shape[0], -1)).pow(2).mean(dim=(1, 2))
    k_ms = k.double().pow(2).mean(dim=1)
    return (q_ms * s.double() ** 2).sum(-1) * (k_ms / s.double() ** 2).sum(-1)


def test_the_scale_balances_queries_and_keys_pair_by_pair():
    """s² = rms(k)/rms(q) over each RoPE pair (channels i and i + D/2) minimises ‖q∘s‖·‖k/s‖ among scales equal
    within pairs (Cauchy–Schwarz): no such perturbation of it does better; it is normalised to a geometric mean
    of 1 per head."""
    g = torch.Generator().manual_seed(0)
    H, Hkv, T, D = 4, 2, 200, 16
    spread = torch.exp2(torch.linspace(-3, 3, D))
    q = torch.randn(H, T, D, generator=g) / spread                    # small where the keys are large
    k = torch.randn(Hkv, T, D, generator=g) * spread
    s = balanced_key_scale(q, k)
    assert s.shape == (Hkv, D) and torch.equal(s[:, :D // 2], s[:, D // 2:])
    torch.testing.assert_close(s.log().mean(-1), torch.zeros(Hkv), atol=1e-5, rtol=0)
    # the ratio of two pairs' scales is the square root of the ratio of their k-rms over q-rms (loops, float64)
    want = torch.zeros(Hkv, D // 2, dtype=torch.float64)
    for h in range(Hkv):
        for i in range(D // 2):
            pair = [i, i + D // 2]
            k_rms = k[h][:, pair].double().pow(2).mean().sqrt()
            q_rms = q[2 * h:2 * h + 2][..., pair].double().pow(2).mean().sqrt()
            want[h, i] = (k_rms / q_rms).sqrt()
    torch.testing.assert_close(s[:, 1:D // 2].double() / s[:, :1], want[:, 1:] / want[:, :1], rtol=1e-4, atol=0)
    best = product(q, k, s)
    assert (best < 0.5 * product(q, k, torch.ones(Hkv, D))).all()   # far better than no scale here
    for _ in range(20):
        nudge = torch.exp(0.2 * torch.randn(Hkv, D // 2, generator=g))
        assert (product(q, k, s * nudge.repeat(1, 2)) >= best * (1 - 1e-9)).all()


def test_a_pair_scale_turns_with_rope_and_a_channel_scale_would_not():
    """RoPE turns channels i and i + D/2 together: with one scale on both, scaling then turning is turning then
    scaling, so the scale fitted on the calibration's positions fits every later one."""
    from bie_trt.builder.kv_choice import shifted
    from bie_trt.kernels.rope import inverse_frequencies

    cfg = tiny_llama(hidden_size=256, num_heads=4, num_kv_heads=1, num_layers=1)
    g = torch.Generator().manual_seed(4)
    D = cfg.head_dim
    q, k = torch.randn(4, 64, D, generator=g), torch.randn(1, 64, D, generator=g) * torch.exp2(torch.linspace(-4, 4, D))
    s, inv = balanced_key_scale(q, k)[:, None], inverse_frequencies(cfg)
    torch.testing.assert_close(shifted(k, inv, 9000) / s, shifted(k / s, inv, 9000), atol=1e-4, rtol=1e-4)
    per_channel = torch.exp2(torch.linspace(-2, 2, D))
    assert not torch.allclose(shifted(k, inv, 9000) / per_channel, shifted(k / per_channel, inv, 9000), atol=1e-2)


def test_the_scale_stays_within_its_range_for_a_dead_channel():
    q, k = torch.randn(2, 50, 8), torch.randn(1, 50, 8)
    k[..., 3] = 0   # a channel that never varies
    s = balanced_key_scale(q, k)
    assert s.isfinite().all() and s.min() >= 1 / KEY_SCALE_RANGE and s.max() <= KEY_SCALE_RANGE


def test_attention_error_is_the_relative_change_of_causal_attention():
    """Against a float64 loop over query heads and rows, head h reading KV head h // group."""
    g = torch.Generator().manual_seed(1)
    H, Hkv, T, D, scale = 4, 2, 12, 8, 0.35
    q, k, v = torch.randn(H, T, D, generator=g), torch.randn(Hkv, T, D, generator=g), torch.randn(Hkv, T, D, generator=g)
    k2 = k + 0.3 * torch.randn(Hkv, T, D, generator=g)
    exact, moved = torch.zeros(H, T, D, dtype=torch.float64), torch.zeros(H, T, D, dtype=torch.float64)
    for h in range(H):
        j = h // (H // Hkv)
        for t in range(T):
            for out, keys in ((exact, k), (moved, k2)):
                w = (keys[j, :t + 1].double() @ q[h, t].double() * scale).softmax(0)
                out[h, t] = w @ v[j, :t + 1].double()
    want = ((moved - exact).norm() / exact.norm()).item()
    assert attention_error(q, k, v, k2, scale) == pytest.approx(want, rel=1e-4)


def calibration_with_an_outlier_layer() -> tuple[Calibration, object]:
    """Two layers, 1 KV head of 64 channels, 4 query heads. Layer 0: queries and keys alike in every channel.
    Layer 1: four key channels vary 40x more than the rest while the queries barely read them -- per-token INT4
    spends its range on channels that hardly move a score."""
    g = torch.Generator().manual_seed(2)
    cfg = tiny_llama(hidden_size=256, num_heads=4, num_kv_heads=1, num_layers=2)
    L, H, Hkv, T, D = 2, 4, 1, 256, cfg.head_dim
    keys = torch.randn(L, Hkv, T, D, generator=g)
    queries = {li: torch.randn(H, T, D, generator=g) for li in range(L)}
    keys[1, :, :, :4] *= 40
    queries[1][..., :4] /= 40
    values = torch.randn(L, Hkv, T, D, generator=g)
    return Calibration(keys, values, queries, D ** -0.5 * 4), cfg


def test_a_layer_is_scaled_where_its_measured_error_falls_and_nowhere_else():
    calibration, cfg = calibration_with_an_outlier_layer()
    kv = KVCacheConfig(dtype="int4_asym")
    chosen, scale, record = choose_key_scale(calibration, cfg, None, kv, explicit=None)
    errors = record["attention_error_per_layer"]
    assert record["layers"] == [1] and chosen.key_scale, record
    assert errors[1][1] < (1 - KEY_SCALE_MIN_GAIN) * errors[1][0]          # measured to help where chosen
    assert not errors[0][1] < (1 - KEY_SCALE_MIN_GAIN) * errors[0][0]      # and not where it was left off
    # the four outlier channels' RoPE pairs (i and i + D/2) take the large scale, every other pair a small one
    D = scale.shape[-1]
    outliers = torch.zeros(D, dtype=torch.bool)
    outliers[:4] = outliers[D // 2:D // 2 + 4] = True
    assert (scale[0] == 1).all() and scale[1, 0, outliers].min() > 4 * scale[1, 0, ~outliers].max()
    assert record["why"].startswith("measured")
    # the stored scale is the one measured: fp16-exact
    assert torch.equal(scale, scale.half().float())


def test_an_explicit_option_wins_and_the_measurements_are_kept():
    calibration, cfg = calibration_with_an_outlier_layer()
    kv = KVCacheConfig(dtype="int4_asym")
    off, scale, record = choose_key_scale(calibration, cfg, None, kv, explicit=False)
    assert not off.key_scale and record["layers"] == [] and (scale == 1).all()
    assert all(e is not None for e in record["attention_error_per_layer"])
    on, scale, record = choose_key_scale(calibration, cfg, None, kv, explicit=True)
    assert on.key_scale and record["layers"] == [0, 1] and record["why"] == "set by the build option"


def test_a_layer_without_keys_of_its_own_is_not_measured():
    calibration, cfg = calibration_with_an_outlier_layer()
    del calibration.queries[0]   # as a linear-attention layer records none
    _, scale, record = choose_key_scale(calibration, cfg, None, KVCacheConfig(dtype="int4_asym"), explicit=None)
    assert record["attention_error_per_layer"][0] is None and (scale[0] == 1).all()


# --- an engine built with the scale --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def scaled_engine(build):
    """SmolLM2 with an INT4 cache and the key scale in every layer (the option given): scales far from 1."""
    return build(kv_cache_dtype="int4_asym", kv_key_scale=True)


def test_the_manifest_the_runner_and_inspect_agree_on_the_scale(scaled_engine):
    manifest = json.loads((scaled_engine / "manifest.json").read_text())
    record = manifest["kv_choice"]["key_scale"]
    assert manifest["kv"]["key_scale"] is True and record["why"] == "set by the build option"
    runner = ModelRunner(EngineConfig(engine_dir=str(scaled_engine), device="cpu", max_num_seqs=1, num_kv_blocks=4))
    assert runner.kv_config.key_scale is True
    assert runner.model.key_scale.float().log2().abs().max() > 1   # some channel scaled by more than 2x
    shown = CliRunner().invoke(main, ["inspect", str(scaled_engine)])
    assert shown.exit_code == 0, shown.output
    assert "key scale on" in shown.output and "key scale in layers [0, 1," in shown.output


def test_the_scale_leaves_attention_exact_where_nothing_is_quantised(scaled_engine):
    """Keys divided by s and queries multiplied by it: with the window over the whole prompt (nothing quantised),
    the logits with the scale on must equal those with it off."""
    tokens = torch.arange(3, 43)

    def logits(scale: bool) -> torch.Tensor:
        runner = ModelRunner(EngineConfig(engine_dir=str(scaled_engine), device="cpu", max_num_seqs=1,
                                          num_kv_blocks=4, kv_window=1024, kv_key_scale=scale))
        return runner.forward([SeqInput(tokens, 0, list(range(3)), all_logits=True)])[0]

    # fp32 rounding of q·s and k/s through 30 layers: 2e-4 at most here; a scale missing on one side moves logits by units
    torch.testing.assert_close(logits(True), logits(False), atol=1e-3, rtol=1e-3)


def test_every_key_attention_reads_is_the_centred_key_over_the_stored_scale(scaled_engine):
    """What a scaled cache holds, FP16 or INT4, is rotate((k - m) / s) for the raw key k (from an FP16 cache), the
    engine's mean m (when centering is on) and its stored scale s; INT4 within half a step of it."""
    assert assert_cache_holds_transformed_keys(scaled_engine, "int4_asym").kv_config.key_scale
