"""Which speculation an engine runs: the caller's config, else the engine's default, and its proposer."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..config import SpeculativeConfig
from ..errors import EngineError
from .proposer import Proposer, TargetRuntime

DRAFT_DIR = "draft"


def resolve_speculative(value: SpeculativeConfig | dict[str, Any] | str | None, manifest: dict,
                        engine_dir: Path) -> SpeculativeConfig:
    """The caller's config; None: the manifest's "speculative" (set at build), else a draft model when the
    engine carries one, else no speculation. A num_speculative_tokens left unsaid is the one the engine's
    memory plan holds room for (when it planned for speculation)."""
    if value is None:
        value = manifest.get("speculative")
    if value is None:
        value = {"method": "draft_model"} if (engine_dir / DRAFT_DIR).is_dir() else {}
    planned = int(manifest.get("plan", {}).get("inputs", {}).get("num_speculative_tokens") or 0)
    try:
        if isinstance(value, str):
            value = _json_or_text(value)
        if isinstance(value, dict) and planned and "num_speculative_tokens" not in value:
            value = {**value, "num_speculative_tokens": planned}
        return SpeculativeConfig.parse(value)
    except (TypeError, ValueError) as e:
        raise EngineError(str(e)) from None


def _json_or_text(text: str) -> object:
    """The JSON a string holds, or the string itself (for `SpeculativeConfig.parse` to explain)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def make_proposer(config: SpeculativeConfig, engine_dir: Path, runner: TargetRuntime) -> Proposer | None:
    if config.method == "ngram":
        from .ngram import NgramProposer

        return NgramProposer(config)
    if config.method == "draft_model":
        try:
            from .draft import DraftModelProposer
        except ModuleNotFoundError as e:
            if e.name != f"{__package__}.draft":
                raise
            raise EngineError("speculative method 'draft_model' is not available in this bie-trt: the engine has "
                              "no draft; use {\"method\": \"ngram\"} or {\"method\": \"none\"}.") from None
        if not (engine_dir / DRAFT_DIR).is_dir():
            raise EngineError(f"{engine_dir} has no draft model ({DRAFT_DIR}/); rebuild it with --draft-checkpoint, "
                              "or use {\"method\": \"ngram\"}.")
        return DraftModelProposer(engine_dir, runner, config.num_speculative_tokens)
    return None
