"""What a model family declares through its config rather than the executor, the builder or the server
knowing it by name (families.py): the tokens that end a reply besides the checkpoint's eos ids (Gemma 3's end
of turn, which its GGUF releases leave out), the template an engine gets when its checkpoint has none, the
reasoning and tool parsers that read its replies, and the model class that runs it."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from bie_trt import config_gemma3, config_qwen35
from bie_trt.chat.reasoning import PARSERS, resolve_parser
from bie_trt.chat.templates import read_chat_template, shipped_chat_templates
from bie_trt.config import FAMILIES, SUPPORTED_ARCHITECTURES, ModelConfig
from bie_trt.config_text import PLAIN_DECODER
from bie_trt.model.llama import LlamaModel, model_class

EXAMPLES = Path(__file__).resolve().parents[1] / "docs" / "examples"
QWEN3_TEMPLATE = read_chat_template("qwen3")


def example(name: str) -> ModelConfig:
    return ModelConfig.from_hf(json.loads((EXAMPLES / f"{name}.config.json").read_text()))


def test_gemma3_declares_its_end_of_turn_and_others_nothing():
    gemma = example("gemma-3-4b-it-awq")
    assert gemma.declared is config_gemma3.FAMILY and gemma.declared.stop_tokens == ("<end_of_turn>",)
    for other in ("llama-3.2-1b-instruct", "qwen3-0.6b"):
        assert example(other).declared.stop_tokens == ()


def test_every_family_declares_what_the_engine_reads():
    assert {arch for f in FAMILIES.values() for arch in f.architectures} == set(SUPPORTED_ARCHITECTURES)
    for name, family in FAMILIES.items():
        assert family.name == name and family.reasoning_parser in PARSERS and family.tool_parser == "hermes"
        assert family.chat_template is None or family.chat_template in shipped_chat_templates()
        assert family.model_class == "LlamaModel"
    assert config_gemma3.FAMILY.chat_template == "gemma3" and config_gemma3.FAMILY.kv_defaults["window"] == 512


def test_the_family_picks_the_reasoning_parser_before_the_template():
    # Qwen3.5 declares Qwen3's block: chosen even where the template does not show it (a user's own template)
    assert resolve_parser("auto", "{{ messages }}", config_qwen35.FAMILY) == "qwen3"
    # a family that leaves it to the template: the template decides, as without a family
    assert resolve_parser("auto", QWEN3_TEMPLATE, PLAIN_DECODER) == resolve_parser("auto", QWEN3_TEMPLATE) == "qwen3"
    assert resolve_parser("auto", "{{ messages }}", PLAIN_DECODER) == "none"
    # a parser named on the command line wins over the family's
    assert resolve_parser("none", QWEN3_TEMPLATE, config_qwen35.FAMILY) == "none"
    with pytest.raises(ValueError, match="harmony"):
        resolve_parser("harmony", QWEN3_TEMPLATE, config_qwen35.FAMILY)


def test_the_model_class_is_the_familys(monkeypatch):
    cfg = example("qwen3-0.6b")
    assert model_class(cfg) is LlamaModel
    monkeypatch.setitem(FAMILIES, "qwen3", dataclasses.replace(FAMILIES["qwen3"], model_class="MambaModel"))
    with pytest.raises(ValueError, match="Qwen3ForCausalLM: its family declares model class 'MambaModel'"):
        model_class(cfg)
