"""transformers' own model class (LlamaForCausalLM, Qwen3ForCausalLM, Gemma3ForCausalLM, ...) on a checkpoint's dequantised
weights: the independent reference model; and the engine's logits of a prompt and a continuation."""
from __future__ import annotations

import random
from collections import deque
from pathlib import Path

import torch

from bie_trt.builder.checkpoint.loader import Checkpoint
from bie_trt.executor.engine import BieEngine
from bie_trt.executor.model_runner import ModelRunner
from bie_trt.executor.sequence import Sequence
from bie_trt.kernels.awq import awq_dequantize
from bie_trt.kernels.step_inputs import SeqInput
from bie_trt.sampling import make_generator
from bie_trt.sampling_params import SamplingParams


def greedy_reference(model, prompt_tokens: int, greedy_tokens: int) -> tuple[list[int], list[int], torch.Tensor]:
    """A seeded random prompt of `prompt_tokens` ids under 256, transformers' greedy continuation of exactly
    `greedy_tokens`, and its logits over prompt and continuation: (prompt, continuation, logits)."""
    ids = torch.randint(0, 256, (prompt_tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=greedy_tokens, min_new_tokens=greedy_tokens,
                             do_sample=False)[0].tolist()
        logits = model(torch.tensor([out])).logits[0]
    return ids, out[len(ids):], logits

def hf_model(ckpt: Checkpoint):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = {k: v for k, v in ckpt.hf_config.items() if k != "quantization_config"}
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    sd = {"model.embed_tokens.weight": ckpt.tensor("model.embed_tokens.weight").float(),
          "model.norm.weight": ckpt.tensor("model.norm.weight").float()}
    G = ckpt.quant.group_size
    norms = ["input_layernorm", "post_attention_layernorm"]
    if ckpt.model.sandwich_norms:
        norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    if ckpt.model.qk_norm:
        norms += ["self_attn.q_norm", "self_attn.k_norm"]
    for i in range(ckpt.model.num_layers):
        p = f"model.layers.{i}."
        for sub in ckpt.linear_shapes(i):
            t = [ckpt.tensor(p + sub + s) for s in (".qweight", ".qzeros", ".scales")]
            sd[p + sub + ".weight"] = awq_dequantize(*t, G).t().contiguous()
            if ckpt.model.qkv_bias and sub in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
                sd[p + sub + ".bias"] = ckpt.tensor(p + sub + ".bias").float()
        for norm in norms:
            sd[p + norm + ".weight"] = ckpt.tensor(p + norm + ".weight").float()
    if not ckpt.model.tie_word_embeddings:
        sd["lm_head.weight"] = ckpt.tensor("lm_head.weight").float()
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    return model


def run_engine_logits(engine: BieEngine, ids: list[int], continuation: list[int], scatter: bool,
                      chunk: int) -> list[torch.Tensor]:
    """Prefill `ids` in chunks (logits for every position), then decode the given continuation."""
    runner: ModelRunner = engine.core.runner
    blocks = runner.block_manager()
    if scatter:
        order = list(blocks.free_fp)
        random.Random(0).shuffle(order)
        blocks.free_fp = deque(order)
    seq = Sequence(list(ids), SamplingParams(temperature=0), make_generator(SamplingParams(), 0))
    rows = []
    for start in range(0, len(ids), chunk):
        part = ids[start:start + chunk]
        blocks.grow(seq, start + len(part))
        rows.append(runner.forward([SeqInput(torch.tensor(part), start, seq.block_table, all_logits=True,
                                             sliding_table=seq.sliding_table or None)])[0])
        seq.num_cached = start + len(part)
        if blocks.sliding is not None:   # a hybrid model's sliding layers give back what left their window
            blocks.sliding.slide(seq)
    for t in continuation:
        blocks.grow(seq, seq.num_cached + 1)
        rows.append(runner.forward([SeqInput(torch.tensor([t]), seq.num_cached, seq.block_table,
                                             sliding_table=seq.sliding_table or None)])[0][None])
        seq.num_cached += 1
        if blocks.sliding is not None:
            blocks.sliding.slide(seq)
    if scatter:
        assert seq.block_table != sorted(seq.block_table)
    blocks.free(seq)
    return rows


def quantize_and_build(root: Path, group_size: int, *build_args: str) -> tuple[Path, Path]:
    """The checkpoint transformers wrote in root/hf (with its tokenizer) packed by `bie-trt quantize` into
    root/awq and built by `bie-trt build` (CPU profile, FP16 KV, `build_args` more) into root/engine:
    (the engine directory, the AWQ checkpoint)."""
    from click.testing import CliRunner

    from bie_trt.cli import main

    r = CliRunner().invoke(main, ["quantize", "--model", str(root / "hf"), "--out", str(root / "awq"),
                                  "--group-size", str(group_size)])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["build", "--checkpoint", str(root / "awq"), "--out", str(root / "engine"),
                                  "--profile", "cpu", "--kv-cache-dtype", "fp16", *build_args])
    assert r.exit_code == 0, r.output
    return root / "engine", root / "awq"
