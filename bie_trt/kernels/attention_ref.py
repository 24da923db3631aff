"""Plain-torch reference of paged mixed-precision attention: the oracle of the Triton kernel and the CPU path.

`paged_attention_ref` is written as the GPU kernel works: walk one sequence's
block table block by block, dequantise each block where it is read, and fold
it into an online softmax (running max, running sum, rescaled accumulator, all
fp32). The full-precision cache is never materialised. It is rotation-agnostic:
the caller rotates q whenever the cached keys are rotated.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from ..kv.pool import KVPools
from ..kv.quant import dequantize_blocks


def paged_attention_ref(
    q: torch.Tensor,
    pools: KVPools,
    layer: int,
    block_table: Sequence[int] | torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    blocks_per_tile: int = 1,
) -> torch.Tensor:
    """Attention of q [T, H_q, D] over one sequence's cache; query t sees tokens j <= positions[t].

    The chunk's own K/V must already be in the cache. Query head h reads kv head
    h // (H_q // H_kv). Returns [T, H_q, D] in q's dtype. `blocks_per_tile` > 1 folds
    several blocks per softmax step (the CPU runtime's speed setting; same algorithm,
    bounded memory).
    """
    T, Hq, D = q.shape
    Hkv, B = pools.k.shape[2], pools.k.shape[3]
    group = Hq // Hkv
    # [H_kv, T, group, D]: the query heads sharing one kv head sit together, as in the kernel.
    qg = q.float().reshape(T, Hkv, group, D).transpose(0, 1)
    pos = positions.to(device=q.device, dtype=torch.long)
    context_len = int(pos.max()) + 1
    num_blocks = -(-context_len // B)
    if len(block_table) < num_blocks:
        raise ValueError(f"block table has {len(block_table)} blocks; positions need {num_blocks}.")

    running_max = torch.full((Hkv, T, group), -torch.inf, device=q.device)
    running_sum = torch.zeros((Hkv, T, group), device=q.device)
    acc = torch.zeros((Hkv, T, group, D), device=q.device)
    for first in range(0, num_blocks, blocks_per_tile):  # blocks beyond the last query are never read
        entries = [int(block_table[i]) for i in range(first, min(first + blocks_per_tile, num_blocks))]
        k, v = dequantize_blocks(pools, layer, entries)
        # Slots past the context in the last block hold stale data; like the kernel's
        # masked loads, never touch them (a stale NaN would otherwise poison p @ v).
        valid = min(len(entries) * B, context_len - first * B)
        k, v = k[:, :valid], v[:, :valid]
        j = torch.arange(first * B, first * B + valid, device=q.device)
        visible = j[None, :] <= pos[:, None]  # [T, valid]
        s = torch.einsum("htgd,hjd->htgj", qg, k) * scale
        s = s.masked_fill(~visible[None, :, None, :], -torch.inf)
        # Block 0 holds token 0, which every query sees, so the running max is
        # finite from the first block on and exp(-inf - finite) below is a clean 0.
        new_max = torch.maximum(running_max, s.amax(-1))
        p = torch.exp(s - new_max.unsqueeze(-1))
        correction = torch.exp(running_max - new_max)
        running_sum = running_sum * correction + p.sum(-1)
        acc = acc * correction.unsqueeze(-1) + torch.einsum("htgj,hjd->htgd", p, v)
        running_max = new_max
    out = acc / running_sum.unsqueeze(-1)
    return out.transpose(0, 1).reshape(T, Hq, D).to(q.dtype)


def paged_prefills_dense(
    q: torch.Tensor,
    pools: KVPools,
    layer: int,
    prefills: list[tuple[int, int, torch.Tensor]],
    positions: torch.Tensor,
    scale: float,
    tile_rows: int = 256,
) -> list[torch.Tensor]:
    """`paged_attention_ref` of each chunk (first row of q, rows, block table) of a step, computed as dense
    masked attention over row tiles: the CPU path, one fused softmax per tile instead of a loop per block.

    Every block the tables name is dequantised once. A tile of consecutive chunks reads the latest chunk's
    table for each block ("base") plus, as extra columns, every other entry an earlier chunk of the tile
    reads in its place (eval's runs see a few blocks in FP16 that later runs see quantised); the mask gives
    each row exactly its own chunk's entries up to its position."""
    H_kv, B = pools.k.shape[2], pools.k.shape[3]
    pos = positions.to(device=q.device, dtype=torch.long)
    chunks = [(s, n, torch.as_tensor(table).tolist()[:_blocks_read(pos[s:s + n], B, table)])
              for s, n, table in prefills]
    entries = sorted({e for _, _, table in chunks for e in table})
    index = {e: i for i, e in enumerate(entries)}
    staged = [side.unflatten(1, (len(entries), B)) for side in dequantize_blocks(pools, layer, entries)]
    out = []
    for tile in _row_tiles(chunks, tile_rows):
        base: dict[int, int] = {}
        for _, _, table in tile:
            base.update(enumerate(table))   # the latest chunk reading a block names its base entry
        extra = sorted({(b, e) for _, _, table in tile for b, e in enumerate(table) if e != base[b]})
        blocks = [b for b in range(len(base))] + [b for b, _ in extra]
        col_pos = (torch.tensor(blocks, device=q.device)[:, None] * B + torch.arange(B, device=q.device)).flatten()
        reads = torch.tensor([[table[b] == e if b < len(table) else False
                               for b, e in list(base.items()) + extra] for _, _, table in tile], device=q.device)
        rows = torch.cat([pos.new_full((n,), i) for i, (_, n, _) in enumerate(tile)])
        row_pos = torch.cat([pos[s:s + n] for s, n, _ in tile])
        visible = reads[rows].repeat_interleave(B, 1) & (col_pos[None, :] <= row_pos[:, None])
        take = torch.tensor([index[e] for e in list(base.values()) + [e for _, e in extra]], device=q.device)
        # Slots no row sees (past a sequence's end in its last block) may hold stale data, even NaN:
        # zero them, as the kernel's masked loads never read them.
        unseen = ~visible.any(0)
        k, v = (side[:, take].flatten(1, 2).masked_fill(unseen[None, :, None], 0) for side in staged)
        qt = torch.cat([q[s:s + n] for s, n, _ in tile]).float().transpose(0, 1)
        o = F.scaled_dot_product_attention(qt[None], k[None], v[None], attn_mask=visible, scale=scale,
                                           enable_gqa=H_kv != q.shape[1])
        out += o[0].transpose(0, 1).to(q.dtype).split([n for _, n, _ in tile])
    return out


def _row_tiles(chunks: list[tuple[int, int, list[int]]], tile_rows: int) -> list[list[tuple[int, int, list[int]]]]:
    """Consecutive chunks in tiles of at most tile_rows rows (a longer chunk alone)."""
    tiles: list[list] = []
    rows = tile_rows
    for chunk in chunks:
        if rows + chunk[1] > tile_rows:
            tiles.append([])
            rows = 0
        tiles[-1].append(chunk)
        rows += chunk[1]
    return tiles


def _blocks_read(pos: torch.Tensor, block_size: int, block_table: Sequence[int] | torch.Tensor) -> int:
    """How many blocks of the table queries at `pos` read: up to the last query's."""
    num_blocks = (int(pos.max()) + block_size) // block_size
    if len(block_table) < num_blocks:
        raise ValueError(f"block table has {len(block_table)} blocks; positions need {num_blocks}.")
    return num_blocks


def paged_decode_attention_ref(
    q: torch.Tensor,
    pools: KVPools,
    layer: int,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    blocks_per_tile: int = 1,
) -> torch.Tensor:
    """One query per sequence, q [S, H_q, D], each attending its context_lens[s] cached tokens through
    `paged_attention_ref`; a length-0 slot (CUDA-graph padding) gives zeros."""
    out = torch.zeros_like(q)
    for s, n in enumerate(context_lens.tolist()):
        if n > 0:
            pos = torch.tensor([n - 1], device=q.device)
            out[s] = paged_attention_ref(q[s:s + 1], pools, layer, block_tables[s], pos, scale, blocks_per_tile)[0]
    return out


def dense_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Plain causal softmax attention of q [T, H_q, D] over dense k, v [S, H_kv, D]; returns [T, H_q, D]."""
    T, Hq, _ = q.shape
    S, Hkv, _ = k.shape
    kf = k.float().repeat_interleave(Hq // Hkv, dim=1)  # [S, H_q, D]: kv head h // group for query head h
    vf = v.float().repeat_interleave(Hq // Hkv, dim=1)
    scores = torch.einsum("thd,shd->hts", q.float(), kf) * scale
    mask = torch.arange(S, device=q.device)[None, :] <= positions.to(q.device)[:, None]
    probs = scores.masked_fill(~mask, -torch.inf).softmax(-1)
    return torch.einsum("hts,shd->thd", probs, vf).to(q.dtype)
