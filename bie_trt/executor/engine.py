"""`BieEngine`: the in-process SDK. Chunked prefill, then decode, one step at a time."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence as Seq

import torch

from ..config import EngineConfig, SamplingParams
from ..errors import RequestError
from ..model.llama import SeqInput
from ..sampling import make_generator, sample_next
from .block_manager import BlockManager
from .model_runner import ModelRunner
from .sequence import Detokenizer, Sequence, Status


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


@dataclass
class StreamEvent:
    """One step of a streamed request: the new text, the new token, and the end."""

    delta: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    output: RequestOutput | None = None   # set on the last event


def _load_tokenizer(engine_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(engine_dir)


class BieEngine:
    def __init__(self, config: EngineConfig | str):
        self.config = config if isinstance(config, EngineConfig) else EngineConfig(engine_dir=str(config))
        self.runner = ModelRunner(self.config)
        self.tokenizer = _load_tokenizer(self.config.engine_dir)
        self.model_name = self.runner.manifest["model"]["name"]
        self.max_model_len = self.runner.max_model_len
        pools = self.runner.pools
        self.blocks = BlockManager(self.runner.kv_config, pools.num_fp_blocks, pools.num_quant_blocks)
        cfg = self.runner.model_config
        self.eos_ids = set(cfg.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_ids.add(self.tokenizer.eos_token_id)
        self._lock = threading.Lock()   # one request at a time; the scheduler (issue 6) lifts this
        self._seed_counter = self.config.seed

    # -- prompts -------------------------------------------------------------------------------
    def encode(self, prompt: str | list[int] | list[dict], chat: bool = False) -> list[int]:
        """Text as `tokenizer(prompt)` tokenises it; a message list or `chat=True` through the chat template."""
        if isinstance(prompt, list) and (not prompt or isinstance(prompt[0], int)):
            return list(prompt)
        if chat or isinstance(prompt, list):
            messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
            if not self.tokenizer.chat_template:
                raise RequestError("this engine's tokenizer has no chat template; send a plain prompt instead.")
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        return list(self.tokenizer(prompt)["input_ids"])

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
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise RequestError(f"prompt token ids must be in [0, {vocab}).")
        self._seed_counter += 1
        return Sequence(prompt_ids, params, make_generator(params, self._seed_counter))

    # -- the loop ------------------------------------------------------------------------------
    def _step(self, seq: Sequence) -> torch.Tensor | None:
        """Run the next chunk of `seq` (a prefill chunk or one decode token). Returns logits once
        the whole prompt is cached, else None."""
        pending = seq.token_ids[seq.num_cached:]
        chunk = pending[: self.runner.chunk_size]
        self.blocks.grow(seq, seq.num_cached + len(chunk))
        logits = self.runner.forward([SeqInput(torch.tensor(chunk), seq.num_cached, seq.block_table)])[0]
        seq.num_cached += len(chunk)
        self.blocks.compact(seq, self.runner.pools)
        return logits if seq.num_cached == seq.num_tokens else None

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_ids):
            return "stop"
        if len(seq.output_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _run(self, seq: Sequence) -> Iterator[StreamEvent]:
        detok = Detokenizer(self.tokenizer, seq.params.stop)
        seq.status = Status.RUNNING
        start = time.perf_counter()
        first = None
        try:
            while True:
                logits = self._step(seq)
                if logits is None:
                    continue
                token = sample_next(logits, seq.params, seq.generator, seq.prompt_ids, seq.output_ids)
                first = first or time.perf_counter()
                seq.output_ids.append(token)
                reason = self._finish_reason(seq, token)
                # a stop token ends the text but is not part of it (OpenAI semantics)
                delta, hit = detok.update(seq, final=reason is not None, drop_last=reason == "stop")
                if hit:
                    reason = "stop"
                if reason:
                    seq.finish_reason, seq.status = reason, Status.FINISHED
                    yield StreamEvent(delta, [token], reason, self._output(seq, start, first))
                    return
                yield StreamEvent(delta, [token])
        finally:
            self.blocks.free(seq)   # also when the consumer stops early (a dropped client)

    def _output(self, seq: Sequence, start: float, first: float | None) -> RequestOutput:
        now = time.perf_counter()
        n = len(seq.output_ids)
        ttft = (first or now) - start
        rate = (n - 1) / (now - first) if first and n > 1 and now > first else 0.0
        return RequestOutput(seq.request_id, seq.prompt_ids, seq.text, list(seq.output_ids), seq.finish_reason,
                             Usage(len(seq.prompt_ids), n), ttft, rate)

    # -- public API ----------------------------------------------------------------------------
    def stream(self, prompt: str | list[int] | list[dict], params: SamplingParams | None = None,
               chat: bool = False) -> Iterator[StreamEvent]:
        """Validate now (raising RequestError), then yield StreamEvents as tokens decode; the last
        one carries the RequestOutput. Closing the iterator early frees the request's blocks."""
        seq = self._new_sequence(self.encode(prompt, chat), params or SamplingParams())
        return self._locked_run(seq)

    def _locked_run(self, seq: Sequence) -> Iterator[StreamEvent]:
        with self._lock:
            yield from self._run(seq)

    def generate(self, prompts: str | list[int] | Seq[str | list[int]], params: SamplingParams | None = None,
                 chat: bool = False) -> RequestOutput | list[RequestOutput]:
        """One prompt -> one RequestOutput; a list of prompts -> a list, in order."""
        single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int))
        batch = [prompts] if single else list(prompts)
        outputs = []
        for p in batch:
            last = None
            for event in self.stream(p, params, chat):
                last = event
            outputs.append(last.output)
        return outputs[0] if single else outputs
