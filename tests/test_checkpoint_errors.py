"""Every malformed checkpoint gets one clear error naming the file or tensor, expected vs found."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from bie_trt.builder.checkpoint.loader import Checkpoint
from bie_trt.builder.checkpoint.quantize import quantize_checkpoint
from bie_trt.config import ModelConfig
from bie_trt.errors import CheckpointError
from tiny_model import TINY, TINY_QWEN3, write_tiny_hf


@pytest.fixture(scope="module")
def tiny_awq(tmp_path_factory, smollm2_checkpoint):
    root = tmp_path_factory.mktemp("tiny")
    hf = write_tiny_hf(root / "hf", smollm2_checkpoint)
    return quantize_checkpoint(hf, root / "awq", group_size=32)


@pytest.fixture
def ckpt(tiny_awq, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_awq, dst)
    return dst


def edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if key == "quantization_config":
            cfg[key].update(value)
        else:
            cfg[key] = value
    (path / "config.json").write_text(json.dumps(cfg))


def edit_tensor(path, name, value):
    t = load_file(str(path / "model.safetensors"))
    if value is None:
        del t[name]
    else:
        t[name] = value
    save_file(t, str(path / "model.safetensors"))


def test_valid_tiny_checkpoint_loads(ckpt):
    c = Checkpoint(ckpt)
    assert c.quant.group_size == 32 and c.model.num_layers == 2 and c.model.head_dim == 16


def expect(path, *fragments):
    with pytest.raises(CheckpointError) as e:
        Checkpoint(path)
    msg = str(e.value)
    for f in fragments:
        assert f in msg, msg
    return msg


def test_missing_config(ckpt):
    (ckpt / "config.json").unlink()
    expect(ckpt, "config.json", "missing")


def test_missing_tokenizer(ckpt):
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (ckpt / f).unlink()
    expect(ckpt, "no tokenizer files", "tokenizer.json")


def test_missing_weights(ckpt):
    (ckpt / "model.safetensors").unlink()
    expect(ckpt, "no weights", "safetensors")


def test_bits_not_4(ckpt):
    edit_config(ckpt, quantization_config={"bits": 8})
    expect(ckpt, "bits is 8", "4-bit")


def test_version_not_gemm(ckpt):
    edit_config(ckpt, quantization_config={"version": "gemv"})
    expect(ckpt, "version is 'gemv'", "gemm")


def test_zero_point_false(ckpt):
    edit_config(ckpt, quantization_config={"zero_point": False})
    expect(ckpt, "zero_point is false")


def test_not_awq(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    del cfg["quantization_config"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    expect(ckpt, "not an AWQ checkpoint", "bie-trt quantize")


def test_group_size_not_dividing(ckpt):
    edit_config(ckpt, quantization_config={"group_size": 48})
    expect(ckpt, "group_size 48 does not divide in_features 64")


def test_wrong_shape(ckpt):
    edit_tensor(ckpt, "model.layers.1.mlp.down_proj.qweight", torch.zeros(128, 4, dtype=torch.int32))
    expect(ckpt, "model.layers.1.mlp.down_proj.qweight", "expected shape [128, 8]", "found [128, 4]")


def test_wrong_dtype(ckpt):
    edit_tensor(ckpt, "model.layers.0.self_attn.q_proj.scales", torch.zeros(2, 64, dtype=torch.float32))
    expect(ckpt, "model.layers.0.self_attn.q_proj.scales", "expected dtype float16", "found float32")


def test_missing_tensor(ckpt):
    edit_tensor(ckpt, "model.layers.0.post_attention_layernorm.weight", None)
    expect(ckpt, "model.layers.0.post_attention_layernorm.weight", "missing")


def test_unsupported_architecture(ckpt):
    edit_config(ckpt, architectures=["GPT2LMHeadModel"])
    expect(ckpt, "unsupported architecture", "GPT2LMHeadModel", "LlamaForCausalLM", "Qwen3ForCausalLM")
    with pytest.raises(CheckpointError) as e:
        Checkpoint(ckpt)
    assert "\n" not in str(e.value)   # one line


@pytest.fixture(scope="module")
def tiny_qwen3_awq(tmp_path_factory, smollm2_checkpoint):
    root = tmp_path_factory.mktemp("tiny-qwen3")
    return quantize_checkpoint(write_tiny_hf(root / "hf", smollm2_checkpoint, **TINY_QWEN3), root / "awq",
                               group_size=32)


@pytest.fixture
def qwen3_ckpt(tiny_qwen3_awq, tmp_path):
    return shutil.copytree(tiny_qwen3_awq, tmp_path / "qwen3")


def test_qwen3_checkpoint_loads(qwen3_ckpt):
    m = Checkpoint(qwen3_ckpt).model
    assert m.qk_norm and (m.head_dim, m.q_size, m.hidden_size) == (32, 128, 64)


def test_qwen3_without_its_k_norm(qwen3_ckpt):
    edit_tensor(qwen3_ckpt, "model.layers.1.self_attn.k_norm.weight", None)
    expect(qwen3_ckpt, "model.layers.1.self_attn.k_norm.weight", "missing", "[32]")


def test_qwen3_q_norm_over_the_wrong_size(qwen3_ckpt):
    edit_tensor(qwen3_ckpt, "model.layers.0.self_attn.q_norm.weight", torch.ones(64, dtype=torch.float16))
    expect(qwen3_ckpt, "model.layers.0.self_attn.q_norm.weight", "expected shape [32]", "found [64]")


def test_sliding_window_attention_is_refused(qwen3_ckpt):
    edit_config(qwen3_ckpt, use_sliding_window=True, sliding_window=32)
    expect(qwen3_ckpt, "use_sliding_window", "sliding_window=32", "false")


def test_qwen3_head_dim_defaults_as_transformers_does():
    """A Qwen3 config.json without head_dim: transformers' Qwen3Config default, not hidden / heads."""
    from transformers import Qwen3Config

    hf = {**TINY, **TINY_QWEN3}
    del hf["head_dim"]
    assert ModelConfig.from_hf(hf).head_dim == Qwen3Config(**hf).head_dim != hf["hidden_size"] // hf["num_attention_heads"]
    assert ModelConfig.from_hf(TINY).head_dim == TINY["hidden_size"] // TINY["num_attention_heads"]


def test_sharded_index_with_missing_shard(ckpt):
    (ckpt / "model.safetensors").rename(ckpt / "model-00001-of-00002.safetensors")
    names = load_file(str(ckpt / "model-00001-of-00002.safetensors")).keys()
    wm = {n: "model-00001-of-00002.safetensors" for n in names}
    wm["lm_head.weight"] = "model-00002-of-00002.safetensors"
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    expect(ckpt, "model-00002-of-00002.safetensors", "missing")


def test_sharded_checkpoint_loads(ckpt):
    t = load_file(str(ckpt / "model.safetensors"))
    (ckpt / "model.safetensors").unlink()
    names = sorted(t)
    half = len(names) // 2
    parts = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for f, ns in parts.items():
        save_file({n: t[n] for n in ns}, str(ckpt / f))
    (ckpt / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {n: f for f, ns in parts.items() for n in ns}}))
    c = Checkpoint(ckpt)
    assert torch.equal(c.tensor(names[-1]), t[names[-1]])


def test_quantize_refuses_bad_group(tmp_path, smollm2_checkpoint):
    hf = write_tiny_hf(tmp_path / "hf", smollm2_checkpoint)
    with pytest.raises(CheckpointError, match="group size 48 does not divide"):
        quantize_checkpoint(hf, tmp_path / "out", group_size=48)
