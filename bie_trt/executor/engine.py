"""`BieEngine`: the in-process SDK over one engine loop (DESIGN §3, §7).

While requests are in flight a background thread runs the loop: admit, prefix-cache lookup,
chunked prefill mixed with decodes, sample, stream, free. Only that thread touches the scheduler,
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence as Seq

import torch

from ..config import EngineConfig, SamplingParams, StructuredOutputs
from ..device_sampling import device_generator, sample_on_device
from ..errors import EngineError, RequestError
from ..model.llama import SeqInput
from ..plan import bounded_fp_blocks_per_seq, planned_step_tokens, step_tokens
from ..sampling import make_generator, sample_next
from ..spec.proposer import Proposal
from ..spec.rejection import verify
from ..spec.select import make_proposer, resolve_speculative
from ..structured import GrammarCompiler, GrammarError, LogitsConstraint
from ..tool_calls import (ReplyParser, ToolCall, parameters_of, required_schema, template_messages,
                          template_renders_tools)
from .block_manager import BlockManager, copy_blocks
from .exact_rows import join_runs
from .model_runner import ModelRunner
from .scheduler import Scheduler
from .sequence import Detokenizer, Sequence


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int

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
    """`BieEngine.chat`'s reply: prose, parsed tool calls, and OpenAI's finish reason ("tool_calls" when
    the reply ended with calls)."""

    content: str | None
    tool_calls: list[ToolCall]
    finish_reason: str | None
    output: RequestOutput


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


@dataclass
class _Request:
    seq: Sequence
    detok: Detokenizer
    events: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    done: threading.Event = field(default_factory=threading.Event)   # set once its blocks are free


_CLOSED = object()   # wakes a reader blocked on a closed stream


class RequestStream:
    """One request's StreamEvents in order; the last carries its RequestOutput. Closing the stream (or
    dropping it) aborts the request; `close()` is safe from any thread, also while another waits in
    `next()`."""

    def __init__(self, engine: "BieEngine", request: _Request):
        self._engine, self._request, self._done = engine, request, False

    def __iter__(self) -> "RequestStream":
        return self

    def __next__(self) -> StreamEvent:
        if self._done:
            raise StopIteration
        item = self._request.events.get()
        if item is _CLOSED:
            raise StopIteration
        if isinstance(item, BaseException):
            self._done = True
            raise item
        self._done = item.output is not None
        return item

    def close(self) -> None:
        if not self._done:
            self._done = True
            self._engine._abort(self._request, wait=True)
            self._request.events.put(_CLOSED)

    def __del__(self) -> None:
        # Dropped unclosed: abort without waiting, since a finaliser may run on any thread, even the loop's.
        if not self._done:
            self._engine._abort(self._request, wait=False)


def _load_tokenizer(engine_dir: str, chat_template: str | None = None):
    """The engine's tokenizer; `chat_template` (a jinja2 file) replaces the checkpoint's own template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(engine_dir)
    if chat_template is not None:
        tokenizer.chat_template = read_chat_template(chat_template)
    return tokenizer


def read_chat_template(path: str) -> str:
    import jinja2

    try:
        text = Path(path).read_bytes().decode("utf-8")
        jinja2.Environment().parse(text)
    except OSError as e:
        raise RequestError(f"chat template {path}: cannot be read ({e.strerror}); pass a jinja2 file.") from None
    except UnicodeDecodeError:
        raise RequestError(f"chat template {path}: not UTF-8 text; pass a jinja2 file.") from None
    except jinja2.TemplateSyntaxError as e:
        raise RequestError(f"chat template {path}: jinja2 syntax error on line {e.lineno} ({e.message}); "
                           f"fix the template.") from None
    return text


def _top_logprobs(logits: torch.Tensor, token: int, n: int) -> dict[int, float]:
    """Log-probabilities of the model's distribution (before sampling filters): top n and the sampled token."""
    logp = torch.log_softmax(logits.float(), -1)
    values, ids = torch.topk(logp, n)
    top = dict(zip(ids.tolist(), values.tolist()))
    top[token] = float(logp[token])
    return top


def plan_tools(tools: list[dict] | None, tool_choice: str | dict | None, parallel: bool = True
               ) -> tuple[str, str | None, StructuredOutputs | None]:
    """OpenAI's tools and tool_choice -> (reply mode: none, auto, required or named; the named function;
    the constraint that enforces it)."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise RequestError(f"tool_choice {tool_choice!r} needs tools; send the functions in tools.")
        return "none", None, None
    if not all(isinstance(t, dict) and isinstance(t.get("function"), dict)
               and isinstance(t["function"].get("name"), str) for t in tools):
        raise RequestError('each tool must be {"type": "function", "function": {"name": ..., "parameters": {...}}}.')
    if tool_choice in (None, "auto", "none"):
        return tool_choice or "auto", None, None
    if tool_choice == "required":
        return "required", None, StructuredOutputs(json=required_schema(tools, parallel))
    name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    if name is None:
        raise RequestError(f'tool_choice must be "none", "auto", "required" or {{"type": "function", "function": '
                           f'{{"name": ...}}}}; got {tool_choice!r}.')
    tool = next((t for t in tools if t["function"]["name"] == name), None)
    if tool is None:
        raise RequestError(f"tool_choice names function {name!r}, which is not in tools "
                           f"({sorted(t['function']['name'] for t in tools)}).")
    return "named", name, StructuredOutputs(json=parameters_of(tool))


def check_prompt(prompt: object, name: str = "the prompt") -> None:
    """One line naming `name` (`prompts[1]`) for a prompt `encode` cannot take: empty, or no string, list of
    token ids or list of chat messages."""
    if isinstance(prompt, (str, list)) and not prompt:
        raise RequestError(f"{name} is empty; send at least one token.")
    if isinstance(prompt, str):
        return
    if isinstance(prompt, list):
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt) or all(isinstance(m, dict)
                                                                                       for m in prompt):
            return
        kinds = sorted({type(p).__name__ for p in prompt})
        got = f"a list of {' and '.join(kinds)}"
        several = "; to run several prompts, pass generate() a list of them" if kinds == ["str"] else ""
    else:
        got, several = type(prompt).__name__, ""
    raise RequestError(f"{name} must be a string, a list of token ids or a list of chat messages; got {got}"
                       f"{several}.")


class BieEngine:
    def __init__(self, config: EngineConfig | str):
        self.config = config if isinstance(config, EngineConfig) else EngineConfig(engine_dir=str(config))
        self.runner = ModelRunner(self.config)
        self.tokenizer = _load_tokenizer(self.config.engine_dir, self.config.chat_template)
        self.model_name = self.runner.manifest["model"]["name"]
        self.max_model_len = self.runner.max_model_len
        pools, kv, chunk = self.runner.pools, self.runner.kv_config, self.runner.chunk_size
        max_num_seqs = self.runner.max_num_seqs
        engine_dir = Path(self.config.engine_dir)
        self.speculative = resolve_speculative(self.config.speculative, self.runner.manifest, engine_dir)
        gamma = self.speculative.num_speculative_tokens if self.speculative.enabled else 0
        budget = self._step_budget(chunk, max_num_seqs, gamma)
        self._check_limits(pools.num_fp_blocks, budget, max_num_seqs, gamma)
        self.proposer = make_proposer(self.speculative, engine_dir, self.runner)
        self.blocks = BlockManager(kv, pools.num_fp_blocks, pools.num_quant_blocks, self.config.enable_prefix_caching)
        self.scheduler = Scheduler(self.blocks, max_num_seqs, budget, chunk, gamma, self.max_model_len,
                                   self.proposer.free if self.proposer else None)
        cfg = self.runner.model_config
        self.eos_ids = set(cfg.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_ids.add(self.tokenizer.eos_token_id)
        # atomic: requests arrive from many threads; None: fresh entropy per request (see _request_seed)
        self._seeds = None if self.config.seed is None else itertools.count(self.config.seed + 1)
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._requests: dict[Sequence, _Request] = {}
        self._loop_lock = threading.Lock()                    # guards starting and ending the loop thread
        self._loop_thread: threading.Thread | None = None
        self._finished: collections.Counter[str] = collections.Counter()
        self._prompt_tokens = self._generation_tokens = 0
        self._spec = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0}
        self._accepted_by_position = [0] * gamma
        self._grammar_compiler: GrammarCompiler | None = None   # made at the first structured request
        self._grammar_lock = threading.Lock()
        self._template_renders_tools: bool | None = None        # checked at the first chat with tools

    def _step_budget(self, chunk: int, max_num_seqs: int, gamma: int) -> int:
        """Tokens a step may run: never more than the memory plan holds activations for. By default a chunk
        beside every decode and its proposals, cut to the plan's when speculation it was not planned for
        asks more (proposals then take only what a prefill chunk leaves)."""
        planned = planned_step_tokens(self.runner.manifest["plan"]["inputs"])
        wanted = self.config.max_num_batched_tokens
        if wanted is None:
            return min(step_tokens(chunk, max_num_seqs, gamma), planned)
        if wanted > planned:
            raise EngineError(f"max_num_batched_tokens {wanted} is above the {planned} tokens a step of this engine "
                              f"holds activations for in its memory plan; lower it (or leave it unset), or rebuild "
                              f"with a larger --chunked-prefill-size.")
        return wanted

    def _check_limits(self, num_fp_blocks: int, budget: int, max_num_seqs: int, gamma: int) -> None:
        """The scheduler relies on one sequence always fitting the pool alone, and on a step's budget
        holding a decode of every running sequence, so that it always makes progress."""
        kv = self.runner.kv_config
        per_seq = -(-self.max_model_len // kv.block_size)
        if kv.dtype != "fp16":
            per_seq = min(per_seq, bounded_fp_blocks_per_seq(kv, kv.window, self.runner.chunk_size))
        if num_fp_blocks < per_seq:
            raise EngineError(f"the FP16 KV pool has {num_fp_blocks} blocks but one sequence of max_model_len "
                              f"{self.max_model_len} needs {per_seq}; raise num_kv_blocks or lower max_model_len.")
        if budget < max_num_seqs:
            raise EngineError(f"max_num_batched_tokens {budget} is below max_num_seqs {max_num_seqs}; every running "
                              f"sequence must be able to decode in each step.")
        # Verified tokens must stay FP16 until accepted: a block is quantised only once its tokens are final.
        if gamma and kv.dtype != "fp16" and kv.window < gamma + 1:
            raise EngineError(f"the KV window of {kv.window} tokens is smaller than the {gamma + 1} tokens a "
                              f"speculative step verifies; lower num_speculative_tokens to {max(kv.window - 1, 0)} or "
                              f"less (0: off), or build with a larger --kv-window.")

    # -- prompts -------------------------------------------------------------------------------
    def encode(self, prompt: str | list[int] | list[dict], chat: bool = False) -> list[int]:
        """Text as `tokenizer(prompt)` tokenises it; a message list or `chat=True` through the chat template."""
        check_prompt(prompt)
        if isinstance(prompt, list) and isinstance(prompt[0], int):
            return list(prompt)
        if chat or isinstance(prompt, list):
            return self._apply_template(prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}])
        return list(self.tokenizer(prompt)["input_ids"])

    def _apply_template(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        if not self.tokenizer.chat_template:
            raise RequestError("this engine's tokenizer has no chat template; send a plain prompt instead.")
        ids = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Chat messages and OpenAI tools through the chat template. A template that does not render tools
        gets them as a system prompt, and assistant tool calls and tool results as text it can render."""
        uses_tools = tools or any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)
        if not uses_tools:
            return self.encode(messages, chat=True)
        check_prompt(messages, "messages")
        if self._template_renders_tools is None and self.tokenizer.chat_template:
            self._template_renders_tools = template_renders_tools(self.tokenizer)
        native = bool(self._template_renders_tools)
        return self._apply_template(template_messages(messages, tools, native), tools if native else None)

    def _new_sequence(self, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        params.validate()
        if not prompt_ids:
            raise RequestError("the prompt is empty; send at least one token.")
        if len(prompt_ids) >= self.max_model_len:
            raise RequestError(
                f"the prompt has {len(prompt_ids)} tokens but this engine's max_model_len is {self.max_model_len} "
                f"(prompt plus at least one generated token must fit); shorten the prompt or rebuild with a larger "
                f"--max-model-len.")
        vocab = self.runner.model_config.vocab_size
        if (bad := next((t for t in prompt_ids if not 0 <= t < vocab), None)) is not None:
            raise RequestError(f"prompt token id {bad} is outside the vocabulary [0, {vocab}); send ids from this "
                               f"model's tokenizer.")
        if params.logit_bias and (bad := next((t for t in params.logit_bias if t >= vocab), None)) is not None:
            raise RequestError(f"logit_bias token id {bad} is outside the vocabulary [0, {vocab}); send ids from "
                               f"this model's tokenizer.")
        seq = Sequence(prompt_ids, params, make_generator(params, self._request_seed()))
        # compiled here, in the caller's thread: a bad grammar fails this call and never stalls the loop
        compiler = self.grammar_compiler() if params.structured_outputs is not None else None
        seq.constraint = LogitsConstraint.build(params, self.eos_ids, compiler)
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

    def _requests_of_step(self) -> list[_Request]:
        """The requests a failed step may have touched: the running batch, which every step is drawn from
        (the scheduler's state mid-step is not kept, so all of it). With none running, the waiting
        ones, so that a fault that recurs cannot spin."""
        seqs = self.scheduler.running or self.scheduler.waiting
        return [self._requests[seq] for seq in list(seqs) if seq in self._requests]

    def _fail(self, requests: list[_Request], error: Exception) -> None:
        """End `requests` (their blocks freed at once) and hand each the error instead of a next event."""
        for request in requests:
            self._end(request, "error")
            request.events.put(error)

    def _submit(self, seqs: list[Sequence]) -> list[RequestStream]:
        requests = [_Request(seq, Detokenizer(self.tokenizer, seq.params.stop)) for seq in seqs]
        self._on_loop(lambda: self._add(requests))   # one call: all are admitted in the same step
        return [RequestStream(self, r) for r in requests]

    def _add(self, requests: list[_Request]) -> None:
        for request in requests:
            self._requests[request.seq] = request
            self.scheduler.add(request.seq)
            self._prompt_tokens += len(request.seq.prompt_ids)

    def _abort(self, request: _Request, wait: bool) -> None:
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

    def _end(self, request: _Request, reason: str) -> None:
        self.scheduler.finish(request.seq, reason)
        del self._requests[request.seq]
        self._finished[reason] += 1
        request.done.set()

    # -- one step --------------------------------------------------------------------------------
    def _step(self) -> None:
        batch = self.scheduler.schedule()
        if not batch.chunks:
            raise RuntimeError("the scheduler made no progress with requests waiting (a KV accounting bug)")
        pools = self.runner.pools
        copy_blocks(pools, batch.copies)
        for seq, _ in batch.chunks:   # a prefix hit can bring FP16 blocks already out of seq's window
            self.blocks.compact(seq, pools)
        proposals = self._propose(batch.lookahead)
        inputs, num_runs, all_logits, quantise = [], [], [], []
        for seq, n in batch.chunks:
            drafts = proposals[seq].token_ids if seq in proposals else []
            ids = torch.tensor(seq.token_slice(seq.num_cached, seq.num_cached + n) + drafts)
            # each run of rows reads the blocks plain decoding had quantised at its position (exact_rows)
            views, pairs = self.blocks.row_views(seq, len(ids), pools)
            inputs += [SeqInput(ids[row:row + rows], seq.num_cached + row, table, all_logits=bool(drafts))
                       for row, rows, table in views]
            num_runs.append(len(views))
            all_logits.append(bool(drafts))
            quantise += pairs
        logits = join_runs(self.runner.forward(inputs, quantise), num_runs, all_logits)
        for (seq, n), rows in zip(batch.chunks, logits):
            request = self._requests[seq]
            try:
                if seq in proposals:
                    self._verify(request, rows, proposals[seq])
                    continue
                self.blocks.commit(seq, n)
                if seq in batch.lookahead:   # room was kept for proposals that did not come
                    self.blocks.truncate(seq)
                self.blocks.compact(seq, pools)
                if seq.num_pending == 0:   # the whole prompt (or the last sampled token) is cached: sample
                    self._publish(request, *self._append(request, rows[None], [self._sample(seq, rows)]))
            except GrammarError as e:   # one request's grammar failed: that request ends, the batch goes on
                self._fail([request], e)

    @staticmethod
    def _sample(seq: Sequence, logits: torch.Tensor) -> int:
        """The next token from logits [V]. On a GPU it is drawn there and only its id crosses to the host;
        a seed then repeats on that kind of device (a CUDA generator's numbers are not the CPU's)."""
        if not logits.is_cuda:
            return sample_next(logits, seq.params, seq.generator, seq.prompt_ids, seq.output_ids, seq.constraint)
        if seq.device_generator is None:
            seq.device_generator = device_generator(seq.params, seq.generator.initial_seed(), logits.device)
        return sample_on_device(logits, seq.params, seq.device_generator, seq.prompt_ids, seq.output_ids,
                                constraint=seq.constraint)[0]

    def _propose(self, lookahead: dict[Sequence, int]) -> dict[Sequence, Proposal]:
        """Proposals for the decodes the scheduler kept room for; empty ones are left out."""
        if not lookahead or self.proposer is None:
            return {}
        seqs = list(lookahead)
        proposals = self.proposer.propose(seqs, [lookahead[s] for s in seqs])
        for seq, proposal in zip(seqs, proposals):
            if len(proposal.token_ids) > lookahead[seq]:
                raise RuntimeError(f"the proposer returned {len(proposal.token_ids)} tokens where "
                                   f"{lookahead[seq]} fit (a proposer bug)")
        return {seq: p for seq, p in zip(seqs, proposals) if p.token_ids}

    def _verify(self, request: _Request, rows: torch.Tensor, proposal: Proposal) -> None:
        """rows [k+1, V]: the target's logits at the pending token and each of k proposals. Emit what
        rejection sampling keeps; the cache keeps the K/V of the accepted tokens only."""
        seq = request.seq
        tokens = verify(rows, proposal, seq.params, seq.generator, seq.prompt_ids, seq.output_ids, seq.constraint)
        accepted = len(tokens) - 1
        self._count_spec(seq, len(proposal.token_ids), accepted)
        appended = self._append(request, rows, tokens)
        # K/V hold for the pending token and the accepted proposals: as many as were appended, when the
        # request stopped inside the run (its blocks are freed just after; prefix caching keeps them).
        self.blocks.commit(seq, min(len(tokens), len(appended[0]) + 1))
        self.blocks.truncate(seq)
        self.blocks.compact(seq, self.runner.pools)
        self._publish(request, *appended)

    def _count_spec(self, seq: Sequence, proposed: int, accepted: int) -> None:
        seq.num_drafts += 1
        seq.num_draft_tokens += proposed
        seq.num_accepted_tokens += accepted
        self._spec["num_drafts"] += 1
        self._spec["num_draft_tokens"] += proposed
        self._spec["num_accepted_tokens"] += accepted
        for i in range(accepted):
            self._accepted_by_position[i] += 1

    def _append(self, request: _Request, rows: torch.Tensor, tokens: list[int]
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
                tops.append(_top_logprobs(row, token, seq.params.logprobs))
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

    def _publish(self, request: _Request, tokens: list[int], delta: str, reason: str | None,
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
                             Usage(len(seq.prompt_ids), n), first - seq.arrival_time, rate,
                             list(seq.logprobs) if seq.params.logprobs is not None else None,
                             {"num_drafts": seq.num_drafts, "num_draft_tokens": seq.num_draft_tokens,
                              "num_accepted_tokens": seq.num_accepted_tokens} if self.proposer else None)

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
             tool_choice: str | dict | None = None, parallel_tool_calls: bool = True) -> ChatOutput:
        """One chat turn with OpenAI-style tools. tool_choice "auto" (the default with tools) parses the
        model's own call format out of its reply; "required" and {"type": "function", "function": {"name":
        ...}} are enforced by a grammar, so the calls always parse and their arguments match the schema;
        "none" leaves the reply prose."""
        params = params or SamplingParams()
        mode, function, constraint = plan_tools(tools, tool_choice, parallel_tool_calls)
        if constraint is not None:
            if params.structured_outputs is not None:
                raise RequestError(f"tool_choice {tool_choice!r} and the params' structured_outputs both constrain "
                                   f"the reply; send one of them.")
            params = dataclasses.replace(params, structured_outputs=constraint)
        out = self.generate(self.encode_chat(messages, tools), params)
        parser = ReplyParser(mode, {t["function"]["name"] for t in tools or []}, function)
        content, calls = parser.message(out.text)
        return ChatOutput(content, calls, ReplyParser.finish_reason(out.finish_reason, bool(calls)), out)

    def reset_prefix_cache(self) -> None:
        """Forget the cached blocks no request holds (benchmarks use it to measure cold prefills)."""
        done = threading.Event()
        self._on_loop(lambda: (self.blocks.reset_prefix_cache(), done.set()))
        done.wait()

    def stats(self) -> EngineStats:
        """Read from any thread without stopping the loop: each number is read atomically, so a snapshot
        may straddle one step."""
        s = self.scheduler
        pools = {"fp16": self.blocks.usage(False)}
        if self.blocks.quantised:
            pools["quant"] = self.blocks.usage(True)
        return EngineStats(dict(self._finished), self._prompt_tokens, self._generation_tokens, s.num_preemptions,
                           s.prefix_queried_tokens, s.prefix_hit_tokens, pools, len(s.running), len(s.waiting),
                           {**self._spec, "accepted_by_position": list(self._accepted_by_position)})
