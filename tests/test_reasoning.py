"""Reasoning output: a tiny Qwen3 checkpoint whose tokenizer knows ``<think>`` and
``</think>`` and whose chat template writes them (Qwen3's ``enable_thinking`` switch, and
an R1-style template that opens the block itself).

The random-weight model serves the template checks and a greedy run whose streamed and
whole splits must agree; exact outputs (tags split across tokens, a call after thinking, a
block the limit cuts) come from a scripted backend with the same tokenizer, through the
chat endpoint, the Responses API and the Messages API, with their own clients.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
import tiny_models
from conftest import ScriptedBackend, ServerHandle, ServerStarter
from iron_batch.backends.torch_backend import TorchBackend
from iron_batch.tokenizer import Tokenizer

QWEN3_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
#: DeepSeek-R1 distills: the generation prompt opens the thinking block.
R1_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>"
    "{{ m['content'].split('</think>')[-1] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|><think>\n{% endif %}"
)
ASK = [{"role": "user", "content": "What is the capital of France?"}]


def thinking_checkpoint(folder: Path, template: str) -> Path:
    """The tiny Qwen3 with ``<think>``/``</think>`` as added (not special) tokens and
    ``template``."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    if not folder.exists():
        shutil.copytree(tiny_models.checkpoint("qwen3"), folder)
        tok = HFTokenizer.from_file(str(folder / "tokenizer.json"))
        tok.add_tokens([AddedToken("<think>", special=False, normalized=False),
                        AddedToken("</think>", special=False, normalized=False)])
        tok.save(str(folder / "tokenizer.json"))
        config = json.loads((folder / "tokenizer_config.json").read_text())
        config["chat_template"] = template
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("thinking")
    return {"qwen3": thinking_checkpoint(root / "qwen3", QWEN3_TEMPLATE),
            "r1": thinking_checkpoint(root / "r1", R1_TEMPLATE)}


@pytest.fixture(scope="module")
def model_server(folders: dict[str, Path]) -> Iterator[ServerHandle]:
    backend = TorchBackend.from_model(str(folders["qwen3"]), device="cpu", dtype="float32",
                                      total_kv_blocks=64, kv_block_size=16)
    starter = ServerStarter()
    yield starter(backend, total_kv_blocks=backend.num_kv_blocks,
                  kv_block_size=backend.kv_block_size, max_model_len=backend.max_model_len)
    starter.close()


class Scripted:
    def __init__(self, folder: Path, **app_options: Any) -> None:
        self.backend = ScriptedBackend(Tokenizer.from_folder(folder))
        self.starter = ServerStarter()
        self.server = self.starter(self.backend, total_kv_blocks=256, app_options=app_options)
        self.openai = openai.OpenAI(base_url=f"{self.server.url}/v1", api_key="unused",
                                    max_retries=0)
        self.anthropic = anthropic.Anthropic(base_url=self.server.url, api_key="unused",
                                             max_retries=0)

    def ids(self, *pieces: str) -> list[int]:
        """Token ids of ``pieces`` encoded one by one (a tag cut between pieces becomes
        byte tokens, not its own token)."""
        tok = self.backend.tokenizer
        return [t for p in pieces for t in tok.encode(p, add_special_tokens=False)]


@pytest.fixture(scope="module")
def qwen3(folders: dict[str, Path]) -> Iterator[Scripted]:
    s = Scripted(folders["qwen3"])
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
    assert getattr(message, "reasoning", None) == whole[0]  # the newer clients' name
    thought, text, reason = "", "", None
    streamed_calls: dict[int, list[str]] = {}
    for chunk in client.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            thought += getattr(ch.delta, "reasoning_content", None) or ""
            text += ch.delta.content or ""
            reason = ch.finish_reason or reason
            for d in ch.delta.tool_calls or []:
                entry = streamed_calls.setdefault(d.index, ["", ""])
                entry[0] += d.function.name or ""
                entry[1] += d.function.arguments or ""
    streamed = (thought or None, text or None,
                [(n, json.loads(a)) for _, (n, a) in sorted(streamed_calls.items())], reason)
    return whole, streamed


HERMES = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object",
                                          "properties": {"city": {"type": "string"}}}}}


@pytest.mark.parametrize(
    ("pieces", "expected"),
    [
        (["<think>\nThe capital is Paris.\n</think>\n\nParis."],
         ("The capital is Paris.", "Paris.", [], "stop")),
        # Both tags cut between tokens, as byte tokens.
        (["<thi", "nk>\nHmm, ", "France.</", "think", ">\n\nParis."],
         ("Hmm, France.", "Paris.", [], "stop")),
        (["Paris."], (None, "Paris.", [], "stop")),
        (["<thinking is fun"], (None, "<thinking is fun", [], "stop")),
        (["<think>I never stop thinking"], ("I never stop thinking", None, [], "stop")),
    ],
)
def test_chat_splits_reasoning_from_the_answer_streamed_or_not(
    qwen3: Scripted, pieces: list[str], expected: tuple[Any, ...],
) -> None:
    qwen3.backend.script = qwen3.ids(*pieces)
    whole, streamed = chat_split(qwen3.openai)
    assert whole == expected
    assert streamed == whole


def test_a_tool_call_after_thinking_is_still_a_call(qwen3: Scripted) -> None:
    qwen3.backend.script = qwen3.ids("<think>I should look it up.</think>\n", HERMES)
    whole, streamed = chat_split(qwen3.openai, tools=[WEATHER])
    assert whole == ("I should look it up.", None, [("get_weather", {"city": "Paris"})],
                     "tool_calls")
    assert streamed == whole


def test_thinking_cut_by_the_limit_is_all_reasoning(qwen3: Scripted) -> None:
    qwen3.backend.script = qwen3.ids("<think>", "a b c d e f g h i j k l m n o p")
    whole, streamed = chat_split(qwen3.openai, max_tokens=6)
    assert whole[0] and whole[1] is None and whole[3] == "length"
    assert streamed == whole


def test_responses_api_gives_a_reasoning_item(qwen3: Scripted) -> None:
    qwen3.backend.script = qwen3.ids("<think>\nThe capital is Paris.\n</think>\n\nParis.")
    out = qwen3.openai.responses.create(model="mock", input="Capital of France?")
    kinds = [item.type for item in out.output]
    assert kinds == ["reasoning", "message"]
    assert out.output[0].content[0].text == "The capital is Paris."  # type: ignore[union-attr,index]
    assert out.output_text == "Paris."
    with qwen3.openai.responses.stream(model="mock", input="Capital of France?") as stream:
        events = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.reasoning_text.delta" in events
    assert events.index("response.reasoning_text.delta") < events.index(
        "response.output_text.delta")
    assert [i.type for i in final.output] == kinds
    assert final.output[0].content[0].text == "The capital is Paris."  # type: ignore[union-attr,index]
    assert final.output_text == "Paris."


def test_messages_api_gives_a_thinking_block(qwen3: Scripted) -> None:
    qwen3.backend.script = qwen3.ids("<think>\nThe capital is Paris.\n</think>\n\nParis.")
    kw: dict[str, Any] = dict(model="mock", max_tokens=64, messages=ASK)
    out = qwen3.anthropic.messages.create(**kw)
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None))
            for b in out.content] == [("thinking", "The capital is Paris."), ("text", "Paris.")]
    with qwen3.anthropic.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == "The capital is Paris."  # type: ignore[union-attr]
    assert final.content[1].text == "Paris."  # type: ignore[union-attr]


def test_a_template_that_opens_the_block_leaves_only_the_close_to_the_model(
    folders: dict[str, Path],
) -> None:
    s = Scripted(folders["r1"])
    try:
        s.backend.script = s.ids("Hmm, France.\n</think>\n\nParis.")
        whole, streamed = chat_split(s.openai)
        assert whole == ("Hmm, France.", "Paris.", [], "stop")
        assert streamed == whole
    finally:
        s.starter.close()


def test_the_none_setting_keeps_the_tags_in_the_content(folders: dict[str, Path]) -> None:
    s = Scripted(folders["qwen3"], reasoning_parser="none")
    try:
        s.backend.script = s.ids("<think>Hmm.</think>Paris.")
        whole, streamed = chat_split(s.openai)
        assert whole == (None, "<think>Hmm.</think>Paris.", [], "stop")
        assert streamed == whole
    finally:
        s.starter.close()


def test_enable_thinking_reaches_the_template(model_server: ServerHandle) -> None:
    def rendered(**kw: Any) -> str:
        tokens = httpx.post(f"{model_server.url}/tokenize",
                            json={"messages": ASK, **kw}).json()["tokens"]
        return str(httpx.post(f"{model_server.url}/detokenize",
                              json={"tokens": tokens}).json()["prompt"])

    assert rendered().endswith("<|assistant|>")
    off = rendered(chat_template_kwargs={"enable_thinking": False})
    assert off.endswith("<|assistant|><think>\n\n</think>\n\n")
    bad = httpx.post(f"{model_server.url}/v1/chat/completions",
                     json={"messages": ASK, "chat_template_kwargs": {"messages": []}})
    assert bad.status_code == 400


def test_the_real_model_splits_alike_streamed_or_not(model_server: ServerHandle) -> None:
    client = openai.OpenAI(base_url=f"{model_server.url}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    for thinking in (True, False):
        whole, streamed = chat_split(
            client, model=model, max_tokens=24, temperature=0,
            extra_body={"chat_template_kwargs": {"enable_thinking": thinking}})
        assert streamed == whole
        # Random weights write no think tags: everything is the answer.
        assert whole[0] is None and whole[1]
    model_server.wait_idle()
