"""The server on its worst day: hostile input, disconnect storms under preemption, and a
backend that fails on chosen steps. After each: no 5xx, the server still serves, and every
KV block is free again."""

from __future__ import annotations

import asyncio
import json
import random
import signal
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
from conftest import (
    CharTokenizer,
    ScriptedBackend,
    ServerFactory,
    ServerHandle,
    ServerStarter,
    TextMockBackend,
    cli_process,
    wait_for,
)
from iron_batch.backends.base import FatalBackendError
from iron_batch.backends.mock import MockBackend
from iron_batch.server.admission import ServerLimits

# ---------------------------------------------------------------- raw streaming client


async def _open_stream(host: str, port: int, body: dict[str, Any]) -> tuple[Any, Any]:
    reader, writer = await asyncio.open_connection(host, port)
    payload = json.dumps(body).encode()
    writer.write(
        b"POST /generate HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(payload), payload)
    )
    await writer.drain()
    return reader, writer


async def _read_lines(reader: Any, limit: int | None = None) -> tuple[int, list[dict[str, Any]]]:
    """Status and NDJSON lines of a chunked response; stops early after ``limit`` lines."""
    status_line = await reader.readline()
    status = int(status_line.split()[1])
    while (await reader.readline()) not in (b"\r\n", b""):
        pass
    lines: list[dict[str, Any]] = []
    buf = b""
    while limit is None or len(lines) < limit:
        size_line = await reader.readline()
        if not size_line:
            break
        size = int(size_line.strip() or b"0", 16)
        if size == 0:
            break
        chunk = await reader.readexactly(size + 2)
        buf += chunk[:-2]
        *complete, buf = buf.split(b"\n")
        lines.extend(json.loads(x) for x in complete if x)
    return status, lines


# ---------------------------------------------------------------- disconnect storm


def test_disconnect_storm_under_preemption(start_server: ServerFactory) -> None:
    """1,000 streams, a random 30% cut before the first token, mid-stream or during a long
    prefill, on a pool small enough to preempt: every uncut stream is complete and in order
    and equals the same request run alone; every block is free at the end."""
    srv = start_server(total_kv_blocks=96, kv_block_size=4, max_batch_tokens=256,
                       max_running_seqs=64, token_latency_us=50, prefill_token_latency_us=2)
    rng = random.Random(7)
    plans = []
    for i in range(1000):
        long_prefill = rng.random() < 0.1
        length = rng.randrange(100, 180) if long_prefill else rng.randrange(1, 24)
        prompt = [rng.randrange(1, 30000) for _ in range(length)]
        cut = None
        if rng.random() < 0.3:
            cut = "prefill" if long_prefill else rng.choice(["before", "mid"])
        plans.append((i, prompt, rng.randrange(1, 24), cut))

    async def one(i: int, prompt: list[int], n: int, cut: str | None) -> Any:
        body = {"prompt_token_ids": prompt, "max_new_tokens": n, "request_id": f"s{i}"}
        reader, writer = await _open_stream(srv.host, srv.port, body)
        try:
            if cut in ("before", "prefill"):
                return None  # closed right after sending: before any token arrives
            if cut == "mid":
                await _read_lines(reader, limit=rng.randrange(1, n + 1))
                return None
            return await _read_lines(reader)
        finally:
            writer.close()

    async def storm() -> list[Any]:
        sem = asyncio.Semaphore(200)

        async def bounded(plan: tuple[int, list[int], int, str | None]) -> Any:
            async with sem:
                return await one(*plan)

        return await asyncio.gather(*(bounded(p) for p in plans))

    results = asyncio.run(storm())
    m = srv.wait_idle(30)
    assert m["preemptions"] > 0, "the pool should have been small enough to preempt"

    # Reference: each uncut request alone on a roomy server gives the same tokens.
    ref = start_server(total_kv_blocks=4096, kv_block_size=4, token_latency_us=0)
    checked = 0
    for (i, prompt, n, cut), result in zip(plans, results, strict=True):
        if cut is not None:
            continue
        status, lines = result
        assert status == 200
        assert [x["token_index"] for x in lines] == list(range(n)), f"stream s{i} incomplete"
        assert lines[-1]["done"] and lines[-1]["finish_reason"] == "length"
        if checked < 40:
            _, alone = ref.generate({"prompt_token_ids": prompt, "max_new_tokens": n})
            assert [x["token_id"] for x in alone] == [x["token_id"] for x in lines]
            checked += 1
    assert checked == 40


# ---------------------------------------------------------------- faults in the backend


class FaultyBackend(MockBackend):
    """Raises on chosen execute calls, like a backend that hits a bad kernel launch."""

    def __init__(self, fail_on: set[int]) -> None:
        super().__init__(token_latency_us=100, prefill_token_latency_us=0)
        self.calls = 0
        self.fail_on = fail_on

    def execute(self, batch: Any) -> np.ndarray:
        self.calls += 1
        if self.calls in self.fail_on:
            raise RuntimeError(f"injected fault on call {self.calls}")
        return super().execute(batch)


def test_backend_faults_fail_that_steps_requests_and_the_rest_complete(
    start_server: ServerFactory,
) -> None:
    backend = FaultyBackend(fail_on={5})
    srv = start_server(backend=backend, total_kv_blocks=256, kv_block_size=4)

    async def run() -> list[tuple[int, list[dict[str, Any]]]]:
        async def one(i: int) -> tuple[int, list[dict[str, Any]]]:
            if i >= 4:
                # Later arrivals miss the failing step.
                await _wait_until(lambda: backend.calls >= 5)
            reader, writer = await _open_stream(
                srv.host, srv.port, {"prompt_token_ids": [i + 1, 2, 3], "max_new_tokens": 12})
            try:
                return await _read_lines(reader)
            finally:
                writer.close()

        return await asyncio.gather(*(one(i) for i in range(8)))

    results = asyncio.run(run())
    failed = [lines for _, lines in results if lines[-1]["finish_reason"] == "error"]
    ok = [lines for _, lines in results if lines[-1]["finish_reason"] == "length"]
    assert len(failed) >= 1 and len(ok) >= 4
    for lines in failed:
        assert lines[-1]["done"] and "injected fault" in lines[-1]["error"]
    for lines in ok:
        assert [x["token_index"] for x in lines] == list(range(12))
    srv.wait_idle()
    status, lines = srv.generate({"prompt_tokens": 4, "max_new_tokens": 3})
    assert status == 200 and len(lines) == 3


async def _wait_until(predicate: Any, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.001)


# ---------------------------------------------------------------- hostile input

_HOSTILE: list[tuple[str, bytes, dict[str, str]]] = [
    ("empty body", b"", {}),
    ("not json", b"{nope", {}),
    ("json array", b"[1, 2, 3]", {}),
    ("json string", b'"hello"', {}),
    ("null", b"null", {}),
    ("invalid utf-8", b'{"prompt_tokens": 4, "stop": ["\xff\xfe"]}', {}),
    ("nan", b'{"prompt_tokens": 4, "temperature": NaN}', {}),
    ("infinity", b'{"prompt_tokens": 4, "top_p": Infinity}', {}),
    ("huge int", b'{"prompt_tokens": 4, "max_new_tokens": 99999999999999999999999}', {}),
    ("huge float", b'{"prompt_tokens": 4, "temperature": 1e308}', {}),
    ("negative tokens", b'{"prompt_tokens": -4}', {}),
    ("bool as int", b'{"prompt_tokens": true}', {}),
    ("float as int", b'{"prompt_tokens": 4.0}', {}),
    ("empty token list", b'{"prompt_token_ids": []}', {}),
    ("negative token id", b'{"prompt_token_ids": [1, -1]}', {}),
    ("token id past vocab", b'{"prompt_token_ids": [1, 4294967296]}', {}),
    ("nested list", b'{"prompt_token_ids": [[1]]}', {}),
    ("two prompts", b'{"prompt_tokens": 4, "prompt_token_ids": [1]}', {}),
    ("no prompt", b'{"max_new_tokens": 4}', {}),
    ("unknown field", b'{"prompt_tokens": 4, "bogus": 1}', {}),
    ("text prompt without tokenizer", b'{"prompt": "hello"}', {}),
    ("never fits the pool", b'{"prompt_tokens": 100000, "max_new_tokens": 1}', {}),
    ("stop not a list", b'{"prompt_tokens": 4, "stop": 5}', {}),
    ("huge stop list", json.dumps({"prompt_tokens": 4, "stop": ["x"] * 1000}).encode(), {}),
    ("deep nesting", b'{"prompt_tokens": ' + b"[" * 5000 + b"]" * 5000 + b"}", {}),
    ("request id too long", json.dumps({"prompt_tokens": 4, "request_id": "x" * 5000}).encode(),
     {}),
    ("form content type", b"prompt_tokens=4",
     {"content-type": "application/x-www-form-urlencoded"}),
    ("oversized body", b'{"prompt_token_ids": [' + b"1," * (9 << 20) + b"1]}", {}),
]


@pytest.mark.parametrize(("name", "body", "headers"), _HOSTILE, ids=[h[0] for h in _HOSTILE])
def test_hostile_generate_bodies_get_a_4xx_and_change_nothing(
    shared_server: ServerHandle, name: str, body: bytes, headers: dict[str, str]
) -> None:
    response = httpx.post(f"{shared_server.url}/generate", content=body,
                          headers={"content-type": "application/json", **headers}, timeout=30)
    assert 400 <= response.status_code < 500, (name, response.status_code, response.text[:200])
    err = response.json()["error"]
    assert err["message"], name
    m = shared_server.metrics()
    assert m["kv_blocks_free"] == m["kv_blocks_total"] and m["running"] == 0
    status, lines = shared_server.generate({"prompt_tokens": 3, "max_new_tokens": 2})
    assert status == 200 and lines[-1]["done"]


@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE"])
def test_wrong_methods_are_4xx(shared_server: ServerHandle, method: str) -> None:
    response = httpx.request(method, f"{shared_server.url}/generate", timeout=10)
    assert 400 <= response.status_code < 500


# ================================================================ every endpoint, faults, limits

_FUZZ_BODY_LIMIT = 1 << 20


class ChatCharTokenizer(CharTokenizer):
    """CharTokenizer with a trivial chat template (the messages' contents, concatenated)."""

    chat_template = "concat"

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True) -> str:
        return "".join(m["content"] for m in messages)


class SwitchBackend(TextMockBackend):
    """Text mock whose execute fails while ``fail`` (RuntimeError) or ``fatal`` is set."""

    def __init__(self, token_latency_us: float = 20.0) -> None:
        super().__init__(token_latency_us)
        self.tokenizer = ChatCharTokenizer()  # type: ignore[assignment]
        self.fail = False
        self.fatal = False

    def execute(self, batch: Any) -> np.ndarray:
        if self.fatal:
            raise FatalBackendError("injected: device lost")
        if self.fail:
            raise RuntimeError("injected fault")
        return super().execute(batch)


@pytest.fixture(scope="module")
def text_server() -> Iterator[ServerHandle]:
    starter = ServerStarter()
    yield starter(SwitchBackend(), total_kv_blocks=256, kv_block_size=4,
                  app_options={"limits": ServerLimits(max_body_bytes=_FUZZ_BODY_LIMIT)})
    starter.close()


def _j(body: Any) -> bytes:
    return json.dumps(body).encode()


_MSG = [{"role": "user", "content": "abc"}]
_COMMON_HOSTILE: list[tuple[str, bytes, dict[str, str]]] = [
    ("empty body", b"", {}),
    ("not json", b"{nope", {}),
    ("json array", b"[1, 2, 3]", {}),
    ("json string", b'"hello"', {}),
    ("null", b"null", {}),
    ("invalid utf-8", b'{"prompt": "\xff\xfe", "tokens": [1]}', {}),
    ("nan", b'{"prompt": [1], "messages": [], "tokens": [1], "temperature": NaN}', {}),
    ("deep nesting", b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", {}),
    ("form content type", b"prompt=abc", {"content-type": "application/x-www-form-urlencoded"}),
    ("text content type", b"abc", {"content-type": "text/plain"}),
    ("utf-16 body", '{"prompt": "abc"}'.encode("utf-16"), {}),
    ("wrong model", _j({"model": "gpt-9", "prompt": "abc", "messages": _MSG, "tokens": [1]}), {}),
    ("oversized body", b'{"prompt": "' + b"a" * (_FUZZ_BODY_LIMIT + 10) + b'"}', {}),
]
_ENDPOINT_HOSTILE: dict[str, list[tuple[str, bytes, dict[str, str]]]] = {
    "/v1/completions": [
        ("no prompt", _j({}), {}),
        ("huge max_tokens", _j({"prompt": [1], "max_tokens": 10**30}), {}),
        ("negative max_tokens", _j({"prompt": [1], "max_tokens": -1}), {}),
        ("infinite top_p", b'{"prompt": [1], "top_p": 1e999}', {}),
        ("string n", _j({"prompt": [1], "n": "2"}), {}),
        ("float n", _j({"prompt": [1], "n": 2.0}), {}),
        ("huge n", _j({"prompt": [1], "n": 10**6}), {}),
        ("empty prompt", _j({"prompt": ""}), {}),
        ("empty prompt list", _j({"prompt": []}), {}),
        ("unknown token id", _j({"prompt": [1, 26]}), {}),
        ("negative token id", _j({"prompt": [-1]}), {}),
        ("token id past int64", _j({"prompt": [2**64]}), {}),
        ("bool token", _j({"prompt": [True]}), {}),
        ("prompt nested too deep", _j({"prompt": [[[1]]]}), {}),
        ("untokenizable prompt", _j({"prompt": "ABC!"}), {}),
        ("huge prompt", _j({"prompt": [1] * 200_000}), {}),
        ("too many prompts", _j({"prompt": ["a"] * 100}), {}),
        ("stream not bool", _j({"prompt": [1], "stream": "yes"}), {}),
        ("stream_options without stream", _j({"prompt": [1],
                                              "stream_options": {"include_usage": True}}), {}),
        ("huge logprobs", _j({"prompt": [1], "logprobs": 1000}), {}),
        ("huge seed", _j({"prompt": [1], "seed": 2**70}), {}),
        ("stop not a string", _j({"prompt": [1], "stop": 5}), {}),
        ("suffix", _j({"prompt": [1], "suffix": "x"}), {}),
    ],
    "/v1/chat/completions": [
        ("no messages", _j({}), {}),
        ("messages a string", _j({"messages": "hi"}), {}),
        ("empty messages", _j({"messages": []}), {}),
        ("message not an object", _j({"messages": [1]}), {}),
        ("bad role", _j({"messages": [{"role": "wizard", "content": "a"}]}), {}),
        ("content a number", _j({"messages": [{"role": "user", "content": 5}]}), {}),
        ("image part", _j({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
         {}),
        ("untokenizable content", _j({"messages": [{"role": "user", "content": "ÄÖ"}]}), {}),
        ("empty rendering", _j({"messages": [{"role": "user", "content": ""}]}), {}),
        ("tools", _j({"messages": _MSG, "tools": [{"type": "function"}]}), {}),
        ("negative max_completion_tokens", _j({"messages": _MSG, "max_completion_tokens": -5}),
         {}),
        ("top_logprobs without logprobs", _j({"messages": _MSG, "top_logprobs": 2}), {}),
        ("huge temperature", _j({"messages": _MSG, "temperature": 1e308}), {}),
        ("huge prompt", _j({"messages": [{"role": "user", "content": "a" * 200_000}]}), {}),
    ],
    "/v1/responses": [
        ("no input", _j({}), {}),
        ("input a number", _j({"input": 5}), {}),
        ("empty input", _j({"input": []}), {}),
        ("item not an object", _j({"input": [1]}), {}),
        ("bad role", _j({"input": [{"role": "wizard", "content": "a"}]}), {}),
        ("unknown item type", _j({"input": [{"type": "computer_call"}]}), {}),
        ("image part", _j({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}),
         {}),
        ("call without arguments", _j({"input": [{"type": "function_call", "call_id": "c",
                                                  "name": "f"}]}), {}),
        ("output without call_id", _j({"input": [{"type": "function_call_output",
                                                  "output": "x"}]}), {}),
        ("untokenizable input", _j({"input": "ÄÖ"}), {}),
        ("empty rendering", _j({"input": ""}), {}),
        ("hosted tool", _j({"input": "abc", "tools": [{"type": "file_search"}]}), {}),
        ("named unknown tool", _j({"input": "abc", "tool_choice": {"type": "function",
                                                                   "name": "f"}}), {}),
        ("bad text format", _j({"input": "abc", "text": {"format": {"type": "xml"}}}), {}),
        ("text not an object", _j({"input": "abc", "text": "json"}), {}),
        ("zero max_output_tokens", _j({"input": "abc", "max_output_tokens": 0}), {}),
        ("float max_output_tokens", _j({"input": "abc", "max_output_tokens": 2.5}), {}),
        ("unknown previous response", _j({"input": "abc", "previous_response_id": "resp_x"}),
         {}),
        ("previous id a number", _j({"input": "abc", "previous_response_id": 5}), {}),
        ("store a string", _j({"input": "abc", "store": "yes"}), {}),
        ("instructions a list", _j({"input": "abc", "instructions": ["a"]}), {}),
        ("background", _j({"input": "abc", "background": True}), {}),
        ("huge temperature", _j({"input": "abc", "temperature": 1e308}), {}),
        ("huge input", _j({"input": "a" * 200_000}), {}),
    ],
    "/v1/messages": [
        ("no max_tokens", _j({"messages": _MSG}), {}),
        ("no messages", _j({"max_tokens": 3}), {}),
        ("bool max_tokens", _j({"messages": _MSG, "max_tokens": True}), {}),
        ("messages a string", _j({"messages": "hi", "max_tokens": 3}), {}),
        ("system role in messages", _j({"messages": [{"role": "system", "content": "a"}],
                                        "max_tokens": 3}), {}),
        ("block not an object", _j({"messages": [{"role": "user", "content": [1]}],
                                    "max_tokens": 3}), {}),
        ("image block", _j({"messages": [{"role": "user", "content": [{"type": "image"}]}],
                            "max_tokens": 3}), {}),
        ("tool_use without input", _j({"messages": [{"role": "assistant", "content": [
            {"type": "tool_use", "id": "t", "name": "f"}]}], "max_tokens": 3}), {}),
        ("tool_result without id", _j({"messages": [{"role": "user", "content": [
            {"type": "tool_result", "content": "x"}]}], "max_tokens": 3}), {}),
        ("system a number", _j({"messages": _MSG, "system": 5, "max_tokens": 3}), {}),
        ("server tool", _j({"messages": _MSG, "max_tokens": 3,
                            "tools": [{"type": "bash_20250124", "name": "bash"}]}), {}),
        ("tool without schema", _j({"messages": _MSG, "max_tokens": 3,
                                    "tools": [{"name": "f"}]}), {}),
        ("tool_choice a string", _j({"messages": _MSG, "max_tokens": 3, "tool_choice": "any"}),
         {}),
        ("stop_sequences a string", _j({"messages": _MSG, "max_tokens": 3,
                                        "stop_sequences": "a"}), {}),
        ("empty stop sequence", _j({"messages": _MSG, "max_tokens": 3, "stop_sequences": [""]}),
         {}),
        ("bad thinking", _j({"messages": _MSG, "max_tokens": 3, "thinking": True}), {}),
        ("negative top_k", _j({"messages": _MSG, "max_tokens": 3, "top_k": -4}), {}),
        ("untokenizable content", _j({"messages": [{"role": "user", "content": "ÄÖ"}],
                                      "max_tokens": 3}), {}),
        ("huge prompt", _j({"messages": [{"role": "user", "content": "a" * 200_000}],
                            "max_tokens": 3}), {}),
    ],
    "/v1/messages/count_tokens": [
        ("no messages", _j({}), {}),
        ("messages empty", _j({"messages": []}), {}),
        ("bad role", _j({"messages": [{"role": "tool", "content": "a"}]}), {}),
        ("bad tool", _j({"messages": _MSG, "tools": [{"name": "f", "input_schema": 5}]}), {}),
    ],
    "/v1/embeddings": [
        ("no input", _j({}), {}),
        ("empty string", _j({"input": ""}), {}),
        ("input a number", _j({"input": 5}), {}),
        ("unknown token id", _j({"input": [1, 26]}), {}),
        ("bad encoding", _j({"input": "abc", "encoding_format": "int4"}), {}),
        ("zero dimensions", _j({"input": "abc", "dimensions": 0}), {}),
        ("too many inputs", _j({"input": ["abc"] * 1000}), {}),
    ],
    "/tokenize": [
        ("neither prompt nor messages", _j({}), {}),
        ("both prompt and messages", _j({"prompt": "a", "messages": _MSG}), {}),
        ("prompt a number", _j({"prompt": 5}), {}),
        ("untokenizable prompt", _j({"prompt": "ÄÖ"}), {}),
        ("add_special_tokens a string", _j({"prompt": "a", "add_special_tokens": "no"}), {}),
        ("bad message", _j({"messages": [{"role": "x"}]}), {}),
    ],
    "/detokenize": [
        ("no tokens", _j({}), {}),
        ("tokens a string", _j({"tokens": "abc"}), {}),
        ("unknown token id", _j({"tokens": [26]}), {}),
        ("negative token id", _j({"tokens": [-1]}), {}),
        ("huge token id", _j({"tokens": [2**70]}), {}),
        ("float token", _j({"tokens": [1.0]}), {}),
        ("bool token", _j({"tokens": [True]}), {}),
    ],
}
_ALL_HOSTILE = [
    (path, *case) for path, cases in _ENDPOINT_HOSTILE.items()
    for case in [*_COMMON_HOSTILE, *cases]
]


@pytest.mark.parametrize(("path", "name", "body", "headers"), _ALL_HOSTILE,
                         ids=[f"{c[0]}:{c[1]}" for c in _ALL_HOSTILE])
def test_hostile_bodies_on_every_endpoint_get_a_4xx(
    text_server: ServerHandle, path: str, name: str, body: bytes, headers: dict[str, str]
) -> None:
    response = httpx.post(f"{text_server.url}{path}", content=body,
                          headers={"content-type": "application/json", **headers}, timeout=30)
    assert 400 <= response.status_code < 500, (name, response.status_code, response.text[:300])
    err = response.json()["error"]
    assert err["message"] and err["type"], name
    m = text_server.metrics()
    assert m["kv_blocks_free"] == m["kv_blocks_total"] and m["running"] == 0


# The mock backend computes no embeddings (tests/test_embeddings.py serves them).
@pytest.mark.parametrize("path", [p for p in _ENDPOINT_HOSTILE if p != "/v1/embeddings"])
def test_every_endpoint_still_serves_after_hostile_input(
    text_server: ServerHandle, path: str
) -> None:
    bodies = {
        "/v1/completions": {"prompt": "abc", "max_tokens": 3},
        "/v1/chat/completions": {"messages": _MSG, "max_tokens": 3},
        "/v1/responses": {"input": "abc", "max_output_tokens": 3},
        "/v1/messages": {"messages": _MSG, "max_tokens": 3},
        "/v1/messages/count_tokens": {"messages": _MSG},
        "/tokenize": {"prompt": "abc"},
        "/detokenize": {"tokens": [0, 1, 2]},
    }
    response = httpx.post(f"{text_server.url}{path}", json=bodies[path], timeout=30)
    assert response.status_code == 200, response.text
    for method in ("GET", "PUT", "DELETE"):
        assert 400 <= httpx.request(method, f"{text_server.url}{path}").status_code < 500


# ---------------------------------------------------------------- faults on the OpenAI paths


def _sse_payloads(text: str) -> list[Any]:
    out: list[Any] = []
    for line in text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_backend_fault_on_openai_paths(start_server: ServerFactory, path: str,
                                       stream: bool) -> None:
    backend = SwitchBackend(token_latency_us=100)
    srv = start_server(backend=backend, total_kv_blocks=256, kv_block_size=4)
    body: dict[str, Any] = {"max_tokens": 8, "stream": stream, "n": 2}
    body.update({"prompt": "abc"} if path == "/v1/completions" else {"messages": _MSG})
    backend.fail = True
    response = httpx.post(f"{srv.url}{path}", json=body, timeout=30)
    if stream:
        assert response.status_code == 200
        events = _sse_payloads(response.text)
        assert events[-1] == "[DONE]"
        err = events[-2]["error"]
        assert err["type"] == "server_error" and "injected fault" in err["message"]
    else:
        assert response.status_code == 500, response.text
        err = response.json()["error"]
        assert err["type"] == "server_error" and "injected fault" in err["message"]
    m = srv.wait_idle()
    # SSE ends at the first failed choice and aborts the other if it has not failed yet.
    assert m["requests_failed"] >= 1 and m["requests_failed"] + m["requests_aborted"] == 2
    backend.fail = False
    ok = httpx.post(f"{srv.url}{path}", json=body, timeout=30)
    assert ok.status_code == 200
    if stream:
        events = _sse_payloads(ok.text)
        assert events[-1] == "[DONE]"
        reasons = [c["finish_reason"] for e in events[:-1] for c in e["choices"]]
        assert reasons.count("length") == 2
    else:
        assert [c["finish_reason"] for c in ok.json()["choices"]] == ["length", "length"]
    srv.wait_idle()


def _named_events(text: str) -> list[dict[str, Any]]:
    """The data of each ``event: NAME`` / ``data: {...}`` server-sent event."""
    return [json.loads(line[len("data: "):]) for line in text.splitlines()
            if line.startswith("data: ")]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("path", ["/v1/responses", "/v1/messages"])
def test_backend_fault_on_the_agent_apis(start_server: ServerFactory, path: str,
                                         stream: bool) -> None:
    backend = SwitchBackend(token_latency_us=100)
    srv = start_server(backend=backend, total_kv_blocks=256, kv_block_size=4)
    body: dict[str, Any] = ({"input": "abc", "max_output_tokens": 8} if path == "/v1/responses"
                            else {"messages": _MSG, "max_tokens": 8})
    body["stream"] = stream
    backend.fail = True
    response = httpx.post(f"{srv.url}{path}", json=body, timeout=30)
    if stream:
        assert response.status_code == 200
        last = _named_events(response.text)[-1]
        assert last["type"] == "error"
        message = last["message"] if path == "/v1/responses" else last["error"]["message"]
        assert "injected fault" in message
    else:
        assert response.status_code == 500, response.text
        err = response.json()["error"]
        assert "injected fault" in err["message"]
        assert err["type"] == ("server_error" if path == "/v1/responses" else "api_error")
    assert srv.wait_idle()["requests_failed"] == 1
    backend.fail = False
    ok = httpx.post(f"{srv.url}{path}", json=body, timeout=30)
    assert ok.status_code == 200
    srv.wait_idle()


async def _open_raw(host: str, port: int, path: str, body: dict[str, Any]) -> tuple[Any, Any]:
    reader, writer = await asyncio.open_connection(host, port)
    payload = json.dumps(body).encode()
    writer.write(
        f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n".encode()
        + b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(payload), payload)
    )
    await writer.drain()
    return reader, writer


async def _read_head(reader: Any) -> int:
    status = int((await reader.readline()).split()[1])
    while (await reader.readline()) not in (b"\r\n", b""):
        pass
    return status


async def _read_chunks(reader: Any, until: bytes | None = None) -> bytes:
    """Chunked body after the head: everything, or up to the first chunk containing
    ``until``."""
    body = b""
    while True:
        size_line = await reader.readline()
        if not size_line:
            return body
        size = int(size_line.strip() or b"0", 16)
        if size == 0:
            return body
        body += (await reader.readexactly(size + 2))[:-2]
        if until is not None and until in body:
            return body


def test_fatal_backend_fault_fails_everything_and_health(start_server: ServerFactory) -> None:
    backend = SwitchBackend(token_latency_us=200)
    srv = start_server(backend=backend, total_kv_blocks=1024, kv_block_size=4)

    async def run() -> list[bytes]:
        opened = [
            await _open_raw(srv.host, srv.port, "/generate",
                            {"prompt_token_ids": [1, 2, 3], "max_new_tokens": 3000}),
            await _open_raw(srv.host, srv.port, "/v1/completions",
                            {"prompt": "abc", "max_tokens": 3000, "stream": True}),
        ]
        heads = []
        for reader, _ in opened:
            assert await _read_head(reader) == 200
            heads.append(await _read_chunks(reader, until=b"\n"))
        backend.fatal = True
        try:
            return [head + await _read_chunks(reader) for head, (reader, _) in
                    zip(heads, opened, strict=True)]
        finally:
            for _, writer in opened:
                writer.close()

    ndjson, sse = asyncio.run(run())
    last = json.loads(ndjson.splitlines()[-1])
    assert last["done"] and last["finish_reason"] == "error"
    assert "device lost" in last["error"]
    events = _sse_payloads(sse.decode())
    assert events[-1] == "[DONE]" and "device lost" in events[-2]["error"]["message"]
    health = httpx.get(f"{srv.url}/health", timeout=10)
    assert health.status_code == 503 and health.json()["status"] == "engine failed"
    wait_for(lambda: not srv.engine.running, what="engine thread stopped")
    for path, body in [("/generate", {"prompt_tokens": 3}),
                       ("/v1/completions", {"prompt": "abc", "max_tokens": 2})]:
        response = httpx.post(f"{srv.url}{path}", json=body, timeout=10)
        assert response.status_code == 503, response.text
        assert response.headers["retry-after"] == "1"
    m = srv.metrics()
    assert m["kv_blocks_free"] == m["kv_blocks_total"] and m["requests_failed"] == 2


def test_consecutive_failed_steps_are_fatal(start_server: ServerFactory) -> None:
    backend = SwitchBackend(token_latency_us=100)
    srv = start_server(backend=backend, total_kv_blocks=256, kv_block_size=4,
                       engine_options={"max_consecutive_failures": 3})
    backend.fail = True
    for i in range(3):
        assert httpx.get(f"{srv.url}/health").status_code == 200
        status, lines = srv.generate({"prompt_token_ids": [1, 2], "max_new_tokens": 4})
        assert status == 200 and lines[-1]["finish_reason"] == "error", (i, lines)
    health = wait_for(lambda: (r := httpx.get(f"{srv.url}/health")).status_code == 503 and r,
                      what="/health failing")
    assert "3 failed steps in a row" in health.json()["error"]
    status, body = srv.generate({"prompt_tokens": 3})
    assert status == 503 and body[0]["error"]["code"] == "engine_failed"


# ---------------------------------------------------------------- limits and backpressure


def test_limits_on_generate_and_openai(start_server: ServerFactory) -> None:
    limits = ServerLimits(max_body_bytes=4096, max_prompt_tokens=50, max_new_tokens=20)
    srv = start_server(SwitchBackend(), total_kv_blocks=256, kv_block_size=4,
                       app_options={"limits": limits})
    big = {"prompt_token_ids": [1] * 3000}
    for path, body in [("/generate", big), ("/v1/completions", {"prompt": [1] * 3000})]:
        response = httpx.post(f"{srv.url}{path}", json=body, timeout=10)
        assert response.status_code == 413, (path, response.text)
    status, body = srv.generate({"prompt_token_ids": [1] * 51})
    assert status == 400 and "at most 50" in body[0]["error"]["message"]
    status, body = srv.generate({"prompt_tokens": 4, "max_new_tokens": 21})
    assert status == 400 and "max_new_tokens" in body[0]["error"]["message"]
    status, lines = srv.generate({"prompt_token_ids": [1] * 50, "max_new_tokens": 20})
    assert status == 200 and len(lines) == 20
    v1 = f"{srv.url}/v1/completions"
    response = httpx.post(v1, json={"prompt": [1] * 51}, timeout=10)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "context_length_exceeded"
    response = httpx.post(v1, json={"prompt": [1], "max_tokens": 21}, timeout=10)
    assert response.status_code == 400 and response.json()["error"]["param"] == "max_tokens"
    # Chat-style "no max_tokens" is clamped to the limit, not to the KV pool.
    response = httpx.post(f"{srv.url}/v1/chat/completions", json={"messages": _MSG}, timeout=10)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 20
    srv.wait_idle()


def test_full_queue_is_503_on_generate_too(start_server: ServerFactory) -> None:
    srv = start_server(app_options={"max_waiting_requests": 0})
    response = httpx.post(f"{srv.url}/generate", json={"prompt_tokens": 3}, timeout=10)
    assert response.status_code == 503 and response.headers["retry-after"] == "1"
    assert response.json()["error"]["code"] == "server_overloaded"


def test_waiting_tokens_limit_refuses_new_work_and_keeps_accepted_work(
    start_server: ServerFactory,
) -> None:
    srv = start_server(total_kv_blocks=1024, kv_block_size=4, max_running_seqs=1,
                       token_latency_us=1000,
                       app_options={"limits": ServerLimits(max_waiting_tokens=15)})

    async def run() -> list[bytes]:
        first = await _open_raw(srv.host, srv.port, "/generate",
                                {"prompt_token_ids": [1] * 10, "max_new_tokens": 2000})
        assert await _read_head(first[0]) == 200
        head = await _read_chunks(first[0], until=b"\n")  # running: its prompt no longer waits
        second = await _open_raw(srv.host, srv.port, "/generate",
                                 {"prompt_token_ids": [2] * 10, "max_new_tokens": 5})
        await _wait_until(lambda: srv.engine.waiting_prompt_tokens == 10)
        for path, body in [("/generate", {"prompt_token_ids": [3] * 10}),
                           ("/v1/completions", {"prompt": [3] * 10})]:
            async with httpx.AsyncClient() as c:
                response = await c.post(f"{srv.url}{path}", json=body, timeout=10)
            assert response.status_code == 503, response.text
            assert response.headers["retry-after"] == "1"
        small = {"prompt_token_ids": [4] * 5, "max_new_tokens": 1}
        third = await _open_raw(srv.host, srv.port, "/generate", small)  # 10 + 5 fits
        out = [head + await _read_chunks(first[0])]
        first[1].close()
        for reader, writer in (second, third):
            assert await _read_head(reader) == 200
            out.append(await _read_chunks(reader))
            writer.close()
        return out

    bodies = asyncio.run(run())
    for body, n in zip(bodies, (2000, 5, 1), strict=True):
        lines = [json.loads(x) for x in body.splitlines()]
        assert lines[-1]["finish_reason"] == "length" and lines[-1]["token_index"] == n - 1
    srv.wait_idle()
    assert srv.engine.waiting_prompt_tokens == 0


# ---------------------------------------------------------------- slow readers


@pytest.mark.parametrize("path", ["/generate", "/v1/completions"])
def test_slow_reader_is_aborted_and_others_complete(start_server: ServerFactory,
                                                     path: str) -> None:
    # The bound is in engine steps a reader may lag: 1,000 steps of 100 us is 0.1 s, far
    # more than a reading client ever lags, far less than a client that stopped reading.
    srv = start_server(total_kv_blocks=1 << 17, kv_block_size=16, token_latency_us=100,
                       engine_options={"max_stream_buffer_events": 1000})
    body = ({"prompt_token_ids": [1, 2, 3], "max_new_tokens": 1_000_000} if path == "/generate"
            else {"prompt": [1, 2, 3], "max_tokens": 1_000_000, "stream": True})
    payload = json.dumps(body).encode()
    # Small socket buffers on both ends (accepted sockets inherit the listener's): without
    # them the kernel absorbs megabytes before the server's writes block.
    for listener in srv.server.servers[0].sockets:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)
    slow = socket.socket()
    slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    slow.connect((srv.host, srv.port))
    try:
        slow.sendall(
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n".encode()
            + b"Content-Length: %d\r\n\r\n" % len(payload) + payload
        )
        # Never read: the server's socket buffers fill, its writes block, the stream's
        # buffer fills, and the engine aborts the request.
        status, lines = srv.generate({"prompt_token_ids": [5, 6], "max_new_tokens": 5000})
        assert status == 200 and len(lines) == 5000 and lines[-1]["finish_reason"] == "length"
        m = wait_for(lambda: (m := srv.metrics())["requests_aborted"] == 1 and m, timeout=60,
                     what="the slow reader's request aborted")
        assert m["running"] == 0
        srv.wait_idle()
    finally:
        slow.close()
    status, lines = srv.generate({"prompt_tokens": 3, "max_new_tokens": 2})
    assert status == 200 and lines[-1]["done"]


# ---------------------------------------------------------------- disconnects on the agent APIs


_AGENT_BODIES = {
    "/v1/responses": {"input": "hi", "max_output_tokens": 4000},
    "/v1/messages": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4000},
}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("path", list(_AGENT_BODIES))
def test_a_client_that_leaves_aborts_its_request(start_server: ServerFactory, path: str,
                                                 stream: bool) -> None:
    backend = ScriptedBackend()
    backend.script = "word " * 3000
    backend.token_latency_s = 0.001
    srv = start_server(backend, total_kv_blocks=1024)
    payload = json.dumps({**_AGENT_BODIES[path], "stream": stream}).encode()
    sock = socket.create_connection((srv.host, srv.port))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 .encode() + b"Content-Length: %d\r\n\r\n" % len(payload) + payload)
    if stream:
        received = b""
        while received.count(b"delta") < 3:  # a few tokens are through
            chunk = sock.recv(65536)
            assert chunk, received
            received += chunk
    else:
        wait_for(lambda: srv.metrics()["running"] == 1, what="request running")
    sock.close()
    m = srv.wait_idle()
    assert m["requests_aborted"] == 1 and m["requests_completed"] == 0


# ---------------------------------------------------------------- schemathesis


def test_schemathesis_finds_no_server_error(start_server: ServerFactory) -> None:
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st
    from schemathesis import GenerationMode
    from schemathesis.checks import not_a_server_error

    srv = start_server(SwitchBackend(token_latency_us=0), total_kv_blocks=512, kv_block_size=4,
                       app_options={"limits": ServerLimits(max_new_tokens=32)})
    schema = schemathesis.openapi.from_url(f"{srv.url}/openapi.json")
    strategy = st.one_of(schema.as_strategy(GenerationMode.POSITIVE),
                         schema.as_strategy(GenerationMode.NEGATIVE))
    calls = 0

    @settings(max_examples=400, deadline=None, database=None, derandomize=True,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def fuzz(case: Any) -> None:
        nonlocal calls
        calls += 1
        response = case.call(base_url=srv.url, timeout=30)
        case.validate_response(response, checks=[not_a_server_error])

    fuzz()
    assert calls >= 100
    srv.wait_idle(30)
    status, lines = srv.generate({"prompt_tokens": 3, "max_new_tokens": 2})
    assert status == 200 and lines[-1]["done"]
    assert httpx.get(f"{srv.url}/health").status_code == 200


# ---------------------------------------------------------------- the CLI process: fatal, SIGTERM

_FATAL_BOOT = """
import sys
from iron_batch.backends import mock
from iron_batch.backends.base import FatalBackendError
execute = mock.MockBackend.execute
def failing(self, batch):
    if self.steps >= 20:
        raise FatalBackendError("injected: device lost")
    return execute(self, batch)
mock.MockBackend.execute = failing
from iron_batch.server.cli import main
main(sys.argv[1:])
"""


def test_cli_exits_non_zero_on_a_fatal_backend_fault() -> None:
    with cli_process("--mock-token-latency-us", "1000", boot=_FATAL_BOOT) as (proc, port):
        response = httpx.post(f"http://127.0.0.1:{port}/generate",
                              json={"prompt_tokens": 4, "max_new_tokens": 1000}, timeout=30)
        lines = [json.loads(x) for x in response.text.splitlines()]
        assert lines[-1]["finish_reason"] == "error" and "device lost" in lines[-1]["error"]
        assert proc.wait(30) == 1
        assert proc.stdout is not None and "fatal engine fault" in proc.stdout.read()


def test_sigterm_drains_then_aborts_and_exits_zero() -> None:
    with cli_process("--mock-token-latency-us", "2000", "--drain-timeout", "3") as (proc, port):
        url = f"http://127.0.0.1:{port}"
        keep_alive = httpx.Client(timeout=10)
        assert keep_alive.get(f"{url}/health").status_code == 200

        async def run() -> tuple[list[bytes], bytes]:
            plans = [("/generate", {"prompt_tokens": 4, "max_new_tokens": 200}),
                     ("/generate", {"prompt_tokens": 4, "max_new_tokens": 60_000}),
                     ("/v1/completions", {"prompt": [1, 2], "max_tokens": 200, "stream": True}),
                     ("/v1/completions", {"prompt": [1, 2], "max_tokens": 60_000,
                                          "stream": True})]
            opened = [await _open_raw("127.0.0.1", port, path, body) for path, body in plans]
            heads = []
            for reader, _ in opened:
                assert await _read_head(reader) == 200
                heads.append(await _read_chunks(reader, until=b"\n"))
            proc.send_signal(signal.SIGTERM)
            try:
                bodies = [head + await _read_chunks(reader)
                          for head, (reader, _) in zip(heads, opened, strict=True)]
            finally:
                for _, writer in opened:
                    writer.close()
            return bodies, b""

        bodies, _ = asyncio.run(run())
        short, long, short_sse, long_sse = bodies
        assert json.loads(short.splitlines()[-1])["finish_reason"] == "length"
        assert len(short.splitlines()) == 200
        last = json.loads(long.splitlines()[-1])
        assert last["done"] and last["finish_reason"] == "abort"
        for body, reason in ((short_sse, "length"), (long_sse, "abort")):
            events = _sse_payloads(body.decode())
            assert events[-1] == "[DONE]"
            assert events[-2]["choices"][0]["finish_reason"] == reason
        # Draining or gone: no new request is served.
        try:
            status = keep_alive.get(f"{url}/health").status_code
        except httpx.HTTPError:
            status = None
        assert status != 200
        keep_alive.close()
        assert proc.wait(30) == 0
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/health", timeout=2)
