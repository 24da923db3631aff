"""The proposer of the speculation an engine runs (which one: `resolve.resolve_speculative`)."""
from __future__ import annotations

from pathlib import Path

from ..config import SpeculativeConfig
from ..errors import EngineError
from .proposer import Proposer, TargetRuntime


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
        return DraftModelProposer(engine_dir, runner)
    return None
