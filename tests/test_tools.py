"""tools and tool_choice with the official openai client.

Forced calls (a named function, ``required``) run SmolLM2-135M under the grammar: their
arguments validate against the declared schema. ``auto`` reads the model's own call format
from its text; to test the parser on exact outputs, a scripted backend (SmolLM2's
tokenizer, no weights) answers each request with the text the test chose.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from conftest import ScriptedBackend, ServerHandle, ServerStarter

MODEL = "smollm2-135m"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 24},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current time in a timezone.",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "maxLength": 24}},
            "required": ["timezone"],
            "additionalProperties": False,
        },
    },
}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "What is the weather like in Paris?"}]


@pytest.fixture(scope="module")
def client(smol: ServerHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{smol.url}/v1", api_key="unused", max_retries=0,
                         timeout=300)


def check_call(call: Any) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_named_function_arguments_follow_its_schema(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER, TIME], max_tokens=40, temperature=0,  # type: ignore[arg-type]
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "get_weather"
    check_call(call)


def test_named_call_streams_its_arguments_in_the_openai_delta_shape(
    client: openai.OpenAI,
) -> None:
    kw: dict[str, Any] = dict(
        model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=40, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    full = client.chat.completions.create(**kw).choices[0].message.tool_calls
    assert full is not None
    deltas = [c.choices[0].delta for c in client.chat.completions.create(**kw, stream=True)
              if c.choices]
    calls = [d.tool_calls[0] for d in deltas if d.tool_calls]
    assert len(calls) > 2  # the arguments arrive in pieces, not at the end
    first = calls[0]
    assert first.index == 0 and first.id and first.function.name == "get_weather"
    assert all(c.id is None and c.function.name is None for c in calls[1:])
    assert "".join(c.function.arguments or "" for c in calls) == full[0].function.arguments
    assert not any(d.content for d in deltas)


def test_required_makes_at_least_one_valid_call(client: openai.OpenAI) -> None:
    for stream in (False, True):
        kw: dict[str, Any] = dict(
            model=MODEL, tools=[WEATHER, TIME], tool_choice="required", max_tokens=64,
            temperature=0.8, seed=5, parallel_tool_calls=False,
            messages=[{"role": "user", "content": "What time is it in Tokyo?"}],
        )
        if stream:
            calls: dict[int, dict[str, str]] = {}
            reason = None
            for chunk in client.chat.completions.create(**kw, stream=True):
                for ch in chunk.choices:
                    reason = ch.finish_reason or reason
                    for d in ch.delta.tool_calls or []:
                        entry = calls.setdefault(d.index, {"name": "", "arguments": ""})
                        entry["name"] += d.function.name or ""
                        entry["arguments"] += d.function.arguments or ""
            assert reason == "tool_calls" and len(calls) == 1
            (entry,) = calls.values()
            jsonschema.validate(json.loads(entry["arguments"]), SCHEMAS[entry["name"]])
        else:
            choice = client.chat.completions.create(**kw).choices[0]
            assert choice.finish_reason == "tool_calls"
            (call,) = choice.message.tool_calls or []
            check_call(call)


def test_none_gives_content_only(client: openai.OpenAI) -> None:
    choice = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=12,
        temperature=0,
    ).choices[0]
    assert choice.message.tool_calls is None
    assert choice.message.content


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [{"type": "function"}]}, "tools[0]"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
         "tools[0].function.name"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function",
                                               "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "nada"}}}}}],
          "tool_choice": "required"}, "tools"),
        ({"tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "objekt"}}}],
          "tool_choice": {"type": "function", "function": {"name": "f"}}},
         "tools[0].function.parameters"),
        ({"messages": [*ASK, {"role": "assistant", "tool_calls": [{"id": "c1"}]}]},
         "messages[1]"),
    ],
)
def test_bad_tools_are_400s(smol: ServerHandle, body: dict[str, Any], param: str) -> None:
    before = smol.engine.stats.scheduler["requests_added"]
    response = httpx.post(f"{smol.url}/v1/chat/completions", json={"messages": ASK, **body},
                          timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert smol.engine.stats.scheduler["requests_added"] == before


def test_tool_results_reach_the_template(smol: ServerHandle) -> None:
    """A call and its result in the history, rendered by SmolLM2's template (which knows
    no tools: they are written in the Hermes text format)."""
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"},
    ]
    tokens = httpx.post(f"{smol.url}/tokenize", json={"messages": messages, "tools": [WEATHER]},
                        timeout=30).json()["tokens"]
    text = httpx.post(f"{smol.url}/detokenize", json={"tokens": tokens}, timeout=30).json()
    rendered = text["prompt"]
    assert '"name": "get_weather"' in rendered  # the declaration and the call
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in rendered
    assert "<tool_response>\n18 degrees and sunny\n</tool_response>" in rendered


# ---------------------------------------------------------------- auto, on scripted text


@pytest.fixture(scope="module")
def scripted() -> Iterator[tuple[ScriptedBackend, openai.OpenAI]]:
    backend = ScriptedBackend()
    starter = ServerStarter()
    handle = starter(backend, total_kv_blocks=256)
    yield backend, openai.OpenAI(base_url=f"{handle.url}/v1", api_key="unused", max_retries=0)
    starter.close()


HERMES = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'  # noqa: E501
PARIS = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
CET = '{"name": "get_time", "arguments": {"timezone": "CET"}}'
BOTH = [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"timezone": "CET"})]


@pytest.mark.parametrize(
    ("script", "content", "calls"),
    [
        (HERMES, None, [("get_weather", {"city": "Paris", "unit": "celsius"})]),
        ("Let me look.\n" + HERMES + '\n<tool_call>\n{"name": "get_time", "arguments": '
         '{"timezone": "CET"}}\n</tool_call>', "Let me look.",
         [("get_weather", {"city": "Paris", "unit": "celsius"}),
          ("get_time", {"timezone": "CET"})]),
        ('{"name": "get_time", "parameters": {"timezone": "UTC"}}', None,
         [("get_time", {"timezone": "UTC"})]),
        ("It is sunny in Paris.", "It is sunny in Paris.", []),
        ('<tool_call>\n{"name": "get_weather", "arguments": {city: Paris}}\n</tool_call>',
         '<tool_call>\n{"name": "get_weather", "arguments": {city: Paris}}\n</tool_call>', []),
        ('<tool_call>\n{"name": "launch_rocket", "arguments": {}}\n</tool_call>',
         '<tool_call>\n{"name": "launch_rocket", "arguments": {}}\n</tool_call>', []),
        ('{"answer": 42}', '{"answer": 42}', []),
        # SmolLM3 (Hermes tags, no newlines).
        (f"<tool_call>{CET}</tool_call>", None, BOTH[1:]),
        # Phi-4-mini: a JSON list between its tags, text before it is content.
        (f"<|tool_call|>[{PARIS}, {CET}]<|/tool_call|>", None, BOTH),
        (f"Let me look.<|tool_call|>[{PARIS}]<|/tool_call|>", "Let me look.", BOTH[:1]),
        # Phi-4-mini's tags are special tokens: skipped in decoding, the list is left.
        (f"[{PARIS}, {CET}]", None, BOTH),
        # Granite 3.0, then Granite 3.1+: the tag and a JSON list, no closing tag.
        (f"<|tool_call|>[{CET}]", None, BOTH[1:]),
        (f"<tool_call>[{PARIS}, {CET}]", None, BOTH),
        ('<|tool_call|>[{"name": "launch_rocket", "arguments": {}}]<|/tool_call|>',
         '<|tool_call|>[{"name": "launch_rocket", "arguments": {}}]<|/tool_call|>', []),
        ("Use <|tool_call| for calls.", "Use <|tool_call| for calls.", []),
        # Gemma 4, its markers spelled out in text (tokenized piece by piece).
        ('Let me look.<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,unit:<|"|>celsius'
         '<|"|>}<tool_call|>', "Let me look.", BOTH[:1]),
    ],
)
def test_auto_reads_the_models_own_call_format(
    scripted: tuple[ScriptedBackend, openai.OpenAI], script: str, content: str | None,
    calls: list[tuple[str, dict[str, Any]]],
) -> None:
    backend, client = scripted
    backend.script = script
    kw: dict[str, Any] = dict(model="mock", messages=ASK, tools=[WEATHER, TIME], max_tokens=200)
    choice = client.chat.completions.create(**kw).choices[0]
    got = [(c.function.name, json.loads(c.function.arguments))
           for c in choice.message.tool_calls or []]
    assert got == calls
    assert choice.message.content == content
    assert choice.finish_reason == ("tool_calls" if calls else "stop")
    # Streamed: the same calls, and the same content (text before a call is sent early).
    text = ""
    streamed: dict[int, dict[str, str]] = {}
    reason = None
    for chunk in client.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            reason = ch.finish_reason or reason
            text += ch.delta.content or ""
            for d in ch.delta.tool_calls or []:
                entry = streamed.setdefault(d.index, {"name": "", "arguments": "", "id": ""})
                entry["name"] += d.function.name or ""
                entry["arguments"] += d.function.arguments or ""
                entry["id"] += d.id or ""
    assert [(e["name"], json.loads(e["arguments"])) for _, e in sorted(streamed.items())] == calls
    assert all(e["id"].startswith("call_") for e in streamed.values())
    assert text.strip() == (content or "")
    assert reason == choice.finish_reason


def test_forced_calls_on_a_backend_without_grammar_are_400s(
    scripted: tuple[ScriptedBackend, openai.OpenAI],
) -> None:
    _, client = scripted
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        with pytest.raises(openai.BadRequestError, match="does not support"):
            client.chat.completions.create(model="mock", messages=ASK, tools=[WEATHER, TIME],
                                           tool_choice=choice)  # type: ignore[arg-type]
