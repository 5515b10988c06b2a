"""The W of ``torch_throughput.py`` (``--requests`` x ``--prompt-tokens`` in x
``--new-tokens`` out) for a shape too large for that script's three copies of the weights:
iron-batch's server is started, measured and stopped first, then transformers is loaded
and measured, so that one engine's copy is in memory at a time; then batch 1 the same way
(the server's inter-token p50 over three requests, transformers' ``generate``, as in
``torch_throughput.py``). One round: each ratio spans a few minutes of this machine's
memory bandwidth.

    python benches/w_one_at_a_time.py --shape qwen3.5-4b --kv-cache-memory-gb 8

``--b1-rounds N`` measures batch 1 alone instead, in N rounds: each round loads, warms up,
measures and frees each engine in turn (the order alternating between rounds), as two
copies of a 4B shape's weights do not fit this machine's memory beside each other.

    python benches/w_one_at_a_time.py --shape qwen3.5-4b --kv-cache-memory-gb 0.5 --b1-rounds 4
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch_throughput as tt  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(tt.SHAPES), required=True)
    ap.add_argument("--model", help="a checkpoint of that shape already written (else built)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--b1-new-tokens", type=int, default=32, help="new tokens of batch 1")
    ap.add_argument("--max-batch-tokens", type=int, default=8192)
    ap.add_argument("--kv-cache-memory-gb", type=float, default=None)
    ap.add_argument("--b1-rounds", type=int, default=0,
                    help="batch 1 only, in this many alternating rounds (no W)")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.model or str(tt.build_shape_model(args.shape, dtype, Path(tmp)))
        gc.collect()
        vocab = int(json.loads((Path(folder) / "config.json").read_text())["vocab_size"])
        memory = ([] if args.kv_cache_memory_gb is None
                  else ["--kv-cache-memory-gb", str(args.kv_cache_memory_gb)])
        if args.b1_rounds:
            batch1_rounds(folder, dtype, vocab, args, memory)
            return
        server = tt.Server(folder, args.dtype, vocab, args, memory)
        try:
            server.client(1, 1, seed=1)  # warm-up
            t = time.perf_counter()
            ours = server.throughput(seed=2)
            print(f"iron-batch server: {ours:.1f} tok/s ({time.perf_counter() - t:.0f} s)",
                  flush=True)
            server.args = argparse.Namespace(**{**vars(args), "new_tokens": args.b1_new_tokens})
            ours_ms = server.ms_per_token(seed=3)
        finally:
            server.stop()
        hf = tt.hf_model(folder, dtype)
        rng = np.random.default_rng(0)
        prompts = rng.integers(100, vocab - 100, (args.requests, args.prompt_tokens))
        tt.hf_static(hf, prompts[: args.hf_batch], args.hf_batch, 2)  # warm-up
        theirs = tt.hf_static(hf, prompts, args.hf_batch, args.new_tokens)
        theirs_ms = tt.hf_ms_per_token(hf, prompts[0], args.b1_new_tokens)
    print(f"transformers static batch {args.hf_batch}: {theirs:.1f} tok/s")
    print(f"| {args.shape} W {args.requests} x {args.prompt_tokens} x {args.new_tokens} | "
          f"{ours:.1f} | {theirs:.1f} | **{ours / theirs:.2f}x** |")
    print(f"| {args.shape} batch 1, ms/token | {ours_ms:.1f} | {theirs_ms:.1f} | "
          f"**{ours_ms / theirs_ms:.2f}x** |")


def batch1_rounds(folder: str, dtype: torch.dtype, vocab: int, args: argparse.Namespace,
                  memory: list[str]) -> None:
    """Batch 1 of the server and of transformers, one engine in memory at a time, in
    rounds whose order alternates."""
    args = argparse.Namespace(**{**vars(args), "new_tokens": args.b1_new_tokens})
    prompt = np.random.default_rng(0).integers(100, vocab - 100, args.prompt_tokens)

    def ours(r: int) -> float:
        server = tt.Server(folder, args.dtype, vocab, args, memory)
        try:
            tt.warm(lambda: server.client(1, 1, seed=1), 5.0)
            return server.ms_per_token(seed=10 + r)
        finally:
            server.stop()

    def theirs() -> float:
        hf = [tt.hf_model(folder, dtype)]
        tt.warm(lambda: tt.hf_ms_per_token(hf[0], prompt, 4), 5.0)
        ms = tt.hf_ms_per_token(hf[0], prompt, args.b1_new_tokens)
        hf.clear()  # its weights freed before the server loads its own
        gc.collect()
        return ms

    ratios = []
    for r in range(args.b1_rounds):
        if r % 2 == 0:
            a = ours(r)
            b = theirs()
        else:
            b = theirs()
            a = ours(r)
        ratios.append(a / b)
        print(f"round {r + 1} ({'ours' if r % 2 == 0 else 'transformers'} first): iron-batch "
              f"server {a:.1f} ms/token, transformers {b:.1f}: {a / b:.2f}x its time",
              flush=True)
    print(f"| {args.shape} batch 1, ms/token over {args.b1_rounds} rounds | "
          f"**{float(np.median(ratios)):.2f}x** ({min(ratios):.2f}-{max(ratios):.2f}) |")

if __name__ == "__main__":
    main()
