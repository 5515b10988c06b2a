"""``python -m iron_batch.server`` as a subprocess: flags, help, errors, the README example."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest
from conftest import cli_process

SERVER = [sys.executable, "-m", "iron_batch.server"]


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*SERVER, *args], capture_output=True, text=True, timeout=60)


def test_help_documents_every_flag() -> None:
    result = run_cli("--help")
    assert result.returncode == 0
    for flag in (
        "--addr",
        "--total-kv-blocks",
        "--kv-block-size",
        "--max-batch-tokens",
        "--max-running-seqs",
        "--mock-token-latency-us",
        "--mock-prefill-token-latency-us",
        "--backend",
        "--backend-url",
        "--model",
        "--device",
        "--dtype",
        "--api-key",
        "--no-ui",
        "--overlap-depth",
        "--no-overlap",
    ):
        assert flag in result.stdout, flag
    for default in ("0.0.0.0:8080", "4096", "16", "8192", "256", "200"):
        assert default in result.stdout, default
    assert "whatever the batch" in result.stdout  # the mock latency model is explained


def test_overlap_flags_reach_the_engine() -> None:
    from iron_batch.server.cli import build_engine, build_parser

    parser = build_parser()
    # The default follows the backend: the mock runs a step when it is submitted (none in
    # flight); the remote backend's default is checked against a worker in its own tests.
    for argv, depth in (([], 0), (["--overlap-depth", "1"], 1), (["--no-overlap"], 0),
                        (["--overlap-depth", "2"], 2)):
        engine = build_engine(parser.parse_args(argv), parser)
        assert engine.overlap_depth == depth, argv


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--total-kv-blocks", "-1"], "positive integer"),
        (["--kv-block-size", "zero"], "positive integer"),
        (["--max-batch-tokens", "0"], "positive integer"),
        (["--mock-token-latency-us", "-5"], ">= 0"),
        (["--addr", "nonsense"], "HOST:PORT"),
        (["--addr", "127.0.0.1:99999"], "port"),
        (["--backend", "gpu"], "invalid choice"),
        (["--backend", "real"], "--backend-url"),
        (["--backend", "remote"], "--backend-url"),
        (["--backend", "remote", "--backend-url", "tcp://127.0.0.1:1"], "cannot use worker"),
        (["--backend", "real", "--backend-url", "tcp://127.0.0.1:1"], "cannot use worker"),
        (["--backend", "torch"], "--model"),
        (["--model", "/tmp/x"], "--backend torch"),
        (["--overlap-depth", "9"], "invalid choice"),
        (["--num-speculative-tokens", "3"], "needs --speculative-method"),
        (["--speculative-method", "ngram"], "needs the torch backend"),
        (["--speculative-method", "eagle"], "invalid choice"),
        (["--speculative-method", "draft"], "--speculative-method draft needs "
         "--speculative-model"),
        (["--speculative-model", "/tmp/x"], "--speculative-model needs --speculative-method "
         "draft"),
    ],
)
def test_bad_flags_exit_with_a_clear_message(args: list[str], needle: str) -> None:
    result = run_cli(*args)
    assert result.returncode != 0
    assert needle in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_a_port_in_use_exits_with_one_line_and_no_hang() -> None:
    # uvicorn runs on a thread of its own beside the engine's loop on the main thread: when
    # it cannot listen, the loop must end too and the process say why.
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_cli("--addr", f"127.0.0.1:{port}", "--no-ui")
    assert result.returncode == 1
    assert f"error: cannot serve on 127.0.0.1:{port}" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


@pytest.fixture
def cli_server() -> Iterator[str]:
    with cli_process("--mock-token-latency-us", "100") as (_, port):
        yield f"http://127.0.0.1:{port}"


def test_readme_examples_against_the_cli_server(cli_server: str) -> None:
    response = httpx.post(
        f"{cli_server}/generate",
        headers={"content-type": "application/json"},
        content=b'{"prompt_tokens": 128, "max_new_tokens": 64}',
        timeout=30,
    )
    assert response.status_code == 200
    lines = [json.loads(x) for x in response.text.splitlines()]
    assert [x["token_index"] for x in lines] == list(range(64))
    assert [x["done"] for x in lines] == [False] * 63 + [True]

    zero = httpx.post(f"{cli_server}/generate", json={"prompt_tokens": 8, "max_new_tokens": 0})
    assert [json.loads(x)["done"] for x in zero.text.splitlines()] == [True]

    metrics = httpx.get(f"{cli_server}/metrics").json()
    assert metrics["tokens_generated"] == 64
    assert metrics["requests_completed"] == 2
    for key in ("elapsed_secs", "tokens_per_sec", "ttft_p50_ms", "ttft_p99_ms"):
        assert key in metrics
