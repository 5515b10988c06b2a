"""Tensor parallelism against one process on the same model, CPU (gloo), side by side.

    python benches/tp_throughput.py --shape qwen2.5-0.5b --dtype bfloat16

For each tensor-parallel size: batch-1 decode ms/token, the output tok/s of W concurrent
requests (offline ``LLM``), and per step the time rank 0 spends in the forward's
collectives (all-reduce after o and down, the embedding's all-reduce, the logit gather;
waiting for the slower rank included) and in the step broadcast. On a small host the ranks
share the same cores and memory bandwidth, so this measures what the communication costs
more than any speed-up.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from iron_batch import SamplingParams
from iron_batch.llm import LLM
from torch_throughput import SHAPES, build_shape_model  # benches/, next to this script


def _comm(llm: LLM) -> tuple[float, float, int]:
    group = getattr(llm.backend, "group", None)
    if group is None:
        return 0.0, 0.0, 0
    return group.comm_seconds, group.broadcast_seconds, group.comm_calls


def batch1(llm: LLM, prompt: list[int], new: int) -> dict[str, float]:
    engine = llm.engine
    engine.add_request("b1", prompt, SamplingParams(max_new_tokens=new + 1, ignore_eos=True))
    engine.step()  # prefill
    c0, b0, n0 = _comm(llm)
    t = time.perf_counter()
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    elapsed = time.perf_counter() - t
    c1, b1, n1 = _comm(llm)
    return {"ms_per_token": elapsed / steps * 1e3,
            "collective_ms_per_step": (c1 - c0) / steps * 1e3,
            "broadcast_ms_per_step": (b1 - b0) / steps * 1e3,
            "collectives_per_step": (n1 - n0) / steps}


def concurrent(llm: LLM, prompts: np.ndarray, new: int) -> dict[str, float]:
    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    c0, b0, _ = _comm(llm)
    t = time.perf_counter()
    outs = llm.generate([p.tolist() for p in prompts], params)
    elapsed = time.perf_counter() - t
    c1, b1, _ = _comm(llm)
    tokens = sum(len(o.token_ids) for o in outs)
    return {"tok_s": tokens / elapsed, "collective_s": c1 - c0, "broadcast_s": b1 - b0,
            "elapsed_s": elapsed, "collective_share": (c1 - c0) / elapsed}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-0.5b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--sizes", default="1,2", help="tensor-parallel sizes to measure")
    ap.add_argument("--requests", type=int, default=16, help="W: concurrent requests")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--json", help="write the numbers here")
    args = ap.parse_args()
    tmp = tempfile.TemporaryDirectory()
    model = str(build_shape_model(args.shape, getattr(torch, args.dtype), Path(tmp.name)))
    vocab = SHAPES[args.shape][1]["vocab_size"]
    rng = np.random.default_rng(0)
    prompts = rng.integers(100, vocab - 100, (args.requests, args.prompt_tokens), dtype=np.int64)
    warm = rng.integers(100, vocab - 100, (args.requests, args.prompt_tokens), dtype=np.int64)
    results: dict[str, Any] = {}
    for size in [int(s) for s in args.sizes.split(",")]:
        llm = LLM(model=model, dtype=args.dtype, device="cpu", kv_cache_memory_gb=0.25,
                  tensor_parallel_size=size)
        concurrent(llm, warm[:4], 8)
        b1 = batch1(llm, prompts[0].tolist(), 32)
        w = concurrent(llm, prompts, args.new_tokens)
        results[str(size)] = {"batch1": b1, "concurrent": w}
        llm.close()
        print(f"TP={size}: batch-1 {b1['ms_per_token']:.1f} ms/token "
              f"(collectives {b1['collective_ms_per_step']:.2f} ms/step in "
              f"{b1['collectives_per_step']:.0f} calls, broadcast "
              f"{b1['broadcast_ms_per_step']:.2f} ms/step); W={args.requests}: "
              f"{w['tok_s']:.1f} tok/s, {w['collective_share']:.0%} of the time in collectives",
              flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
