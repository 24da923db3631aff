"""Triton paged mixed-precision attention (decode and chunked prefill) against the plain-torch reference.

Without CUDA the kernels run under TRITON_INTERPRET=1 (set in conftest.py, before the kernel module
and so triton's jit decorator see it), at small shapes: head_dim 64, 6 query heads on 2 kv
heads (GQA 3, a group that is not a power of two), 16-token blocks.

Tolerances. With fp32 activations and pools every product and sum is fp32 in both kernel and
reference, so they differ by summation order only (about 1e-6); the bound is 2e-3, the
project's bar for kernels. With fp16 activations the kernel feeds fp16 operands to tl.dot
(dequantised K/V, the probabilities) while the reference stays fp32, and both round the output
to fp16, which alone can differ by one ulp = 2^-10 |x|: the bound is 2e-3 + 2^-10 |ref|.

Every pool slot a sequence does not own is NaN, and block tables are padded with ids that do
not exist, so any read outside a sequence's context turns its output into NaN.

Both tile loops (config variant "v1" and "v2") pass every test over a quantised pool; over an FP16
cache v2 runs v1's loop, so that case runs once.
"""
from __future__ import annotations


import pytest
import torch


from bie_trt.config import KVCacheConfig, ModelConfig  # noqa: E402
from bie_trt.kernels.attention_ref import paged_attention_ref  # noqa: E402
from bie_trt.kernels.step_inputs import StepTiles  # noqa: E402
from bie_trt.kernels.triton_attention import (  # noqa: E402
    available,
    paged_decode_attention,
    paged_decode_attention_ref,
    paged_prefill_attention,
    paged_tile_attention,
    paged_tile_attention_ref,
)
from bie_trt.kv.pool import KVPools, allocate_pools, encode_quant_block  # noqa: E402
from bie_trt.kv.quant import quantize_block  # noqa: E402

pytestmark = pytest.mark.skipif(not available(), reason="triton is not importable (or no CUDA and no interpreter)")

LAYERS, HQ, HKV, D, B = 2, 6, 2, 64, 16
SCALE = D**-0.5
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (kv dtype, INT4 group size): each quantised format, INT4 at two group sizes.
KINDS = [("fp16", 64), ("int4_asym", 32), ("int4_asym", 64), ("fp8", 64)]
KIND_IDS = ["fp16", "int4-g32", "int4-g64", "fp8"]
VARIANT_KINDS = [pytest.param(variant, kind, id=f"{variant}-{kid}") for variant in ("v1", "v2")
                 for kind, kid in zip(KINDS, KIND_IDS) if variant == "v1" or kind[0] != "fp16"]
VARIANTS = ["v1", "v2"]
FP_BLOCKS, Q_BLOCKS = 20, 12
TABLE_WIDTH = 7  # wider than any sequence here: the tail of every row is padding


def model_config() -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM", hidden_size=HQ * D, intermediate_size=4 * HQ * D,
        num_layers=LAYERS, num_heads=HQ, num_kv_heads=HKV, head_dim=D, vocab_size=256,
        rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=4096, tie_word_embeddings=False,
    )


def poisoned_pools(dtype: str, group: int, act: torch.dtype) -> KVPools:
    """Pools that are NaN everywhere until written (fp8 and fp16 scale/zero bytes 0x7F are NaN too)."""
    pools = allocate_pools(model_config(), KVCacheConfig(dtype=dtype, group_size=group), FP_BLOCKS, Q_BLOCKS,
                           dtype=act, device=DEVICE)
    pools.k.fill_(torch.nan)
    pools.v.fill_(torch.nan)
    for name, t in pools.tensors().items():
        if name not in ("k", "v"):
            t.view(torch.uint8).fill_(0x7F)
    return pools


class Cache:
    """Hands out scattered block ids and stores sequences into poisoned pools, block by block."""

    def __init__(self, pools: KVPools, seed: int) -> None:
        self.pools = pools
        self.gen = torch.Generator().manual_seed(seed)
        self.scratch = FP_BLOCKS - 1  # quantised blocks pass through it, and it is poisoned again after
        self.fp_free = torch.randperm(FP_BLOCKS - 1, generator=self.gen).tolist()
        self.q_free = torch.randperm(Q_BLOCKS, generator=self.gen).tolist()

    def sequence(self, length: int, quantised: set[int], v_std: float = 1.0) -> list[int]:
        """A random sequence of `length` tokens; the blocks in `quantised` go to the quantised pool."""
        pools = self.pools
        k = torch.randn(LAYERS, HKV, length, D, generator=self.gen)
        k[..., 7] *= 20.0  # an outlier channel, as real keys have, so INT4 error is not negligible
        v = torch.randn(LAYERS, HKV, length, D, generator=self.gen) * v_std
        k, v = k.to(pools.k.device, pools.k.dtype), v.to(pools.v.device, pools.v.dtype)
        table = []
        for i in range(-(-length // B)):
            n = min(B, length - i * B)
            quant = i in quantised and pools.k_q is not None
            target = self.scratch if quant else self.fp_free.pop()
            pools.k[:, target, :, :n] = k[:, :, i * B:i * B + n]
            pools.v[:, target, :, :n] = v[:, :, i * B:i * B + n]
            if quant:
                assert n == B, "only whole blocks are quantised"
                qb = self.q_free.pop()
                quantize_block(pools, None, self.scratch, qb)
                pools.k[:, self.scratch] = torch.nan
                pools.v[:, self.scratch] = torch.nan
                table.append(encode_quant_block(qb))
            else:
                table.append(target)
        return table


def padded(tables: list[list[int]]) -> torch.Tensor:
    """[S, TABLE_WIDTH] int32; padding alternates between ids past either pool's end, positive and negative."""
    pad = [10_000, encode_quant_block(10_000)]
    rows = [t + [pad[(i + j) % 2] for j in range(TABLE_WIDTH - len(t))] for i, t in enumerate(tables)]
    return torch.tensor(rows, dtype=torch.int32, device=DEVICE)


def decode_batch(dtype: str, group: int, act: torch.dtype = torch.float32, seed: int = 0
                 ) -> tuple[KVPools, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pools, block tables, lengths, q) of three sequences: FP16 sink + quantised body + partial FP16
    tail (45 tokens), a single token (1), and a longer one with a three-block quantised body (70 = 4·16 + 6).
    With an fp16 cache every block is FP16."""
    pools = poisoned_pools(dtype, group, act)
    cache = Cache(pools, seed)
    lengths = [45, 1, 70]
    tables = [cache.sequence(45, {1}), cache.sequence(1, set()), cache.sequence(70, {1, 2, 3})]
    lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(lengths), HQ, D, generator=torch.Generator().manual_seed(seed + 1)).to(DEVICE, act)
    return pools, padded(tables), lens, q


def assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert torch.isfinite(out).all(), "NaN/inf: the kernel read a slot outside the sequence"
    diff = (out.float() - ref.float()).abs()
    bound = 2e-3 + (2.0**-10 * ref.float().abs() if out.dtype == torch.float16 else 0.0)
    assert (diff <= bound).all(), f"max |Δ| {diff.max().item():.3g}"


@pytest.mark.parametrize("variant,kind", VARIANT_KINDS)
@pytest.mark.parametrize("parts", [1, 2, pytest.param(3, marks=pytest.mark.slow)])
def test_decode_matches_reference(variant: str, kind: tuple[str, int], parts: int) -> None:
    pools, tables, lens, q = decode_batch(*kind)
    for layer in range(LAYERS):
        out = paged_decode_attention(q, pools, layer, tables, lens, SCALE, num_partitions=parts,
                                     config={"variant": variant})
        assert_close(out, paged_decode_attention_ref(q, pools, layer, tables, lens, SCALE))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("kind", [("int4_asym", 32), ("fp8", 64)], ids=["int4-g32", "fp8"])
def test_decode_fp16_activations(variant: str, kind: tuple[str, int]) -> None:
    pools, tables, lens, q = decode_batch(*kind, act=torch.float16, seed=3)
    out = paged_decode_attention(q, pools, 1, tables, lens, SCALE, num_partitions=2, config={"variant": variant})
    assert out.dtype == torch.float16
    assert_close(out, paged_decode_attention_ref(q, pools, 1, tables, lens, SCALE))


@pytest.mark.parametrize("kind", [("int4_asym", 32), ("fp8", 64)], ids=["int4-g32", "fp8"])
def test_v2_small_values_keep_fp16_precision(kind: tuple[str, int]) -> None:
    """Values of std 1e-3 (scales ~1e-4) over a 181-token context whose probabilities span decades:
    v2 multiplies P by the scales before its fp16 product, and unless it rescales, p · scale falls into
    fp16's subnormals and rounds to 0. v2 must stay within twice v1's error (v1 rounds only P to fp16), or half an fp16 ulp of the output."""
    pools = poisoned_pools(*kind, torch.float16)
    table = Cache(pools, seed=11).sequence(181, set(range(1, 11)), v_std=1e-3)
    tables = torch.tensor([table], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([181], dtype=torch.int32, device=DEVICE)
    q = torch.randn(1, HQ, D, generator=torch.Generator().manual_seed(12)).to(DEVICE, torch.float16)
    ref = paged_decode_attention_ref(q, pools, 0, tables, lens, SCALE).float()
    err = {variant: (paged_decode_attention(q, pools, 0, tables, lens, SCALE, num_partitions=1,
                                            config={"variant": variant}).float() - ref).abs().max().item()
           for variant in VARIANTS}
    assert err["v2"] <= max(2 * err["v1"], 2.0**-11 * ref.abs().max().item()), err


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("kind", [("int4_asym", 32), ("fp8", 64)], ids=["int4-g32", "fp8"])
@pytest.mark.parametrize("parts", [1, 2])
def test_decode_many_quantised_tiles_a_partition(variant: str, kind: tuple[str, int], parts: int) -> None:
    """181 tokens, nine quantised blocks between an FP16 sink and tail and one FP16 block among them: six
    tiles, every one after the first read ahead (v1 carries a tile's codes and records for two iterations,
    its table entries for three), each with its own scales; a tile that took another's record, the wrong
    tile's codes, or another tile's view of which rows are FP16, moves the output far past the bound."""
    pools = poisoned_pools(*kind, torch.float32)
    table = Cache(pools, seed=21).sequence(181, set(range(1, 11)) - {4})
    tables = torch.tensor([table], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([181], dtype=torch.int32, device=DEVICE)
    q = torch.randn(1, HQ, D, generator=torch.Generator().manual_seed(22)).to(DEVICE)
    for layer in range(LAYERS):
        out = paged_decode_attention(q, pools, layer, tables, lens, SCALE, num_partitions=parts,
                                     config={"variant": variant})
        assert_close(out, paged_decode_attention_ref(q, pools, layer, tables, lens, SCALE))


@pytest.mark.parametrize("variant", VARIANTS)
def test_decode_more_partitions_than_tiles_and_empty_slot(variant: str) -> None:
    """Most partitions hold no tile; a length-0 slot (CUDA-graph padding) yields zeros and no NaN."""
    pools, tables, lens, q = decode_batch("int4_asym", 64, seed=5)
    lens[1] = 0
    out = paged_decode_attention(q, pools, 0, tables, lens, SCALE, num_partitions=8,
                                 config={"tile_blocks": 1, "variant": variant})
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert_close(out, paged_decode_attention_ref(q, pools, 0, tables, lens, SCALE))


@pytest.mark.parametrize("variant", VARIANTS)
def test_decode_default_config_and_tile_sizes(variant: str) -> None:
    pools, tables, lens, q = decode_batch("int4_asym", 64, seed=7)
    ref = paged_decode_attention_ref(q, pools, 1, tables, lens, SCALE)
    assert_close(paged_decode_attention(q, pools, 1, tables, lens, SCALE, config={"variant": variant}), ref)
    assert_close(paged_decode_attention(q, pools, 1, tables, lens, SCALE, num_partitions=2,
                                        config={"tile_blocks": 4, "num_warps": 2, "variant": variant}), ref)


# (first position, chunk length, config): a chunk ending a 40-token context (FP16 sink, quantised
# body, FP16 tail holding the chunk), a first chunk at position 0, and a long chunk with a query
# tile (46..49) straddling a block boundary, so the one-tile partition of tokens 48.. lies wholly
# past that tile's early queries: they see nothing there (the online softmax's -inf guard).
PREFILL_CASES = {
    "chunk-at-end": (35, 5, {"block_m": 2, "num_partitions": 2}),
    "chunk-at-start": (0, 5, {"block_m": 2, "num_partitions": 2}),
    "long-chunk": (38, 20, {"block_m": 4, "num_partitions": 4, "tile_blocks": 1}),
}


@pytest.mark.parametrize("variant,kind", VARIANT_KINDS)
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c == "long-chunk" else c
                                  for c in PREFILL_CASES])
def test_prefill_matches_reference(variant: str, kind: tuple[str, int], case: str) -> None:
    start, n, config = PREFILL_CASES[case]
    pools = poisoned_pools(*kind, torch.float32)
    cache = Cache(pools, seed=11)
    # The chunk itself is in the FP16 tail: only whole blocks after the sink and before it are quantised.
    quantised = {i for i in range(1, start // B)}
    table = padded([cache.sequence(start + n, quantised)])[0]
    q = torch.randn(n, HQ, D, generator=torch.Generator().manual_seed(12)).to(DEVICE)
    positions = torch.arange(start, start + n, dtype=torch.int32, device=DEVICE)
    out = paged_prefill_attention(q, pools, 1, table, positions, SCALE, config={**config, "variant": variant})
    assert_close(out, paged_attention_ref(q, pools, 1, table, positions, SCALE))


@pytest.mark.parametrize("variant", VARIANTS)
def test_prefill_fp16_speculative_verify(variant: str) -> None:
    """Speculative verification: a few queries (γ+1 = 4) over a mixed cache, fp16, default tiles."""
    pools = poisoned_pools("int4_asym", 64, torch.float16)
    cache = Cache(pools, seed=13)
    table = padded([cache.sequence(52, {1, 2})])[0]
    q = torch.randn(4, HQ, D, generator=torch.Generator().manual_seed(14)).to(DEVICE, torch.float16)
    positions = torch.arange(48, 52, dtype=torch.int32, device=DEVICE)
    out = paged_prefill_attention(q, pools, 0, table, positions, SCALE, config={"variant": variant})
    assert_close(out, paged_attention_ref(q, pools, 0, table, positions, SCALE))


def verify_step(dtype: str, group: int, act: torch.dtype = torch.float32, seed: int = 19
                ) -> tuple[KVPools, list[tuple[list[int], list[int]]], torch.Tensor]:
    """A tiled step's (table, positions) inputs and q: a verify of 6 rows (34..39) of a 40-token sequence
    crossing a window block, so rows 34, 35 read block 1 in FP16 and rows 36.. read its quantised twin
    (two views of one cache); a decode row beside it; and a 10-row verify, more than one query tile."""
    pools = poisoned_pools(dtype, group, act)
    cache = Cache(pools, seed)
    crossing = cache.sequence(40, set())
    twin = list(crossing)
    if pools.k_q is not None:
        qb = cache.q_free.pop()
        quantize_block(pools, None, crossing[1], qb)
        twin[1] = encode_quant_block(qb)
    decode, long_verify = cache.sequence(21, {0}), cache.sequence(40, {1})
    inputs = [(crossing, list(range(34, 36))), (twin, list(range(36, 40))), (decode, [20]),
              (long_verify, list(range(30, 40)))]
    rows = sum(len(p) for _, p in inputs)
    q = torch.randn(rows, HQ, D, generator=torch.Generator().manual_seed(seed + 1)).to(DEVICE, act)
    return pools, inputs, q


def tiled(inputs: list[tuple[list[int], list[int]]], pad_tiles: int = 0) -> tuple[torch.Tensor, ...]:
    """(tiles, tables, positions) of `inputs` as `StepMetadata.build` lays them out, with `pad_tiles` empty
    tiles after them (a CUDA graph's padding)."""
    layout = StepTiles.layout([len(p) for _, p in inputs]) + [(0, 0, 0)] * pad_tiles
    tiles = torch.tensor(layout, dtype=torch.int32, device=DEVICE)
    positions = torch.tensor([p for _, pos in inputs for p in pos], dtype=torch.int32, device=DEVICE)
    return tiles, padded([t for t, _ in inputs]), positions


def per_input_ref(q: torch.Tensor, pools: KVPools, layer: int, inputs: list[tuple[list[int], list[int]]]) -> torch.Tensor:
    """The oracle: each input's rows through `paged_attention_ref` over its own table."""
    out, row = [], 0
    for table, pos in inputs:
        positions = torch.tensor(pos, device=DEVICE)
        out.append(paged_attention_ref(q[row:row + len(pos)], pools, layer, table, positions, SCALE))
        row += len(pos)
    return torch.cat(out)


@pytest.mark.parametrize("variant,kind", [p if p.id in ("v1-fp16", "v1-int4-g32", "v2-int4-g32", "v2-fp8")
                                          else pytest.param(*p.values, id=p.id, marks=pytest.mark.slow)
                                          for p in VARIANT_KINDS])
def test_tiled_verify_matches_reference(variant: str, kind: tuple[str, int]) -> None:
    """One launch for every row of every sequence, each row through its own input's view: the crossing
    verify's two views differ in block 1's precision, so a row reading the other view is off."""
    pools, inputs, q = verify_step(*kind)
    tiles, tables, positions = tiled(inputs, pad_tiles=2)
    want = per_input_ref(q, pools, 1, inputs)
    out = paged_tile_attention(q, pools, 1, tiles, tables, positions, SCALE, 8,
                               config={"variant": variant, "num_partitions": 2})
    assert_close(out, want)
    assert_close(paged_tile_attention_ref(q, pools, 1, tiles, tables, positions, SCALE), want)


def test_tiled_verify_fp16_default_config() -> None:
    pools, inputs, q = verify_step("int4_asym", 32, act=torch.float16, seed=23)
    tiles, tables, positions = tiled(inputs)
    out = paged_tile_attention(q, pools, 0, tiles, tables, positions, SCALE, 8)
    assert_close(out, per_input_ref(q, pools, 0, inputs))


def test_rejects_bad_inputs() -> None:
    pools, tables, lens, q = decode_batch("fp16", 64)
    with pytest.raises(TypeError, match="int32"):
        paged_decode_attention(q, pools, 0, tables.long(), lens, SCALE)
    with pytest.raises(ValueError, match="unknown"):
        paged_decode_attention(q, pools, 0, tables, lens, SCALE, config={"BLOCK": 64})
    with pytest.raises(ValueError, match="variant 'v3'"):
        paged_decode_attention(q, pools, 0, tables, lens, SCALE, config={"variant": "v3"})
    with pytest.raises(ValueError, match="does not fit"):
        paged_decode_attention(q[:, :5], pools, 0, tables, lens, SCALE)


def test_engine_switch_picks_the_variant(monkeypatch: pytest.MonkeyPatch) -> None:
    """BIE_TRT_ATTENTION reaches the kernel the model calls through ops: v2 there is bit for bit the
    v2 kernel (which sums in another order than v1, so the two differ in the last bits)."""
    from bie_trt.kernels import ops

    pools, tables, lens, q = decode_batch("int4_asym", 32, seed=17)
    direct = {v: paged_decode_attention(q, pools, 0, tables, lens, SCALE, config={"variant": v}) for v in VARIANTS}
    assert not torch.equal(direct["v1"], direct["v2"])
    monkeypatch.setenv("BIE_TRT_KERNELS", "triton")
    for variant in VARIANTS:
        monkeypatch.setenv("BIE_TRT_ATTENTION", variant)
        assert torch.equal(ops.paged_decode_attention(q, pools, 0, tables, lens, SCALE), direct[variant])
    monkeypatch.setenv("BIE_TRT_ATTENTION", "v3")
    with pytest.raises(ValueError, match="variant 'v3'"):
        ops.paged_decode_attention(q, pools, 0, tables, lens, SCALE)


@pytest.mark.parametrize("variant,kind", [p if p.id == "v1-fp16" else pytest.param(*p.values, id=p.id, marks=pytest.mark.slow)
                                          for p in VARIANT_KINDS if p.id in ("v1-fp16", "v2-int4-g32")])
def test_a_sliding_window_skips_the_blocks_below_it(variant: str, kind: tuple[str, int]) -> None:
    """Decode, a prefill chunk and a tiled verify of a sliding-window layer (window 20): each query reads the
    last 20 positions up to its own, as the reference does; the blocks wholly below every query's window point
    at a poisoned block, so a read of one of them shows as NaN. One tile of one block, so the first tile
    read holds positions below the window too (masked, not loaded)."""
    window = 20
    pools = poisoned_pools(*kind, torch.float32)
    cache = Cache(pools, seed=21)
    table = cache.sequence(70, {1, 2} if kind[0] != "fp16" else set())
    config = {"variant": variant, "tile_blocks": 2, "num_partitions": 2, "block_m": 2}
    q = torch.randn(5, HQ, D, generator=torch.Generator().manual_seed(22)).to(DEVICE)
    positions = torch.arange(65, 70, dtype=torch.int32, device=DEVICE)
    below = (65 - window + 1) // B
    table[:below] = [cache.scratch] * below
    t = padded([table])
    ref = paged_attention_ref(q, pools, 1, t[0], positions, SCALE, window=window)
    assert torch.isfinite(ref).all()
    assert_close(paged_prefill_attention(q, pools, 1, t[0], positions, SCALE, config=config, window=window), ref)
    lens = torch.tensor([70], dtype=torch.int32, device=DEVICE)
    assert_close(paged_decode_attention(q[-1:], pools, 1, t, lens, SCALE, config=config, window=window), ref[-1:])
    tiles = torch.tensor(StepTiles.layout([5], 2), dtype=torch.int32, device=DEVICE)
    assert_close(paged_tile_attention(q, pools, 1, tiles, t, positions, SCALE, 2, config=config, window=window), ref)


@pytest.mark.parametrize("variant,kind,act", [pytest.param("v1", ("fp16", 64), torch.float32, id="v1-fp16"),
                                              pytest.param("v1", ("int4_asym", 32), torch.float32, id="v1-int4-g32"),
                                              pytest.param("v2", ("int4_asym", 32), torch.float32, id="v2-int4-g32"),
                                              pytest.param("v1", ("int4_asym", 32), torch.float16,
                                                           id="v1-int4-g32-fp16-activations")])
def test_centred_keys_get_their_offset_back_as_the_reference_adds_it(variant: str, kind: tuple[str, int],
                                                                     act: torch.dtype) -> None:
    """With centred keys every score gets q·R(p)m back (key_offset.py): decode and a prefill chunk, each row
    with its own coefficients, against the reference; the offset moves the output well past the tolerance, so
    a kernel that drops it, or turns it to another position, fails. With fp16 activations the kernel's
    coefficients go into fp16 products in two parts; coefficients of 300 (what a large offset gives) must still
    come back to the reference's fp32 sum."""
    from bie_trt.kernels.key_offset import KeyOffset
    from bie_trt.kernels.rope import inverse_frequencies

    inv = inverse_frequencies(model_config()).to(DEVICE)
    pools, tables, lens, q = decode_batch(*kind, act=act, seed=5)
    g = torch.Generator().manual_seed(6)
    size = 3 if act == torch.float32 else 300
    offset = KeyOffset((size * torch.randn(q.shape, generator=g)).to(DEVICE), inv)
    out = paged_decode_attention(q, pools, 1, tables, lens, SCALE, num_partitions=2, config={"variant": variant},
                                 offset=offset)
    ref = paged_decode_attention_ref(q, pools, 1, tables, lens, SCALE, offset=offset)
    assert_close(out, ref)
    assert (ref - paged_decode_attention_ref(q, pools, 1, tables, lens, SCALE)).abs().max() > 0.1

    table, n = tables[2], 6   # the last 6 tokens of the 70-token sequence as a chunk
    positions = torch.arange(70 - n, 70, dtype=torch.int32, device=DEVICE)
    qc = torch.randn(n, HQ, D, generator=g).to(DEVICE, act)
    chunk = KeyOffset((3 * torch.randn(qc.shape, generator=g)).to(DEVICE), inv)
    out = paged_prefill_attention(qc, pools, 0, table, positions, SCALE,
                                  config={"block_m": 2, "num_partitions": 2, "variant": variant}, offset=chunk)
    assert_close(out, paged_attention_ref(qc, pools, 0, table, positions, SCALE, offset=chunk))
