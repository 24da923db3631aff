"""One fused linear (qkv, o, gate_up, down) of a checkpoint into the engine's weights: the W4 layout,
or, where a GGUF stores a part in a format W4 cannot hold exactly, the file's own blocks."""
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
