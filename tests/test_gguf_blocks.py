"""GGUF linears kept in the file's own block formats (Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, and floats
beside them): the plain-torch dequantisers equal the `gguf` package's (independent math) bit for bit, the
Triton kernel (interpreted) equals its twin, and a tiny file written by the `gguf` package, built, gives
the file's weights bit for bit and transformers' greedy tokens."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from bie_trt.builder.checkpoint.gguf_checkpoint import GGUFCheckpoint
from bie_trt.builder.checkpoint.loader import FUSED
from bie_trt.builder.key_centering import CALIBRATION_TEXT
from bie_trt.config import EngineConfig
from bie_trt.executor.engine import BieEngine
from bie_trt.kernels.gguf_blocks import BLOCK_FORMATS, BlockPart, BlockWeight, block_linear_ref, dequantize, \
    from_tensors
from bie_trt.sampling_params import SamplingParams
from tiny_gguf import k_quant_bytes, write_tiny_gguf

QUANTISED = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
# Every linear of a layer in another format, as a Q4_K_M file mixes them; in-features of 256 for the K-quants.
MIXED = {"attn_q": "Q5_0", "attn_k": "Q5_1", "attn_v": "Q6_K", "attn_output": "Q4_K", "ffn_gate": "Q5_K",
         "ffn_up": "Q8_0", "ffn_down": "Q4_1"}
WIDE = {"hidden": 256, "intermediate": 512}


def _raw(fmt: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """A tensor's bytes in `fmt`: the gguf package's quantisation of normal weights, or random K-quant blocks
    (every code, scale and minimum bit pattern), or the floats themselves."""
    rng = np.random.default_rng(seed)
    if fmt.endswith("_K"):
        return k_quant_bytes(rng, fmt, n, k)
    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    if fmt == "F32":
        return w.view(np.uint8)
    if fmt == "F16":
        return w.astype(np.float16).view(np.uint8)
    if fmt == "BF16":
        return torch.from_numpy(w).bfloat16().view(torch.uint8).numpy()
    return gguf.quants.quantize(w, gguf.GGMLQuantizationType[fmt])


@pytest.mark.parametrize("fmt", QUANTISED)
def test_each_formats_dequantiser_is_the_gguf_packages_bit_for_bit(fmt):
    raw = _raw(fmt, 6, 512)
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[fmt])
    assert torch.equal(dequantize(fmt, torch.from_numpy(raw)), torch.from_numpy(want))


def _spread_columns(k: int) -> list[int]:
    """32 input positions touching every 32-weight run of the first 512 weights' two halves (low / high
    nibbles, a Q6_K scale's two 16-weight groups), in a different place in each."""
    return [32 * s + (7 * s + 16 * (s % 2)) % 32 for s in range(k // 32)][:32]


@pytest.mark.parametrize("fmt", list(BLOCK_FORMATS))
def test_the_triton_kernel_computes_with_exactly_the_twins_weights(fmt, monkeypatch):
    """Interpreted: x one-hot at 16 positions reads the kernel's dequantised weights out exactly; random
    x with a bias and a residual, two row tiles and a ragged last column tile, against the twin."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from bie_trt.kernels.triton_gguf import block_linear_triton

    n, k = 40, 512
    w = BlockWeight([BlockPart(fmt, torch.from_numpy(np.ascontiguousarray(_raw(fmt, n, k, seed=1))))])
    cols = _spread_columns(k)
    got = block_linear_triton(torch.eye(k)[cols], w)
    assert torch.equal(got, dequantize(fmt, w.parts[0].raw)[:, cols].t())
    gen = torch.Generator().manual_seed(0)
    x, res = torch.randn(17, k, generator=gen), torch.randn(17, n, generator=gen)
    w.bias = torch.randn(n, generator=gen)
    torch.testing.assert_close(block_linear_triton(x, w, residual=res), block_linear_ref(x, w) + res,
                               rtol=1e-5, atol=1e-5)


def test_a_fused_linear_of_several_formats_stacks_its_parts():
    """qkv with q and k in one format and v in another: each part's rows in its own launch, in order."""
    pytest.importorskip("triton")
    import os

    os.environ.setdefault("TRITON_INTERPRET", "1")
    from bie_trt.kernels.triton_gguf import block_linear_triton

    parts = [BlockPart(f, torch.from_numpy(np.ascontiguousarray(_raw(f, n, 256, seed=n))))
             for f, n in (("Q5_0", 32), ("Q6_K", 16))]
    w = BlockWeight(parts)
    x = torch.randn(3, 256)
    want = x @ torch.cat([dequantize(p.fmt, p.raw) for p in parts]).t()
    torch.testing.assert_close(block_linear_triton(x, w), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(block_linear_ref(x, w), want, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def tiny_mixed(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf-blocks") / "tiny-mixed.gguf", linear_type=MIXED,
                           **WIDE)


@pytest.fixture(scope="module")
def hf_mixed(tiny_mixed):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_mixed.parent, gguf_file=tiny_mixed.name, dtype=torch.float32,
                                                attn_implementation="eager").eval()


def test_a_mixed_file_is_built_with_every_linear_the_files_bit_for_bit(build, tiny_mixed, hf_mixed):
    engine = build(checkpoint=str(tiny_mixed), max_model_len=1024, kv_cache_dtype="fp16")
    weights = load_file(str(engine / "weights.safetensors"))
    for i, layer in enumerate(hf_mixed.model.layers):
        for name, parts in FUSED.items():
            got = BlockWeight(from_tensors(weights, f"layers.{i}.{name}", torch.device("cpu"))).dequantize()
            assert torch.equal(got, torch.cat([layer.get_submodule(p).weight for p in parts])), (i, name)
    conv = GGUFCheckpoint(tiny_mixed).conversion("fp16")
    assert conv["linear_blocks"] == {f: 2 for f in sorted(MIXED.values())} and conv["linear_requantised"] == {}

    bie = BieEngine(EngineConfig(engine_dir=str(engine), device="cpu"))
    ids = bie.tokenizer(CALIBRATION_TEXT.read_text())["input_ids"][:40]
    with torch.no_grad():
        ref = hf_mixed.generate(torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16,
                                do_sample=False)[0].tolist()[len(ids):]
    assert bie.generate(ids, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)).token_ids == ref


def test_the_plan_counts_each_linears_own_bytes(tiny_mixed):
    ckpt = GGUFCheckpoint(tiny_mixed)
    want = sum(int(t.n_bytes) for t in ckpt.reader.tensors if t.name.startswith("blk.") and
               t.tensor_type.name in MIXED.values() and not t.name.endswith("norm.weight"))
    assert ckpt.linear_bytes == want
