"""The memory plan, checked against hand arithmetic and against the real pool allocator."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from bie_trt.cli import main
from bie_trt.config import SUPPORTED_ARCHITECTURES, KVCacheConfig, ModelConfig
from bie_trt.errors import PlanError
from bie_trt.kv.pool import allocate_pools
from bie_trt.plan import (
    verify_graph_buckets,
    activation_workspace_bytes,
    draft_kv_blocks,
    draft_kv_blocks_per_seq,
    format_bytes,
    kv_pool_blocks,
    planned_step_tokens,
    solve_plan,
)
from bie_trt.profiles import list_profiles, load_profile

GIB = 2**30
MIB = 2**20

# meta-llama/Llama-3.1-8B-Instruct config.json, verbatim.
LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0",
    "use_cache": True,
    "vocab_size": 128256,
}

# meta-llama/Llama-3.2-1B-Instruct: same tokenizer, a natural draft for the 8B.
LLAMA_32_1B = {
    **LLAMA_31_8B,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "head_dim": 64,
    "tie_word_embeddings": True,
    "rope_scaling": {**LLAMA_31_8B["rope_scaling"], "factor": 32.0},
}

# HuggingFaceTB/SmolLM2-135M's shapes: a small vocabulary (49,152) and a narrow head (576).
SMOLLM2_135M = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 576, "intermediate_size": 1536,
    "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
    "max_position_embeddings": 8192, "rope_theta": 100000, "tie_word_embeddings": True,
}


@pytest.fixture(scope="module")
def llama() -> ModelConfig:
    return ModelConfig.from_hf(LLAMA_31_8B)


@pytest.fixture(scope="module")
def ti() -> object:
    return load_profile("rtx4060ti-8gb")


def kv_cfg(dtype: str = "int4_asym", **kw) -> KVCacheConfig:
    return KVCacheConfig(dtype=dtype, group_size=64, sink_tokens=8, window=128, **kw)


def plan64k(model, profile, dtype="int4_asym", **kw):
    return solve_plan(model, profile, max_model_len=65536, kv=kv_cfg(dtype), max_num_seqs=1, **kw)


# --- acceptance: Llama-3.1-8B at 64k on an 8 GB card --------------------------------------

def test_llama_int4_64k_fits_on_rtx4060ti(llama, ti):
    plan = plan64k(llama, ti)
    assert plan.kv_bytes_per_token == 36864
    assert plan.fits
    assert plan.total_bytes <= 7.2 * GIB
    assert plan.max_model_len_that_fits >= 65536


@pytest.mark.parametrize("dtype", ["fp16", "fp8"])
def test_wider_kv_does_not_fit_64k_but_reports_a_shorter_length(llama, ti, dtype):
    plan = plan64k(llama, ti, dtype)
    assert not plan.fits
    n = plan.max_model_len_that_fits
    assert 0 < n < 65536 and n % 16 == 0
    # n is the boundary: it fits, one more block does not.
    assert solve_plan(llama, ti, max_model_len=n, kv=kv_cfg(dtype)).fits
    assert not solve_plan(llama, ti, max_model_len=n + 16, kv=kv_cfg(dtype)).fits


def test_sizes_match_design_arithmetic(llama, ti):
    plan = plan64k(llama, ti)
    # 6.98 B linear parameters, 4 bits each + an fp16 scale and a 4-bit zero per 128 inputs.
    params = 32 * (4096 * (4096 + 1024 + 1024) + 4096 * 4096 + 3 * 4096 * 14336)
    assert params == 6_979_321_856
    assert plan.bytes_of("linear_weights") == params * 133 // 256  # (64 + 2 + 0.5) bytes per 128 weights
    # A 3.45 GiB estimate counts an fp16 zero (4.25 bit); AWQ packs zeros in 4 bits: ~2% less.
    assert abs(plan.bytes_of("linear_weights") / (3.45 * GIB) - 1) < 0.03
    assert plan.bytes_of("kv_quant_pool") == 36 * 1024 * 65536 == 2.25 * GIB
    assert plan.bytes_of("kv_fp16_pool") == 42 * 16 * 128 * 1024  # sink 1 + window 8 + chunk 32 + 1 blocks
    assert plan.bytes_of("lm_head") == 128256 * 4096 + 128256 * 2  # int8 + per-row fp16 scale
    assert plan.bytes_of("embedding") == 0  # pinned host memory on 8 GB profiles
    assert plan.bytes_of("norms") == 65 * 4096 * 2
    assert plan.bytes_of("logits") == 128256 * 4
    assert plan.bytes_of("cuda_context") == ti.cuda_context_reserve_bytes
    assert plan.budget_bytes == int(8 * GIB * 0.92)

    fp16 = plan64k(llama, ti, "fp16")
    assert fp16.kv_bytes_per_token == 128 * 1024
    assert fp16.bytes_of("kv_fp16_pool") == 8 * GIB
    assert fp16.bytes_of("kv_quant_pool") == 0
    assert plan64k(llama, ti, "fp8").bytes_of("kv_quant_pool") == 2 * 32 * 8 * (128 + 2) * 65536

    on_gpu = plan64k(llama, ti, lm_head_dtype="fp16", embedding_placement="gpu")
    assert on_gpu.bytes_of("embedding") == on_gpu.bytes_of("lm_head") == 128256 * 4096 * 2  # ~0.98 GiB each


def test_activation_workspace_is_the_mlp_phase_for_8b(llama):
    t, h, i = 512, 4096, 14336
    residual = (t * h + 2 * t * 128) * 2   # the residual stream and RoPE cos/sin
    mlp = (t * h + 2 * t * i + t * i + t * h) * 2
    attention = (t * h + t * (4096 + 2 * 1024) + t * 4096 + t * h) * 2 + t * 32 * 16 * 4
    assert attention < mlp
    assert activation_workspace_bytes(llama, 512) == residual + mlp == 54 * MIB + 256 * 1024
    assert 2 * activation_workspace_bytes(llama, 256) == activation_workspace_bytes(llama, 512)  # linear in T


# --- the plan equals what the runtime allocates ----------------------------------------------

def tiny(layers=2, heads=4, kv_heads=2, head_dim=64) -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM", hidden_size=heads * head_dim, intermediate_size=3 * heads * head_dim,
        num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, vocab_size=512,
        rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=8192, tie_word_embeddings=True,
    )


@pytest.mark.parametrize("model,kv,max_len,seqs,chunk", [
    (tiny(), kv_cfg("int4_asym"), 1000, 1, 512),
    (tiny(), kv_cfg("fp8"), 4096, 3, 256),
    (tiny(), kv_cfg("fp16"), 777, 2, 512),
    (tiny(3, 8, 4, 128), KVCacheConfig(dtype="int4_asym", group_size=32, sink_tokens=4, window=64,
                                       block_size=32), 2048, 2, 128),
    (ModelConfig.from_hf(LLAMA_31_8B), kv_cfg("int4_asym"), 65536, 1, 512),
])
def test_plan_kv_items_equal_allocated_pools(model, kv, max_len, seqs, chunk):
    n_fp, n_q = kv_pool_blocks(model, kv, max_len, seqs, chunk)
    # meta tensors: real shapes and dtypes without the memory (the Llama case is 2.3 GiB).
    pools = allocate_pools(model, kv, n_fp, n_q, dtype=torch.float16, device="meta")
    plan = solve_plan(model, load_profile("cpu"), max_model_len=max_len, kv=kv, max_num_seqs=seqs,
                      chunked_prefill_size=chunk, weight_group_size=64)
    assert (plan.num_fp_blocks, plan.num_quant_blocks) == (n_fp, n_q)
    assert pools.nbytes() == {"fp16": plan.bytes_of("kv_fp16_pool"), "quant": plan.bytes_of("kv_quant_pool")}


def test_kv_pool_blocks(llama):
    assert kv_pool_blocks(llama, kv_cfg("int4_asym"), 65536, 1, 512) == (1 + 8 + 32 + 1, 4096)
    assert kv_pool_blocks(llama, kv_cfg("int4_asym"), 65536, 2, 512) == (84, 8192)
    assert kv_pool_blocks(llama, kv_cfg("fp16"), 1000, 3, 512) == (3 * 63, 0)


# --- draft, bias, ties ------------------------------------------------------------------------

def test_draft_adds_weights_and_bounded_kv(llama, ti):
    draft = ModelConfig.from_hf(LLAMA_32_1B)
    base = plan64k(llama, ti)
    plan = plan64k(llama, ti, draft=draft, draft_window_tokens=1024)
    blocks = draft_kv_blocks(kv_cfg(), 1024, 1)
    assert blocks == draft_kv_blocks_per_seq(8, 1024, 16) == 1 + 64 + 1   # sink block, window, one more
    assert plan.bytes_of("draft_kv") == blocks * 16 * 2 * 16 * 8 * 64 * 2
    # Bounded: the draft's KV grows neither with the target's context nor with the prefill chunk.
    longer = solve_plan(llama, ti, max_model_len=131072, kv=kv_cfg(), draft=draft, draft_window_tokens=1024,
                        chunked_prefill_size=2048)
    assert longer.bytes_of("draft_kv") == plan.bytes_of("draft_kv")
    linears = 16 * (2048 * (2048 + 512 + 512) + 2048 * 2048 + 3 * 2048 * 8192)
    assert plan.bytes_of("draft_linear_weights") == linears * 133 // 256
    k = 32768                                                       # the default byte budget's rows
    assert plan.bytes_of("draft_lm_head") == k * 2048 + k * 2      # int8 rows + fp16 scales, K rows only
    assert plan.bytes_of("draft_embedding") == 0                    # host
    assert plan.bytes_of("draft_norms") == 33 * 2048 * 2
    assert plan.bytes_of("draft_kv_key_mean") == 0                  # the draft's cache is fp16: nothing to centre
    k = ti.defaults.num_speculative_tokens
    assert plan.bytes_of("logits") == (1 + k) * 128256 * 4
    assert plan.bytes_of("draft_probs") == k * 128256 * 4
    assert plan.total_bytes > base.total_bytes
    names = [i.name for i in plan.items if i.name.startswith("draft_")]
    assert names == ["draft_linear_weights", "draft_lm_head", "draft_embedding", "draft_norms",
                     "draft_request_head", "draft_kv", "draft_probs"]


def test_draft_vocab_size_sets_the_head_rows(llama, ti):
    draft = ModelConfig.from_hf(LLAMA_32_1B)
    full = plan64k(llama, ti, draft=draft, draft_vocab_size=10**6)   # more than the vocabulary: all of it
    assert full.bytes_of("draft_lm_head") == 128256 * 2048 + 128256 * 2
    assert full.inputs["draft_vocab_size"] == 128256
    small = plan64k(llama, ti, draft=draft, draft_vocab_size=1000)
    assert small.bytes_of("draft_lm_head") == 1000 * 2050 and small.inputs["draft_vocab_size"] == 1000
    fp16 = plan64k(llama, ti, draft=draft, draft_vocab_size=1000, lm_head_dtype="fp16", embedding_placement="gpu")
    assert fp16.bytes_of("draft_lm_head") == 1000 * 2048 * 2    # tied, but a reduced head cannot share the table
    for bad in ({"draft_vocab_size": 0}, {"draft_window_tokens": 0}):
        with pytest.raises(PlanError, match="at least 1"):
            plan64k(llama, ti, draft=draft, **bad)


def test_each_sequence_gets_its_request_rows_of_the_drafts_head(llama, ti):
    """R more rows of the draft's head per sequence (int8: H bytes + a 2-byte scale a row), never more
    rows than there are ids outside the K, none when the K cover the vocabulary; the inputs say how many."""
    draft = ModelConfig.from_hf(LLAMA_32_1B)
    plan = plan64k(llama, ti, draft=draft)                        # defaults: K 32,768, R 4,096
    assert plan.bytes_of("draft_request_head") == 4096 * (2048 + 2) and plan.inputs["draft_request_vocab"] == 4096
    three = solve_plan(llama, ti, max_model_len=8192, kv=kv_cfg(), max_num_seqs=3, draft=draft,
                       draft_request_vocab=1000)
    assert three.bytes_of("draft_request_head") == 3 * 1000 * 2050
    assert three.total_bytes - solve_plan(llama, ti, max_model_len=8192, kv=kv_cfg(), max_num_seqs=3, draft=draft,
                                          draft_request_vocab=0).total_bytes == 3 * 1000 * 2050
    capped = plan64k(llama, ti, draft=draft, draft_vocab_size=128000, draft_request_vocab=4096)
    assert capped.inputs["draft_request_vocab"] == 256 and capped.bytes_of("draft_request_head") == 256 * 2050
    full = plan64k(llama, ti, draft=draft, draft_vocab_size=128256)
    assert full.inputs["draft_request_vocab"] == 0 and "draft_request_head" not in [i.name for i in full.items]
    fp16 = plan64k(llama, ti, draft=draft, lm_head_dtype="fp16", embedding_placement="gpu")
    assert fp16.bytes_of("draft_request_head") == 4096 * 2048 * 2
    with pytest.raises(PlanError, match="request vocabulary must be 0"):
        plan64k(llama, ti, draft=draft, draft_request_vocab=-1)


def test_8b_with_1b_draft_fits_64k_on_8gb_cards(llama):
    """The acceptance pair: Llama-3.1-8B + Llama-3.2-1B, 64k, INT4 KV, num_speculative_tokens 5, each 8 GB profile's
    defaults (the draft's head: 32,768 rows by the byte budget), with at least 32 MiB to spare beyond the margin."""
    draft = ModelConfig.from_hf(LLAMA_32_1B)
    for name in ("rtx4060ti-8gb", "rtx4060-8gb", "rtx3060-8gb", "rtx3070-8gb", "rtx4070-laptop-8gb"):
        p = load_profile(name)
        d = p.defaults
        plan = solve_plan(llama, p, max_model_len=65536, kv=d.kv_config(), max_num_seqs=d.max_num_seqs,
                          chunked_prefill_size=d.chunked_prefill_size, draft=draft, num_speculative_tokens=5)
        assert plan.inputs["draft_vocab_size"] == 32768 and plan.inputs["draft_request_vocab"] == 4096
        assert plan.budget_bytes - plan.total_bytes >= 32 * MIB, plan.format_table()


def test_the_drafts_default_head_is_the_rows_that_fit_its_byte_budget(llama, ti):
    """Without --draft-vocab-size the draft's head keeps the most frequent ids whose weights fit 64 MiB
    (int8: hidden_size bytes a row, fp16 twice), at most the vocabulary; a given row count wins."""
    one_b = ModelConfig.from_hf(LLAMA_32_1B)
    plan = plan64k(llama, ti, draft=one_b)
    assert plan.inputs["draft_vocab_size"] == 32768 == 64 * MIB // 2048
    note = next(i.note for i in plan.items if i.name == "draft_lm_head")
    assert "the 32,768 most frequent of 128,256 vocabulary rows (as many as fit the 64.0 MiB draft head budget)" in note
    fp16 = plan64k(llama, ti, draft=one_b, lm_head_dtype="fp16", embedding_placement="gpu")
    assert fp16.inputs["draft_vocab_size"] == 16384 and fp16.bytes_of("draft_lm_head") == 16384 * 2048 * 2
    # a vocabulary just past the budget is cut to it, one just under it is kept whole
    for vocab, rows in ((32769, 32768), (32767, 32767)):
        small_target, small_draft = (ModelConfig.from_hf({**c, "vocab_size": vocab}) for c in (LLAMA_31_8B, LLAMA_32_1B))
        assert plan64k(small_target, ti, draft=small_draft).inputs["draft_vocab_size"] == rows

    smol = ModelConfig.from_hf(SMOLLM2_135M)
    for profile in (ti, load_profile("cpu")):                     # an int8 head and an fp16 one
        self_draft = solve_plan(smol, profile, max_model_len=8192, kv=kv_cfg(), weight_group_size=64, draft=smol)
        assert self_draft.inputs["draft_vocab_size"] == 49152, profile.name   # the whole head: 27 or 54 MiB
        assert self_draft.inputs["draft_request_vocab"] == 0 and self_draft.bytes_of("draft_request_head") == 0
        note = next(i.note for i in self_draft.items if i.name == "draft_lm_head")
        assert "all 49,152 vocabulary rows (their weights fit the 64.0 MiB draft head budget)" in note

    given = plan64k(llama, ti, draft=one_b, draft_vocab_size=20000)
    assert given.inputs["draft_vocab_size"] == 20000 and given.bytes_of("draft_lm_head") == 20000 * 2050
    assert "(--draft-vocab-size 20,000)" in next(i.note for i in given.items if i.name == "draft_lm_head")
    assert plan64k(llama, ti, draft=one_b, draft_vocab_size=10**6).inputs["draft_vocab_size"] == 128256


def test_qkv_bias_and_tied_embeddings():
    qwen = ModelConfig.from_hf({
        "architectures": ["Qwen2ForCausalLM"], "hidden_size": 896, "intermediate_size": 4864,
        "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
        "max_position_embeddings": 32768, "tie_word_embeddings": True,
    })
    cpu = load_profile("cpu")
    plan = solve_plan(qwen, cpu, max_model_len=4096, kv=kv_cfg("fp16"), weight_group_size=64,
                      lm_head_dtype="fp16", embedding_placement="gpu")
    assert plan.bytes_of("qkv_bias") == 24 * (896 + 2 * 128) * 2
    assert plan.bytes_of("lm_head") == 0  # shares the fp16 embedding table
    host = solve_plan(qwen, cpu, max_model_len=4096, kv=kv_cfg("fp16"), weight_group_size=64,
                      lm_head_dtype="int8", embedding_placement="host")
    assert host.bytes_of("lm_head") == 151936 * 896 + 151936 * 2  # a GPU copy of the tied table


# --- every shipped profile's defaults --------------------------------------------------------

@pytest.mark.parametrize("name", list_profiles())
def test_llama_fits_every_profile_at_its_defaults(llama, name):
    p = load_profile(name)
    d = p.defaults
    plan = solve_plan(llama, p, max_model_len=min(d.max_model_len, llama.max_position_embeddings),
                      kv=d.kv_config(), max_num_seqs=d.max_num_seqs, chunked_prefill_size=d.chunked_prefill_size)
    assert plan.fits, plan.format_table()


# --- validation -------------------------------------------------------------------------------

def test_max_model_len_beyond_model_limit(llama, ti):
    with pytest.raises(PlanError, match="131,072"):
        solve_plan(llama, ti, max_model_len=131073, kv=kv_cfg())


def test_kv_group_must_divide_head_dim(ti):
    odd = tiny(head_dim=96)
    with pytest.raises(PlanError, match="head_dim 96"):
        solve_plan(odd, ti, max_model_len=1024, kv=kv_cfg(), weight_group_size=32)


def test_weight_group_must_divide_in_features(llama, ti):
    with pytest.raises(PlanError, match="weight group size 96"):
        solve_plan(llama, ti, max_model_len=1024, kv=kv_cfg(), weight_group_size=96)


def test_a_draft_may_lack_its_targets_last_rows_but_have_no_more(llama, ti):
    smaller = ModelConfig.from_hf({**LLAMA_32_1B, "vocab_size": llama.vocab_size - 64})
    probs = plan64k(llama, ti, draft=smaller).bytes_of("draft_probs")
    assert probs == plan64k(llama, ti, draft=ModelConfig.from_hf(LLAMA_32_1B)).bytes_of("draft_probs") > 0
    larger = ModelConfig.from_hf({**LLAMA_32_1B, "vocab_size": llama.vocab_size + 1})
    with pytest.raises(PlanError, match="larger than the target's"):
        plan64k(llama, ti, draft=larger)


def test_nothing_fits_gives_zero(llama, ti):
    small = dataclasses.replace(ti, vram_bytes=3 * GIB)
    plan = plan64k(llama, small)
    assert not plan.fits and plan.max_model_len_that_fits == 0


def test_to_dict_is_json_ready(llama, ti):
    d = json.loads(json.dumps(plan64k(llama, ti).to_dict()))
    for key in ("fits", "total_bytes", "budget_bytes", "kv_bytes_per_token", "max_model_len_that_fits", "inputs"):
        assert key in d
    assert {i["name"]: i["bytes"] for i in d["items"]}["kv_quant_pool"] == 2.25 * GIB
    assert sum(i["bytes"] for i in d["items"]) == d["total_bytes"]
    assert d["inputs"]["max_model_len"] == 65536 and d["inputs"]["kv"]["dtype"] == "int4_asym"


# --- `bie-trt plan` ---------------------------------------------------------------------------

@pytest.fixture()
def llama_json(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA_31_8B))
    return path


def test_cli_plan_fits(llama_json):
    r = CliRunner().invoke(main, ["plan", "--model-config", str(llama_json), "--profile", "rtx4060ti-8gb"])
    assert r.exit_code == 0, r.output
    assert "kv_quant_pool" in r.stdout and "fits" in r.stdout and "36,864 bytes/token" in r.stdout


def test_cli_plan_does_not_fit_says_what_to_change(llama_json):
    r = CliRunner().invoke(main, ["plan", "--model-config", str(llama_json), "--profile", "rtx4060ti-8gb",
                                  "--kv-cache-dtype", "fp16"])
    assert r.exit_code == 3
    assert "DOES NOT FIT" in r.stdout
    assert "--kv-cache-dtype int4_asym" in r.stdout and "--max-model-len 23856" in r.stdout


def test_cli_plan_json_and_checkpoint_dir(llama_json):
    r = CliRunner().invoke(main, ["plan", "--checkpoint", str(llama_json.parent), "--profile", "rtx4060ti-8gb",
                                  "--max-model-len", "32768", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["fits"] and d["inputs"]["max_model_len"] == 32768 and d["advice"] is None


def test_cli_plan_errors_are_one_line(llama_json):
    r = CliRunner().invoke(main, ["plan", "--model-config", str(llama_json), "--profile", "rtx9999"])
    assert r.exit_code == 2 and "known profiles" in r.stderr


@pytest.mark.parametrize("limit,want", [(8192, 8192), (8200, 8192), (16, 16)])
def test_when_the_models_own_limit_fits_it_is_the_largest_fitting_length(limit, want):
    model = dataclasses.replace(tiny(), max_position_embeddings=limit)
    plan = solve_plan(model, load_profile("cpu"), max_model_len=16, kv=kv_cfg(), weight_group_size=64)
    assert plan.fits and plan.max_model_len_that_fits == want   # a multiple of the block size


def test_the_largest_fitting_length_is_the_boundary_for_every_budget():
    # Budgets from "nothing fits" to "everything fits", in steps that are no multiple of a block's bytes,
    # so the boundary lands on every part of the binary search.
    model, cpu = tiny(), load_profile("cpu")

    def plan(vram: int, length: int):
        return solve_plan(model, dataclasses.replace(cpu, vram_bytes=vram), max_model_len=length, kv=kv_cfg("fp16"),
                          weight_group_size=64, gpu_memory_utilization=1.0)

    fixed = plan(2**40, 16).total_bytes - plan(2**40, 16).bytes_of("kv_fp16_pool") - plan(2**40, 16).bytes_of("margin")
    start = fixed + 64 * MIB             # the margin's floor: below this nothing fits
    seen = set()
    for vram in range(start - 3 * 16384, start + 514 * 16384, 27_001):
        n = plan(vram, 16).max_model_len_that_fits
        seen.add(n)
        assert n == 0 or plan(vram, n).fits, (vram, n)
        assert n == 8192 or not plan(vram, n + 16).fits, (vram, n)
    assert 0 in seen and 8192 in seen and len(seen) > 250


def test_decode_graphs_are_captured_up_to_and_including_max_num_seqs(llama, ti):
    plan = solve_plan(llama, ti, max_model_len=4096, kv=kv_cfg(), max_num_seqs=2, cuda_graph_batch_sizes=[1, 2, 4])
    assert plan.inputs["cuda_graph_batch_sizes"] == [1, 2]
    assert plan.bytes_of("cuda_graphs") == 2 * 16 * MIB


def test_verify_graphs_hold_their_logits_beyond_the_steps_own(llama, ti):
    """γ = 5 at batch sizes 1, 2, 4 (S = 4): three verify buckets of 6, 12 and 24 rows hold their fp32 logits
    as graph outputs; the step's `logits` item already covers 24 rows. At S = 1 the one bucket is that item."""
    row = llama.vocab_size * 4
    plan = solve_plan(llama, ti, max_model_len=4096, kv=kv_cfg(), max_num_seqs=4, cuda_graph_batch_sizes=[1, 2, 4],
                      num_speculative_tokens=5)
    assert plan.bytes_of("logits") == 24 * row
    assert plan.bytes_of("cuda_graphs") == 3 * 16 * MIB + (6 + 12 + 24 - 24) * row
    one = solve_plan(llama, ti, max_model_len=4096, kv=kv_cfg(), max_num_seqs=1, cuda_graph_batch_sizes=[1, 2],
                     num_speculative_tokens=5)
    assert one.bytes_of("cuda_graphs") == 16 * MIB
    # γ + 1 = 16 rows: buckets of batch 1 to 4 only (the head's 64 rows)
    assert verify_graph_buckets([1, 2, 4, 8], 16) == [(1, 16), (2, 16), (4, 16)]
    assert verify_graph_buckets([1, 2], 17) == []


def test_the_whole_card_and_the_models_whole_length_are_allowed(ti):
    model = tiny()
    plan = solve_plan(model, ti, max_model_len=model.max_position_embeddings, kv=kv_cfg(), weight_group_size=64,
                      gpu_memory_utilization=1.0)
    assert plan.budget_bytes == ti.vram_bytes and plan.fits
    with pytest.raises(PlanError, match="gpu_memory_utilization must be in"):
        solve_plan(model, ti, max_model_len=1024, kv=kv_cfg(), weight_group_size=64, gpu_memory_utilization=1.01)


def test_cli_plan_with_draft_shows_each_draft_item():
    from pathlib import Path

    examples = Path(__file__).parent.parent / "docs" / "examples"
    r = CliRunner().invoke(main, ["plan", "--model-config", str(examples / "llama-3.1-8b-instruct-awq.config.json"),
                                  "--speculative-draft-config", str(examples / "llama-3.2-1b-instruct.config.json"),
                                  "--profile", "rtx4060ti-8gb", "--max-model-len", "65536",
                                  "--kv-cache-dtype", "int4_asym", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    items = {i["name"]: i["bytes"] for i in d["items"]}
    assert d["budget_bytes"] - d["total_bytes"] >= 32 * MIB
    assert items["draft_lm_head"] == 32768 * 2050 and items["draft_embedding"] == 0
    assert d["inputs"]["draft_window_tokens"] == 1024 and d["inputs"]["draft_vocab_size"] == 32768
    assert items["draft_request_head"] == 4096 * 2050 and d["inputs"]["draft_request_vocab"] == 4096


def test_a_tied_int8_head_on_the_gpu_is_its_own_copy(ti):
    model = tiny()                                # tie_word_embeddings=True
    plan = solve_plan(model, ti, max_model_len=1024, kv=kv_cfg(), weight_group_size=64, lm_head_dtype="int8",
                      embedding_placement="gpu")
    assert plan.bytes_of("lm_head") == 512 * 256 + 512 * 2 and plan.bytes_of("embedding") == 512 * 256 * 2


def test_activation_workspace_is_the_attention_phase_when_the_mlp_is_narrow():
    model = dataclasses.replace(tiny(), intermediate_size=64)   # hidden 256, 4 heads, 2 KV heads of 64
    t = 8
    residual = (t * 256 + 2 * t * 64) * 2
    # + the online softmax's fp32 scores (4 heads x 16 a token) and the centred keys' fp32 offset coefficients (q)
    attention = (t * 256 + t * (256 + 2 * 128) + t * 256 + t * 256) * 2 + t * 4 * 16 * 4 + t * 256 * 4
    mlp = (t * 256 + 2 * t * 64 + t * 64 + t * 256) * 2
    assert mlp < attention and activation_workspace_bytes(model, t) == residual + attention == 36864


def test_the_activations_cover_a_whole_step_with_the_drafts_proposals(llama, ti):
    """A step runs a prefill chunk beside every sequence's decode and its num_speculative_tokens proposals: 256 + 1 x (1 + 4)
    tokens on an 8 GB profile with a 1B draft, and the pair still fits 64k with 32 MiB to spare."""
    d = ti.defaults
    plan = plan64k(llama, ti, draft=ModelConfig.from_hf(LLAMA_32_1B), chunked_prefill_size=d.chunked_prefill_size)
    step = d.chunked_prefill_size + d.max_num_seqs * (1 + d.num_speculative_tokens)
    assert step == 261
    assert plan.bytes_of("activations") == activation_workspace_bytes(llama, step, block_size=d.block_size)
    assert plan.budget_bytes - plan.total_bytes >= 32 * MIB


def test_planned_step_reads_the_older_chunk_key():
    """Engines built before the rename record the prefill chunk as "chunk_tokens"."""
    new = {"chunked_prefill_size": 512, "max_num_seqs": 2, "num_speculative_tokens": 3}
    old = {"chunk_tokens": 512, "max_num_seqs": 2, "num_speculative_tokens": 3}
    assert planned_step_tokens(new) == planned_step_tokens(old) == 512 + 2 * (1 + 3)


# --- the shipped configs plan as README.md and docs/memory-plan.md state ---------------------

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "docs" / "examples"


def cli_plan(config: str, *args: str) -> tuple[int, dict]:
    """`bie-trt plan --model-config docs/examples/CONFIG.config.json --profile rtx4060ti-8gb ... --json`:
    (exit status, the JSON plan, or {"error": ...} when it is refused)."""
    r = CliRunner().invoke(main, ["plan", "--model-config", str(EXAMPLES / f"{config}.config.json"),
                                  "--profile", "rtx4060ti-8gb", *args, "--json"])
    return r.exit_code, json.loads(r.stdout)


def readme_row(checkpoint: str) -> str:
    lines = (ROOT / "README.md").read_text().splitlines()
    return next(line for line in lines if line.startswith(f"| `{checkpoint}` |"))


@pytest.mark.parametrize("checkpoint,config", [
    ("hugging-quants/Meta-Llama-3.1-8B-Instruct-AWQ-INT4", "llama-3.1-8b-instruct-awq"),
    ("Qwen/Qwen2.5-7B-Instruct-AWQ", "qwen2.5-7b-instruct-awq"),
    ("Qwen/Qwen3-8B-AWQ", "qwen3-8b-awq"),
])
def test_the_readme_table_states_what_the_shipped_configs_plan(checkpoint, config):
    status, plan = cli_plan(config, "--max-model-len", "65536")
    assert status == 0 and plan["fits"]
    row = readme_row(checkpoint)
    total, budget = format_bytes(plan["total_bytes"]), format_bytes(plan["budget_bytes"])
    assert f"`{config}.config.json`" in row
    assert f"65,536 on `rtx4060ti-8gb`: {total.removesuffix(' GiB')} of {budget} planned" in row
    assert f"up to {plan['max_model_len_that_fits']:,} fit" in row


def test_qwen25_with_yarn_plans_as_the_memory_plan_doc_states():
    # YaRN's limit is factor x original context: 131,072, where max_position_embeddings says 32,768
    status, plan = cli_plan("qwen2.5-7b-instruct-awq", "--max-model-len", "131072")
    assert status == 0 and format_bytes(plan["total_bytes"]) == "6.24 GiB"
    status, err = cli_plan("qwen2.5-7b-instruct-awq", "--max-model-len", "131073")
    assert status == 2 and "limit of 131,072 tokens (YaRN's factor" in err["error"]
    # the KV table: bytes a token, total at 64k, the largest length that fits
    for dtype, per_token, total, largest in [("int4_asym", 16128, "5.26 GiB", 131072), ("fp8", 29120, "6.05 GiB", 113760),
                                             ("fp16", 57344, "7.75 GiB", 58176)]:
        status, plan = cli_plan("qwen2.5-7b-instruct-awq", "--max-model-len", "65536", "--kv-cache-dtype", dtype)
        assert status == (0 if dtype != "fp16" else 3)
        assert (plan["kv_bytes_per_token"], format_bytes(plan["total_bytes"]), plan["max_model_len_that_fits"]) == \
            (per_token, total, largest)


def test_qwen25_without_its_rope_scaling_stops_at_32k():
    hf = json.loads((EXAMPLES / "qwen2.5-7b-instruct-awq.config.json").read_text())
    del hf["rope_scaling"]
    assert ModelConfig.from_hf(hf).max_positions == 32768


def test_qwen25_with_its_05b_draft_despite_the_padded_vocabulary():
    status, plan = cli_plan("qwen2.5-7b-instruct-awq", "--max-model-len", "65536", "--speculative-draft-config",
                            str(EXAMPLES / "qwen2.5-0.5b-instruct.config.json"))
    assert status == 0 and plan["inputs"]["draft"]["vocab_size"] == 151936
    assert (format_bytes(plan["total_bytes"]), plan["max_model_len_that_fits"]) == ("5.52 GiB", 131072)


@pytest.mark.skipif("Qwen3ForCausalLM" not in SUPPORTED_ARCHITECTURES, reason="Qwen3 is not a supported architecture")
def test_qwen3_8b_with_yarn_fits_64k_and_its_06b_draft_does_not():
    status, plan = cli_plan("qwen3-8b-awq", "--max-model-len", "65536")
    assert status == 0 and plan["kv_bytes_per_token"] == 41472 and plan["max_model_len_that_fits"] == 72064
    status, plan = cli_plan("qwen3-8b-awq", "--max-model-len", "65536", "--speculative-draft-config",
                            str(EXAMPLES / "qwen3-0.6b.config.json"))
    assert status == 3 and plan["max_model_len_that_fits"] == 61776
