"""`bie-trt quantize`: round-to-nearest asymmetric 4-bit, written in AutoAWQ gemm format.

Sources: an HF checkpoint directory (fp16/bf16/fp32 safetensors, streamed tensor by tensor)
or a `.gguf` file (dequantised through transformers' GGUF loader).
"""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from ...config import ModelConfig
from ...errors import CheckpointError
from ...kernels.awq import quantize_rtn
from ...plan import AWQ_GROUP_SIZES
from .gguf_header import gguf_linear_sizes
from .loader import MULTIMODAL, TEXT_TOWER_PREFIXES, TOKENIZER_FILES
from .qwen35_weights import FP32_TENSORS

# Qwen3.5's DeltaNet linears too, but for in_proj_b / in_proj_a (qwen35_weights.DENSE_LINEARS)
_QUANTISED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
              "in_proj_qkv", "in_proj_z", "out_proj")
_TOKENIZER_EXTRA = ("special_tokens_map.json", "generation_config.json", "chat_template.jinja")


def _hf_tensors(src: Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{src}: no *.safetensors weights to quantise.")
    for f in files:
        with safe_open(f, "pt") as h:
            for name in sorted(h.keys()):
                yield name, h.get_tensor(name)


def _load_gguf(path: Path, out: Path) -> tuple[dict, list[tuple[str, torch.Tensor]]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as e:  # transformers raises many kinds here; the file is what is wrong
        raise CheckpointError(f"{path}: transformers could not read this GGUF file ({e}).") from e
    tok.save_pretrained(out)
    hf = model.config.to_dict()
    hf.pop("quantization_config", None)
    hf["architectures"] = [type(model).__name__]
    return hf, sorted(model.state_dict().items())


def choose_group_size(sizes: dict[str, int], group_size: int | None) -> int:
    """`group_size` if it divides every size, or by default the largest of AWQ_GROUP_SIZES that does."""
    fits = [g for g in AWQ_GROUP_SIZES if all(k % g == 0 for k in sizes.values())]
    if group_size is None:
        if not fits:
            raise CheckpointError(f"no group size of {', '.join(map(str, AWQ_GROUP_SIZES))} divides this model's "
                                  f"sizes {sizes}; it cannot be 4-bit AWQ-packed.")
        return fits[0]
    for name, k in sizes.items():
        if k % group_size:
            advice = f"use --group-size {' or '.join(map(str, fits))}" if fits else "no group size the kernels take fits"
            raise CheckpointError(f"group size {group_size} does not divide {name} = {k}; {advice}.")
    return group_size


def _linear_sizes(model: ModelConfig) -> dict[str, int]:
    sizes = {"hidden_size": model.hidden_size, "intermediate_size": model.intermediate_size,
             "attention output (heads*head_dim)": model.q_size}
    if model.global_head_dim:   # Gemma 4's full layers' o_proj reads their wider heads
        sizes["full layers' attention output (heads*global_head_dim)"] = model.num_heads * model.global_head_dim
    if model.linear_layers:   # Qwen3.5's out_proj reads the DeltaNet's values
        sizes["DeltaNet values (linear_num_value_heads*linear_value_head_dim)"] = \
            model.linear_num_value_heads * model.linear_value_head_dim
    return sizes


def _check_source(src: Path) -> dict[str, int]:
    """Refuse a bad source before any weight is read; returns the sizes a group must divide."""
    if src.suffix == ".gguf":
        if not src.is_file():
            raise CheckpointError(f"{src}: no such GGUF file.")
        return gguf_linear_sizes(src)
    cfg = src / "config.json"
    if not cfg.exists():
        raise CheckpointError(f"{cfg}: missing; `--model` needs an HF checkpoint directory or a .gguf file.")
    hf = json.loads(cfg.read_text())
    if "quantization_config" in hf:
        raise CheckpointError(f"{src} is already quantised ({hf['quantization_config'].get('quant_method')}); quantise an fp16/bf16/fp32 checkpoint.")
    if not any((src / f).exists() for f in TOKENIZER_FILES):
        raise CheckpointError(f"{src}: no tokenizer files (expected one of {', '.join(TOKENIZER_FILES)}).")
    return _linear_sizes(ModelConfig.from_hf(hf, str(src)))


def quantize_checkpoint(src: str | Path, out: str | Path, group_size: int | None = None, force: bool = False) -> Path:
    """Quantise `src` into the AutoAWQ gemm checkpoint directory `out`; returns `out`. Everything is
    checked before the weights are read; the result is written beside `out` and renamed into place at the
    end, so a failure leaves no partial checkpoint. A non-empty `out` is replaced only with `force`."""
    src, out = Path(src), Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise CheckpointError(f"{out} exists and is not empty; pass --force to replace it, or choose another --out.")
    group_size = choose_group_size(_check_source(src), group_size)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        _quantize_into(src, work, group_size)
        if out.is_dir():
            shutil.rmtree(out)
        elif out.exists():
            out.unlink()
        work.rename(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


def _quantize_into(src: Path, out: Path, group_size: int) -> None:
    if src.suffix == ".gguf":
        hf, tensors = _load_gguf(src, out)
        total = len(tensors)
    else:
        hf = json.loads((src / "config.json").read_text())
        for f in TOKENIZER_FILES + _TOKENIZER_EXTRA:
            if (src / f).exists():
                shutil.copyfile(src / f, out / f)
        tensors, total = _hf_tensors(src), None
    model = ModelConfig.from_hf(hf, str(src))
    choose_group_size(_linear_sizes(model), group_size)   # the loaded config must agree with the header

    result: dict[str, torch.Tensor] = {}
    text_only = model.architecture in MULTIMODAL   # the engine runs the text tower: the vision tower is left out
    for name, t in tqdm(tensors, total=total, desc="quantize", unit="tensor", leave=False):
        if name == "lm_head.weight" and model.tie_word_embeddings:
            continue
        if text_only and not name.startswith(tuple(TEXT_TOWER_PREFIXES)):
            continue
        base, _, leaf = name.rpartition(".")
        if leaf == "weight" and base.rsplit(".", 1)[-1] in _QUANTISED:
            qweight, qzeros, scales = quantize_rtn(t.float().t().contiguous(), group_size)
            result.update({f"{base}.qweight": qweight, f"{base}.qzeros": qzeros, f"{base}.scales": scales})
        elif leaf in FP32_TENSORS:
            result[name] = t.float()
        else:
            result[name] = t.to(torch.float16)
    save_file(result, str(out / "model.safetensors"))
    hf["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group_size,
                                 "version": "gemm", "zero_point": True}
    hf.setdefault("architectures", [model.architecture])
    hf["torch_dtype"] = "float16"
    (out / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True))
