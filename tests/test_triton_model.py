"""The whole forward through the Triton kernels (interpreted on the CPU) equals the reference twins:
the dispatcher's wiring, mixed batches (a prefill chunk beside decodes), and the INT4 cache."""
from __future__ import annotations

import pytest
import torch

from bie_trt.builder.build import BuildOptions, build_engine
from bie_trt.builder.checkpoint.quantize import quantize_checkpoint
from bie_trt.config import EngineConfig
from bie_trt.cache_tiers.block_manager import BlockManager
from bie_trt.executor.model_runner import ModelRunner, quantise_blocks
from bie_trt.executor.sequence import Sequence
from bie_trt.kernels import triton_ops
from bie_trt.model.llama import SeqInput
from bie_trt.sampling import make_generator
from bie_trt.sampling_params import SamplingParams
from tiny_model import write_tiny_hf

pytestmark = pytest.mark.skipif(not triton_ops.available(), reason="triton not importable")


@pytest.fixture(scope="module")
def runner(tmp_path_factory, smollm2_checkpoint):
    root = tmp_path_factory.mktemp("tiny-triton")
    # head_dim 32 (2 heads over hidden 64), GQA 2:1 -- the smallest shapes the kernels take
    hf = write_tiny_hf(root / "hf", smollm2_checkpoint, num_attention_heads=2, num_key_value_heads=1)
    awq = quantize_checkpoint(hf, root / "awq", group_size=32)
    engine = build_engine(BuildOptions(checkpoint=str(awq), out=str(root / "engine"), profile="cpu",
                                       max_model_len=256, kv_cache_dtype="int4_asym", kv_group_size=32,
                                       kv_window=16, kv_sink_tokens=8), log=lambda m: None)
    return ModelRunner(EngineConfig(engine_dir=str(engine), device="cpu", max_num_seqs=2))


def run_steps(runner: ModelRunner) -> list[torch.Tensor]:
    """Two sequences: A prefills 58 tokens in chunks then decodes; B decodes beside A's chunks."""
    pools = runner.pools
    blocks = BlockManager(runner.kv_config, pools.num_fp_blocks, pools.num_quant_blocks)
    g = torch.Generator().manual_seed(0)
    a_ids, b_ids = torch.randint(0, 49152, (58,), generator=g).tolist(), torch.randint(0, 49152, (9,), generator=g).tolist()
    a = Sequence(a_ids, SamplingParams(), make_generator(SamplingParams(), 0))
    b = Sequence(b_ids, SamplingParams(), make_generator(SamplingParams(), 0))
    out = []
    # B's prompt, then A's chunks (32 rows, then 26: a multiple of 16 and not) with B decoding alongside, then both decode
    plan = [[(b, 9)], [(a, 32), (b, 1)], [(a, 26), (b, 1)], [(a, 1), (b, 1)], [(a, 1), (b, 1)]]
    for step in plan:
        inputs = []
        for seq, n in step:
            if seq.num_cached + n > seq.num_tokens:
                seq.output_ids.append(int(torch.randint(0, 49152, (1,), generator=g)))
            chunk = seq.token_ids[seq.num_cached:seq.num_cached + n]
            blocks.grow(seq, seq.num_cached + n)
            inputs.append(SeqInput(torch.tensor(chunk), seq.num_cached, list(seq.block_table), all_logits=n > 1))
        out += runner.forward(inputs)
        for seq, n in step:
            seq.num_cached += n
            quantise_blocks(pools, blocks.compact(seq))
    assert any(e < 0 for e in a.block_table), "the INT4 body was never used"
    return out


def test_triton_forward_equals_reference(runner, monkeypatch):
    monkeypatch.setenv("BIE_TRT_KERNELS", "reference")
    want = run_steps(runner)
    monkeypatch.setenv("BIE_TRT_KERNELS", "triton")
    got = run_steps(runner)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert (g - w).abs().max().item() <= 2e-3


def test_the_triton_path_really_runs(runner, monkeypatch):
    from bie_trt.kernels import triton_attention, triton_w4

    calls = {"w4": 0, "attn": 0, "norm": 0, "kv": 0}

    def counting(module, name, key):
        real = getattr(module, name)

        def wrapper(*a, **k):
            calls[key] += 1
            return real(*a, **k)
        monkeypatch.setattr(module, name, wrapper)

    counting(triton_w4, "w4_linear_triton", "w4")
    counting(triton_attention, "paged_decode_attention", "attn")
    counting(triton_attention, "paged_prefill_attention", "attn")
    counting(triton_attention, "paged_tile_attention", "attn")   # a short prefill is one tiled launch
    counting(triton_ops, "rms_norm_triton", "norm")
    counting(triton_ops, "qkv_epilogue_triton", "kv")
    monkeypatch.setenv("BIE_TRT_KERNELS", "triton")
    runner.forward([SeqInput(torch.tensor([5, 6, 7]), 0, [0])])
    assert all(v > 0 for v in calls.values()), calls
