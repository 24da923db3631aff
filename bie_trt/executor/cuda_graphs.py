"""Decode steps replayed from CUDA graphs, one per batch size of the profile, so Python and launch
overhead do not show in the step time.

A graph reads static buffers: the embedded rows, one [4, batch] buffer of positions, KV slots and
context lengths (one asynchronous host-to-device copy a step, from pinned memory), and the block
tables. A table row is copied only when its sequence's table changed since that row was last
written (a new block every 16 tokens, a compaction), not every step: at 64k context a row is
4,096 entries, and rebuilding them each step would cost more host time than the decode itself.

A step takes the smallest graph that fits. Padding rows write their K/V into a scratch FP16 block
no sequence owns and attend to nothing (length 0).
"""
from __future__ import annotations

import torch

from ..kv.pool import KVPools
from ..model.llama import LlamaModel
from ..model.step_inputs import SeqInput, StepMetadata, write_blocks


class _StaticStep:
    """The buffers of one batch size and the decode step over them; `capture` records it as a CUDA
    graph, otherwise `run` executes the same step eagerly (how the CPU tests check the buffers)."""

    def __init__(self, model: LlamaModel, pools: KVPools, batch: int, max_blocks: int, scratch_block: int,
                 capture: bool, pool_handle=None) -> None:
        dev = model.device
        self.model, self.pools, self.batch = model, pools, batch
        self.block_size, self.scratch_block = pools.cfg.block_size, scratch_block
        self.h = torch.zeros(batch, model.cfg.hidden_size, dtype=model.dtype, device=dev)
        self.small = torch.zeros(4, batch, dtype=torch.long, device=dev)   # positions, slot block, offset, length
        # Staged in pinned memory and copied without a sync, so the host can prepare the next step
        # while the GPU runs this one; the event says when the staging buffer may be written again.
        on_gpu = dev.type == "cuda"
        self.small_host = torch.zeros(4, batch, dtype=torch.long, pin_memory=on_gpu)
        self.small_copied = torch.cuda.Event() if on_gpu else None
        self.tables = torch.zeros(batch, max_blocks, dtype=torch.int32, device=dev)
        self.rows_written: list[list[int] | None] = [None] * batch         # host copy of each table row
        self.lens = torch.zeros(batch, dtype=torch.int32, device=dev)
        rows = torch.arange(batch, device=dev)
        self.meta = StepMetadata(
            positions=self.small[0], slot_blocks=self.small[1], slot_offsets=self.small[2],
            decode_rows=rows, decode_tables=self.tables, decode_lens=self.lens,
            prefills=[], logit_rows=rows, logit_counts=[1] * batch, rope_positions=self.small[0])
        self.graph = None
        if capture:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):   # warm-up: Triton compiles and autotunes outside the capture
                self._step()
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=pool_handle):
                self.logits = self._step()

    def _step(self) -> torch.Tensor:
        self.lens.copy_(self.small[3])   # the kernels take int32 lengths; the copy is part of the graph
        return self.model.forward_hidden(self.h, self.meta, self.pools)

    def run(self, seqs: list[SeqInput]) -> torch.Tensor:
        n, pad = len(seqs), self.batch - len(seqs)
        positions = [s.start_pos for s in seqs]
        slots = [write_blocks(s.block_table, [p], self.block_size)[0] for s, p in zip(seqs, positions)]
        small = (positions + [0] * pad + slots + [self.scratch_block] * pad
                 + [p % self.block_size for p in positions] + [0] * pad + [p + 1 for p in positions] + [0] * pad)
        if self.small_copied is not None:
            self.small_copied.synchronize()   # the previous step's copy has read the staging buffer
        self.small_host.copy_(torch.tensor(small).view(4, self.batch))
        self.small.copy_(self.small_host, non_blocking=True)
        if self.small_copied is not None:
            self.small_copied.record()
        for i, s in enumerate(seqs):
            if self.rows_written[i] != s.block_table:   # the table is a list the block manager edits in place
                self.tables[i, :len(s.block_table)].copy_(torch.tensor(s.block_table, dtype=torch.int32))
                self.rows_written[i] = list(s.block_table)
        self.h[:n].copy_(self.model.embed_ids(torch.cat([s.token_ids for s in seqs])))
        if self.graph is None:
            return self._step()[:n]
        self.graph.replay()
        return self.logits[:n]


class DecodeGraphs:
    def __init__(self, model: LlamaModel, pools: KVPools, batch_sizes: list[int], max_model_len: int,
                 scratch_block: int, capture: bool = True) -> None:
        self.max_blocks = -(-max_model_len // pools.cfg.block_size)
        handle = torch.cuda.graph_pool_handle() if capture else None
        # Largest first: later, smaller captures reuse its memory from the shared pool.
        self.steps = {b: _StaticStep(model, pools, b, self.max_blocks, scratch_block, capture, handle)
                      for b in sorted(set(batch_sizes), reverse=True)}

    def run(self, seqs: list[SeqInput]) -> list[torch.Tensor] | None:
        """Logits of a decode-only step, or None when no graph fits it (the caller runs eagerly)."""
        if any(len(s.token_ids) != 1 or s.all_logits or s.rope_offset for s in seqs):
            return None
        fitting = [b for b in self.steps if b >= len(seqs)]
        if not fitting:
            return None
        return list(self.steps[min(fitting)].run(seqs).clone())
