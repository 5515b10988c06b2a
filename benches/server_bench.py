"""iron-batch's streaming server against its ceiling, in one run.

Starts ``python -m iron_batch.server`` (mock backend) and ``benches/bare_stream_server.py``
(a Starlette endpoint that streams the same lines with no engine), then drives each with the
bench client, alternating ``--rounds`` times so that both see the same machine weather.

    python benches/server_bench.py                      # 128 x 2000, prompt 128, 64 new, 200 us
    python benches/server_bench.py --rounds 1 --total-requests 500
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(cmd: list[str], url: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/metrics", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit(f"server {cmd} did not start")


def drive(url: str, args: argparse.Namespace) -> dict[str, float]:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run(
            [sys.executable, "-m", "iron_batch.bench_client", "--url", url, "--no-progress",
             "--concurrency", str(args.concurrency), "--total-requests", str(args.total_requests),
             "--prompt-tokens", str(args.prompt_tokens), "--max-new-tokens",
             str(args.max_new_tokens), "--json", out.name],
            check=True, stdout=subprocess.DEVNULL,
        )
        return dict(json.loads(Path(out.name).read_text()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=128)
    ap.add_argument("--total-requests", type=int, default=2000)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--mock-token-latency-us", type=float, default=200.0)
    args = ap.parse_args()

    ours_port, bare_port = free_port(), free_port()
    ours_url, bare_url = f"http://127.0.0.1:{ours_port}", f"http://127.0.0.1:{bare_port}"
    env_python = [sys.executable]
    ours = start([*env_python, "-m", "iron_batch.server", "--addr", f"127.0.0.1:{ours_port}",
                  "--mock-token-latency-us", str(args.mock_token_latency_us)], ours_url)
    bare = start([*env_python, str(HERE / "bare_stream_server.py"), "--addr",
                  f"127.0.0.1:{bare_port}"], bare_url)
    rows: dict[str, list[dict[str, float]]] = {"iron-batch": [], "bare Starlette": []}
    try:
        drive(ours_url, argparse.Namespace(**{**vars(args), "total_requests": 200}))  # warm
        for _ in range(args.rounds):
            rows["iron-batch"].append(drive(ours_url, args))
            rows["bare Starlette"].append(drive(bare_url, args))
    finally:
        for p in (ours, bare):
            p.terminate()
            p.wait(20)

    def med(name: str, key: str) -> float:
        return statistics.median(float(r[key]) for r in rows[name])

    ceiling = med("bare Starlette", "tokens_per_sec")
    print(f"{args.concurrency} streams x {args.total_requests} requests, prompt "
          f"{args.prompt_tokens}, {args.max_new_tokens} new, mock step "
          f"{args.mock_token_latency_us:g} us; median of {args.rounds} alternating rounds "
          f"({os.cpu_count()} CPUs)")
    print("| server | tok/s | vs ceiling | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | failed |")
    print("|---|---|---|---|---|---|---|")
    for name in rows:
        tps = med(name, "tokens_per_sec")
        print(f"| {name} | {tps:,.0f} | {tps / ceiling:.2f}x | {med(name, 'ttft_p50_ms'):.1f} | "
              f"{med(name, 'ttft_p99_ms'):.1f} | {med(name, 'itl_p50_ms'):.2f} | "
              f"{int(sum(float(r['requests_failed']) for r in rows[name]))} |")


if __name__ == "__main__":
    main()
