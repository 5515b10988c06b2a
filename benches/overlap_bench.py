"""What overlapped steps buy the torch backend in process, on this machine's CPU.

    python benches/overlap_bench.py                       # SmolLM2-135M, float32
    python benches/overlap_bench.py --model PATH --dtype bfloat16

Runs the offline engine (``LLM.generate``) at batch 1 (one request) and batch W (W
requests at once), with ``overlap_depth`` 0 (sequential steps, the default on CPU) and 1
(the next step scheduled and submitted before the previous one is committed), alternating
the two ``--reps`` times so that machine noise hits both alike, with fresh prompts for
every run (the prefix cache would serve repeated ones); prints the median tok/s of each
and their ratio. Then the first-token latency of a request that joins W running ones, the
same way. Also reports the share of a decode step spent outside the model's forward (the
CPU-side work that overlap could hide on an asynchronous device).

``--server`` runs the comparison through two ``python -m iron_batch.server`` processes
(``--overlap-depth`` 0 and 1) instead, driven by ``iron_batch.bench_client`` with W
streams open and 3 W requests in all, so that requests keep joining running ones: TTFT
p50, inter-token p50 and tok/s, the servers taking turns ``--reps`` times.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np
from iron_batch import LLM, SamplingParams


def tok_s(llm: LLM, prompts: list[list[int]], new: int) -> float:
    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t)


def outside_forward_share(llm: LLM, prompt: list[int], new: int) -> float:
    model: Any = llm.backend.model  # type: ignore[attr-defined]
    forward = model.forward
    spent = [0.0]

    def timed(**kw: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return forward(**kw)
        finally:
            spent[0] += time.perf_counter() - t0

    model.forward = timed
    try:
        t = time.perf_counter()
        tok_s(llm, [prompt], new)
        elapsed = time.perf_counter() - t
    finally:
        model.forward = forward
    return 1 - spent[0] / elapsed


def first_token_ms(llm: LLM, prompts: list[list[int]], new: int) -> float:
    """Milliseconds from adding one more request to its first token, while the others run
    (their prefill done: the newcomer's prompt shares a step with their decodes)."""
    engine = llm.engine
    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    *running, newcomer = prompts
    for i, prompt in enumerate(running):
        engine.add_request(f"run-{i}", prompt, params)
    for _ in range(4):
        engine.step()
    t = time.perf_counter()
    engine.add_request("newcomer", newcomer, SamplingParams(max_new_tokens=2, ignore_eos=True))
    first = None
    while engine.has_unfinished():
        for event in engine.step():
            if first is None and event.request_id == "newcomer" and event.token_id is not None:
                first = time.perf_counter() - t
    assert first is not None
    return first * 1e3


def server_main(args: argparse.Namespace) -> None:
    from torch_throughput import Server  # benches/, next to this script

    vocab = LLM(model=args.model, dtype=args.dtype, device="cpu").backend.vocab_size
    args.max_batch_tokens = 8192
    servers = {d: Server(args.model, args.dtype, vocab, args, ["--overlap-depth", str(d)])
               for d in (0, 1)}
    try:
        seeds = iter(range(1000, 2000))
        for server in servers.values():  # warm up
            server.client(args.width, args.width, next(seeds))
        rows: dict[int, list[dict[str, Any]]] = {0: [], 1: []}
        for _ in range(args.reps):
            for d, server in servers.items():
                rows[d].append(server.client(args.width, 3 * args.width, next(seeds)))
    finally:
        for server in servers.values():
            server.stop()
    for key, label in (("ttft_p50_ms", "TTFT p50 ms"), ("itl_p50_ms", "inter-token p50 ms"),
                       ("tokens_per_sec", "tok/s")):
        med = {d: statistics.median(r[key] for r in rows[d]) for d in (0, 1)}
        print(f"{label}: no overlap {med[0]:.1f}, overlap {med[1]:.1f}, "
              f"ratio {med[1] / med[0]:.2f}x  (runs {[[r[key] for r in rows[d]] for d in (0, 1)]})",
              flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--width", type=int, default=32, help="batch W (default 32)")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--server", action="store_true",
                    help="compare through two servers instead of in process")
    args = ap.parse_args()
    if args.server:
        server_main(args)
        return
    llms = {d: LLM(model=args.model, dtype=args.dtype, device="cpu", overlap_depth=d)
            for d in (0, 1)}
    vocab = llms[0].backend.vocab_size
    rng = np.random.default_rng(0)

    def fresh(batch: int) -> list[list[int]]:
        return [rng.integers(3, vocab, size=args.prompt_tokens).tolist() for _ in range(batch)]

    for d in (0, 1):  # warm up
        tok_s(llms[d], fresh(args.width), 8)
    for batch in (1, args.width):
        runs: dict[int, list[float]] = {0: [], 1: []}
        for _ in range(args.reps):
            for d in (0, 1):
                runs[d].append(tok_s(llms[d], fresh(batch), args.new_tokens))
        med = {d: statistics.median(v) for d, v in runs.items()}
        print(f"batch {batch:3}: no overlap {med[0]:8.1f} tok/s, overlap {med[1]:8.1f} tok/s, "
              f"ratio {med[1] / med[0]:.2f}x  (runs {runs})", flush=True)
    waits: dict[int, list[float]] = {0: [], 1: []}
    for _ in range(args.reps):
        for d in (0, 1):
            waits[d].append(first_token_ms(llms[d], fresh(args.width + 1), args.new_tokens))
    med = {d: statistics.median(v) for d, v in waits.items()}
    print(f"first token of a request joining {args.width}: no overlap {med[0]:.0f} ms, "
          f"overlap {med[1]:.0f} ms  (runs {waits})", flush=True)
    prompts = fresh(1)
    share = outside_forward_share(llms[0], prompts[0], args.new_tokens)
    print(f"batch 1: {share:.0%} of a step is spent outside the model forward", flush=True)


if __name__ == "__main__":
    main()
