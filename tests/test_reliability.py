"""The server on its worst day: hostile input, disconnect storms under preemption, and a
backend that fails on chosen steps. After each: no 5xx, the server still serves, and every
KV block is free again."""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import httpx
import numpy as np
import pytest
from conftest import ServerFactory, ServerHandle
from iron_batch.backends.mock import MockBackend

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
