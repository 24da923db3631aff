"""`BieEngine`: the in-process SDK over one engine loop.

While requests are in flight a background thread runs the loop; each `_step` is schedule (the
scheduler picks chunks and decodes), run (the model runner's device work), postprocess (sample or
verify, let the scheduler account for the cache, stream). Only that thread touches the scheduler,
the blocks and the model; callers talk to it through queues. `stream()` and `generate()` submit
requests and read their events; closing a stream aborts its request, whose blocks are free by the
time `close()` returns.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import queue
import secrets
import threading
import time
from pathlib import Path
from typing import Callable, Sequence as Seq

import torch

from ..chat.reasoning import PROMPT_TAIL_TOKENS, resolve_parser, split_reasoning, starts_inside
from ..chat.thinking_budget import ThinkingBudget
from ..chat.tool_calls import ReplyParser, plan_tools
from ..config import EngineConfig
from ..config_gemma3 import STOP_TOKENS
from ..errors import RequestError
from ..logits_constraint import GrammarCompiler, GrammarError, LogitsConstraint
from ..model.cuda_graphs import STEP_KINDS
from ..plan import planned_step_tokens
from ..sampling import make_generator, sample_next, top_logprobs
from ..sampling_params import SamplingParams
from ..spec_decode.adaptive import AdaptiveGamma, step_clock
from ..spec_decode.proposer import Proposal
from ..spec_decode.rejection import verify
from ..spec_decode.select import make_proposer
from .cache_blocks import adopt, cache_identity, copy_out
from .cache_file import CachedBlock, CacheFileError, read_cache_file, write_cache_file
from .disk_blocks import load_from_disk, open_disk_tier, persist_prompt
from .model_runner import ModelRunner
from .outputs import ChatOutput, EngineStats, RequestOutput, StreamEvent, Usage
from .prompt_checks import check_prompt, check_prompt_ids
from .prompt_encoder import PromptEncoder
from .scheduler import Scheduler, check_progress, step_budget
from .sequence import Detokenizer, Sequence
from .streams import RequestState, RequestStream


class BieEngine:
    def __init__(self, config: EngineConfig | str):
        self.config = config if isinstance(config, EngineConfig) else EngineConfig(engine_dir=str(config))
        self.runner = ModelRunner(self.config)
        self.prompts = PromptEncoder.load(self.config.engine_dir, self.config.chat_template,
                                         self.config.chat_template_kwargs)
        self.tokenizer = self.prompts.tokenizer
        self.model_name = self.runner.manifest.model_name
        self.max_model_len = self.runner.max_model_len
        pools, kv, max_num_seqs = self.runner.pools, self.runner.kv_config, self.runner.max_num_seqs
        chunked_prefill_size = self.runner.chunked_prefill_size
        engine_dir = Path(self.config.engine_dir)
        self.speculative = self.runner.settings.speculative
        num_speculative_tokens = self.speculative.num_speculative_tokens if self.speculative.enabled else 0
        self.runner.capture_verify_graphs(num_speculative_tokens)
        budget = step_budget(planned_step_tokens(self.runner.manifest.plan.inputs),
                             self.config.max_num_batched_tokens, chunked_prefill_size, max_num_seqs,
                             num_speculative_tokens)
        check_progress(kv, self.max_model_len, chunked_prefill_size, pools.num_fp_blocks, budget, max_num_seqs,
                       num_speculative_tokens)
        self.proposer = make_proposer(self.speculative, engine_dir, self.runner)
        # each request's γ chosen every step (None: always num_speculative_tokens)
        self.adaptive = (AdaptiveGamma(num_speculative_tokens, per_token=self.speculative.method == "draft_model",
                                       clock=step_clock(self.runner.device.type))
                         if self.proposer is not None and self.speculative.adaptive else None)
        self.blocks = self.runner.block_manager(self.config.enable_prefix_caching, self.runner.host_bytes)
        self.scheduler = Scheduler(self.blocks, max_num_seqs, budget, chunked_prefill_size, num_speculative_tokens,
                                   self.max_model_len, self._free_speculation if self.proposer else None,
                                   self.adaptive.room if self.adaptive else None)
        cfg = self.runner.model_config
        self.eos_ids = set(cfg.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_ids.add(self.tokenizer.eos_token_id)
        if cfg.family == "gemma3":   # the end of the model's turn ends a reply (vLLM reads it from generation_config)
            ids = self.tokenizer.convert_tokens_to_ids(list(STOP_TOKENS))
            self.eos_ids.update(i for i in ids if i is not None and i != self.tokenizer.unk_token_id)
        # atomic: requests arrive from many threads; None: fresh entropy per request (see _request_seed)
        self._seeds = None if self.config.seed is None else itertools.count(self.config.seed + 1)
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._requests: dict[Sequence, RequestState] = {}
        self._loop_lock = threading.Lock()                    # guards starting and ending the loop thread
        self._loop_thread: threading.Thread | None = None
        self._finished: collections.Counter[str] = collections.Counter()
        self._prompt_tokens = self._generation_tokens = 0
        self._spec = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0}
        self._accepted_by_position = [0] * num_speculative_tokens
        self._grammar_compiler: GrammarCompiler | None = None   # made at the first structured request
        self._grammar_lock = threading.Lock()
        self.disk = open_disk_tier(self.config, self.runner, self.model_name)

    # -- prompts -------------------------------------------------------------------------------
    def encode(self, prompt: str | list[int] | list[dict], chat: bool = False) -> list[int]:
        """Text as `tokenizer(prompt)` tokenises it; a message list or `chat=True` through the chat template."""
        return self.prompts.encode(prompt, chat)

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None,
                    template_kwargs: dict | None = None, continue_final: bool = False) -> list[int]:
        """Chat messages and OpenAI tools through the chat template (see PromptEncoder.encode_chat)."""
        return self.prompts.encode_chat(messages, tools, template_kwargs, continue_final)

    def _new_sequence(self, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        params.validate()
        check_prompt_ids(prompt_ids, params, self.max_model_len, self.runner.model_config.vocab_size)
        seq = Sequence(prompt_ids, params, make_generator(params, self._request_seed()))
        # compiled here, in the caller's thread: a bad grammar fails this call and never stalls the loop
        compiler = self.grammar_compiler() if params.structured_outputs is not None else None
        budget = None if params.thinking_budget is None else \
            ThinkingBudget.build(params.thinking_budget, prompt_ids, self.tokenizer)
        seq.constraint = LogitsConstraint.build(params, self.eos_ids, compiler, budget)
        return seq

    def grammar_compiler(self) -> GrammarCompiler:
        """The engine's grammar compiler (its cache of compiled grammars), made on first use."""
        with self._grammar_lock:
            if self._grammar_compiler is None:
                self._grammar_compiler = GrammarCompiler(self.tokenizer, self.runner.model_config.vocab_size,
                                                         self.eos_ids)
            return self._grammar_compiler

    def _request_seed(self) -> int:
        """The seed of a request that names none: fresh entropy each time (as OpenAI and vLLM draw), unless
        the engine was given a seed, which makes its sequence of unseeded requests repeat."""
        return secrets.randbits(63) if self._seeds is None else next(self._seeds)

    # -- talking to the loop ---------------------------------------------------------------------
    def _on_loop(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the loop thread, between steps, in the order calls arrive. The thread is not a daemon:
        interpreter exit waits for the requests in flight (killing it inside torch aborts the process)."""
        self._inbox.put(fn)
        with self._loop_lock:
            if self._loop_thread is None:
                self._loop_thread = threading.Thread(target=self._loop, name="bie-engine-loop")
                self._loop_thread.start()

    def _loop(self) -> None:
        """Step while there is work; the thread ends when there is none (the next call starts another)."""
        while True:
            try:
                while not self._inbox.empty():   # only this thread takes from the inbox
                    self._inbox.get()()
                if not self.scheduler.has_work():
                    with self._loop_lock:
                        if self._inbox.empty():
                            self._loop_thread = None
                            return
                    continue
            except Exception as e:  # a bug outside any step: every request in flight gets the error
                self._fail(list(self._requests.values()), e)
                continue
            try:
                self._step()
            except Exception as e:  # a fault in one step fails that step's requests; the others keep going
                self._fail(self._requests_of_step(), e)

    def _requests_of_step(self) -> list[RequestState]:
        """The requests a failed step may have touched: the running batch, which every step is drawn from
        (the scheduler's state mid-step is not kept, so all of it). With none running, the waiting
        ones, so that a fault that recurs cannot spin."""
        seqs = self.scheduler.running or self.scheduler.waiting
        return [self._requests[seq] for seq in list(seqs) if seq in self._requests]

    def _fail(self, requests: list[RequestState], error: Exception) -> None:
        """End `requests` (their blocks freed at once) and hand each the error instead of a next event."""
        for request in requests:
            self._end(request, "error")
            request.events.put(error)

    def _submit(self, seqs: list[Sequence]) -> list[RequestStream]:
        requests = [RequestState(seq, Detokenizer(self.tokenizer, seq.params.stop, seq.params.min_tokens))
                    for seq in seqs]
        self._on_loop(lambda: self._add(requests))   # one call: all are admitted in the same step
        return [RequestStream(self._abort, r) for r in requests]

    def _add(self, requests: list[RequestState]) -> None:
        for request in requests:
            self._requests[request.seq] = request
            if self.disk is not None:
                load_from_disk(self.blocks, self.runner, self.scheduler, self.disk, request.seq)
            self.scheduler.add(request.seq)
            self._prompt_tokens += len(request.seq.prompt_ids)

    def _abort(self, request: RequestState, wait: bool) -> None:
        """Abort on the loop thread. Without `wait` (a finaliser, which may run on any thread, even inside
        `_on_loop`) only the reentrant queue is touched: a request not done yet keeps the loop alive."""
        def abort() -> None:
            if not request.done.is_set():
                self._end(request, "abort")

        if request.done.is_set():
            return
        if wait:
            self._on_loop(abort)
            request.done.wait()
        else:
            self._inbox.put(abort)

    def _end(self, request: RequestState, reason: str) -> None:
        self.scheduler.finish(request.seq, reason)
        del self._requests[request.seq]
        self._finished[reason] += 1
        request.done.set()

    # -- one step --------------------------------------------------------------------------------
    def _step(self) -> None:
        batch = self.scheduler.schedule()
        if not batch.chunks:
            raise RuntimeError("the scheduler made no progress with requests waiting (a KV accounting bug)")
        # decodes of generated tokens only: the steps whose time says what a step of r rows a sequence costs
        decodes = all(n == 1 and seq.output_ids for seq, n in batch.chunks)
        proposals = self._propose(batch.lookahead)
        rows = [1 + len(proposals[seq].token_ids) if seq in proposals else 1 for seq, _ in batch.chunks]
        if self.adaptive is not None and decodes:
            for (seq, _), r in zip(batch.chunks, rows):
                self.adaptive.record_decode(seq, r - 1)
        start = self.adaptive.clock() if self.adaptive is not None else 0.0
        logits = self.runner.execute(batch, {seq: p.token_ids for seq, p in proposals.items()})
        for (seq, n), logit_rows in zip(batch.chunks, logits):
            try:
                self._postprocess(self._requests[seq], n, logit_rows, proposals.get(seq), seq in batch.lookahead)
            except GrammarError as e:   # one request's grammar failed: that request ends, the batch goes on
                self._fail([self._requests[seq]], e)
        if self.adaptive is not None and decodes:
            # the tokens are on the host by now (sampled or verified there): the time is the device's too
            self.adaptive.record_step(rows, self.adaptive.clock() - start)

    def _postprocess(self, request: RequestState, n: int, rows: torch.Tensor, proposal: Proposal | None,
                     had_lookahead: bool) -> None:
        """After the forward over n of the sequence's tokens (and its proposals): sample or verify the next
        tokens once its prompt is all in, let the scheduler account for what the cache now holds, then
        stream the tokens (ending the request when they finish it)."""
        seq = request.seq
        if proposal is None and seq.num_pending > n:   # a prompt chunk with more of the prompt to come
            self.scheduler.postprocess(seq, n, had_lookahead)
            return
        prefilled = not seq.output_ids
        if proposal is None:
            tokens, rows = [self._sample(seq, rows)], rows[None]
        else:   # rows [k+1, V]: the target's logits at the pending token and each of k proposals
            tokens = verify(rows, proposal, seq.params, seq.generator, seq.prompt_ids, seq.output_ids,
                            seq.constraint)
            self._count_spec(seq, len(proposal.token_ids), len(tokens) - 1)
        appended = self._append(request, rows, tokens)
        # K/V hold for the pending token and the accepted proposals: as many as were appended when the
        # request stopped inside the run (its blocks are freed just after; prefix caching keeps them).
        computed = n if proposal is None else min(len(tokens), len(appended[0]) + 1)
        self.scheduler.postprocess(seq, computed, had_lookahead)
        if prefilled and self.disk is not None and self.disk.writable:   # handed over before the reply can end
            persist_prompt(self.blocks, self.runner, self.scheduler, self.disk, seq)
        self._publish(request, *appended)

    @staticmethod
    def _sample(seq: Sequence, logits: torch.Tensor) -> int:
        """The next token from logits [V]. On a GPU it is drawn there and only its id crosses to the host."""
        generator = seq.generator
        if logits.is_cuda:
            if seq.device_generator is None:
                seq.device_generator = make_generator(seq.params, seq.generator.initial_seed(), logits.device)
            generator = seq.device_generator
        return sample_next(logits, seq.params, generator, seq.prompt_ids, seq.output_ids, seq.constraint)

    def _propose(self, lookahead: dict[Sequence, int]) -> dict[Sequence, Proposal]:
        """Proposals for the decodes the scheduler kept room for, each cut where its grammar refuses a token
        (the target could never accept it: verifying it is wasted), and a lookup's to the γ adaptive γ takes
        of them; empty ones are left out."""
        if not lookahead or self.proposer is None:
            return {}
        seqs = list(lookahead)
        start, before = (self.adaptive.clock() if self.adaptive is not None else 0.0), self._draft_work()
        proposals = self.proposer.propose([seq.proposal_request(lookahead[seq]) for seq in seqs])
        if self.adaptive is not None:
            self._time_proposals(len(seqs), self.adaptive.clock() - start, before)
        for seq, proposal in zip(seqs, proposals):
            if len(proposal.token_ids) > lookahead[seq]:
                raise RuntimeError(f"the proposer returned {len(proposal.token_ids)} tokens where "
                                   f"{lookahead[seq]} fit (a proposer bug)")
            keep = len(proposal.token_ids)
            if seq.constraint is not None and keep:
                keep = seq.constraint.allowed_prefix(proposal.token_ids)
            if self.adaptive is not None:   # a lookup's γ is chosen over what it found
                keep = self.adaptive.take(seq, keep)
            if keep < len(proposal.token_ids):
                proposal.token_ids = proposal.token_ids[:keep]
                proposal.probs = None if proposal.probs is None else proposal.probs[:keep]
        return {seq: p for seq, p in zip(seqs, proposals) if p.token_ids}

    def _draft_work(self) -> tuple[int, int]:
        """The draft's forwards and the tokens it ran so far ((0, 0) for n-gram lookup)."""
        steps = getattr(self.proposer, "steps", None)
        return (sum(steps.values()), self.proposer.tokens_forwarded) if steps is not None else (0, 0)

    def _time_proposals(self, num_seqs: int, seconds: float, before: tuple[int, int]) -> None:
        """A proposal round's time, per sequence and draft step. A draft round that first caught up on many
        tokens (after plain steps) is not a draft step's cost: it is left out."""
        if self.speculative.method != "draft_model":
            self.adaptive.record_proposal(seconds, num_seqs, 1)
            return
        steps, fed = (now - then for now, then in zip(self._draft_work(), before))
        if fed <= num_seqs * (2 * self.speculative.num_speculative_tokens + 1):
            self.adaptive.record_proposal(seconds, num_seqs, steps)

    def _free_speculation(self, seq: Sequence) -> None:
        """The request's blocks went (finished, aborted, preempted): its draft cache and γ state go too; its last
        γ choice stays on the sequence for its output."""
        self.proposer.free(seq)
        if self.adaptive is not None:
            seq.gamma_choice = self.adaptive.explain(seq) or seq.gamma_choice
            self.adaptive.free(seq)

    def _count_spec(self, seq: Sequence, proposed: int, accepted: int) -> None:
        seq.num_drafts += 1
        seq.num_draft_tokens += proposed
        seq.num_accepted_tokens += accepted
        if self.adaptive is not None:
            self.adaptive.record_verify(seq, proposed, accepted)
        self._spec["num_drafts"] += 1
        self._spec["num_draft_tokens"] += proposed
        self._spec["num_accepted_tokens"] += accepted
        for i in range(accepted):
            self._accepted_by_position[i] += 1

    def _append(self, request: RequestState, rows: torch.Tensor, tokens: list[int]
                ) -> tuple[list[int], str, str | None, list[dict[int, float]]]:
        """Append tokens (each sampled from the logits row beside it) one at a time, stopping exactly where
        decoding them one per step would. -> (tokens appended, new text, finish reason, their logprobs)."""
        seq = request.seq
        new, delta, reason, tops = [], "", None, []
        for row, token in zip(rows, tokens):
            seq.output_ids.append(token)
            new.append(token)
            if seq.constraint is not None:
                seq.constraint.accept(token)
            if seq.params.logprobs is not None:
                tops.append(top_logprobs(row, token, seq.params.logprobs))
                seq.logprobs.append(tops[-1])
            reason = self._finish_reason(seq, token)
            # a stop token ends the text but is not part of it (OpenAI semantics)
            text, hit = request.detok.update(seq, final=reason is not None, drop_last=reason == "stop")
            delta += text
            reason = "stop" if hit else reason
            if reason:
                break
        seq.first_token_time = seq.first_token_time or time.perf_counter()
        self._generation_tokens += len(new)
        return new, delta, reason, tops

    def _publish(self, request: RequestState, tokens: list[int], delta: str, reason: str | None,
                 tops: list[dict[int, float]]) -> None:
        if reason:
            self._end(request, reason)
        output = self._output(request.seq) if reason else None
        request.events.put(StreamEvent(delta, tokens, reason, output, tops if request.seq.params.logprobs is not None
                                       else None))

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_ids):
            return "stop"
        if seq.constraint is not None and seq.constraint.finished:   # the grammar took a stop token
            return "stop"
        if len(seq.output_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _output(self, seq: Sequence) -> RequestOutput:
        now, n, first = time.perf_counter(), len(seq.output_ids), seq.first_token_time
        rate = (n - 1) / (now - first) if n > 1 and now > first else 0.0
        return RequestOutput(seq.request_id, seq.prompt_ids, seq.text, list(seq.output_ids), seq.finish_reason,
                             Usage(len(seq.prompt_ids), n, seq.num_prompt_cached or 0), first - seq.arrival_time, rate,
                             list(seq.logprobs) if seq.params.logprobs is not None else None,
                             self._spec_output(seq) if self.proposer else None)

    def _spec_output(self, seq: Sequence) -> dict:
        """A request's speculation counters, and with adaptive γ its last choice and why."""
        out = {"num_drafts": seq.num_drafts, "num_draft_tokens": seq.num_draft_tokens,
               "num_accepted_tokens": seq.num_accepted_tokens}
        if self.adaptive is not None:
            out["gamma"] = seq.gamma_choice or self.adaptive.explain(seq)
        return out

    # -- public API ----------------------------------------------------------------------------
    def stream(self, prompt: str | list[int] | list[dict], params: SamplingParams | None = None,
               chat: bool = False) -> RequestStream:
        """Validate now (raising RequestError), then yield StreamEvents as tokens decode; the last
        one carries the RequestOutput. Closing the iterator early aborts the request and frees its blocks."""
        seq = self._new_sequence(self.encode(prompt, chat), params or SamplingParams())
        return self._submit([seq])[0]

    def generate(self, prompts: str | list[int] | Seq[str | list[int]],
                 params: SamplingParams | Seq[SamplingParams] | None = None,
                 chat: bool = False) -> RequestOutput | list[RequestOutput]:
        """One prompt -> one RequestOutput; a list of prompts (batched together, one SamplingParams or
        one per prompt) -> a list, in order."""
        single = isinstance(prompts, str) or (isinstance(prompts, list) and bool(prompts)
                                              and not isinstance(prompts[0], (str, list)))
        if not single:
            if not isinstance(prompts, (list, tuple)):
                check_prompt(prompts)      # neither one prompt nor a list of them: says what is taken
            if not prompts:
                raise RequestError("prompts is empty; send a prompt, or a list of them.")
        batch = [prompts] if single else list(prompts)
        if isinstance(params, (list, tuple)):
            if len(params) != len(batch):
                raise RequestError(f"{len(params)} SamplingParams for {len(batch)} prompts; send one, or one each.")
            per_prompt = list(params)
        else:
            per_prompt = [params or SamplingParams()] * len(batch)
        seqs = []
        for i, (prompt, sp) in enumerate(zip(batch, per_prompt)):
            name = "the prompt" if single else f"prompts[{i}]"
            check_prompt(prompt, name)
            try:
                seqs.append(self._new_sequence(self.encode(prompt, chat), sp))
            except RequestError as e:
                raise e if single else RequestError(f"{name}: {e}") from None
        streams = self._submit(seqs)
        outputs = []
        try:
            for stream in streams:
                for event in stream:
                    pass
                outputs.append(event.output)
        finally:
            for stream in streams:
                stream.close()
        return outputs[0] if single else outputs

    def chat(self, messages: list[dict], params: SamplingParams | None = None, tools: list[dict] | None = None,
             tool_choice: str | dict | None = None, parallel_tool_calls: bool = False,
             template_kwargs: dict | None = None, reasoning_parser: str = "auto") -> ChatOutput:
        """One chat turn with OpenAI-style tools. tool_choice "auto" (the default with tools) parses the
        model's own call format out of its reply; "required" and {"type": "function", "function": {"name":
        ...}} are enforced by a grammar, so the calls always parse and their arguments match the schema;
        "none" leaves the reply prose. `template_kwargs` are the chat template's extra variables
        ({"enable_thinking": False}); a thinking model's reasoning is split off as the server splits it
        (`reasoning_parser`: auto, qwen3, deepseek_r1 or none)."""
        params = params or SamplingParams()
        mode, function, constraint = plan_tools(tools, tool_choice, parallel_tool_calls)
        if constraint is not None:
            if params.structured_outputs is not None:
                raise RequestError(f"tool_choice {tool_choice!r} and the params' structured_outputs both constrain "
                                   f"the reply; send one of them.")
            params = dataclasses.replace(params, structured_outputs=constraint)
        parser_name = self.reasoning_parser(reasoning_parser)   # a bad name fails before generating
        ids = self.encode_chat(messages, tools, template_kwargs)
        out = self.generate(ids, params)
        # a reply shaped whole by a constraint is not split: the constraint covers all of it
        reasoning, text = (None, out.text) if params.structured_outputs is not None else \
            self.split_reasoning(ids, out.text, parser_name)
        parser = ReplyParser(mode, {t["function"]["name"] for t in tools or []}, function)
        content, calls = (None, []) if text is None else parser.message(text)
        return ChatOutput(content, calls, ReplyParser.finish_reason(out.finish_reason, bool(calls)), out, reasoning)

    def reasoning_parser(self, name: str = "auto") -> str:
        """The reasoning parser `name` stands for with this engine's chat template (auto: qwen3's when the
        template mentions <think>, else none)."""
        try:
            return resolve_parser(name, str(self.tokenizer.chat_template or ""))
        except ValueError as e:
            raise RequestError(str(e)) from None

    def reasoning_start(self, prompt_ids: list[int], parser: str = "auto") -> bool | None:
        """Where a chat reply to `prompt_ids` starts, read from the prompt's end: inside a reasoning block
        (True), before one it may open (False), or not split at all (None)."""
        return starts_inside(self.reasoning_parser(parser), self.tokenizer.decode(prompt_ids[-PROMPT_TAIL_TOKENS:]))

    def split_reasoning(self, prompt_ids: list[int], text: str, parser: str = "auto") -> tuple[str | None, str | None]:
        """A chat reply to `prompt_ids` -> (reasoning, content), as the server splits a thinking model's
        reply; (None, text) when it is not split."""
        inside = self.reasoning_start(prompt_ids, parser)
        return (None, text) if inside is None else split_reasoning(text, inside)

    def reset_prefix_cache(self) -> None:
        """Forget the cached blocks no request holds, in both tiers (benchmarks use it to measure cold
        prefills)."""
        def reset() -> None:
            self.blocks.reset_prefix_cache()
            # the host tier's memory goes now, with the quantisations queued before it (in order)
            self.runner.launch_moves(self.scheduler.take_moves())

        self._run_on_loop(reset)

    # -- cache files -----------------------------------------------------------------------------
    def save_cache(self, prompt: str | list[int] | list[dict], path: str | Path, chat: bool = False) -> dict:
        """Write the prompt's KV blocks to `path` (atomically), prefilling it first unless it is cached.
        -> {"file", "tokens" (prompt tokens the file covers), "blocks", "bytes"}."""
        ids = self.encode(prompt, chat)
        self.generate(ids, SamplingParams(max_tokens=1, temperature=0))   # a hit, or the prefill that caches it
        cached: list[CachedBlock] = []
        self._run_on_loop(lambda: cached.extend(copy_out(self.blocks, self.runner, self.scheduler, ids)))
        size = write_cache_file(Path(path), cache_identity(self.runner), ids, cached)
        return {"file": str(path), "tokens": len(cached) * self.blocks.block_size, "blocks": len(cached),
                "bytes": size}

    def load_cache(self, path: str | Path, prompt: str | list[int] | list[dict] | None = None,
                   chat: bool = False) -> dict:
        """Put a cache file's blocks into the prefix cache (on the device while it has room), so that a
        request with its prompt hits them. CacheFileError (one line) for a file this engine cannot use, or
        one saved for another prompt than `prompt` when given. -> {"file", "tokens", "blocks"}."""
        ids, cached = read_cache_file(Path(path), cache_identity(self.runner))
        if prompt is not None and self.encode(prompt, chat) != ids:
            raise CacheFileError(f"{path}: saved for another prompt ({len(ids)} tokens) than this one.")
        taken: list[int] = []
        self._run_on_loop(lambda: taken.append(adopt(self.blocks, self.runner, self.scheduler, cached)))
        return {"file": str(path), "tokens": taken[0] * self.blocks.block_size, "blocks": taken[0]}

    def _run_on_loop(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the loop thread between steps and wait for it; its exception is raised here."""
        done, error = threading.Event(), []

        def run() -> None:
            try:
                fn()
            except Exception as e:   # handed to the caller, not to the requests in flight
                error.append(e)
            finally:
                done.set()

        self._on_loop(run)
        done.wait()
        if error:
            raise error[0]

    def stats(self) -> EngineStats:
        """Read from any thread without stopping the loop: each number is read atomically, so a snapshot
        may straddle one step."""
        s = self.scheduler
        pools = {"fp16": self.blocks.usage(False)}
        if self.blocks.quantised:
            pools["quant"] = self.blocks.usage(True)
        if self.blocks.sliding is not None:   # a hybrid model's sliding-window layers, apart
            pools["sliding"] = self.blocks.sliding.usage()
        return EngineStats(dict(self._finished), self._prompt_tokens, self._generation_tokens, s.num_preemptions,
                           s.prefix_queried_tokens, s.prefix_hit_tokens, pools, len(s.running), len(s.waiting),
                           self._spec_stats(), self._host_stats(), self._graph_stats(), self._disk_stats())

    def _graph_stats(self) -> dict[str, dict[str, int]]:
        graphs = self.runner.graphs
        return {kind: dict(graphs.counts[kind]) if graphs is not None else {"graph": 0, "eager": 0}
                for kind in STEP_KINDS}

    def _disk_stats(self) -> dict[str, int]:
        if self.disk is None:
            return {}
        stats = self.disk.stats()
        bs = self.blocks.block_size
        return {**stats, "hit_tokens": stats.pop("hit_blocks") * bs, "missed_tokens": stats.pop("missed_blocks") * bs}

    def close(self) -> None:
        """Finish the disk tier's writes and let go of its directory (a server does this as it stops; another
        engine on the same directory may then write it). The engine still serves, persisting nothing."""
        if self.disk is not None:
            self.disk.close()

    def _spec_stats(self) -> dict:
        out = {**self._spec, "accepted_by_position": list(self._accepted_by_position)}
        if self.adaptive is not None:
            out["adaptive"] = self.adaptive.stats()
        drawn = getattr(self.proposer, "drawn", None)
        if drawn is not None:   # the draft's proposals by where they were drawn (host: a grammar or penalties)
            out["draft_proposals"] = dict(drawn)
        return out

    def _host_stats(self) -> dict[str, float]:
        host, pool = self.blocks.host, self.runner.host_pool
        on = host is not None   # (an empty tier is falsy: it has a length)
        return {"capacity_bytes": host.capacity if on else 0, "used_bytes": host.held if on else 0,
                "blocks": len(host) if on else 0, "hit_tokens": self.scheduler.host_hit_tokens,
                "offloaded_bytes": pool.bytes_offloaded, "restored_bytes": pool.bytes_restored,
                "offload_seconds": pool.seconds_offloading, "restore_seconds": pool.seconds_restoring}
