"""Reading Gemma 3 configs and checkpoints: the text tower of the multimodal releases (their published
config, which leaves most fields to transformers' defaults), its tensors under either naming, the vision
tower left out by `quantize`, and what is refused by name."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from bie_trt.builder.checkpoint.loader import Checkpoint
from bie_trt.builder.checkpoint.quantize import quantize_checkpoint
from bie_trt.config import ModelConfig
from bie_trt.errors import CheckpointError
from bie_trt.kernels.rope import Rope
from tiny_model import TINY_GEMMA3, write_tiny_hf

EXAMPLES = Path(__file__).resolve().parents[1] / "docs" / "examples"


def test_the_4b_multimodal_config_reads_as_its_text_tower():
    cfg = ModelConfig.from_hf(json.loads((EXAMPLES / "gemma-3-4b-it-awq.config.json").read_text()))
    assert cfg.family == "gemma3" and (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads,
                                       cfg.head_dim, cfg.vocab_size) == (2560, 34, 8, 4, 256, 262_208)
    # one full layer in every six (5, 11, 17, 23, 29), the others over a 1,024-position window
    assert [i for i in range(34) if not cfg.window_of(i)] == [5, 11, 17, 23, 29] and cfg.window_of(0) == 1024
    assert (cfg.rope_theta, cfg.local_rope_theta, cfg.rope_scaling.rope_type, cfg.rope_scaling.factor) == (
        1e6, 1e4, "linear", 8.0)
    assert cfg.eos_token_ids == (1, 106) and cfg.tie_word_embeddings and cfg.query_pre_attn_scalar == 256
    assert cfg.max_positions == 131_072 and cfg.embed_scale == pytest.approx(2560 ** 0.5)
    rope = Rope(cfg, torch.device("cpu"))   # linear scaling on the full layers only
    exponents = torch.arange(0, 256, 2, dtype=torch.float64) / 256
    assert torch.allclose(rope.inv_freq, (1 / 1e6 ** exponents / 8).float())
    assert torch.allclose(rope.local_inv_freq, (1 / 1e4 ** exponents).float())
    assert rope.inv_freq_of(5) is rope.inv_freq and rope.inv_freq_of(4) is rope.local_inv_freq


def test_gemma2_score_capping_is_refused_by_name():
    hf = {**TINY_GEMMA3, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
          "num_key_value_heads": 2, "vocab_size": 256, "attn_logit_softcapping": 50.0}
    with pytest.raises(CheckpointError, match="attn_logit_softcapping"):
        ModelConfig.from_hf(hf)


def test_a_multimodal_checkpoint_is_quantised_and_read_as_its_text_tower(tmp_path, smollm2_checkpoint):
    """The text tower under transformers' current names (model.language_model.*) beside a vision tower
    whose sizes no AWQ group divides: quantize leaves the vision tower out, the loader finds the text model."""
    hf = write_tiny_hf(tmp_path / "hf", smollm2_checkpoint, **TINY_GEMMA3)
    text = json.loads((hf / "config.json").read_text())
    tensors = {k.replace("model.", "model.language_model.", 1): v for k, v in load_file(hf / "model.safetensors").items()}
    tensors["model.vision_tower.vision_model.encoder.layers.0.self_attn.q_proj.weight"] = torch.zeros(1152, 4304).half()
    save_file(tensors, str(hf / "model.safetensors"))
    (hf / "config.json").write_text(json.dumps({"architectures": ["Gemma3ForConditionalGeneration"],
                                                "model_type": "gemma3", "text_config": text}))
    ckpt = Checkpoint(quantize_checkpoint(hf, tmp_path / "awq", group_size=32))
    assert ckpt.model.architecture == "Gemma3ForConditionalGeneration" and ckpt.model.sliding_layers == (0, 1)
    assert ckpt.tensor("model.layers.2.self_attn.q_proj.qweight").dtype == torch.int32
    assert not any("vision" in name for name in load_file(tmp_path / "awq" / "model.safetensors"))
