"""`bie-trt quantize`: round-to-nearest asymmetric 4-bit, written in AutoAWQ gemm format.

Sources: an HF checkpoint directory (fp16/bf16/fp32 safetensors, streamed tensor by tensor)
or a `.gguf` file (dequantised through transformers' GGUF loader).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from ..config import ModelConfig
from ..errors import CheckpointError
from .awq import quantize_rtn
from .loader import TOKENIZER_FILES

_QUANTISED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
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


def quantize_checkpoint(src: str | Path, out: str | Path, group_size: int = 128) -> Path:
    """Quantise `src` into the AutoAWQ gemm checkpoint directory `out`; returns `out`."""
    src, out = Path(src), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if src.suffix == ".gguf":
        if not src.is_file():
            raise CheckpointError(f"{src}: no such GGUF file.")
        hf, tensors = _load_gguf(src, out)
        total = len(tensors)
    else:
        cfg = src / "config.json"
        if not cfg.exists():
            raise CheckpointError(f"{cfg}: missing; `--model` needs an HF checkpoint directory or a .gguf file.")
        hf = json.loads(cfg.read_text())
        if "quantization_config" in hf:
            raise CheckpointError(f"{src} is already quantised ({hf['quantization_config'].get('quant_method')}); quantise an fp16/bf16/fp32 checkpoint.")
        if not any((src / f).exists() for f in TOKENIZER_FILES):
            raise CheckpointError(f"{src}: no tokenizer files (expected one of {', '.join(TOKENIZER_FILES)}).")
        for f in TOKENIZER_FILES + _TOKENIZER_EXTRA:
            if (src / f).exists():
                shutil.copyfile(src / f, out / f)
        tensors, total = _hf_tensors(src), None
    model = ModelConfig.from_hf(hf, str(src))
    for name, k in (("hidden_size", model.hidden_size), ("intermediate_size", model.intermediate_size),
                    ("attention output (heads*head_dim)", model.q_size)):
        if k % group_size:
            raise CheckpointError(f"group size {group_size} does not divide {name} = {k}; pick one that does (e.g. 64 or 32).")

    result: dict[str, torch.Tensor] = {}
    for name, t in tqdm(tensors, total=total, desc="quantize", unit="tensor", leave=False):
        if name == "lm_head.weight" and model.tie_word_embeddings:
            continue
        base, _, leaf = name.rpartition(".")
        if leaf == "weight" and base.rsplit(".", 1)[-1] in _QUANTISED:
            qweight, qzeros, scales = quantize_rtn(t.float().t().contiguous(), group_size)
            result.update({f"{base}.qweight": qweight, f"{base}.qzeros": qzeros, f"{base}.scales": scales})
        else:
            result[name] = t.to(torch.float16)
    save_file(result, str(out / "model.safetensors"))
    hf["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group_size,
                                 "version": "gemm", "zero_point": True}
    hf.setdefault("architectures", [model.architecture])
    hf["torch_dtype"] = "float16"
    (out / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True))
    return out
