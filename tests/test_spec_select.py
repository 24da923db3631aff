"""Which speculation an engine runs by default, and that it is the one its memory plan holds room for."""
from __future__ import annotations

import pytest

from bie_trt.builder.build import build_speculation
from bie_trt.config import SpeculativeConfig
from bie_trt.errors import EngineError
from bie_trt.profiles import load_profile
from bie_trt.resolve import resolve_speculative


def manifest(planned: int, speculative: dict | None = None, draft: bool = False) -> tuple:
    """What `resolve_speculative` reads of a manifest: its default, the planned tokens, whether it has a draft."""
    return speculative, planned, draft


def test_a_draft_engine_built_without_a_config_speculates_as_planned(tmp_path):
    profile = load_profile("cpu")
    built = build_speculation(None, True, profile)
    assert built == SpeculativeConfig("draft_model", num_speculative_tokens=profile.defaults.num_speculative_tokens)
    assert build_speculation(None, False, profile) == SpeculativeConfig()
    ngram = SpeculativeConfig("ngram", num_speculative_tokens=2)
    assert build_speculation(ngram, True, profile) is ngram


def test_unsaid_num_speculative_tokens_is_the_plans():
    assert resolve_speculative(None, *manifest(3, draft=True)) == SpeculativeConfig("draft_model", 3)
    assert resolve_speculative('{"method": "ngram"}', *manifest(3)).num_speculative_tokens == 3
    assert resolve_speculative({"method": "ngram"}, *manifest(3)).num_speculative_tokens == 3
    stored = {"method": "ngram", "num_speculative_tokens": 2}
    assert resolve_speculative(None, *manifest(3, stored)).num_speculative_tokens == 2   # the build's own choice
    said = {"method": "ngram", "num_speculative_tokens": 6}
    assert resolve_speculative(said, *manifest(3)).num_speculative_tokens == 6   # the caller's wins


def test_an_engine_planned_without_speculation_keeps_the_config_default():
    assert resolve_speculative(None, *manifest(0)) == SpeculativeConfig()
    assert resolve_speculative('{"method": "ngram"}', *manifest(0)) == SpeculativeConfig("ngram")


def test_bad_config_text_still_explains_itself():
    with pytest.raises(EngineError, match="not valid JSON"):
        resolve_speculative("{method: ngram", *manifest(3))
