"""Decode and speculative-verify steps replayed from CUDA graphs, so Python and launch overhead do
not show in the step time: decode per batch size of the profile, verify per (batch, γ+1) bucket.

A graph reads static buffers: the embedded rows (and Gemma 4's per-layer table rows), one buffer of positions, KV slots, RoPE positions
and context lengths (and a verify's query tiles), copied host-to-device once a step without a sync,
from pinned memory, and the block tables. A table row is copied only when the table it holds changed
since that row was last written (a new block every 16 tokens, a compaction), not every step: at 64k
context a row is 4,096 entries, and rebuilding them each step would cost more host time than the
decode itself.

A decode takes the smallest graph that fits; its rows attend through the batched decode attention. A
verify (rows of each sequence: the pending token and its proposals, cut into runs where the window's
quantised end moves, each run with its own table view) takes the smallest bucket whose rows, runs
and query tiles hold it; all its rows attend in one tiled launch. Padding rows write their K/V into a
scratch FP16 block no sequence owns and attend to nothing (length 0, or a tile of no rows).

A hybrid model's sliding-window layers read their own cache group: a second row of slot blocks and a second
set of table rows (`pools.sliding`, `SeqInput.sliding_table`), into that group's own scratch block.
"""
from __future__ import annotations

import torch

from ..kernels.step_inputs import TILE_ROWS, SeqInput, StepMetadata, StepTiles, write_blocks
from ..kv.pool import KVPools
from ..plan import verify_graph_buckets
from .llama import LlamaModel

STEP_KINDS = ("decode", "verify")
# The rows of the staged buffer: position, slot block, slot offset, RoPE position, context length, and the
# sliding layers' slot block (a hybrid model's; unused otherwise).
_POS, _SLOT, _OFFSET, _ROPE, _LEN, _SLIDING_SLOT = range(6)
_ROWS = 6


class _StaticStep:
    """The buffers of one bucket and the step over them: a decode of `batch` rows (`rows` = 1), or a
    verify of up to `batch`·`rows` rows in at most 2·`batch` runs (each sequence's rows cross at most one
    window block when `rows` <= a block). `capture` records it as a CUDA graph, otherwise `run` executes
    the same step eagerly (how the CPU tests check the buffers). `head`: logits, else the hidden states
    before the final norm (a draft applies its own heads)."""

    def __init__(self, model: LlamaModel, pools: KVPools, batch: int, max_blocks: int, scratch_block: int,
                 capture: bool, pool_handle=None, rows: int = 1, head: bool = True) -> None:
        dev = model.device
        self.model, self.pools, self.head = model, pools, head
        self.block_size, self.scratch_block = pools.cfg.block_size, scratch_block
        self.capacity = batch * rows
        self.max_inputs = batch if rows == 1 else 2 * batch
        self.max_tiles = 0 if rows == 1 else batch * (-(-rows // TILE_ROWS) + 1)
        self.rows = rows
        self.h = torch.zeros(self.capacity, model.cfg.hidden_size, dtype=model.dtype, device=dev)
        # Gemma 4's per-layer table rows of the step's tokens: gathered outside the graph as the embedded rows are
        cfg = model.cfg
        self.per_layer = (torch.zeros(self.capacity, cfg.num_layers * cfg.per_layer_input_size, dtype=model.dtype,
                                      device=dev) if model.per_layer is not None else None)
        staged = _ROWS * self.capacity + 3 * self.max_tiles
        self.staged = torch.zeros(staged, dtype=torch.long, device=dev)
        self.small = self.staged[:_ROWS * self.capacity].view(_ROWS, self.capacity)
        # Staged in pinned memory and copied without a sync, so the host can prepare the next step
        # while the GPU runs this one; the event says when the staging buffer may be written again.
        on_gpu = dev.type == "cuda"
        self.staged_host = torch.zeros(staged, dtype=torch.long, pin_memory=on_gpu)
        self.staged_copied = torch.cuda.Event() if on_gpu else None
        self.tables = torch.zeros(self.max_inputs, max_blocks, dtype=torch.int32, device=dev)
        self.rows_written: list[list[int] | None] = [None] * self.max_inputs   # host copy of each table row
        self.sliding_tables = (torch.zeros(self.max_inputs, max_blocks, dtype=torch.int32, device=dev)
                               if pools.sliding is not None else None)
        self.sliding_written: list[list[int] | None] = [None] * self.max_inputs
        every_row = torch.arange(self.capacity, device=dev)
        common = dict(positions=self.small[_POS], slot_blocks=self.small[_SLOT], slot_offsets=self.small[_OFFSET],
                      prefills=[], logit_rows=every_row, logit_counts=[1] * self.capacity,
                      rope_positions=self.small[_ROPE])
        if rows == 1:
            self.lens = torch.zeros(batch, dtype=torch.int32, device=dev)
            self.meta = StepMetadata(decode_rows=every_row, decode_tables=self.tables, decode_lens=self.lens, **common)
            if self.sliding_tables is not None:
                self.meta.sliding = StepMetadata(decode_rows=every_row, decode_tables=self.sliding_tables,
                                                 decode_lens=self.lens,
                                                 **(common | {"slot_blocks": self.small[_SLIDING_SLOT]}))
        else:
            self.tiles = StepTiles(torch.zeros(self.max_tiles, 3, dtype=torch.int32, device=dev), self.tables,
                                   torch.zeros(self.capacity, dtype=torch.int32, device=dev))
            self.meta = StepMetadata(decode_rows=None, decode_tables=None, decode_lens=None, tiles=self.tiles, **common)
            if self.sliding_tables is not None:   # the same tiles and positions through the sliding tables
                self.sliding_tiles = StepTiles(self.tiles.tiles, self.sliding_tables, self.tiles.positions)
                self.meta.sliding = StepMetadata(decode_rows=None, decode_tables=None, decode_lens=None,
                                                 tiles=self.sliding_tiles,
                                                 **(common | {"slot_blocks": self.small[_SLIDING_SLOT]}))
        self.graph = None
        if capture:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):   # warm-up: Triton compiles and autotunes outside the capture
                self._step()
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=pool_handle):
                self.out = self._step()

    def _step(self) -> torch.Tensor:
        # The kernels take int32 lengths, positions and tiles; the casts are part of the graph.
        if self.rows == 1:
            self.lens.copy_(self.small[_LEN])
        else:
            self.tiles.tiles.copy_(self.staged[_ROWS * self.capacity:].view(self.max_tiles, 3))
            self.tiles.positions.copy_(self.small[_POS])
            self.tiles.dense = None   # the CPU twin lays this step's tiles out afresh
            if self.sliding_tables is not None:
                self.sliding_tiles.dense = None
        return self.model.forward_hidden(self.h, self.meta, self.pools, head=self.head, per_layer=self.per_layer)

    def fits(self, seqs: list[SeqInput]) -> bool:
        lengths = [len(s.token_ids) for s in seqs]
        if self.rows == 1:
            return len(seqs) <= self.capacity and max(lengths) == 1 and not any(s.all_logits for s in seqs)
        return (len(seqs) <= self.max_inputs and max(lengths) <= self.rows and sum(lengths) <= self.capacity
                and len(StepTiles.layout(lengths)) <= self.max_tiles)

    def _stage(self, seqs: list[SeqInput]) -> None:
        """This step's rows into the staged buffer and the changed table rows into theirs."""
        cap = self.capacity
        small = torch.zeros(_ROWS, cap, dtype=torch.long)
        small[_SLOT] = self.scratch_block
        sliding = self.pools.sliding
        if sliding is not None:
            small[_SLIDING_SLOT] = sliding.scratch_block
        row = 0
        for s in seqs:
            pos = list(range(s.start_pos, s.start_pos + len(s.token_ids)))
            span = slice(row, row + len(pos))
            small[_POS, span] = torch.tensor(pos)
            small[_SLOT, span] = torch.tensor(write_blocks(s.block_table, pos, self.block_size))
            if sliding is not None:
                small[_SLIDING_SLOT, span] = torch.tensor(write_blocks(s.sliding_table, pos, self.block_size))
            small[_OFFSET, span] = torch.tensor([p % self.block_size for p in pos])
            small[_ROPE, span] = torch.tensor(pos) + s.rope_offset
            row += len(pos)
        small[_LEN, :len(seqs)] = torch.tensor([s.start_pos + len(s.token_ids) for s in seqs])
        staged = [small.flatten()]
        if self.rows > 1:
            layout = StepTiles.layout([len(s.token_ids) for s in seqs])
            tiles = torch.zeros(self.max_tiles, 3, dtype=torch.long)   # empty tiles after the step's own
            tiles[:len(layout)] = torch.tensor(layout)
            staged.append(tiles.flatten())
        if self.staged_copied is not None:
            self.staged_copied.synchronize()   # the previous step's copy has read the staging buffer
        torch.cat(staged, out=self.staged_host)
        self.staged.copy_(self.staged_host, non_blocking=True)
        if self.staged_copied is not None:
            self.staged_copied.record()
        for i, s in enumerate(seqs):
            self._write_row(self.tables, self.rows_written, i, s.block_table)
            if sliding is not None:
                self._write_row(self.sliding_tables, self.sliding_written, i, s.sliding_table)

    @staticmethod
    def _write_row(tables: torch.Tensor, written: list[list[int] | None], i: int, table: list[int]) -> None:
        if written[i] != table:   # the table is a list the block manager edits in place
            tables[i, :len(table)].copy_(torch.tensor(table, dtype=torch.int32))
            written[i] = list(table)

    def run(self, seqs: list[SeqInput]) -> list[torch.Tensor]:
        """Each input's logits (or hidden states): [V] for its last row, [T, V] when all_logits."""
        self._stage(seqs)
        ids = torch.cat([s.token_ids for s in seqs])
        self.h[:len(ids)].copy_(self.model.embed_ids(ids))
        if self.per_layer is not None:
            self.per_layer[:len(ids)].copy_(self.model.per_layer_rows(ids))
        if self.graph is None:
            out = self._step()
        else:
            self.graph.replay()
            out = self.out
        lengths = [len(s.token_ids) for s in seqs]
        rows = out[:sum(lengths)].clone().split(lengths)
        return [r if s.all_logits else r[-1] for r, s in zip(rows, seqs)]


class DecodeGraphs:
    """The static steps of an engine: decode at each of `batch_sizes`, and verify at each (batch, rows) of
    `verify_rows` (γ+1 of the speculation, also added later by `add_verify`) whose rows the head takes in
    a few launches."""

    def __init__(self, model: LlamaModel, pools: KVPools, batch_sizes: list[int], max_model_len: int,
                 scratch_block: int, capture: bool = True, verify_rows: list[int] = (), head: bool = True,
                 pool_handle=None) -> None:
        """`pool_handle`: capture into another set of graphs' memory pool (a draft's beside its target's:
        they never replay at once), else a new one."""
        self.model, self.pools, self.scratch_block, self.capture, self.head = model, pools, scratch_block, capture, head
        self.batch_sizes = sorted(set(batch_sizes))
        self.max_blocks = -(-max_model_len // pools.cfg.block_size)
        self.handle = pool_handle if pool_handle is not None or not capture else torch.cuda.graph_pool_handle()
        self.steps: dict[tuple[int, int], _StaticStep] = {}
        self.reset_counts()
        self._add([(b, 1) for b in self.batch_sizes])
        self.add_verify(verify_rows)

    def reset_counts(self) -> None:
        """Zero `counts`: the steps graph hits and eager fallbacks by step kind (decode: every input one row;
        verify: inputs of several rows)."""
        self.counts = {kind: {"graph": 0, "eager": 0} for kind in STEP_KINDS}

    def add_verify(self, verify_rows: list[int]) -> None:
        """Verify buckets of `verify_rows` rows a sequence at each batch size (`plan.verify_graph_buckets`)."""
        self._add([bucket for r in set(verify_rows) for bucket in verify_graph_buckets(self.batch_sizes, r)])

    def _add(self, buckets: list[tuple[int, int]]) -> None:
        # Largest first: later, smaller captures reuse its memory from the shared pool.
        for b, r in sorted(set(buckets) - set(self.steps), key=lambda br: (-br[0] * br[1], -br[1])):
            self.steps[b, r] = _StaticStep(self.model, self.pools, b, self.max_blocks, self.scratch_block,
                                           self.capture, self.handle, r, self.head)

    def run(self, seqs: list[SeqInput], quantise: bool = False) -> list[torch.Tensor] | None:
        """Each input's logits of a decode or verify step, or None when no graph fits it or it `quantise`s
        blocks between layers, which no graph holds (the caller runs eagerly). A step whose every input
        has at most a bucket's rows counts in `counts` as a graph hit or an eager fallback; a longer
        prefill chunk, which no graph is for, as neither."""
        lengths = [len(s.token_ids) for s in seqs]
        kind = "decode" if max(lengths) == 1 else "verify"
        fitting = [] if quantise else [(step.capacity, key) for key, step in self.steps.items() if step.fits(seqs)]
        if not fitting:
            if max(lengths) <= max(rows for _, rows in self.steps):
                self.counts[kind]["eager"] += 1
            return None
        self.counts[kind]["graph"] += 1
        return self.steps[min(fitting)[1]].run(seqs)
