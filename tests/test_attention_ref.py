"""Paged mixed-precision attention reference against dense softmax attention."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bie_trt.config import KVCacheConfig, ModelConfig
from bie_trt.kernels.attention_ref import DensePrefills, dense_attention_ref, paged_attention_ref, paged_prefills_dense
from bie_trt.kv.pool import KVPools, allocate_pools, encode_quant_block
from bie_trt.kv.quant import dequantize_block, quantize_block
from bie_trt.kv.rotation import rotate

LAYERS, HQ, HKV, D = 2, 6, 2, 64  # GQA: 3 query heads per kv head
SCALE = D**-0.5


def model_config() -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM", hidden_size=HQ * D, intermediate_size=4 * HQ * D,
        num_layers=LAYERS, num_heads=HQ, num_kv_heads=HKV, head_dim=D, vocab_size=256,
        rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=4096, tie_word_embeddings=False,
    )


def random_kv(seq_len: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V [L, S, H_kv, D]; keys get an outlier channel so INT4 error is not negligible."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(LAYERS, seq_len, HKV, D, generator=g)
    k[..., 5] *= 20.0
    return k, torch.randn(LAYERS, seq_len, HKV, D, generator=g)


def poisoned_pools(kv: KVCacheConfig, fp_blocks: int, quant_blocks: int) -> KVPools:
    """Pools whose every byte is NaN until written, so any read of a slot the sequence does not own shows up."""
    pools = allocate_pools(model_config(), kv, fp_blocks, quant_blocks, dtype=torch.float32)
    pools.k.fill_(torch.nan)
    pools.v.fill_(torch.nan)
    for name, t in pools.tensors().items():
        if name not in ("k", "v"):
            t.view(torch.uint8).fill_(0x7F)  # NaN as fp8 e4m3 and, in pairs, as fp16 scale/zero
    return pools


def write_block(pools: KVPools, fp_block: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """Tokens k, v [L, n, H_kv, D] into the first n slots of FP16 block `fp_block` (head-major inside)."""
    n = k.shape[1]
    pools.k[:, fp_block, :, :n] = k.transpose(1, 2)
    pools.v[:, fp_block, :, :n] = v.transpose(1, 2)


def build_sequence(
    pools: KVPools, k: torch.Tensor, v: torch.Tensor, quantised: set[int], fp_ids: list[int], q_ids: list[int]
) -> list[int]:
    """Store a sequence block by block, quantising the blocks in `quantised`; returns its block table.

    Quantised blocks pass through a scratch FP16 block (the last one) that is poisoned again
    afterwards, as the runtime frees the FP16 slot once a block is quantised.
    """
    B, scratch = pools.cfg.block_size, pools.num_fp_blocks - 1
    table, fp_iter, q_iter = [], iter(fp_ids), iter(q_ids)
    for i in range(-(-k.shape[1] // B)):
        tokens = slice(i * B, (i + 1) * B)
        if i in quantised:
            write_block(pools, scratch, k[:, tokens], v[:, tokens])
            qb = next(q_iter)
            quantize_block(pools, None, scratch, qb)
            table.append(encode_quant_block(qb))
        else:
            fb = next(fp_iter)
            write_block(pools, fb, k[:, tokens], v[:, tokens])
            table.append(fb)
    pools.k[:, scratch] = torch.nan
    pools.v[:, scratch] = torch.nan
    return table


def dequantised_cache(pools: KVPools, layer: int, table: list[int], seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The sequence's K, V [S, H_kv, D] as the kernel sees them, gathered densely."""
    ks, vs = zip(*(dequantize_block(pools, layer, e) for e in table))
    k = torch.cat(ks, dim=1).transpose(0, 1)[:seq_len]
    v = torch.cat(vs, dim=1).transpose(0, 1)[:seq_len]
    return k, v


def queries(positions: list[int], seed: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(len(positions), HQ, D, generator=g).to(dtype), torch.tensor(positions)


def mixed_case(dtype: str, seq_len: int = 37) -> tuple[KVPools, list[int], torch.Tensor, torch.Tensor]:
    """FP16 sink block, quantised body, FP16 tail with a partial last block; ids scattered in both pools."""
    kv = KVCacheConfig(dtype=dtype, group_size=32, block_size=4)
    pools = poisoned_pools(kv, fp_blocks=12, quant_blocks=9)
    k, v = random_kv(seq_len, seed=11)
    num_blocks = -(-seq_len // 4)
    body = set(range(1, num_blocks - 3))
    table = build_sequence(pools, k, v, body, fp_ids=[7, 2, 9, 0, 5], q_ids=[6, 1, 8, 3, 0, 4, 7])
    assert any(e < 0 for e in table) and table[0] >= 0 and table[-1] >= 0
    return pools, table, k, v


def assert_paged_equals_dense(pools: KVPools, table: list[int], seq_len: int, positions: list[int], layer: int) -> None:
    q, pos = queries(positions, seed=len(positions) + layer)
    out = paged_attention_ref(q, pools, layer, table, pos, SCALE)
    k, v = dequantised_cache(pools, layer, table, seq_len)
    expected = dense_attention_ref(q, k, v, pos, SCALE)
    assert out.shape == (len(positions), HQ, D) and out.dtype == torch.float32
    assert torch.isfinite(out).all()
    assert (out - expected).abs().max().item() <= 1e-4


def test_int4_mixed_table_causal_chunk_matches_dense_over_dequantised_cache() -> None:
    pools, table, _, _ = mixed_case("int4_asym")
    for layer in range(LAYERS):
        assert_paged_equals_dense(pools, table, 37, positions=[32, 33, 34, 35, 36], layer=layer)


def test_fp8_mixed_table_causal_chunk_matches_dense_over_dequantised_cache() -> None:
    pools, table, _, _ = mixed_case("fp8", seq_len=29)
    for layer in range(LAYERS):
        assert_paged_equals_dense(pools, table, 29, positions=[25, 26, 27, 28], layer=layer)


def test_scattered_positions_skip_blocks_past_the_last_query() -> None:
    pools, table, _, _ = mixed_case("int4_asym")
    # The last query sits at 22 (block 5); point every later entry at a poisoned FP16 block:
    # a NaN in the output would mean a block wholly beyond the last position was read.
    table = table[:6] + [10] * (len(table) - 6)
    assert_paged_equals_dense(pools, table, 23, positions=[0, 3, 17, 22, 9], layer=1)


def test_rotated_keys_with_rotated_queries_give_the_unrotated_attention() -> None:
    # The runtime stores H-rotated keys and rotates q; the reference needs no knowledge of it.
    pools = poisoned_pools(KVCacheConfig(dtype="fp16", block_size=4), fp_blocks=8, quant_blocks=0)
    k, v = random_kv(19, seed=12)
    table = build_sequence(pools, rotate(k), v, set(), fp_ids=[3, 6, 0, 4, 1], q_ids=[])
    q, pos = queries([15, 16, 17, 18], seed=13)
    out = paged_attention_ref(rotate(q), pools, 1, table, pos, SCALE)
    expected = dense_attention_ref(q, k[1], v[1], pos, SCALE)
    assert (out - expected).abs().max().item() <= 1e-4


def test_all_fp16_table_equals_dense_attention_on_the_original_kv() -> None:
    kv = KVCacheConfig(dtype="fp16")  # the default 16-token blocks
    pools = poisoned_pools(kv, fp_blocks=6, quant_blocks=0)
    k, v = random_kv(45, seed=4)
    table = build_sequence(pools, k, v, set(), fp_ids=[4, 1, 3], q_ids=[])
    positions = [40, 41, 42, 43, 44]
    for layer in range(LAYERS):
        q, pos = queries(positions, seed=layer)
        out = paged_attention_ref(q, pools, layer, torch.tensor(table, dtype=torch.int32), pos, SCALE)
        expected = dense_attention_ref(q, k[layer], v[layer], pos, SCALE)
        assert (out - expected).abs().max().item() <= 1e-5


def test_output_keeps_the_query_dtype() -> None:
    pools = poisoned_pools(KVCacheConfig(dtype="fp16", block_size=4), fp_blocks=4, quant_blocks=0)
    k, v = random_kv(7, seed=8)
    table = build_sequence(pools, k, v, set(), fp_ids=[2, 0], q_ids=[])
    q, pos = queries([5, 6], seed=1, dtype=torch.float16)
    out = paged_attention_ref(q, pools, 0, table, pos, SCALE)
    assert out.dtype == torch.float16
    expected = dense_attention_ref(q.float(), k[0], v[0], pos, SCALE)
    torch.testing.assert_close(out.float(), expected, rtol=2e-3, atol=2e-3)


# --- the dense oracle itself ---------------------------------------------------------------

def test_dense_reference_first_token_returns_its_kv_heads_value() -> None:
    # A query at position 0 sees only token 0, so its output is v[0] of kv head h // 3.
    k, v = random_kv(5, seed=2)
    q, pos = queries([0], seed=9)
    out = dense_attention_ref(q, k[0], v[0], pos, SCALE)
    for h in range(HQ):
        assert torch.equal(out[0, h], v[0, 0, h // 3])


def test_dense_reference_matches_torch_sdpa() -> None:
    k, v = random_kv(21, seed=6)
    q, pos = queries([3, 10, 20], seed=7)
    expected = F.scaled_dot_product_attention(
        q.transpose(0, 1), k[1].transpose(0, 1).repeat_interleave(3, 0), v[1].transpose(0, 1).repeat_interleave(3, 0),
        attn_mask=torch.arange(21)[None, :] <= pos[:, None], scale=SCALE,
    ).transpose(0, 1)
    torch.testing.assert_close(dense_attention_ref(q, k[1], v[1], pos, SCALE), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tile", [2, 3, 64])
def test_multi_block_tiles_compute_the_same_attention(tile: int) -> None:
    pools, table, _, _ = mixed_case("int4_asym")
    q, pos = queries([3, 17, 36], seed=5)
    one = paged_attention_ref(q, pools, 1, table, pos, SCALE)
    tiled = paged_attention_ref(q, pools, 1, table, pos, SCALE, blocks_per_tile=tile)
    assert torch.isfinite(tiled).all() and (one - tiled).abs().max().item() <= 1e-5


# --- the CPU path: dense masked attention over tiles of a step's chunks ------------------------

def eval_like_step() -> tuple[KVPools, list[tuple[int, int, torch.Tensor]], torch.Tensor]:
    """One text cut into chunks whose tables read more blocks quantised the later they start (eval's runs:
    each block in FP16 and, once it left the window, as its quantised twin), then a second, unrelated
    sequence. The last block of each sequence is partial: its stale slots are NaN."""
    kv = KVCacheConfig(dtype="int4_asym", group_size=32, block_size=4)
    pools = poisoned_pools(kv, fp_blocks=12, quant_blocks=8)
    k, v = random_kv(30, seed=21)
    fp = build_sequence(pools, k, v, set(), fp_ids=[9, 2, 7, 0, 5, 6, 3, 8], q_ids=[])
    twins = {b: encode_quant_block(qb) for b, qb in zip(range(1, 6), [6, 1, 4, 0, 3])}
    for b, entry in twins.items():
        quantize_block(pools, None, fp[b], -entry - 1)
    k2, v2 = random_kv(7, seed=22)
    other = build_sequence(pools, k2, v2, set(), fp_ids=[10, 1], q_ids=[])
    chunks = [(0, 12, 0), (12, 8, 3), (20, 4, 4), (24, 6, 6)]   # (first position, rows, quantised end)
    prefills, positions, row = [], [], 0
    for first, n, end in chunks:
        table = [twins[b] if 1 <= b < end else e for b, e in enumerate(fp)]
        prefills.append((row, n, torch.tensor(table, dtype=torch.int32)))
        positions += range(first, first + n)
        row += n
    prefills.append((row, 7, torch.tensor(other, dtype=torch.int32)))
    positions += range(7)
    return pools, prefills, torch.tensor(positions)


@pytest.mark.parametrize("tile_rows", [8, 24, 256])
def test_dense_prefills_equal_the_paged_reference_chunk_by_chunk(tile_rows: int) -> None:
    pools, prefills, pos = eval_like_step()
    q, _ = queries(list(range(len(pos))), seed=23)
    plan = DensePrefills.build(prefills, pos, pools.cfg.block_size, tile_rows)   # once for every layer, as a step
    for layer in range(LAYERS):
        dense = paged_prefills_dense(q, pools, layer, plan, SCALE)
        for (s, n, table), out in zip(prefills, dense):
            expected = paged_attention_ref(q[s:s + n], pools, layer, table, pos[s:s + n], SCALE)
            assert out.shape == (n, HQ, D) and torch.isfinite(out).all()
            assert (out - expected).abs().max().item() <= 1e-5, (layer, s)


def test_dense_prefills_read_each_chunks_own_blocks() -> None:
    # Quantising changes the values enough to see: a chunk given a later chunk's table would show it.
    pools, prefills, pos = eval_like_step()
    q, _ = queries(list(range(len(pos))), seed=24)
    first, later = prefills[1], prefills[3]
    B = pools.cfg.block_size
    swapped = (later[0], later[1], first[2])
    mixed = paged_prefills_dense(q, pools, 0, DensePrefills.build([first, swapped], pos, B), SCALE)
    own = paged_prefills_dense(q, pools, 0, DensePrefills.build([first, later], pos, B), SCALE)
    assert (mixed[0] - own[0]).abs().max().item() <= 1e-5 and (mixed[1] - own[1]).abs().max().item() > 1e-3


@pytest.mark.parametrize("dtype", ["int4_asym", "fp16"])
def test_a_sliding_window_reads_its_window_only(dtype: str) -> None:
    """A sliding-window layer (window 9 over blocks of 4): each query sees the last 9 positions up to its own,
    as dense attention with the window does; the blocks wholly below every query's window are poisoned, so a
    read of any of them (one block too many) shows as NaN, in the paged reference and in the dense CPU path."""
    window, seq_len = 9, 37
    kv = KVCacheConfig(dtype=dtype, group_size=32, block_size=4)
    pools = poisoned_pools(kv, fp_blocks=12, quant_blocks=9)
    k, v = random_kv(seq_len, seed=31)
    quantised = set(range(1, 6)) if dtype != "fp16" else set()
    table = build_sequence(pools, k, v, quantised, fp_ids=list(range(11)), q_ids=[6, 1, 8, 3, 0, 4, 7])
    positions = [30, 31, 35, 36]
    lowest = (min(positions) - window + 1) // 4   # the first block any query's window reaches
    table[:lowest] = [10] * lowest   # a poisoned FP16 block (10 is never written)
    q, pos = queries(positions, seed=32)
    kd, vd = dequantised_cache(pools, 1, table[lowest:], seq_len - lowest * 4)
    expected = dense_attention_ref(q, kd, vd, pos - lowest * 4, SCALE, window)
    out = paged_attention_ref(q, pools, 1, table, pos, SCALE, window=window)
    assert torch.isfinite(out).all() and (out - expected).abs().max().item() <= 1e-5
    # a window of positions changes the answer: without it the query would read older positions
    assert (dense_attention_ref(q, kd, vd, pos - lowest * 4, SCALE) - expected).abs().max().item() > 1e-2
    plan = DensePrefills.build([(0, len(positions), torch.tensor(table))], pos, 4)
    (dense,) = paged_prefills_dense(q, pools, 1, plan, SCALE, window)
    assert torch.isfinite(dense).all() and (dense - expected).abs().max().item() <= 1e-5
