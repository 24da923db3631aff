"""Gemma 4's per-layer embeddings: each token looks up a small vector for every layer (a [vocab, layers x P]
table, only gathered, never multiplied: it may live in host memory and send one row a token), which is mixed
with a projection of the token's embedding; after its MLP each layer gates its own vector into the residual
stream. Dense (unquantised) weights: the projections are a few MiB."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..config import ModelConfig
from ..kernels import ops


@dataclass
class PerLayerEmbedding:
    table: torch.Tensor        # [V_pl, L x P], on the host when `on_host`
    projection: torch.Tensor   # [L x P, H]: the token embedding's share
    norm: torch.Tensor         # [P]
    eps: float
    on_host: bool

    @classmethod
    def load(cls, cfg: ModelConfig, weights: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype,
             on_host: bool) -> "PerLayerEmbedding":
        on_host = on_host and device.type != "cpu"
        table = weights["per_layer.embed"]
        table = (table.half().pin_memory() if torch.cuda.is_available() else table.half()) if on_host \
            else table.to(device=device, dtype=dtype)
        return cls(table, weights["per_layer.projection"].to(device=device, dtype=dtype),
                   weights["per_layer.norm"].to(device=device, dtype=dtype), cfg.rms_norm_eps, on_host)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The tokens' table rows [T, L x P], on the device (one small row a token crosses PCIe when the table
        lives on the host)."""
        device = self.projection.device
        if self.on_host:
            return self.table[ids.cpu()].to(device, self.projection.dtype, non_blocking=True)
        return F.embedding(ids.to(device), self.table)

    def mix(self, rows: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        """Each row's per-layer vectors [T, L, P]: (norm(projection of its scaled embedding / sqrt(H)) + its
        looked-up row x sqrt(P)) / sqrt(2), as transformers mixes them."""
        size = self.norm.shape[0]
        rows = rows.unflatten(-1, (-1, size)) * size ** 0.5
        mixed = F.linear(embedded, self.projection) * embedded.shape[-1] ** -0.5
        mixed = ops.rms_norm(mixed.unflatten(-1, (-1, size)), self.norm, self.eps)[0]
        return (mixed + rows) * 2 ** -0.5


@dataclass
class PerLayerGate:
    """One layer's use of its vector: gate [P, H], projection [H, P], the norm after it [H]."""

    gate: torch.Tensor
    projection: torch.Tensor
    norm: torch.Tensor

    @classmethod
    def load(cls, weights: dict[str, torch.Tensor], prefix: str, device: torch.device,
             dtype: torch.dtype) -> "PerLayerGate":
        return cls(*(weights[prefix + name].to(device=device, dtype=dtype)
                     for name in ("per_layer_gate", "per_layer_projection", "post_per_layer_norm")))

    def __call__(self, h: torch.Tensor, vector: torch.Tensor, eps: float) -> torch.Tensor:
        """h + norm(projection(gelu_tanh(gate(h)) x vector)): the residual stream after the layer's vector."""
        x = F.gelu(F.linear(h, self.gate), approximate="tanh") * vector
        return h + ops.rms_norm(F.linear(x, self.projection), self.norm, eps)[0]
