"""`bie-trt eval`: scoring math, and that its scoring sees the cache exactly as decode does."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from click.testing import CliRunner

from bie_trt.cli import main
from bie_trt.config import EngineConfig, KVCacheConfig
from bie_trt import evaluate as ev
from bie_trt.evaluate import evaluate
from bie_trt.cache_tiers.block_manager import BlockManager
from bie_trt.executor.model_runner import ModelRunner, quantise_blocks
from bie_trt.executor.sequence import Sequence
from bie_trt.kv.pool import allocate_pools
from bie_trt.model.llama import SeqInput
from bie_trt.sampling import make_generator
from bie_trt.sampling_params import SamplingParams



@pytest.fixture(scope="module")
def runner(smollm2_engine):
    return ModelRunner(EngineConfig(engine_dir=str(smollm2_engine), device="cpu", max_num_seqs=1, num_kv_blocks=1))


@pytest.fixture(scope="module")
def ids(runner, lee_text):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(runner.engine_dir)
    return tok(lee_text.read_text()[:4000])["input_ids"]


def logits_by(runner, kv: KVCacheConfig, tokens: list[int], chunk: int) -> torch.Tensor:
    """Teacher-forced logits for every position, `chunk` tokens per forward, compacting after each."""
    n = -(-len(tokens) // kv.block_size) + 1
    pools = allocate_pools(runner.model_config, kv, n, n, runner.dtype)
    blocks = BlockManager(kv, n, n)
    seq = Sequence(list(tokens), SamplingParams(temperature=0), make_generator(SamplingParams(), 0))
    rows = []
    for pos in range(0, len(tokens), chunk):
        part = tokens[pos:pos + chunk]
        blocks.grow(seq, pos + len(part))
        rows.append(runner.model.forward([SeqInput(torch.tensor(part), pos, seq.block_table, all_logits=True)], pools)[0])
        seq.num_cached = pos + len(part)
        quantise_blocks(pools, blocks.compact(seq))
    return torch.cat(rows)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["int4_asym", "fp8"])
def test_block_chunks_see_exactly_what_decode_sees(runner, ids, dtype):
    kv = KVCacheConfig(dtype=dtype, window=32, sink_tokens=8)
    tokens = ids[:80]
    decode = logits_by(runner, kv, tokens, chunk=1)      # one token at a time: decode
    chunked = logits_by(runner, kv, tokens, chunk=16)    # what eval does
    exact = logits_by(runner, dataclasses.replace(kv, dtype="fp16"), tokens, chunk=16)
    effect = (exact - chunked).abs().mean().item()       # what quantising the body changes
    # Same quantised state: only fp32 summation order differs, which can flip a rare code at a
    # rounding boundary (an FP8 ulp is 6%), so compare means against the quantisation effect.
    assert (decode - chunked).abs().mean().item() <= 0.05 * effect
    assert effect > 1e-3
    # Chunks wider than a block would see blocks in FP16 that decode already sees quantised.
    wide = logits_by(runner, kv, tokens, chunk=48)
    assert (decode - wide).abs().mean().item() > (decode - chunked).abs().mean().item()


def test_perplexity_is_the_mean_nll_of_the_targets(smollm2_engine, runner, ids):
    context = 96
    results = evaluate(smollm2_engine, ids, context, {}, max_windows=2, progress=False)
    nll, count = 0.0, 0
    for start in (0, context):
        window = ids[start:start + context]
        logp = torch.log_softmax(logits_by(runner, KVCacheConfig(), window, chunk=context).double(), -1)
        nll -= logp[:-1].gather(-1, torch.tensor(window[1:])[:, None]).sum().item()
        count += context - 1
    assert results[0].tokens == count
    assert math.isclose(results[0].ppl, math.exp(nll / count), rel_tol=1e-6)


def test_eval_scores_what_decode_sees_chunk_by_chunk(smollm2_engine, runner, ids):
    """Eval runs a window as one forward whose rows read the cache as decode does; its numbers are those of
    block-sized chunks run one by one (what decode sees with a window that is a multiple of the block)."""
    kv = KVCacheConfig(dtype="int4_asym", window=32, sink_tokens=8)
    window = ids[:96]
    fp16, int4 = evaluate(smollm2_engine, ids, len(window), {"int4": kv}, max_windows=1, progress=False)
    base = torch.log_softmax(logits_by(runner, dataclasses.replace(kv, dtype="fp16"), window[:-1], 16).double(), -1)
    logp = torch.log_softmax(logits_by(runner, kv, window[:-1], 16).double(), -1)
    targets = torch.tensor(window[1:])[:, None]
    assert fp16.ppl == pytest.approx(math.exp(-base.gather(-1, targets).mean().item()), rel=1e-6)
    assert int4.ppl == pytest.approx(math.exp(-logp.gather(-1, targets).mean().item()), rel=1e-6)
    assert int4.kld == pytest.approx((base.exp() * (base - logp)).sum(-1).mean().item(), rel=1e-4)


def test_variants_against_fp16(smollm2_engine, ids):
    variants = {
        "fp16 again": KVCacheConfig(dtype="fp16"),
        "int4 window covers all": KVCacheConfig(dtype="int4_asym", window=128),
        "values rotated too, window covers all": KVCacheConfig(dtype="int4_asym", window=128, rotation="hadamard_kv"),
        "int4": KVCacheConfig(dtype="int4_asym", window=16),
    }
    res = {r.label: r for r in evaluate(smollm2_engine, ids, 112, variants, max_windows=1, progress=False)}
    assert res["fp16 again"].kld < 1e-9 and res["fp16 again"].ppl == pytest.approx(res["fp16"].ppl, rel=1e-9)
    # nothing leaves a window that covers the context: exactly fp16
    assert res["int4 window covers all"].kld < 1e-9
    # rotating values and rotating the attention output back is exact too
    assert res["values rotated too, window covers all"].kld < 1e-9
    assert res["int4"].kld > 1e-5 and abs(res["int4"].ppl / res["fp16"].ppl - 1) < 0.1
    assert res["int4"].kv_bytes_per_token == 30 * 2 * 3 * (32 + 4)


def test_eval_cli_json(smollm2_engine, lee_text):
    out = CliRunner().invoke(main, ["eval", "--engine", str(smollm2_engine), "--text", str(lee_text), "--context", "64",
                                    "--max-windows", "1", "--kv-cache-dtype", "int4_asym", "--kv-window", "16",
                                    "--json"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.output)
    assert {"ppl", "kld", "tokens", "context", "kv"} <= set(data)
    assert data["kv"]["dtype"] == "int4_asym" and data["kv"]["window"] == 16 and data["tokens"] == 63



@pytest.fixture(scope="module")
def tiny_gemma3_dir(build, tiny_gemma3_awq):
    """The tiny Gemma 3 (hybrid, logits soft-capped) with an FP16 cache: the same engine as tiny_gemma3_engine's."""
    return build(checkpoint=str(tiny_gemma3_awq), max_model_len=512, kv_cache_dtype="fp16")


def test_streamed_scores_equal_the_full_logit_matrix(tiny_gemma3_dir, monkeypatch):
    """Eval scores the rows a slice at a time (a window's [T, V] float64 log-probs do not fit at 8k tokens of
    a 262k vocabulary); here slices of 7 rows, over two overlapping windows (the second scores its last 24
    rows only), against the whole matrix of each variant's head logits, soft-capping included."""
    seen, forward = [], ev._teacher_forced_hidden

    def keep_hidden(model, v, ids):   # the real forward; its final hidden rows kept for the full matrix
        seen.append((model, forward(model, v, ids)))
        return seen[-1][1]

    monkeypatch.setattr(ev, "_teacher_forced_hidden", keep_hidden)
    ids = torch.randint(0, 49152, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    monkeypatch.setattr(ev, "_SLICE_ELEMENTS", 7 * 49152)
    context, stride = 64, 24
    kv = KVCacheConfig(dtype="int4_asym", group_size=32, window=16, sink_tokens=4)
    fp16, int4 = evaluate(tiny_gemma3_dir, ids, context, {"int4": kv}, stride=stride, max_windows=2, progress=False)
    assert seen[0][0].cfg.final_logit_softcapping == 30.0
    nll, kl = [0.0, 0.0], 0.0
    for w, start in enumerate((0, stride)):
        first = 0 if start == 0 else context - stride - 1      # rows whose targets no earlier window scored
        targets = torch.tensor(ids[start + 1 + first:start + context])[:, None]
        base, logp = (torch.log_softmax(model.head_logits(h).double(), -1)[first:] for model, h in seen[2 * w:2 * w + 2])
        nll = [nll[0] - base.gather(-1, targets).sum().item(), nll[1] - logp.gather(-1, targets).sum().item()]
        kl += (base.exp() * (base - logp)).sum().item()
    count = context - 1 + stride
    # The head's float32 matmul over 7 rows may round a logit an ulp apart from the one over all rows (~3e-9 here).
    assert fp16.tokens == int4.tokens == count
    assert fp16.ppl == pytest.approx(math.exp(nll[0] / count), rel=1e-7)
    assert int4.ppl == pytest.approx(math.exp(nll[1] / count), rel=1e-7)
    assert int4.kld == pytest.approx(kl / count, rel=1e-7) and int4.kld > 1e-6
