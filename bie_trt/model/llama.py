"""Llama-family forward over the paged KV cache, written against `kernels.ops`."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..config import KVCacheConfig, ModelConfig
from ..kernels import ops
from ..kernels.int8_rows import Int8Rows
from ..kernels.w4_layout import W4Weight
from ..kv.pool import KVPools
from .rope import Rope

LINEARS = ("qkv", "o", "gate_up", "down")


def rotates_keys(kv: KVCacheConfig) -> bool:
    """Keys are stored Hadamard-rotated whenever they may be quantised; FP16-only caches stay exact."""
    return kv.dtype != "fp16" and kv.rotation == "hadamard"


@dataclass
class SeqInput:
    """One sequence's slice of a step: tokens at positions start_pos.., their blocks already allocated."""

    token_ids: torch.Tensor          # [T] int64
    start_pos: int
    block_table: list[int]
    all_logits: bool = False         # prefill-for-eval / speculative verify want every position

    @property
    def positions(self) -> torch.Tensor:
        return torch.arange(self.start_pos, self.start_pos + len(self.token_ids))


@dataclass
class Layer:
    attn_norm: torch.Tensor
    mlp_norm: torch.Tensor
    linears: dict[str, W4Weight] = field(default_factory=dict)


class LlamaModel:
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype,
                 embedding_on_host: bool = False):
        self.cfg, self.device, self.dtype = cfg, device, dtype

        def t(name: str) -> torch.Tensor:
            return weights[name].to(device=device, dtype=dtype)

        # On the host, only the gathered rows (2·hidden bytes a token) cross the bus each step.
        self.embed_on_host = embedding_on_host and device.type != "cpu"
        embed = weights["embed_tokens"]
        self.embed = (embed.half().pin_memory() if torch.cuda.is_available() else embed.half()) \
            if self.embed_on_host else t("embed_tokens")
        if "lm_head.q" in weights:
            self.lm_head: Int8Rows | torch.Tensor = Int8Rows(weights["lm_head.q"].to(device),
                                                             weights["lm_head.scale"].to(device))
        elif "lm_head" in weights:
            self.lm_head = t("lm_head")
        else:  # tied, fp16: share the table, or keep a device copy when the table lives on the host
            self.lm_head = embed.to(device=device, dtype=dtype) if self.embed_on_host else self.embed
        self.norm = t("norm")
        self.layers = []
        for i in range(cfg.num_layers):
            p = f"layers.{i}."
            lin = {}
            for name in LINEARS:
                q = p + name + "."
                lin[name] = W4Weight(
                    qweight=weights[q + "qweight"].to(device), scales=weights[q + "scales"].to(device),
                    zeros=weights[q + "zeros"].to(device),
                    bias=weights[q + "bias"].to(device=device, dtype=dtype) if q + "bias" in weights else None)
            self.layers.append(Layer(t(p + "attn_norm"), t(p + "mlp_norm"), lin))
        self.rope = Rope(cfg, device)
        self.scale = cfg.head_dim ** -0.5

    @torch.inference_mode()
    def forward(self, seqs: list[SeqInput], pools: KVPools) -> list[torch.Tensor]:
        """Returns each sequence's logits: [V] for its last token, or [T, V] when all_logits."""
        cfg = self.cfg
        ids = torch.cat([s.token_ids for s in seqs]).to(self.device)
        positions = torch.cat([s.positions for s in seqs]).to(self.device)
        lengths = [len(s.token_ids) for s in seqs]
        cos, sin = self.rope.cos_sin(positions, self.dtype)
        h = self._embed(ids)
        residual = None
        for li, layer in enumerate(self.layers):
            x, residual = ops.rms_norm(h, layer.attn_norm, cfg.rms_norm_eps, residual)
            h = self._attention(li, layer, x, cos, sin, positions, seqs, lengths, pools)
            x, residual = ops.rms_norm(h, layer.mlp_norm, cfg.rms_norm_eps, residual)
            h = ops.w4_linear(ops.silu_mul(ops.w4_linear(x, layer.linears["gate_up"])), layer.linears["down"])
        h, _ = ops.rms_norm(h, self.norm, cfg.rms_norm_eps, residual)
        out, start = [], 0
        for s, n in zip(seqs, lengths):
            rows = h[start:start + n] if s.all_logits else h[start + n - 1]
            out.append(self._logits(rows).float())
            start += n
        return out

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.embed_on_host:
            return self.embed[ids.cpu()].to(self.device, self.dtype, non_blocking=True)
        return F.embedding(ids, self.embed)

    def _logits(self, rows: torch.Tensor) -> torch.Tensor:
        if isinstance(self.lm_head, Int8Rows):
            return self.lm_head.linear(rows)
        return F.linear(rows, self.lm_head)

    def _attention(self, li: int, layer: Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   positions: torch.Tensor, seqs: list[SeqInput], lengths: list[int], pools: KVPools) -> torch.Tensor:
        cfg = self.cfg
        qkv = ops.w4_linear(x, layer.linears["qkv"])
        q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = Rope.apply(q.view(-1, cfg.num_heads, cfg.head_dim), cos, sin)
        k = Rope.apply(k.view(-1, cfg.num_kv_heads, cfg.head_dim), cos, sin)
        v = v.view(-1, cfg.num_kv_heads, cfg.head_dim)
        if rotates_keys(pools.cfg):
            # Hadamard-rotated keys quantise without outlier channels; rotating q too keeps q·k.
            from ..kv.rotation import rotate
            q, k = rotate(q), rotate(k)
        outs, start = [], 0
        for s, n in zip(seqs, lengths):
            pos = positions[start:start + n]
            ops.write_kv(pools, li, k[start:start + n], v[start:start + n], s.block_table, pos)
            outs.append(ops.paged_attention(q[start:start + n], pools, li, s.block_table, pos, self.scale))
            start += n
        return ops.w4_linear(torch.cat(outs).reshape(-1, cfg.q_size), layer.linears["o"])
