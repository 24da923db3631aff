"""Key centering that follows RoPE: the calibrated mean key is subtracted before RoPE turns the key, and its turned
image is added back where attention scores the key.

A model's keys carry an offset shared by every token (Qwen2's k_proj bias; Gemma 3's k-normed keys). The offset is
fixed before RoPE, so after RoPE it turns with each key's position: one post-RoPE mean calibrated over the first
few hundred positions no longer fits keys tens of thousands of positions on (on Qwen2.5-Coder-0.5B layer 0 the INT4
attention error grew from 0.12 to 0.97 at 32k). Subtracting the pre-RoPE mean m instead leaves the cache holding
R(p)(k − m), whatever the position p. Unlike a fixed shift, R(p)m differs from key to key, so the score of key j
is q·R(p_j)(k_j − m) + q·R(p_j)m: the second term is added back exactly. With q's halves (q1, q2) and m's (m1, m2)
over the rotate-half pairs, q·R(p)m = Σ_i A_i cos(p θ_i) + B_i sin(p θ_i), where A = q1∘m1 + q2∘m2 and
B = q2∘m1 − q1∘m2: per query row two vectors of head_dim / 2 (the `coefficients`, computed where q is, before
the key scale and rotation touch it), and per key position the angles RoPE already uses.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .rope import Rope, cos_sin


class KeyOffset(NamedTuple):
    """What attention adds back for centred keys: each query row's coefficients [T, H_q, D] fp32 ([A | B]) and
    the layer's RoPE inverse frequencies [D / 2]."""

    coefficients: torch.Tensor
    inv_freq: torch.Tensor

    def rows(self, index) -> "KeyOffset":
        return KeyOffset(self.coefficients[index], self.inv_freq)


def coefficients(q: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """q [T, H_q, D] (after RoPE, before the key scale and rotation), mean [H_kv, D] (the pre-RoPE mean key)
    -> [T, H_q, D] fp32: [A | B] of each query row against its KV head's mean."""
    m = mean.float().repeat_interleave(q.shape[1] // mean.shape[0], dim=0)
    q1, q2 = q.float().chunk(2, dim=-1)
    m1, m2 = m.chunk(2, dim=-1)
    return torch.cat([q1 * m1 + q2 * m2, q2 * m1 - q1 * m2], dim=-1)


def angles(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [S, D / 2] of each key position's RoPE angles, as RoPE's own `cos_sin` rounds them, in fp32."""
    cos, sin = cos_sin(positions, inv_freq.float(), dtype)
    half = inv_freq.shape[0]
    return cos[:, 0, :half].float(), sin[:, 0, :half].float()


def scores(offset: KeyOffset, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q·R(p)m [H_q, T, S] of every query row against keys at `positions` [S] (what the scores of centred keys
    lack); `dtype` is the activation dtype RoPE rounds its cos and sin to."""
    cos, sin = angles(positions, offset.inv_freq, dtype)
    a, b = offset.coefficients.float().chunk(2, dim=-1)
    return torch.einsum("thi,si->hts", a, cos) + torch.einsum("thi,si->hts", b, sin)


def turned(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """x [..., D] (the pre-RoPE mean) turned by RoPE to each of `positions` [S] -> [..., S, D] fp32: the offset a
    centred key at p is stored without."""
    cos, sin = cos_sin(positions, inv_freq.float(), torch.float32)
    return Rope.apply(x.float()[..., None, :], cos[:, 0], sin[:, 0])


def unturned(keys: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Post-RoPE keys [..., S, D] at `positions` [S] turned back to before RoPE (fp32)."""
    cos, sin = cos_sin(-positions, inv_freq.float(), torch.float32)
    return Rope.apply(keys.float(), cos[:, 0], sin[:, 0])
