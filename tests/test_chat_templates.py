"""The shipped chat templates, rendered by transformers' jinja2 through the engine's own loading path
(`--chat-template qwen3`): the thinking switch, tools and tool calls in Hermes format, tool results,
and which turns keep their reasoning. Also the checks on chat_template_kwargs and on a template name."""
from __future__ import annotations

import pytest

from bie_trt.chat.templates import parse_template_kwargs, shipped_chat_templates, template_kwargs_problem
from bie_trt.chat.tokenizer import load_tokenizer
from bie_trt.errors import RequestError

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
HI = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def qwen3(smollm2_checkpoint):
    return load_tokenizer(str(smollm2_checkpoint), "qwen3")


def render(tokenizer, messages, **kw) -> str:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kw)


def test_qwen3_is_shipped():
    assert "qwen3" in shipped_chat_templates()


def test_thinking_is_on_unless_switched_off(qwen3):
    thinking = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert render(qwen3, HI) == thinking
    assert render(qwen3, HI, enable_thinking=True) == thinking
    assert render(qwen3, HI, enable_thinking=False) == thinking + "<think>\n\n</think>\n\n"
    assert render(qwen3, HI[1:]) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"   # no system turn


def test_tools_calls_and_results(qwen3):
    run = [{"role": "system", "content": "Be brief."},
           {"role": "user", "content": "Weather in Oslo and Rome?"},
           {"role": "assistant", "content": "", "reasoning_content": "Two cities: two calls.",
            "tool_calls": [{"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": {"city": c}}}
                           for c in ("Oslo", "Rome")]},
           {"role": "tool", "tool_call_id": "a", "content": "sunny"},
           {"role": "tool", "tool_call_id": "b", "content": "rain"}]
    text = render(qwen3, run, tools=[WEATHER])
    system, rest = text.split("<|im_end|>\n", 1)
    assert system.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather", ' in system
    assert system.endswith("<tool_call>\n{\"name\": <function name>, \"arguments\": <arguments as a JSON object>}\n"
                           "</tool_call>")
    assert rest == (
        "<|im_start|>user\nWeather in Oslo and Rome?<|im_end|>\n"
        # after the last user message: a run in progress keeps its reasoning
        "<|im_start|>assistant\n<think>\nTwo cities: two calls.\n</think>\n\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call><|im_end|>\n'
        # consecutive results share one user turn
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n")


def test_earlier_turns_lose_their_reasoning(qwen3):
    chat = [{"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "<think>\nfour\n</think>\n\n4"},
            {"role": "user", "content": "3+3?"}]
    assert render(qwen3, chat) == ("<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"
                                   "<|im_start|>user\n3+3?<|im_end|>\n<|im_start|>assistant\n")
    # with no user message after it, the turn keeps its reasoning (as written in its content)
    assert render(qwen3, chat[:2]).endswith("<|im_start|>assistant\n<think>\nfour\n</think>\n\n4<|im_end|>\n"
                                            "<|im_start|>assistant\n")


def test_a_name_that_is_neither_file_nor_shipped(smollm2_checkpoint):
    with pytest.raises(RequestError, match=r"chat template qwen9: cannot be read .*shipped template \(gemma3, gemma4, qwen3\)"):
        load_tokenizer(str(smollm2_checkpoint), "qwen9")


@pytest.mark.parametrize("value, fragment", [
    ("thinking", "must be a JSON object of chat template variables"),
    ([{"enable_thinking": False}], "must be a JSON object"),
    ({"add_generation_prompt": False, "messages": []}, "sets add_generation_prompt, messages, which the engine sets"),
    ({"tokenize": False}, "sets tokenize"),
])
def test_template_kwargs_problems(value, fragment):
    assert fragment in template_kwargs_problem(value)


def test_template_kwargs_flag():
    assert parse_template_kwargs('{"enable_thinking": false}', "--x") == {"enable_thinking": False}
    assert template_kwargs_problem({"enable_thinking": False, "custom": [1]}) is None
    with pytest.raises(RequestError, match=r"--x is not valid JSON \(Expecting value at character 0\)"):
        parse_template_kwargs("enable_thinking=false", "--x")
    with pytest.raises(RequestError, match=r"--x must be a JSON object .*; got \[1\]\."):
        parse_template_kwargs("[1]", "--x")


def test_gemma3_turns_with_the_system_text_in_the_first_user_turn(smollm2_checkpoint):
    """Gemma 3 has no system role: its text opens the next user turn; assistant turns are the model's; the
    prompt ends by opening the model's turn (the reply then ends at <end_of_turn>, a stop token)."""
    gemma3 = load_tokenizer(str(smollm2_checkpoint), "gemma3")
    bos = gemma3.bos_token
    assert render(gemma3, HI) == f"{bos}<start_of_turn>user\nBe brief.\n\nhi<end_of_turn>\n<start_of_turn>model\n"
    turns = HI + [{"role": "assistant", "content": " Hello. "}, {"role": "user", "content": [{"type": "text", "text": "bye"}]}]
    assert render(gemma3, turns) == (f"{bos}<start_of_turn>user\nBe brief.\n\nhi<end_of_turn>\n<start_of_turn>model\n"
                                     "Hello.<end_of_turn>\n<start_of_turn>user\nbye<end_of_turn>\n<start_of_turn>model\n")
