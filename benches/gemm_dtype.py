"""bf16 projections of many rows three ways, in process: the Rust GEMV (passes of 8 rows),
oneDNN's packed bf16 layout (what ``IRON_BATCH_CPU_GEMM=bf16`` runs above the GEMV's rows),
and torch's f32 GEMM over an f32 copy of the weight (what ``f32`` runs). Which one wins
depends on the core: see ``platform.cpu.bf16_dot_is_no_faster``.

Two sets of matrices with random weights, called matrix by matrix as a step calls them:
SmolLM2-135M's 120 projections (30 layers of fused q/k/v, o, fused gate/up, down) and one
layer of a Llama-3.2-3B shape. Each figure is the median of ``--reps`` passes over the set,
the three ways called in turns.

    python benches/gemm_dtype.py --rows 16 32 64 512
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from iron_batch.layers import cpu_kernels, quant

SETS = {
    "SmolLM2 projections (30 layers)": [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30,
    "Llama-3.2-3B layer": [(5120, 3072), (3072, 3072), (16384, 3072), (3072, 8192)],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 32, 64, 512])
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    torch.manual_seed(0)
    print("| matrices | rows | GEMV ms | packed bf16 ms | f32 ms | f32 / GEMV | "
          "**f32 / packed bf16** | f32 GFLOP/s |")
    print("|---|---|---|---|---|---|---|---|")
    for name, shapes in SETS.items():
        weights = [(torch.randn(n, k) / 30).bfloat16() for n, k in shapes]
        wide = [w.float() for w in weights]
        packed = [cpu_kernels.prepack(w) for w in weights]
        flops_per_row = 2 * sum(n * k for n, k in shapes)
        for rows in args.rows:
            xs = [torch.randn(rows, w.shape[1]).bfloat16() for w in weights]
            ways = {"gemv": lambda x, w, f, p: cpu_kernels.linear(x, w, None),
                    "f32": lambda x, w, f, p: quant.wide_linear(x, f, None)}
            if all(p is not None for p in packed):
                ways["packed"] = lambda x, w, f, p: cpu_kernels.packed_linear(x, p, None)
            times: dict[str, list[float]] = {way: [] for way in ways}
            for rep in range(args.reps + 1):
                order = list(ways.items())
                for label, way in order if rep % 2 else order[::-1]:
                    t0 = time.perf_counter()
                    for x, w, f, p in zip(xs, weights, wide, packed, strict=True):
                        way(x, w, f, p)
                    if rep:  # the first pass warms up
                        times[label].append(time.perf_counter() - t0)
            ms = {label: 1000 * statistics.median(t) for label, t in times.items()}
            p = ms.get("packed", float("nan"))
            f32 = ms["f32"]
            print(f"| {name} | {rows} | {ms['gemv']:.2f} | {p:.2f} | {f32:.2f} | "
                  f"{f32 / ms['gemv']:.2f}x | **{f32 / p:.2f}x** | "
                  f"{flops_per_row * rows / f32 / 1e6:.0f} |", flush=True)


if __name__ == "__main__":
    main()
