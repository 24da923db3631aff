"""A request as the loop holds it: its sequence, its text so far, the mailbox its stream reads, and how
new tokens extend it (stopping exactly where decoding them one per step would) and end it."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from .outputs import RequestOutput, Usage
from .sequence import Detokenizer, Sequence
from .mailbox import Mailbox

_WATCH_LOCK = threading.Lock()


@dataclass(eq=False)
class RequestState:
    seq: Sequence
    detok: Detokenizer
    events: Mailbox = field(default_factory=Mailbox)
    done: threading.Event = field(default_factory=threading.Event)   # set once its blocks are free
    _watchers: list[Callable[[], None]] = field(default_factory=list)

    def append(self, tokens: list[int], eos_ids: set[int], max_model_len: int) -> tuple[list[int], str, str | None]:
        """Append tokens one at a time, up to the first that ends the request.
        -> (tokens appended, new text, finish reason)."""
        seq, new, delta, reason = self.seq, [], "", None
        for token in tokens:
            seq.output_ids.append(token)
            new.append(token)
            if seq.constraint is not None:
                seq.constraint.accept(token)
            reason = finish_reason(seq, token, eos_ids, max_model_len)
            # a stop token ends the text but is not part of it (OpenAI semantics)
            text, hit = self.detok.update(seq, final=reason is not None, drop_last=reason == "stop")
            delta, reason = delta + text, "stop" if hit else reason
            if reason:
                break
        seq.first_token_time = seq.first_token_time or time.perf_counter()
        return new, delta, reason

    def output(self, spec_decode: dict | None) -> RequestOutput:
        seq = self.seq
        now, n, first = time.perf_counter(), len(seq.output_ids), seq.first_token_time
        rate = (n - 1) / (now - first) if n > 1 and now > first else 0.0
        return RequestOutput(seq.request_id, seq.prompt_ids, seq.text, list(seq.output_ids), seq.finish_reason,
                             Usage(len(seq.prompt_ids), n, seq.num_prompt_cached or 0), first - seq.arrival_time, rate,
                             list(seq.logprobs) if seq.params.logprobs is not None else None, spec_decode)

    def finish(self) -> None:
        """On the loop thread, once the request's blocks are free: wake whoever waits for that."""
        with _WATCH_LOCK:
            self.done.set()
            watchers, self._watchers = self._watchers, []
        for wake in watchers:
            wake()

    def on_finish(self, wake: Callable[[], None]) -> bool:
        """Call `wake` (on the loop thread) when the request finishes; False, and no call, if it has."""
        with _WATCH_LOCK:
            if self.done.is_set():
                return False
            self._watchers.append(wake)
            return True


def finish_reason(seq: Sequence, token: int, eos_ids: set[int], max_model_len: int) -> str | None:
    """Why `token`, just appended, ends the request (None: it does not)."""
    p = seq.params
    if token in p.stop_token_ids or (not p.ignore_eos and token in eos_ids):
        return "stop"
    if seq.constraint is not None and seq.constraint.finished:   # the grammar took a stop token
        return "stop"
    if len(seq.output_ids) >= p.max_tokens or seq.num_tokens >= max_model_len:
        return "length"
    return None
