"""The Anthropic Messages API (/v1/messages) with the official ``anthropic`` client and
LangChain's ``ChatAnthropic``, against SmolLM2-135M served by iron-batch (CPU); bad input
and the API key on a scripted mock backend."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest
from conftest import ScriptedBackend, ServerFactory, ServerHandle, ServerStarter

MODEL = "smollm2-135m"
#: This anthropic client has no temperature argument (newer models fix their own): the
#: server still reads one from the body.
GREEDY = {"temperature": 0}
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {
    "name": "get_weather",
    "description": "Current weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string",
                                                               "maxLength": 24}},
                     "required": ["city"]},
}


@pytest.fixture(scope="module")
def client(smol: ServerHandle) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=smol.url, api_key="unused", max_retries=0, timeout=300)


def _text(message: Any) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def test_create_answers_and_counts_tokens(smol: ServerHandle,
                                          client: anthropic.Anthropic) -> None:
    out = client.messages.create(model=MODEL, max_tokens=32, extra_body=GREEDY,
                                 messages=QUESTION)  # type: ignore[arg-type]
    assert out.type == "message" and out.role == "assistant"
    assert "Paris" in _text(out)
    assert out.stop_reason == "end_turn"
    counted = client.messages.count_tokens(model=MODEL, messages=QUESTION)  # type: ignore[arg-type]
    prompt = httpx.post(f"{smol.url}/tokenize", json={"messages": QUESTION}).json()["count"]
    assert counted.input_tokens == prompt
    assert out.usage.input_tokens + (out.usage.cache_read_input_tokens or 0) == prompt
    assert 0 < out.usage.output_tokens <= 32
    smol.wait_idle()


def test_stream_gives_the_same_message(client: anthropic.Anthropic) -> None:
    kw: dict[str, Any] = dict(model=MODEL, max_tokens=32, extra_body=GREEDY, messages=QUESTION,
                              system="Answer in one sentence.")
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(pieces) > 1
    assert "".join(pieces) == _text(whole) == _text(final)
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_stop_sequences_and_max_tokens_say_why_it_stopped(client: anthropic.Anthropic) -> None:
    kw: dict[str, Any] = dict(model=MODEL, max_tokens=32, extra_body=GREEDY, messages=QUESTION)
    answer = _text(client.messages.create(**kw))
    cut = answer.index("Paris")
    out = client.messages.create(**kw, stop_sequences=["Paris", "zebra"])
    assert out.stop_reason == "stop_sequence" and out.stop_sequence == "Paris"
    assert _text(out) == answer[:cut]
    with client.messages.stream(**kw, stop_sequences=["zebra", "Paris"]) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == "Paris"
    short = client.messages.create(**{**kw, "max_tokens": 3})
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3


def test_tool_use_round_trip(client: anthropic.Anthropic) -> None:
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.messages.create(model=MODEL, max_tokens=40, extra_body=GREEDY,
                                   messages=ask, tools=[WEATHER],  # type: ignore[arg-type,list-item]
                                   tool_choice={"type": "tool", "name": "get_weather"})
    assert first.stop_reason == "tool_use"
    (use,) = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "get_weather"
    jsonschema.validate(use.input, {**WEATHER["input_schema"], "additionalProperties": False})
    second = client.messages.create(
        model=MODEL, max_tokens=24, extra_body=GREEDY, tools=[WEATHER],  # type: ignore[list-item]
        messages=[*ask, {"role": "assistant", "content": first.content},  # type: ignore[list-item]
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                "content": "18 degrees and sunny"}]}],
    )
    assert _text(second)
    with client.messages.stream(model=MODEL, max_tokens=40, extra_body=GREEDY, messages=ask,  # type: ignore[arg-type]
                                tools=[WEATHER],  # type: ignore[list-item]
                                tool_choice={"type": "tool", "name": "get_weather"}) as stream:
        final = stream.get_final_message()
    (streamed,) = [b for b in final.content if b.type == "tool_use"]
    assert streamed.input == use.input and final.stop_reason == "tool_use"


def test_langchain_chat_anthropic(smol: ServerHandle) -> None:
    from langchain_anthropic import ChatAnthropic
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        return f"18 degrees in {city}"

    llm = ChatAnthropic(model=MODEL, base_url=smol.url, api_key="unused",  # type: ignore[call-arg,arg-type]
                        temperature=0.0, max_tokens=32, max_retries=0, timeout=300)
    answer = llm.invoke("What is the capital of France?")
    assert "Paris" in answer.text
    streamed = "".join(chunk.text for chunk in llm.stream("What is the capital of France?"))
    assert streamed == answer.text
    bound = llm.bind_tools([get_weather], tool_choice="get_weather")
    message = bound.invoke("What is the weather in Paris?")
    (call,) = message.tool_calls  # type: ignore[attr-defined]
    assert call["name"] == "get_weather" and set(call["args"]) == {"city"}
    assert "degrees" in get_weather.invoke(call["args"])


# ---------------------------------------------------------------- mock backend


@pytest.fixture(scope="module")
def scripted() -> Iterator[ServerHandle]:
    starter = ServerStarter()
    yield starter(ScriptedBackend(), total_kv_blocks=256)
    starter.close()


#: (body, whether /v1/messages/count_tokens reads the bad field too)
BAD = [
    ({"messages": QUESTION}, False),  # no max_tokens
    ({"messages": QUESTION, "max_tokens": 0}, False),
    ({"max_tokens": 8}, True),
    ({"max_tokens": 8, "messages": []}, True),
    ({"max_tokens": 8, "messages": [{"role": "system", "content": "hi"}]}, True),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "image"}]}]}, True),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]}, True),
    ({"max_tokens": 8, "messages": QUESTION, "system": 7}, True),
    ({"max_tokens": 8, "messages": QUESTION, "tools": [{"type": "web_search_20250305"}]}, True),
    ({"max_tokens": 8, "messages": QUESTION, "tool_choice": {"type": "maybe"}}, True),
    ({"max_tokens": 8, "messages": QUESTION, "tools": [WEATHER],
      "tool_choice": {"type": "tool", "name": "nope"}}, True),
    ({"max_tokens": 8, "messages": QUESTION, "stop_sequences": "Paris"}, False),
    ({"max_tokens": 8, "messages": QUESTION, "temperature": -1}, False),
    ({"max_tokens": 8, "messages": QUESTION, "thinking": {"type": "sometimes"}}, True),
    ({"max_tokens": 8, "messages": QUESTION, "model": "claude-nope"}, True),
]


@pytest.mark.parametrize(("body", "counted"), BAD)
def test_bad_input_is_a_4xx_in_anthropic_shape_and_changes_nothing(
    scripted: ServerHandle, body: dict[str, Any], counted: bool,
) -> None:
    before = scripted.engine.stats.scheduler["requests_added"]
    paths = ["/v1/messages"] + (["/v1/messages/count_tokens"] if counted else [])
    for path in paths:
        response = httpx.post(f"{scripted.url}{path}", json=body, timeout=30)
        assert 400 <= response.status_code < 500, (path, response.text)
        error = response.json()
        assert error["type"] == "error" and error["error"]["message"]
        assert error["error"]["type"] in ("invalid_request_error", "not_found_error")
    assert scripted.engine.stats.scheduler["requests_added"] == before


def test_the_api_key_is_read_from_x_api_key(start_server: ServerFactory) -> None:
    backend = ScriptedBackend()
    backend.script = "Hello there."
    server = start_server(backend, api_key="sekret")
    server.headers = {"Authorization": "Bearer sekret"}
    good = anthropic.Anthropic(base_url=server.url, api_key="sekret", max_retries=0,
                               default_headers={"anthropic-version": "2023-06-01"})
    out = good.messages.create(model="mock", max_tokens=16, messages=QUESTION)  # type: ignore[arg-type]
    assert _text(out) == "Hello there." and out.stop_reason == "end_turn"
    bad = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as info:
        bad.messages.create(model="mock", max_tokens=16, messages=QUESTION)  # type: ignore[arg-type]
    assert info.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    with pytest.raises(anthropic.AuthenticationError):
        bad.messages.count_tokens(model="mock", messages=QUESTION)  # type: ignore[arg-type]
    server.wait_idle()
