"""A step's inputs as the model reads them: each sequence's slice (`SeqInput`) and, built from them once
per step, where every token sits in the paged cache (`StepMetadata`). The model runner, the draft and
evaluation all prepare their steps here."""
from __future__ import annotations

import collections
import dataclasses
import itertools
from dataclasses import dataclass

import torch

from ..plan import TILED_INPUT_ROWS
from .attention_ref import DensePrefills

# A step whose sequences each bring at most TILED_INPUT_ROWS rows (a speculative verify, with decodes
# beside it) attends all of them in one launch, in query tiles of at most TILE_ROWS rows of one input.
TILE_ROWS = 8


@dataclass
class SeqInput:
    """One sequence's slice of a step: tokens at positions start_pos.., their blocks already allocated."""

    token_ids: torch.Tensor          # [T] int64
    start_pos: int
    block_table: list[int]
    all_logits: bool = False         # prefill-for-eval / speculative verify want every position
    # RoPE position = cache position + rope_offset. Non-zero for a cache that dropped older tokens
    # (the draft's sliding window): the tokens keep their original positions.
    rope_offset: int = 0
    # A hybrid model's sliding-window layers read their own cache group through this table (block b holds
    # positions b*B..; blocks below the window are given back, their entries only placeholders never read).
    sliding_table: list[int] | None = None
    # A model with linear-attention layers (Qwen3.5): the sequence's slot in the recurrent states (kv/recurrent.py),
    # holding its state after start_pos tokens.
    state_slot: int | None = None
    log_state: bool = False   # a speculative verify: keep what rolling the recurrent state back needs
    # (rows, snapshot slot): copy the state as it is after the first `rows` tokens into that slot (a prompt's
    # boundary kept for prefix hits, cache_tiers/state_snapshots.py)
    save_states: list[tuple[int, int]] = dataclasses.field(default_factory=list)


def write_blocks(block_table: list[int], positions: list[int], block_size: int) -> list[int]:
    """The FP16 blocks the K/V of tokens at `positions` are written to. Writes always land in the FP16
    tail: a quantised block there means the block manager compacted too early."""
    entries = [block_table[p // block_size] for p in positions]
    if min(entries) < 0:
        raise RuntimeError("write into a quantised KV block: the FP16 tail must cover every position written")
    return entries


@dataclass
class StepTiles:
    """The one attention launch of a tiled step (`ops.paged_tile_attention`), as device tensors built once
    per step: each input is one or more query tiles over its own block table (its view of the cache)."""

    tiles: torch.Tensor                 # int32 [N, 3]: first row, rows (<= block_m), row of `tables`
    tables: torch.Tensor                # int32 [inputs, max_blocks]
    positions: torch.Tensor             # int32 [T]
    block_m: int = TILE_ROWS
    dense: DensePrefills | None = None  # the CPU twin's layout, made at the first layer

    @staticmethod
    def layout(lengths: list[int], block_m: int = TILE_ROWS) -> list[tuple[int, int, int]]:
        """(first row, rows, input) of each tile, for inputs of `lengths` rows laid out one after another."""
        out, row = [], 0
        for i, n in enumerate(lengths):
            out += [(row + k, min(block_m, n - k), i) for k in range(0, n, block_m)]
            row += n
        return out


@dataclass
class StepMetadata:
    """Where each token of a step lives, as device tensors built once per step (not per layer)."""

    positions: torch.Tensor                  # [T] long
    slot_blocks: torch.Tensor                # [T] FP16-pool block each token's K/V is written to
    slot_offsets: torch.Tensor               # [T]
    decode_rows: torch.Tensor | None         # rows of single-token sequences, attended in one batched call
    decode_tables: torch.Tensor | None       # int32 [S_decode, max_blocks]
    decode_lens: torch.Tensor | None         # int32 [S_decode]
    prefills: list[tuple[int, int, torch.Tensor]]  # (first row, tokens, int32 table) of multi-token chunks
    logit_rows: torch.Tensor                 # rows whose logits are wanted
    logit_counts: list[int]
    rope_positions: torch.Tensor             # [T] positions RoPE rotates by: `positions` + each rope_offset
    quantise: tuple[list[int], list[int]] | None = None   # FP16 blocks, and the quantised blocks they go to
    dense_prefills: DensePrefills | None = None   # the CPU attention's layout of `prefills`, made at the first layer
    tiles: StepTiles | None = None   # set when the step attends in one tiled launch (short inputs, not all decodes)
    # A hybrid model's sliding layers: the same rows through their own group's tables (its slot_blocks, tables
    # and tiles; positions and logit rows as here)
    sliding: "StepMetadata | None" = None
    # Linear-attention layers: (first row, tokens, state slot) of each input run on its own, in row order; and
    # the rows and slots of the one-token inputs that are their sequence's only input (a decode batch, one launch)
    recurrent: list[tuple[int, int, int]] | None = None
    recurrent_decode: tuple[torch.Tensor, torch.Tensor] | None = None
    recurrent_log: frozenset[int] = frozenset()   # slots whose multi-token rows are logged (StepLog)
    recurrent_saves: dict[int, list[tuple[int, int]]] = dataclasses.field(default_factory=dict)   # first row -> saves

    @property
    def all_decode(self) -> bool:
        """Every row is a one-token sequence, in order (build() and the graphs list them so)."""
        return not self.prefills and self.decode_rows is not None and self.decode_rows.numel() == self.positions.numel()

    @classmethod
    def build(cls, seqs: list[SeqInput], block_size: int, device: torch.device) -> "StepMetadata":
        """The step's metadata; with sliding tables (a hybrid model) also theirs, in `sliding`."""
        meta = cls._build(seqs, block_size, device)
        if seqs and seqs[0].sliding_table is not None:
            sliding = [dataclasses.replace(s, block_table=s.sliding_table, sliding_table=None) for s in seqs]
            meta.sliding = cls._build(sliding, block_size, device)
        if seqs and seqs[0].state_slot is not None:
            starts = list(itertools.accumulate((len(s.token_ids) for s in seqs), initial=0))
            runs = [(starts[i], len(s.token_ids), s.state_slot) for i, s in enumerate(seqs)]
            meta.recurrent_log = frozenset(s.state_slot for s in seqs if s.log_state)
            meta.recurrent_saves = {starts[i]: s.save_states for i, s in enumerate(seqs) if s.save_states}
            # A sequence cut into several inputs (runs of rows reading its KV blocks differently) advances its
            # state through them in order, so none of them joins the decode batch, which runs first; nor does an
            # input that saves its state.
            inputs_of = collections.Counter(slot for _, _, slot in runs)
            alone = [n == 1 and inputs_of[slot] == 1 and row not in meta.recurrent_saves for row, n, slot in runs]
            decode = [(row, slot) for (row, _, slot), one in zip(runs, alone) if one]
            meta.recurrent = [run for run, one in zip(runs, alone) if not one]
            if decode:
                rows, slots = zip(*decode)
                meta.recurrent_decode = (torch.tensor(rows, device=device), torch.tensor(slots, device=device))
        return meta

    @classmethod
    def _build(cls, seqs: list[SeqInput], block_size: int, device: torch.device) -> "StepMetadata":
        positions, blocks, offsets, logit_rows, counts, rope = [], [], [], [], [], []
        decode_rows, decode_tables, decode_lens, prefills = [], [], [], []
        row = 0
        for s in seqs:
            n = len(s.token_ids)
            pos = list(range(s.start_pos, s.start_pos + n))
            entries = write_blocks(s.block_table, pos, block_size)
            positions += pos
            rope += [p + s.rope_offset for p in pos]
            blocks += entries
            offsets += [p % block_size for p in pos]
            logit_rows += list(range(row, row + n)) if s.all_logits else [row + n - 1]
            counts.append(n if s.all_logits else 1)
            table = s.block_table[: pos[-1] // block_size + 1]
            if n == 1:
                decode_rows.append(row)
                decode_tables.append(table)
                decode_lens.append(pos[-1] + 1)
            else:
                prefills.append((row, n, torch.tensor(table, dtype=torch.int32, device=device)))
            row += n

        def t(values, dtype=torch.long):
            return torch.tensor(values, dtype=dtype, device=device)

        def padded(tables: list[list[int]]) -> torch.Tensor:
            width = max(len(tb) for tb in tables)
            return t([tb + [0] * (width - len(tb)) for tb in tables], torch.int32)

        lengths = [len(s.token_ids) for s in seqs]
        tiles = None
        if prefills and max(lengths) <= TILED_INPUT_ROWS:
            tables = [s.block_table[: (s.start_pos + n - 1) // block_size + 1] for s, n in zip(seqs, lengths)]
            tiles = StepTiles(t(StepTiles.layout(lengths), torch.int32), padded(tables), t(positions, torch.int32))
        return cls(t(positions), t(blocks), t(offsets),
                   t(decode_rows) if decode_rows else None,
                   padded(decode_tables) if decode_rows else None,
                   t(decode_lens, torch.int32) if decode_rows else None,
                   prefills, t(logit_rows), counts,
                   t(rope), tiles=tiles)
