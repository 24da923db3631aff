"""Decode steps replayed from CUDA graphs, one per batch size of the profile, so Python and launch
overhead do not show in the step time.

A graph holds static input buffers (embedded rows, positions, KV slots, block tables, lengths);
a step copies its metadata into the smallest graph that fits and replays it. Padding rows write
their K/V into a scratch FP16 block no sequence owns and attend to nothing (length 0).
"""
from __future__ import annotations

import torch

from ..kv.pool import KVPools
from ..model.llama import LlamaModel, SeqInput, StepMetadata


class _Graph:
    def __init__(self, model: LlamaModel, pools: KVPools, batch: int, max_blocks: int, scratch_block: int,
                 pool_handle) -> None:
        dev, hidden = model.device, model.cfg.hidden_size
        self.batch, self.scratch_block = batch, scratch_block
        self.h = torch.zeros(batch, hidden, dtype=model.dtype, device=dev)
        rows = torch.arange(batch, device=dev)
        self.meta = StepMetadata(
            positions=torch.zeros(batch, dtype=torch.long, device=dev),
            slot_blocks=torch.full((batch,), scratch_block, dtype=torch.long, device=dev),
            slot_offsets=torch.zeros(batch, dtype=torch.long, device=dev),
            decode_rows=rows, decode_tables=torch.zeros(batch, max_blocks, dtype=torch.int32, device=dev),
            decode_lens=torch.zeros(batch, dtype=torch.int32, device=dev),
            prefills=[], logit_rows=rows, logit_counts=[1] * batch)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):   # warm-up: Triton compiles and autotunes outside the capture
            model.forward_hidden(self.h, self.meta, pools)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool_handle):
            self.logits = model.forward_hidden(self.h, self.meta, pools)

    def run(self, h: torch.Tensor, meta: StepMetadata) -> torch.Tensor:
        n = h.shape[0]
        m = self.meta
        self.h[:n].copy_(h)
        m.positions[:n].copy_(meta.positions)
        m.slot_blocks.fill_(self.scratch_block)
        m.slot_blocks[:n].copy_(meta.slot_blocks)
        m.slot_offsets.zero_()
        m.slot_offsets[:n].copy_(meta.slot_offsets)
        m.decode_lens.zero_()
        m.decode_lens[:n].copy_(meta.decode_lens)
        m.decode_tables[:n, : meta.decode_tables.shape[1]].copy_(meta.decode_tables)
        self.graph.replay()
        return self.logits[:n]


class DecodeGraphs:
    def __init__(self, model: LlamaModel, pools: KVPools, batch_sizes: list[int], max_model_len: int,
                 scratch_block: int) -> None:
        self.model, self.pools = model, pools
        self.max_blocks = -(-max_model_len // pools.cfg.block_size)
        handle = torch.cuda.graph_pool_handle()
        # Largest first: later, smaller captures reuse its memory from the shared pool.
        self.graphs = {b: _Graph(model, pools, b, self.max_blocks, scratch_block, handle)
                       for b in sorted(set(batch_sizes), reverse=True)}

    def run(self, seqs: list[SeqInput]) -> list[torch.Tensor] | None:
        """Logits of a decode-only step, or None when no graph fits it (the caller runs eagerly)."""
        if any(len(s.token_ids) != 1 or s.all_logits for s in seqs):
            return None
        fitting = [b for b in self.graphs if b >= len(seqs)]
        if not fitting:
            return None
        meta = StepMetadata.build(seqs, self.pools.cfg.block_size, self.model.device)
        h = self.model.embed_ids(torch.cat([s.token_ids for s in seqs]))
        return list(self.graphs[min(fitting)].run(h, meta).clone())
