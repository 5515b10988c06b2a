"""Checkpoints' own chat templates behind every chat API, on a scripted backend (SmolLM2's
tokenizer, no weights) whose template is swapped for the real template of another family.

Gemma 2's template has no system role: it raises "System role not supported". A leading
system message is then folded into the first user turn, the way Gemma 3's template does
it itself (the system text, a blank line, the user text); Gemma 3's own folding is left
alone. A template that raises for any other reason is the client's 400.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest
from conftest import ScriptedBackend, ServerHandle, ServerStarter

# google/gemma-2-2b-it, tokenizer_config.json "chat_template" (the same in gemma-2-9b-it
# and gemma-2-27b-it).
GEMMA2 = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role "
    "not supported') }}{% endif %}{% for message in messages %}{% if (message['role'] == "
    "'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must "
    "alternate user/assistant/user/assistant/...') }}{% endif %}{% if (message['role'] == "
    "'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + "
    "'<end_of_turn>\\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{'<start_of_turn>model\\n'}}{% endif %}"
)

# google/gemma-3-1b-it, tokenizer_config.json "chat_template" (the text-only checkpoints
# and the multimodal ones share it).
GEMMA3 = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\\n'}}
{%- endif -%}
"""

SYSTEM = "You are a pirate. Answer in one line."
USER = "Where is the treasure?"
FOLDED = f"<start_of_turn>user\n{SYSTEM}\n\n{USER}<end_of_turn>\n<start_of_turn>model\n"


def _server(template: str) -> Iterator[tuple[ScriptedBackend, ServerHandle]]:
    from iron_batch.loader import read_gguf_fields, resolve
    from iron_batch.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf_fields(read_gguf_fields(resolve("smollm2-135m").gguf))
    tok.chat_template = template
    backend = ScriptedBackend(tok)
    backend.script = "Under the palm tree."
    starter = ServerStarter()
    yield backend, starter(backend, total_kv_blocks=256)
    starter.close()


@pytest.fixture(scope="module")
def gemma2() -> Iterator[tuple[ScriptedBackend, ServerHandle]]:
    yield from _server(GEMMA2)


@pytest.fixture(scope="module")
def gemma3() -> Iterator[tuple[ScriptedBackend, ServerHandle]]:
    yield from _server(GEMMA3)


def _client(handle: ServerHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{handle.url}/v1", api_key="unused", max_retries=0)


def _last_prompt(backend: ScriptedBackend) -> str:
    assert backend.tokenizer is not None
    return str(backend.tokenizer.decode(backend.prompts[-1], skip_special_tokens=False))


ASK: list[Any] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]


@pytest.mark.parametrize("stream", [False, True])
def test_a_system_message_reaches_a_template_without_a_system_role(
    gemma2: tuple[ScriptedBackend, ServerHandle], stream: bool,
) -> None:
    backend, handle = gemma2
    kw: dict[str, Any] = dict(model="mock", messages=ASK, max_tokens=20)
    if stream:
        text = "".join(c.choices[0].delta.content or ""
                       for c in _client(handle).chat.completions.create(**kw, stream=True)
                       if c.choices)
    else:
        text = _client(handle).chat.completions.create(**kw).choices[0].message.content or ""
    assert text == "Under the palm tree."
    assert _last_prompt(backend).endswith(FOLDED)


def test_the_fold_serves_the_responses_and_messages_apis(
    gemma2: tuple[ScriptedBackend, ServerHandle],
) -> None:
    backend, handle = gemma2
    out = _client(handle).responses.create(model="mock", instructions=SYSTEM, input=USER,
                                           max_output_tokens=20)
    assert out.output_text == "Under the palm tree."
    assert _last_prompt(backend).endswith(FOLDED)
    client = anthropic.Anthropic(base_url=handle.url, api_key="unused", max_retries=0)
    message = client.messages.create(model="mock", system=SYSTEM, max_tokens=20,
                                     messages=[{"role": "user", "content": USER}])
    assert message.content[0].text == "Under the palm tree."  # type: ignore[union-attr]
    assert _last_prompt(backend).endswith(FOLDED)


def test_a_template_that_folds_the_system_message_itself_is_left_alone(
    gemma3: tuple[ScriptedBackend, ServerHandle],
) -> None:
    backend, handle = gemma3
    out = _client(handle).chat.completions.create(model="mock", messages=ASK, max_tokens=20)
    assert out.choices[0].message.content == "Under the palm tree."
    prompt = _last_prompt(backend)
    assert prompt.endswith(FOLDED)
    assert prompt.count(SYSTEM) == 1


def test_a_system_message_alone_becomes_the_user_turn(
    gemma2: tuple[ScriptedBackend, ServerHandle],
) -> None:
    backend, handle = gemma2
    _client(handle).chat.completions.create(
        model="mock", messages=[{"role": "system", "content": SYSTEM}], max_tokens=20)
    assert _last_prompt(backend).endswith(
        f"<start_of_turn>user\n{SYSTEM}<end_of_turn>\n<start_of_turn>model\n")


@pytest.mark.parametrize("system", [False, True])
def test_other_template_errors_are_400s_in_each_apis_shape(
    gemma2: tuple[ScriptedBackend, ServerHandle], system: bool,
) -> None:
    """Two user turns in a row: Gemma's template raises, with or without a system
    message before them (folding it does not make the turns alternate)."""
    backend, handle = gemma2
    before = len(backend.prompts)
    turns = [{"role": "user", "content": USER}, {"role": "user", "content": USER}]
    messages = [ASK[0], *turns] if system else turns
    with pytest.raises(openai.BadRequestError) as caught:
        _client(handle).chat.completions.create(model="mock", messages=messages,  # type: ignore[arg-type]
                                                max_tokens=20)
    error = caught.value.body
    assert isinstance(error, dict)
    assert "Conversation roles must alternate" in error["message"]
    assert error["param"] == "messages" and error["type"] == "invalid_request_error"
    response = httpx.post(f"{handle.url}/v1/messages", timeout=30, json={
        "model": "mock", "max_tokens": 20, "messages": turns,
        **({"system": SYSTEM} if system else {})})
    assert response.status_code == 400
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "Conversation roles must alternate" in body["error"]["message"]
    assert len(backend.prompts) == before  # nothing reached the engine


# ---------------------------------------------------------------- Phi-4-mini's tools

# microsoft/Phi-4-mini-instruct, tokenizer_config.json "chat_template": tools come in the
# system message's "tools" (a JSON string), written between <|tool|> and <|/tool|>.
PHI4_MINI = (
    "{% for message in messages %}{% if message['role'] == 'system' and 'tools' in message "
    "and message['tools'] is not none %}{{ '<|' + message['role'] + '|>' + message['content'] "
    "+ '<|tool|>' + message['tools'] + '<|/tool|>' + '<|end|>' }}{% else %}{{ '<|' + "
    "message['role'] + '|>' + message['content'] + '<|end|>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% else %}{{ eos_token }}{% endif %}"
)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


@pytest.fixture(scope="module")
def phi4_mini() -> Iterator[tuple[ScriptedBackend, ServerHandle]]:
    yield from _server(PHI4_MINI)


def test_phi4_mini_gets_its_tools_in_the_system_message_and_its_calls_are_read(
    phi4_mini: tuple[ScriptedBackend, ServerHandle],
) -> None:
    backend, handle = phi4_mini
    history: list[Any] = [
        ASK[0], {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3 degrees"},
        {"role": "assistant", "content": "It is 3 degrees."},
        {"role": "user", "content": "And in Paris?"},
    ]
    backend.script = '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]<|/tool_call|>'  # noqa: E501
    kw: dict[str, Any] = dict(model="mock", messages=history, tools=[WEATHER], max_tokens=60)
    choice = _client(handle).chat.completions.create(**kw).choices[0]
    prompt = _last_prompt(backend)
    declared = json.dumps([WEATHER["function"]])
    assert prompt.startswith(f"<|system|>{SYSTEM}<|tool|>{declared}<|/tool|><|end|>")
    assert ('<|assistant|><|tool_call|>[{"name": "get_weather", "arguments": {"city": "Oslo"}}]'
            '<|/tool_call|><|end|><|tool|>3 degrees<|end|>') in prompt
    assert prompt.endswith("<|user|>And in Paris?<|end|><|assistant|>")
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather", {"city": "Paris"})
    streamed = [d for c in _client(handle).chat.completions.create(**kw, stream=True)
                for d in (c.choices[0].delta.tool_calls or [] if c.choices else [])]
    assert [(d.function.name, json.loads(d.function.arguments or "")) for d in streamed] == [
        ("get_weather", {"city": "Paris"})]


def test_phi4_mini_without_a_system_message_gets_one_for_its_tools(
    phi4_mini: tuple[ScriptedBackend, ServerHandle],
) -> None:
    backend, handle = phi4_mini
    backend.script = "Sunny."
    out = _client(handle).chat.completions.create(
        model="mock", messages=[{"role": "user", "content": USER}], tools=[WEATHER],
        max_tokens=20)
    assert out.choices[0].message.content == "Sunny."
    assert _last_prompt(backend).startswith(
        "<|system|>You are a helpful assistant with some tools.<|tool|>[{")


# ---------------------------------------------------------------- Granite's tools

# ibm-granite/granite-3.2-*-instruct, tokenizer_config.json "chat_template": it takes
# ``tools`` (a tools turn) but writes no calls; its system prompt asks for <|tool_call|>
# and a JSON list.
GRANITE32 = """{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set system_message = "Knowledge Cutoff Date: April 2024.\\nToday's Date: " + strftime_now('%B %d, %Y') + ".\\nYou are Granite, developed by IBM." %}
    {%- if tools and documents %}
        {%- set system_message = system_message + " You are a helpful AI assistant with access to the following tools. When a tool is required to answer the user's query, respond with <|tool_call|> followed by a JSON list of tools used. If a tool does not exist in the provided list of tools, notify the user that you do not have the ability to fulfill the request.\\n\\nWrite the response to the user's input by strictly aligning with the facts in the provided documents. If the information needed to answer the question is not available in the documents, inform the user that the question cannot be answered based on the available data." %}
    {%- elif tools %}
        {%- set system_message = system_message + " You are a helpful AI assistant with access to the following tools. When a tool is required to answer the user's query, respond with <|tool_call|> followed by a JSON list of tools used. If a tool does not exist in the provided list of tools, notify the user that you do not have the ability to fulfill the request." %}
    {%- elif documents %}
        {%- set system_message = system_message + " Write the response to the user's input by strictly aligning with the facts in the provided documents. If the information needed to answer the question is not available in the documents, inform the user that the question cannot be answered based on the available data." %}
    {%- else %}
        {%- set system_message = system_message + " You are a helpful AI assistant." %}
    {%- endif %}
    {%- if 'citations' in controls and documents %}
        {%- set system_message = system_message + '\\n\\nIn your response, use the symbols <co> and </co> to indicate when a fact comes from a document in the search result, e.g <co>0</co> for a fact from document 0. Afterwards, list all the citations with their corresponding documents in an ordered list.' %}
    {%- endif %}
    {%- if 'hallucinations' in controls and documents %}
        {%- set system_message = system_message + '\\n\\nFinally, after the response is written, include a numbered list of sentences from the response that are potentially hallucinated and not based in the documents.' %}
    {%- endif %}
    {%- set loop_messages = messages %}
{%- endif %}
{{- '<|start_of_role|>system<|end_of_role|>' + system_message + '<|end_of_text|>\\n' }}
{%- if tools %}
    {{- '<|start_of_role|>tools<|end_of_role|>' }}
    {{- tools | tojson(indent=4) }}
    {{- '<|end_of_text|>\\n' }}
{%- endif %}
{%- if documents %}
    {{- '<|start_of_role|>documents<|end_of_role|>' }}
    {%- for document in documents %}
        {{- 'Document ' + loop.index0 | string + '\\n' }}
        {{- document['text'] }}
        {%- if not loop.last %}
            {{- '\\n\\n'}}
        {%- endif%}
    {%- endfor %}
    {{- '<|end_of_text|>\\n' }}
{%- endif %}
{%- for message in loop_messages %}
    {{- '<|start_of_role|>' + message['role'] + '<|end_of_role|>' + message['content'] + '<|end_of_text|>\\n' }}
    {%- if loop.last and add_generation_prompt %}
        {{- '<|start_of_role|>assistant' }}
            {%- if controls %}
                {{- ' ' + controls | tojson()}}
            {%- endif %}
        {{- '<|end_of_role|>' }}
    {%- endif %}
{%- endfor %}"""  # noqa: E501


@pytest.fixture(scope="module")
def granite() -> Iterator[tuple[ScriptedBackend, ServerHandle]]:
    yield from _server(GRANITE32)


@pytest.mark.parametrize("stream", [False, True])
def test_granite_gets_its_tools_turn_and_its_calls_are_read(
    granite: tuple[ScriptedBackend, ServerHandle], stream: bool,
) -> None:
    backend, handle = granite
    history: list[Any] = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3 degrees"},
        {"role": "user", "content": "And in Paris?"},
    ]
    backend.script = '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    kw: dict[str, Any] = dict(model="mock", messages=history, tools=[WEATHER], max_tokens=60)
    if stream:
        deltas = [c.choices[0].delta for c in
                  _client(handle).chat.completions.create(**kw, stream=True) if c.choices]
        assert not any(d.content for d in deltas)
        got = [(t.function.name, json.loads(t.function.arguments or ""))
               for d in deltas for t in d.tool_calls or []]
    else:
        choice = _client(handle).chat.completions.create(**kw).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        got = [(t.function.name, json.loads(t.function.arguments))
               for t in choice.message.tool_calls or []]
    assert got == [("get_weather", {"city": "Paris"})]
    prompt = _last_prompt(backend)
    assert "respond with <|tool_call|> followed by a JSON list" in prompt
    tools_turn = json.dumps([WEATHER], indent=4)
    assert f"<|start_of_role|>tools<|end_of_role|>{tools_turn}<|end_of_text|>" in prompt
    assert ('<|start_of_role|>assistant<|end_of_role|><|tool_call|>[{"name": "get_weather", '
            '"arguments": {"city": "Oslo"}}]<|end_of_text|>\n'
            "<|start_of_role|>tool<|end_of_role|>3 degrees<|end_of_text|>") in prompt
