"""The Responses API (/v1/responses) with the official ``openai`` client and the OpenAI
Agents SDK, against SmolLM2-135M served by iron-batch (CPU); bad input and the store's
tenants on the mock backend."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from conftest import ScriptedBackend, ServerFactory, ServerHandle, ServerStarter

MODEL = "smollm2-135m"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 24}},
        "required": ["city"],
    },
}


@pytest.fixture(scope="module")
def client(smol: ServerHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{smol.url}/v1", api_key="unused", max_retries=0,
                         timeout=300)


def test_create_answers_and_counts_tokens(smol: ServerHandle, client: openai.OpenAI) -> None:
    out = client.responses.create(model=MODEL, input="What is the capital of France?",
                                  max_output_tokens=24, temperature=0)
    assert out.status == "completed" and out.id.startswith("resp_")
    assert "Paris" in out.output_text
    (item,) = out.output
    assert item.type == "message" and item.role == "assistant"
    prompt = httpx.post(f"{smol.url}/tokenize", json={"messages": [
        {"role": "user", "content": "What is the capital of France?"}]}).json()["count"]
    assert out.usage is not None and out.usage.input_tokens == prompt
    assert 0 < out.usage.output_tokens <= 24
    smol.wait_idle()


def test_stream_gives_the_typed_events_and_the_same_text(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model=MODEL, input="What is the capital of France?",
                              max_output_tokens=64, temperature=0,
                              instructions="Answer in one sentence.")
    whole = client.responses.create(**kw)
    with client.responses.stream(**kw) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed" and whole.status == "completed"
    assert kinds.count("response.output_text.delta") > 1
    assert kinds.index("response.output_item.added") < kinds.index("response.output_text.delta")
    assert kinds.index("response.output_text.done") < kinds.index("response.output_item.done")
    assert final.output_text == whole.output_text
    assert final.status == whole.status


def test_incomplete_when_the_output_limit_cuts_it(client: openai.OpenAI) -> None:
    out = client.responses.create(model=MODEL, input="Tell me a long story.",
                                  max_output_tokens=4, temperature=0)
    assert out.status == "incomplete"
    assert out.incomplete_details is not None
    assert out.incomplete_details.reason == "max_output_tokens"
    assert out.usage is not None and out.usage.output_tokens == 4


def test_function_tool_round_trip(client: openai.OpenAI) -> None:
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.responses.create(model=MODEL, input=question,  # type: ignore[arg-type]
                                    tools=[WEATHER],  # type: ignore[list-item]
                                    tool_choice={"type": "function", "name": "get_weather"},
                                    max_output_tokens=40, temperature=0)
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id
    args = json.loads(call.arguments)
    jsonschema.validate(args, {**WEATHER["parameters"], "additionalProperties": False})
    # The result goes back as a function_call_output item; the model answers in text.
    second = client.responses.create(
        model=MODEL, tools=[WEATHER], max_output_tokens=24, temperature=0,  # type: ignore[list-item]
        input=[*question, call.model_dump(exclude_none=True),  # type: ignore[list-item]
               {"type": "function_call_output", "call_id": call.call_id,
                "output": "18 degrees and sunny"}],
    )
    assert second.status in ("completed", "incomplete")
    assert second.output_text
    # Streamed, the call's arguments arrive as function_call_arguments events.
    with client.responses.stream(model=MODEL, input=question,  # type: ignore[arg-type]
                                 tools=[WEATHER],  # type: ignore[list-item]
                                 tool_choice={"type": "function", "name": "get_weather"},
                                 max_output_tokens=40, temperature=0) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds
    (streamed,) = [item for item in final.output if item.type == "function_call"]
    assert streamed.arguments == call.arguments and streamed.name == "get_weather"


def test_json_schema_output_validates(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "country": {"type": "string", "maxLength": 20}},
              "required": ["city", "country"]}
    out = client.responses.create(
        model=MODEL, input="Name a big city and its country.", max_output_tokens=40,
        temperature=0, text={"format": {"type": "json_schema", "name": "place",
                                        "schema": schema}},
    )
    assert out.status == "completed"
    value = json.loads(out.output_text)
    jsonschema.validate(value, {**schema, "additionalProperties": False})


def test_previous_response_id_continues_the_conversation(client: openai.OpenAI) -> None:
    first = client.responses.create(model=MODEL, input="My name is Ada. Say hello.",
                                    max_output_tokens=12, temperature=0)
    second = client.responses.create(model=MODEL, input="What is my name?",
                                     previous_response_id=first.id, max_output_tokens=12,
                                     temperature=0)
    alone = client.responses.create(model=MODEL, input="What is my name?",
                                    max_output_tokens=12, temperature=0)
    assert first.usage and second.usage and alone.usage
    # The second turn's prompt holds the first turn, its answer and the new question.
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens > alone.usage.input_tokens
    assert second.previous_response_id == first.id
    assert client.responses.retrieve(first.id).output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="Hi", previous_response_id=first.id)
    unstored = client.responses.create(model=MODEL, input="Hi", store=False,
                                       max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_an_agent_with_a_function_tool_completes_a_run(smol: ServerHandle) -> None:
    agents = pytest.importorskip("agents", reason="openai-agents is a test dependency")
    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        calls.append(city)
        return f"18 degrees and sunny in {city}"

    model = agents.OpenAIResponsesModel(
        model=MODEL,
        openai_client=openai.AsyncOpenAI(base_url=f"{smol.url}/v1", api_key="unused",
                                         max_retries=0, timeout=300),
    )
    agent = agents.Agent(
        name="weather", instructions="Answer with the tool's result.", tools=[get_weather],
        model=model,
        model_settings=agents.ModelSettings(tool_choice="get_weather", temperature=0,
                                            max_tokens=40),
    )
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?", max_turns=4,
                                    run_config=agents.RunConfig(tracing_disabled=True))
    assert calls  # the tool ran with the model's arguments
    assert isinstance(result.final_output, str) and result.final_output
    smol.wait_idle()


# ---------------------------------------------------------------- mock backend


@pytest.fixture(scope="module")
def scripted() -> Iterator[ServerHandle]:
    starter = ServerStarter()
    yield starter(ScriptedBackend(), total_kv_blocks=256)
    starter.close()



@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "input"),
        ({"input": []}, "input"),
        ({"input": [{"role": "robot", "content": "hi"}]}, "input[0]"),
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0]"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
         "input[0].content"),
        ({"input": [{"type": "function_call", "name": "f"}]}, "input[0]"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0]"),
        ({"input": "hi", "tool_choice": {"type": "mcp"}}, "tool_choice"),
        ({"input": "hi", "text": {"format": {"type": "yaml"}}}, "text.format"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "hi", "temperature": "hot"}, "temperature"),
        ({"input": "hi", "previous_response_id": "resp_nope"}, "previous_response_id"),
        ({"input": "hi", "background": True}, "background"),
    ],
)
def test_bad_input_is_a_4xx_in_openai_shape_and_changes_nothing(
    scripted: ServerHandle, body: dict[str, Any], param: str,
) -> None:
    server = scripted
    before = server.engine.stats.scheduler["requests_added"]
    response = httpx.post(f"{server.url}/v1/responses", json=body, timeout=30)
    assert 400 <= response.status_code < 500, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"]
    assert server.engine.stats.scheduler["requests_added"] == before


def test_stored_responses_belong_to_their_api_key(start_server: ServerFactory) -> None:
    backend = ScriptedBackend()
    backend.script = "Hello there."
    server = start_server(backend, api_key=["key-a", "key-b"])  # type: ignore[arg-type]
    server.headers = {"Authorization": "Bearer key-a"}
    a = openai.OpenAI(base_url=f"{server.url}/v1", api_key="key-a", max_retries=0)
    b = openai.OpenAI(base_url=f"{server.url}/v1", api_key="key-b", max_retries=0)
    mine = a.responses.create(model="mock", input="hello", max_output_tokens=3)
    assert a.responses.retrieve(mine.id).id == mine.id
    with pytest.raises(openai.NotFoundError):
        b.responses.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError):
        b.responses.delete(mine.id)
    with pytest.raises(openai.NotFoundError):
        b.responses.create(model="mock", input="hi", previous_response_id=mine.id)
    assert a.responses.retrieve(mine.id).id == mine.id  # b's attempts changed nothing
    server.wait_idle()


def test_an_evicted_response_is_a_404(start_server: ServerFactory) -> None:
    backend = ScriptedBackend()
    backend.script = "Hello there."
    server = start_server(backend, app_options={"max_stored_responses": 2})
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    ids = [client.responses.create(model="mock", input=f"turn {i}").id for i in range(3)]
    with pytest.raises(openai.NotFoundError, match="evicted"):
        client.responses.retrieve(ids[0])
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="mock", input="more", previous_response_id=ids[0])
    assert [client.responses.retrieve(i).id for i in ids[1:]] == ids[1:]
    server.wait_idle()
