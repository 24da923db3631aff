"""The reference `bie-trt eval --reference FILE.gguf` scores an engine against: transformers' own model
class on the weights the `gguf` package dequantises from the file (fp32), so the comparison measures what
the engine's conversion (and its KV cache) cost, not a second implementation's choices."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from ..config import ModelConfig
from ..errors import BieError


_SHAPE = ("architecture", "num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim",
          "vocab_size")


def gguf_reference(path: str | Path, engine_model: ModelConfig) -> Callable[[list[int]], torch.Tensor]:
    """ids -> logits [len(ids), V] of the GGUF's model; refused unless its shape is the engine's."""
    from transformers import AutoModelForCausalLM

    from .checkpoint.gguf_checkpoint import GGUFCheckpoint

    path = Path(path)
    file_model = GGUFCheckpoint(path).model   # checks the file (one error naming it) before loading it
    for field in _SHAPE:
        if getattr(file_model, field) != getattr(engine_model, field):
            raise BieError(f"{path} is not the model this engine was built from: its {field} is "
                           f"{getattr(file_model, field)}, the engine's {getattr(engine_model, field)}.")
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                 attn_implementation="eager").eval()

    def logits(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0]

    return logits
