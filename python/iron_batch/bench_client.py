"""Load generator: ``python -m iron_batch.bench_client --concurrency 128 --total-requests 2000``.

Keeps ``--concurrency`` streams open against POST /generate, each on its own keep-alive
connection, and reports throughput with TTFT and inter-token latency percentiles, then
the server's own /metrics.

The default client speaks HTTP/1.1 over raw asyncio streams: it only needs to find line
ends and the final line, and httpx's per-chunk machinery costs several times more CPU,
which on a small machine makes the client, not the server, the bottleneck (compare with
``--client httpx``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx
from tqdm import tqdm

from iron_batch.cli_args import non_negative_int, positive_int


@dataclass
class _Results:
    ok: int = 0
    failed: int = 0
    tokens: int = 0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)
    finish_reasons: dict[str, int] = field(default_factory=dict)

    def fail(self, why: str) -> None:
        self.failed += 1
        self.errors[why] = self.errors.get(why, 0) + 1


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile of already sorted ``values``."""
    if not values:
        return None
    rank = max(1, math.ceil(q / 100.0 * len(values)))
    return values[rank - 1]


class _Work:
    """Hands out request numbers to the workers until the total is reached."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.remaining = total

    def take(self) -> int | None:
        """The next request's number (0, 1, ...), or None when all are handed out."""
        if self.remaining <= 0:
            return None
        self.remaining -= 1
        return self.total - self.remaining - 1


def request_bodies(args: argparse.Namespace) -> Callable[[int], dict[str, Any]]:
    """Request number -> /generate body.

    By default every request sends ``prompt_tokens: N`` (the same synthetic prompt, so the
    prefix cache serves most of it). ``--random-prompts VOCAB`` sends distinct random token
    ids in [0, VOCAB) per request instead (seeded by ``--seed`` and the request number), which
    is what a model benchmark needs: every prompt token is computed.
    """
    common: dict[str, Any] = {"max_new_tokens": args.max_new_tokens}
    if args.ignore_eos:
        common["ignore_eos"] = True
    if not args.random_prompts:
        body = {"prompt_tokens": args.prompt_tokens, **common}
        return lambda _i: body

    def random_body(i: int) -> dict[str, Any]:
        rng = random.Random(args.seed * 1_000_003 + i)
        ids = [rng.randrange(args.random_prompts) for _ in range(args.prompt_tokens)]
        return {"prompt_token_ids": ids, **common}

    return random_body


def _record_stream_line(
    line: bytes, now: float, state: list[Any], results: _Results
) -> bool:
    """Account one NDJSON line; state = [start, last_token_time, tokens]. True on the last."""
    if b'"done":true' in line:
        final = json.loads(line)
        reason = str(final.get("finish_reason"))
        results.finish_reasons[reason] = results.finish_reasons.get(reason, 0) + 1
        if final.get("token_id") is None:
            return True
    last = state[1]
    if last is None:
        results.ttft.append(now - state[0])
    else:
        results.itl.append(now - last)
    state[1] = now
    state[2] += 1
    return b'"done":true' in line


async def _raw_worker(
    host: str, port: int, request_for: Callable[[int], bytes], work: _Work, results: _Results,
    bar: tqdm,
) -> None:
    reader: asyncio.StreamReader | None = None
    writer: asyncio.StreamWriter | None = None
    while (number := work.take()) is not None:
        request = request_for(number)
        try:
            if writer is None:
                reader, writer = await asyncio.open_connection(host, port)
            assert reader is not None
            state: list[Any] = [time.perf_counter(), None, 0]
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head[9:12])
            headers = head.lower()
            keep_alive = b"connection: close" not in headers
            if b"transfer-encoding: chunked" not in headers:
                # Error responses carry a Content-Length body.
                length = 0
                for h in headers.split(b"\r\n"):
                    if h.startswith(b"content-length:"):
                        length = int(h[15:])
                body = await reader.readexactly(length)
                results.fail(f"HTTP {status}: {body[:200].decode(errors='replace')}")
            else:
                pending = b""
                done = False
                while True:
                    size_line = await reader.readuntil(b"\r\n")
                    size = int(size_line.split(b";", 1)[0], 16)
                    if size == 0:
                        await reader.readuntil(b"\r\n")
                        break
                    data = await reader.readexactly(size + 2)
                    now = time.perf_counter()
                    pending += data[:-2]
                    # A chunk holds whole lines from our server, but HTTP does not promise it.
                    *lines, pending = pending.split(b"\n")
                    for line in lines:
                        if line and _record_stream_line(line, now, state, results):
                            done = True
                if status == 200 and done:
                    results.ok += 1
                    results.tokens += state[2]
                else:
                    results.fail(f"HTTP {status}" if status != 200 else "stream ended early")
            if not keep_alive:
                writer.close()
                reader = writer = None
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as e:
            results.fail(type(e).__name__)
            if writer is not None:
                writer.close()
            reader = writer = None
        bar.update(1)
    if writer is not None:
        writer.close()


async def _httpx_worker(
    client: httpx.AsyncClient, url: str, body_for: Callable[[int], dict[str, Any]],
    work: _Work, results: _Results, bar: tqdm,
) -> None:
    while (number := work.take()) is not None:
        body = body_for(number)
        state: list[Any] = [time.perf_counter(), None, 0]
        done = False
        try:
            async with client.stream("POST", url, json=body) as response:
                if response.status_code != 200:
                    text = (await response.aread())[:200].decode(errors="replace")
                    results.fail(f"HTTP {response.status_code}: {text}")
                else:
                    async for line in response.aiter_lines():
                        if line and _record_stream_line(
                            line.encode(), time.perf_counter(), state, results
                        ):
                            done = True
                    if done:
                        results.ok += 1
                        results.tokens += state[2]
                    else:
                        results.fail("stream ended early")
        except httpx.HTTPError as e:
            results.fail(type(e).__name__)
        bar.update(1)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 3)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    url = urlsplit(args.url)
    host = url.hostname or "127.0.0.1"
    port = url.port or 80
    base = args.url.rstrip("/")
    body_for = request_bodies(args)
    head = (
        f"POST {url.path.rstrip('/')}/generate HTTP/1.1\r\nHost: {host}:{port}\r\n"
        "Content-Type: application/json\r\n"
        + (f"Authorization: Bearer {args.api_key}\r\n" if args.api_key else "")
    ).encode()

    def request_for(number: int) -> bytes:
        payload = json.dumps(body_for(number)).encode()
        return head + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload

    results = _Results()
    work = _Work(args.total_requests)
    headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    bar = tqdm(total=args.total_requests, unit="req", disable=args.no_progress, mininterval=0.5)
    limits = httpx.Limits(
        max_connections=args.concurrency, max_keepalive_connections=args.concurrency
    )
    async with httpx.AsyncClient(timeout=None, limits=limits, headers=headers) as client:
        started = time.perf_counter()
        if args.client == "raw":
            workers = [
                _raw_worker(host, port, request_for, work, results, bar)
                for _ in range(args.concurrency)
            ]
        else:
            workers = [
                _httpx_worker(client, f"{base}/generate", body_for, work, results, bar)
                for _ in range(args.concurrency)
            ]
        await asyncio.gather(*workers)
        elapsed = time.perf_counter() - started
        bar.close()
        server_metrics: dict[str, Any] | None
        try:
            response = await client.get(f"{base}/metrics", timeout=10.0)
            server_metrics = response.json() if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            server_metrics = None

    results.ttft.sort()
    results.itl.sort()
    summary: dict[str, Any] = {
        "url": args.url,
        "client": args.client,
        "concurrency": args.concurrency,
        "total_requests": args.total_requests,
        "prompt_tokens": args.prompt_tokens,
        "max_new_tokens": args.max_new_tokens,
        "requests_ok": results.ok,
        "requests_failed": results.failed,
        "tokens": results.tokens,
        "elapsed_secs": round(elapsed, 3),
        "tokens_per_sec": round(results.tokens / elapsed, 1) if elapsed > 0 else 0.0,
        "requests_per_sec": round(results.ok / elapsed, 1) if elapsed > 0 else 0.0,
        "finish_reasons": results.finish_reasons,
        "errors": results.errors,
        "server_metrics": server_metrics,
    }
    for name, values in (("ttft", results.ttft), ("itl", results.itl)):
        for q in (50, 90, 99):
            summary[f"{name}_p{q}_ms"] = _ms(percentile(values, q))
    return summary


def _print_summary(s: dict[str, Any]) -> None:
    print(f"requests ok:      {s['requests_ok']}  failed: {s['requests_failed']}")
    for why, n in sorted(s["errors"].items(), key=lambda kv: -kv[1])[:5]:
        print(f"  {n} x {why}")
    print(f"tokens:           {s['tokens']}")
    print(f"elapsed:          {s['elapsed_secs']:.3f} s")
    print(f"throughput:       {s['tokens_per_sec']:.1f} tok/s, {s['requests_per_sec']:.1f} req/s")
    for name, label in (("ttft", "TTFT"), ("itl", "inter-token")):
        p = [s[f"{name}_p{q}_ms"] for q in (50, 90, 99)]
        shown = ", ".join(
            f"p{q} {v:.2f} ms" if v is not None else f"p{q} -"
            for q, v in zip((50, 90, 99), p, strict=True)
        )
        print(f"{label + ':':<18}{shown}")
    metrics = s["server_metrics"]
    if metrics is not None:
        print("server /metrics:  " + json.dumps(metrics))
    else:
        print("server /metrics:  unavailable")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m iron_batch.bench_client", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8080", help="server base URL")
    p.add_argument("--concurrency", type=positive_int, default=128,
                   help="streams open at once (default 128)")
    p.add_argument("--total-requests", type=positive_int, default=2000,
                   help="requests to send in all (default 2000)")
    p.add_argument("--prompt-tokens", type=positive_int, default=128,
                   help="synthetic prompt length (default 128)")
    p.add_argument("--max-new-tokens", type=non_negative_int, default=64,
                   help="tokens to generate per request (default 64)")
    p.add_argument("--random-prompts", type=positive_int, default=None, metavar="VOCAB",
                   help="distinct random prompt token ids in [0, VOCAB) per request instead of "
                        "one synthetic prompt (every prompt token is computed)")
    p.add_argument("--seed", type=non_negative_int, default=0,
                   help="seed of --random-prompts (default 0)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="generate max-new-tokens tokens whatever the model samples")
    p.add_argument("--json", metavar="PATH", default=None, help="also write the summary here")
    p.add_argument("--client", choices=("raw", "httpx"), default="raw",
                   help="HTTP client: raw asyncio streams (default) or httpx")
    p.add_argument("--api-key", default=None, help="bearer token for --api-key servers")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        import uvloop  # a faster loop makes the client less of a bottleneck
    except ImportError:
        summary = asyncio.run(run(args))
    else:
        summary = uvloop.run(run(args))
    _print_summary(summary)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
            f.write("\n")
    if summary["requests_ok"] == 0:
        sys.exit(1)


if __name__ == "__main__":
    main()
