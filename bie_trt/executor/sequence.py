"""A request's life: prompt, generated tokens, blocks, and its incremental text."""
from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..sampling_params import SamplingParams
from ..spec_decode.proposer import ProposalRequest

if TYPE_CHECKING:
    from ..logits_constraint import LogitsConstraint

_ids = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)   # compared by identity: the scheduler keys dicts by sequence
class Sequence:
    prompt_ids: list[int]
    params: SamplingParams
    # seeded with the request's seed: plain decoding keys its draws by that seed (sampling.race_key),
    # verification and the draft draw from the generator itself
    generator: torch.Generator
    # logit_bias, min_tokens, the grammar and a thinking budget (logits_constraint.py); None when the request sets none
    constraint: "LogitsConstraint | None" = None
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    output_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    # A hybrid model's sliding-window layers: their own table (sliding_blocks.py), entries below
    # `sliding_first` given back
    sliding_table: list[int] = field(default_factory=list)
    sliding_first: int = 0
    # A model with linear-attention layers (Qwen3.5): the slot of its recurrent state while it runs (kv/recurrent.py)
    state_slot: int | None = None
    num_cached: int = 0            # tokens whose K/V are in the cache
    num_prompt_cached: int | None = None   # prompt tokens the prefix cache held at first admission (both tiers)
    # Prefix-cache keys of the first full blocks of token_ids, in order; they depend on the tokens
    # only, so they survive preemption.
    block_keys: list[bytes] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None
    text: str = ""                 # detokenised output, stop strings already cut
    logprobs: list[dict[int, float]] = field(default_factory=list)   # per output token, when params.logprobs
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    # speculative decoding: proposals verified, tokens proposed, and of those accepted
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    gamma_choice: dict | None = None   # adaptive γ: the last choice and why, kept when the request's state goes

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_slice(self, start: int, stop: int) -> list[int]:
        """token_ids[start:stop] without building the whole list (contexts run to 64k tokens)."""
        n = len(self.prompt_ids)
        return self.prompt_ids[start:stop] + self.output_ids[max(0, start - n):max(0, stop - n)]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_pending(self) -> int:
        """Tokens still to run through the model (the prompt's rest, or the newest sampled token)."""
        return self.num_tokens - self.num_cached

    def proposal_request(self, num_tokens: int) -> ProposalRequest:
        """What a proposer is asked for this sequence: its tokens, and up to `num_tokens` proposals."""
        return ProposalRequest(self, self.prompt_ids, self.output_ids, num_tokens, self.params,
                               self.generator.initial_seed(), self.constraint)

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED


class Detokenizer:
    """Turns a growing id list into text deltas. Each step decodes only the new tokens, with the
    tokens of the step before as context (so spacing comes out as a whole decode gives it): a whole
    decode every step would cost O(n²) on the loop thread. Holds back a partial UTF-8 character and
    any tail that could still become a stop string, so streamed text never has to be taken back.
    Stop strings count only once more than `min_tokens` tokens are out, as vLLM's do: text before that
    is searched no more (a stop string ending past it still counts)."""

    def __init__(self, tokenizer, stop: list[str], min_tokens: int = 0):
        self.tokenizer, self.stop, self.min_tokens = tokenizer, stop, min_tokens
        self.text = ""                 # the decode of ids[:read]
        self.prefix = self.read = 0    # ids[prefix:read] are decoded again as context for the next ones
        self.searched = 0              # text[:searched] holds no stop string
        self.emitted = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def update(self, seq: Sequence, final: bool = False, drop_last: bool = False) -> tuple[str, bool]:
        """-> (new text to emit, whether a stop string was hit). Sets seq.text.
        `drop_last`: the newest token is a stop token, whose text is not part of the output."""
        ids = seq.output_ids[:-1] if drop_last else seq.output_ids
        if len(ids) > self.read:
            context, window = self._decode(ids[self.prefix:self.read]), self._decode(ids[self.prefix:])
            if final or not window.endswith("\ufffd"):   # else a character is still incomplete: wait
                self.text += window[len(context):]
                self.prefix, self.read = self.read, len(ids)
        text, hit = self.text, False
        stops = self.stop if len(seq.output_ids) > self.min_tokens else []
        hits = [i for s in stops if (i := text.find(s, max(0, self.searched - len(s) + 1))) != -1]
        if hits:
            text, hit = text[:min(hits)], True
        self.searched = len(text)
        safe = len(text)
        if not (final or hit):
            for s in self.stop:  # a suffix of the text that is a prefix of a stop string
                for k in range(min(len(s) - 1, safe), 0, -1):
                    if text[safe - k:safe] == s[:k]:
                        safe -= k
                        break
        seq.text = text
        delta = text[self.emitted:max(safe, self.emitted)]
        self.emitted = max(safe, self.emitted)
        return delta, hit
