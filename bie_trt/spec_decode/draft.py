"""The draft-model proposer: a small model sharing the target's tokenizer guesses the next tokens.

Its cache is bounded per sequence: the first tokens (sinks, in whole blocks) and a sliding window
of the most recent ones, all FP16, each token keeping its original RoPE position. A sequence owns
a fixed set of blocks; when they are full the oldest window block is moved to the end of the
table and reused, so memory and the cost of a step do not grow with the context. A long prompt
is read only through its sinks and its last window (O(window), not O(prompt)).

The proposer remembers which token it cached in each slot. On each call it compares them with
the sequence's tokens: rejected guesses are simply no longer there, and the cache is cut back to
the longest prefix that still matches.

The draft's head covers a reduced vocabulary (draft/vocab.json) plus, per sequence, up to R rows
of its full head (draft/head.safetensors, kept in host memory) for the ids of the sequence's own
text outside it (request_vocab.py). Its logits over that union are scattered into the whole
vocabulary (-inf elsewhere) and processed exactly as the target's are (penalties, temperature,
top-k/p, min-p), so q(x) = 0 outside the union and rejection sampling stays exact.

Proposals are drawn on the device: each draft step's token, drawn there by the one sampler with the
request's draft generator on that device, is the next step's input without visiting the host, and
its distribution q stays there for verification; the round's tokens come to the host once, after
its last step. A request whose proposals depend on the tokens drawn before them on the host (a
grammar, whose mask follows each token; penalties, which count them; logit_bias and min_tokens,
kept on the host) is drawn there instead, one transfer a step, as before; `drawn` counts both.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Hashable, Sequence as Seq

import torch
from safetensors.torch import load_file

from .. import engine_format as ef
from ..config import KVCacheConfig
from ..errors import EngineError
from ..kernels.int8_rows import Int8Rows
from ..kernels.step_inputs import SeqInput
from ..kv.pool import allocate_pools
from ..logits_constraint import GrammarError
from ..model.cuda_graphs import DecodeGraphs
from ..model.llama import LlamaModel
from ..plan import draft_kv_blocks_per_seq
from ..sampling import draw, process_logits
from .proposer import Proposal, ProposalRequest, TargetRuntime
from .request_vocab import RequestVocab

DRAFT_SEED_SALT = 0x5DEECE66D


def draft_generator(target_seed: int) -> torch.Generator:
    """The draft's own generator for a request whose target generator was seeded `target_seed`. Salted:
    with the target's seed its numbers would repeat the ones verification draws to accept or reject
    them, and the emitted tokens would no longer follow the target's distribution. The target's stream
    is not the one it would be without speculation either: each verify draws k uniforms and one
    multinomial from it where plain decoding draws one token a step, so a seeded request's sampled
    tokens follow the same distribution, not the same draws (greedy tokens are the same)."""
    g = torch.Generator()
    g.manual_seed((target_seed ^ DRAFT_SEED_SALT) % 2**63)
    return g


def drawn_on_host(request: ProposalRequest) -> bool:
    """Whether a request's proposals must be drawn on the host, one at a time: its constraint (a grammar's
    mask follows each token; logit_bias and min_tokens live on the host) or penalties (they count the
    tokens drawn before) need each token there."""
    p = request.params
    return (request.constraint is not None or p.repetition_penalty != 1.0 or bool(p.presence_penalty)
            or bool(p.frequency_penalty))


@dataclass
class _DraftSeq:
    """One sequence's draft cache: slot i of its block table holds token ids[i] at position pos[i] (-1 while a
    token drawn on the device this round is not on the host yet)."""

    blocks: list[int]
    generator: torch.Generator
    pos: list[int]
    ids: list[int]
    vocab: RequestVocab
    head_slot: int   # its rows in the proposer's extra head (-1: none)
    vocab_ids: torch.Tensor | None = None   # vocab.ids on the device (None: none yet, or changed)
    device_generator: torch.Generator | None = None   # the generator's seed on the device (off the CPU)


class DraftModelProposer:
    def __init__(self, engine_dir: Path, runner: TargetRuntime) -> None:
        engine_dir = Path(engine_dir)
        draft = runner.manifest.draft
        if draft is None:
            raise EngineError(f"{engine_dir}: the engine has no draft model; build it with "
                              f"`bie-trt build --draft-checkpoint DIR|NAME`, or speculate with n-gram lookup.")
        self.cfg = draft.config
        self.target_vocab = runner.model_config.vocab_size   # >= the draft's: ids past its end get no proposals
        self.window = draft.window   # room for num_speculative_tokens: checked by `resolve`
        self.device, self.block_size = runner.device, runner.kv_config.block_size
        self.sink_slots = math.ceil(draft.sink_tokens / self.block_size) * self.block_size
        self.model = LlamaModel(self.cfg, load_file(str(engine_dir / ef.DRAFT_DIR / ef.WEIGHTS)), runner.device,
                                runner.dtype, embedding_on_host=runner.manifest.plan.embedding_placement == "host")
        ids = json.loads((engine_dir / ef.DRAFT_DIR / ef.DRAFT_VOCAB).read_text())["ids"]
        self.vocab_ids = torch.tensor(ids, dtype=torch.long)
        self.static_ids = frozenset(ids)
        self.request_rows = draft.request_vocab
        self._load_request_head(engine_dir, runner)
        self.blocks_per_seq = draft_kv_blocks_per_seq(draft.sink_tokens, self.window, self.block_size)
        kv = KVCacheConfig(dtype="fp16", sink_tokens=draft.sink_tokens, window=self.window,
                           block_size=self.block_size)
        target_graphs = runner.graphs
        self.pools = allocate_pools(self.cfg, kv, runner.max_num_seqs * self.blocks_per_seq, 0, runner.dtype,
                                    runner.device, scratch_block=target_graphs is not None)
        # Its decode steps (every proposal after the first of a round) replayed from CUDA graphs at the
        # target's batch sizes, in the target's graph pool; hidden states come out, its heads follow.
        self.graphs = None if target_graphs is None else DecodeGraphs(
            self.model, self.pools, target_graphs.batch_sizes, self.blocks_per_seq * self.block_size,
            self.pools.scratch_block, head=False, pool_handle=target_graphs.handle)
        self.steps = {"graph": 0, "eager": 0}   # draft forwards by how they ran, for tests and benchmarks
        self.free_blocks = list(range(runner.max_num_seqs * self.blocks_per_seq))
        self.chunked_prefill_size = runner.chunked_prefill_size
        self.seqs: dict[Hashable, _DraftSeq] = {}   # request key -> its cache
        self.tokens_forwarded = 0   # tokens run through the draft, for tests and benchmarks
        self.vocab_ids_device = self.vocab_ids.to(self.device)
        self.drawn = {"device": 0, "host": 0}   # proposals by where they were drawn (host: see drawn_on_host)

    # -- the Proposer protocol ----------------------------------------------------------------

    def propose(self, requests: Seq[ProposalRequest]) -> list[Proposal]:
        proposals = [Proposal([], None) for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        feeds = {i: self._sync(r) for i, r in enumerate(requests) if r.num_tokens > 0}
        try:
            self._draft(requests, feeds, proposals, probs)
        finally:   # the grammars back where they were: the target's verification walks them itself
            for request, proposal in zip(requests, proposals):
                if request.constraint is not None:
                    request.constraint.rollback(len(proposal.token_ids))
        for p, q in zip(proposals, probs):
            p.probs = torch.stack(q) if q else None
        return proposals

    def _draft(self, requests: Seq[ProposalRequest], feeds: dict[int, list[tuple[int, int | torch.Tensor]]],
               proposals: list[Proposal], probs: list[list[torch.Tensor]]) -> None:
        """Run the draft over each request's unseen tokens, then one proposal after another. A proposal drawn on
        the device feeds the next step as it is (a one-element tensor there); one drawn on the host advances its
        request's grammar. The device's proposals come to the host together, after the last step."""
        on_device: dict[int, list[torch.Tensor]] = {}   # request -> its proposals still on the device
        while feeds:
            budget, inputs, fed = self.chunked_prefill_size, [], []
            for i, feed in feeds.items():
                if budget <= 0:
                    break
                piece = self._take(self.seqs[requests[i].key], feed, budget)
                inputs.append(piece)
                fed.append(i)
                budget -= len(piece.token_ids)
            self.tokens_forwarded += sum(len(s.token_ids) for s in inputs)
            hidden = self._hidden(inputs)
            for i, row in zip(fed, hidden):
                if feeds[i]:
                    continue   # more of its context first
                request, state = requests[i], self.seqs[requests[i].key]
                if drawn_on_host(request):
                    drawn = self._sample(request, state, self._logits(state, row).cpu(), proposals[i].token_ids)
                    if drawn is None:   # the grammar allows nothing the draft can say
                        del feeds[i]
                        continue
                    token, q = drawn
                    proposals[i].token_ids.append(token)
                    count, done = len(proposals[i].token_ids), request.constraint is not None and request.constraint.finished
                    self.drawn["host"] += 1
                else:
                    token, q = draw(self._logits(state, row), request.params, self._generator(state))
                    on_device.setdefault(i, []).append(token)
                    count, done = len(on_device[i]), False
                    self.drawn["device"] += 1
                if q is not None:
                    probs[i].append(q)
                if count < request.num_tokens and not done:
                    feeds[i] = [(state.pos[-1] + 1, token)]
                else:
                    del feeds[i]
        if on_device:   # the round's one transfer: every proposal drawn on the device, in one copy
            drawn = torch.cat([t for i in on_device for t in on_device[i]]).tolist()
            for i, tokens in on_device.items():
                proposals[i].token_ids, drawn = drawn[:len(tokens)], drawn[len(tokens):]
                state = self.seqs[requests[i].key]
                # the slots that hold them (the last proposal is not run through the draft)
                slots = [k for k, t in enumerate(state.ids) if t < 0]
                for k, t in zip(slots, proposals[i].token_ids):
                    state.ids[k] = t

    def _generator(self, state: _DraftSeq) -> torch.Generator:
        """The request's draft generator where its proposals are drawn: itself on the CPU, else one on the device
        seeded as it was (as the target's own sampling does)."""
        if self.device.type == "cpu":
            return state.generator
        if state.device_generator is None:
            state.device_generator = torch.Generator(device=self.device)
            state.device_generator.manual_seed(state.generator.initial_seed())
        return state.device_generator

    def _hidden(self, inputs: list[SeqInput]) -> list[torch.Tensor] | torch.Tensor:
        """Each input's last hidden state: from a graph when one fits (a decode step), else eagerly."""
        if len({s.token_ids.device for s in inputs}) > 1:   # proposals drawn on the device beside host ones
            inputs = [replace(s, token_ids=s.token_ids.to(self.device)) for s in inputs]
        rows = self.graphs.run(inputs) if self.graphs is not None else None
        self.steps["eager" if rows is None else "graph"] += 1
        return self.model.final_hidden(inputs, self.pools) if rows is None else rows

    def free(self, key: Hashable) -> None:
        state = self.seqs.pop(key, None)
        if state is not None:
            self.free_blocks += state.blocks
            if state.head_slot >= 0:
                self.free_head_slots.append(state.head_slot)

    # -- the bounded cache --------------------------------------------------------------------

    def cached_positions(self, key: Hashable) -> list[int]:
        """Original positions of the tokens the draft holds for a request (sinks, then the window)."""
        state = self.seqs.get(key)
        return list(state.pos) if state else []

    def blocks_held(self, key: Hashable) -> int:
        state = self.seqs.get(key)
        return len(state.blocks) if state else 0

    def _state(self, request: ProposalRequest) -> _DraftSeq:
        if request.key not in self.seqs:
            if len(self.free_blocks) < self.blocks_per_seq:
                raise EngineError("the draft's cache is full: more sequences speculate than the engine's "
                                  "max_num_seqs; free finished requests with `free(key)`.")
            blocks, self.free_blocks = self.free_blocks[:self.blocks_per_seq], self.free_blocks[self.blocks_per_seq:]
            slot = self.free_head_slots.pop(0) if self.request_rows else -1
            self.seqs[request.key] = _DraftSeq(blocks, draft_generator(request.seed), [], [],
                                       RequestVocab(self.request_rows, self.static_ids, self.cfg.vocab_size), slot)
        return self.seqs[request.key]

    def _sync(self, request: ProposalRequest) -> list[tuple[int, int]]:
        """Cut the cache back to what still matches the request's tokens; return the (position, token) pairs
        to run before proposing: the new tokens, or only the sinks and the last window of them."""
        state = self._state(request)
        n = request.num_total
        self._fill_request_rows(state, state.vocab.admit(request.token_slice(state.vocab.seen, n)))
        keep = self._matching_prefix(state, request)
        if keep and state.pos[keep - 1] == n - 1:
            keep -= 1   # everything is cached: run the last token again for its logits
        del state.pos[keep:], state.ids[keep:]
        start = state.pos[-1] + 1 if state.pos else 0
        if n - start <= self.window:
            wanted = list(range(start, n))
        else:   # far behind (a long prompt): the sinks it lacks, then the last window
            sinks = sum(p < self.sink_slots for p in state.pos)
            del state.pos[sinks:], state.ids[sinks:]
            wanted = list(range(sinks, min(self.sink_slots, n))) + list(range(max(self.sink_slots, n - self.window), n))
        tokens = request.token_slice(wanted[0], n) if wanted else []
        return [(p, tokens[p - wanted[0]]) for p in wanted]

    @staticmethod
    def _matching_prefix(state: _DraftSeq, request: ProposalRequest) -> int:
        """Slots whose cached token is still the request's token at that position (positions run in at most
        two contiguous stretches: the sinks and the window)."""
        slot = 0
        while slot < len(state.pos):
            end = slot
            while end + 1 < len(state.pos) and state.pos[end + 1] == state.pos[end] + 1:
                end += 1
            actual = request.token_slice(state.pos[slot], state.pos[end] + 1)
            for cached, token in zip(state.ids[slot:end + 1], actual):
                if cached != token:
                    return slot
                slot += 1
            if slot <= end:   # the request is shorter than what was cached
                return slot
        return slot

    def _take(self, state: _DraftSeq, feed: list[tuple[int, int]], budget: int) -> SeqInput:
        """The next piece of `feed` (contiguous positions, at most `budget` tokens, as many as the
        sequence's blocks hold), appended to its cache."""
        capacity = self.blocks_per_seq * self.block_size
        if len(state.pos) == capacity:   # full: recycle the oldest window block (>= window tokens stay)
            first = self.sink_slots // self.block_size
            state.blocks.append(state.blocks.pop(first))
            del state.pos[self.sink_slots:self.sink_slots + self.block_size]
            del state.ids[self.sink_slots:self.sink_slots + self.block_size]
        n = 1   # a device proposal comes alone: its feed is that one token
        limit = min(len(feed), capacity - len(state.pos), budget)
        while n < limit and feed[n][0] == feed[n - 1][0] + 1:
            n += 1
        piece, feed[:n] = feed[:n], []
        slot = len(state.pos)
        state.pos += [p for p, _ in piece]
        if isinstance(piece[0][1], torch.Tensor):   # a proposal drawn on the device: its id comes after the round
            state.ids.append(-1)
            ids = piece[0][1]
        else:
            state.ids += [t for _, t in piece]
            ids = torch.tensor([self._embeddable(t) for _, t in piece], dtype=torch.long)
        return SeqInput(ids, slot, state.blocks, rope_offset=piece[0][0] - slot)

    def _embeddable(self, token: int) -> int:
        """An id the draft can read: a target id past the draft's vocabulary (a padded row the target
        sampled or a prompt sent) is read as id 0. The proposals then condition on a stand-in, which
        costs acceptance at that position only: rejection sampling is exact for any proposal."""
        return token if token < self.cfg.vocab_size else 0

    # -- the request's own ids ---------------------------------------------------------------

    def _load_request_head(self, engine_dir: Path, runner: TargetRuntime) -> None:
        """The full head in host memory, and on the device R rows of it per sequence (the plan's
        draft_request_head), filled as the sequence's ids arrive."""
        self.free_head_slots = list(range(runner.max_num_seqs)) if self.request_rows else []
        self.host_head: dict[str, torch.Tensor] = {}
        self.request_head: dict[str, torch.Tensor] = {}
        if not self.request_rows:
            return
        self.host_head = load_file(str(engine_dir / ef.DRAFT_DIR / ef.DRAFT_HEAD))
        for name, t in self.host_head.items():   # an fp16 head computes in the model's dtype, as its own does
            dtype = runner.dtype if name == "lm_head" else t.dtype
            self.request_head[name] = torch.zeros(runner.max_num_seqs, self.request_rows, *t.shape[1:],
                                                  dtype=dtype, device=self.device)

    def _fill_request_rows(self, state: _DraftSeq, writes: list[tuple[int, int]]) -> None:
        if not writes:
            return
        rows = torch.tensor([r for r, _ in writes])
        ids = torch.tensor([i for _, i in writes])
        for name, buf in self.request_head.items():
            buf[state.head_slot, rows.to(buf.device)] = self.host_head[name][ids].to(buf.device, buf.dtype)
        state.vocab_ids = torch.tensor(state.vocab.ids, device=self.device)   # before the round, not in it

    def request_ids(self, key: Hashable) -> list[int]:
        """The ids outside the static head the draft holds rows for, for a request (row order)."""
        state = self.seqs.get(key)
        return list(state.vocab.ids) if state else []

    def _logits(self, state: _DraftSeq, row: torch.Tensor) -> torch.Tensor:
        """The draft's logits over the whole vocabulary, on the device: its static head's and the sequence's own
        rows', -inf elsewhere."""
        full = torch.full((self.target_vocab,), -torch.inf, device=self.device)
        full[self.vocab_ids_device] = self.model.head_logits(row[None])[0].float()
        n = len(state.vocab.ids)
        if n:
            heads = {name: buf[state.head_slot, :n] for name, buf in self.request_head.items()}
            head = heads["lm_head"] if "lm_head" in heads else Int8Rows(heads["lm_head.q"], heads["lm_head.scale"])
            full[state.vocab_ids] = self.model.head_logits(row[None], head)[0].float()
        return full

    # -- sampling -----------------------------------------------------------------------------

    @staticmethod
    def _sample(request: ProposalRequest, state: _DraftSeq, full: torch.Tensor, proposed: list[int]
                ) -> tuple[int, torch.Tensor | None] | None:
        """One proposal from the draft's logits (over the whole vocabulary, -inf outside its own),
        processed as the target's are, its grammar's mask included, and taken by the grammar; returns q
        (None when greedy: q is one-hot). None when the grammar leaves the draft nothing to propose."""
        constraint = request.constraint
        try:
            full = process_logits(full, request.params, request.prompt_ids, request.output_ids + proposed,
                                  constraint)
        except GrammarError:   # the target's own step meets it and ends the request
            return None
        if constraint is not None and not bool(torch.isfinite(full).any()):
            return None
        token, q = draw(full, request.params, state.generator)
        if constraint is not None and not constraint.try_accept(int(token)):
            return None
        return int(token), q
