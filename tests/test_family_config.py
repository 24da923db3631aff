"""What a model family declares through its config rather than the executor knowing it by name: the tokens
that end a reply besides the checkpoint's eos ids (Gemma 3's end of turn, which its GGUF releases leave out)."""
from __future__ import annotations

import json
from pathlib import Path

from bie_trt.config import ModelConfig

EXAMPLES = Path(__file__).resolve().parents[1] / "docs" / "examples"


def test_gemma3_declares_its_end_of_turn_and_others_nothing():
    gemma = ModelConfig.from_hf(json.loads((EXAMPLES / "gemma-3-4b-it-awq.config.json").read_text()))
    assert gemma.stop_tokens == ("<end_of_turn>",)
    for other in ("llama-3.2-1b-instruct", "qwen3-0.6b"):
        assert ModelConfig.from_hf(json.loads((EXAMPLES / f"{other}.config.json").read_text())).stop_tokens == ()
