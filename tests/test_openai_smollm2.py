"""The official ``openai`` client against SmolLM2-135M served by iron-batch (CPU).

One server for the module; a handful of short generations.
"""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest
from conftest import ServerHandle

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(smol: ServerHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{smol.url}/v1", api_key="unused", max_retries=0,
                         timeout=120)


def test_chat_answers_paris_and_counts_tokens(smol: ServerHandle, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == ["smollm2-135m"]
    out = client.chat.completions.create(
        model="smollm2-135m", messages=QUESTION, max_tokens=24, temperature=0,  # type: ignore
        logprobs=True, top_logprobs=3,
    )
    choice = out.choices[0]
    assert "Paris" in (choice.message.content or "")
    assert out.usage is not None
    prompt = httpx.post(f"{smol.url}/tokenize", json={"messages": QUESTION}).json()["tokens"]
    assert out.usage.prompt_tokens == len(prompt)
    content = choice.logprobs.content  # type: ignore[union-attr]
    assert content is not None
    assert out.usage.completion_tokens == len(content)
    if choice.finish_reason == "stop":  # ended on <|im_end|>, which is not in the text
        assert content[-1].token == "<|im_end|>"
    for item in content:
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob, abs=1e-4)
    # The answer's text is the concatenation of its non-special tokens.
    joined = "".join(i.token for i in content if i.token != "<|im_end|>")
    assert joined == choice.message.content


def test_streamed_text_equals_non_streamed(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model="smollm2-135m", prompt="Once upon a time", max_tokens=12,
                              temperature=0.8, seed=42, n=2)
    full = client.completions.create(**kw)
    texts = ["", ""]
    usage = None
    for chunk in client.completions.create(**kw, stream=True,
                                           stream_options={"include_usage": True}):
        for ch in chunk.choices:
            texts[ch.index] += ch.text
        usage = chunk.usage or usage
    assert texts == [c.text for c in full.choices]
    assert texts[0] != texts[1]  # seed and seed + 1
    assert usage is not None and full.usage is not None
    assert usage.completion_tokens == full.usage.completion_tokens


def test_stop_string_and_cached_prompt(client: openai.OpenAI) -> None:
    prompt = "Here is a list of fruits: apple, banana, cherry, and more fruits like"
    kw: dict[str, Any] = dict(model="smollm2-135m", prompt=prompt, max_tokens=16,
                              temperature=0)
    free = client.completions.create(**kw).choices[0].text
    stop = free.strip()[:2]
    out = client.completions.create(**kw, stop=[stop])
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == free[: free.index(stop)]
    # The same prompt a third time: its full blocks came from the prefix cache.
    assert out.usage is not None and out.usage.prompt_tokens_details is not None
    cached = out.usage.prompt_tokens_details.cached_tokens
    assert cached == (out.usage.prompt_tokens - 1) // 16 * 16
