"""A tiny random Gemma 4 through the whole path: transformers writes it as real safetensors, `bie-trt quantize`
packs it, `bie-trt build` makes an engine, and the engine's greedy tokens equal transformers'
Gemma4ForCausalLM over a prompt of several windows in several chunks, again through a prefix-cache hit and with
n-gram speculation; its chat template writes Gemma 4's documented turns, and its turn's end and a tool wait
stop a reply; the CUDA graphs' static step feeds the per-layer rows as the eager forward does."""
from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open

from bie_trt.cli import main
from bie_trt.config import EngineConfig, KVCacheConfig
from bie_trt.executor.engine import BieEngine
from bie_trt.kernels.step_inputs import SeqInput
from bie_trt.kv.pool import allocate_kv
from bie_trt.model.cuda_graphs import DecodeGraphs
from bie_trt.model.synthetic import write_word_tokenizer
from bie_trt.sampling_params import SamplingParams
from gemma4_tiny import GREEDY_TOKENS, engine_model
from hf_reference import quantize_and_build, run_engine_logits
from qwen35_tiny import GROUP

CHUNK = 40   # a 100-token prompt in three chunks, each longer than the 24-position window
# Gemma 4's control tokens, added to the word tokenizer as its release has them: one id each.
CONTROL_TOKENS = ["<|turn>", "<turn|>", "<|tool>", "<tool|>", "<|tool_call>", "<tool_call|>", "<|tool_response>",
                  "<tool_response|>", '<|"|>']


def greedy(max_tokens: int = GREEDY_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def write_tokenizer(out) -> None:
    from transformers import PreTrainedTokenizerFast

    write_word_tokenizer(out)
    tok = PreTrainedTokenizerFast.from_pretrained(out)
    tok.add_special_tokens({"bos_token": "<bos>", "additional_special_tokens": CONTROL_TOKENS})
    tok.save_pretrained(out)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, gemma4_reference):
    """(the engine directory, the AWQ checkpoint): the model written by transformers (the multimodal release's
    names are read the same way: loader.TEXT_TOWER_PREFIXES), packed by `bie-trt quantize` and built; its
    weights are W4-exact and fp16, so the engine and transformers run the same numbers."""
    root = tmp_path_factory.mktemp("gemma4")
    gemma4_reference[0].save_pretrained(root / "hf")
    write_tokenizer(root / "hf")
    return quantize_and_build(root, GROUP, "--max-model-len", "512", "--max-num-seqs", "2",
                              "--chunked-prefill-size", str(CHUNK))


@pytest.fixture(scope="module")
def engine(tiny):
    return BieEngine(EngineConfig(engine_dir=str(tiny[0]), device="cpu"))


def test_the_engine_holds_the_text_model_as_built(tiny):
    """W4 linears, q/k only where a layer owns its cache (k = v on the full ones), the per-layer table and its
    projections dense fp16, no mean key (the keys of the two layer kinds differ in shape), and why."""
    with safe_open(tiny[0] / "weights.safetensors", "pt") as f:
        shapes = {name: f.get_slice(name).get_shape() for name in f.keys()}
        dtypes = {name: f.get_slice(name).get_dtype() for name in f.keys()}
    # qkv rows: sliding layer 0 [4 x 32 | 2 x 32 | 2 x 32], full layer 2 [4 x 64 | 1 x 64], shared layer 5 [4 x 64]
    assert [shapes[f"layers.{i}.qkv.scales"][0] for i in (0, 2, 4, 5)] == [256, 320, 128, 256]
    assert "layers.4.k_norm" not in shapes and dtypes["layers.4.qkv.qweight"] == "I32"
    assert shapes["per_layer.embed"] == [256, 6 * 16] and dtypes["per_layer.embed"] == "F16"
    assert dtypes["layers.3.per_layer_gate"] == dtypes["layers.3.layer_scalar"] == "F16"
    assert "kv.key_mean" not in shapes
    manifest = json.loads((tiny[0] / "manifest.json").read_text())
    assert not manifest["kv"]["key_centering"] and "differ in shape" in manifest["kv_choice"]["why"]


def test_plan_of_the_checkpoint_counts_only_owning_layers(tiny):
    plan = CliRunner().invoke(main, ["plan", "--checkpoint", str(tiny[1]), "--profile", "cpu"])
    assert plan.exit_code == 0 and "2 KV-shared layers own no cache" in plan.stdout, plan.output
    assert "kv_key_mean                   0 B" in plan.stdout, plan.stdout


def test_greedy_tokens_equal_transformers_and_again_through_a_prefix_hit(gemma4_reference, engine):
    _, ids, continuation, _ = gemma4_reference
    assert len(ids) > 2 * CHUNK
    assert engine.generate(ids, greedy()).token_ids == continuation
    hits = engine.core.scheduler.prefix_hit_tokens
    assert engine.generate(ids, greedy()).token_ids == continuation
    assert engine.core.scheduler.prefix_hit_tokens >= hits + 64   # the prompt's whole blocks came from the cache


def test_the_built_engines_logits_equal_transformers(gemma4_reference, engine):
    """Every position's logits of the prompt (prefilled in chunks over scattered blocks) and of the greedy
    continuation (decoded) within fp32 rounding of transformers': greedy tokens alone would miss a small
    mix-up of the weights (the tied embedding dominates this tiny model's logits)."""
    _, ids, continuation, hf_logits = gemma4_reference
    ours = torch.cat(run_engine_logits(engine, ids, continuation[:-1], scatter=True, chunk=CHUNK))
    assert (ours - hf_logits[:len(ours)]).abs().max() <= 1e-4 * hf_logits.abs().max()


def test_ngram_speculation_gives_the_greedy_tokens(tiny, gemma4_reference, engine):
    spec = BieEngine(EngineConfig(engine_dir=str(tiny[0]), device="cpu", speculative={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "adaptive": False}))
    ids = gemma4_reference[1][:30] * 3   # a prompt the lookup finds proposals in
    assert spec.generate(ids, greedy(24)).token_ids == engine.generate(ids, greedy(24)).token_ids
    assert spec.core.spec.counts["num_draft_tokens"] > 0


def test_chat_template_writes_gemma4_turns_and_its_stop_tokens_end_a_reply(engine):
    """The engine's template (the checkpoint has none): the documented turns, a tool's declaration, a call and
    its response in Gemma 4's notation; <turn|> and <|tool_response> are among the ids that end a reply."""
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                               "parameters": {"type": "object", "required": ["city"],
                                                              "properties": {"city": {"type": "string"}}}}}]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
                    "name": "get_weather", "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
                {"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "Thanks."}]
    text = engine.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    assert text == ('<bos><|turn>system\nBe brief.<|tool>declaration:get_weather{description:<|"|>Weather now<|"|>,'
                    'parameters:{type:<|"|>object<|"|>,required:[<|"|>city<|"|>],properties:{city:{type:<|"|>string'
                    '<|"|>}}}}<tool|><turn|>\n'
                    '<|turn>user\nWeather in Paris?<turn|>\n'
                    '<|turn>model\n<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>'
                    '<|tool_response>response:get_weather{value:<|"|>sunny<|"|>}<tool_response|>Sunny.<turn|>\n'
                    '<|turn>user\nThanks.<turn|>\n<|turn>model\n')
    ids = engine.tokenizer.convert_tokens_to_ids(["<turn|>", "<|tool_response>", "<|turn>"])
    assert {ids[0], ids[1]} <= engine.core.requests.eos_ids and ids[2] not in engine.core.requests.eos_ids


def test_the_graphs_static_step_feeds_the_per_layer_rows(gemma4_reference):
    """Decodes through DecodeGraphs' static buffers (run eagerly here; captured on CUDA) equal the eager
    forward's over a copy of the cache: the per-layer rows of each step's tokens reach the static step, in a
    full graph and with a padded row."""
    model, _ = engine_model(gemma4_reference[0])
    pools = [allocate_kv(model.cfg, KVCacheConfig(dtype="fp16"), 8, 0, 8, dtype=torch.float32, scratch_block=True)
             for _ in range(2)]
    graphs = DecodeGraphs(model, pools[0], [2], 64, pools[0].scratch_block, capture=False)
    tables, sliding = [[0, 1], [2, 3]], [[0, 1], [2, 3]]
    g, length = torch.Generator().manual_seed(5), [0, 0]
    for t in range(8):
        rows = ([0, 1], [1])[t % 2]   # a full graph, then one row padded to two
        ids = torch.randint(0, 256, (len(rows),), generator=g)
        inputs = [SeqInput(ids[i:i + 1], length[r], tables[r], sliding_table=sliding[r]) for i, r in enumerate(rows)]
        for a, b in zip(graphs.run(inputs), model.forward(inputs, pools[1])):
            assert (a - b).abs().max() <= 1e-5 * b.abs().max()
        for r in rows:
            length[r] += 1
    assert graphs.counts["decode"] == {"graph": 8, "eager": 0}
