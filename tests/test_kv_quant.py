"""KV quantisers, Hadamard rotation and pool byte counts, checked against hand-computed values."""
from __future__ import annotations

import math

import pytest
import torch

from bie_trt.config import KVCacheConfig, ModelConfig
from bie_trt.kv.pool import allocate_pools, encode_quant_block, quant_bytes_per_token_per_layer
from bie_trt.kv.quant import (
    dequantize_block,
    dequantize_blocks,
    dequantize_fp8,
    dequantize_int4_asym,
    quantize_block,
    quantize_fp8,
    quantize_int4_asym,
)
from bie_trt.kv.rotation import hadamard_matrix, rotate


def model_config(layers: int = 2, heads: int = 4, kv_heads: int = 2, head_dim: int = 64) -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM", hidden_size=heads * head_dim, intermediate_size=4 * heads * head_dim,
        num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, vocab_size=256,
        rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=4096, tie_word_embeddings=False,
    )


def with_outliers(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    x[..., 3] *= 40.0  # an outlier channel, as real keys have
    x[..., -1] += 25.0  # and one with a large offset
    return x


# --- INT4, hand-computed -----------------------------------------------------------------------

def test_int4_hand_computed_two_groups() -> None:
    # Group 1: min -2, max 5.5 -> scale 7.5/15 = 0.5, zero -2; codes (x + 2) / 0.5 = 6, 0, 5.2 -> 5, 15.
    # Group 2: min 0, max 7.5 -> scale 0.5, zero 0; codes 15, 0, 2, 6.8 -> 7.
    x = torch.tensor([1.0, -2.0, 0.6, 5.5, 7.5, 0.0, 1.0, 3.4])
    packed, scale, zero = quantize_int4_asym(x, group_size=4)
    assert packed.dtype == torch.uint8 and scale.dtype == torch.float16 and zero.dtype == torch.float16
    # byte j = code[2j] | code[2j+1] << 4
    assert packed.tolist() == [0x06, 0xF5, 0x0F, 0x72]
    assert scale.tolist() == [0.5, 0.5]
    assert zero.tolist() == [-2.0, 0.0]
    x_hat = dequantize_int4_asym(packed, scale, zero, group_size=4)
    assert x_hat.tolist() == [1.0, -2.0, 0.5, 5.5, 7.5, 0.0, 1.0, 3.5]


def test_int4_exact_grid_round_trips_with_known_bytes() -> None:
    # x = code - 3 with codes 0..15 twice: scale 1, zero -3, and bytes 0x10, 0x32, ..., 0xFE.
    codes = torch.arange(32) % 16
    x = codes.float() - 3.0
    packed, scale, zero = quantize_int4_asym(x, group_size=32)
    assert packed.tolist() == [0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE] * 2
    assert scale.tolist() == [1.0] and zero.tolist() == [-3.0]
    assert torch.equal(dequantize_int4_asym(packed, scale, zero, 32), x)


def test_int4_nibble_order_byte_by_byte() -> None:
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (3, 5, 64), generator=g)
    codes[..., 0], codes[..., 1] = 0, 15  # pin each group's range to 0..15 so scale = 1, zero = 0
    codes[..., 32], codes[..., 33] = 15, 0
    packed, scale, zero = quantize_int4_asym(codes.float(), group_size=32)
    assert torch.all(scale == 1) and torch.all(zero == 0)
    for idx in torch.cartesian_prod(torch.arange(3), torch.arange(5)).tolist():
        row, byte_row = codes[idx[0], idx[1]].tolist(), packed[idx[0], idx[1]].tolist()
        for j, byte in enumerate(byte_row):
            assert byte & 0xF == row[2 * j], "channel 2j must sit in the low nibble"
            assert byte >> 4 == row[2 * j + 1], "channel 2j+1 must sit in the high nibble"


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_int4_error_bound_on_random_data_with_outliers(group_size: int, dtype: torch.dtype) -> None:
    x = with_outliers((3, 5, 128), seed=group_size).to(dtype)
    packed, scale, zero = quantize_int4_asym(x, group_size)
    assert packed.shape == (3, 5, 64) and scale.shape == zero.shape == (3, 5, 128 // group_size)
    xf = x.float()
    groups = xf.unflatten(-1, (-1, group_size))
    lo, hi = groups.amin(-1), groups.amax(-1)
    # zero is the group min, rounded down to fp16 (exactly the min when x is fp16).
    assert torch.all(zero.float() <= lo)
    if dtype == torch.float16:
        assert torch.equal(zero.float(), lo)
    else:
        assert torch.all(lo - zero.float() <= lo.abs() * 2.0**-10 + 1e-7)
    # scale is (max - zero) / 15 in fp16.
    torch.testing.assert_close(scale.float(), (hi - zero.float()) / 15, rtol=2.0**-11, atol=0)
    # Each element is within half a step of the stored scale (fp32 rounding aside).
    x_hat = dequantize_int4_asym(packed, scale, zero, group_size)
    step = scale.float().repeat_interleave(group_size, dim=-1)
    assert torch.all((xf - x_hat).abs() <= step / 2 + 1e-6 * xf.abs().amax())


def test_int4_constant_groups_use_a_positive_scale_and_return_the_value() -> None:
    x = torch.cat([torch.full((2, 32), 3.25), torch.zeros(2, 32), torch.full((2, 32), -7.5)], dim=-1)
    packed, scale, zero = quantize_int4_asym(x, group_size=32)
    assert torch.all(scale > 0) and torch.all(torch.isfinite(scale))
    assert torch.all(packed == 0)
    assert zero.tolist() == [[3.25, 0.0, -7.5]] * 2
    assert torch.equal(dequantize_int4_asym(packed, scale, zero, 32), x)


def test_int4_dequantize_returns_the_requested_dtype() -> None:
    packed, scale, zero = quantize_int4_asym(torch.randn(4, 64), 32)
    assert dequantize_int4_asym(packed, scale, zero, 32, dtype=torch.float16).dtype == torch.float16


def test_int4_rejects_a_group_size_that_does_not_divide_head_dim() -> None:
    with pytest.raises(ValueError, match="group size"):
        quantize_int4_asym(torch.randn(2, 96), 64)


# --- FP8 -----------------------------------------------------------------------------------

def test_fp8_matches_torch_casting_of_x_over_scale() -> None:
    x = with_outliers((4, 3, 64), seed=7)
    q, scale = quantize_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float16 and scale.shape == (4, 3, 1)
    expected_scale = (x.abs().amax(-1, keepdim=True) / 448).half()
    assert torch.equal(scale, expected_scale)
    expected_q = (x / expected_scale.float()).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(q.view(torch.uint8), expected_q.view(torch.uint8))
    x_hat = dequantize_fp8(q, scale)
    assert torch.equal(x_hat, expected_q.float() * expected_scale.float())
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 above the subnormal range.
    assert torch.all((x - x_hat).abs() <= x.abs() * 2.0**-4 + scale.float() * 2.0**-9)


def test_fp8_zero_token_gets_a_positive_scale() -> None:
    q, scale = quantize_fp8(torch.zeros(2, 64))
    assert torch.all(scale > 0)
    assert torch.equal(dequantize_fp8(q, scale), torch.zeros(2, 64))


# --- whole blocks in the pools -------------------------------------------------------------

def filled_pools(dtype: str, layers: int = 3):
    kv = KVCacheConfig(dtype=dtype, group_size=32, block_size=4)
    pools = allocate_pools(model_config(layers=layers), kv, num_fp_blocks=4, num_quant_blocks=3, dtype=torch.float32)
    g = torch.Generator().manual_seed(3)
    pools.k.copy_(torch.randn(pools.k.shape, generator=g) * 3)
    pools.v.copy_(torch.randn(pools.v.shape, generator=g))
    for name, t in pools.tensors().items():  # recognisable junk in the quantised pool
        if name not in ("k", "v"):
            t.view(torch.uint8).fill_(0x3C)
    return pools


def snapshot(pools) -> dict[str, torch.Tensor]:
    return {n: t.view(torch.uint8).clone() for n, t in pools.tensors().items()}


@pytest.mark.parametrize("dtype", ["int4_asym", "fp8"])
def test_quantize_block_moves_exactly_one_block_in_every_layer(dtype: str) -> None:
    pools = filled_pools(dtype)
    before = snapshot(pools)
    quantize_block(pools, None, fp_block=2, q_block=1)
    for name, t in pools.tensors().items():
        now = t.view(torch.uint8)
        if name in ("k", "v"):
            assert torch.equal(now, before[name]), "the FP16 pool must not change"
            continue
        others = [b for b in range(t.shape[1]) if b != 1]
        assert torch.equal(now[:, others], before[name][:, others]), f"{name}: other blocks changed"
    for side in ("k", "v"):
        src = getattr(pools, side)[:, 2]
        if dtype == "int4_asym":
            packed, scale, zero = quantize_int4_asym(src, 32)
            assert torch.equal(pools.k_zero[:, 1] if side == "k" else pools.v_zero[:, 1], zero)
        else:
            packed, scale = quantize_fp8(src)
        assert torch.equal(getattr(pools, f"{side}_q")[:, 1].view(torch.uint8), packed.view(torch.uint8))
        assert torch.equal(getattr(pools, f"{side}_scale")[:, 1], scale)


def test_quantize_block_of_one_layer_leaves_the_other_layers() -> None:
    pools = filled_pools("int4_asym")
    before = snapshot(pools)
    quantize_block(pools, 1, fp_block=0, q_block=2)
    for name in ("k_pack", "v_pack"):   # codes and records of every (block, head)
        now = getattr(pools, name)
        assert torch.equal(now[[0, 2]], before[name][[0, 2]])
        assert not torch.equal(now[1, 2], before[name][1, 2])


@pytest.mark.parametrize("dtype", ["int4_asym", "fp8"])
def test_dequantize_block_reads_either_pool(dtype: str) -> None:
    pools = filled_pools(dtype)
    quantize_block(pools, None, fp_block=3, q_block=0)
    k, v = dequantize_block(pools, 2, 3)  # FP16 entry: the pool's values as they are
    assert k.dtype == torch.float32 and torch.equal(k, pools.k[2, 3]) and torch.equal(v, pools.v[2, 3])
    kq, vq = dequantize_block(pools, 2, encode_quant_block(0))
    assert kq.shape == vq.shape == (2, 4, 64) and kq.dtype == torch.float32
    if dtype == "int4_asym":
        expected = dequantize_int4_asym(pools.k_q[2, 0], pools.k_scale[2, 0], pools.k_zero[2, 0], 32)
        step = pools.v_scale[2, 0].float().repeat_interleave(32, dim=-1)
        assert torch.all((vq - pools.v[2, 3]).abs() <= step / 2 + 1e-5)
    else:
        expected = dequantize_fp8(pools.k_q[2, 0], pools.k_scale[2, 0])
    assert torch.equal(kq, expected)
    torch.testing.assert_close(kq, pools.k[2, 3], rtol=0.07, atol=0.6)


def test_quantize_block_refuses_an_fp16_cache() -> None:
    pools = allocate_pools(model_config(), KVCacheConfig(dtype="fp16"), 2, 2, dtype=torch.float32)
    with pytest.raises(ValueError, match="no quantised pool"):
        quantize_block(pools, None, 0, 0)


# --- bytes per token -----------------------------------------------------------------------

def pool_bytes_per_token(model: ModelConfig, kv: KVCacheConfig) -> dict[str, float]:
    # The meta device allocates nothing but reports the same nbytes.
    pools = allocate_pools(model, kv, num_fp_blocks=3, num_quant_blocks=5, device="meta")
    b = pools.nbytes()
    return {"fp16": b["fp16"] / (3 * kv.block_size), "quant": b["quant"] / (5 * kv.block_size)}


@pytest.mark.parametrize("layers,kv_heads,head_dim,group", [(2, 2, 64, 32), (32, 8, 128, 64), (3, 4, 128, 128)])
def test_int4_pool_bytes_per_token_match_the_design_formula(layers: int, kv_heads: int, head_dim: int, group: int) -> None:
    model = model_config(layers=layers, heads=4 * kv_heads, kv_heads=kv_heads, head_dim=head_dim)
    kv = KVCacheConfig(dtype="int4_asym", group_size=group)
    per_token = pool_bytes_per_token(model, kv)
    # K and V, each head: head_dim/2 bytes of nibbles + (fp16 scale + fp16 zero) per group.
    formula = 2 * layers * kv_heads * (head_dim // 2 + (head_dim // group) * 4)
    assert per_token["quant"] == formula == layers * quant_bytes_per_token_per_layer(model, kv)
    assert per_token["fp16"] == 2 * layers * kv_heads * head_dim * 2


def test_llama3_8b_kv_bytes_per_token_are_the_design_numbers() -> None:
    llama = model_config(layers=32, heads=32, kv_heads=8, head_dim=128)
    int4 = pool_bytes_per_token(llama, KVCacheConfig(dtype="int4_asym", group_size=64))
    assert int4["quant"] == 2 * 32 * 8 * (64 + 2 * 4) == 36 * 1024
    assert int4["fp16"] == 128 * 1024
    assert int4["quant"] * 65536 == 2.25 * 2**30  # 64k tokens: 2.25 GiB
    fp8 = pool_bytes_per_token(llama, KVCacheConfig(dtype="fp8"))
    assert fp8["quant"] == 2 * 32 * 8 * (128 + 2)


# --- Hadamard rotation ---------------------------------------------------------------------

def test_hadamard_small_matrices_by_hand() -> None:
    r = 1 / math.sqrt(2)
    assert torch.allclose(hadamard_matrix(2), torch.tensor([[r, r], [r, -r]]))
    h4 = torch.tensor([[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1]]) / 2.0
    assert torch.equal(hadamard_matrix(4), h4)


@pytest.mark.parametrize("n", [1, 8, 64, 128])
def test_hadamard_is_orthonormal_and_symmetric(n: int) -> None:
    h = hadamard_matrix(n, torch.float64)
    assert torch.allclose(h @ h.T, torch.eye(n, dtype=torch.float64), atol=1e-12)
    assert torch.equal(h, h.T)


def test_hadamard_is_cached_and_rejects_other_sizes() -> None:
    assert hadamard_matrix(16, torch.float32, "cpu") is hadamard_matrix(16, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="power-of-two"):
        hadamard_matrix(96)


def test_rotation_keeps_dot_products_and_spreads_an_outlier() -> None:
    g = torch.Generator().manual_seed(5)
    q, k = torch.randn(6, 128, generator=g), with_outliers((6, 128), seed=6)
    torch.testing.assert_close(rotate(q) @ rotate(k).T, q @ k.T, rtol=1e-5, atol=1e-4)
    spike = torch.zeros(128)
    spike[3] = 100.0
    assert torch.allclose(rotate(spike).abs(), torch.full((128,), 100.0 / math.sqrt(128)))
    assert rotate(k.half()).dtype == torch.float16


def test_rotation_shrinks_int4_error_on_outlier_keys() -> None:
    k = with_outliers((64, 128), seed=9)

    def err(x: torch.Tensor) -> float:
        return (dequantize_int4_asym(*quantize_int4_asym(x, 64), 64) - x).norm().item()

    # The rotation is orthonormal, so the error norm compares like for like.
    assert err(rotate(k)) < 0.5 * err(k)


def test_block_scale_scope_shares_one_range_per_layer() -> None:
    model = model_config()
    kv = KVCacheConfig(dtype="int4_asym", group_size=32, block_size=4, scale_scope="block")
    pools = allocate_pools(model, kv, num_fp_blocks=2, num_quant_blocks=2, dtype=torch.float32)
    pools.k[:, 1] = with_outliers(pools.k[:, 1].shape, seed=3)
    pools.v[:, 1] = torch.randn(pools.v[:, 1].shape)
    quantize_block(pools, None, 1, 0)
    for layer in range(model.num_layers):
        zero, scale = pools.k_zero[layer, 0].float(), pools.k_scale[layer, 0].float()
        assert torch.unique(zero).numel() == 1 and torch.unique(scale).numel() == 1
        x = pools.k[layer, 1]
        assert zero.flatten()[0] <= x.min() and x.min() - zero.flatten()[0] < 1e-2
        assert abs(scale.flatten()[0] - (x.max() - x.min()) / 15) <= 1e-2 * scale.flatten()[0]
        k, _ = dequantize_block(pools, layer, encode_quant_block(0))
        assert ((k - x).abs() <= scale.flatten()[0] / 2 + 1e-3).all()


def test_the_scratch_block_is_allocated_but_owned_by_no_sequence() -> None:
    kv = KVCacheConfig(dtype="int4_asym", group_size=32, block_size=4)
    pools = allocate_pools(model_config(), kv, num_fp_blocks=5, num_quant_blocks=3, scratch_block=True, device="meta")
    assert pools.k.shape[1] == 6 and pools.scratch_block == 5
    assert (pools.num_fp_blocks, pools.num_quant_blocks) == (5, 3)
    plain = allocate_pools(model_config(), kv, num_fp_blocks=5, num_quant_blocks=3, device="meta")
    assert plain.k.shape[1] == plain.num_fp_blocks == 5 and plain.scratch_block is None


def test_dequantize_blocks_keeps_the_tables_order_across_both_pools() -> None:
    pools = filled_pools("int4_asym")
    quantize_block(pools, None, fp_block=0, q_block=2)
    quantize_block(pools, None, fp_block=1, q_block=0)
    table = [3, encode_quant_block(2), 2, encode_quant_block(0)]
    k, v = dequantize_blocks(pools, 1, table)
    for i, entry in enumerate(table):
        want_k, want_v = dequantize_block(pools, 1, entry)
        assert torch.equal(k[:, 4 * i:4 * (i + 1)], want_k) and torch.equal(v[:, 4 * i:4 * (i + 1)], want_v), i


def test_fp8_dequantize_returns_the_requested_dtype() -> None:
    q, scale = quantize_fp8(torch.randn(4, 64))
    x = dequantize_fp8(q, scale, dtype=torch.float16)
    assert x.dtype == torch.float16 and torch.equal(x, (q.float() * scale.float()).half())
