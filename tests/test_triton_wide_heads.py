"""Gemma 4's 512-wide full-attention heads through the Triton paged attention (decode, a prefill chunk), FP16
and INT4 pools, against the plain-torch reference: the kernels take the head width from the pool, and 512 is
the widest the engine runs. Interpreted on the CPU at one KV head, two query heads."""
from __future__ import annotations

import pytest
import torch

from bie_trt.config import KVCacheConfig, ModelConfig
from bie_trt.kernels.attention_ref import paged_attention_ref
from bie_trt.kernels.triton_attention import (available, paged_decode_attention, paged_decode_attention_ref,
                                              paged_prefill_attention)
from bie_trt.kv.pool import allocate_pools, encode_quant_block
from bie_trt.kv.quant import quantize_block

pytestmark = pytest.mark.skipif(not available(), reason="triton is not importable (or no CUDA and no interpreter)")

HQ, D, B, LENGTH = 2, 512, 16, 40
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def filled_pools(dtype: str):
    """Pools holding one 40-token sequence: block 0 FP16, block 1 quantised (where the format has a quantised
    pool), block 2 the FP16 tail; and its block table."""
    cfg = ModelConfig(architecture="Gemma4ForCausalLM", hidden_size=64, intermediate_size=64, num_layers=1,
                      num_heads=HQ, num_kv_heads=1, head_dim=D, vocab_size=256, rms_norm_eps=1e-6,
                      rope_theta=1e6, max_position_embeddings=1024, tie_word_embeddings=True)
    pools = allocate_pools(cfg, KVCacheConfig(dtype=dtype, group_size=64), 4, 2, dtype=torch.float32, device=DEVICE)
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(1, 1, 3 * B, D, generator=g).to(DEVICE) for _ in range(2))
    k[..., 7] *= 20.0   # an outlier channel, as real keys have
    table = []
    for i in range(3):
        pools.k[:, i, :, :], pools.v[:, i, :, :] = k[:, :, i * B:(i + 1) * B], v[:, :, i * B:(i + 1) * B]
        if i == 1 and pools.k_q is not None:
            quantize_block(pools, None, i, 0)
            pools.k[:, i], pools.v[:, i] = torch.nan, torch.nan   # any read of the FP16 twin shows as NaN
            table.append(encode_quant_block(0))
        else:
            table.append(i)
    return pools, torch.tensor(table, dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize("dtype", ["fp16", "int4_asym"])
def test_512_wide_heads_match_the_reference(dtype: str) -> None:
    pools, table = filled_pools(dtype)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, HQ, D, generator=g).to(DEVICE)
    lens = torch.tensor([LENGTH], dtype=torch.int32, device=DEVICE)
    out = paged_decode_attention(q, pools, 0, table[None], lens, 1.0 / D ** 0.5)
    ref = paged_decode_attention_ref(q, pools, 0, table[None], lens, 1.0 / D ** 0.5)
    assert torch.isfinite(out).all() and (out - ref).abs().max() <= 2e-3
    chunk = torch.randn(8, HQ, D, generator=g).to(DEVICE)
    positions = torch.arange(LENGTH - 8, LENGTH, dtype=torch.int32, device=DEVICE)
    out = paged_prefill_attention(chunk, pools, 0, table, positions, 1.0 / D ** 0.5)
    ref = paged_attention_ref(chunk, pools, 0, table, positions, 1.0 / D ** 0.5)
    assert torch.isfinite(out).all() and (out - ref).abs().max() <= 2e-3
