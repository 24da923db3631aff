"""Triton W4A16 linear (GEMV for M = 1, tensor-core kernel for M >= 2) under the CPU interpreter.

Each case is checked against `w4_linear_ref` and against a float64 dequantisation written here
from the layout's description alone (word j, nibble i -> k = 8j + i), so a shared mistake in
`W4Weight.dequantize` and a kernel cannot hide each other.
"""
from __future__ import annotations


import pytest
import torch

pytest.importorskip("triton")

from bie_trt.kernels.reference import w4_linear_ref  # noqa: E402
from bie_trt.kernels.triton_w4 import (  # noqa: E402
    candidate_configs,
    default_config,
    random_w4,
    tune_w4,
    w4_linear_triton,
)
from bie_trt.kernels.w4_layout import W4Weight  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def dense_from_layout(w: W4Weight) -> torch.Tensor:
    """float64 W [N, K]: nibble i (bits 4i..4i+3) of word j is q[n, 8j + i]; W = (q - zero) * scale per group."""
    words = w.qweight.cpu().to(torch.int64) & 0xFFFFFFFF
    n, kw = words.shape
    q = torch.empty(n, kw * 8, dtype=torch.float64)
    for i in range(8):
        q[:, i::8] = ((words >> (4 * i)) & 0xF).double()
    group = torch.arange(kw * 8) // w.group_size
    return (q - w.zeros.cpu().double()[:, group]) * w.scales.cpu().double()[:, group]


def expected(x: torch.Tensor, w: W4Weight) -> torch.Tensor:
    y = x.cpu().double() @ dense_from_layout(w).t()
    return y if w.bias is None else y + w.bias.cpu().double()


def check(x: torch.Tensor, w: W4Weight, config: dict | None = None, tol: float = 1e-4) -> None:
    y = w4_linear_triton(x, w, config)
    assert y.shape == x.shape[:-1] + (w.out_features,) and y.dtype == x.dtype
    torch.testing.assert_close(y.cpu().double(), expected(x, w), rtol=tol, atol=tol)
    torch.testing.assert_close(y, w4_linear_ref(x, w), rtol=tol, atol=tol)


def weight(n: int, k: int, group: int, bias: bool, seed: int = 0) -> W4Weight:
    return random_w4(n, k, group, bias=bias, device=DEVICE, seed=seed)


# --- M = 1: the GEMV ----------------------------------------------------------------------------

@pytest.mark.parametrize("n, k, group, bias, config", [
    (40, 256, 32, False, None),
    (72, 512, 64, True, {"SPLIT_K": 2}),
    (56, 1024, 128, True, {"SPLIT_K": 1}),
    (24, 1024, 128, False, {"BLOCK_N": 64, "BLOCK_K": 64, "SPLIT_K": 4, "num_warps": 4}),
    (136, 512, 128, True, {"BLOCK_N": 64, "BLOCK_K": 32, "SPLIT_K": 3, "num_warps": 2}),
])
def test_gemv(n: int, k: int, group: int, bias: bool, config: dict | None) -> None:
    w = weight(n, k, group, bias)
    x = torch.randn(1, k, device=DEVICE)
    check(x, w, config)


def test_gemv_split_slices_cover_k_exactly() -> None:
    # 5 steps in 3 slices: slices of 2, 2 and 1 step; and more slices than steps collapses.
    w = weight(40, 5 * 64, 64, bias=True, seed=1)
    x = torch.randn(1, 5 * 64, device=DEVICE)
    check(x, w, {"BLOCK_K": 64, "SPLIT_K": 3})
    check(x, w, {"BLOCK_K": 64, "SPLIT_K": 16})


@pytest.mark.parametrize("m", [1, 3])
def test_fractional_fp16_zeros(m: int) -> None:
    """A GGUF Q4_1 / Q4_K block's minimum as an fp16 zero point with a fraction: the GEMV and the MMA
    kernel subtract it exactly, not rounded to an integer (a rounded zero is off by up to half a step)."""
    w = random_w4(40, 256, 32, device=DEVICE, seed=5, float_zeros=True)
    assert w.zeros.dtype == torch.float16 and (w.zeros.float() % 1).abs().max() > 0.4
    check(torch.randn(m, 256, device=DEVICE), w, {"SPLIT_K": 2})


# --- M >= 2: the tensor-core kernel -------------------------------------------------------------

@pytest.mark.parametrize("m, n, k, group, bias, config", [
    (3, 72, 512, 128, True, None),
    (3, 40, 256, 32, False, {"SPLIT_K": 2}),
    (8, 56, 512, 64, True, {"SPLIT_K": 4, "BLOCK_K": 64}),
    (8, 24, 256, 128, False, {"SPLIT_K": 1}),
    (17, 40, 256, 32, True, None),
    (33, 56, 512, 128, False, None),
    (33, 72, 256, 64, True, {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "SPLIT_K": 2}),
    (17, 40, 256, 128, False, {"BLOCK_M": 32, "BLOCK_K": 32}),  # BLOCK_M >= BLOCK_K: scales per weight
])
def test_mma(m: int, n: int, k: int, group: int, bias: bool, config: dict | None) -> None:
    w = weight(n, k, group, bias, seed=m)
    x = torch.randn(m, k, device=DEVICE)
    check(x, w, config)


# --- dtypes, shapes, configs --------------------------------------------------------------------

@pytest.mark.parametrize("m", [1, 17])
def test_fp16_activations(m: int) -> None:
    w = weight(40, 512, 128, bias=True, seed=3)
    x = torch.randn(m, 512, device=DEVICE).half()
    y = w4_linear_triton(x, w)
    assert y.dtype == torch.float16
    # fp16 output: one rounding of an fp32 sum, so half an fp16 ulp of |y| plus slack.
    torch.testing.assert_close(y.double().cpu(), expected(x, w), rtol=2e-3, atol=2e-3)


def test_leading_dims_and_strided_input() -> None:
    w = weight(40, 256, 64, bias=False, seed=4)
    base = torch.randn(2, 3, 512, device=DEVICE)
    x = base[..., ::2]  # last-dim stride 2: the wrapper makes it contiguous
    y = w4_linear_triton(x, w)
    assert y.shape == (2, 3, 40)
    torch.testing.assert_close(y.reshape(6, 40).cpu().double(), expected(x.reshape(6, 256), w), rtol=1e-4, atol=1e-4)
    assert w4_linear_triton(x[:0], w).shape == (0, 3, 40)


def test_bad_configs_are_rejected() -> None:
    w = weight(40, 256, 64, bias=False)
    x = torch.randn(1, 256, device=DEVICE)
    with pytest.raises(ValueError, match="BLOCK_M"):
        w4_linear_triton(x, w, {"BLOCK_M": 16})  # M = 1 runs the GEMV, which has no BLOCK_M
    with pytest.raises(ValueError, match="divides the group size"):
        w4_linear_triton(x, w, {"BLOCK_K": 128})
    with pytest.raises(ValueError, match="expects 256"):
        w4_linear_triton(torch.randn(1, 128, device=DEVICE), w)


@pytest.mark.parametrize("m", [1, 5, 512])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_candidate_configs_are_valid(m: int, group: int) -> None:
    n, k = 4096, 14336 // group * group
    cands = candidate_configs(m, n, k, group)
    assert cands[0] == default_config(m, n, k, group)
    assert len({tuple(sorted(c.items())) for c in cands}) == len(cands) > 1
    keys = {"BLOCK_N", "BLOCK_K", "SPLIT_K", "num_warps"} if m == 1 else \
        {"BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K", "num_warps", "num_stages"}
    for c in cands:
        assert set(c) == keys
        assert group % c["BLOCK_K"] == 0 and 1 <= c["SPLIT_K"] <= k // c["BLOCK_K"]


def test_a_few_candidates_run() -> None:
    w = weight(72, 512, 64, bias=True, seed=5)
    for m in (1, 4):
        x = torch.randn(m, 512, device=DEVICE)
        for c in candidate_configs(m, 72, 512, 64)[1::17]:
            check(x, w, c)


def test_tune_without_cuda_returns_the_default() -> None:
    assert tune_w4(1, 4096, 4096, "cpu") == default_config(1, 4096, 4096)


# --- the fused prologue and epilogues -------------------------------------------------------------

def rms_normed(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xd = x.double()
    return xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


@pytest.mark.parametrize("m, split", [(1, 1), (1, 3), (3, 1), (6, 2)])
def test_norm_in_front_and_silu_mul_behind(m: int, split: int) -> None:
    """gate_up of the normalised row with SiLU(gate)·up: one launch, against float64 math."""
    n, k, group = 2 * 40, 256, 32
    w = weight(n, k, group, bias=False, seed=3)
    x = torch.randn(m, k, device=DEVICE) * 3
    nw = torch.rand(k, device=DEVICE) + 0.5
    y = w4_linear_triton(x, w, {"SPLIT_K": split}, norm_weight=nw, eps=1e-5, silu_mul=True)
    gate_up = rms_normed(x.cpu(), nw.cpu(), 1e-5) @ dense_from_layout(w).t()
    gate, up = gate_up.chunk(2, dim=-1)
    assert y.shape == (m, n // 2)
    torch.testing.assert_close(y.cpu().double(), torch.nn.functional.silu(gate) * up, rtol=1e-4, atol=1e-4)
    # twice: the arrival counters are back at 0 after a split launch
    torch.testing.assert_close(w4_linear_triton(x, w, {"SPLIT_K": split}, norm_weight=nw, eps=1e-5, silu_mul=True), y)


@pytest.mark.parametrize("m, split, bias", [(1, 1, True), (1, 4, False), (5, 1, False), (2, 3, True)])
def test_residual_behind(m: int, split: int, bias: bool) -> None:
    n, k, group = 48, 512, 64
    w = weight(n, k, group, bias=bias, seed=4)
    x = torch.randn(m, k, device=DEVICE)
    residual = torch.randn(m, n, device=DEVICE)
    y = w4_linear_triton(x, w, {"SPLIT_K": split}, residual=residual)
    torch.testing.assert_close(y.cpu().double(), expected(x, w) + residual.cpu().double(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_norm_in_front_fp16(seed: int) -> None:
    from bie_trt.kernels.reference import rms_norm_ref

    w = weight(64, 256, 64, bias=True, seed=5)
    g = torch.Generator().manual_seed(seed)   # its own stream: the global one depends on test order
    x = (torch.randn(1, 256, generator=g) * 4).half().to(DEVICE)
    nw = (torch.rand(256, generator=g) + 0.5).half().to(DEVICE)
    y = w4_linear_triton(x, w, {"SPLIT_K": 2}, norm_weight=nw, eps=1e-5)
    # The kernel keeps the normed row in fp32 where the reference rounds it to fp16 first: a few fp16
    # steps apart after 256 products.
    torch.testing.assert_close(y, w4_linear_ref(rms_norm_ref(x, nw, 1e-5)[0], w), rtol=1e-2, atol=4e-3)
