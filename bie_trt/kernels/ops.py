"""The one dispatcher: every device-specific op the model calls goes through here.

CUDA tensors take the Triton kernels once they land (issue 5); CPU tensors take the
plain-torch reference twins, which are also the kernels' test oracles.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..kv.pool import KVPools
from .attention_ref import paged_attention_ref
from .reference import rms_norm_ref as rms_norm  # noqa: F401
from .reference import silu_mul_ref as silu_mul  # noqa: F401
from .reference import w4_linear_ref as w4_linear  # noqa: F401
from .reference import write_kv_ref as write_kv  # noqa: F401

# The CPU path folds 64 blocks (1,024 tokens) per online-softmax step: same algorithm as the
# one-block oracle, far fewer Python iterations.
CPU_BLOCKS_PER_TILE = 64


def paged_attention(q: torch.Tensor, pools: KVPools, layer: int, block_table: Sequence[int],
                    positions: torch.Tensor, scale: float) -> torch.Tensor:
    return paged_attention_ref(q, pools, layer, block_table, positions, scale, blocks_per_tile=CPU_BLOCKS_PER_TILE)
