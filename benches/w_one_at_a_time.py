"""The W of ``torch_throughput.py`` (``--requests`` x ``--prompt-tokens`` in x
``--new-tokens`` out) for a shape too large for that script's three copies of the weights:
iron-batch's server is started, measured and stopped first, then transformers is loaded
and measured, so that one engine's copy is in memory at a time; then batch 1 the same way
(the server's inter-token p50 over three requests, transformers' ``generate``, as in
``torch_throughput.py``). One round: each ratio spans a few minutes of this machine's
memory bandwidth.

    python benches/w_one_at_a_time.py --shape qwen3.5-4b --kv-cache-memory-gb 8
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
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.model or str(tt.build_shape_model(args.shape, dtype, Path(tmp)))
        gc.collect()
        vocab = int(json.loads((Path(folder) / "config.json").read_text())["vocab_size"])
        memory = ([] if args.kv_cache_memory_gb is None
                  else ["--kv-cache-memory-gb", str(args.kv_cache_memory_gb)])
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


if __name__ == "__main__":
    main()
