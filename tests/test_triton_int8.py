"""The Triton int8-row linear (the lm_head of 8 GB plans) against independent math: the codes
times the row scales, in float64, then the product with x."""
from __future__ import annotations

import pytest
import torch

from bie_trt.kernels import ops, triton_ops
from bie_trt.kernels.int8_rows import Int8Rows, quantize_rows_int8

pytestmark = pytest.mark.skipif(not triton_ops.available(), reason="triton not importable")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def head(v: int, k: int, seed: int = 0) -> Int8Rows:
    g = torch.Generator().manual_seed(seed)
    q, scale = quantize_rows_int8(torch.randn(v, k, generator=g) * torch.rand(v, 1, generator=g))
    return Int8Rows(q.to(DEVICE), scale.to(DEVICE))


def expected(x: torch.Tensor, h: Int8Rows) -> torch.Tensor:
    w = h.q.cpu().double() * h.scale.cpu().double()[:, None]
    return x.cpu().double() @ w.T


@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_int8_rows_equal_independent_math(m, dtype):
    from bie_trt.kernels.triton_int8 import int8_rows_linear_triton

    # V not a multiple of the 64-row tile, K not of the 128-wide step: both edges masked
    h = head(301, 200)
    x = torch.randn(m, 200, generator=torch.Generator().manual_seed(m)).to(DEVICE, dtype)
    out = int8_rows_linear_triton(x, h)
    assert out.shape == (m, 301) and out.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.cpu().double(), expected(x, h), atol=tol, rtol=tol)


def normed(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float64, rounded to x's dtype as the model's norm stores its output."""
    x64 = x.cpu().double()
    rstd = (x64.pow(2).mean(-1, keepdim=True) + eps).rsqrt()
    return (x64 * rstd * weight.cpu().double()).to(x.dtype)


@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_norm_in_front_equals_independent_math(m, dtype):
    from bie_trt.kernels.triton_int8 import int8_rows_linear_triton

    g = torch.Generator().manual_seed(10 + m)
    h = head(301, 200)
    # Rows of very different sizes (a norm reading row 0 for every row is off by their ratio) and
    # small enough that eps = 0.01 moves 1/rms by several percent.
    x = (torch.randn(m, 200, generator=g) * 0.1 * torch.arange(1, m + 1)[:, None]).to(DEVICE, dtype)
    w = (torch.rand(200, generator=g) + 0.5).to(DEVICE, dtype)
    out = int8_rows_linear_triton(x, h, norm_weight=w, eps=1e-2)
    assert out.shape == (m, 301) and out.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.cpu().double(), expected(normed(x, w, 1e-2), h), atol=tol, rtol=tol)


def test_dispatch_takes_one_launch_per_16_rows_up_to_64_and_torch_beyond(monkeypatch):
    from bie_trt.kernels import triton_int8

    monkeypatch.setenv("BIE_TRT_KERNELS", "triton")
    launches = []
    kernel = triton_int8.int8_rows_linear_triton
    monkeypatch.setattr(triton_int8, "int8_rows_linear_triton", lambda x, *a, **kw: launches.append(len(x))
                        or kernel(x, *a, **kw))
    h = head(100, 64)
    w = (torch.rand(64, generator=torch.Generator().manual_seed(1)) + 0.5).to(DEVICE)
    for m, slices in ((1, [1]), (16, [16]), (17, [16, 1]), (40, [16, 16, 8]), (65, [])):
        launches.clear()
        x = torch.randn(m, 64, generator=torch.Generator().manual_seed(m)).to(DEVICE)
        torch.testing.assert_close(ops.norm_int8_rows_linear(x, w, 1e-5, h).cpu().double(),
                                   expected(normed(x, w, 1e-5), h), atol=1e-4, rtol=1e-4)
        assert launches == slices, m
    with pytest.raises(ValueError, match="at most 16 rows"):
        from bie_trt.kernels.triton_int8 import int8_rows_linear_triton

        int8_rows_linear_triton(torch.randn(17, 64).to(DEVICE), h)
    with pytest.raises(ValueError, match="norm_weight has shape"):
        from bie_trt.kernels.triton_int8 import int8_rows_linear_triton

        int8_rows_linear_triton(torch.randn(1, 64).to(DEVICE), h, norm_weight=w[:32])


def test_model_final_step_is_the_fused_norm_and_head(monkeypatch):
    """The model's last step (final norm + int8 head) through the kernel equals independent math."""
    from bie_trt.model.llama import LlamaModel
    from bie_trt.model.synthetic import random_weights, tiny_llama

    cfg = tiny_llama()
    weights = random_weights(cfg, group_size=32)
    weights["norm"] = (torch.rand(cfg.hidden_size, generator=torch.Generator().manual_seed(2)) + 0.5).half()
    model = LlamaModel(cfg, weights, torch.device(DEVICE), torch.float32)
    rows = torch.randn(2, cfg.hidden_size, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    monkeypatch.setenv("BIE_TRT_KERNELS", "triton")
    want = expected(normed(rows, model.norm, cfg.rms_norm_eps), model.lm_head)
    torch.testing.assert_close(model.head_logits(rows).cpu().double(), want, atol=1e-4, rtol=1e-4)
