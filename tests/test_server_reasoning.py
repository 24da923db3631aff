"""A thinking chat template over the real `openai` client: chat_template_kwargs reaches the template (the
prompt the model gets changes), and the reply's <think> block comes back as reasoning_content, whole and
streamed, with Hermes tool calls after it still parsed.

How the model is made to think, honestly: SmolLM2-135M was never trained to think, but it copies what
its context shows. The conversation is a tool-calling run in progress under the shipped Qwen3 template,
which keeps the reasoning of the assistant turns after the last user message: three turns of
"<think>I need the weather in X.</think> Checking X. <tool_call>...". Greedy, the model writes the
fourth turn the same way, block, close tag and call included, so every tag the server splits on is
one the model generated. The SDK's greedy text for the same prompt ids is the reference."""
from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from bie_trt import BieEngine, EngineConfig, SamplingParams
from bie_trt.chat.reasoning import THINK_CLOSE, split_reasoning
from bie_trt.chat.thinking_budget import THINK_END, ThinkingBudget
from bie_trt.chat.tool_calls import parse_tool_calls
from test_server import serving

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
CITIES = ("Oslo", "Rome", "Paris")
RUN = [{"role": "user", "content": "Weather in Oslo, Rome, Paris and Berlin?"}]
for _i, _city in enumerate(CITIES):
    RUN += [{"role": "assistant", "content": f"Checking {_city}.", "reasoning_content": f"I need the weather in {_city}.",
             "tool_calls": [{"id": f"call_{_i}", "type": "function",
                             "function": {"name": "get_weather", "arguments": json.dumps({"city": _city})}}]},
            {"role": "tool", "tool_call_id": f"call_{_i}", "content": "sunny"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
EMPTY_BLOCK = "<think>\n\n</think>\n\n"


@pytest.fixture(scope="module")
def served(smollm2_engine):
    engine = BieEngine(EngineConfig(engine_dir=str(smollm2_engine), device="cpu", max_model_len=1024,
                                    chat_template="qwen3"))
    with serving(engine) as base:
        yield engine, base, openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)


def sdk_reply(engine: BieEngine, template_kwargs: dict | None = None):
    ids = engine.encode_chat(RUN, [WEATHER], template_kwargs)
    return ids, engine.generate(ids, SamplingParams(temperature=0, max_tokens=80))


def ask(client, **kw):
    return client.chat.completions.create(model=client.models.list().data[0].id, messages=RUN, tools=[WEATHER],
                                          temperature=0, max_tokens=80, **kw)


@pytest.fixture(scope="module")
def reference(served):
    """The SDK's greedy reply to the run, thinking on: (prompt ids, output)."""
    return sdk_reply(served[0])


@pytest.fixture(scope="module")
def reply(served):
    return ask(served[2])


def calls(tool_calls) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in tool_calls or []]


def test_reasoning_content_apart_and_the_call_after_it(reference, reply):
    ids, sdk = reference
    reasoning, content = split_reasoning(sdk.text)
    assert reasoning == "I need the weather in Berlin."     # the model's own block, closed by the model
    message = reply.choices[0].message
    assert message.reasoning_content == reasoning
    assert calls(message.tool_calls) == [("get_weather", {"city": "Berlin"})]
    assert message.content == parse_tool_calls(content, {"get_weather"})[0] == "Checking Berlin.\n"
    assert reply.choices[0].finish_reason == "tool_calls"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(ids), len(sdk.token_ids))


@pytest.mark.slow   # kept out of the default suite's six minutes; CI runs it
def test_the_stream_carries_reasoning_deltas(served, reply):
    client, whole = served[2], reply.choices[0].message
    reasoning, content, arguments, names = [], [], [], []
    for chunk in ask(client, stream=True):
        for choice in chunk.choices:
            delta = choice.delta
            reasoning += [getattr(delta, "reasoning_content", None) or ""]
            content += [delta.content or ""]
            for call in delta.tool_calls or []:
                names += [call.function.name] if call.function.name else []
                arguments += [call.function.arguments or ""]
    assert "".join(reasoning) == whole.reasoning_content
    assert "".join(content) == whole.content
    assert not any("think" in piece for piece in content)     # no piece of a tag reaches the content
    assert sum(1 for piece in reasoning if piece) > 1        # reasoning streamed as it came, not at the end
    assert (names, json.loads("".join(arguments))) == (["get_weather"], {"city": "Berlin"})


# The same run in Anthropic's Messages shape: thinking, text and tool_use blocks, tool_result answers.
CLAUDE_RUN = [RUN[0]] + [
    {"role": "assistant", "content": [{"type": "thinking", "thinking": m["reasoning_content"], "signature": ""},
                                      {"type": "text", "text": m["content"]},
                                      {"type": "tool_use", "id": m["tool_calls"][0]["id"], "name": "get_weather",
                                       "input": json.loads(m["tool_calls"][0]["function"]["arguments"])}]}
    if m["role"] == "assistant" else
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": m["tool_call_id"], "content": m["content"]}]}
    for m in RUN[1:]]
CLAUDE_WEATHER = {"name": "get_weather", "description": WEATHER["function"]["description"],
                  "input_schema": WEATHER["function"]["parameters"]}


def claude_ask(served) -> tuple[anthropic.Anthropic, dict]:
    claude = anthropic.Anthropic(base_url=served[1], api_key="unused", max_retries=0)
    return claude, dict(model=served[0].model_name, max_tokens=80, extra_body={"temperature": 0},
                        messages=CLAUDE_RUN, tools=[CLAUDE_WEATHER])


@pytest.fixture(scope="module")
def claude_reply(served):
    claude, ask = claude_ask(served)
    return claude.messages.create(**ask, thinking={"type": "adaptive"})


def test_anthropic_messages_return_the_thinking_block(served, reference, claude_reply):
    """The official anthropic SDK: the reasoning comes back as a thinking block before the text and the
    tool_use, as the chat route splits it; the replayed thinking blocks reach the template (the prompt
    is the chat run's, token for token)."""
    claude, ask = claude_ask(served)
    ids, sdk = reference
    assert claude.messages.count_tokens(model=ask["model"], messages=CLAUDE_RUN,
                                        tools=[CLAUDE_WEATHER]).input_tokens == len(ids)
    reasoning, content = split_reasoning(sdk.text)
    prose, _ = parse_tool_calls(content, {"get_weather"})
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None) or b.input)
            for b in claude_reply.content] == [("thinking", reasoning), ("text", prose), ("tool_use", {"city": "Berlin"})]
    assert claude_reply.stop_reason == "tool_use" and claude_reply.usage.output_tokens == len(sdk.token_ids)


@pytest.mark.slow
def test_anthropic_stream_reassembles_the_thinking_block(served, claude_reply):
    claude, ask = claude_ask(served)
    with claude.messages.stream(**ask) as stream:   # no thinking field: the template's default, thinking
        kinds = [e.delta.type for e in stream if e.type == "content_block_delta"]
        streamed = stream.get_final_message()
    assert [b.model_dump(exclude={"id"}) for b in streamed.content] == \
        [b.model_dump(exclude={"id"}) for b in claude_reply.content]
    assert kinds.count("thinking_delta") > 1 and kinds.index("thinking_delta") < kinds.index("text_delta")


def test_anthropic_thinking_disabled_closes_the_block_in_the_prompt(served, reference):
    _, base, _ = served
    claude = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0)
    empty_block = served[0].tokenizer(EMPTY_BLOCK, add_special_tokens=False)["input_ids"]
    reply = claude.messages.create(model=served[0].model_name, max_tokens=1, extra_body={"temperature": 0},
                                   messages=CLAUDE_RUN, tools=[CLAUDE_WEATHER], thinking={"type": "disabled"})
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == len(reference[0]) + len(empty_block)
    assert "thinking" not in [b.type for b in reply.content]


# The same run as Responses input items: reasoning, the answer and the call, then the call's output.
RESPONSES_RUN = [{"type": "message", "role": "user", "content": RUN[0]["content"]}]
for _m in RUN[1:]:
    if _m["role"] == "assistant":
        _call = _m["tool_calls"][0]
        RESPONSES_RUN += [
            {"type": "reasoning", "id": f"rs_{_call['id']}", "summary": [],
             "content": [{"type": "reasoning_text", "text": _m["reasoning_content"]}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": _m["content"]}]},
            {"type": "function_call", "call_id": _call["id"], "name": "get_weather",
             "arguments": _call["function"]["arguments"]}]
    else:
        RESPONSES_RUN.append({"type": "function_call_output", "call_id": _m["tool_call_id"], "output": _m["content"]})
RESPONSES_WEATHER = {"type": "function", **WEATHER["function"]}


def responses_ask(served) -> dict:
    return dict(model=served[0].model_name, input=RESPONSES_RUN, tools=[RESPONSES_WEATHER], temperature=0,
                max_output_tokens=80)


@pytest.fixture(scope="module")
def responses_reply(served):
    return served[2].responses.create(**responses_ask(served))


def test_responses_return_a_reasoning_item(reference, responses_reply):
    """The official openai client's responses.create: the reasoning as a reasoning item before the
    message and the function call; replayed reasoning items reach the template (the prompt is the chat
    run's, token for token)."""
    ids, sdk = reference
    reasoning, content = split_reasoning(sdk.text)
    reply = responses_reply
    assert reply.usage.input_tokens == len(ids) and reply.usage.output_tokens == len(sdk.token_ids)
    assert [item.type for item in reply.output] == ["reasoning", "message", "function_call"]
    assert [part.text for part in reply.output[0].content] == [reasoning]
    assert reply.output_text == parse_tool_calls(content, {"get_weather"})[0]
    assert (reply.output[2].name, json.loads(reply.output[2].arguments)) == ("get_weather", {"city": "Berlin"})


# A custom tool whose input is free text (no grammar), offered beside the function the run calls.
NOTE = {"type": "custom", "name": "note", "description": "Writes a note.", "format": {"type": "text"}}


def test_a_forced_text_custom_tool_takes_the_whole_reply_even_a_call_in_it(served):
    """tool_choice names a text custom tool: everything after the reasoning is its input, word for word, although
    SmolLM2 writes the run's Hermes call there (text that tool_choice auto would take for a function call); the
    input streams as the model writes it, the call's tag in pieces, not held back as a call's would be."""
    body = {**responses_ask(served), "tools": [RESPONSES_WEATHER, NOTE], "tool_choice": {"type": "custom", "name": "note"},
            "max_output_tokens": 64, "stream": True}
    with httpx.stream("POST", served[1] + "/v1/responses", json=body, timeout=300) as r:
        assert r.status_code == 200, r.read()
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    reply = events[-1]["response"]   # response.completed: the whole reply
    assert reply["status"] == "completed" and [item["type"] for item in reply["output"]] == ["reasoning", "custom_tool_call"]
    call = reply["output"][1]
    assert call["name"] == "note" and call["call_id"].startswith("call_")
    prose, calls = parse_tool_calls(call["input"], {"get_weather"})
    assert prose.startswith("Checking Berlin.") and [c.name for c in calls] == ["get_weather"]   # it reads as a call
    deltas = [e["delta"] for e in events if e["type"] == "response.custom_tool_call_input.delta"]
    assert "".join(deltas) == call["input"] and not any("<tool_call>" in d for d in deltas)


@pytest.mark.slow
def test_responses_stream_reasoning_text_deltas(served, reference, responses_reply):
    reasoning, _ = split_reasoning(reference[1].text)
    reply = responses_reply
    deltas, final = [], None
    for event in served[2].responses.create(**responses_ask(served), stream=True):
        if event.type == "response.reasoning_text.delta":
            deltas.append(event.delta)
        if event.type == "response.completed":
            final = event.response
    assert "".join(deltas) == reasoning and len(deltas) > 1
    assert [i.model_dump(exclude={"id", "call_id"}) for i in final.output] == \
        [i.model_dump(exclude={"id", "call_id"}) for i in reply.output]


def test_the_sdks_chat_splits_the_reasoning_and_takes_the_templates_variables(served, reference):
    engine = served[0]
    greedy = SamplingParams(temperature=0, max_tokens=80)
    reasoning, content = split_reasoning(reference[1].text)
    out = engine.chat(RUN, greedy, tools=[WEATHER])
    assert (out.reasoning_content, out.content) == (reasoning, parse_tool_calls(content, {"get_weather"})[0])
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [("get_weather", {"city": "Berlin"})]
    # thinking off: the prompt closes the block (one token is enough to see the prompt)
    off = engine.chat(RUN, SamplingParams(temperature=0, max_tokens=1), tools=[WEATHER],
                      template_kwargs=NO_THINKING["chat_template_kwargs"])
    assert engine.tokenizer.decode(off.output.prompt_token_ids) == engine.tokenizer.decode(reference[0]) + EMPTY_BLOCK
    assert engine.split_reasoning(reference[0], reference[1].text, "none") == (None, reference[1].text)


def test_enable_thinking_false_changes_the_prompt_and_the_reply(served, reference):
    engine, base, client = served
    empty_block = engine.tokenizer(EMPTY_BLOCK, add_special_tokens=False)["input_ids"]
    thinking = reference[0]
    plain_ids, plain = sdk_reply(engine, NO_THINKING["chat_template_kwargs"])
    assert plain_ids == thinking + empty_block
    tokenized = httpx.post(base + "/tokenize", json={"messages": RUN, "tools": [WEATHER], **NO_THINKING}).json()
    assert tokenized["tokens"] == plain_ids
    reply = ask(client, extra_body=NO_THINKING)
    assert reply.usage.prompt_tokens == len(thinking) + len(empty_block)
    message = reply.choices[0].message
    # the prompt closed the block: nothing the model writes is reasoning
    assert message.reasoning_content is None
    prose, expected_calls = parse_tool_calls(plain.text, {"get_weather"})
    assert (message.content, calls(message.tool_calls)) == (prose, [(c.name, json.loads(c.arguments))
                                                                    for c in expected_calls])


@pytest.mark.parametrize("value, fragment", [
    ("enable_thinking", "chat_template_kwargs: must be a JSON object of chat template variables"),
    ([{"enable_thinking": False}], "chat_template_kwargs: must be a JSON object"),
    ({"add_generation_prompt": False}, "chat_template_kwargs: sets add_generation_prompt, which the engine sets"),
])
def test_bad_chat_template_kwargs_are_400_naming_the_field(served, value, fragment):
    _, base, client = served
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, extra_body={"chat_template_kwargs": value})
    assert e.value.body["param"] == "chat_template_kwargs" and fragment in e.value.body["message"]
    r = httpx.post(base + "/tokenize", json={"messages": RUN, "chat_template_kwargs": value})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"


def test_replayed_reasoning_is_only_for_assistant_turns(served):
    _, base, _ = served
    r = httpx.post(base + "/tokenize", json={"messages": [{"role": "user", "content": "hi", "reasoning_content": "x"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].reasoning_content"


@pytest.fixture(scope="module")
def tiny_served(tiny_engine):
    """The tiny model under the shipped template with thinking off by default (the server's
    --chat-template-kwargs), and a DeepSeek-R1 parser: the reply starts inside the block."""
    engine = BieEngine(EngineConfig(engine_dir=str(tiny_engine), device="cpu", max_model_len=256,
                                    chat_template="qwen3", chat_template_kwargs={"enable_thinking": False},
                                    reasoning_parser="deepseek_r1"))
    with serving(engine) as base:
        yield engine, base, openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)


def test_request_kwargs_override_the_servers_key_by_key(tiny_served):
    engine, base, _ = tiny_served
    hi = [{"role": "user", "content": "hi"}]

    def prompt(**kw) -> str:
        r = httpx.post(base + "/tokenize", json={"messages": hi, **kw})
        assert r.status_code == 200, r.text
        return engine.tokenizer.decode(r.json()["tokens"])

    assert prompt().endswith("assistant\n" + EMPTY_BLOCK)                         # the server's default
    assert prompt(chat_template_kwargs={"other": 1}).endswith(EMPTY_BLOCK)        # other keys keep it
    assert prompt(chat_template_kwargs={"enable_thinking": True}).endswith("assistant\n")


def test_a_deepseek_r1_reply_is_reasoning_until_it_closes(tiny_served):
    """The tiny random model never writes </think>: under deepseek_r1 with thinking on, all of its reply is
    reasoning (cut short by max_tokens); with the server's default (the prompt closed the block), all content."""
    engine, _, client = tiny_served
    hi = [{"role": "user", "content": "hi"}]
    model = client.models.list().data[0].id
    on = client.chat.completions.create(model=model, messages=hi, temperature=0, max_tokens=8,
                                        extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    off = client.chat.completions.create(model=model, messages=hi, temperature=0, max_tokens=8)
    text = engine.generate(engine.encode_chat(hi, None, {"enable_thinking": True}),
                           SamplingParams(temperature=0, max_tokens=8)).text
    assert (on.choices[0].message.reasoning_content, on.choices[0].message.content) == (text.strip(), None)
    assert off.choices[0].message.reasoning_content is None and off.choices[0].message.content
    streamed = client.chat.completions.create(model=model, messages=hi, temperature=0, max_tokens=8, stream=True,
                                              extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    pieces = [(getattr(c.choices[0].delta, "reasoning_content", None) or "", c.choices[0].delta.content or "")
              for c in streamed if c.choices]
    assert ("".join(r for r, _ in pieces), "".join(c for _, c in pieces)) == (text.strip(), "")


# -- thinking budgets: the engine closes the block itself once the reasoning has spent its budget --------

def end_ids(engine: BieEngine) -> list[int]:
    return engine.tokenizer(THINK_END, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("budget", [0, 5])
def test_the_engine_closes_the_block_after_exactly_the_budget(tiny_served, budget):
    """A prompt that opens the block (as DeepSeek-R1's template does): the reply's first `budget` tokens are
    the model's own (the unbounded reply's), then the end of thinking, then the model answers after it."""
    engine = tiny_served[0]
    prompt = engine.encode_chat([{"role": "user", "content": "hi"}], None, {"enable_thinking": True})
    prompt += engine.tokenizer("<think>\n", add_special_tokens=False)["input_ids"]
    end = end_ids(engine)
    greedy = dict(temperature=0, max_tokens=budget + len(end) + 3)
    free = engine.generate(prompt, SamplingParams(**greedy)).token_ids
    bounded = engine.generate(prompt, SamplingParams(**greedy, thinking_budget=budget))
    assert THINK_CLOSE not in engine.tokenizer.decode(free)   # the tiny model never closes a block itself
    assert bounded.token_ids[:budget] == free[:budget] and bounded.token_ids[budget:budget + len(end)] == end
    reasoning, answer = split_reasoning(bounded.text, inside=True)
    assert reasoning == (engine.tokenizer.decode(free[:budget]).strip() or None) and answer


def test_a_budget_is_unused_where_the_prompt_closed_the_block(tiny_served):
    engine = tiny_served[0]
    prompt = engine.encode_chat([{"role": "user", "content": "hi"}])   # the server's default: thinking off
    greedy = dict(temperature=0, max_tokens=6)
    assert engine.generate(prompt, SamplingParams(**greedy, thinking_budget=0)).token_ids == \
        engine.generate(prompt, SamplingParams(**greedy)).token_ids


def test_the_budget_bounds_the_block_the_servers_parser_splits_off(tiny_served):
    """DeepSeek-R1's parser (the engine's, over a template that does not open the block): the reply starts
    inside the block with no tag, the server returns it as reasoning, and the budget closes that block."""
    engine, _, client = tiny_served
    hi, budget, thinking = [{"role": "user", "content": "hi"}], 3, {"chat_template_kwargs": {"enable_thinking": True}}
    prompt = engine.encode_chat(hi, None, thinking["chat_template_kwargs"])
    assert not engine.tokenizer.decode(prompt).rstrip().endswith("<think>")   # only the parser says "inside"
    end = end_ids(engine)
    greedy = dict(temperature=0, max_tokens=budget + len(end) + 2)
    free = engine.generate(prompt, SamplingParams(**greedy)).token_ids
    r = client.chat.completions.create(model=engine.model_name, messages=hi, **greedy,
                                       extra_body={**thinking, "thinking_token_budget": budget})
    bounded = engine.generate(prompt, SamplingParams(**greedy, thinking_budget=budget)).token_ids
    assert bounded[:budget] == free[:budget] and bounded[budget:budget + len(end)] == end
    message = r.choices[0].message
    assert (message.reasoning_content, message.content) == (engine.tokenizer.decode(free[:budget]).strip(),
                                                            engine.tokenizer.decode(bounded[budget + len(end):]).lstrip())


# DeepSeek-R1's template as it matters here: past turns' reasoning cut off at </think>, no <think> written
R1_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}<|User|>{{ m['content'] }}"
               "{% else %}<|Assistant|>{{ m['content'].split('</think>')[-1] }}<|end|>{% endif %}{% endfor %}"
               "{% if add_generation_prompt %}<|Assistant|>{% endif %}")


@pytest.mark.parametrize("flag,parser", [("auto", "deepseek_r1"), ("none", "none")])
def test_a_deepseek_style_template_declares_its_parser_for_the_budget_and_the_split(tiny_engine, tmp_path, flag,
                                                                                   parser):
    """auto takes the template's parser, which the budget and the reply's split share; the flag overrides it
    for both (none: nothing is reasoning, so nothing is bounded)."""
    (tmp_path / "r1.jinja").write_text(R1_TEMPLATE)
    engine = BieEngine(EngineConfig(engine_dir=str(tiny_engine), device="cpu", max_model_len=256,
                                    chat_template=str(tmp_path / "r1.jinja"), reasoning_parser=flag))
    try:
        assert engine.reasoning_parser() == parser
        hi = [{"role": "user", "content": "hi"}]
        free = engine.chat(hi, SamplingParams(temperature=0, max_tokens=9))
        bounded = engine.chat(hi, SamplingParams(temperature=0, max_tokens=9, thinking_budget=2))
        if parser == "none":
            assert bounded.output.token_ids == free.output.token_ids and bounded.reasoning_content is None
        else:
            assert bounded.output.token_ids[2:2 + len(end_ids(engine))] == end_ids(engine)
            assert bounded.reasoning_content == engine.tokenizer.decode(free.output.token_ids[:2]).strip()
    finally:
        engine.close()


def test_a_block_the_reply_opens_is_counted_after_its_tag(served):
    """Qwen3 opens the block in its reply: the budget counts from after `<think>` (however it is tokenised)."""
    tokenizer = served[0].tokenizer
    budget = ThinkingBudget.build(2, served[0].encode_chat(RUN, [WEATHER]), tokenizer, served[0].reasoning_parser())
    for token in tokenizer("<think>I need", add_special_tokens=False)["input_ids"]:
        assert budget.forced_token() is None
        budget.accept(token)
    assert budget.used == 2 and budget.forced_token() == end_ids(served[0])[0]   # "I", " need": spent
    budget.rollback(1)
    assert budget.used == 1 and budget.forced_token() is None


def test_a_block_the_model_closes_itself_ends_the_budget_though_its_tag_is_three_tokens(served, reference):
    """SmolLM2 writes `</think>` as three tokens. A budget that runs out exactly on the tag's last token has been
    met by the model's own close: the reply is the unbounded one (a budget still counting past the tag would
    write the engine's close a second time)."""
    engine = served[0]
    tokenizer = engine.tokenizer
    ids, free = reference
    tag = tokenizer(THINK_CLOSE, add_special_tokens=False)["input_ids"]
    assert [tokenizer.decode([t]) for t in tag] == ["</", "think", ">"]

    def first_ending(tagged) -> int:   # the index of the first token whose text completes `tagged`
        return next(i for i in range(len(free.token_ids)) if tagged(tokenizer.decode(free.token_ids[:i + 1])))

    opened = first_ending(lambda text: text.lstrip().startswith("<think>"))
    closed = first_ending(lambda text: THINK_CLOSE in text)
    assert free.token_ids[closed - 2:closed + 1] == tag   # the model's own close, in three tokens
    n = closed + len(end_ids(engine)) + 2
    bounded = engine.generate(ids, SamplingParams(temperature=0, max_tokens=n, thinking_budget=closed - opened))
    assert bounded.token_ids == free.token_ids[:n]


def test_anthropic_budget_tokens_bound_the_thinking_block(served, reference):
    """Claude Code's thinking: {"type": "enabled", "budget_tokens": N}. SmolLM2 copies the run's thinking
    blocks ("<think>\nI need the weather in Berlin."): with a budget of 3 the engine closes the block after
    the unbounded reply's first 3 reasoning tokens ("\nI need"), and the model goes on to answer after it."""
    engine = served[0]
    claude, ask = claude_ask(served)
    free = reference[1].token_ids
    opened = next(i for i in range(len(free)) if engine.tokenizer.decode(free[:i + 1]).lstrip().startswith("<think>"))
    budget = free[opened + 1:opened + 4]
    reply = claude.messages.create(**{**ask, "max_tokens": opened + 4 + len(end_ids(engine)) + 2},
                                   thinking={"type": "enabled", "budget_tokens": 3})
    assert engine.tokenizer.decode(budget).strip() == "I need"
    assert [(b.type, getattr(b, "thinking", None)) for b in reply.content] == [("thinking", "I need"), ("text", None)]
    assert reply.content[1].text and reply.stop_reason == "max_tokens"


def test_responses_effort_maps_to_a_budget_or_switches_thinking_off(served, reference):
    from bie_trt.server.protocols.openai_responses import EFFORT_BUDGETS, ResponsesRequest
    fields = ResponsesRequest.model_validate({"input": "hi", "reasoning": {"effort": "low"}}).chat_fields([])
    assert EFFORT_BUDGETS["low"] == 1024
    assert (fields["thinking_token_budget"], fields["chat_template_kwargs"]) == (1024, {"enable_thinking": True})
    empty_block = served[0].tokenizer(EMPTY_BLOCK, add_special_tokens=False)["input_ids"]
    off = served[2].responses.create(**{**responses_ask(served), "max_output_tokens": 1}, reasoning={"effort": "none"})
    assert off.usage.input_tokens == len(reference[0]) + len(empty_block)
    r = httpx.post(served[1] + "/v1/responses", json={"input": "hi", "reasoning": {"effort": "huge"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning.effort", r.text
