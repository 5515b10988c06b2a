"""Throughput of the remote backend against in-process, over loopback.

    python benches/remote_bench.py            # full table (a few minutes)
    python benches/remote_bench.py --quick    # smoke run (seconds)

For each model (the mock backend with a fixed per-step latency, and a tiny random-weight
torch model), runs the engine in-process (without and with overlap) and against a
``python -m iron_batch.worker`` subprocess: without overlap at K = 1, 4, 8 decode steps
per call, and with K = 1 and 1, 2 or the engine's own choice of steps in flight (overlap
depth), with no added delay and with ``--delay-ms`` of added latency on every reply, at
concurrency 1 and 64 (that
many requests in flight, a new one admitted as soon as one ends). The engine is driven on
this thread (``Engine.step``), so the figures are the backend path alone, without HTTP.
``--rounds N`` repeats the whole table N times, each configuration once per round, and
reports the median of each (a shared machine's noise then hits every row alike).

The tiny torch checkpoint is built with the tests' helper (tests/tiny_models.py, which
needs transformers); ``--no-torch`` skips it.
"""

from __future__ import annotations

import argparse
import os
import select
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from iron_batch import Engine, SamplingParams, SchedulerConfig
from iron_batch.backends.remote import RemoteBackend

ROOT = Path(__file__).resolve().parent.parent


#: The overlap depth the engine picks by itself (``overlap_depth=None``), as a row label.
AUTO = -1


@dataclass
class Result:
    model: str
    mode: str
    depth: int  # AUTO: the engine's own choice
    steps_per_call: int
    delay_ms: float
    concurrency: int
    tokens: int
    seconds: float
    calls: int

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def run_engine(
    backend: Any, config: SchedulerConfig, concurrency: int, total: int, prompt_len: int,
    max_new: int, vocab: int, depth: int,
) -> tuple[int, float, int]:
    """(tokens generated, seconds, engine steps) with ``concurrency`` requests in flight."""
    engine = Engine(backend, config, overlap_depth=None if depth == AUTO else depth)
    rng = np.random.default_rng(0)
    params = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    submitted = done = tokens = steps = 0

    def submit() -> None:
        nonlocal submitted
        prompt = rng.integers(3, vocab, size=prompt_len).tolist()
        engine.add_request(f"q{submitted}", prompt, params)
        submitted += 1

    started = time.perf_counter()
    while submitted < min(concurrency, total):
        submit()
    while done < total:
        for ev in engine.step():
            if ev.error:
                raise RuntimeError(ev.error)
            tokens += ev.token_id is not None
            if ev.finished:
                done += 1
                if submitted < total:
                    submit()
        steps += 1
    return tokens, time.perf_counter() - started, steps


class Worker:
    def __init__(self, *args: str) -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT / "python"))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "iron_batch.worker", "--addr", "127.0.0.1:0", *args],
            stdout=subprocess.PIPE, env=env,
        )
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        out = b""
        deadline = time.monotonic() + 120
        while b"\n" not in out:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"worker did not start: {out!r}")
            if select.select([fd], [], [], 1.0)[0]:
                out += os.read(fd, 4096)
        self.url = "tcp://127.0.0.1:" + out.split(b"\n")[0].rsplit(b":", 1)[1].decode()

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def bench_model(
    name: str, local: Any, worker_args: list[str], config: SchedulerConfig, vocab: int,
    args: argparse.Namespace,
) -> list[Result]:
    runs: dict[tuple[str, int, int, float, int], list[Result]] = {}

    def measure(backend: Any, mode: str, k: int, delay: float, depth: int) -> None:
        for c in args.concurrency:
            total = max(c, args.requests if c > 1 else args.requests_at_1)
            tokens, secs, steps = run_engine(
                backend, config, c, total, args.prompt_len, args.max_new_tokens, vocab, depth
            )
            r = Result(name, mode, depth, k, delay, c, tokens, secs, steps)
            runs.setdefault((mode, depth, k, delay, c), []).append(r)
            print(f"  {name:6} {mode:10} depth={depth} K={k} delay={delay:g}ms c={c:3}: "
                  f"{tokens / secs:9.0f} tok/s", file=sys.stderr, flush=True)

    workers = {delay: Worker(*worker_args, "--delay-ms", str(delay)) for delay in args.delays}
    try:
        for _ in range(args.rounds):
            for depth in sorted({0, *args.depths} - {AUTO}):
                measure(local, "in-process", 1, 0.0, depth)
            for delay, worker in workers.items():
                remote = [(k, 0) for k in args.steps] + [(1, d) for d in args.depths if d != 0]
                for k, depth in remote:
                    be = RemoteBackend(worker.url, steps_per_call=k, timeout=60)
                    try:
                        measure(be, "remote", k, delay, depth)
                    finally:
                        be.close()
    finally:
        for worker in workers.values():
            worker.stop()
    # The median round of each configuration.
    return [sorted(rs, key=lambda r: r.tok_s)[len(rs) // 2] for rs in runs.values()]


def print_table(results: list[Result]) -> None:
    """Each row with its ratio to the same model's in-process run without overlap at the
    same concurrency (measured in this run)."""
    base = {(r.model, r.concurrency): r.tok_s for r in results
            if r.mode == "in-process" and r.depth == 0}
    print(f"| {'model':6} | {'mode':10} | {'overlap':>7} | {'K':>2} | {'delay ms':>8} | "
          f"{'conc':>4} | {'tokens':>7} | {'tok/s':>9} | {'vs in-process':>13} |")
    print("|" + "|".join("-" * w for w in (8, 12, 9, 4, 10, 6, 9, 11, 15)) + "|")
    for r in results:
        ratio = r.tok_s / base[(r.model, r.concurrency)]
        depth = "auto" if r.depth == AUTO else str(r.depth)
        print(f"| {r.model:6} | {r.mode:10} | {depth:>7} | {r.steps_per_call:>2} | "
              f"{r.delay_ms:>8g} | {r.concurrency:>4} | {r.tokens:>7} | {r.tok_s:>9.0f} | "
              f"{ratio:>12.2f}x |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny smoke run")
    p.add_argument("--no-torch", action="store_true", help="mock only")
    p.add_argument("--no-mock", action="store_true", help="tiny torch model only")
    p.add_argument("--mock-step-us", type=float, default=1000.0,
                   help="mock: fixed latency of one decode step (default 1000)")
    p.add_argument("--steps", type=int, nargs="+", default=[1, 4, 8],
                   help="K values run without overlap")
    p.add_argument("--depths", type=int, nargs="+", default=[1, 2, AUTO],
                   help=f"overlap depths run with K = 1 (and in process); {AUTO}: the "
                   "engine's own choice (overlap_depth=None)")
    p.add_argument("--delays", type=float, nargs="+", default=[0.0, 2.0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    p.add_argument("--requests", type=int, default=128, help="requests per run (>= conc)")
    p.add_argument("--requests-at-1", type=int, default=16,
                   help="requests per run at concurrency 1 (default 16)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=1,
                   help="repeat every configuration this many times; report the median")
    args = p.parse_args()
    if args.quick:
        args.requests, args.requests_at_1 = 8, 4
        args.max_new_tokens, args.prompt_len = 16, 8
        args.concurrency = [1, 8]

    results: list[Result] = []
    from iron_batch.backends.mock import MockBackend

    mock_cfg = SchedulerConfig(total_kv_blocks=4096, kv_block_size=16)
    results += [] if args.no_mock else bench_model(
        "mock",
        MockBackend(token_latency_us=args.mock_step_us, prefill_token_latency_us=0.0),
        ["--backend", "mock", "--mock-token-latency-us", str(args.mock_step_us),
         "--mock-prefill-token-latency-us", "0", "--total-kv-blocks", "4096",
         "--kv-block-size", "16"],
        mock_cfg, 32000, args,
    )
    if not args.no_torch:
        sys.path.insert(0, str(ROOT / "tests"))
        from iron_batch.backends.torch_backend import TorchBackend
        from tiny_models import VOCAB, checkpoint  # type: ignore[import-not-found]

        ckpt = str(checkpoint("llama"))
        local = TorchBackend.from_model(ckpt, device="cpu", dtype="float32",
                                        total_kv_blocks=1024, kv_block_size=16)
        torch_cfg = SchedulerConfig(total_kv_blocks=1024, kv_block_size=16,
                                    max_model_len=local.max_model_len)
        results += bench_model(
            "torch",
            local,
            ["--model", ckpt, "--device", "cpu", "--dtype", "float32",
             "--total-kv-blocks", "1024", "--kv-block-size", "16"],
            torch_cfg, VOCAB, args,
        )
    print_table(results)


if __name__ == "__main__":
    main()
