"""Families the decoder runs but the build cannot yet turn into an engine: refused by name, before any tensor
is read, with what is there and what is missing (rather than a missing-tensor error from the loader)."""
from __future__ import annotations

from ...config import SUPPORTED_ARCHITECTURES, ModelConfig
from ...errors import CheckpointError

# family -> what is in place and what is missing
NOT_YET_BUILT: dict[str, str] = {
    "gemma4": ("Gemma 4 is not supported by `bie-trt build` yet. In place: the decoder's Gemma 4 switches "
               "(per-layer embeddings, KV-shared layers, 512-wide full heads, K = V, proportional RoPE; checked "
               "against transformers' Gemma4ForCausalLM on a tiny random model) and `bie-trt plan`, which plans "
               "it. Missing: reading a Gemma 4 checkpoint (AWQ or GGUF) into an engine, its chat template, and "
               "CUDA graphs with per-layer embeddings."),
}


def buildable_architectures() -> list[str]:
    return sorted(a for a, family in SUPPORTED_ARCHITECTURES.items() if family not in NOT_YET_BUILT)


def refuse_unbuilt(model: ModelConfig, source: str) -> None:
    """CheckpointError naming the architecture when the build cannot make an engine of its family yet."""
    why = NOT_YET_BUILT.get(model.family)
    if why is not None:
        raise CheckpointError(f"{source}: {model.architecture}: {why} Buildable architectures: "
                              f"{', '.join(buildable_architectures())}.")
