"""Decode and speculative verify through the graphs' static buffers equal the eager forward.

Two identical worlds (same weights, pools and block decisions) decode the same tokens: one through
`DecodeGraphs`, one through `LlamaModel.forward`. Batches change size and order between steps, so
graph rows are padded and rows are reassigned to other sequences; tables grow a block every 16
tokens and blocks leave the window into the INT4 body, so a table row copied once goes stale. In
the verify worlds each step verifies random proposals (γ = 3) and accepts a random prefix of them:
rows cross window blocks (a sequence's rows in two runs, each with its own view), buckets change,
and rejected rows are rolled back. On the CPU the static step runs eagerly (the buffers, tiles and
padding logic); on CUDA it is captured and replayed (the gpu tests).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from bie_trt.config import KVCacheConfig
from bie_trt.cache_tiers.block_manager import BlockManager
from bie_trt.cache_tiers.exact_rows import join_runs
from bie_trt.executor.model_runner import ModelRunner, apply_moves, copy_blocks
from bie_trt.executor.scheduler import Scheduler
from bie_trt.executor.sequence import Sequence
from bie_trt.kernels import triton_ops
from bie_trt.kernels.step_inputs import TILE_ROWS, StepTiles
from bie_trt.kv.pool import allocate_kv, allocate_pools
from bie_trt.model.cuda_graphs import DecodeGraphs
from bie_trt.model.llama import LlamaModel, SeqInput
from bie_trt.model.synthetic import random_weights, tiny_llama
from bie_trt.sampling import make_generator
from bie_trt.sampling_params import SamplingParams

CFG = tiny_llama()   # head_dim 32, GQA 2:1
# A hybrid model: two sliding layers over 20 positions (their own cache group, blocks given back as the window
# passes), one full layer
HYBRID = dataclasses.replace(tiny_llama(num_layers=3), sliding_window=20,
                             layer_types=("sliding_attention", "full_attention", "sliding_attention"))
SLIDING_BLOCKS = 24
# A window of 1.5 blocks: blocks leave it mid-block, so a table entry changes while its length does not.
KV = KVCacheConfig(dtype="int4_asym", group_size=32, sink_tokens=4, window=24)
PROMPTS = (5, 20, 37)
# Graph sizes 4 and 2: three rows pad one, a single row pads one, two fit exactly.
BATCHES = ([0, 1, 2], [2, 0], [1])
FP_BLOCKS, QUANT_BLOCKS, MAX_LEN = 16, 16, 160
GAMMA = 3


class World:
    """Sequences stepped as the engine steps them (scheduler views, moves, copies, then the forward), through
    the graphs or eagerly; `graph_steps` counts the steps a graph took and their runs per sequence."""

    def __init__(self, model: LlamaModel, graphs: bool, capture: bool):
        self.model, cfg = model, model.cfg
        sliding = SLIDING_BLOCKS if cfg.sliding_layers else 0
        self.pools = allocate_kv(cfg, KV, FP_BLOCKS, QUANT_BLOCKS, sliding, model.dtype, model.device,
                                 scratch_block=True)
        self.blocks = BlockManager(KV, FP_BLOCKS, QUANT_BLOCKS, sliding_window=cfg.sliding_window or 0,
                                   num_sliding_blocks=sliding)
        if sliding:   # sliding block ids other than the full layers' ones, so a table taken for the other shows
            self.blocks.sliding.free.reverse()
        self.scheduler = Scheduler(self.blocks, len(PROMPTS), 256, 64, GAMMA)
        self.graphs = DecodeGraphs(model, self.pools, [4, 2], MAX_LEN, self.pools.scratch_block,
                                   capture=capture, verify_rows=[GAMMA + 1]) if graphs else None
        self.graph_steps: list[list[int]] = []
        self.seqs = []
        for i, n in enumerate(PROMPTS):
            seq = Sequence(list(range(10 * i, 10 * i + n)), SamplingParams(), make_generator(SamplingParams(), 0))
            self.step([(seq, n)], {})
            self.scheduler.postprocess(seq, n, had_lookahead=False)
            self.seqs.append(seq)

    def step(self, chunks: list[tuple[Sequence, int]], drafts: dict[Sequence, list[int]]) -> list[torch.Tensor]:
        copies = [c for seq, n in chunks for c in self.blocks.grow(seq, seq.num_cached + n + len(drafts.get(seq, [])))]
        batch = self.scheduler.batch(chunks, copies, {seq: len(d) for seq, d in drafts.items()})
        apply_moves(self.pools, None, batch.moves)
        copy_blocks(self.pools, batch.copies)
        inputs, num_runs, all_logits = ModelRunner.prepare_inputs(batch, drafts)
        logits = None
        if self.graphs and not batch.layer_quantisations:   # as ModelRunner.forward decides
            logits = self.graphs.run(inputs)
            if logits is not None:
                self.graph_steps.append(num_runs)
        if logits is None:
            logits = self.model.forward(inputs, self.pools, batch.layer_quantisations)
        return join_runs(logits, num_runs, all_logits)

    def decode(self, rows: list[int], tokens: list[int]) -> list[torch.Tensor]:
        for r, t in zip(rows, tokens):
            self.seqs[r].output_ids.append(t)
        chunks = [(self.seqs[r], 1) for r in rows]
        logits = self.step(chunks, {})
        for seq, n in chunks:
            self.scheduler.postprocess(seq, n, had_lookahead=False)
        return logits

    def verify(self, rows: list[int], drafts: list[list[int]], accepted: list[int]) -> list[torch.Tensor]:
        """Verify each row's drafts after its pending token, then keep `accepted` of them and a bonus token."""
        chunks = [(self.seqs[r], 1) for r in rows]
        logits = self.step(chunks, {self.seqs[r]: d for r, d in zip(rows, drafts) if d})
        for (seq, _), d, a in zip(chunks, drafts, accepted):
            seq.output_ids += d[:a] + [(d[-1] + 1) % CFG.vocab_size if d else 0]
            self.scheduler.postprocess(seq, 1 + a, had_lookahead=bool(d))
        return logits


def decode_both(device: str, steps: int, capture: bool, cfg=CFG) -> tuple[World, list[tuple[torch.Tensor, torch.Tensor]]]:
    dtype = torch.float16 if device == "cuda" else torch.float32
    model = LlamaModel(cfg, random_weights(cfg, group_size=32), torch.device(device), dtype)
    static, eager = World(model, graphs=True, capture=capture), World(model, graphs=False, capture=False)
    g = torch.Generator().manual_seed(1)
    pairs = []
    for t in range(steps):
        rows = BATCHES[t % len(BATCHES)]
        tokens = torch.randint(0, CFG.vocab_size, (len(rows),), generator=g).tolist()
        pairs += zip(static.decode(rows, tokens), eager.decode(rows, tokens))
    assert [s.block_table for s in static.seqs] == [s.block_table for s in eager.seqs]
    return static, pairs


def verify_both(device: str, steps: int, capture: bool, cfg=CFG) -> tuple[World, list[tuple[torch.Tensor, torch.Tensor]]]:
    """As `decode_both`, each step a verify: every row brings 0..γ random drafts (0: a decode beside the
    verifies) and keeps a random prefix of them."""
    dtype = torch.float16 if device == "cuda" else torch.float32
    model = LlamaModel(cfg, random_weights(cfg, group_size=32), torch.device(device), dtype)
    static, eager = World(model, graphs=True, capture=capture), World(model, graphs=False, capture=False)
    for seq in static.seqs + eager.seqs:   # each prompt's first generated token, pending
        seq.output_ids.append(1)
    g = torch.Generator().manual_seed(2)
    pairs = []
    for t in range(steps):
        rows = BATCHES[t % len(BATCHES)]
        counts = torch.randint(0, GAMMA + 1, (len(rows),), generator=g).tolist()
        drafts = [torch.randint(0, CFG.vocab_size, (k,), generator=g).tolist() for k in counts]
        accepted = [int(torch.randint(0, k + 1, (1,), generator=g)) for k in counts]
        pairs += zip(static.verify(rows, drafts, accepted), eager.verify(rows, drafts, accepted))
    assert [s.token_ids for s in static.seqs] == [s.token_ids for s in eager.seqs]
    assert [s.block_table for s in static.seqs] == [s.block_table for s in eager.seqs]
    # the graphs took verifies whose rows crossed a window block (two runs of one sequence)
    assert any(n == 2 for runs in static.graph_steps for n in runs), static.graph_steps
    assert len(static.graph_steps) >= steps // 2, f"{len(static.graph_steps)} of {steps} verify steps ran in a graph"
    return static, pairs


def check(static: World, pairs: list[tuple[torch.Tensor, torch.Tensor]], atol: float) -> None:
    assert any(e < 0 for s in static.seqs for e in s.block_table), "no block ever left the window"
    for a, b in pairs:
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, atol=atol, rtol=0)


TRITON = [pytest.mark.slow, pytest.mark.skipif(not triton_ops.available(), reason="triton not importable")]
STEPS = {"decode": decode_both, "verify": verify_both}


@pytest.mark.parametrize("step,kernels,steps", [
    ("decode", "reference", 60), ("verify", "reference", 40),
    # 1-2 min each in the interpreter (the verify crosses a window block at its 19th step); the gpu test
    # below runs the same through the compiled kernels
    pytest.param("decode", "triton", 30, marks=TRITON), pytest.param("verify", "triton", 20, marks=TRITON)])
def test_static_step_equals_eager_step(step, kernels, steps, monkeypatch):
    monkeypatch.setenv("BIE_TRT_KERNELS", kernels)
    static, pairs = STEPS[step]("cpu", steps, capture=False)
    check(static, pairs, atol=1e-5)


@pytest.mark.parametrize("step,steps,device", [
    ("decode", 6, "cpu"), pytest.param("verify", 40, "cpu", marks=pytest.mark.slow),
    pytest.param("decode", 60, "cuda", marks=pytest.mark.gpu), pytest.param("verify", 40, "cuda", marks=pytest.mark.gpu)])
def test_a_hybrid_models_static_step_equals_eager_step(step, steps, device, monkeypatch):
    """The sliding layers through their own slot row and tables (blocks below the window given back, PAD in
    their place) in the static step as in the eager forward."""
    if device == "cpu":
        monkeypatch.setenv("BIE_TRT_KERNELS", "reference")
    static, pairs = STEPS[step](device, steps, capture=device == "cuda", cfg=HYBRID)
    assert any(s.sliding_first > 0 for s in static.seqs), "no sliding block was given back"
    for a, b in pairs:
        torch.testing.assert_close(a, b, atol=1e-5 if device == "cpu" else 5e-3, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("step,steps", [("decode", 60), ("verify", 40)])
def test_cuda_graph_step_equals_eager_step(step, steps):
    static, pairs = STEPS[step]("cuda", steps, capture=True)
    # fp16: batched rows take the tensor-core W4 path, single rows the GEMV, so sums differ in order;
    # 5e-3 is 3% of these logits' spread (std 0.16), where a stale table or slot moves them by more
    check(static, pairs, atol=5e-3)


def draft_both(device: str, steps: int, capture: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A draft's decode (`DraftModelProposer`): an FP16 cache whose slots hold tokens of later original
    positions (a RoPE offset per sequence, growing as the window slides), hidden states out (its heads
    follow), through the graphs and through `final_hidden`, in two copies of one cache."""
    dtype = torch.float16 if device == "cuda" else torch.float32
    model = LlamaModel(CFG, random_weights(CFG, group_size=32), torch.device(device), dtype)
    kv = KVCacheConfig(dtype="fp16")
    pools = [allocate_pools(CFG, kv, 8, 0, dtype, model.device, scratch_block=True) for _ in range(2)]
    graphs = DecodeGraphs(model, pools[0], [4, 2], 64, pools[0].scratch_block, capture=capture, head=False)
    tables = [[0, 1, 2, 3], [4, 5, 6, 7]]
    g = torch.Generator().manual_seed(3)
    for p in pools:
        p.k.copy_(torch.randn(p.k.shape, generator=g) * 0.1)   # the same cache in both (one seed, drawn twice)
        p.v.copy_(torch.randn(p.v.shape, generator=g) * 0.1)
        g.manual_seed(3)
    pairs = []
    for t in range(steps):
        rows = ([0, 1], [1], [1, 0])[t % 3]   # graphs of 2 and 1 (padded) rows, rows reassigned
        ids = torch.randint(0, CFG.vocab_size, (len(rows),), generator=g)
        inputs = [SeqInput(ids[i:i + 1], 20 + t, tables[r], rope_offset=100 * r + 7 * t) for i, r in enumerate(rows)]
        pairs += zip(graphs.run(inputs), model.final_hidden(inputs, pools[1]))
    return pairs


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_static_draft_decode_equals_final_hidden(device):
    pairs = draft_both(device, 12, capture=device == "cuda")
    # hidden states, the residual stream (|h| up to ~150 here): padded batches sum in another order, which
    # moves fp32 by ~1e-6 of the largest value (a position off by its RoPE offset moves it by 1)
    tol = 1e-5 if device == "cpu" else 2e-3
    for a, b in pairs:
        assert torch.isfinite(a).all()
        assert (a - b).abs().max() <= tol * b.abs().max()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_verify_needing_the_extra_query_tile_hits_its_bucket(device, monkeypatch):
    """A full bucket (2 sequences at γ+1 = 4 rows) where one sequence's rows cross a window block: its two
    runs take a query tile each, one more than ceil(rows / TILE_ROWS) a sequence, and the step still
    replays its bucket (the static step, eager on the CPU), with the eager forward's logits; a step no
    bucket holds is counted as an eager fallback, a prefill chunk as neither."""
    if device == "cpu":
        monkeypatch.setenv("BIE_TRT_KERNELS", "reference")
    dtype = torch.float16 if device == "cuda" else torch.float32
    cfg = tiny_llama(num_layers=1)
    model = LlamaModel(cfg, random_weights(cfg, group_size=32), torch.device(device), dtype)
    pools = [allocate_pools(cfg, KVCacheConfig(dtype="fp16"), 8, 0, dtype, model.device, scratch_block=True)
             for _ in range(2)]
    # captured first: a capture's warm-up step writes its padding rows' K/V into the pool
    graphs = DecodeGraphs(model, pools[0], [2], 64, pools[0].scratch_block, capture=device == "cuda",
                          verify_rows=[GAMMA + 1])
    g = torch.Generator()
    for p in pools:   # the same cache in both (one seed, drawn twice)
        g.manual_seed(4)
        p.k.copy_(torch.randn(p.k.shape, generator=g) * 0.1)
        p.v.copy_(torch.randn(p.v.shape, generator=g) * 0.1)
    ids = torch.randint(0, cfg.vocab_size, (GAMMA + 1,), generator=g)
    # sequence A's rows at positions 30..33 in two runs, cut at a block's end as a window block leaving
    # mid-verify cuts them (each run an input of its own), sequence B's four rows in one
    step = [SeqInput(ids[:2], 30, [0, 1, 2], all_logits=True), SeqInput(ids[2:], 32, [0, 1, 2], all_logits=True),
            SeqInput(ids, 40, [3, 4, 5], all_logits=True)]
    assert len(StepTiles.layout([2, 2, 4])) == 3 > 2 * -(-(GAMMA + 1) // TILE_ROWS)
    got = graphs.run(step)
    assert got is not None, "the verify fell out of its bucket"
    assert graphs.counts["verify"] == {"graph": 1, "eager": 0}
    for a, b in zip(got, model.forward(step, pools[1])):   # (fp16 on CUDA: as the graph test's tolerance)
        torch.testing.assert_close(a, b, atol=1e-5 if device == "cpu" else 5e-3, rtol=0)
    too_many = [SeqInput(ids, 4 * i, [6], all_logits=True) for i in range(3)]   # 3 sequences, buckets of 2
    assert graphs.run(too_many) is None and graphs.counts["verify"] == {"graph": 1, "eager": 1}
    assert graphs.run([SeqInput(ids[:1], 5, [6])], quantise=True) is None   # a decode that quantises mid-step
    assert graphs.run([SeqInput(torch.cat([ids, ids]), 0, [6])]) is None     # a prefill chunk: no graph is for it
    assert graphs.counts == {"decode": {"graph": 0, "eager": 1}, "verify": {"graph": 1, "eager": 1}}
