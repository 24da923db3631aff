"""One fused linear (qkv, o, gate_up, down) of a checkpoint into the engine's weights: the W4 layout,
or, where a GGUF stores a part in a format W4 cannot hold exactly, the file's own blocks; and a GGUF's
quantised head, in its blocks too."""
from __future__ import annotations

import torch

from ..kernels.gguf_blocks import merge_parts, to_tensors
from .checkpoint.gguf_checkpoint import GGUFCheckpoint
from .checkpoint.loader import Checkpoint


def fused_linear(ckpt: Checkpoint | GGUFCheckpoint, names: tuple[str, ...], prefix: str) -> dict[str, torch.Tensor]:
    """The linears `names` (Hugging Face names, output rows stacked in this order) under `prefix`."""
    if isinstance(ckpt, GGUFCheckpoint) and ckpt.in_blocks(names):
        return to_tensors(prefix, merge_parts([ckpt.blocks(n) for n in names]))
    packed = [ckpt.w4(n) for n in names]
    return {f"{prefix}.{key}": torch.cat([t[key] for t in packed]).contiguous() for key in ("qweight", "scales", "zeros")}


def gguf_head(ckpt: Checkpoint | GGUFCheckpoint) -> dict[str, torch.Tensor]:
    """The output head in the GGUF's own blocks (the embedding's, when tied), or nothing: not a GGUF, or a
    float head (which takes the plan's dtype like any checkpoint's)."""
    if not isinstance(ckpt, GGUFCheckpoint) or ckpt.head_bytes is None:
        return {}
    return to_tensors("lm_head", [ckpt.blocks(ckpt.head_name)])
