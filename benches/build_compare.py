"""Two builds of iron-batch through the server, measured in alternating rounds: the check
that a change costs nothing (W and batch 1 of the same model, the same flags, the same
prompts for both builds in a round).

    python benches/build_compare.py --build old=/path/to/old/python --build new=python \\
        --model smollm2-135m --dtype bfloat16 --rounds 5
    python benches/build_compare.py ... --shape qwen2.5-0.5b
    python benches/build_compare.py ... --model smollm2-135m --quantization gguf

Each ``--build NAME=PYTHON`` is an interpreter whose ``iron_batch`` is the build to measure
(a virtual environment with that checkout installed). Both servers are started and warmed
up first, then each round measures W (``--requests`` concurrent requests of
``--prompt-tokens`` in, ``--new-tokens`` out; output tok/s) and batch 1 (inter-token p50
over three requests in a row) on each build, the order flipping every round, with fresh
random prompts per round shared by both builds. Prints each round's ratios (second build
over first) and their median.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import torch_throughput as tt  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--build", action="append", required=True, metavar="NAME=PYTHON")
    ap.add_argument("--model", help="checkpoint dir, GGUF file or short name (smollm2-135m)")
    ap.add_argument("--shape", choices=sorted(tt.SHAPES), help="random-weight model of this shape")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--warmup-s", type=float, default=8.0)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-batch-tokens", type=int, default=8192)
    ap.add_argument("--kv-cache-memory-gb", type=float, default=None,
                    help="the servers' KV and state memory (their default when not given)")
    ap.add_argument("--parts", default="w,b1", help="w (throughput), b1 (batch 1) or both")
    ap.add_argument("--one-at-a-time", action="store_true",
                    help="start each build's server for its turn and stop it after (a model "
                         "too large for two servers in memory at once); warm-up every turn")
    ap.add_argument("--json", help="write the numbers here")
    args = ap.parse_args()
    builds = [tuple(b.split("=", 1)) for b in args.build]
    parts = set(args.parts.split(","))
    if len(builds) != 2:
        raise SystemExit("give exactly two --build NAME=PYTHON")
    tmp = Path(tempfile.mkdtemp(prefix="iron-batch-compare-"))
    if args.shape:
        model = str(tt.build_shape_model(args.shape, getattr(torch, args.dtype), tmp / "shape"))
        vocab = tt.SHAPES[args.shape][1]["vocab_size"]
    elif args.model:
        model, vocab = args.model, 49152 if args.model == "smollm2-135m" else 32000
    else:
        raise SystemExit("give --model or --shape")
    extra = ["--quantization", args.quantization] if args.quantization else []
    if args.kv_cache_memory_gb is not None:
        extra += ["--kv-cache-memory-gb", str(args.kv_cache_memory_gb)]
    pythons = dict(builds)

    def warm(name: str, server: tt.Server) -> None:
        end = time.monotonic() + args.warmup_s
        seed = 10_000
        while time.monotonic() < end:
            if "w" in parts:
                server.throughput(seed)
            else:
                server.ms_per_token(seed)
            seed += 1
        print(f"warmed up {name}", flush=True)

    servers: dict[str, tt.Server] = {}
    try:
        if not args.one_at_a_time:
            for name, python in builds:
                servers[name] = tt.Server(model, args.dtype, vocab, args, extra, python=python)
            for name, server in servers.items():
                warm(name, server)
        (a, _), (b, _) = builds
        rows = []
        for r in range(args.rounds):
            order = [a, b] if r % 2 == 0 else [b, a]
            got: dict[str, dict[str, float]] = {}
            for name in order:
                if args.one_at_a_time:
                    servers[name] = tt.Server(model, args.dtype, vocab, args, extra,
                                              python=pythons[name])
                    warm(name, servers[name])
                s = servers[name]
                got[name] = {
                    "w_tok_s": s.throughput(100 + r) if "w" in parts else float("nan"),
                    "b1_ms": s.ms_per_token(200 + r) if "b1" in parts else float("nan"),
                }
                if args.one_at_a_time:
                    servers.pop(name).stop()
            row = {"round": r, "order": order, **{f"{n}_{k}": v for n, d in got.items()
                                                  for k, v in d.items()},
                   "w_ratio": got[b]["w_tok_s"] / got[a]["w_tok_s"],
                   "b1_ratio": got[b]["b1_ms"] / got[a]["b1_ms"]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        for server in servers.values():
            server.stop()
    w = [r["w_ratio"] for r in rows]
    b1 = [r["b1_ratio"] for r in rows]
    print(f"\n| {b} / {a} | median | range |\n|---|---|---|")
    if "w" in parts:
        print(f"| W tok/s | {statistics.median(w):.3f}x | {min(w):.3f}-{max(w):.3f} |")
    if "b1" in parts:
        print(f"| batch-1 ms/token | {statistics.median(b1):.3f}x | "
              f"{min(b1):.3f}-{max(b1):.3f} |")
    for name in (a, b):
        ws = [r[f"{name}_w_tok_s"] for r in rows]
        ms = [r[f"{name}_b1_ms"] for r in rows]
        print(f"| {name}: W {statistics.median(ws):.1f} tok/s, batch 1 "
              f"{statistics.median(ms):.2f} ms | | |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
