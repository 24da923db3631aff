"""Speculative decoding in the engine: greedy output identical with n-gram proposals and without, on the
bundled SmolLM2 engine with an INT4 KV cache (a short window, so blocks are quantised during the runs),
batched with mixed lengths, across prefill chunks, a prefix-cache hit, preemption, stops; no leaks."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner

from bie_trt import BieEngine, EngineConfig, EngineError, SamplingParams, SpeculativeConfig
from bie_trt.spec_decode.adaptive import MEASURE_SAMPLES, StepCosts
from bie_trt.chat.thinking_budget import THINK_END
from bie_trt.cli import main
from bie_trt.resolve import resolve_speculative

PASSAGE = ("The river rises in the hills above the old mill and runs south through three villages before it "
           "meets the sea. In spring the water is high and fast; in late summer children walk across it on the "
           "stones below the bridge.")
CODE = ("def area(width, height):\n    return width * height\n\n\ndef perimeter(width, height):\n"
        "    return 2 * (width + height)\n")
PROMPTS = [   # input-grounded, so that lookup proposals are often right; mixed lengths
    f"Copy the passage exactly.\n\nPassage: {PASSAGE}\n\nCopy: The river rises in the hills",
    f"Rename width to w in this code.\n\n{CODE}\nRenamed:\ndef area(w, height):",
    "Repeat after me: one two three four, one two three four, one two",
]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
# INT4 with a 32-token window and 4 sinks: blocks leave the window within these prompts; 32-token
# chunks: the first prompt (~60+ tokens with the instruction) spans several.
KV = dict(kv_cache_dtype="int4_asym", kv_window=32, kv_sink_tokens=4, chunked_prefill_size=32)


def make(engine_dir, speculative, **kw) -> BieEngine:
    return BieEngine(EngineConfig(engine_dir=str(engine_dir), device="cpu", speculative=speculative,
                                  **{"max_model_len": 384, **KV, **kw}))


@pytest.fixture(scope="module")
def plain(smollm2_engine):
    return make(smollm2_engine, {"method": "none"})


@pytest.fixture(scope="module")
def spec(smollm2_engine):
    return make(smollm2_engine, {"method": "ngram", "num_speculative_tokens": 5, "adaptive": True})


@pytest.fixture(scope="module")
def fixed(smollm2_engine):
    """A fixed γ: every step verifies what the lookup finds, whatever the host's timings say (for tests that
    need steps of several tokens)."""
    return make(smollm2_engine, {"method": "ngram", "num_speculative_tokens": 5, "adaptive": False})


@pytest.fixture(scope="module")
def expected(plain):
    return [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]


def idle(engine: BieEngine) -> bool:
    return all(pool["used"] == 0 for pool in engine.stats().kv_blocks.values())


def test_batched_greedy_is_identical_and_proposals_are_accepted(spec, expected):
    assert len(spec.tokenizer(PROMPTS[0])["input_ids"]) > 2 * KV["chunked_prefill_size"]   # several chunks
    outs = spec.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == expected
    stats = spec.stats().spec_decode
    assert stats["num_accepted_tokens"] > 10 and stats["num_drafts"] > 0
    assert sum(stats["accepted_by_position"]) == stats["num_accepted_tokens"]
    assert stats["accepted_by_position"] == sorted(stats["accepted_by_position"], reverse=True)
    assert sum(o.spec_decode["num_accepted_tokens"] for o in outs) == stats["num_accepted_tokens"]
    # the last timed step's context: what its sequences had in the cache, on average
    lengths = [len(spec.tokenizer(p)["input_ids"]) for p in PROMPTS]
    assert min(lengths) <= spec.core.spec.adaptive.costs.context < max(lengths) + GREEDY.max_tokens
    assert idle(spec)


def set_costs(engine: BieEngine, monkeypatch, verify_ratio: float, proposal_ratio: float = 0.0) -> None:
    """The adaptive engine's step costs as if measured, and held there for the test (its own timings no longer
    recorded): a verify of any width `verify_ratio` plain steps, proposing (a draft step, a lookup)
    `proposal_ratio` (set on the loop thread, between steps)."""
    adaptive = engine.core.spec.adaptive
    costs = StepCosts(adaptive.gamma_max, adaptive.costs.per_token)
    for _ in range(MEASURE_SAMPLES + 2):   # the first of each is cold, and the others wait for a plain step
        costs.record_target(1, 1.0)
        for rows in range(2, adaptive.gamma_max + 2):
            costs.record_target(rows, verify_ratio)
        costs.record_proposal(max(proposal_ratio, 1e-9))

    def put() -> None:
        monkeypatch.setattr(adaptive, "costs", costs)
        monkeypatch.setattr(adaptive, "record_step", lambda *args: None)
        monkeypatch.setattr(adaptive, "record_proposal", lambda *args: None)
        adaptive.requests.clear()

    engine._run_on_loop(put)


def test_adaptive_gamma_steps_aside_and_back_and_changes_no_token(spec, expected, monkeypatch):
    """Verifying made to look 50 plain steps dear: the requests decode plainly (no probes either: nothing could
    pay); made as cheap as a plain step: they speculate. The tokens are plain decoding's either way."""
    assert spec.core.spec.adaptive is not None
    steps = spec.core.spec.adaptive.steps_by_gamma
    short = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)   # greedy: the first 10 of `expected`
    set_costs(spec, monkeypatch, 50.0)
    adaptive = spec.core.spec.adaptive
    before, judged, drafts = list(steps), adaptive.engine.tried[0], spec.stats().spec_decode["num_drafts"]
    assert [o.token_ids for o in spec.generate(PROMPTS[:2], short)] == [e[:10] for e in expected[:2]]
    plain_steps, speculating = steps[0] - before[0], sum(steps[1:]) - sum(before[1:])
    assert plain_steps >= 5 and speculating == 0 and spec.stats().spec_decode["num_drafts"] == drafts
    # what the lookups found was judged by the tokens the plain steps drew (quoting prompts: mostly right)
    assert spec.core.spec.adaptive.engine.tried[0] > judged * 0.98 ** plain_steps + 1
    set_costs(spec, monkeypatch, 1.0)
    before = list(steps)
    out = spec.generate(PROMPTS[2], short)
    assert out.token_ids == expected[2][:10]
    assert sum(steps[1:]) - sum(before[1:]) > 0 and out.spec_decode["gamma"]["reason"] == "best"
    assert idle(spec)


def test_a_draft_that_does_not_pay_runs_no_draft_step_and_no_verify(tiny_draft_engine, monkeypatch):
    """A draft step made to cost a plain step (itself as its draft, as on the CPU): every step is a plain decode,
    the draft reads no token (not even the ones it missed, until a probe that never comes) and nothing is
    verified; the tokens are plain decoding's."""
    spec = BieEngine(EngineConfig(engine_dir=str(tiny_draft_engine), device="cpu",
                                  speculative={"method": "draft_model", "num_speculative_tokens": 4}))
    assert spec.core.spec.adaptive is not None and spec.core.spec.adaptive.costs.per_token   # the draft's default
    plain = BieEngine(EngineConfig(engine_dir=str(tiny_draft_engine), device="cpu", speculative={"method": "none"}))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    set_costs(spec, monkeypatch, 1.1, 1.0)
    out = spec.generate(PROMPTS[2], params)
    assert out.token_ids == plain.generate(PROMPTS[2], params).token_ids
    assert spec.core.spec.proposer.tokens_forwarded == 0 and sum(spec.core.spec.proposer.steps.values()) == 0
    assert out.spec_decode["num_drafts"] == 0 and spec.core.spec.adaptive.steps_by_gamma == [11, 0, 0, 0, 0]
    assert spec.core.spec.adaptive.probes == 0


def test_a_prefix_cache_hit_keeps_the_tokens(spec, expected):
    before = spec.stats().prefix_hit_tokens
    out = spec.generate(PROMPTS[0], GREEDY)   # its blocks (accepted tokens only) are cached from the batch
    assert spec.stats().prefix_hit_tokens > before
    assert out.token_ids == expected[0]


def test_stops_inside_an_accepted_run_cut_where_plain_decoding_stops(fixed, plain, expected):
    spec = fixed
    events = list(spec.stream(PROMPTS[0], GREEDY))
    offsets, at = [], 0
    for e in events:
        offsets.append(at)
        at += len(e.token_ids)
    run = next(i for i, e in enumerate(events) if len(e.token_ids) >= 3)   # a step that accepted proposals
    inside = offsets[run] + 1   # the run's second token
    tokens = expected[0]
    text_before = spec.tokenizer.decode(tokens[:inside])
    stop = spec.tokenizer.decode(tokens[:inside + 1])[len(text_before):]
    assert stop.strip() and stop not in text_before
    for params in (SamplingParams(temperature=0, max_tokens=inside + 1, ignore_eos=True),
                   SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop]),
                   SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[tokens[inside]])):
        if tokens[inside] in tokens[:inside] and params.stop_token_ids:
            continue
        got, want = spec.generate(PROMPTS[0], params), plain.generate(PROMPTS[0], params)
        assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
        assert len(got.token_ids) == inside + 1
    assert idle(spec)


def test_streamed_deltas_add_up_with_several_tokens_a_step(fixed):
    events = list(fixed.stream(PROMPTS[2], GREEDY))
    assert max(len(e.token_ids) for e in events) > 1
    assert "".join(e.delta for e in events) == events[-1].output.text
    assert sum(len(e.token_ids) for e in events) == len(events[-1].output.token_ids)


def test_logprobs_are_the_targets(spec, plain):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    got, want = spec.generate(PROMPTS[2], params), plain.generate(PROMPTS[2], params)
    assert got.token_ids == want.token_ids
    for a, b in zip(got.logprobs, want.logprobs):
        assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-3 for t in a)


def test_an_abort_mid_run_frees_every_block(spec):
    stream = spec.stream(PROMPTS[0], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    next(stream), next(stream)
    stream.close()
    assert idle(spec)


def test_after_each_verify_a_table_holds_only_the_blocks_its_cached_tokens_fill(spec):
    """Blocks taken for proposals that were rejected go back at once: between two steps every running
    sequence holds exactly the blocks its cached tokens fill, as without speculation."""
    def tables() -> list[tuple[int, int]]:
        looked = threading.Event()
        seen = []

        def look() -> None:   # on the loop thread, between two steps
            size = spec.core.blocks.block_size
            seen.extend((len(s.block_table), -(-s.num_cached // size)) for s in spec.core.scheduler.running)
            looked.set()

        spec._on_loop(look)
        looked.wait()
        return seen

    stream = spec.stream(PROMPTS[0], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    seen = [pair for _ in stream for pair in tables()]
    assert len(seen) > 5 and all(held == filled for held, filled in seen), seen
    assert spec.stats().spec_decode["num_draft_tokens"] > spec.stats().spec_decode["num_accepted_tokens"]


def test_preemption_in_a_tiny_pool_keeps_the_tokens(smollm2_engine, expected):
    # a fixed γ: every step proposes what lookup finds, so the batch outgrows the pool and preempts
    engine = make(smollm2_engine, {"method": "ngram", "adaptive": False}, num_kv_blocks=10, enable_prefix_caching=False)
    outs = engine.generate(PROMPTS, GREEDY)
    assert engine.stats().preemptions > 0
    assert [o.token_ids for o in outs] == expected
    assert idle(engine)


def test_a_window_smaller_than_a_verify_step_is_refused(smollm2_engine):
    with pytest.raises(EngineError, match="window of 4 tokens is smaller than the 6"):
        make(smollm2_engine, {"method": "ngram", "num_speculative_tokens": 5}, kv_window=4)


def test_draft_model_without_a_draft_is_refused(smollm2_engine):
    with pytest.raises(EngineError, match="draft"):
        make(smollm2_engine, {"method": "draft_model"})


@pytest.mark.parametrize("bad, message", [
    ({"method": "eagle"}, "method 'eagle' is unknown"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1"),
    ({"method": "ngram", "prompt_lookup_min": 5}, "prompt_lookup_min 5 is above prompt_lookup_max 4"),
    ({"method": "ngram", "gamma": 3}, "unknown keys \\['gamma'\\]"),
    ({"method": "ngram", "adaptive": "yes"}, "adaptive must be true or false"),
    ('{"method": ', "not valid JSON"),
])
def test_bad_speculative_configs_say_what_is_wrong(bad, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(bad)


def test_adaptive_gamma_is_the_default_for_both_methods():
    assert SpeculativeConfig("draft_model").adaptive and SpeculativeConfig("ngram").adaptive
    assert SpeculativeConfig.parse({"method": "ngram"}).adaptive
    assert not SpeculativeConfig.parse({"method": "ngram", "adaptive": False}).adaptive
    assert not SpeculativeConfig.parse({"method": "draft_model", "adaptive": False}).adaptive


def test_the_default_comes_from_the_manifest_else_a_draft_else_off():
    assert resolve_speculative(None, None, 0, False) == SpeculativeConfig("none")
    stored = {"method": "ngram", "num_speculative_tokens": 3}
    assert resolve_speculative(None, stored, 0, False) == SpeculativeConfig("ngram", 3)
    assert resolve_speculative(None, None, 0, True) == SpeculativeConfig("draft_model", 5)   # a draft/
    assert resolve_speculative({"method": "none"}, None, 0, True) == SpeculativeConfig("none")
    with pytest.raises(EngineError, match="unknown"):
        resolve_speculative({"method": "medusa"}, None, 0, False)


@pytest.mark.slow   # kept out of the default suite's six minutes; CI runs it
def test_generate_cli_speculates_and_reports_it(smollm2_engine):
    prompt = "Repeat after me: one two three four, one two three four, one two"
    res = CliRunner().invoke(main, ["generate", "--engine", str(smollm2_engine), "--prompt", prompt, "--max-tokens",
                                    "12", "--temperature", "0", "--device", "cpu", "--json",
                                    "--speculative-config", '{"method": "ngram", "adaptive": true}'])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["spec_decode"]["num_accepted_tokens"] > 0
    assert out["spec_decode"]["num_draft_tokens"] >= out["spec_decode"]["num_accepted_tokens"]
    gamma = out["spec_decode"]["gamma"]   # the last γ chosen, and why
    assert 0 <= gamma["gamma"] <= 5 and gamma["reason"] in ("best", "probe", "measure")
    # every γ considered: a lookup's choice is among the tokens it found, up to 5
    considered = gamma["expected_tokens_per_s"]
    assert len(gamma["acceptance"]) == 5 and list(considered) == [str(g) for g in range(len(considered))] and 1 < len(considered) <= 6
    assert "plain_ms" in gamma["step_costs"] and sum(gamma["steps_by_gamma"].values()) > 0
    plain = BieEngine(EngineConfig(engine_dir=str(smollm2_engine), device="cpu", max_model_len=384))
    assert out["token_ids"] == plain.generate(prompt, SamplingParams(temperature=0, max_tokens=12)).token_ids


@pytest.mark.slow
def test_bench_spec_smoke(smollm2_engine, tmp_path):
    out = tmp_path / "spec.json"
    root = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "scripts/bench_spec.py", "--smoke", "--engine", str(smollm2_engine),
                    "--out", str(out)], cwd=root, check=True, timeout=600, capture_output=True,
                   env={**os.environ, "PYTHONPATH": str(root)})   # this checkout's bie_trt, installed or not
    result = json.loads(out.read_text())
    rows = {r["task"]: r for r in result["tasks"]}
    assert set(rows) == {"quote_passage"}
    for r in rows.values():
        assert r["identical_tokens"] and r["num_accepted_tokens"] <= r["num_draft_tokens"]
        assert r["speedup"] == pytest.approx(r["tokens_per_s_ngram"] / r["tokens_per_s_off"])
    verify = result["verify"]["rows"][0]
    assert verify["verify_cost_ratio"] == pytest.approx(verify["ms_verify_6"] / verify["ms_verify_1"])
    # a round of 5 proposals and the verify emits 1 + a + ... + a^5 tokens at acceptance a
    for a, tokens_per_s in verify["tokens_per_s_speculative"].items():
        emitted = sum(float(a) ** i for i in range(6))
        assert tokens_per_s == pytest.approx(1e3 * emitted / verify["ms_round"])
    assert verify["ms_draft_step"] > 0 and verify["ms_verify_crossing"] > 0


@pytest.mark.slow
def test_bench_spec_self_draft_smoke(tiny_draft_engine, tmp_path):
    """The self-draft table's code end to end (the tiny self-draft engine in both columns)."""
    out = tmp_path / "spec.json"
    root = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "scripts/bench_spec.py", "--smoke", "--self-draft", str(tiny_draft_engine),
                    str(tiny_draft_engine), "--out", str(out)], cwd=root, check=True, timeout=600,
                   capture_output=True, env={**os.environ, "PYTHONPATH": str(root)})
    result = json.loads(out.read_text())["self_draft"]
    (row,) = result["rows"]
    assert row["task"] == "prose_short" and row["full_vocab_identical"]
    for name in ("default", "full_vocab"):
        r = row[name]
        assert r["draft_vocab_size"] == 4096 and r["request_vocab"] == 4096 and r["draft_window"] == 64
        assert r["num_draft_tokens"] > 0
        assert r["acceptance_rate"] == pytest.approx(r["num_accepted_tokens"] / r["num_draft_tokens"])
        assert result["acceptance_all_tasks"][name] == pytest.approx(r["acceptance_rate"])
    assert 0 <= row["first_uses_outside_static"] <= 6


@pytest.mark.slow
def test_max_model_len_cuts_a_speculative_run_where_plain_decoding_stops(smollm2_engine, plain):
    limit = len(plain.tokenizer(PROMPTS[2])["input_ids"]) + 9
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    outs = [make(smollm2_engine, spec, max_model_len=limit).generate(PROMPTS[2], params)
            for spec in ({"method": "none"}, {"method": "ngram"})]
    assert outs[1].spec_decode["num_accepted_tokens"] > 0
    assert outs[0].finish_reason == outs[1].finish_reason == "length"
    assert outs[0].token_ids == outs[1].token_ids and len(outs[1].token_ids) == 9


@pytest.mark.slow   # ~19 s on two cores: two 20-token runs of SmolLM2 with an INT4 cache
def test_a_thinking_budget_closes_the_block_where_plain_decoding_does(smollm2_engine):
    """The budget's forced end of thinking lands inside verified runs: proposals past it are cut or rejected,
    and the tokens are plain decoding's (the n-gram proposer repeats the pattern across the budget)."""
    # SmolLM2's template declares no thinking block, so the engines name the parser that finds one
    plain, spec = (make(smollm2_engine, s, reasoning_parser="qwen3") for s in
                   ({"method": "none"}, {"method": "ngram", "num_speculative_tokens": 5, "adaptive": True}))
    prompt = PROMPTS[2] + " one two three four\n<think>\n"
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, thinking_budget=6)
    want = plain.generate(prompt, params)
    got = spec.generate(prompt, params)
    end = plain.tokenizer(THINK_END, add_special_tokens=False)["input_ids"]
    assert got.token_ids == want.token_ids and want.token_ids[6:6 + len(end)] == end
    assert got.spec_decode["num_accepted_tokens"] > 0


@pytest.mark.slow
def test_bench_adaptive_spec_smoke(tiny_draft_engine, tmp_path):
    """The adaptive benchmark's code end to end on the tiny self-draft engine: every configuration, both clocks,
    the ratios computed from the table, plain decoding's tokens everywhere."""
    out = tmp_path / "adaptive.json"
    root = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "scripts/bench_adaptive_spec.py", "--smoke", "--engine", str(tiny_draft_engine),
                    "--out", str(out)], cwd=root, check=True, timeout=600, capture_output=True,
                   env={**os.environ, "PYTHONPATH": str(root)})
    result = json.loads(out.read_text())
    assert all(result["identical_to_plain"].values()) and len(result["identical_to_plain"]) == 7
    for clock in ("cpu", "wall"):
        table, ratios = result["tokens_per_s"][clock], result["ratios"][clock]
        for short in ("draft", "ngram"):
            r = ratios[short]
            assert r["prose_adaptive_over_plain"] == pytest.approx(table[f"{short}_adaptive"]["prose"] / table["plain"]["prose"])
            assert r["quoting_adaptive_over_best_fixed"] == pytest.approx(
                r["quoting_speedup"][f"{short}_adaptive"] / max(r["quoting_speedup"][f"{short}_fixed_{g}"] for g in (2, 5)))
    assert set(result["adaptive_choices"]) == {"draft_adaptive", "ngram_adaptive"}
