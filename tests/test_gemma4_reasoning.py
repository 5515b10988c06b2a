"""Gemma 4's thinking (``<|channel>thought\\n...<channel|>``) split from its answer, and
its output ending at ``<turn|>`` and, after a tool call, at ``<|tool_response>``: through
the OpenAI and Anthropic clients, plain and streamed.

The scripted backend uses SmolLM2's tokenizer with Gemma 4's markers added as special
tokens, as they are in Gemma 4's own tokenizer (decoding skips special tokens by default),
and a chat template that writes Gemma 4's turns and its ``<|think|>`` switch but not the
channel markers: the reasoning parser is found from the vocabulary.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest
from conftest import ScriptedBackend, ServerHandle, ServerStarter
from iron_batch.server.openai.reasoning import (
    GEMMA4,
    THINK,
    ReasoningSplitter,
    opens_reasoning,
    reasoning_format,
)

Q = '<|"|>'
SPECIAL = ["<|turn>", "<turn|>", "<|think|>", "<|channel>", "<channel|>", "<|tool>",
           "<tool|>", "<|tool_call>", "<tool_call|>", "<|tool_response>", "<tool_response|>",
           Q]
TURNS = (
    "{% if enable_thinking is defined and enable_thinking %}<|turn>system\n<|think|><turn|>\n"
    "{% endif %}"
    "{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "{{ '<|turn>' + role + '\\n' + m['content'] | trim + '<turn|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|turn>model\\n' }}{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a place.",
        "parameters": {"type": "object", "properties": {"location": {"type": "string"}},
                       "required": ["location"]},
    },
}
ASK = [{"role": "user", "content": "What is the capital of France?"}]
THOUGHT = "<|channel>thought\nThe user asks for the capital of France. It is Paris.<channel|>"
LONDON = f"<|tool_call>call:get_weather{{location:{Q}London{Q}}}<tool_call|>"
RESULT = f"<|tool_response>response:get_weather{{value:{Q}12 degrees{Q}}}<tool_response|>"


def _tokenizer(special: list[str]) -> Any:
    from iron_batch.loader import read_gguf_fields, resolve
    from iron_batch.tokenizer import Tokenizer
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    info = Tokenizer.from_gguf_fields(read_gguf_fields(resolve("smollm2-135m").gguf)).to_info()
    hf = HFTokenizer.from_str(info["json"])
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    return Tokenizer.from_info({**info, "json": hf.to_str(), "chat_template": TURNS})


class Served:
    def __init__(self, tokenizer: Any = None) -> None:
        self.backend = ScriptedBackend(tokenizer)
        self.starter = ServerStarter()
        self.handle: ServerHandle = self.starter(self.backend, total_kv_blocks=256)
        self.openai = openai.OpenAI(base_url=f"{self.handle.url}/v1", api_key="unused",
                                    max_retries=0)
        self.anthropic = anthropic.Anthropic(base_url=self.handle.url, api_key="unused",
                                             max_retries=0)


@pytest.fixture(scope="module")
def gemma4() -> Iterator[Served]:
    s = Served(_tokenizer(SPECIAL))
    yield s
    s.starter.close()


def chat_split(client: openai.OpenAI, **kw: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """(reasoning, content, tool calls, finish reason) of the whole and the streamed answer."""
    kw = {"model": "mock", "messages": ASK, "max_tokens": 200, **kw}
    choice = client.chat.completions.create(**kw).choices[0]
    message = choice.message
    calls = [(c.function.name, json.loads(c.function.arguments))
             for c in message.tool_calls or []]
    whole = (getattr(message, "reasoning_content", None), message.content, calls,
             choice.finish_reason)
    assert getattr(message, "reasoning", None) == whole[0]
    thought, text, reason, pieces = "", "", None, 0
    streamed_calls: dict[int, list[str]] = {}
    for chunk in client.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            delta = getattr(ch.delta, "reasoning_content", None) or ""
            pieces += bool(delta)
            thought += delta
            text += ch.delta.content or ""
            reason = ch.finish_reason or reason
            for d in ch.delta.tool_calls or []:
                entry = streamed_calls.setdefault(d.index, ["", ""])
                entry[0] += d.function.name or ""
                entry[1] += d.function.arguments or ""
    streamed = (thought or None, text or None,
                [(n, json.loads(a)) for _, (n, a) in sorted(streamed_calls.items())], reason)
    if whole[0]:
        assert pieces > 1  # the thinking streams as it comes, not at the end
    return whole, streamed


@pytest.mark.parametrize(
    ("script", "expected"),
    [
        (f"{THOUGHT}Paris.",
         ("The user asks for the capital of France. It is Paris.", "Paris.", [], "stop")),
        ("<|channel>thought\nHmm.\n<channel|>\n\nParis is the capital.",
         ("Hmm.", "Paris is the capital.", [], "stop")),
        # No channel: all of it is the answer.
        ("Paris.", (None, "Paris.", [], "stop")),
        # An empty channel (thinking switched off, larger checkpoints): no reasoning.
        ("<|channel>thought\n<channel|>Paris.", (None, "Paris.", [], "stop")),
        # The end of the turn ends the output: nothing after it is shown.
        (f"{THOUGHT}Paris.<turn|>\n<|turn>user\nAnd Spain?<turn|>",
         ("The user asks for the capital of France. It is Paris.", "Paris.", [], "stop")),
    ],
)
def test_chat_splits_the_thought_channel_from_the_answer(
    gemma4: Served, script: str, expected: tuple[Any, ...],
) -> None:
    gemma4.backend.script = script
    whole, streamed = chat_split(gemma4.openai)
    assert whole == expected
    assert streamed == whole


def test_thinking_switched_on_reaches_the_template(gemma4: Served) -> None:
    gemma4.backend.script = f"{THOUGHT}Paris."
    whole, _ = chat_split(gemma4.openai,
                          extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert whole[:2] == ("The user asks for the capital of France. It is Paris.", "Paris.")
    tok = gemma4.backend.tokenizer
    prompt = tok.decode(gemma4.backend.prompts[-1], skip_special_tokens=False)
    assert prompt.startswith("<|turn>system\n<|think|><turn|>\n<|turn>user\n")


def test_a_call_after_thinking_is_a_call_and_the_output_stops_at_the_result(
    gemma4: Served,
) -> None:
    # The model would go on to invent the tool's result: <|tool_response> ends its output.
    gemma4.backend.script = (f"<|channel>thought\nI need the weather.<channel|>{LONDON}{RESULT}"
                             "It is 12 degrees in London.")
    whole, streamed = chat_split(gemma4.openai, tools=[WEATHER])
    assert whole == ("I need the weather.", None, [("get_weather", {"location": "London"})],
                     "tool_calls")
    assert streamed == whole
    out = gemma4.openai.chat.completions.create(model="mock", messages=ASK, max_tokens=200,
                                                tools=[WEATHER])  # type: ignore[list-item]
    tok = gemma4.backend.tokenizer
    generated = tok.encode(f"<|channel>thought\nI need the weather.<channel|>{LONDON}"
                           "<|tool_response>", add_special_tokens=False)
    assert out.usage is not None and out.usage.completion_tokens == len(generated)


def test_without_tools_the_output_also_stops_at_a_tool_response(gemma4: Served) -> None:
    gemma4.backend.script = f"Paris.{RESULT}Invented."
    whole, streamed = chat_split(gemma4.openai)
    assert whole == (None, "Paris.", [], "stop")
    assert streamed == whole


def test_the_vocabulary_ends_gemma4_turns_and_tool_calls(gemma4: Served) -> None:
    tok = gemma4.backend.tokenizer
    for end in ("<turn|>", "<|tool_response>"):
        assert tok.token_to_id(end) in tok.eos_token_ids
    # What it had before stays first.
    plain = _tokenizer([])
    assert tok.eos_token_ids[: len(plain.eos_token_ids)] == plain.eos_token_ids
    assert not {tok.token_to_id("<|tool_response>"), tok.token_to_id("<turn|>")} & set(
        plain.eos_token_ids)


def test_responses_api_gives_a_reasoning_item(gemma4: Served) -> None:
    gemma4.backend.script = f"{THOUGHT}Paris."
    thought = "The user asks for the capital of France. It is Paris."
    out = gemma4.openai.responses.create(model="mock", input="Capital of France?")
    assert [item.type for item in out.output] == ["reasoning", "message"]
    assert out.output[0].content[0].text == thought  # type: ignore[union-attr,index]
    assert out.output_text == "Paris."
    with gemma4.openai.responses.stream(model="mock", input="Capital of France?") as stream:
        events = [e.type for e in stream]
        final = stream.get_final_response()
    assert events.index("response.reasoning_text.delta") < events.index(
        "response.output_text.delta")
    assert [i.type for i in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == thought  # type: ignore[union-attr,index]
    assert final.output_text == "Paris."


def test_messages_api_gives_thinking_then_text_or_a_tool_use(gemma4: Served) -> None:
    gemma4.backend.script = f"{THOUGHT}Paris."
    thought = "The user asks for the capital of France. It is Paris."
    kw: dict[str, Any] = dict(model="mock", max_tokens=64, messages=ASK,
                              thinking={"type": "enabled", "budget_tokens": 1024})
    out = gemma4.anthropic.messages.create(**kw)
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None))
            for b in out.content] == [("thinking", thought), ("text", "Paris.")]
    with gemma4.anthropic.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None))
            for b in final.content] == [("thinking", thought), ("text", "Paris.")]

    gemma4.backend.script = (f"<|channel>thought\nI need the weather.<channel|>{LONDON}{RESULT}"
                             "It is 12 degrees.")
    tools: Any = [{"name": "get_weather", "description": "Current weather in a place.",
                   "input_schema": WEATHER["function"]["parameters"]}]  # type: ignore[index]
    with gemma4.anthropic.messages.stream(**kw, tools=tools) as stream:
        streamed = stream.get_final_message()
    for out in (gemma4.anthropic.messages.create(**kw, tools=tools), streamed):
        assert out.stop_reason == "tool_use"
        assert [(b.type, getattr(b, "thinking", None) or getattr(b, "name", None))
                for b in out.content] == [("thinking", "I need the weather."),
                                          ("tool_use", "get_weather")]


def test_a_vocabulary_without_the_channel_is_unchanged() -> None:
    """SmolLM2 as it is: the same text is all content, the tags as written."""
    s = Served()
    try:
        assert reasoning_format(s.backend.tokenizer.chat_template, "auto",
                                s.backend.tokenizer) is None
        s.backend.script = "<|channel>thought\nHmm.<channel|>Paris."
        whole, streamed = chat_split(s.openai)
        assert whole == (None, "<|channel>thought\nHmm.<channel|>Paris.", [], "stop")
        assert streamed == whole
    finally:
        s.starter.close()


def test_the_format_is_chosen_by_template_vocabulary_or_setting(gemma4: Served) -> None:
    tok = gemma4.backend.tokenizer
    assert reasoning_format(TURNS, "auto", tok) is GEMMA4
    assert reasoning_format("{{ '<|channel>thought\\n<channel|>' }}", "auto") is GEMMA4
    assert reasoning_format(TURNS, "auto") is None
    assert reasoning_format(TURNS, "none", tok) is None
    assert reasoning_format(TURNS, "gemma4") is GEMMA4
    assert reasoning_format("<think></think>", "auto") is THINK


def test_a_prompt_that_opens_the_channel_leaves_the_model_inside_it() -> None:
    assert opens_reasoning(GEMMA4, "<|turn>model\n<|channel>thought\n")
    assert not opens_reasoning(GEMMA4, "<|turn>model\n<|channel>thought\n<channel|>")
    assert not opens_reasoning(GEMMA4, "<|turn>model\n")
    split = ReasoningSplitter(GEMMA4, in_reasoning=True)
    assert split.split("Checking.<channel|>Paris.") == ("Checking.", "Paris.")
