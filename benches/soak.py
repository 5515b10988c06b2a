"""Soak: many requests at high concurrency against a real server process, with clients
disconnecting at random points, on a KV pool small enough to force preemption.

    python benches/soak.py                       # 20,000 requests, 256 at a time
    python benches/soak.py --requests 2000 --concurrency 64 --json

Starts ``python -m iron_batch.server`` (mock backend) on a free loopback port, drives it with
raw HTTP/1.1 over asyncio (NDJSON /generate and SSE /v1/completions), and reports: requests
completed / disconnected on purpose / failed, p99 time to first token per 10% slice of the
run (by request start), the server's RSS at start and end, and its KV blocks free at the end
(all of them, or something leaked). Exit status 1 when anything failed or leaked.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from typing import Any


@dataclass
class Result:
    start: float
    ttft: float | None = None
    outcome: str = "failed"  # completed | disconnected | failed
    detail: str = ""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def _get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def _p99(values: list[float]) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(0.99 * len(values)))]


async def _one(host: str, port: int, rng: random.Random, result: Result) -> None:
    sse = rng.random() < 0.2
    prompt = [rng.randrange(1, 32000) for _ in range(rng.randrange(1, 64))]
    n = rng.randrange(1, 64)
    cut = rng.random() < 0.1
    # Where a disconnecting client gives up: before the response, or after k tokens.
    cut_after = rng.randrange(0, n) if cut else None
    if sse:
        path = "/v1/completions"
        body = {"prompt": prompt, "max_tokens": n, "stream": True, "temperature": 0}
    else:
        path = "/generate"
        body = {"prompt_token_ids": prompt, "max_new_tokens": n}
    payload = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(
            f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n".encode()
            + b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(payload), payload)
        )
        await writer.drain()
        if cut_after == 0:
            result.outcome = "disconnected"
            return
        status = int((await reader.readline()).split()[1])
        while (await reader.readline()) not in (b"\r\n", b""):
            pass
        if status != 200:
            result.detail = f"status {status}"
            return
        tokens = 0
        finish = None
        buf = b""
        while True:
            size_line = await reader.readline()
            if not size_line:
                break
            size = int(size_line.strip() or b"0", 16)
            if size == 0:
                break
            buf += (await reader.readexactly(size + 2))[:-2]
            *lines, buf = buf.split(b"\n")
            for line in lines:
                if sse:
                    if not line.startswith(b"data: ") or line == b"data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        result.detail = event["error"]["message"]
                        return
                    choice = event["choices"][0]
                    tokens += 1
                    finish = choice["finish_reason"] or finish
                else:
                    if not line:
                        continue
                    event = json.loads(line)
                    if event.get("token_id") is not None:
                        tokens += 1
                    if event["done"]:
                        finish = event["finish_reason"]
                if tokens and result.ttft is None:
                    result.ttft = time.perf_counter() - result.start
            if cut_after is not None and tokens >= cut_after:
                result.outcome = "disconnected"
                return
        if finish == "length" and tokens == n:
            result.outcome = "completed"
        else:
            result.detail = f"finish {finish!r} after {tokens}/{n} tokens"
    except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
        result.detail = f"{type(exc).__name__}: {exc}"
    finally:
        writer.close()


async def _drive(host: str, port: int, requests: int, concurrency: int,
                 seed: int) -> list[Result]:
    rng = random.Random(seed)
    results = [Result(0.0) for _ in range(requests)]
    next_index = 0
    done = 0
    last_report = time.monotonic()

    async def worker() -> None:
        nonlocal next_index, done, last_report
        while next_index < requests:
            i = next_index
            next_index += 1
            results[i].start = time.perf_counter()
            await _one(host, port, rng, results[i])
            done += 1
            if time.monotonic() - last_report > 10:
                last_report = time.monotonic()
                print(f"  {done}/{requests}", file=sys.stderr, flush=True)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--total-kv-blocks", type=int, default=256,
                        help="server KV pool (default 256 blocks of 16: forces preemption)")
    parser.add_argument("--mock-token-latency-us", type=float, default=500.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, "-m", "iron_batch.server", "--addr", f"127.0.0.1:{port}",
         "--total-kv-blocks", str(args.total_kv_blocks), "--kv-block-size", "16",
         "--mock-token-latency-us", str(args.mock_token_latency_us),
         "--drain-timeout", "5"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if _get_json(f"{url}/health")["status"] == "ok":
                    break
            except OSError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                print(f"server did not start: {server.stderr.read() if server.stderr else ''}",
                      file=sys.stderr)
                return 1
            time.sleep(0.1)
        rss_start = _rss_mib(server.pid)
        started = time.perf_counter()
        results = asyncio.run(_drive("127.0.0.1", port, args.requests, args.concurrency,
                                     args.seed))
        elapsed = time.perf_counter() - started
        deadline = time.monotonic() + 30
        while True:  # aborts of the last disconnects land within a step or two
            metrics = _get_json(f"{url}/metrics")
            idle = metrics["running"] == 0 and metrics["waiting"] == 0
            if (idle and metrics["kv_blocks_free"] == metrics["kv_blocks_total"]) or (
                time.monotonic() > deadline
            ):
                break
            time.sleep(0.1)
        rss_end = _rss_mib(server.pid)
    finally:
        server.terminate()
        try:
            code = server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            code = server.wait()

    order = sorted(results, key=lambda r: r.start)
    slices = []
    for k in range(10):
        part = order[k * len(order) // 10:(k + 1) * len(order) // 10]
        p99 = _p99([r.ttft for r in part if r.ttft is not None])
        slices.append(None if p99 is None else round(p99 * 1000, 1))
    failed = [r for r in results if r.outcome == "failed"]
    report = {
        "requests": args.requests,
        "concurrency": args.concurrency,
        "elapsed_s": round(elapsed, 1),
        "requests_per_s": round(args.requests / elapsed, 1),
        "completed": sum(r.outcome == "completed" for r in results),
        "disconnected": sum(r.outcome == "disconnected" for r in results),
        "failed": len(failed),
        "failure_examples": sorted({r.detail for r in failed})[:5],
        "ttft_p99_ms_per_10pct": slices,
        "server_rss_mib_start": round(rss_start, 1),
        "server_rss_mib_end": round(rss_end, 1),
        "kv_blocks_free_end": metrics["kv_blocks_free"],
        "kv_blocks_total": metrics["kv_blocks_total"],
        "server_requests_aborted": metrics["requests_aborted"],
        "server_preemptions": metrics["preemptions"],
        "server_exit_code": code,
    }
    if args.json:
        print(json.dumps(report))
    else:
        for key, value in report.items():
            print(f"{key:28} {value}")
    leaked = metrics["kv_blocks_free"] != metrics["kv_blocks_total"]
    return 1 if failed or leaked or code != 0 else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
