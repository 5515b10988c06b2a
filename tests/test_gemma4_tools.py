"""Gemma 4's tool calls (``<|tool_call>call:NAME{key:<|"|>text<|"|>}<tool_call|>``) read
from the model's text under ``tool_choice: auto``, through the OpenAI and Anthropic
clients, plain and streamed; earlier calls and results written back in that form.

The scripted backend uses SmolLM2's tokenizer with Gemma 4's markers added as special
tokens, as they are in Gemma 4's own tokenizer (decoding skips special tokens by
default), and a chat template that writes Gemma 4's turns but knows no tools.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest
from conftest import ScriptedBackend, ServerHandle, ServerStarter

Q = '<|"|>'
SPECIAL = ["<|turn>", "<turn|>", "<|tool>", "<tool|>", "<|tool_call>", "<tool_call|>",
           "<|tool_response>", "<tool_response|>", Q]
TURNS = (
    "{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "{{ '<|turn>' + role + '\\n' + m['content'] | trim + '<turn|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|turn>model\\n' }}{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a place.",
        "parameters": {"type": "object", "properties": {"location": {"type": "string"},
                                                         "unit": {"type": "string"}},
                       "required": ["location"]},
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search notes.",
        "parameters": {"type": "object", "properties": {}},
    },
}
ASK = [{"role": "user", "content": "What is the weather in London?"}]
LONDON = f"<|tool_call>call:get_weather{{location:{Q}London{Q},unit:{Q}celsius{Q}}}<tool_call|>"


def _server(template: str) -> Iterator[tuple[ScriptedBackend, ServerHandle]]:
    from iron_batch.loader import read_gguf_fields, resolve
    from iron_batch.tokenizer import Tokenizer
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    info = Tokenizer.from_gguf_fields(read_gguf_fields(resolve("smollm2-135m").gguf)).to_info()
    hf = HFTokenizer.from_str(info["json"])
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tok = Tokenizer.from_info({**info, "json": hf.to_str(), "chat_template": template})
    backend = ScriptedBackend(tok)
    starter = ServerStarter()
    yield backend, starter(backend, total_kv_blocks=256)
    starter.close()


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[ScriptedBackend, ServerHandle]]:
    yield from _server(TURNS)


# A short stand-in for Gemma 4's own template, which renders tools, calls and results.
NATIVE = (
    "{% if tools %}<|turn>system\n{% for t in tools %}<|tool>declaration:"
    "{{ t['function']['name'] }}<tool|>{% endfor %}<turn|>\n{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'tool' %}<|tool_response>response:"
    "{{ m['tool_call_id'] }}{value:{{ m['content'] }}}<tool_response|>{% else %}"
    "<|turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] }}"
    "{% for c in m['tool_calls'] or [] %}<|tool_call>call:{{ c['function']['name'] }}"
    "{{ c['function']['arguments'] | tojson }}<tool_call|>{% endfor %}<turn|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|turn>model\n{% endif %}"
)


@pytest.fixture(scope="module")
def native() -> Iterator[tuple[ScriptedBackend, ServerHandle]]:
    yield from _server(NATIVE)


def _client(handle: ServerHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{handle.url}/v1", api_key="unused", max_retries=0)


def test_the_markers_are_special_tokens(server: tuple[ScriptedBackend, ServerHandle]) -> None:
    """What the scripted model says loses its markers in plain decoding: the server has to
    keep them to read the calls."""
    backend, _ = server
    assert backend.tokenizer is not None
    ids = backend.tokenizer.encode(LONDON, add_special_tokens=False)
    assert backend.tokenizer.decode(ids) == "call:get_weather{location:London,unit:celsius}"


NESTED = (
    f"<|tool_call>call:search{{query:{Q}a, {{b}} [c] \"d\" 'e': f{Q},limit:10,ratio:-2.5e-1,"
    f"exact:true,fuzzy:false,after:null,filter:{{tags:[{Q}x{Q},{Q}y, z{Q}],"
    f"range:{{from:1,to:[]}},{Q}odd key{Q}:{{}}}}}}<tool_call|>"
)
NESTED_ARGS = {
    "query": "a, {b} [c] \"d\" 'e': f", "limit": 10, "ratio": -0.25, "exact": True,
    "fuzzy": False, "after": None,
    "filter": {"tags": ["x", "y, z"], "range": {"from": 1, "to": []}, "odd key": {}},
}
GET_LONDON = ("get_weather", {"location": "London", "unit": "celsius"})


@pytest.mark.parametrize(
    ("script", "content", "calls"),
    [
        (LONDON, None, [GET_LONDON]),
        (NESTED, None, [("search", NESTED_ARGS)]),
        # Text before the calls is content; two calls in one turn.
        (f"Let me check both.\n{LONDON}<|tool_call>call:search{{}}<tool_call|>",
         "Let me check both.", [GET_LONDON, ("search", {})]),
        # The output may stop right after the last brace.
        (f"<|tool_call>call:get_weather{{location:{Q}Paris{Q}}}", None,
         [("get_weather", {"location": "Paris"})]),
        # Not calls of declared tools, or not in the format: all content, markers included.
        (f"<|tool_call>call:launch_rocket{{target:{Q}Moon{Q}}}<tool_call|>",
         f"<|tool_call>call:launch_rocket{{target:{Q}Moon{Q}}}<tool_call|>", []),
        ("<|tool_call>call:get_weather{location:London}<tool_call|>",
         "<|tool_call>call:get_weather{location:London}<tool_call|>", []),
        # NaN is no JSON: arguments with it could not be read by a client.
        ("<|tool_call>call:get_weather{location:NaN}<tool_call|>",
         "<|tool_call>call:get_weather{location:NaN}<tool_call|>", []),
        (f"<|tool_call>call:get_weather{{location:{Q}London}}<tool_call|>",
         f"<|tool_call>call:get_weather{{location:{Q}London}}<tool_call|>", []),
        (f"Sure. <|tool_call>get_weather{{location:{Q}London{Q}}}<tool_call|>",
         f"Sure. <|tool_call>get_weather{{location:{Q}London{Q}}}<tool_call|>", []),
        ("It is 12 degrees in London.", "It is 12 degrees in London.", []),
    ],
)
def test_auto_reads_gemma4_calls(
    server: tuple[ScriptedBackend, ServerHandle], script: str, content: str | None,
    calls: list[tuple[str, dict[str, Any]]],
) -> None:
    backend, handle = server
    backend.script = script
    client = _client(handle)
    kw: dict[str, Any] = dict(model="mock", messages=ASK, tools=[WEATHER, SEARCH],
                              max_tokens=300)
    choice = client.chat.completions.create(**kw).choices[0]
    got = [(c.function.name, json.loads(c.function.arguments))
           for c in choice.message.tool_calls or []]
    assert got == calls
    assert all(c.id.startswith("call_") for c in choice.message.tool_calls or [])
    assert choice.message.content == content
    assert choice.finish_reason == ("tool_calls" if calls else "stop")
    text, streamed, reason = "", {}, None
    for chunk in client.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            reason = ch.finish_reason or reason
            text += ch.delta.content or ""
            for d in ch.delta.tool_calls or []:
                entry = streamed.setdefault(d.index, {"name": "", "arguments": ""})
                entry["name"] += d.function.name or ""
                entry["arguments"] += d.function.arguments or ""
    assert [(e["name"], json.loads(e["arguments"])) for _, e in sorted(streamed.items())] == calls
    assert text.strip() == (content or "")
    assert reason == choice.finish_reason


def test_streamed_text_before_a_call_comes_before_it_ends(
    server: tuple[ScriptedBackend, ServerHandle],
) -> None:
    backend, handle = server
    backend.script = f"One moment, please.{LONDON}"
    events = []
    for chunk in _client(handle).chat.completions.create(
        model="mock", messages=ASK, tools=[WEATHER], max_tokens=300, stream=True,
    ):
        for ch in chunk.choices:
            if ch.delta.content:
                events.append(("content", ch.delta.content))
            if ch.delta.tool_calls:
                events.append(("call", ch.delta.tool_calls[0].function.name))
    assert "".join(t for kind, t in events if kind == "content") == "One moment, please."
    assert events[-1] == ("call", "get_weather")
    assert sum(kind == "content" for kind, _ in events) > 1  # sent as it came, not at the end


def test_the_messages_api_gives_tool_use_blocks(
    server: tuple[ScriptedBackend, ServerHandle],
) -> None:
    backend, handle = server
    backend.script = f"Checking.{LONDON}<|tool_call>call:search{{query:{Q}rain{Q}}}<tool_call|>"
    client = anthropic.Anthropic(base_url=handle.url, api_key="unused", max_retries=0)
    tools: Any = [{"name": t["function"]["name"], "description": t["function"]["description"],
                   "input_schema": t["function"]["parameters"]} for t in (WEATHER, SEARCH)]
    kw: dict[str, Any] = dict(model="mock", max_tokens=300, tools=tools,
                              messages=[{"role": "user", "content": ASK[0]["content"]}])
    message = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        streamed = stream.get_final_message()
    for out in (message, streamed):
        assert out.stop_reason == "tool_use"
        assert [(b.type, getattr(b, "text", None)) for b in out.content][0] == ("text",
                                                                                 "Checking.")
        uses = [(b.name, b.input) for b in out.content if b.type == "tool_use"]
        assert uses == [GET_LONDON, ("search", {"query": "rain"})]


def test_the_responses_api_gives_function_calls(
    server: tuple[ScriptedBackend, ServerHandle],
) -> None:
    backend, handle = server
    backend.script = LONDON
    out = _client(handle).responses.create(
        model="mock", input=ASK[0]["content"], max_output_tokens=300,
        tools=[{"type": "function", **WEATHER["function"]}],  # type: ignore[list-item]
    )
    calls = [(i.name, json.loads(i.arguments)) for i in out.output if i.type == "function_call"]
    assert calls == [GET_LONDON]


def test_history_and_tools_are_written_in_gemma4_form(
    server: tuple[ScriptedBackend, ServerHandle],
) -> None:
    backend, handle = server
    backend.script = "It is 3 degrees in Oslo and sunny in Paris."
    history: list[Any] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo and Paris?"},
        {"role": "assistant", "content": "Looking.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"location": "Oslo", "unit": "celsius"}'}},
            {"id": "call_2", "type": "function", "function": {
                "name": "search", "arguments": '{"query": "Paris, FR", "days": [1, 2]}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3 degrees"},
        {"role": "tool", "tool_call_id": "call_2", "content": '{"sky": "sunny"}'},
    ]
    out = _client(handle).chat.completions.create(
        model="mock", messages=history, tools=[WEATHER, SEARCH], max_tokens=60)
    assert out.choices[0].message.content == "It is 3 degrees in Oslo and sunny in Paris."
    assert backend.tokenizer is not None
    prompt = backend.tokenizer.decode(backend.prompts[-1], skip_special_tokens=False)
    assert prompt.startswith(
        "<|turn>system\nBe brief.<|tool>declaration:get_weather{description:"
        f"{Q}Current weather in a place.{Q},parameters:{{type:{Q}object{Q},properties:"
        f"{{location:{{type:{Q}string{Q}}},unit:{{type:{Q}string{Q}}}}},"
        f"required:[{Q}location{Q}]}}}}<tool|><|tool>declaration:search{{")
    assert (
        f"<|turn>model\nLooking.<|tool_call>call:get_weather{{location:{Q}Oslo{Q},"
        f"unit:{Q}celsius{Q}}}<tool_call|><|tool_call>call:search{{query:{Q}Paris, FR{Q},"
        f"days:[1,2]}}<tool_call|>"
        f"<|tool_response>response:get_weather{{value:{Q}3 degrees{Q}}}<tool_response|>"
        f"<|tool_response>response:search{{value:{Q}{{\"sky\": \"sunny\"}}{Q}}}"
        "<tool_response|><turn|>\n<|turn>model\n"
    ) in prompt


def test_a_template_that_renders_tools_gets_them_as_they_are(
    native: tuple[ScriptedBackend, ServerHandle],
) -> None:
    backend, handle = native
    backend.script = LONDON
    history: list[Any] = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"location": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3 degrees"},
        {"role": "user", "content": "And London?"},
    ]
    choice = _client(handle).chat.completions.create(
        model="mock", messages=history, tools=[WEATHER], max_tokens=60).choices[0]
    got = [(c.function.name, json.loads(c.function.arguments))
           for c in choice.message.tool_calls or []]
    assert got == [GET_LONDON]
    assert backend.tokenizer is not None
    prompt = backend.tokenizer.decode(backend.prompts[-1], skip_special_tokens=False)
    assert prompt == (
        "<|turn>system\n<|tool>declaration:get_weather<tool|><turn|>\n"
        "<|turn>user\nWeather in Oslo?<turn|>\n"
        '<|turn>model\n<|tool_call>call:get_weather{"location": "Oslo"}<tool_call|><turn|>\n'
        "<|tool_response>response:call_1{value:3 degrees}<tool_response|>"
        "<|turn>user\nAnd London?<turn|>\n<|turn>model\n"
    )
