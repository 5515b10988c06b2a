"""Qwen3.5's XML tool calls, read back from the model's text by /v1/chat/completions
(``tool_choice: auto``), plain and streamed, through the OpenAI client: parameter values
typed by the tool's schema, text before a call kept as content, and calls of undeclared
tools or in a broken form left as content."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from conftest import ScriptedBackend, ServerStarter

SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web.",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string"}, "limit": {"type": "integer"},
                           "exact": {"type": "boolean"}, "code": {"type": "string"}},
            "required": ["query"],
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "clock",
        "description": "The time.",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}},
    },
}
ASK = [{"role": "user", "content": "Find me something."}]


@pytest.fixture(scope="module")
def scripted() -> Iterator[tuple[ScriptedBackend, openai.OpenAI]]:
    backend = ScriptedBackend()
    starter = ServerStarter()
    handle = starter(backend, total_kv_blocks=256)
    yield backend, openai.OpenAI(base_url=f"{handle.url}/v1", api_key="unused", max_retries=0)
    starter.close()


ONE = ("<tool_call>\n<function=search>\n<parameter=query>\ncats & dogs\n</parameter>\n"
       "<parameter=limit>\n5\n</parameter>\n<parameter=exact>\ntrue\n</parameter>\n"
       "<parameter=code>\n123\n</parameter>\n</function>\n</tool_call>")
TWO = ("<tool_call>\n<function=clock>\n<parameter=zone>\nCET\n</parameter>\n</function>\n"
       "</tool_call>")
FIRST = ("search", {"query": "cats & dogs", "limit": 5, "exact": True, "code": "123"})


@pytest.mark.parametrize(
    ("script", "content", "calls"),
    [
        (ONE, None, [FIRST]),
        ("Let me look.\n" + ONE + "\n" + TWO, "Let me look.", [FIRST, ("clock", {"zone": "CET"})]),
        # A multi-line string value keeps its inner newlines.
        ("<tool_call>\n<function=search>\n<parameter=query>\na\nb\n</parameter>\n</function>\n"
         "</tool_call>", None, [("search", {"query": "a\nb"})]),
        ("<tool_call>\n<function=launch>\n</function>\n</tool_call>",
         "<tool_call>\n<function=launch>\n</function>\n</tool_call>", []),
        ("<tool_call>\nsearch for cats\n</tool_call>", "<tool_call>\nsearch for cats\n</tool_call>",
         []),
    ],
)
def test_auto_reads_qwen3_5_xml_calls(
    scripted: tuple[ScriptedBackend, openai.OpenAI], script: str, content: str | None,
    calls: list[tuple[str, dict[str, Any]]],
) -> None:
    backend, client = scripted
    backend.script = script
    kw: dict[str, Any] = dict(model="mock", messages=ASK, tools=[SEARCH, CLOCK], max_tokens=300)
    choice = client.chat.completions.create(**kw).choices[0]
    got = [(c.function.name, json.loads(c.function.arguments))
           for c in choice.message.tool_calls or []]
    assert got == calls
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
