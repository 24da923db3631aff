"""The quantised pool's packed layout: each (block, head) is one run of bytes, its codes then its
scale/zero record, and k_q / k_scale / k_zero are views into it. Expected bytes are assembled here
from the quantisers' outputs, independently of `pack_views`."""
from __future__ import annotations

import pytest
import torch

from bie_trt.config import KVCacheConfig, ModelConfig
from bie_trt.kv.pool import KVPools, allocate_pools
from bie_trt.kv.quant import quantize_block, quantize_fp8, quantize_int4_asym

L, H, B, D = 2, 2, 4, 64


def pools_of(dtype: str, group: int = 32) -> KVPools:
    model = ModelConfig(
        architecture="LlamaForCausalLM", hidden_size=4 * D, intermediate_size=8 * D, num_layers=L, num_heads=4,
        num_kv_heads=H, head_dim=D, vocab_size=256, rms_norm_eps=1e-5, rope_theta=10000.0,
        max_position_embeddings=4096, tie_word_embeddings=False)
    kv = KVCacheConfig(dtype=dtype, group_size=group, block_size=B)
    pools = allocate_pools(model, kv, num_fp_blocks=2, num_quant_blocks=3, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    pools.k.copy_(torch.randn(pools.k.shape, generator=g) * 3)
    pools.v.copy_(torch.randn(pools.v.shape, generator=g))
    return pools


def expected_run(x: torch.Tensor, kv: KVCacheConfig) -> torch.Tensor:
    """The bytes one (block, head) [B, D] quantises to: codes row by row, then per token its
    (scale, zero) pairs group by group (INT4) or its scale (FP8)."""
    if kv.dtype == "int4_asym":
        packed, scale, zero = quantize_int4_asym(x, kv.group_size)
        record = torch.stack([scale, zero], dim=-1)
    else:
        packed, record = quantize_fp8(x)
    return torch.cat([packed.reshape(-1).view(torch.uint8), record.reshape(-1).view(torch.uint8)])


@pytest.mark.parametrize("dtype,group", [("int4_asym", 32), ("int4_asym", 64), ("fp8", 64)])
def test_each_block_head_is_its_codes_then_its_record(dtype: str, group: int) -> None:
    pools = pools_of(dtype, group)
    quantize_block(pools, None, fp_block=1, q_block=2)
    for side in ("k", "v"):
        pack = getattr(pools, f"{side}_pack")
        for layer in range(L):
            for head in range(H):
                want = expected_run(getattr(pools, side)[layer, 1, head], pools.cfg)
                assert torch.equal(pack[layer, 2, head], want), f"{side} layer {layer} head {head}"
        assert not pack[:, [0, 1]].any(), "other blocks must stay untouched"


def test_int4_views_alias_the_pack_bytes() -> None:
    pools = pools_of("int4_asym", 32)
    layer, block, head, token, group = 1, 2, 1, 3, 1
    pools.k_scale[layer, block, head, token, group] = 1.5
    pools.k_zero[layer, block, head, token, group] = -2.0
    pools.k_q[layer, block, head, token, 5] = 0xA7
    run = pools.k_pack[layer, block, head]
    record = B * D // 2 + (token * (D // 32) + group) * 4   # 2 groups a token, 4 bytes a (scale, zero) pair
    assert torch.equal(run[record:record + 4].view(torch.float16), torch.tensor([1.5, -2.0], dtype=torch.float16))
    assert run[token * D // 2 + 5] == 0xA7
    # nothing else was written: the code byte and the record's nonzero bytes (1.5 = 0x3E00, -2 = 0xC000)
    assert int(run.count_nonzero()) == 3
    assert not pools.v_pack.any()


def test_fp8_views_alias_the_pack_bytes() -> None:
    pools = pools_of("fp8")
    pools.v_scale[0, 1, 1, 2, 0] = 0.25
    pools.v_q[0, 1, 1, 2, 7] = 2.0
    run = pools.v_pack[0, 1, 1]
    assert run[B * D + 2 * 2:B * D + 2 * 3].view(torch.float16).item() == 0.25
    assert run[2 * D + 7] == torch.tensor(2.0).to(torch.float8_e4m3fn).view(torch.uint8)
    assert int(run.count_nonzero()) == 2   # the code byte and 0.25's high byte (0x3400)
    assert pools.k_zero is None and pools.v_zero is None


def test_a_copy_from_tensors_has_its_own_aliased_views() -> None:
    pools = pools_of("int4_asym")
    copy = KVPools(pools.cfg, **{n: t.clone() for n, t in pools.tensors().items()})
    assert set(pools.tensors()) == {"k", "v", "k_pack", "v_pack"}
    copy.v_zero[1, 0, 0, 0, 0] = 3.0
    assert copy.v_pack.view(torch.float16).eq(3.0).sum() == 1
    assert not pools.v_pack.any()
    assert sum(t.nbytes for t in copy.tensors().values()) == sum(copy.nbytes().values())


def test_a_pack_of_the_wrong_size_is_refused() -> None:
    pools = pools_of("int4_asym")
    with pytest.raises(ValueError, match="k_pack must be uint8"):
        KVPools(pools.cfg, pools.k, pools.v, pools.k_pack[..., :-4], pools.v_pack)
