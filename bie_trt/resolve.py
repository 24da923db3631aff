"""The settings an engine runs with, in one place: what the caller asked for (`EngineConfig`) against what
the engine was built for (its `Manifest`). The CLI, the model runner, the replicas, speculation and eval all
take them from `resolve`, so a value is capped, defaulted or refused the same way everywhere.

The rule: a setting left unsaid is the engine's; one above the engine's is refused (the memory plan --
KV pool, activation workspace -- was solved for the built value), never silently lowered.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Mapping

from .config import EngineConfig, KVCacheConfig, SpeculativeConfig
from .engine_format import Manifest
from .errors import EngineError, SettingsError

# why each built value is a ceiling, and the build option that raises it
_CEILINGS = {
    "max_model_len": ("its memory plan holds that context", "--max-model-len"),
    "max_num_seqs": ("its KV pool is sized for that many", "--max-num-seqs"),
    "chunked_prefill_size": ("its activation workspace is sized for that chunk", "--chunked-prefill-size"),
}


@dataclass(frozen=True)
class Resolved:
    max_model_len: int
    max_num_seqs: int
    chunked_prefill_size: int
    cuda_graph_batch_sizes: tuple[int, ...]   # the build's decode graphs, up to max_num_seqs
    kv: KVCacheConfig                         # the engine's format with the caller's overrides, validated
    speculative: SpeculativeConfig


def resolve(config: EngineConfig, manifest: Manifest) -> Resolved:
    """The effective settings; SettingsError (a ValueError) naming the built value and the fix for one
    above the engine's, EngineError for a KV format or speculation that cannot run."""
    max_num_seqs = _at_most("max_num_seqs", config.max_num_seqs, manifest.max_num_seqs)
    kv = config.apply(manifest.kv)
    try:
        kv.validate(manifest.model.head_dim)
    except ValueError as e:
        raise EngineError(str(e)) from None
    speculative = resolve_speculative(config.speculative, manifest.speculative,
                                      manifest.plan.num_speculative_tokens, manifest.draft is not None)
    if speculative.method == "draft_model" and manifest.draft is not None and \
            speculative.num_speculative_tokens >= manifest.draft.window:
        raise SettingsError("num_speculative_tokens", f"{speculative.num_speculative_tokens} does not fit the draft's "
                            f"{manifest.draft.window}-token window; use fewer tokens or rebuild with a larger "
                            f"--draft-window-tokens.")
    return Resolved(
        max_model_len=_at_most("max_model_len", config.max_model_len, manifest.max_model_len),
        max_num_seqs=max_num_seqs,
        chunked_prefill_size=_at_most("chunked_prefill_size", config.chunked_prefill_size,
                                      manifest.chunked_prefill_size),
        cuda_graph_batch_sizes=tuple(b for b in manifest.cuda_graph_batch_sizes if b <= max_num_seqs),
        kv=kv, speculative=speculative)


def _at_most(setting: str, asked: int | None, built: int) -> int:
    if asked is None:
        return built
    if asked > built:
        why, option = _CEILINGS[setting]
        raise SettingsError(setting, f"{asked} is above this engine's {built} ({why}); lower it or rebuild with "
                                     f"`bie-trt build {option} {asked}`.")
    return asked


def resolve_speculative(value: SpeculativeConfig | dict[str, Any] | str | None, default: Mapping[str, Any] | None,
                        planned: int, has_draft: bool) -> SpeculativeConfig:
    """The caller's config; None: the build's `default`, else a draft model when the engine carries one,
    else no speculation. A num_speculative_tokens left unsaid is the `planned` one (the verify rows the
    engine's memory plan holds room for, when it planned for speculation)."""
    if value is None:
        value = dict(default) if default is not None else None
    if value is None:
        value = {"method": "draft_model"} if has_draft else {}
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
