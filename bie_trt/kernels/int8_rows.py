"""Row-wise symmetric int8 matrices: the lm_head of 8 GB plans (half the bytes of fp16).

W[v, :] ≈ q[v, :] · scale[v], q int8 in [-127, 127], scale fp16 = absmax(row) / 127.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Rows dequantised per step on devices where a full fp16 copy would break the memory plan.
ROWS_PER_CHUNK = 8192


def quantize_rows_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [V, H] -> (q int8 [V, H], scale fp16 [V]); codes use the stored fp16 scale."""
    scale = (w.float().abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float16).tiny).half()
    q = torch.round(w.float() / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


@dataclass
class Int8Rows:
    q: torch.Tensor
    scale: torch.Tensor
    _dense: torch.Tensor | None = None

    def dequantize(self, dtype: torch.dtype, rows: slice = slice(None)) -> torch.Tensor:
        return (self.q[rows].float() * self.scale[rows].float()[:, None]).to(dtype)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, H] -> x @ Wᵀ [M, V]. On the CPU the dequantised matrix is kept (exact reference);
        elsewhere it is rebuilt chunk by chunk so no fp16 copy of the whole head ever exists."""
        if x.device.type == "cpu":
            if self._dense is None or self._dense.dtype != x.dtype:
                self._dense = self.dequantize(x.dtype)
            return F.linear(x, self._dense)
        # Dequantised straight into x's dtype: q (|q| <= 127) and the fp16 scale are exact there and their
        # product is rounded once, so the bytes equal `dequantize` (fp32, then cast) at 2.3x less traffic.
        n = self.q.shape[0]
        return torch.cat([F.linear(x, self.q[i:i + ROWS_PER_CHUNK].to(x.dtype)
                                   * self.scale[i:i + ROWS_PER_CHUNK, None].to(x.dtype))
                          for i in range(0, n, ROWS_PER_CHUNK)], dim=-1)
