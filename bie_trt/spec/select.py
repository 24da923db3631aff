"""Which speculation an engine runs: the caller's config, else the engine's default, and its proposer."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ..config import SpeculativeConfig
from ..errors import EngineError
from .proposer import Proposer

DRAFT_DIR = "draft"


def resolve_speculative(value: SpeculativeConfig | dict[str, Any] | str | None, manifest: dict,
                        engine_dir: Path) -> SpeculativeConfig:
    """The caller's config; None: the manifest's "speculative" (set at build), else a draft model with the
    default γ when the engine carries one, else no speculation."""
    if value is None:
        value = manifest.get("speculative")
    if value is None:
        return SpeculativeConfig("draft_model") if (engine_dir / DRAFT_DIR).is_dir() else SpeculativeConfig()
    try:
        return SpeculativeConfig.parse(value)
    except (TypeError, ValueError) as e:
        raise EngineError(str(e)) from None


def make_proposer(config: SpeculativeConfig, engine_dir: Path, runner) -> Proposer | None:
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
        return DraftModelProposer(engine_dir, runner, config)
    return None
