"""The runtime's 4-bit weight layout, made from AWQ at build time.

Row n of the matrix (one output feature) is contiguous along K, so a GEMV program streams it:
  qweight int32 [N, K/8]: nibble i (bits 4i..4i+3) of word j holds q[n, 8j + i]
  scales  fp16  [N, K/G]
  zeros   uint8 [N, K/G]      W[n, k] = (q[n, k] - zeros[n, k//G]) * scales[n, k//G]
          (fp16 where a zero point has a fraction: a GGUF's Q4_1 / Q4_K block minimum)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .awq import awq_unpack

_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def pack_w4(q: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] (0..15) -> int32 [N, K/8], sequential nibbles."""
    n, k = q.shape
    return (q.to(torch.int32).reshape(n, k // 8, 8) << _SHIFTS.to(q.device)).sum(-1, dtype=torch.int64).to(torch.int32)


def unpack_w4(packed: torch.Tensor) -> torch.Tensor:
    """int32 [N, K/8] -> uint8 [N, K]."""
    return ((packed.unsqueeze(-1) >> _SHIFTS.to(packed.device)) & 0xF).reshape(packed.shape[0], -1).to(torch.uint8)


class KeptDense:
    """The CPU reference path's dequantised matrix, made once and kept (it trades memory for speed) unless
    `keep_dense` is off; a weight class gives `dequantize`, `keep_dense` and `_dense`."""

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        if not self.keep_dense:
            return self.dequantize(dtype)
        if self._dense is None or self._dense.dtype != dtype:
            self._dense = self.dequantize(dtype)
        return self._dense


@dataclass
class W4Weight(KeptDense):
    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    bias: torch.Tensor | None = None
    gemv_config: dict | None = None     # tuned at build time for 1-row (decode) inputs
    keep_dense: bool = True             # False: a one-off pass over a big model must not keep 4x its bytes
    _dense: torch.Tensor | None = None

    @property
    def group_size(self) -> int:
        return self.qweight.shape[1] * 8 // self.scales.shape[1]

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """-> W [N, K] (nn.Linear orientation)."""
        g = self.group_size
        q = unpack_w4(self.qweight).to(torch.float32)
        z = self.zeros.to(torch.float32).repeat_interleave(g, dim=1)
        s = self.scales.to(torch.float32).repeat_interleave(g, dim=1)
        return ((q - z) * s).to(dtype)



def awq_to_w4(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor) -> dict[str, torch.Tensor]:
    """AWQ gemm tensors ([K, N/8] etc.) -> this layout's tensors."""
    q = awq_unpack(qweight).t().contiguous()          # [N, K]
    z = awq_unpack(qzeros).t().contiguous()           # [N, K/G]
    return {"qweight": pack_w4(q), "scales": scales.t().contiguous().to(torch.float16), "zeros": z}
