"""OpenAI-compatible API through the official ``openai`` client, over loopback.

A tiny random-weight Llama (byte tokenizer, chat template) exercises text, chat, sampling,
logprobs and usage; the mock backend (no weights) exercises limits, disconnects and errors
where only the plumbing matters.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from conftest import ServerFactory, ServerHandle, ServerStarter, wait_for
from iron_batch.backends.torch_backend import TorchBackend
from tiny_models import checkpoint

PROMPT = "The tiny model says"


@pytest.fixture(scope="module")
def tiny() -> Iterator[ServerHandle]:
    backend = TorchBackend.from_model(
        str(checkpoint("llama")), device="cpu", dtype="float32",
        total_kv_blocks=256, kv_block_size=4,
    )
    starter = ServerStarter()
    yield starter(
        backend,
        total_kv_blocks=backend.num_kv_blocks,
        kv_block_size=backend.kv_block_size,
        max_model_len=backend.max_model_len,
    )
    starter.close()


def client(srv: ServerHandle, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key=api_key, max_retries=0, timeout=60)


def aclient(srv: ServerHandle) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0,
                              timeout=60)


def tokenize(srv: ServerHandle, **body: Any) -> list[int]:
    response = httpx.post(f"{srv.url}/tokenize", json=body, timeout=10)
    assert response.status_code == 200, response.text
    return list(response.json()["tokens"])


# --- tiny model --------------------------------------------------------------------------


def test_models(tiny: ServerHandle) -> None:
    c = client(tiny)
    models = c.models.list().data
    assert [m.id for m in models] == ["llama"]
    assert c.models.retrieve("llama").id == "llama"
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("gpt-4")


def test_completion_usage_and_length(tiny: ServerHandle) -> None:
    out = client(tiny).completions.create(
        model="llama", prompt=PROMPT, max_tokens=12, temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert out.object == "text_completion" and out.model == "llama" and out.id
    assert out.created > 0
    (choice,) = out.choices
    assert choice.finish_reason == "length"
    assert isinstance(choice.text, str)
    assert out.usage is not None
    assert out.usage.prompt_tokens == len(tokenize(tiny, prompt=PROMPT))
    assert out.usage.completion_tokens == 12
    assert out.usage.total_tokens == out.usage.prompt_tokens + 12
    assert out.usage.prompt_tokens_details is not None
    assert out.usage.prompt_tokens_details.cached_tokens is not None


def test_prefix_cache_hits_are_reported(tiny: ServerHandle) -> None:
    prompt = "a shared prefix that spans several four-token KV blocks, then more"
    c = client(tiny)
    usages = []
    for _ in range(2):
        out = c.completions.create(model="llama", prompt=prompt, max_tokens=2, temperature=0)
        assert out.usage is not None and out.usage.prompt_tokens_details is not None
        usages.append(out.usage)
    cached = usages[1].prompt_tokens_details.cached_tokens  # type: ignore[union-attr]
    # Every full block but the one holding the last prompt token comes from the cache.
    n = usages[1].prompt_tokens
    assert cached == (n - 1) // 4 * 4
    assert cached > 0


def test_stream_equals_non_stream_for_the_same_seed(tiny: ServerHandle) -> None:
    c = client(tiny)
    kw: dict[str, Any] = dict(model="llama", prompt=PROMPT, max_tokens=16, temperature=0.9,
                              seed=1234)
    full = c.completions.create(**kw)
    chunks = list(c.completions.create(**kw, stream=True,
                                       stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.model_dump() == full.usage.model_dump()  # type: ignore[union-attr]
    text = "".join(ch.choices[0].text for ch in chunks[:-1])
    assert text == full.choices[0].text
    assert chunks[-2].choices[0].finish_reason == full.choices[0].finish_reason
    assert all(ch.usage is None for ch in chunks[:-1])


def test_chat_sync_and_async_stream_equal(tiny: ServerHandle) -> None:
    messages: list[Any] = [{"role": "system", "content": "Be brief."},
                           {"role": "user", "content": "Hi there"}]
    kw: dict[str, Any] = dict(model="llama", messages=messages, max_tokens=10,
                              temperature=0.7, seed=99)
    full = client(tiny).chat.completions.create(**kw)
    assert full.object == "chat.completion"
    assert full.choices[0].message.role == "assistant"
    assert full.usage is not None
    assert full.usage.prompt_tokens == len(tokenize(tiny, messages=messages))

    async def streamed() -> tuple[str, list[Any]]:
        ac = aclient(tiny)
        stream = await ac.chat.completions.create(**kw, stream=True)
        chunks = [chunk async for chunk in stream]
        await ac.close()
        return "".join(ch.choices[0].delta.content or "" for ch in chunks), chunks

    text, chunks = asyncio.run(streamed())
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason


def test_async_non_streaming_completion(tiny: ServerHandle) -> None:
    async def run() -> Any:
        ac = aclient(tiny)
        outs = await asyncio.gather(*(
            ac.completions.create(model="llama", prompt=PROMPT, max_tokens=5, temperature=0)
            for _ in range(3)
        ))
        await ac.close()
        return outs

    outs = asyncio.run(run())
    assert len({o.choices[0].text for o in outs}) == 1  # greedy: all the same


def test_n_choices_use_seed_plus_i(tiny: ServerHandle) -> None:
    c = client(tiny)
    kw: dict[str, Any] = dict(model="llama", prompt=PROMPT, max_tokens=12, temperature=1.0,
                              extra_body={"ignore_eos": True})
    both = c.completions.create(**kw, n=2, seed=5)
    assert [ch.index for ch in both.choices] == [0, 1]
    assert both.choices[0].text != both.choices[1].text
    assert both.usage is not None
    assert both.usage.completion_tokens == 24
    assert both.usage.prompt_tokens == len(tokenize(tiny, prompt=PROMPT))  # counted once
    second = c.completions.create(**kw, seed=6)
    assert second.choices[0].text == both.choices[1].text

    chat = c.chat.completions.create(
        model="llama", messages=[{"role": "user", "content": "x"}], n=2, max_tokens=4,
        temperature=0,
    )
    assert [ch.index for ch in chat.choices] == [0, 1]
    assert chat.choices[0].message.content == chat.choices[1].message.content


def test_stop_string(tiny: ServerHandle) -> None:
    c = client(tiny)
    kw: dict[str, Any] = dict(model="llama", prompt=PROMPT, max_tokens=24, temperature=0,
                              extra_body={"ignore_eos": True})
    text = c.completions.create(**kw).choices[0].text
    # Printable, non-overlapping stop strings taken from the greedy text itself.
    start = next(i for i in range(4, len(text) - 2) if text[i:i + 2].isprintable())
    stop = text[start:start + 2]
    out = c.completions.create(**kw, stop=[stop, "never-appears"])
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == text[: text.index(stop)]
    single = c.completions.create(**kw, stop=stop)
    assert single.choices[0].text == out.choices[0].text
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(**kw, stop=stop,
                                                                        stream=True))
    assert streamed == out.choices[0].text


def test_completion_logprobs_are_consistent(tiny: ServerHandle) -> None:
    out = client(tiny).completions.create(
        model="llama", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3,
        extra_body={"ignore_eos": True},
    )
    lp = out.choices[0].logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) <= 3
        # Greedy: the chosen token is the most likely one.
        assert chosen == pytest.approx(max(top.values()), abs=1e-5)
        assert chosen <= 0.0
    assert lp.text_offset is not None and lp.text_offset[0] == 0


def test_chat_logprobs_stream_and_not(tiny: ServerHandle) -> None:
    c = client(tiny)
    kw: dict[str, Any] = dict(model="llama", messages=[{"role": "user", "content": "hey"}],
                              max_tokens=5, temperature=0, logprobs=True, top_logprobs=2,
                              extra_body={"ignore_eos": True})
    out = c.chat.completions.create(**kw)
    content = out.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 5
    for item in content:
        assert len(item.top_logprobs) == 2
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob, abs=1e-5)
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert item.bytes == list(item.token.encode())
    streamed = [
        item
        for ch in c.chat.completions.create(**kw, stream=True)
        if ch.choices and ch.choices[0].logprobs and ch.choices[0].logprobs.content
        for item in ch.choices[0].logprobs.content
    ]
    assert [i.logprob for i in streamed] == pytest.approx([i.logprob for i in content])
    no_lp = c.chat.completions.create(model="llama", messages=kw["messages"], max_tokens=2)
    assert no_lp.choices[0].logprobs is None


def test_echo_penalties_and_sampling_knobs(tiny: ServerHandle) -> None:
    c = client(tiny)
    out = c.completions.create(model="llama", prompt=PROMPT, max_tokens=3, echo=True,
                               temperature=0)
    assert out.choices[0].text.startswith(PROMPT)
    out = c.completions.create(
        model="llama", prompt=[PROMPT, "Second"], max_tokens=4, temperature=0.8, top_p=1.0,
        presence_penalty=0.5, frequency_penalty=0.3, seed=3,
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.2},
    )
    assert [ch.index for ch in out.choices] == [0, 1]
    assert out.usage is not None
    assert out.usage.prompt_tokens == (len(tokenize(tiny, prompt=PROMPT))
                                       + len(tokenize(tiny, prompt="Second")))


def test_bad_requests_raise_typed_errors(tiny: ServerHandle) -> None:
    c = client(tiny)
    with pytest.raises(openai.NotFoundError) as not_found:
        c.completions.create(model="gpt-4", prompt="x")
    assert not_found.value.code == "model_not_found"
    cases: list[tuple[dict[str, Any], str]] = [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 0}, "n"),
        ({"logprobs": 50}, "logprobs"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"stop": 5}, "stop"),
        ({"seed": "x"}, "seed"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [1, 100000]}, "prompt"),
        ({"prompt": "x" * 600}, "prompt"),  # longer than the 512-token context
        ({"logit_bias": {"5": 10}}, "logit_bias"),
    ]
    for fields, param in cases:
        body = {"model": "llama", "prompt": "x", **fields}
        with pytest.raises(openai.BadRequestError) as bad:
            c.completions.create(**body)  # type: ignore[call-overload]
        error = bad.value.body
        assert isinstance(error, dict) and error["param"] == param, (fields, error)
        assert error["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model="llama", messages=[])
    with pytest.raises(openai.BadRequestError):
        robot: Any = [{"role": "robot", "content": "x"}]  # deliberately invalid
        c.chat.completions.create(model="llama", messages=robot)
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(
            model="llama", messages=[{"role": "user", "content": "x"}], top_logprobs=2
        )
    raw = httpx.post(f"{tiny.url}/v1/completions", content=b"{nope", timeout=10)
    assert raw.status_code == 400
    assert set(raw.json()["error"]) == {"message", "type", "param", "code"}
    # ... and the server keeps serving.
    assert c.completions.create(model="llama", prompt="x", max_tokens=1).choices


def test_tokenize_detokenize(tiny: ServerHandle) -> None:
    ids = tokenize(tiny, prompt="héllo")
    assert ids[0] == 1  # BOS from the tokenizer's post-processor
    assert tokenize(tiny, prompt="héllo", add_special_tokens=False) == ids[1:]
    response = httpx.post(f"{tiny.url}/detokenize", json={"tokens": ids}, timeout=10)
    assert response.json() == {"prompt": "héllo"}
    chat = tokenize(tiny, messages=[{"role": "user", "content": "hi"}])
    assert chat == tokenize(tiny, prompt="<|user|>hi</s><|assistant|>",
                            add_special_tokens=False)
    bad = httpx.post(f"{tiny.url}/detokenize", json={"tokens": [-1]}, timeout=10)
    assert bad.status_code == 400


def test_openapi_document_is_valid_and_complete(tiny: ServerHandle) -> None:
    from openapi_spec_validator import validate
    from starlette.routing import Route

    doc = httpx.get(f"{tiny.url}/openapi.json", timeout=10).json()
    validate(doc)
    app = tiny.server.config.app
    routes = {r.path.replace("{model:path}", "{model}") for r in app.routes  # type: ignore
              if isinstance(r, Route)}
    assert routes == set(doc["paths"])


# --- mock backend: limits, disconnects, auth ---------------------------------------------


def test_max_tokens_is_clamped_to_the_kv_pool(start_server: ServerFactory) -> None:
    srv = start_server(total_kv_blocks=8, kv_block_size=4)  # 32 tokens per sequence
    out = client(srv).completions.create(model="mock", prompt=list(range(1, 11)),
                                         max_tokens=10_000)
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None and out.usage.completion_tokens == 22
    # Chat-style default (no max_tokens) on completions is 16.
    out = client(srv).completions.create(model="mock", prompt=[1, 2, 3])
    assert out.usage is not None and out.usage.completion_tokens == 16
    with pytest.raises(openai.BadRequestError) as too_long:
        client(srv).completions.create(model="mock", prompt=list(range(1, 40)))
    assert too_long.value.code == "context_length_exceeded"


def test_api_key_everywhere_but_health(start_server: ServerFactory) -> None:
    srv = start_server(api_key="sekrit")
    with pytest.raises(openai.AuthenticationError):
        client(srv, "wrong").models.list()
    with pytest.raises(openai.AuthenticationError):
        client(srv, "wrong").completions.create(model="mock", prompt=[1, 2], max_tokens=1)
    ok = client(srv, "sekrit").completions.create(model="mock", prompt=[1, 2], max_tokens=2)
    assert ok.usage is not None and ok.usage.completion_tokens == 2
    for method, path in [("GET", "/v1/models"), ("POST", "/v1/completions"),
                         ("POST", "/v1/chat/completions"), ("POST", "/tokenize"),
                         ("POST", "/detokenize"), ("GET", "/openapi.json"),
                         ("GET", "/metrics"), ("POST", "/generate"),
                         ("POST", "/v1/responses"), ("GET", "/v1/responses/resp_x"),
                         ("DELETE", "/v1/responses/resp_x"), ("POST", "/v1/messages"),
                         ("POST", "/v1/messages/count_tokens")]:
        response = httpx.request(method, f"{srv.url}{path}", json={}, timeout=10)
        assert response.status_code == 401, path
    assert httpx.get(f"{srv.url}/health").status_code == 200
    doc = httpx.get(f"{srv.url}/openapi.json", headers={"authorization": "Bearer sekrit"})
    assert doc.status_code == 200
    # Anthropic's clients send the key as x-api-key; a wrong one is no better there.
    assert httpx.get(f"{srv.url}/v1/models", headers={"x-api-key": "sekrit"}).status_code == 200
    assert httpx.get(f"{srv.url}/v1/models", headers={"x-api-key": "nope"}).status_code == 401
    assert httpx.get(f"{srv.url}/v1/models", headers={
        "x-api-key": "sekrit", "authorization": "Bearer nope"}).status_code == 401


def test_full_server_is_503_with_retry_after(start_server: ServerFactory) -> None:
    srv = start_server(app_options={"max_waiting_requests": 0})
    response = httpx.post(f"{srv.url}/v1/completions",
                          json={"prompt": [1, 2, 3], "max_tokens": 2}, timeout=10)
    assert response.status_code == 503
    assert response.headers["retry-after"] == "1"
    assert response.json()["error"]["code"] == "server_overloaded"
    with pytest.raises(openai.InternalServerError) as exc:
        client(srv).completions.create(model="mock", prompt=[1, 2, 3], max_tokens=2)
    assert exc.value.status_code == 503


def _raw_post(srv: ServerHandle, path: str, body: dict[str, Any]) -> socket.socket:
    payload = json.dumps(body).encode()
    sock = socket.create_connection((srv.host, srv.port), timeout=10)
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n".encode()
        + b"Content-Length: %d\r\n\r\n" % len(payload)
        + payload
    )
    return sock


def test_dropped_non_streaming_request_frees_its_blocks(start_server: ServerFactory) -> None:
    srv = start_server(token_latency_us=1000)
    sock = _raw_post(srv, "/v1/completions",
                     {"prompt": list(range(1, 40)), "max_tokens": 50_000, "n": 2})
    m = wait_for(lambda: (m := srv.metrics())["running"] == 2
                 and m["kv_blocks_free"] < m["kv_blocks_total"] and m, what="admitted")
    sock.close()
    m = srv.wait_idle()
    assert m["kv_blocks_free"] == m["kv_blocks_total"]
    assert m["requests_aborted"] == 2
    assert m["requests_completed"] == 0


def test_dropped_stream_frees_its_blocks(start_server: ServerFactory) -> None:
    srv = start_server(token_latency_us=1000)
    seen = 0
    with client(srv).completions.create(model="mock", prompt=[5, 6, 7], max_tokens=50_000,
                                        stream=True) as chunks:
        for _ in chunks:
            seen += 1
            if seen == 5:
                break
    m = srv.wait_idle()
    assert m["requests_aborted"] == 1


def test_health_reports_a_stalled_engine(start_server: ServerFactory) -> None:
    srv = start_server()
    assert httpx.get(f"{srv.url}/health").json() == {"status": "ok"}
    engine = srv.engine
    wait_for(lambda: engine.idle, what="engine idle")
    # Simulate a loop stuck inside one step for minutes (the thread is asleep, untouched).
    engine.idle = False
    engine.heartbeat = time.monotonic() - 3600
    response = httpx.get(f"{srv.url}/health")
    assert response.status_code == 503 and response.json()["status"] == "engine stalled"
    engine.idle = True
    assert httpx.get(f"{srv.url}/health").status_code == 200
