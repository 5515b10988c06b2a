"""The HTTP server over loopback: streaming, bad input, disconnects, metrics, concurrency."""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import httpx
import pytest
from conftest import ServerFactory, ServerHandle, TextMockBackend, wait_for
from prometheus_client.parser import text_string_to_metric_families


def check_stream(lines: list[dict[str, Any]], n: int, reason: str = "length") -> None:
    """``n`` token lines, indices 0..n-1 in order, only the last one done."""
    assert [line["token_index"] for line in lines] == list(range(n))
    assert [line["done"] for line in lines] == [False] * (n - 1) + [True]
    assert all(isinstance(line["token_id"], int) for line in lines)
    assert lines[-1]["finish_reason"] == reason


def test_readme_generate_and_metrics(start_server: ServerFactory) -> None:
    srv = start_server()
    with httpx.stream(
        "POST",
        f"{srv.url}/generate",
        headers={"content-type": "application/json"},
        content=b'{"prompt_tokens": 128, "max_new_tokens": 64}',
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in response.iter_lines() if line]
    check_stream(lines, 64)
    assert set(lines[0]) == {"token_index", "token_id", "done"}

    m = srv.wait_idle()
    for key in (
        "elapsed_secs",
        "tokens_generated",
        "requests_completed",
        "tokens_per_sec",
        "ttft_p50_ms",
        "ttft_p99_ms",
        "kv_blocks_total",
        "kv_blocks_free",
        "running",
        "waiting",
        "preemptions",
        "prefix_cache_hit_rate",
    ):
        assert key in m, key
    assert m["tokens_generated"] == 64
    assert m["requests_completed"] == 1
    assert m["kv_blocks_total"] == 4096
    assert m["ttft_p50_ms"] > 0
    assert httpx.get(f"{srv.url}/health").json() == {"status": "ok"}


def test_max_new_tokens_zero_sends_one_done_line(start_server: ServerFactory) -> None:
    srv = start_server()
    status, lines = srv.generate({"prompt_tokens": 16, "max_new_tokens": 0})
    assert status == 200
    assert len(lines) == 1
    assert lines[0]["done"] is True
    assert lines[0]["token_id"] is None
    assert lines[0]["finish_reason"] == "length"
    srv.wait_idle()


def test_prompt_token_ids_are_deterministic(start_server: ServerFactory) -> None:
    srv = start_server()
    body = {"prompt_token_ids": [5, 6, 7, 8, 9], "max_new_tokens": 12, "temperature": 0}
    _, first = srv.generate(body)
    _, second = srv.generate(body)
    check_stream(first, 12)
    assert [x["token_id"] for x in first] == [x["token_id"] for x in second]
    _, other = srv.generate({"prompt_token_ids": [5, 6, 7, 8, 10], "max_new_tokens": 12})
    assert [x["token_id"] for x in first] != [x["token_id"] for x in other]


BAD_BODIES: list[tuple[str, bytes, str]] = [
    ("malformed json", b'{"prompt_tokens": 12,', "malformed JSON"),
    ("not utf-8", b"\xff\xfe", "UTF-8"),
    ("not an object", b"[1, 2]", "JSON object"),
    ("unknown field", b'{"prompt_tokens": 4, "max_tokens": 3}', "max_tokens"),
    ("no prompt", b'{"max_new_tokens": 3}', "prompt"),
    ("two prompts", b'{"prompt_tokens": 4, "prompt_token_ids": [1]}', "exactly one"),
    ("bool prompt_tokens", b'{"prompt_tokens": true}', "prompt_tokens"),
    ("float prompt_tokens", b'{"prompt_tokens": 4.0}', "prompt_tokens"),
    ("string prompt_tokens", b'{"prompt_tokens": "4"}', "prompt_tokens"),
    ("zero prompt_tokens", b'{"prompt_tokens": 0}', "prompt_tokens"),
    ("absurd prompt_tokens", b'{"prompt_tokens": 100000000000000000000000000}', "prompt_tokens"),
    ("negative max_new_tokens", b'{"prompt_tokens": 4, "max_new_tokens": -1}', "max_new_tokens"),
    ("float max_new_tokens", b'{"prompt_tokens": 4, "max_new_tokens": 2.5}', "max_new_tokens"),
    ("bool max_new_tokens", b'{"prompt_tokens": 4, "max_new_tokens": false}', "max_new_tokens"),
    ("null max_new_tokens", b'{"prompt_tokens": 4, "max_new_tokens": null}', "max_new_tokens"),
    ("absurd max_new_tokens", b'{"prompt_tokens": 4, "max_new_tokens": 99999999999}',
     "max_new_tokens"),
    ("ids not a list", b'{"prompt_token_ids": 5}', "prompt_token_ids"),
    ("empty ids", b'{"prompt_token_ids": []}', "prompt_token_ids"),
    ("string in ids", b'{"prompt_token_ids": [1, "2"]}', "prompt_token_ids"),
    ("bool in ids", b'{"prompt_token_ids": [1, true]}', "prompt_token_ids"),
    ("negative id", b'{"prompt_token_ids": [1, -2]}', "prompt_token_ids"),
    ("id outside vocab", b'{"prompt_token_ids": [1, 32000]}', "vocabulary"),
    ("text prompt without tokenizer", b'{"prompt": "hello"}', "tokenizer"),
    ("stop without tokenizer", b'{"prompt_tokens": 4, "stop": ["x"]}', "tokenizer"),
    ("temperature string", b'{"prompt_tokens": 4, "temperature": "hot"}', "temperature"),
    ("temperature NaN", b'{"prompt_tokens": 4, "temperature": NaN}', "NaN"),
    ("temperature negative", b'{"prompt_tokens": 4, "temperature": -1}', "temperature"),
    ("top_p zero", b'{"prompt_tokens": 4, "top_p": 0}', "top_p"),
    ("top_k float", b'{"prompt_tokens": 4, "top_k": 1.5}', "top_k"),
    ("seed negative", b'{"prompt_tokens": 4, "seed": -5}', "seed"),
    ("ignore_eos not bool", b'{"prompt_tokens": 4, "ignore_eos": 1}', "ignore_eos"),
    ("stop_token_ids bad", b'{"prompt_tokens": 4, "stop_token_ids": [1.0]}', "stop_token_ids"),
    ("request_id not string", b'{"prompt_tokens": 4, "request_id": 7}', "request_id"),
    ("prompt beyond the KV pool", b'{"prompt_tokens": 70000, "max_new_tokens": 1}', "KV"),
    ("output beyond the KV pool", b'{"prompt_tokens": 8, "max_new_tokens": 70000}', "KV"),
]


@pytest.mark.parametrize(("name", "body", "needle"), BAD_BODIES, ids=[b[0] for b in BAD_BODIES])
def test_bad_input_is_a_4xx_naming_the_problem(
    shared_server: ServerHandle, name: str, body: bytes, needle: str
) -> None:
    response = httpx.post(f"{shared_server.url}/generate", content=body, timeout=10)
    assert 400 <= response.status_code < 500, (response.status_code, response.text)
    error = response.json()["error"]
    assert needle.lower() in error["message"].lower(), error
    # ... and the server keeps serving.
    status, lines = shared_server.generate({"prompt_tokens": 4, "max_new_tokens": 2})
    assert status == 200
    check_stream(lines, 2)


def test_wrong_method_and_path(shared_server: ServerHandle) -> None:
    assert httpx.get(f"{shared_server.url}/generate").status_code == 405
    assert httpx.get(f"{shared_server.url}/nope").status_code == 404


def test_duplicate_live_request_id_is_409(start_server: ServerFactory) -> None:
    srv = start_server(token_latency_us=2000)
    body = {"prompt_tokens": 8, "max_new_tokens": 10_000, "request_id": "dup"}
    with httpx.stream("POST", f"{srv.url}/generate", json=body, timeout=30) as first:
        assert first.status_code == 200
        # Keep the iterator referenced: a collected one closes the response.
        lines_iter = first.iter_lines()
        next(lines_iter)  # the first request is live now
        status, lines = srv.generate(body)
        assert status == 409
        assert "dup" in lines[0]["error"]["message"]
        next(lines_iter)  # ... and still streaming
    # Closing the first stream aborted it; the id is free again.
    srv.wait_idle()
    status, lines = srv.generate({**body, "max_new_tokens": 3})
    assert status == 200
    check_stream(lines, 3)


def _raw_post(srv: ServerHandle, body: dict[str, Any]) -> socket.socket:
    payload = json.dumps(body).encode()
    sock = socket.create_connection((srv.host, srv.port), timeout=10)
    sock.sendall(
        b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + b"Content-Length: %d\r\n\r\n" % len(payload)
        + payload
    )
    return sock


def test_disconnect_mid_stream_frees_blocks(start_server: ServerFactory) -> None:
    srv = start_server(token_latency_us=1000)
    sock = _raw_post(srv, {"prompt_tokens": 64, "max_new_tokens": 50_000})
    received = b""
    while received.count(b'"done":false') < 3:  # a few tokens are through
        chunk = sock.recv(65536)
        assert chunk, received
        received += chunk
    assert srv.metrics()["running"] == 1
    sock.close()
    m = srv.wait_idle()
    assert m["requests_aborted"] == 1
    assert m["requests_completed"] == 0


def test_disconnect_before_first_token_frees_blocks(start_server: ServerFactory) -> None:
    # 400 prompt tokens at 5 ms each, chunked 32 per step: the first token is 2 s away.
    srv = start_server(
        prefill_token_latency_us=5000, enable_prefix_caching=False, max_batch_tokens=32
    )
    sock = _raw_post(srv, {"prompt_tokens": 400, "max_new_tokens": 5})
    wait_for(lambda: srv.metrics()["kv_blocks_free"] < 4096, what="request admitted")
    sock.close()
    m = srv.wait_idle()
    assert m["requests_aborted"] == 1
    assert m["tokens_generated"] == 0


async def _stream_all(
    url: str, bodies: list[dict[str, Any]], limit: int
) -> list[tuple[int, list[dict[str, Any]]]]:
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:

        async def one(body: dict[str, Any]) -> tuple[int, list[dict[str, Any]]]:
            async with client.stream("POST", f"{url}/generate", json=body) as response:
                lines = [json.loads(x) async for x in response.aiter_lines() if x]
                return response.status_code, lines

        return await asyncio.gather(*(one(b) for b in bodies))


def test_200_concurrent_streams(start_server: ServerFactory) -> None:
    srv = start_server(token_latency_us=200)
    bodies = [{"prompt_tokens": 32 + i % 7, "max_new_tokens": 10 + i % 13} for i in range(200)]
    results = asyncio.run(_stream_all(srv.url, bodies, 200))
    for body, (status, lines) in zip(bodies, results, strict=True):
        assert status == 200
        check_stream(lines, body["max_new_tokens"])
    m = srv.wait_idle()
    assert m["requests_completed"] == 200
    assert m["tokens_generated"] == sum(b["max_new_tokens"] for b in bodies)


def test_tiny_kv_pool_preempts_but_delivers_every_token_once(
    start_server: ServerFactory,
) -> None:
    # 12 requests of up to 12 + 40 tokens; the pool holds 96 tokens: preemption is certain.
    bodies = [
        {"prompt_token_ids": [(7 * i + j) % 100 + 1 for j in range(12)], "max_new_tokens": 40}
        for i in range(12)
    ]
    tiny = start_server(total_kv_blocks=24, kv_block_size=4, max_running_seqs=12)
    big = start_server()
    tiny_results = asyncio.run(_stream_all(tiny.url, bodies, 12))
    big_results = asyncio.run(_stream_all(big.url, bodies, 12))
    for (ts, tlines), (bs, blines) in zip(tiny_results, big_results, strict=True):
        assert ts == bs == 200
        check_stream(tlines, 40)
        assert [x["token_id"] for x in tlines] == [x["token_id"] for x in blines]
    m = tiny.wait_idle()
    assert m["preemptions"] > 0
    assert m["tokens_generated"] == 12 * 40


def test_prometheus_text_parses(start_server: ServerFactory) -> None:
    srv = start_server()
    for _ in range(3):
        srv.generate({"prompt_tokens": 8, "max_new_tokens": 5})
    response = httpx.get(f"{srv.url}/metrics", headers={"accept": "text/plain"})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(response.text)}
    assert families["iron_batch_tokens_generated"].samples[0].value == 15
    ttft = families["iron_batch_time_to_first_token_seconds"]
    assert ttft.type == "histogram"
    count = [s for s in ttft.samples if s.name.endswith("_count")][0]
    assert count.value == 3
    itl = families["iron_batch_inter_token_latency_seconds"]
    assert [s for s in itl.samples if s.name.endswith("_count")][0].value == 12
    assert families["iron_batch_kv_blocks_free"].samples[0].value == 4096

    om = httpx.get(
        f"{srv.url}/metrics",
        headers={"accept": "application/openmetrics-text; version=1.0.0"},
    )
    assert om.headers["content-type"].startswith("application/openmetrics-text")
    assert om.text.rstrip().endswith("# EOF")


def test_api_key(start_server: ServerFactory) -> None:
    srv = start_server(api_key="sekrit")
    body = {"prompt_tokens": 4, "max_new_tokens": 2}
    assert srv.generate(body)[0] == 401
    assert srv.generate(body, headers={"authorization": "Bearer wrong"})[0] == 401
    status, lines = srv.generate(body, headers={"authorization": "Bearer sekrit"})
    assert status == 200
    check_stream(lines, 2)
    assert httpx.get(f"{srv.url}/metrics").status_code == 401
    assert httpx.get(f"{srv.url}/health").status_code == 200
    # One error body on every endpoint, whatever the front end.
    bodies = [
        httpx.post(f"{srv.url}/generate", json=body, timeout=10).json(),
        httpx.get(f"{srv.url}/metrics", timeout=10).json(),
        httpx.post(f"{srv.url}/v1/completions", json={"prompt": [1]}, timeout=10).json(),
        httpx.get(f"{srv.url}/v1/models", timeout=10).json(),
    ]
    for error in bodies:
        assert error == {"error": {"message": bodies[0]["error"]["message"],
                                   "type": "authentication_error", "param": None,
                                   "code": "invalid_api_key"}}


def test_generate_and_v1_errors_have_the_same_shape(shared_server: ServerHandle) -> None:
    bad_seed = [
        httpx.post(f"{shared_server.url}/generate", json={"prompt_tokens": 4, "seed": -1},
                   timeout=10),
        httpx.post(f"{shared_server.url}/v1/completions", json={"prompt": [1], "seed": -1},
                   timeout=10),
    ]
    for response in bad_seed:
        assert response.status_code == 400
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert (error["type"], error["param"]) == ("invalid_request_error", "seed")
    assert bad_seed[0].json()["error"]["message"] == bad_seed[1].json()["error"]["message"]


def test_text_prompt_and_stop_string(start_server: ServerFactory) -> None:
    backend = TextMockBackend()
    srv = start_server(backend)
    status, lines = srv.generate({"prompt": "hello", "max_new_tokens": 30})
    assert status == 200
    check_stream(lines, 30)
    text = "".join(line["text"] for line in lines)
    assert text == "".join(chr(97 + line["token_id"]) for line in lines)

    stop = text[10:12]
    status, lines = srv.generate({"prompt": "hello", "max_new_tokens": 30, "stop": [stop]})
    assert status == 200
    assert lines[-1]["done"] and lines[-1]["finish_reason"] == "stop"
    stopped = "".join(line["text"] for line in lines)
    assert stopped == text[: text.index(stop)]
    assert len(lines) <= 12
    srv.wait_idle()

    bad = httpx.post(f"{srv.url}/generate", json={"prompt": "Hello!"})
    assert bad.status_code == 400
    assert "tokenize" in bad.json()["error"]["message"]
