"""A fused linear of an engine's weights file as the kernels take it: W4, or GGUF blocks."""
from __future__ import annotations

import torch

from ..kernels.gguf_blocks import BlockWeight, from_tensors, is_stored
from ..kernels.w4_layout import W4Weight

Linear = W4Weight | BlockWeight


def load_linear(weights: dict[str, torch.Tensor], prefix: str, device: torch.device, dtype: torch.dtype,
                gemv_config: dict | None, keep_dense: bool) -> Linear:
    bias = weights[prefix + ".bias"].to(device=device, dtype=dtype) if prefix + ".bias" in weights else None
    if is_stored(weights, prefix):
        return BlockWeight(from_tensors(weights, prefix, device), bias=bias, keep_dense=keep_dense)
    return W4Weight(qweight=weights[prefix + ".qweight"].to(device), scales=weights[prefix + ".scales"].to(device),
                    zeros=weights[prefix + ".zeros"].to(device), bias=bias, gemv_config=gemv_config,
                    keep_dense=keep_dense)
