"""scripts/fuzz_structured.py, reduced: every shape agent frameworks send, two seeds, at temperature 1 on
the tiny random model, plain / n-gram / draft, in the closed form: every reply validates against the
schema as sent, and tool-call arguments hold only the keys their tool declares."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from fuzz_structured import check_reply, run  # noqa: E402
from structured_cases import FRAMEWORK_SCHEMAS  # noqa: E402


def test_check_reply_catches_what_the_fuzz_looks_for():
    """The check the fuzz relies on can fail: cut JSON, a schema mismatch, an undeclared argument."""
    person = FRAMEWORK_SCHEMAS["person"]
    assert check_reply("person", person, '{"name": "Ada", "age": 36}') is None
    assert check_reply("person", person, '{"name": "Ada", "age": 3').startswith("not JSON")
    assert check_reply("person", person, '{"name": "Ada"}').startswith("invalid")
    tools = FRAMEWORK_SCHEMAS["required_tools"]
    assert check_reply("required_tools", tools, '[{"name": "add", "parameters": {"a": 1, "b": 2}}]') is None
    assert check_reply("required_tools", tools, '[{"name": "add", "parameters": {"a": 1, "b": 2, "c": 3}}]') == (
        "undeclared arguments ['c']")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["plain", "ngram", "draft"])
def test_every_framework_shape_closes_under_speculation(mode, tiny_engine, tiny_draft_engine):
    engine = tiny_draft_engine if mode == "draft" else tiny_engine
    result = run(str(engine), mode, "closed", list(FRAMEWORK_SCHEMAS), [0, 1], max_tokens=200)
    assert result["failures"] == [] and result["validated"] == result["replies"] == 2 * len(FRAMEWORK_SCHEMAS)
    assert result["cut_by_max_tokens"] == 0

