"""Anthropic's context editing (`context_management.edits`, which Claude Code sends): the history edited
before the prompt is made, each edit reported as the API reports it (`context_management.applied_edits`).

- `clear_tool_uses_20250919`: once the prompt is past the trigger (input tokens, or tool uses), the
  results of the oldest tool uses are replaced by a placeholder, keeping the `keep` most recent ones and
  those of `exclude_tools`; `clear_tool_inputs` also empties the calls' inputs (all, or the named
  tools'); `clear_at_least` skips an edit that would free fewer tokens.
- `clear_thinking_20251015`: thinking blocks are dropped from all but the `keep` most recent assistant
  turns that have them (`"all"` keeps every one).

Other edits (compaction, which writes a summary with the model) are refused by name. The client keeps its
full history: nothing here is stored.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Field, field_validator

from .protocols.openai import _Strict

PLACEHOLDER = "[tool result cleared to save context]"   # what the model reads where a result was
CLEAR_TOOL_USES, CLEAR_THINKING = "clear_tool_uses_20250919", "clear_thinking_20251015"


class InputTokens(_Strict):
    type: Literal["input_tokens"]
    value: int = Field(ge=0)


class ToolUses(_Strict):
    type: Literal["tool_uses"]
    value: int = Field(ge=0)


class ThinkingTurns(_Strict):
    type: Literal["thinking_turns"]
    value: int = Field(ge=0)


class AllTurns(_Strict):
    type: Literal["all"]


class ClearToolUses(_Strict):
    """Anthropic's defaults: triggered past 100,000 input tokens, the 3 most recent tool uses kept."""
    type: Literal["clear_tool_uses_20250919"]
    trigger: Annotated[Union[InputTokens, ToolUses], Field(discriminator="type")] = \
        InputTokens(type="input_tokens", value=100_000)
    keep: ToolUses = ToolUses(type="tool_uses", value=3)
    clear_at_least: InputTokens | None = None
    exclude_tools: list[str] | None = None
    clear_tool_inputs: bool | list[str] | None = None

    def edit(self, messages: list, tokens: int) -> tuple[list, int]:
        """-> (the messages with the old tool results cleared, how many tool uses were cleared)."""
        uses = [(i, j, b) for i, m in enumerate(messages) if m.role == "assistant"
                for j, b in enumerate(m.content) if b.type == "tool_use"]
        past = tokens > self.trigger.value if self.trigger.type == "input_tokens" else len(uses) > self.trigger.value
        if not past:
            return messages, 0
        results = {b.tool_use_id: (i, j) for i, m in enumerate(messages) if m.role == "user"
                   for j, b in enumerate(m.content) if b.type == "tool_result"}
        old = uses[:max(0, len(uses) - self.keep.value)]
        content = {i: list(m.content) for i, m in enumerate(messages)}
        cleared = 0
        for i, j, use in old:
            if use.name in (self.exclude_tools or []):
                continue
            done = False
            if use.id in results:
                ri, rj = results[use.id]
                result = content[ri][rj]
                if result.text() != PLACEHOLDER:
                    content[ri][rj] = type(result).model_validate(
                        {"type": "tool_result", "tool_use_id": result.tool_use_id, "content": PLACEHOLDER})
                    done = True
            inputs = self.clear_tool_inputs
            if (inputs is True or (isinstance(inputs, list) and use.name in inputs)) and use.input:
                content[i][j] = use.model_copy(update={"input": {}})
                done = True
            cleared += done
        edited = [m.model_copy(update={"content": content[i]}) for i, m in enumerate(messages)]
        return edited, cleared

    @staticmethod
    def report(count: int, tokens: int) -> dict[str, Any]:
        return {"type": CLEAR_TOOL_USES, "cleared_tool_uses": count, "cleared_input_tokens": tokens}


class ClearThinking(_Strict):
    """Anthropic's default keeps the thinking of the last assistant turn."""
    type: Literal["clear_thinking_20251015"]
    keep: Annotated[Union[ThinkingTurns, AllTurns], Field(discriminator="type")] = \
        ThinkingTurns(type="thinking_turns", value=1)

    @field_validator("keep", mode="before")
    @classmethod
    def _all(cls, value: Any) -> Any:
        return {"type": "all"} if value == "all" else value   # "all" may come as a plain string

    def edit(self, messages: list, tokens: int) -> tuple[list, int]:
        """-> (the messages with the older turns' thinking blocks dropped, how many turns lost theirs)."""
        if self.keep.type == "all":
            return messages, 0
        thinking = [i for i, m in enumerate(messages)
                    if m.role == "assistant" and any(b.type == "thinking" for b in m.content)]
        old = set(thinking[:max(0, len(thinking) - self.keep.value)])
        edited = [m.model_copy(update={"content": [b for b in m.content if b.type != "thinking"]}) if i in old else m
                  for i, m in enumerate(messages)]
        return edited, len(old)

    @staticmethod
    def report(count: int, tokens: int) -> dict[str, Any]:
        return {"type": CLEAR_THINKING, "cleared_thinking_turns": count, "cleared_input_tokens": tokens}


Edit = Annotated[Union[ClearToolUses, ClearThinking], Field(discriminator="type")]


class ContextManagement(_Strict):
    edits: list[Edit] = Field(default_factory=list)

    @field_validator("edits", mode="before")
    @classmethod
    def _known_edits(cls, edits: Any) -> Any:
        for i, edit in enumerate(edits if isinstance(edits, list) else []):
            kind = edit.get("type") if isinstance(edit, dict) else None
            if isinstance(kind, str) and kind not in (CLEAR_TOOL_USES, CLEAR_THINKING):
                raise ValueError(f"[{i}] is a {kind} edit, which this server cannot perform (it performs "
                                 f"{CLEAR_TOOL_USES} and {CLEAR_THINKING}); leave it out")
        return edits
