"""The engine core alone: token ids in, events out, on the caller's thread (no loop thread, no prompts, no
chat). Its events add up to each request's output, a batch gives each request what it gets alone (greedy
and seeded), an abort frees the blocks, and a fault fails only the requests of its step."""
from __future__ import annotations

import threading

import pytest

from bie_trt import EngineConfig, EngineCore, SamplingParams
from bie_trt.executor.engine_stats import engine_stats

PROMPTS = [[1, 504, 3458, 314, 253], [1, 2683, 2115, 253, 655, 28, 1115], [1, 47, 48, 49]]
PARAMS = [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
          SamplingParams(temperature=1.0, top_p=0.9, seed=4, max_tokens=5, ignore_eos=True),
          SamplingParams(temperature=0.7, top_k=30, presence_penalty=1.0, seed=8, max_tokens=4, ignore_eos=True,
                         logprobs=2)]


@pytest.fixture(scope="module")
def core(tiny_engine) -> EngineCore:
    return EngineCore(EngineConfig(engine_dir=str(tiny_engine), device="cpu", max_model_len=128))


def run(core: EngineCore, prompts: list[list[int]], params: list[SamplingParams]) -> list[list]:
    """Each request's events, stepping the core on this thread until it has no work."""
    requests = [core.add_request(ids, p) for ids, p in zip(prompts, params)]
    events: dict = {id(r): [] for r in requests}
    while core.has_work():
        for request, event in core.step():
            events[id(request)].append(event)
    return [events[id(r)] for r in requests]


def test_ids_in_events_out_on_the_callers_thread(core):
    threads = threading.active_count()
    batched = run(core, PROMPTS, PARAMS)
    assert threading.active_count() == threads   # the core starts no thread
    for events, ids, p in zip(batched, PROMPTS, PARAMS):
        out = events[-1].output
        assert out is not None and all(e.output is None for e in events[:-1])
        assert [t for e in events for t in e.token_ids] == out.token_ids and len(out.token_ids) == p.max_tokens
        assert "".join(e.delta for e in events) == out.text and out.finish_reason == "length"
        assert out.prompt_token_ids == ids
    out = batched[2][-1].output   # top 2 and the sampled token
    assert all(len(lp) >= 2 and t in lp for t, lp in zip(out.token_ids, out.logprobs)) and len(out.logprobs) == 4
    # alone, a seeded request draws what it drew in the batch (greedy: tests/test_concurrency.py)
    for events, ids, p in list(zip(batched, PROMPTS, PARAMS))[1:]:
        assert run(core, [ids], [p])[0][-1].output.token_ids == events[-1].output.token_ids
    assert engine_stats(core).kv_blocks["fp16"]["used"] == 0


def test_an_abort_frees_the_requests_blocks(core):
    aborted = core.finished["abort"]
    request = core.add_request(PROMPTS[0], SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(3):
        core.step()
    assert request.seq.output_ids and engine_stats(core).kv_blocks["fp16"]["used"] > 0
    core.abort(request)
    assert request.done.is_set() and not core.has_work()
    assert core.finished["abort"] == aborted + 1 and engine_stats(core).kv_blocks["fp16"]["used"] == 0


def test_a_fault_in_a_step_fails_its_requests_as_events(core, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("kernel exploded")

    request = core.add_request(PROMPTS[1], SamplingParams(max_tokens=4))
    monkeypatch.setattr(core.runner, "execute", broken)
    [(failed, error)] = core.step()
    assert failed is request and isinstance(error, RuntimeError) and request.done.is_set()
    monkeypatch.undo()
    assert not core.has_work() and engine_stats(core).kv_blocks["fp16"]["used"] == 0
