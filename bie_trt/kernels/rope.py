"""Rotary position embedding, with Llama-3.1's and YaRN's frequency scaling."""
from __future__ import annotations

import dataclasses
import math

import torch

from ..config import ModelConfig, RopeScaling


def inverse_frequencies(cfg: ModelConfig, theta: float | None = None) -> torch.Tensor:
    """The full layers' frequencies (the config's base and scaling), or with `theta` plain RoPE of that base
    (Gemma 3's sliding layers). With partial rotary (Qwen3.5) the rotated channels' frequencies, then zeros:
    the engine stores each q/k head in `partial_rotary_order`, where those zero-frequency pairs pass through."""
    if cfg.rotary_dim < cfg.head_dim:
        inv = inverse_frequencies(dataclasses.replace(cfg, head_dim=cfg.rotary_dim, partial_rotary_factor=1.0), theta)
        return torch.cat([inv, inv.new_zeros((cfg.head_dim - cfg.rotary_dim) // 2)])
    d = cfg.head_dim
    s = None if theta is not None else cfg.rope_scaling
    if s is not None and s.rope_type == "yarn":
        return yarn_inverse_frequencies(d, cfg.rope_theta, s)
    inv = 1.0 / ((theta or cfg.rope_theta) ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    if s is None:
        return inv.float()
    if s.rope_type == "linear":   # positions divided by factor: every frequency too
        return (inv / s.factor).float()
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * inv / s.factor + smooth * inv
    out = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
    mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return torch.where(mid, blended, out).float()


def proportional_frequencies(head_dim: int, theta: float, proportion: float) -> torch.Tensor:
    """Gemma 4's full layers: the first proportion x D/2 pairs turn at theta^(-2i/D) (the exponent over the whole
    head, not over the turned part), the other pairs at frequency 0, passing through. Pairs are channels i and
    i + D/2 as for every head here, so the checkpoint's channel order stays. In fp32, as transformers computes it."""
    pairs = int(proportion * head_dim // 2)
    inv = 1.0 / theta ** (torch.arange(0, 2 * pairs, 2, dtype=torch.float32) / head_dim)
    return torch.cat([inv, inv.new_zeros(head_dim // 2 - pairs)])


def partial_rotary_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """For each channel of a q/k head as the engine stores it, the checkpoint's channel. A checkpoint rotates
    channels i and i + r/2 of its first r; the engine's RoPE rotates i and i + D/2 of all D. Placing the
    checkpoint's pairs at i and i + D/2 (i < r/2) and its pass-through channels in the rest, with frequency 0
    there, is the same rotation; q.k is unchanged by permuting q and k alike, and v is never permuted."""
    half, r = head_dim // 2, rotary_dim // 2
    rest = list(range(rotary_dim, head_dim))
    order = list(range(r)) + rest[:half - r] + list(range(r, rotary_dim)) + rest[half - r:]
    return torch.tensor(order)


def yarn_inverse_frequencies(dim: int, base: float, s: RopeScaling) -> torch.Tensor:
    """YaRN: dimensions turning more than beta_fast times over the original context keep their
    frequency, those turning fewer than beta_slow times are divided by `factor`, and a linear ramp
    blends the ones between. In fp32, in transformers' order of operations, so the tables agree
    with it bit for bit."""
    beta_fast = s.beta_fast or 32.0   # transformers treats 0 as unset too
    beta_slow = s.beta_slow or 1.0

    def dimension_of(rotations: float) -> float:
        """The (fractional) dimension whose wavelength fits `rotations` times into the original context."""
        return dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dimension_of(beta_fast), dimension_of(beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001   # a ramp of width zero would divide by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp   # 1: the frequency as trained (extrapolated), 0: divided by factor (interpolated)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    return (1.0 / (s.factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


def attention_factor(s: RopeScaling | None) -> float:
    """The factor YaRN multiplies cos and sin by (1 for other RoPE): the config's attention_factor, else
    0.1·ln(factor) + 1, or the ratio of that with mscale over that with mscale_all_dim when both are set."""
    if s is None or s.rope_type != "yarn":
        return 1.0
    if s.attention_factor is not None:
        return s.attention_factor

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if s.mscale and s.mscale_all_dim:
        return mscale(s.factor, s.mscale) / mscale(s.factor, s.mscale_all_dim)
    return mscale(s.factor)


def cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, 1, D] cos and sin of each position's angles, computed in fp32 and rounded to dtype."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


class Rope:
    def __init__(self, cfg: ModelConfig, device: torch.device):
        self.inv_freq = inverse_frequencies(cfg).to(device)
        if cfg.global_head_dim:   # Gemma 4: the full layers' wider heads turn proportionally
            self.inv_freq = proportional_frequencies(cfg.global_head_dim, cfg.rope_theta,
                                                     cfg.global_rope_proportion).to(device)
        # Gemma 3's sliding layers rotate with their own base (and no scaling)
        self.local_inv_freq = (inverse_frequencies(cfg, cfg.local_rope_theta).to(device)
                               if cfg.local_rope_theta is not None else self.inv_freq)
        self.windows = [cfg.window_of(i) for i in range(cfg.num_layers)]
        self.attention_factor = attention_factor(cfg.rope_scaling)

    def inv_freq_of(self, layer: int) -> torch.Tensor:
        return self.local_inv_freq if self.windows[layer] else self.inv_freq

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, H, D]; the rotate-half convention of HF Llama checkpoints."""
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin
