"""Triton small ops and KV writers under the CPU interpreter, against their reference twins.

The block quantiser must be byte-identical to `quantize_block`: packed codes, scales, zeros and
FP8 bytes, including round-half-to-even ties, FP8 subnormals and the clamp at 448. The reference
always runs on a CPU copy: CUDA torch divides by a Python scalar through its reciprocal, the CPU
divides, and the CPU result is the one the kernel reproduces.
"""
from __future__ import annotations


import pytest
import torch

pytest.importorskip("triton")

from bie_trt.config import KVCacheConfig, ModelConfig  # noqa: E402
from bie_trt.kernels.reference import rms_norm_ref, silu_mul_ref, write_kv_ref  # noqa: E402
from bie_trt.kernels.triton_ops import (  # noqa: E402
    available,
    quantize_block_triton,
    rms_norm_triton,
    silu_mul_triton,
    write_kv_triton,
)
from bie_trt.kv.pool import KVPools, allocate_pools, encode_quant_block  # noqa: E402
from bie_trt.kv.quant import quantize_block  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def model_config(layers: int = 2, kv_heads: int = 2, head_dim: int = 64) -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM", hidden_size=4 * head_dim, intermediate_size=8 * head_dim,
        num_layers=layers, num_heads=4, num_kv_heads=kv_heads, head_dim=head_dim, vocab_size=256,
        rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=4096, tie_word_embeddings=False,
    )


def clone_pools(p: KVPools, device: str = DEVICE) -> KVPools:
    return KVPools(p.cfg, **{name: t.to(device, copy=True) for name, t in p.tensors().items()})


def assert_pools_identical(a: KVPools, b: KVPools) -> None:
    for name, t in a.tensors().items():
        u = getattr(b, name)
        assert torch.equal(t.cpu().view(torch.uint8), u.cpu().view(torch.uint8)), f"{name} differs"


def test_available() -> None:
    assert available()


# --- RMSNorm, SiLU·mul ----------------------------------------------------------------------------

@pytest.mark.parametrize("shape, dtype, tol", [
    ((5, 96), torch.float32, 1e-5),     # D not a power of two: masked lanes
    ((2, 3, 64), torch.float32, 1e-5),  # leading dims
    ((3, 4096), torch.float16, 2e-3),
])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(shape: tuple[int, ...], dtype: torch.dtype, tol: float, with_residual: bool) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g).to(DEVICE, dtype)
    weight = (torch.rand(shape[-1], generator=g) + 0.5).to(DEVICE, dtype)
    residual = torch.randn(shape, generator=g).to(DEVICE, dtype) if with_residual else None
    out, summed = rms_norm_triton(x, weight, 1e-5, residual)
    ref_out, ref_summed = rms_norm_ref(x, weight, 1e-5, residual)
    assert out.shape == x.shape and out.dtype == dtype
    torch.testing.assert_close(out, ref_out, rtol=tol, atol=tol)
    if with_residual:
        assert torch.equal(summed, ref_summed)  # the same single add in the same dtype
    else:
        assert summed is x


@pytest.mark.parametrize("shape, dtype, tol", [
    ((4, 160), torch.float32, 1e-6),
    ((2, 3, 96), torch.float32, 1e-6),
    ((2, 2 * 1500), torch.float16, 2e-3),  # I = 1500: two column blocks, the second masked
])
def test_silu_mul(shape: tuple[int, ...], dtype: torch.dtype, tol: float) -> None:
    gate_up = (torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 3).to(DEVICE, dtype)
    out = silu_mul_triton(gate_up)
    assert out.shape == shape[:-1] + (shape[-1] // 2,) and out.dtype == dtype
    torch.testing.assert_close(out, silu_mul_ref(gate_up), rtol=tol, atol=tol)


# --- write_kv -------------------------------------------------------------------------------------

@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.float16])
def test_write_kv_scattered_blocks(pool_dtype: torch.dtype) -> None:
    mc, kv = model_config(), KVCacheConfig(dtype="int4_asym", group_size=32)
    pools = allocate_pools(mc, kv, num_fp_blocks=8, num_quant_blocks=2, dtype=pool_dtype, device=DEVICE)
    g = torch.Generator().manual_seed(2)
    for t in (pools.k, pools.v):
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))  # every slot not written must survive
    ref = clone_pools(pools)
    # Slots as the step metadata derives them: blocks out of order, partial blocks, two boundaries crossed.
    table = [encode_quant_block(1), 6, 2, 5]
    positions = [18, 19, 20, 31, 32, 33, 47]
    blocks = torch.tensor([table[p // 16] for p in positions], device=DEVICE)
    offsets = torch.tensor([p % 16 for p in positions], device=DEVICE)
    T, H, D = len(positions), mc.num_kv_heads, mc.head_dim
    # k, v as views into a fused qkv-like buffer: row stride larger than H * D.
    qkv = torch.randn(T, 3 * H * D, generator=g).to(DEVICE, pool_dtype)
    k = qkv[:, H * D:2 * H * D].view(T, H, D)
    v = qkv[:, 2 * H * D:].view(T, H, D)
    write_kv_triton(pools, 1, k, v, blocks, offsets)
    write_kv_ref(ref, 1, k, v, blocks, offsets)
    assert_pools_identical(pools, ref)
    assert torch.equal(pools.k[1, 6, :, 15], k[3].to(pool_dtype))  # position 31: block table[1] = 6, slot 15


# --- the fused block quantiser --------------------------------------------------------------------

def filled_pools(kv: KVCacheConfig, pool_dtype: torch.dtype, head_dim: int = 128) -> KVPools:
    mc = model_config(head_dim=head_dim)
    pools = allocate_pools(mc, kv, num_fp_blocks=4, num_quant_blocks=3, dtype=pool_dtype, device=DEVICE)
    g = torch.Generator().manual_seed(7)
    for t in (pools.k, pools.v):
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
        t[..., 3] *= 40.0        # an outlier channel
        t[..., -1] += 25.0       # and an offset one
    pools.k[:, 2, 0, 1] = 0.0                   # an all-zero token: the scale floor
    pools.v[:, 2, 1, 2] = -3.0                  # a constant token
    # Ties: a group spanning exactly 0..15 has scale 1 and zero 0, so x.5 codes must round to even.
    ties = torch.tensor([0.0, 15.0, 0.5, 1.5, 2.5, 3.5, 12.5, 13.5, 14.5, 7.25, 7.75, 6.5])
    pools.k[:, 2, 1, 3, :ties.numel()] = ties.to(pool_dtype)
    pools.k[:, 2, 1, 3, ties.numel():kv.group_size] = 8.0
    # Old contents of the target block and of the other quantised blocks must survive or be replaced exactly.
    for name, t in pools.tensors().items():
        if name not in ("k", "v"):
            t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, generator=g))
    return pools


def fp8_pools(pool_dtype: torch.dtype) -> KVPools:
    pools = filled_pools(KVCacheConfig(dtype="fp8"), pool_dtype)
    # absmax 448 gives scale 1 exactly, so the values below reach the cast unchanged:
    # ties between e4m3 neighbours, subnormals (multiples of 2^-9) and their ties, the normal boundary.
    special = [448.0, 1.0625, 1.1875, -1.0625, 2 ** -10, 3 * 2 ** -10, 5 * 2 ** -10, 2 ** -6, 15 * 2 ** -10,
               -(2 ** -9), 2 ** -12, 0.0, -0.0, 240.0, 232.0, 104.0, -9.25]
    pools.k[:, 2, 0, 5, :len(special)] = torch.tensor(special).to(pool_dtype)
    # absmax 449: the fp16 scale rounds below 449/448, so 449/scale exceeds 448 and must clamp.
    pools.v[:, 2, 1, 6, 0] = 449.0
    return pools


@pytest.mark.parametrize("group", [32, 64, 128])
def test_quantize_block_int4_fp16_pool_is_byte_identical(group: int) -> None:
    pools = filled_pools(KVCacheConfig(dtype="int4_asym", group_size=group), torch.float16)
    ref = clone_pools(pools, "cpu")
    quantize_block_triton(pools, 2, 1)
    quantize_block(ref, None, 2, 1)
    assert_pools_identical(pools, ref)


def test_quantize_block_int4_fp32_pool_is_byte_identical() -> None:
    # fp32 inputs exercise the zero's round-down (nextafter) when fp16 rounding lands above the minimum.
    pools = filled_pools(KVCacheConfig(dtype="int4_asym", group_size=64), torch.float32, head_dim=64)
    ref = clone_pools(pools, "cpu")
    quantize_block_triton(pools, 2, 0)
    quantize_block(ref, None, 2, 0)
    assert_pools_identical(pools, ref)


@pytest.mark.parametrize("pool_dtype", [torch.float16, torch.float32])
def test_quantize_block_fp8_is_byte_identical(pool_dtype: torch.dtype) -> None:
    pools = fp8_pools(pool_dtype)
    ref = clone_pools(pools, "cpu")
    quantize_block_triton(pools, 2, 2)
    quantize_block(ref, None, 2, 2)
    assert_pools_identical(pools, ref)


def test_quantize_block_refuses_what_it_does_not_implement() -> None:
    pools = allocate_pools(model_config(), KVCacheConfig(dtype="fp16"), 2, 2, device=DEVICE)
    with pytest.raises(ValueError, match="no quantised pool"):
        quantize_block_triton(pools, 0, 0)
    pools = allocate_pools(model_config(), KVCacheConfig(dtype="int4_asym", scale_scope="block"), 2, 2, device=DEVICE)
    with pytest.raises(ValueError, match="ablation"):
        quantize_block_triton(pools, 0, 0)


# --- the qkv epilogue -----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype, centre, rotate_k, rotate_v, qk_norm, scale", [
    (torch.float32, False, True, False, False, False), (torch.float32, True, True, True, False, False),
    (torch.float32, False, False, False, False, False), (torch.float16, True, True, False, False, False),
    (torch.float32, False, False, False, True, False), (torch.float32, True, True, True, True, False),
    (torch.float16, False, True, False, True, False), (torch.float32, True, True, False, False, True),
    (torch.float16, True, True, False, False, True), (torch.float32, False, False, False, True, True)])
def test_qkv_epilogue(dtype: torch.dtype, centre: bool, rotate_k: bool, rotate_v: bool, qk_norm: bool,
                      scale: bool) -> None:
    """Qwen3's per-head q/k norms, RoPE, centering, the per-channel key scale, Hadamard rotation and the K/V
    write in one launch, against the torch twin and against math written here (each head's RMS over its own
    channels, rotation as an explicit matrix, RoPE as the complex rotation of pairs, the scale dividing keys
    and multiplying each query head by its KV head's, h // group)."""
    from bie_trt.kernels.reference import QKNorm, qkv_epilogue_ref
    from bie_trt.kernels.triton_ops import qkv_epilogue_triton
    from bie_trt.kernels.rope import inverse_frequencies
    from bie_trt.kv.rotation import hadamard_matrix

    mc, kv = model_config(kv_heads=2, head_dim=64), KVCacheConfig(dtype="int4_asym", group_size=32)
    Hq, Hkv, D = mc.num_heads, mc.num_kv_heads, mc.head_dim
    pools = allocate_pools(mc, kv, num_fp_blocks=6, num_quant_blocks=1, dtype=dtype, device=DEVICE)
    ref_pools = clone_pools(pools)
    g = torch.Generator().manual_seed(11)
    positions = torch.tensor([5, 17, 300, 4095, 16], device=DEVICE)   # a verify-like run of rows and others
    T = positions.numel()
    blocks = torch.tensor([0, 1, 4, 5, 1], device=DEVICE)
    offsets = positions % 16
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D, generator=g).to(DEVICE, dtype)
    mean = torch.randn(Hkv, D, generator=g).to(DEVICE, dtype) if centre else None
    inv_freq = inverse_frequencies(mc).to(DEVICE)
    # A large eps (0.05 against mean squares near 1) so that the eps in the wrong place shows.
    norms = QKNorm((1 + torch.rand(D, generator=g)).to(DEVICE, dtype), (1 + torch.rand(D, generator=g)).to(DEVICE, dtype),
                   0.05) if qk_norm else None
    # a different scale per KV head and channel, 1/8..8 as calibrated scales spread
    key_scale = torch.exp2(torch.rand(Hkv, D, generator=g) * 6 - 3).to(DEVICE, dtype) if scale else None
    args = (Hq, Hkv, positions, inv_freq, mean, rotate_k, rotate_v)
    q, off = qkv_epilogue_triton(qkv, *args, pools, 1, blocks, offsets, norms, key_scale)
    q_ref, off_ref = qkv_epilogue_ref(qkv, *args, ref_pools, 1, blocks, offsets, norms, key_scale)
    tol = 2e-3 if dtype == torch.float16 else 1e-5
    torch.testing.assert_close(q, q_ref, rtol=tol, atol=tol)
    assert (off is None and off_ref is None) if not centre else off.dtype == torch.float32
    if centre:
        torch.testing.assert_close(off, off_ref, rtol=tol, atol=tol * 10)
    torch.testing.assert_close(pools.k, ref_pools.k, rtol=tol, atol=tol)
    torch.testing.assert_close(pools.v, ref_pools.v, rtol=tol, atol=tol)

    # Independent float64 math for the keys: pair (d, d + D/2) turned by angle pos·inv_freq[d].
    ang = positions.double().cpu()[:, None] * inv_freq.double().cpu()[None, :]
    c, s = ang.cos()[:, None, :], ang.sin()[:, None, :]

    def normed(x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        return x / (x.pow(2).mean(-1, keepdim=True) + norms.eps).sqrt() * weight.double().cpu() if qk_norm else x

    def turned(x: torch.Tensor) -> torch.Tensor:
        a, b = x[..., :D // 2], x[..., D // 2:]
        return torch.cat([a * c - b * s, b * c + a * s], dim=-1)

    k_raw = normed(qkv.double().cpu()[:, Hq * D:(Hq + Hkv) * D].view(T, Hkv, D), norms and norms.k)
    # centering subtracts the mean before RoPE: the key at p is stored as R(p)(k - m)
    k = turned(k_raw - mean.double().cpu()) if centre else turned(k_raw)
    k_plain = turned(k_raw)
    if scale:
        k = k / key_scale.double().cpu()
    if rotate_k:
        k = k @ hadamard_matrix(D, torch.float64)
    for t in range(T):
        got = pools.k[1, blocks[t], :, offsets[t]].double().cpu()
        torch.testing.assert_close(got, k[t], rtol=5e-3 if dtype == torch.float16 else 1e-4, atol=5e-3)
    # Every query head's scores against the stored keys, plus what centering adds back, are its scores against
    # the plain keys: q·k unchanged.
    q_plain = turned(normed(qkv.double().cpu()[:, :Hq * D].view(T, Hq, D), norms and norms.q))
    kv_of = torch.arange(Hq) // (Hq // Hkv)
    scores = torch.einsum("thd,shd->hts", q.double().cpu(), k[:, kv_of])
    if centre:
        from bie_trt.kernels.key_offset import KeyOffset, scores as offset_scores
        scores = scores + offset_scores(KeyOffset(off.cpu(), inv_freq.cpu()), positions.cpu(), torch.float32).double()
    torch.testing.assert_close(scores, torch.einsum("thd,shd->hts", q_plain, k_plain[:, kv_of]),
                               rtol=2e-2 if dtype == torch.float16 else 1e-3, atol=0.2 if dtype == torch.float16 else 1e-2)
