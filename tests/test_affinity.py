"""The scale-out router's scoring, without Ray: a prompt's affinity keys are the prefix cache's own keys
of its leading full blocks; a prompt goes to the replica holding its deepest key unless that replica is
overloaded past the bound; otherwise the least-loaded replica, new documents spread out. Also what the
ingress routes a chat body by: the ids the replica's engine prefills for it."""
from __future__ import annotations

import pytest

from bie_trt.config import KVCacheConfig
from bie_trt.cache_tiers.block_manager import BlockManager
from bie_trt.executor.prompt_encoder import PromptEncoder
from bie_trt.scale_out.affinity import (AFFINITY, LEAST_LOADED, OVERFLOW, AffinityTable, choose, least_loaded,
                                        prefix_keys)
from bie_trt.scale_out.routed_prompt import routed_prompt
from test_block_manager import new_seq
from test_prefix_cache import run

B = 4


def test_affinity_keys_are_the_prefix_caches_keys_of_the_full_blocks():
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]   # two full blocks and a partial one
    bm = BlockManager(KVCacheConfig(block_size=B), 8, 0, enable_prefix_caching=True)
    run(bm, new_seq(prompt))
    keys = prefix_keys(prompt, B)
    assert len(keys) == 2
    assert set(keys) == set(bm.cache.entry_of)   # every cached block, and nothing else
    assert prefix_keys(prompt[:8] + [7, 7, 7], B) == keys          # same leading blocks, same keys
    assert prefix_keys([1] + prompt[1:], B)[1] != keys[1]          # keys chain: block 2 depends on block 1
    assert prefix_keys(prompt, B, max_blocks=1) == keys[:1]
    assert prefix_keys(prompt[:3], B) == []                        # no full block: nothing to route by


def test_a_returning_prompt_goes_to_the_replica_holding_its_deepest_block():
    table = AffinityTable()
    doc_a, doc_b = prefix_keys(list(range(16)), B), prefix_keys(list(range(8)) + [9] * 8, B)
    table.record(doc_a, "r1")
    table.record(doc_b, "r2")   # shares doc_a's first two blocks: r2 now holds those, doc_a keeps its deeper ones
    loads = {"r1": 0, "r2": 0}
    assert choose(doc_a, loads, table, overload=2) == choose(doc_a[:3], loads, table, overload=2)
    assert choose(doc_a, loads, table, overload=2).replica == "r1"
    assert choose(doc_a, loads, table, overload=2).reason == AFFINITY
    assert choose(doc_b, loads, table, overload=2).replica == "r2"
    assert choose(doc_a[:2], loads, table, overload=2).replica == "r2"   # only the shared blocks: their last holder


def test_a_shared_header_alone_is_no_affinity():
    """Documents behind one system prompt: holding the header is not holding the document."""
    table = AffinityTable()
    header = list(range(8))                        # two blocks every prompt starts with
    table.record(prefix_keys(header + [1] * 8, B), "r1")
    other = prefix_keys(header + [2] * 12, B)       # 2 of its 5 blocks held by r1: under half
    choice = choose(other, {"r1": 0, "r2": 0}, table, overload=2)
    assert (choice.replica, choice.reason) == ("r2", LEAST_LOADED)
    half = prefix_keys(header + [2] * 8, B)         # 2 of 4: half, affinity
    assert choose(half, {"r1": 0, "r2": 0}, table, overload=2).reason == AFFINITY


def test_an_overloaded_holder_yields_to_the_least_loaded_past_the_bound_only():
    table = AffinityTable()
    keys = prefix_keys(list(range(8)), B)
    table.record(keys, "r1")
    at_bound = choose(keys, {"r1": 3, "r2": 1}, table, overload=2)
    assert (at_bound.replica, at_bound.reason) == ("r1", AFFINITY)
    past = choose(keys, {"r1": 4, "r2": 1}, table, overload=2)
    assert (past.replica, past.reason) == ("r2", OVERFLOW)


def test_new_prompts_go_to_the_least_loaded_then_to_the_replica_holding_fewest_prefixes():
    table = AffinityTable()
    table.record(prefix_keys(list(range(8)), B), "r1")
    fresh = prefix_keys([7] * 8, B)
    assert choose(fresh, {"r1": 0, "r2": 0}, table, overload=2).replica == "r2"   # r1 holds more already
    assert choose(fresh, {"r1": 0, "r2": 1}, table, overload=2) .replica == "r1"   # load first
    assert choose(fresh, {"r1": 0, "r2": 0}, table, overload=2).reason == LEAST_LOADED
    with pytest.raises(ValueError):
        choose(fresh, {}, table, overload=2)


def test_a_replica_that_is_gone_holds_nothing():
    table = AffinityTable()
    keys = prefix_keys(list(range(8)), B)
    table.record(keys, "dead")
    choice = choose(keys, {"r1": 3, "r2": 0}, table, overload=8)
    assert (choice.replica, choice.reason) == ("r2", LEAST_LOADED)


def test_the_table_forgets_the_least_recently_routed_keys_and_counts_what_each_replica_holds():
    table = AffinityTable(capacity=3)
    a, b = prefix_keys(list(range(8)), B), prefix_keys([9] * 8, B)
    table.record(a, "r1")
    table.record(b, "r2")   # 4 keys into 3: a's first key goes
    assert table.held == {"r1": 1, "r2": 2}
    assert table.deepest(a[:1], {"r1", "r2"}) == (None, 0) and table.deepest(a, {"r1", "r2"}) == ("r1", 2)
    table.record(b, "r1")   # b moves: its keys leave r2
    assert table.held == {"r1": 3, "r2": 0}
    assert least_loaded({"r1": 0, "r2": 0}, table.held) == "r2"


def test_the_ingress_routes_a_chat_by_the_ids_the_engine_prefills(tiny_engine):
    encoder = PromptEncoder.load(str(tiny_engine))
    tool = {"type": "function", "function": {"name": "lookup", "description": "Look a word up.",
                                             "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}
    messages = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "Define 'ray'."}]
    body = {"model": "m", "messages": messages, "tools": [tool], "max_tokens": 4}
    assert routed_prompt("/v1/chat/completions", body, encoder) == encoder.encode_chat(messages, [tool])
    assert routed_prompt("/v1/chat/completions", {**body, "tools": None}, encoder) != encoder.encode_chat(
        messages, [tool])
    assert routed_prompt("/v1/completions", {"prompt": ["one two", "three"]}, encoder) == encoder.encode("one two")
    assert routed_prompt("/v1/completions", {"prompt": [5, 6, 7]}, encoder) == [5, 6, 7]
    assert routed_prompt("/tokenize", {"prompt": "x"}, encoder) is None
    # The same conversation as a Messages body and as a Responses body: the same ids
    fn = tool["function"]
    claude = {"model": "m", "max_tokens": 4, "system": "You answer briefly.", "messages": messages[1:],
              "tools": [{"name": fn["name"], "description": fn["description"], "input_schema": fn["parameters"]}]}
    assert routed_prompt("/v1/messages", claude, encoder) == encoder.encode_chat(messages, [tool])
    responses = {"model": "m", "instructions": "You answer briefly.", "input": "Define 'ray'.",
                 "tools": [{"type": "function", **fn}]}
    assert routed_prompt("/v1/responses", responses, encoder) == encoder.encode_chat(messages, [tool])
    assert routed_prompt("/v1/responses", {**responses, "previous_response_id": "resp_1"}, encoder) is None


def test_a_stream_whose_replica_is_gone_ends_in_its_apis_own_error_event():
    import json

    ingress = pytest.importorskip("bie_trt.scale_out.ingress")
    chat = ingress.stream_error("/v1/chat/completions", "gone").split("\n\n")
    assert json.loads(chat[0].removeprefix("data: "))["error"]["code"] == "replica_unavailable" and chat[1] == "data: [DONE]"
    for path, error in (("/v1/messages", {"type": "overloaded_error", "message": "gone"}),
                        ("/v1/responses", {"message": "gone", "type": "overloaded_error", "param": None,
                                           "code": "replica_unavailable"})):
        event, data = ingress.stream_error(path, "gone").strip().split("\n")
        assert event == "event: error" and json.loads(data.removeprefix("data: ")) == {"type": "error", "error": error}
