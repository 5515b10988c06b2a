"""The engine's own cost per token: offline ``LLM.generate`` over a mock backend that takes
no time, so what is measured is scheduling, committing, turning the step's events into
``TokenEvent`` objects and collecting them.

    python benches/engine_overhead.py                      # 1024 requests x 64 tokens
    python benches/engine_overhead.py --ab /path/to/other/checkout/python --pairs 8

With ``--ab``, each measurement runs in a fresh process, alternating between this checkout
and the other ``iron_batch`` (a ``PYTHONPATH`` entry, e.g. a worktree of an older commit
with its extension built); the median of the paired ratios is the number to read on a
shared machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def best_tok_s(running: int, overlap: int, requests: int, new: int, reps: int) -> float:
    from iron_batch import LLM, SamplingParams
    from iron_batch.backends.mock import MockBackend

    llm = LLM(backend=MockBackend(token_latency_us=0, prefill_token_latency_us=0),
              total_kv_blocks=8192, max_running_seqs=running, overlap_depth=overlap)
    # Distinct prompts of 32 tokens (little prefix caching; the mock's prefill is free).
    prompts = [[i % 1000 + 1, *range(2, 33)] for i in range(requests)]
    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    llm.generate(prompts[:64], params)  # warm
    best = 0.0
    for _ in range(reps):
        t = time.perf_counter()
        outs = llm.generate(prompts, params)
        best = max(best, requests * new / (time.perf_counter() - t))
        assert all(len(o.token_ids) == new for o in outs)
    return best


def in_process(pythonpath: str, args: argparse.Namespace, running: int, overlap: int) -> float:
    cmd = [sys.executable, __file__, "--one", str(running), str(overlap),
           "--requests", str(args.requests), "--new-tokens", str(args.new_tokens),
           "--reps", str(args.reps)]
    env = {**os.environ, "PYTHONPATH": pythonpath}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return float(out.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--running", type=int, nargs="+", default=[256, 16])
    ap.add_argument("--overlap-depth", type=int, nargs="+", default=[1, 0])
    ap.add_argument("--requests", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3, help="generate calls per process (best)")
    ap.add_argument("--pairs", type=int, default=5, help="processes per configuration")
    ap.add_argument("--ab", metavar="PYTHONPATH", help="the iron_batch to compare against")
    ap.add_argument("--one", type=int, nargs=2, metavar=("RUNNING", "OVERLAP"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(best_tok_s(*args.one, args.requests, args.new_tokens, args.reps))
        return
    ours = str(HERE.parent / "python")
    if args.ab:
        print("| running | overlap | this tok/s | other tok/s | this / other (median, min-max) |")
        print("|---|---|---|---|---|")
    else:
        print("| running | overlap | tok/s (median) | µs per token |")
        print("|---|---|---|---|")
    for running in args.running:
        for overlap in args.overlap_depth:
            this: list[float] = []
            other: list[float] = []
            for i in range(args.pairs):
                this_first = i % 2 == 0
                if args.ab and not this_first:
                    other.append(in_process(args.ab, args, running, overlap))
                this.append(in_process(ours, args, running, overlap))
                if args.ab and this_first:
                    other.append(in_process(args.ab, args, running, overlap))
            med = statistics.median(this)
            if args.ab:
                ratios = [a / b for a, b in zip(this, other, strict=True)]
                print(f"| {running} | {overlap} | {med:,.0f} | {statistics.median(other):,.0f} "
                      f"| {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}) |")
            else:
                print(f"| {running} | {overlap} | {med:,.0f} | {1e6 / med:.2f} |")


if __name__ == "__main__":
    main()
