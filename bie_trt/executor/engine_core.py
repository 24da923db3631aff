"""`EngineCore`: the engine loop alone. Token ids and SamplingParams in, events out; no threads, no text
prompts, no chat.

    core = EngineCore(EngineConfig(engine_dir="engines/smollm2"))
    request = core.add_request([1, 504, 3458], SamplingParams(max_tokens=8))
    while core.has_work():
        for req, event in core.step():   # StreamEvent (its last carries the RequestOutput) or an exception
            ...

Each step is schedule (the scheduler picks prompt chunks and decodes, and room for proposals), run (the
model runner's device work), then sample every plain row in one batch and verify each proposal, let the
scheduler account for the cache, and emit one event a request that moved. The caller owns the thread:
`BieEngine` runs a core on one thread of its own (`EngineThread`).
"""
from __future__ import annotations

import collections

import torch

from ..chat.reasoning import resolve_parser
from ..chat.tokenizer import load_tokenizer
from ..config import EngineConfig
from ..errors import SettingsError
from ..logits_constraint import GrammarError
from ..plan import planned_step_tokens
from ..sampling import logprob_rows, to_device, top_logprobs_of
from ..sampling_params import SamplingParams
from .disk_blocks import load_from_disk, open_disk_tier, persist_prompt
from .model_runner import ModelRunner
from .outputs import StreamEvent
from .request_builder import RequestBuilder
from .request_state import RequestState
from .sampler import sample_step
from .scheduler import Scheduler, check_progress, step_budget
from .sequence import Sequence
from .speculation import Speculation

Event = tuple[RequestState, StreamEvent | Exception]


class EngineCore:
    def __init__(self, config: EngineConfig):
        self.config, self.runner = config, ModelRunner(config)
        self.tokenizer = load_tokenizer(config.engine_dir, config.chat_template)
        self.max_model_len, pools, kv = self.runner.max_model_len, self.runner.pools, self.runner.kv_config
        self.spec = Speculation(self.runner)
        chunk, seqs, gamma = self.runner.chunked_prefill_size, self.runner.max_num_seqs, self.spec.num_tokens
        budget = step_budget(planned_step_tokens(self.runner.manifest.plan.inputs),
                             config.max_num_batched_tokens, chunk, seqs, gamma)
        check_progress(kv, self.max_model_len, chunk, pools.num_fp_blocks, budget, seqs, gamma)
        self.blocks = self.runner.block_manager(config.enable_prefix_caching, self.runner.host_bytes)
        adaptive = self.spec.adaptive
        self.scheduler = Scheduler(self.blocks, seqs, budget, chunk, gamma, self.max_model_len,
                                   self.spec.free if self.spec.proposer else None, adaptive.room if adaptive else None,
                                   states=pools.recurrent)
        try:   # chosen once: the thinking budget and the reply's split find the block with the same parser
            self.reasoning_parser = resolve_parser(config.reasoning_parser, str(self.tokenizer.chat_template or ""),
                                                   self.runner.model_config.declared)
        except ValueError as e:
            raise SettingsError("reasoning_parser", str(e).removeprefix("reasoning parser ")) from None
        self.requests = RequestBuilder(self.tokenizer, self.runner.model_config, self.max_model_len, config.seed,
                                       self.reasoning_parser)
        self.disk = open_disk_tier(config, self.runner, self.runner.manifest.model_name)
        self.live: dict[Sequence, RequestState] = {}
        self.finished: collections.Counter[str] = collections.Counter()
        self.prompt_tokens = self.generation_tokens = 0

    def add_request(self, prompt_ids: list[int], params: SamplingParams) -> RequestState:
        """Check and admit a request (RequestError, one line, when this engine cannot run it)."""
        request = self.requests.build(prompt_ids, params)
        self.add([request])
        return request

    def add(self, requests: list[RequestState]) -> None:
        """Admit requests built by `self.requests` (all of them in the same step)."""
        for request in requests:
            self.live[request.seq] = request
            if self.disk is not None:
                load_from_disk(self.blocks, self.runner, self.scheduler, self.disk, request.seq)
            self.scheduler.add(request.seq)
            self.prompt_tokens += len(request.seq.prompt_ids)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def abort(self, request: RequestState) -> None:
        if not request.done.is_set():
            self._end(request, "abort")

    def fail(self, requests: list[RequestState], error: Exception) -> list[Event]:
        """End `requests` (their blocks freed at once): each gets the error instead of a next event."""
        for request in requests:
            self._end(request, "error")
        return [(request, error) for request in requests]

    def _end(self, request: RequestState, reason: str) -> None:
        self.scheduler.finish(request.seq, reason)
        del self.live[request.seq]
        self.finished[reason] += 1
        request.finish()

    def step(self) -> list[Event]:
        """One step; a fault fails the requests it may have touched (the running batch, or with none running
        the waiting ones, so that a fault that recurs cannot spin) and the others go on."""
        try:
            return self._step()
        except Exception as e:
            return self.fail([self.live[s] for s in list(self.scheduler.running or self.scheduler.waiting)
                              if s in self.live], e)

    def _step(self) -> list[Event]:
        batch = self.scheduler.schedule()
        if not batch.chunks:
            raise RuntimeError("the scheduler made no progress with requests waiting (a KV accounting bug)")
        decodes = all(n == 1 and seq.output_ids for seq, n in batch.chunks)
        proposals = self.spec.propose(batch.lookahead)
        rows = [1 + len(proposals[seq].token_ids) if seq in proposals else 1 for seq, _ in batch.chunks]
        if decodes:
            self.spec.record_decodes([seq for seq, _ in batch.chunks], rows)
        start, events = self.spec.clock(), []
        logits = self.runner.execute(batch, {seq: p.token_ids for seq, p in proposals.items()})
        sampled = self._sample([(seq, row) for (seq, n), row in zip(batch.chunks, logits)
                                if seq not in proposals and seq.num_pending <= n], events)
        self.spec.judge_unverified(sampled)
        for (seq, n), seq_rows in zip(batch.chunks, logits):
            if seq in sampled or seq in proposals:
                try:
                    tokens, tops = sampled[seq] if seq in sampled else self._verify(seq, seq_rows, proposals[seq])
                    events.append(self._advance(self.live[seq], n, tokens, tops, seq in proposals,
                                                seq in batch.lookahead))
                except GrammarError as e:   # one request's grammar failed: that request ends, the batch goes on
                    events += self.fail([self.live[seq]], e)
            elif seq in self.live:   # a prompt chunk with more of the prompt to come (or a grammar failed)
                self.scheduler.postprocess(seq, n, seq in batch.lookahead)
        if decodes:   # the tokens are on the host by now: the time is the device's too
            self.spec.record_step(rows, self.spec.clock() - start)
        return events

    def _sample(self, plain: list[tuple[Sequence, torch.Tensor]], events: list[Event]) -> dict:
        """Every plain row's next token in one batch -> {seq: ([token], [logprobs])}; a request whose grammar
        allows nothing fails here and is left out."""
        kept, constraints = [], []
        for seq, row in plain:
            try:
                constraints.append(seq.constraint.row(len(seq.output_ids)) if seq.constraint is not None else None)
                kept.append((seq, row))
            except GrammarError as e:
                events += self.fail([self.live[seq]], e)
        if not kept:
            return {}
        tokens, tops = sample_step([s for s, _ in kept], [r for _, r in kept], constraints)
        return {seq: ([token], [top]) for (seq, _), token, top in zip(kept, tokens, tops)}

    def _verify(self, seq: Sequence, rows: torch.Tensor, proposal) -> tuple[list[int], list]:
        tokens = self.spec.verify(seq, rows, proposal)
        n = seq.params.logprobs
        if n is None:
            return tokens, [None] * len(tokens)
        k = len(tokens)   # every row's logprobs in one read back
        host = logprob_rows(rows[:k], to_device(tokens, torch.long, rows.device), [n] * k).tolist()
        return tokens, [top_logprobs_of(row, t, n) for row, t in zip(host, tokens)]

    def _advance(self, request: RequestState, n: int, tokens: list[int], tops: list, verified: bool,
                 had_lookahead: bool) -> Event:
        """Append the new tokens, let the scheduler account for what the cache now holds, -> the event."""
        seq, prefilled = request.seq, not request.seq.output_ids
        new, delta, reason = request.append(tokens, self.requests.eos_ids, self.max_model_len)
        self.generation_tokens += len(new)
        # K/V hold for the pending token and the accepted proposals: as many as were appended when the
        # request stopped inside the run (its blocks are freed just after; prefix caching keeps them).
        kept = min(len(tokens), len(new) + 1) if verified else n
        if verified:
            self.runner.keep_rows(seq, kept)
        self.scheduler.postprocess(seq, kept, had_lookahead)
        if prefilled and self.disk is not None and self.disk.writable:   # handed over before the reply can end
            persist_prompt(self.blocks, self.runner, self.scheduler, self.disk, seq)
        kept = tops[:len(new)] if seq.params.logprobs is not None else None
        if kept is not None:
            seq.logprobs += kept
        if reason:
            self._end(request, reason)
        return request, StreamEvent(delta, new, reason, request.output(self.spec.output(seq)) if reason else None,
                                    kept)
