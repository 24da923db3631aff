"""Plain-torch reference of paged mixed-precision attention: the oracle of the Triton kernel and the CPU path.

`paged_attention_ref` is written as the GPU kernel works: walk one sequence's
block table block by block, dequantise each block where it is read, and fold
it into an online softmax (running max, running sum, rescaled accumulator, all
fp32). The full-precision cache is never materialised. It is rotation-agnostic:
the caller rotates q whenever the cached keys are rotated.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from ..kv.pool import KVPools
from ..kv.quant import dequantize_blocks
from . import key_offset
from .key_offset import KeyOffset


def paged_attention_ref(
    q: torch.Tensor,
    pools: KVPools,
    layer: int,
    block_table: Sequence[int] | torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    blocks_per_tile: int = 1,
    window: int = 0,
    offset: KeyOffset | None = None,
) -> torch.Tensor:
    """Attention of q [T, H_q, D] over one sequence's cache; query t sees tokens j <= positions[t] (and, with
    `window` > 0 (a sliding-window layer), j > positions[t] - window: the blocks below every query's window
    are never read). `offset`: with centred keys, each score's q·R(p)m added back (key_offset.py).

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
    lo = (pos - window + 1).clamp(min=0) if window else torch.zeros_like(pos)

    running_max = torch.full((Hkv, T, group), -torch.inf, device=q.device)
    running_sum = torch.zeros((Hkv, T, group), device=q.device)
    acc = torch.zeros((Hkv, T, group, D), device=q.device)
    for first in range(int(lo.min()) // B, num_blocks, blocks_per_tile):  # nor beyond the last query
        entries = [int(block_table[i]) for i in range(first, min(first + blocks_per_tile, num_blocks))]
        k, v = dequantize_blocks(pools, layer, entries)
        # Slots past the context in the last block hold stale data; like the kernel's
        # masked loads, never touch them (a stale NaN would otherwise poison p @ v).
        valid = min(len(entries) * B, context_len - first * B)
        k, v = k[:, :valid], v[:, :valid]
        j = torch.arange(first * B, first * B + valid, device=q.device)
        visible = (j[None, :] <= pos[:, None]) & (j[None, :] >= lo[:, None])  # [T, valid]
        s = torch.einsum("htgd,hjd->htgj", qg, k)
        if offset is not None:   # [H_q, T, j] -> [H_kv, T, group, j]
            s = s + key_offset.scores(offset, j, q.dtype).unflatten(0, (Hkv, group)).transpose(1, 2)
        s = s * scale
        s = s.masked_fill(~visible[None, :, None, :], -torch.inf)
        # A query may see nothing in a block (an early query of a chunk before its window's first block is
        # read): subtracting 0 instead of a -inf max keeps exp at a clean 0 rather than NaN.
        new_max = torch.maximum(running_max, s.amax(-1))
        ref_max = new_max.masked_fill(new_max == -torch.inf, 0)
        p = torch.exp(s - ref_max.unsqueeze(-1))
        correction = torch.exp(running_max - ref_max)
        running_sum = running_sum * correction + p.sum(-1)
        acc = acc * correction.unsqueeze(-1) + torch.einsum("htgj,hjd->htgd", p, v)
        running_max = new_max
    out = acc / running_sum.unsqueeze(-1)
    return out.transpose(0, 1).reshape(T, Hq, D).to(q.dtype)


@dataclass
class _Tile:
    """Consecutive chunks of a step attended together: which cached entry each column block reads, and which
    of them each chunk reads."""
    rows: list[tuple[int, int]]     # (first row of q, rows) of each chunk
    take: torch.Tensor              # [column blocks] index into the step's dequantised entries
    col_pos: torch.Tensor           # [columns] position each column holds
    row_chunk: torch.Tensor         # [rows] the tile's chunk each row belongs to
    row_pos: torch.Tensor           # [rows] each row's position
    reads: torch.Tensor             # [chunks, column blocks] bool: the chunk reads that column block's entry
    unseen: torch.Tensor | None     # [columns] bool, columns no row sees (stale slots past an end), or None


@dataclass
class DensePrefills:
    """How the CPU path attends a step's multi-token chunks, worked out once per step (every layer reads the
    same blocks at the same positions): the entries to dequantise and the tiles of rows with their columns."""
    entries: list[int]
    tiles: list[_Tile]
    block_size: int

    @classmethod
    def build(cls, prefills: list[tuple[int, int, torch.Tensor]], positions: torch.Tensor, block_size: int,
              tile_rows: int = 256) -> "DensePrefills":
        """A tile of consecutive chunks reads the latest chunk's table for each block ("base") plus, as extra
        columns, every other entry an earlier chunk of the tile reads in its place (eval's runs see a few
        blocks in FP16 that later runs see quantised)."""
        B = block_size
        pos = positions.to(dtype=torch.long)
        device = pos.device
        chunks = [(s, n, torch.as_tensor(table).tolist()[:_blocks_read(pos[s:s + n], B, table)])
                  for s, n, table in prefills]
        entries = sorted({e for _, _, table in chunks for e in table})
        index = {e: i for i, e in enumerate(entries)}
        tiles = []
        for tile in _row_tiles(chunks, tile_rows):
            base: dict[int, int] = {}
            for _, _, table in tile:
                base.update(enumerate(table))   # the latest chunk reading a block names its base entry
            extra = sorted({(b, e) for _, _, table in tile for b, e in enumerate(table) if e != base[b]})
            columns = list(base.items()) + extra
            col_pos = (torch.tensor([b for b, _ in columns], device=device)[:, None] * B
                       + torch.arange(B, device=device)).flatten()
            reads = torch.tensor([[b < len(table) and table[b] == e for b, e in columns] for _, _, table in tile],
                                 device=device)
            row_chunk = torch.cat([pos.new_full((n,), i) for i, (_, n, _) in enumerate(tile)])
            row_pos = torch.cat([pos[s:s + n] for s, n, _ in tile])
            t = _Tile([(s, n) for s, n, _ in tile], torch.tensor([index[e] for _, e in columns], device=device),
                      col_pos, row_chunk, row_pos, reads, None)
            unseen = ~_visible(t, B).any(0)
            t.unseen = unseen if bool(unseen.any()) else None
            tiles.append(t)
        return cls(entries, tiles, B)


def _visible(tile: _Tile, block_size: int, window: int = 0) -> torch.Tensor:
    """[rows, columns] bool: a row sees its own chunk's entries up to its position (the last `window` of
    them when window > 0)."""
    own = tile.reads[tile.row_chunk].repeat_interleave(block_size, 1)
    seen = own & (tile.col_pos[None, :] <= tile.row_pos[:, None])
    return seen & (tile.col_pos[None, :] > tile.row_pos[:, None] - window) if window else seen


def paged_prefills_dense(q: torch.Tensor, pools: KVPools, layer: int, plan: DensePrefills,
                         scale: float, window: int = 0, offset: KeyOffset | None = None) -> list[torch.Tensor]:
    """`paged_attention_ref` of each chunk of a step (as `plan` lays them out), computed as dense masked
    attention over row tiles: the CPU path, one fused softmax per tile instead of a loop per block. Every
    block the tables name is dequantised once; the mask gives each row exactly its own chunk's entries up
    to its position."""
    H_kv, B = pools.k.shape[2], plan.block_size
    staged = [side.unflatten(1, (len(plan.entries), B)) for side in dequantize_blocks(pools, layer, plan.entries)]
    out = []
    for tile in plan.tiles:
        k, v = (side[:, tile.take].flatten(1, 2) for side in staged)
        visible = _visible(tile, B, window)
        # with a window, the slots below every row's window too (their blocks may be gone)
        unseen = tile.unseen if not window else ~visible.any(0)
        if unseen is not None:
            # Slots no row sees (past a sequence's end in its last block) may hold stale data, even NaN:
            # zero them, as the kernel's masked loads never read them.
            k, v = (side.masked_fill_(unseen[None, :, None], 0) for side in (k, v))
        qt = torch.cat([q[s:s + n] for s, n in tile.rows]).float().transpose(0, 1)
        D = qt.shape[-1]
        if offset is not None:
            # centred keys: q·R(p)m = [A | B]·[cos | sin] of the key's position, so each query row carries its
            # coefficients and each key its angles as extra channels, and one product scores both (v padded to
            # the same width keeps torch's fused CPU attention: twice the plain tile's time, against six for a
            # float mask of the scores)
            coefficients = torch.cat([offset.coefficients[s:s + n] for s, n in tile.rows]).float().transpose(0, 1)
            turn = torch.cat(key_offset.angles(tile.col_pos, offset.inv_freq, q.dtype), dim=-1)
            qt, k = torch.cat([qt, coefficients], dim=-1), torch.cat([k, turn.expand(H_kv, -1, -1)], dim=-1)
            v = torch.cat([v, torch.zeros_like(v)], dim=-1)
        o = F.scaled_dot_product_attention(qt[None], k[None], v[None], attn_mask=visible, scale=scale,
                                           enable_gqa=H_kv != q.shape[1])[..., :D]
        out += o[0].transpose(0, 1).to(q.dtype).split([n for _, n in tile.rows])
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


def tile_chunks(tiles: torch.Tensor, tables: torch.Tensor) -> list[tuple[int, int, list[int]]]:
    """The (first row, rows, table) of each non-empty query tile of a tiled step (`paged_tile_attention`)."""
    table_rows = tables.tolist()
    return [(first, n, table_rows[row]) for first, n, row in tiles.tolist() if n > 0]


def paged_tile_attention_ref(q: torch.Tensor, pools: KVPools, layer: int, tiles: torch.Tensor, tables: torch.Tensor,
                             positions: torch.Tensor, scale: float, plan: DensePrefills | None = None,
                             window: int = 0, offset: KeyOffset | None = None) -> torch.Tensor:
    """The twin of the tiled attention: each tile's rows attend through its table as `paged_attention_ref`
    does (dense over row tiles, `paged_prefills_dense`; `plan` is that layout when the caller keeps it
    across layers). Rows of no tile get zeros."""
    if plan is None:
        plan = DensePrefills.build(tile_chunks(tiles, tables), positions, pools.cfg.block_size)
    out = torch.zeros_like(q)
    spans = [span for tile in plan.tiles for span in tile.rows]
    for (first, n), rows in zip(spans, paged_prefills_dense(q, pools, layer, plan, scale, window, offset)):
        out[first:first + n] = rows
    return out


def paged_decode_attention_ref(
    q: torch.Tensor,
    pools: KVPools,
    layer: int,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    blocks_per_tile: int = 1,
    window: int = 0,
    offset: KeyOffset | None = None,
) -> torch.Tensor:
    """One query per sequence, q [S, H_q, D], each attending its context_lens[s] cached tokens through
    `paged_attention_ref`; a length-0 slot (CUDA-graph padding) gives zeros."""
    out = torch.zeros_like(q)
    for s, n in enumerate(context_lens.tolist()):
        if n > 0:
            pos = torch.tensor([n - 1], device=q.device)
            out[s] = paged_attention_ref(q[s:s + 1], pools, layer, block_tables[s], pos, scale, blocks_per_tile,
                                         window, offset.rows(slice(s, s + 1)) if offset is not None else None)[0]
    return out


def dense_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """Plain causal softmax attention of q [T, H_q, D] over dense k, v [S, H_kv, D] (the last `window`
    positions when window > 0); returns [T, H_q, D]."""
    T, Hq, _ = q.shape
    S, Hkv, _ = k.shape
    kf = k.float().repeat_interleave(Hq // Hkv, dim=1)  # [S, H_q, D]: kv head h // group for query head h
    vf = v.float().repeat_interleave(Hq // Hkv, dim=1)
    scores = torch.einsum("thd,shd->hts", q.float(), kf) * scale
    j, pos = torch.arange(S, device=q.device)[None, :], positions.to(q.device)[:, None]
    mask = (j <= pos) & (j > pos - window) if window else j <= pos
    probs = scores.masked_fill(~mask, -torch.inf).softmax(-1)
    return torch.einsum("hts,shd->thd", probs, vf).to(q.dtype)
