"""Token ids and SamplingParams into a checked request the loop can run: its sequence (seeded), its
constraint (logit_bias, min_tokens, a compiled grammar, a thinking budget) and its detokenizer. Runs in
the caller's thread, so a bad request or a slow grammar compile never stalls the loop."""
from __future__ import annotations

import itertools
import secrets
import threading

from ..chat.thinking_budget import ThinkingBudget
from ..config import ModelConfig
from ..logits_constraint import GrammarCompiler, LogitsConstraint
from ..sampling import make_generator
from ..sampling_params import SamplingParams
from .prompt_checks import check_prompt_ids
from .request_state import RequestState
from .sequence import Detokenizer, Sequence


def stop_token_ids(cfg: ModelConfig, tokenizer) -> set[int]:
    """The ids that end a reply: the model's and the tokenizer's end of sequence, and the stop tokens the
    model's family declares (ModelFamily.stop_tokens: Gemma 3's end of turn) where the vocabulary has them."""
    ids = set(cfg.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    stop = cfg.declared.stop_tokens
    if stop:
        turn = tokenizer.convert_tokens_to_ids(list(stop))
        ids.update(i for i in turn if i is not None and i != tokenizer.unk_token_id)
    return ids


class RequestBuilder:
    def __init__(self, tokenizer, cfg: ModelConfig, max_model_len: int, seed: int | None, reasoning_parser: str):
        self.tokenizer, self.vocab_size, self.max_model_len = tokenizer, cfg.vocab_size, max_model_len
        self.reasoning_parser = reasoning_parser   # the engine's, which the replies are split by
        self.eos_ids = stop_token_ids(cfg, tokenizer)
        # atomic: requests arrive from many threads; None: fresh entropy per request (see request_seed)
        self._seeds = None if seed is None else itertools.count(seed + 1)
        self._compiler: GrammarCompiler | None = None   # made at the first structured request
        self._lock = threading.Lock()

    def build(self, prompt_ids: list[int], params: SamplingParams) -> RequestState:
        """RequestError (one line) for what this engine cannot run."""
        params.validate()
        check_prompt_ids(prompt_ids, params, self.max_model_len, self.vocab_size)
        seq = Sequence(prompt_ids, params, make_generator(params, self.request_seed()))
        compiler = self.grammar_compiler() if params.structured_outputs is not None else None
        budget = None if params.thinking_budget is None else \
            ThinkingBudget.build(params.thinking_budget, prompt_ids, self.tokenizer, self.reasoning_parser)
        seq.constraint = LogitsConstraint.build(params, self.eos_ids, compiler, budget)
        return RequestState(seq, Detokenizer(self.tokenizer, params.stop, params.min_tokens))

    def grammar_compiler(self) -> GrammarCompiler:
        """The engine's grammar compiler (its cache of compiled grammars), made on first use."""
        with self._lock:
            if self._compiler is None:
                self._compiler = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_ids)
            return self._compiler

    def request_seed(self) -> int:
        """The seed of a request that names none: fresh entropy each time (as OpenAI and vLLM draw), unless
        the engine was given a seed, which makes its sequence of unseeded requests repeat."""
        return secrets.randbits(63) if self._seeds is None else next(self._seeds)
