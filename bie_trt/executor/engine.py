"""`BieEngine`: the in-process SDK over one engine core.

It turns prompts (text, token ids, chat messages through the chat template) into requests of token ids
for its `EngineCore`, which a background thread (`EngineThread`) steps while requests are in flight;
`stream()` and `generate()` read the requests' events, `chat()` parses tool calls and splits a thinking
model's reasoning off the reply, and cache files save and load prompts' KV blocks. Closing a stream aborts
its request, whose blocks are free by the time `close()` returns.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable, Sequence as Seq

from ..chat.reasoning import reply_start, resolve_parser, split_reasoning
from ..chat.reply_processor import ReplyProcessor
from ..chat.tool_calls import CallCheck, ToolSetup
from ..config import EngineConfig
from ..errors import RequestError
from ..logits_constraint import GrammarCompiler
from ..sampling_params import SamplingParams
from .cache_blocks import adopt, cache_identity, copy_out
from ..cache_tiers.cache_file import CachedBlock, CacheFileError, read_cache_file, write_cache_file
from .engine_core import EngineCore
from .engine_stats import engine_stats
from .engine_thread import EngineThread
from .outputs import ChatOutput, EngineStats, RequestOutput
from .prompt_checks import check_prompt
from .prompt_encoder import PromptEncoder
from .streams import RequestStream


class BieEngine:
    # What a caller above the executor (the server, a replica deployment) reads on an engine: these
    # attributes and the public methods. The engine's inside (its runner, scheduler, blocks, disk tier,
    # speculation) is reached through one attribute, `core`, which tests and benchmarks look into between
    # steps; no copy of the core's parts sits here. tests/test_layering.py holds the server to this list and
    # __init__ to these attributes and the facade's own parts (FACADE_PARTS).
    PUBLIC_ATTRIBUTES = ("config", "tokenizer", "model_name", "max_model_len", "vocab_size", "max_num_seqs")
    FACADE_PARTS = ("core", "prompts", "loop")

    def __init__(self, config: EngineConfig | str):
        self.config = config if isinstance(config, EngineConfig) else EngineConfig(engine_dir=str(config))
        # the core first: it checks the manifest before anything reads the tokenizer files
        self.core = core = EngineCore(self.config)
        self.tokenizer = core.tokenizer
        self.prompts = PromptEncoder(self.tokenizer, self.config.chat_template_kwargs)
        self.loop = EngineThread(core)
        self.model_name = core.runner.manifest.model_name
        self.max_model_len = core.max_model_len
        self.vocab_size = core.runner.model_config.vocab_size   # the model's: token ids run 0 .. vocab_size - 1
        self.max_num_seqs = core.scheduler.max_num_seqs         # requests the loop runs at once

    # -- prompts -------------------------------------------------------------------------------
    def encode(self, prompt: str | list[int] | list[dict], chat: bool = False) -> list[int]:
        """Text as `tokenizer(prompt)` tokenises it; a message list or `chat=True` through the chat template."""
        return self.prompts.encode(prompt, chat)

    def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Plain text as the tokenizer splits it, with or without its special tokens."""
        return self.prompts.encode_text(text, add_special_tokens)

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None,
                    template_kwargs: dict | None = None, continue_final: bool = False) -> list[int]:
        """Chat messages and OpenAI tools through the chat template (see PromptEncoder.encode_chat)."""
        return self.prompts.encode_chat(messages, tools, template_kwargs, continue_final)

    def grammar_compiler(self) -> GrammarCompiler:
        """The engine's grammar compiler (its cache of compiled grammars), made on first use."""
        return self.core.requests.grammar_compiler()

    # -- the loop thread (tests look between steps through these) ----------------------------------
    def _on_loop(self, fn: Callable[[], None]) -> None:
        self.loop.call(fn)

    def _run_on_loop(self, fn: Callable[[], None]) -> None:
        self.loop.call_and_wait(fn)

    # -- public API ----------------------------------------------------------------------------
    def stream(self, prompt: str | list[int] | list[dict], params: SamplingParams | None = None,
               chat: bool = False) -> RequestStream:
        """Validate now (raising RequestError), then yield StreamEvents as tokens decode; the last
        one carries the RequestOutput. Closing the iterator early aborts the request and frees its blocks."""
        request = self.core.requests.build(self.encode(prompt, chat), params or SamplingParams())
        return self.loop.submit([request])[0]

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
        requests = []
        for i, (prompt, sp) in enumerate(zip(batch, per_prompt)):
            name = "the prompt" if single else f"prompts[{i}]"
            check_prompt(prompt, name)
            try:
                requests.append(self.core.requests.build(self.encode(prompt, chat), sp))
            except RequestError as e:
                raise e if single else RequestError(f"{name}: {e}") from None
        streams = self.loop.submit(requests)
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
             template_kwargs: dict | None = None) -> ChatOutput:
        """One chat turn with OpenAI-style tools. tool_choice "auto" (the default with tools) parses the
        model's own call format out of its reply; "required" and {"type": "function", "function": {"name":
        ...}} are enforced by a grammar, so the calls always parse and their arguments match the schema;
        "none" leaves the reply prose. `template_kwargs` are the chat template's extra variables
        ({"enable_thinking": False}); a thinking model's reasoning is split off as the server splits it
        (by the engine's parser, EngineConfig.reasoning_parser)."""
        params = params or SamplingParams()
        setup = ToolSetup.of(tools, tool_choice, parallel_tool_calls)
        if setup.constraint is not None:
            params = dataclasses.replace(params, structured_outputs=setup.constrain(params.structured_outputs,
                                                                                    "the params' structured_outputs"))
        ids = self.encode_chat(messages, setup.tools, template_kwargs)
        out = self.generate(ids, params)
        reply = self.reply_processor(ids, setup, params.structured_outputs is not None).reply(out.text,
                                                                                             out.finish_reason)
        return ChatOutput(reply.content, reply.tool_calls, reply.finish_reason, out, reply.reasoning)

    def reply_processor(self, prompt_ids: list[int], tools: ToolSetup, constrained: bool = False,
                        check: CallCheck | None = None) -> ReplyProcessor:
        """The reader of one chat reply to `prompt_ids` (the server's routes and `chat` alike): its reasoning
        split by the engine's parser, unless an output constraint (`constrained`, or tool_choice's) shapes the
        whole reply; its calls read in the model family's format, passing `check` where given."""
        inside = None if constrained or tools.constraint is not None else self.reasoning_start(prompt_ids)
        return ReplyProcessor(tools.parser(check, self.core.runner.model_config.declared.tool_parser), inside)

    def reasoning_parser(self, name: str | None = None) -> str:
        """The reasoning parser `name` stands for with this engine's model family and chat template (auto: the
        one they declare, reasoning.resolve_parser); None: the engine's own (EngineConfig.reasoning_parser),
        which its thinking budgets use."""
        if name is None:
            return self.core.reasoning_parser
        try:
            return resolve_parser(name, str(self.tokenizer.chat_template or ""),
                                 self.core.runner.model_config.declared)
        except ValueError as e:
            raise RequestError(str(e)) from None

    def reasoning_start(self, prompt_ids: list[int], parser: str | None = None) -> bool | None:
        """Where a chat reply to `prompt_ids` starts, read from the prompt's end: inside a reasoning block
        (True), before one it may open (False), or not split at all (None); by the engine's parser unless
        another is named."""
        return reply_start(self.reasoning_parser(parser), prompt_ids, self.tokenizer.decode)

    def split_reasoning(self, prompt_ids: list[int], text: str, parser: str | None = None
                        ) -> tuple[str | None, str | None]:
        """A chat reply to `prompt_ids` -> (reasoning, content), as the server splits a thinking model's
        reply; (None, text) when it is not split."""
        inside = self.reasoning_start(prompt_ids, parser)
        return (None, text) if inside is None else split_reasoning(text, inside)

    def reset_prefix_cache(self) -> None:
        """Forget the cached blocks no request holds, in both tiers (benchmarks use it to measure cold
        prefills)."""
        core = self.core

        def reset() -> None:
            core.blocks.reset_prefix_cache()
            # the host tier's memory goes now, with the quantisations queued before it (in order)
            core.runner.launch_moves(core.scheduler.take_moves())

        self.loop.call_and_wait(reset)

    # -- cache files -----------------------------------------------------------------------------
    def save_cache(self, prompt: str | list[int] | list[dict], path: str | Path, chat: bool = False) -> dict:
        """Write the prompt's KV blocks to `path` (atomically), prefilling it first unless it is cached.
        -> {"file", "tokens" (prompt tokens the file covers), "blocks", "bytes"}."""
        ids, core = self.encode(prompt, chat), self.core
        self.generate(ids, SamplingParams(max_tokens=1, temperature=0))   # a hit, or the prefill that caches it
        cached: list[CachedBlock] = []
        self.loop.call_and_wait(lambda: cached.extend(copy_out(core.blocks, core.runner, core.scheduler, ids)))
        size = write_cache_file(Path(path), cache_identity(core.runner), ids, cached)
        return {"file": str(path), "tokens": len(cached) * core.blocks.block_size, "blocks": len(cached),
                "bytes": size}

    def load_cache(self, path: str | Path, prompt: str | list[int] | list[dict] | None = None,
                   chat: bool = False) -> dict:
        """Put a cache file's blocks into the prefix cache (on the device while it has room), so that a
        request with its prompt hits them. CacheFileError (one line) for a file this engine cannot use, or
        one saved for another prompt than `prompt` when given. -> {"file", "tokens", "blocks"}."""
        core = self.core
        ids, cached = read_cache_file(Path(path), cache_identity(core.runner))
        if prompt is not None and self.encode(prompt, chat) != ids:
            raise CacheFileError(f"{path}: saved for another prompt ({len(ids)} tokens) than this one.")
        taken: list[int] = []
        self.loop.call_and_wait(lambda: taken.append(adopt(core.blocks, core.runner, core.scheduler, cached)))
        return {"file": str(path), "tokens": taken[0] * core.blocks.block_size, "blocks": taken[0]}

    def stats(self) -> EngineStats:
        """Read from any thread without stopping the loop: each number is read atomically, so a snapshot
        may straddle one step."""
        return engine_stats(self.core)

    def close(self) -> None:
        """Finish the disk tier's writes and let go of its directory (a server does this as it stops; another
        engine on the same directory may then write it). The engine still serves, persisting nothing."""
        if self.core.disk is not None:
            self.core.disk.close()
