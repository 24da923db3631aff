"""DraftModelProposer: its bounded cache (sinks + window, original positions), rollback, the
reduced vocabulary's q, and the SmolLM2 engine proposing for itself."""
from __future__ import annotations

import json

import pytest
import torch

from bie_trt.builder.checkpoint.loader import Checkpoint
from bie_trt.config import EngineConfig
from bie_trt.executor.engine import BieEngine
from bie_trt.executor.model_runner import ModelRunner
from bie_trt.executor.sequence import Sequence
from bie_trt.sampling import make_generator
from bie_trt.sampling_params import SamplingParams
from bie_trt.spec_decode.draft import DraftModelProposer
from hf_reference import hf_model

NUM_SPECULATIVE_TOKENS = 4
K = 4096   # the static ids of tiny_draft_engine's draft: SmolLM2's merge order is its id order, so 0..4095


def seq_of(ids: list[int], **params) -> Sequence:
    p = SamplingParams(**{"temperature": 0.0, **params})
    return Sequence(list(ids), p, make_generator(p, 7))


@pytest.fixture(scope="module")
def tiny(tiny_draft_engine):
    """SmolLM2 target, the random 2-layer draft: head over 4,096 ids, window 64."""
    runner = ModelRunner(EngineConfig(engine_dir=str(tiny_draft_engine), device="cpu", max_num_seqs=2))
    return runner, DraftModelProposer(tiny_draft_engine, runner)


@pytest.fixture(scope="module")
def text_ids(smollm2_checkpoint, lee_text):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_checkpoint)(lee_text.read_text())["input_ids"]


def test_long_prompt_reads_sinks_and_last_window_at_their_positions(tiny, tiny_draft, tiny_draft_engine, text_ids):
    """The draft's distribution after a 300-token prompt equals transformers' on the sinks and the
    last window only, fed with their original position ids, over its static ids and every id of the
    prompt outside them (those in first-seen order)."""
    _, proposer = tiny
    ids = text_ids[:300]
    seq = seq_of(ids, temperature=1.0)
    before = proposer.tokens_forwarded
    q = proposer.propose([seq.proposal_request(1)])[0].probs[0]
    assert proposer.tokens_forwarded - before == 16 + 64          # O(window), not O(prompt)
    kept = list(range(16)) + list(range(300 - 64, 300))
    assert proposer.cached_positions(seq) == kept
    own = list(dict.fromkeys(t for t in ids if t >= K))           # the static ids are 0..K-1
    assert len(own) > 10 and proposer.request_ids(seq) == own
    want, vocab = draft_log_probs(tiny_draft, tiny_draft_engine, ids, kept, extra=own)
    assert (q > 0).sum() == len(vocab) == K + len(own)
    # log q to 1e-4 (fp32 ~1e-6 here); position ids of the slots instead of the originals: ~5e-2
    assert torch.allclose(q[vocab].log(), want, atol=1e-4), (q[vocab].log() - want).abs().max()
    proposer.free(seq)


def test_reduced_vocabulary_zeroes_q_outside_it(tiny, tiny_draft_engine, tmp_path, text_ids):
    """q is zero outside the draft's ids and the prompt's, positive inside, and the proposals come from
    them. SmolLM2's merge order is its id order, so the built vocabulary is ids 0..4095: this copy of
    the engine names 4,096 scattered ids instead, to tell a scatter from a prefix."""
    import random
    import shutil

    runner, _ = tiny
    engine = tmp_path / "engine"
    shutil.copytree(tiny_draft_engine, engine)
    ids = sorted(random.Random(0).sample(range(49152), 4096))
    (engine / "draft" / "vocab.json").write_text(json.dumps({"ids": ids}))
    proposer = DraftModelProposer(engine, runner)
    seq = seq_of(text_ids[:40], temperature=1.0, top_p=1.0)
    prop = proposer.propose([seq.proposal_request(4)])[0]
    inside = torch.zeros(49152, dtype=torch.bool)
    inside[ids] = True
    inside[text_ids[:40]] = True
    assert len(prop.token_ids) == 4 and prop.probs.shape == (4, 49152)
    assert (prop.probs[:, ~inside] == 0).all() and (prop.probs[:, inside] > 0).all()
    assert torch.allclose(prop.probs.sum(-1), torch.ones(4), atol=1e-5)
    assert all(inside[t] for t in prop.token_ids)
    greedy = proposer.propose([seq_of(text_ids[:40]).proposal_request(2)])[0]
    assert greedy.probs is None and all(inside[t] for t in greedy.token_ids)


def test_past_r_ids_the_most_recently_seen_keep_their_rows(tiny_draft_engine, tmp_path, text_ids):
    """A copy of the engine whose draft may add R = 8 ids a sequence: its rows buffer holds 8 rows, the
    8 most recently seen ids of the prompt outside the static ones get q > 0 (with their own rows of the
    full head), older ones q = 0; new output ids take the oldest rows; a freed sequence's rows are reused."""
    import shutil

    engine = tmp_path / "engine"
    shutil.copytree(tiny_draft_engine, engine)
    manifest = json.loads((engine / "manifest.json").read_text())
    manifest["draft"]["request_vocab"] = 8
    (engine / "manifest.json").write_text(json.dumps(manifest))
    runner = ModelRunner(EngineConfig(engine_dir=str(engine), device="cpu", max_num_seqs=2))   # reads it
    proposer = DraftModelProposer(engine, runner)
    assert {t.shape[:2] for t in proposer.request_head.values()} == {(runner.max_num_seqs, 8)}

    def most_recent(ids: list[int]) -> set[int]:
        return set(list(dict.fromkeys(t for t in reversed(ids) if t >= K))[:8])

    seq = seq_of(text_ids[:200], temperature=1.0)
    for step in range(2):
        q = proposer.propose([seq.proposal_request(1)])[0].probs[0]
        held, older = most_recent(seq.token_ids), set(t for t in seq.token_ids if t >= K) - most_recent(seq.token_ids)
        assert set(proposer.request_ids(seq)) == held and len(proposer.request_ids(seq)) == 8 and older
        assert all(q[t] > 0 for t in held) and all(q[t] == 0 for t in older)
        assert (q > 0).sum() == K + 8
        slot = proposer.seqs[seq].head_slot
        for row, t in enumerate(proposer.request_ids(seq)):
            assert torch.equal(proposer.request_head["lm_head"][slot, row],
                               proposer.host_head["lm_head"][t].to(runner.dtype))
        seq.output_ids += [t for t in text_ids[1000:1200] if t >= K][:3]   # three ids, then propose again
    proposer.free(seq)
    again = [seq_of(text_ids[:50]), seq_of(text_ids[:60])]
    proposer.propose([s.proposal_request(1) for s in again])
    assert sorted(proposer.seqs[s].head_slot for s in again) == [0, 1]


def test_an_int8_head_gives_the_request_rows_in_int8_too(tiny, tiny_draft_engine, tmp_path, text_ids):
    """The 8 GB profiles keep heads int8: a copy of the engine with both heads int8 proposes over the same
    union, with q within int8 rounding of the fp16 engine's."""
    import shutil

    from safetensors.torch import load_file, save_file

    from bie_trt.kernels.int8_rows import quantize_rows_int8

    runner, proposer = tiny
    engine = tmp_path / "engine"
    shutil.copytree(tiny_draft_engine, engine)
    for name in ("weights.safetensors", "head.safetensors"):
        w = load_file(str(engine / "draft" / name))
        w["lm_head.q"], w["lm_head.scale"] = quantize_rows_int8(w.pop("lm_head"))
        save_file(w, str(engine / "draft" / name))
    int8 = DraftModelProposer(engine, runner)
    assert int8.request_head["lm_head.q"].dtype == torch.int8
    seq, twin = seq_of(text_ids[:120], temperature=1.0), seq_of(text_ids[:120], temperature=1.0)
    q8 = int8.propose([seq.proposal_request(1)])[0].probs[0]
    q = proposer.propose([twin.proposal_request(1)])[0].probs[0]
    assert int8.request_ids(seq) == proposer.request_ids(twin) and len(int8.request_ids(seq)) > 5
    assert torch.equal(q8 > 0, q > 0)
    assert torch.allclose(q8[q > 0].log(), q[q > 0].log(), atol=0.05), (q8[q > 0].log() - q[q > 0].log()).abs().max()
    proposer.free(twin)


def test_rollback_equals_a_fresh_draft(tiny, tiny_draft_engine, text_ids):
    """After proposals are rejected (the sequence took other tokens), the draft's next q is the one a
    draft that never saw the rejected guesses gives."""
    runner, proposer = tiny
    seq = seq_of(text_ids[:50], temperature=1.0)
    guesses = proposer.propose([seq.proposal_request(4)])[0].token_ids
    seq.output_ids += [guesses[0], (guesses[1] + 1) % 4096]       # first accepted, second replaced
    q = proposer.propose([seq.proposal_request(3)])[0].probs[0]
    fresh = DraftModelProposer(tiny_draft_engine, runner)
    q_fresh = fresh.propose([seq_of(seq.token_ids, temperature=1.0).proposal_request(1)])[0].probs[0]
    assert torch.allclose(q, q_fresh, atol=1e-5), (q - q_fresh).abs().max()
    proposer.free(seq)


def test_proposals_drawn_on_the_device_are_the_host_samplers(tiny, monkeypatch):
    """Drawn on the device (fed step to step there, handed over once), a batch's proposals and their q are
    the ones the host path draws with the same seeds; a request with penalties is drawn on the host, beside
    the others, and counted there."""
    from bie_trt.spec_decode import draft

    _, proposer = tiny
    prompts = [[5, 17, 300, 42, 7], [9, 8, 7, 6, 5, 4]]

    def round_of(penalised: bool = False) -> list:
        seqs = [seq_of(p, temperature=1.0, seed=i) for i, p in enumerate(prompts)]
        if penalised:
            seqs[1] = seq_of(prompts[1], temperature=1.0, seed=1, repetition_penalty=1.0 + 1e-7)
        out = proposer.propose([s.proposal_request(NUM_SPECULATIVE_TOKENS) for s in seqs])
        for s in seqs:
            proposer.free(s)
        return out

    before = dict(proposer.drawn)
    on_device = round_of()
    assert proposer.drawn["device"] - before["device"] == 2 * NUM_SPECULATIVE_TOKENS
    with monkeypatch.context() as m:
        m.setattr(draft, "drawn_on_host", lambda request: True)
        on_host = round_of()
    assert proposer.drawn["host"] - before["host"] == 2 * NUM_SPECULATIVE_TOKENS
    for d, h in zip(on_device, on_host):
        assert d.token_ids == h.token_ids and len(d.token_ids) == NUM_SPECULATIVE_TOKENS
        assert torch.allclose(d.probs, h.probs)
    mixed = round_of(penalised=True)   # a penalty too small to change q: the same proposals, drawn on the host
    assert [p.token_ids for p in mixed] == [p.token_ids for p in on_device]
    assert proposer.drawn["host"] - before["host"] == 3 * NUM_SPECULATIVE_TOKENS


def test_draft_kv_is_the_same_for_6k_and_1k_prompts(build, tiny_draft, text_ids):
    engine = build(checkpoint=str(tiny_draft), draft_checkpoint=str(tiny_draft))   # default window 1,024
    runner = ModelRunner(EngineConfig(engine_dir=str(engine), device="cpu", max_num_seqs=2))
    proposer = DraftModelProposer(engine, runner)
    held, forwarded = [], []
    for n in (1000, 6000):
        seq = seq_of(text_ids[:n])
        before = proposer.tokens_forwarded
        proposer.propose([seq.proposal_request(4)])
        forwarded.append(proposer.tokens_forwarded - before)
        held.append(proposer.blocks_held(seq))
        # the prompt (or its sinks and last window), then the 3 proposals fed back (the 4th is not)
        window = list(range(n + 3)) if n <= 1024 else list(range(16)) + list(range(n - 1024, n + 3))
        assert proposer.cached_positions(seq) == window
        proposer.free(seq)
    assert held[0] == held[1] == proposer.blocks_per_seq == 1 + 64 + 1
    assert forwarded == [1000 + 3, 16 + 1024 + 3]
    assert sorted(proposer.free_blocks) == list(range(2 * proposer.blocks_per_seq))   # all returned
    # the pool is the plan's draft_kv item (fp16 bytes, max_num_seqs sequences), scaled to this runner
    manifest = json.loads((engine / "manifest.json").read_text())
    planned = next(i["bytes"] for i in manifest["plan"]["items"] if i["name"] == "draft_kv")
    allocated = sum(t.nbytes for t in proposer.pools.tensors().values())
    per_seq_fp16 = allocated // runner.max_num_seqs * 2 // runner.dtype.itemsize
    assert per_seq_fp16 == planned // manifest["max_num_seqs"]


def draft_log_probs(tiny_draft, tiny_draft_engine, ids: list[int], positions: list[int],
                    extra: list[int] = ()) -> torch.Tensor:
    """transformers' log-distribution of the draft over its static vocabulary and the `extra` ids after
    the tokens at `positions`, fed with those original position ids."""
    with torch.no_grad():
        logits = hf_model(Checkpoint(tiny_draft))(torch.tensor([[ids[p] for p in positions]]),
                                                  position_ids=torch.tensor([positions])).logits[0, -1]
    static = json.loads((tiny_draft_engine / "draft" / "vocab.json").read_text())["ids"]
    vocab = torch.tensor(static + list(extra))
    return torch.log_softmax(logits[vocab], -1), vocab


@pytest.fixture(scope="module")
def one_layer(build, smollm2_checkpoint, tmp_path_factory):
    """A one-layer random model as its own draft (head over 4,096 ids, window 64). With one layer a
    cached token's K/V depend only on that token and its position, not on what it saw, so after the
    window wraps the draft's distribution must be transformers' over exactly the tokens it holds."""
    from bie_trt.builder.checkpoint.quantize import quantize_checkpoint
    from tiny_model import write_tiny_hf

    root = tmp_path_factory.mktemp("one-layer")
    hf = write_tiny_hf(root / "hf", smollm2_checkpoint, num_hidden_layers=1, max_position_embeddings=8192)
    awq = quantize_checkpoint(hf, root / "awq", group_size=32)
    engine = build(checkpoint=str(awq), draft_checkpoint=str(awq), draft_vocab_size=4096, draft_window_tokens=64,
                   max_model_len=512)
    runner = ModelRunner(EngineConfig(engine_dir=str(engine), device="cpu", max_num_seqs=2))
    return awq, engine, DraftModelProposer(engine, runner)


def test_a_long_run_keeps_a_sliding_window_in_its_fixed_blocks(one_layer, text_ids):
    """Proposing step after step past the window: the blocks never change in number, the cache always
    holds the sinks and a contiguous run of at least `window` tokens ending at the newest, and after the
    window has wrapped the draft's distribution is transformers' over exactly those tokens."""
    checkpoint, engine, proposer = one_layer
    seq = seq_of(text_ids[:20], temperature=1.0)
    for step in range(40):
        guesses = proposer.propose([seq.proposal_request(4)])[0].token_ids
        seq.output_ids += guesses[:step % 3] + [text_ids[20 + step]]   # some accepted, then the target's own
        pos = proposer.cached_positions(seq)
        window = pos[16:]
        assert pos[:16] == list(range(16)) and proposer.blocks_held(seq) == proposer.blocks_per_seq
        assert window == list(range(window[0], window[0] + len(window)))
        assert len(window) >= min(64, seq.num_tokens - 16) and len(pos) <= proposer.blocks_per_seq * 16
    q = proposer.propose([seq.proposal_request(1)])[0].probs[0]
    own = list(dict.fromkeys(t for t in seq.token_ids if t >= K))
    want, vocab = draft_log_probs(checkpoint, engine, seq.token_ids, proposer.cached_positions(seq), extra=own)
    assert torch.allclose(q[vocab].log(), want, atol=1e-4), (q[vocab].log() - want).abs().max()
    proposer.free(seq)


@pytest.mark.slow
def test_smollm2_as_its_own_draft_proposes_the_targets_greedy_tokens(build, text_ids):
    """The target (INT4 KV) decodes greedily; the draft (the same weights, FP16 window covering the
    context) proposes 4 tokens a step, accepted up to the first mismatch: >= 95% accepted."""
    engine_dir = build(draft_checkpoint="smollm2-135m", draft_vocab_size=49152)
    target = BieEngine(EngineConfig(engine_dir=str(engine_dir), device="cpu", kv_cache_dtype="int4_asym"))
    proposer = DraftModelProposer(engine_dir, target.core.runner)
    proposed = accepted = 0
    for start in (0, 5000):
        prompt = text_ids[start:start + 120]
        ref = target.generate(prompt, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)).token_ids
        seq, i = seq_of(prompt), 0
        while i < len(ref) - 1:
            guesses = proposer.propose([seq.proposal_request(4)])[0].token_ids
            judged = min(len(guesses), len(ref) - i)   # guesses past the reference's end are not judged
            m = next((j for j, (g, r) in enumerate(zip(guesses, ref[i:])) if g != r), judged)
            proposed, accepted = proposed + judged, accepted + m
            seq.output_ids += ref[i:i + m + 1]
            i += m + 1
        proposer.free(seq)
    assert accepted / proposed >= 0.95, (accepted, proposed)
