"""Two agent frameworks' own clients against a served SmolLM2 INT4 engine on 127.0.0.1, with the request
shapes they send by default (no `additionalProperties: false` in LangChain's schemas, no
`parallel_tool_calls`, a small max_tokens) at temperature 0: structured output parsed into a pydantic
model, tool_choice "any" and a forced named tool (whole and streamed) through LangChain's ChatOpenAI, and an
OpenAI Agents SDK agent loop that calls a tool and answers with its result. Every call's arguments hold
only the keys its tool declares."""
from __future__ import annotations

import asyncio

import pydantic
import pytest

from bie_trt import BieEngine, EngineConfig
from test_server import serving

MAX_TOKENS = 64   # the small budget agent code often sets; a reply that closes needs far fewer
WEATHER_IN_ROME = [("user", "What is the weather in Rome?")]


@pytest.fixture(scope="module")
def base_url(smollm2_engine):
    engine = BieEngine(EngineConfig(engine_dir=str(smollm2_engine), device="cpu", max_model_len=1024))
    with serving(engine) as base:
        yield base + "/v1", engine.model_name


@pytest.fixture(scope="module")
def chat(base_url):
    from langchain_openai import ChatOpenAI

    url, model = base_url
    return ChatOpenAI(base_url=url, api_key="unused", model=model, temperature=0, max_tokens=MAX_TOKENS,
                      max_retries=0, timeout=300)


def get_weather(city: str) -> str:
    """Current weather in a city."""
    return f"Sunny, 21 C in {city}"


def assert_weather_calls(calls: list[dict]) -> None:
    """LangChain's parsed tool calls: at least one, each get_weather with exactly its declared keys."""
    assert calls, "no tool call"
    for call in calls:
        assert call["name"] == "get_weather"
        assert set(call["args"]) == {"city"}, call["args"]
        assert isinstance(call["args"]["city"], str) and call["args"]["city"]


def test_langchain_structured_output_parses_into_the_model(chat):
    class City(pydantic.BaseModel):
        """A city and where it is."""
        name: str
        country: str
        population: int

    city = chat.with_structured_output(City).invoke("Describe Paris.")
    assert isinstance(city, City)


@pytest.mark.parametrize("choice", ["any", "get_weather"])
def test_langchain_bound_tool_is_called(chat, choice):
    from langchain_core.tools import tool

    reply = chat.bind_tools([tool(get_weather)], tool_choice=choice).invoke(WEATHER_IN_ROME)
    assert_weather_calls(reply.tool_calls)
    assert len(reply.tool_calls) == 1   # parallel_tool_calls unset: one call
    assert reply.response_metadata["finish_reason"] == "tool_calls"


def test_langchain_streamed_named_tool(chat):
    from langchain_core.tools import tool

    chunks = list(chat.bind_tools([tool(get_weather)], tool_choice="get_weather").stream(WEATHER_IN_ROME))
    whole = chunks[0]
    for chunk in chunks[1:]:
        whole += chunk
    assert_weather_calls(whole.tool_calls)
    assert whole.response_metadata["finish_reason"] == "tool_calls"


def test_agents_sdk_loop_calls_the_tool_and_answers_with_its_result(base_url):
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)   # its traces would go to OpenAI's servers
    url, model = base_url
    called: list[dict] = []

    @function_tool
    def weather(city: str) -> str:
        """Current weather in a city."""
        called.append({"city": city})
        return get_weather(city)

    async def run():
        client = AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300)
        agent = Agent(name="weather", instructions="Answer with the weather the tool reports.", tools=[weather],
                      model=OpenAIChatCompletionsModel(model=model, openai_client=client),
                      # required on the first turn; the SDK resets it to auto after a call, so the loop ends
                      model_settings=ModelSettings(temperature=0, tool_choice="required", max_tokens=MAX_TOKENS))
        return await Runner.run(agent, "What is the weather in Rome?", max_turns=4)

    result = asyncio.run(run())
    assert len(called) == 1 and called[0]["city"]
    assert isinstance(result.final_output, str) and "21" in result.final_output, result.final_output
