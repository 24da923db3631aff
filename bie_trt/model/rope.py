"""Rotary position embedding, including Llama-3.1's frequency scaling."""
from __future__ import annotations

import math

import torch

from ..config import ModelConfig


def inverse_frequencies(cfg: ModelConfig) -> torch.Tensor:
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    s = cfg.rope_scaling
    if s is None:
        return inv.float()
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * inv / s.factor + smooth * inv
    out = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
    mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return torch.where(mid, blended, out).float()


def cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, 1, D] cos and sin of each position's angles, computed in fp32 and rounded to dtype."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


class Rope:
    def __init__(self, cfg: ModelConfig, device: torch.device):
        self.inv_freq = inverse_frequencies(cfg).to(device)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, H, D]; the rotate-half convention of HF Llama checkpoints."""
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin
