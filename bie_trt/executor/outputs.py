"""What the SDK hands back: a request's output, its streamed events, a chat reply, the loop's counters."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..chat.tool_calls import ToolCall


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    # prompt tokens served from the prefix cache (device or host tier), OpenAI's
    # usage.prompt_tokens_details.cached_tokens
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    usage: Usage
    time_to_first_token_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    logprobs: list[dict[int, float]] | None = None   # per token: top-N and the sampled one, when asked
    # with speculative decoding: {"num_drafts", "num_draft_tokens", "num_accepted_tokens"} of this request
    spec_decode: dict[str, int] | None = None


@dataclass
class ChatOutput:
    """`BieEngine.chat`'s reply: prose, parsed tool calls, OpenAI's finish reason ("tool_calls" when
    the reply ended with calls), and a thinking model's reasoning (None when it wrote none)."""

    content: str | None
    tool_calls: list[ToolCall]
    finish_reason: str | None
    output: RequestOutput
    reasoning_content: str | None = None


@dataclass
class StreamEvent:
    """One step of a streamed request: the new text, the new token, and the end."""

    delta: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    output: RequestOutput | None = None   # set on the last event
    logprobs: list[dict[int, float]] | None = None


@dataclass
class EngineStats:
    """The loop's counters and the KV pools at one moment (what /metrics exports)."""

    requests: dict[str, int]                # finished requests by finish reason: stop, length, abort, error (a fault)
    prompt_tokens: int
    generation_tokens: int
    preemptions: int
    prefix_queried_tokens: int
    prefix_hit_tokens: int
    kv_blocks: dict[str, dict[str, int]]    # pool (fp16, quant) -> used / cached / free
    running: int
    waiting: int
    # speculative decoding: num_drafts, num_draft_tokens, num_accepted_tokens (ints) and
    # accepted_by_position (list: drafts whose i-th proposal was accepted)
    spec_decode: dict = field(default_factory=lambda: {"num_drafts": 0, "num_draft_tokens": 0,
                                                        "num_accepted_tokens": 0, "accepted_by_position": []})
    # the host tier: capacity_bytes, used_bytes, blocks (now), hit_tokens, offloaded_bytes, restored_bytes,
    # offload_seconds, restore_seconds (since start)
    host_kv: dict = field(default_factory=dict)
    # the target's CUDA-graph steps since start, by kind (decode, verify) -> {"graph": hits, "eager": steps of
    # graph-sized rows that fit no captured bucket}; all zero without graphs (CPU, enforce_eager)
    cuda_graphs: dict = field(default_factory=dict)
    # the disk tier (empty when off): capacity_bytes, used_bytes, files (every engine's), blocks (this engine's),
    # writable (0/1) now; hit_tokens, missed_tokens, read_bytes, written_bytes, evictions, bad_files since start
    disk_kv: dict = field(default_factory=dict)
