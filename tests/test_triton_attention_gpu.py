"""Chunked-prefill and decode attention at Llama-3-8B head shapes (32 query heads on 8 kv heads, head_dim
128), with the default tiles, against the plain-torch reference: on a GPU only. The interpreter tests the
same code at small shapes; on an H200 under Triton 3.6 the tile that the interpreter passed (64 score rows
over an INT4 body) gave wrong outputs at these shapes, so the shapes users run are checked where they run."""
from __future__ import annotations

import pytest
import torch

from bie_trt.config import KVCacheConfig
from bie_trt.kernels.attention_ref import paged_attention_ref
from bie_trt.kernels.triton_attention import paged_decode_attention, paged_decode_attention_ref, paged_prefill_attention
from bie_trt.kv.pool import allocate_pools, encode_quant_block
from bie_trt.kv.quant import quantize_block
from bie_trt.model.synthetic import llama3_8b

pytestmark = pytest.mark.gpu
START, CHUNK, B = 512, 512, 16   # a 512-token chunk after 512 tokens: FP16 sink, INT4/FP8 body, FP16 tail


@pytest.mark.parametrize("kind,variant", [("int4_asym", "v1"), ("int4_asym", "v2"), ("fp8", "v1"), ("fp16", "v1")])
def test_prefill_chunk_at_8b_shapes_matches_reference(kind: str, variant: str) -> None:
    cfg = llama3_8b()
    blocks = (START + CHUNK) // B
    pools = allocate_pools(cfg, KVCacheConfig(dtype=kind), blocks + 1, blocks, torch.float16, "cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    pools.k.normal_(generator=g)
    pools.v.normal_(generator=g)
    body = range(1, START // B) if kind != "fp16" else range(0)
    for i in body:
        quantize_block(pools, None, i, i)
    table = torch.tensor([encode_quant_block(i) if i in body else i for i in range(blocks)],
                         dtype=torch.int32, device="cuda")
    q = torch.randn(CHUNK, cfg.num_heads, cfg.head_dim, generator=g, device="cuda", dtype=torch.float16)
    positions = torch.arange(START, START + CHUNK, dtype=torch.int32, device="cuda")
    out = paged_prefill_attention(q, pools, 0, table, positions, cfg.head_dim ** -0.5, config={"variant": variant})
    ref = paged_attention_ref(q.float(), pools, 0, table, positions, cfg.head_dim ** -0.5)
    assert (out.float() - ref).abs().max().item() < 2e-2


@pytest.mark.parametrize("kind,variant", [("int4_asym", "v1"), ("int4_asym", "v2"), ("fp8", "v1"), ("fp16", "v1")])
@pytest.mark.parametrize("parts", [None, 1])
def test_decode_8k_at_8b_shapes_matches_reference(kind: str, variant: str, parts: int | None) -> None:
    """8,192 tokens, a quantised body between an FP16 sink block and the last blocks, two sequences: in the
    default partitions and in one, where a single program reads all 256 tiles, each ahead of the last."""
    cfg = llama3_8b()
    context, seqs = 8192, 2
    blocks = context // B
    pools = allocate_pools(cfg, KVCacheConfig(dtype=kind), seqs * blocks + 1, seqs * blocks, torch.float16, "cuda")
    g = torch.Generator(device="cuda").manual_seed(1)
    pools.k.normal_(generator=g)
    pools.v.normal_(generator=g)
    body = range(1, blocks - 8) if kind != "fp16" else range(0)
    rows = []
    for s in range(seqs):   # the second sequence's blocks sit after the first's, so tables differ
        row = []
        for i in range(blocks):
            block = s * blocks + i
            if i in body:
                quantize_block(pools, None, block, block)
                row.append(encode_quant_block(block))
            else:
                row.append(block)
        rows.append(row)
    table = torch.tensor(rows, dtype=torch.int32, device="cuda")
    lens = torch.tensor([context, context - 37], dtype=torch.int32, device="cuda")
    q = torch.randn(seqs, cfg.num_heads, cfg.head_dim, generator=g, device="cuda", dtype=torch.float16)
    out = paged_decode_attention(q, pools, 0, table, lens, cfg.head_dim ** -0.5, num_partitions=parts,
                                 config={"variant": variant})
    ref = paged_decode_attention_ref(q, pools, 0, table, lens, cfg.head_dim ** -0.5)
    assert (out.float() - ref.float()).abs().max().item() < 2e-2
