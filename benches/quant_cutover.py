"""Where the quantized GEMV stops paying: each layout's block GEMV against a bf16
dequantization and a dense GEMM (what ``QuantWeight.linear`` does above its GEMV rows), at
several row counts, in process.

SmolLM2-135M's projection shapes (30 layers of q/k/v, o, gate/up, down; the GGUF block
formats take k = 512 and 1536, whole super-blocks) with random blocks, every matrix called
through ``QuantWeight.linear`` once with the GEMV forced and once with the dense path
forced, taking turns; the median of ``--reps`` passes. The ratio below 1 is where the GEMV
wins.

    python benches/quant_cutover.py --kinds q4 q8 --rows 8 12 16 24 32
    python benches/quant_cutover.py --kinds q4_k q5_0 q6_k --rows 4 8 12 16
    python benches/quant_cutover.py --kinds q4_k q6_k --rows 8 12 16 --shape llama3b

``--shape llama3b``: two layers of a Llama-3.2-3B shape's projections instead (q/k/v 5120 x
3072, o 3072 x 3072, gate/up 16384 x 3072, down 3072 x 8192), whose bf16 dequantization
no longer fits the caches.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from iron_batch.layers.quant import QuantWeight

# (values a block, bytes a block, offsets of the block's f16 fields) of the GGUF formats.
BLOCKS = {"q4_k": (256, 144, (0, 2)), "q6_k": (256, 210, (208,)), "q5_0": (32, 22, (0,)),
          "q8_0": (32, 34, (0,))}


def weight(rng: np.random.Generator, n: int, k: int, kind: str) -> QuantWeight:
    if kind in BLOCKS:
        values, size, halves = BLOCKS[kind]
        data = rng.integers(0, 256, size=(n * k // values, size), dtype=np.uint8)
        for at in halves:
            data[:, at:at + 2] = np.array([0.002], dtype=np.float16).view(np.uint8)
        return QuantWeight(kind, n, k, torch.from_numpy(data.reshape(n, -1)),
                           torch.empty(0, dtype=torch.float16), None, kind.upper())
    bits = 4 if kind == "q4" else 8
    quants = torch.from_numpy(rng.integers(0, 256, size=(n, k * bits // 8), dtype=np.uint8))
    if kind == "q8":
        quants = quants.view(torch.int8)
    scale = torch.from_numpy((rng.random((n, k // 32)) * 0.004 + 0.001).astype(np.float16))
    low = (torch.from_numpy((rng.random((n, k // 32)) * -0.02).astype(np.float16))
           if kind == "q4" else None)
    return QuantWeight(kind, n, k, quants, scale, low, kind.upper())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kinds", nargs="+", default=["q4", "q8", "q4_k", "q5_0", "q6_k"])
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 12, 16, 24])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--shape", choices=["smollm2", "llama3b"], default="smollm2")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    print("| layout | rows | GEMV (ms) | dequantize + GEMM (ms) | **GEMV / dense** |")
    print("|---|---|---|---|---|")
    for kind in args.kinds:
        k0 = 512 if kind in BLOCKS else 576
        shapes = [(1024 if kind in BLOCKS else 960, k0), (k0, k0), (3072, k0), (k0, 1536)]
        layers = 30
        if args.shape == "llama3b":
            shapes, layers = [(5120, 3072), (3072, 3072), (16384, 3072), (3072, 8192)], 2
        mats = [weight(rng, n, k, kind) for _ in range(layers) for n, k in shapes]
        for rows in args.rows:
            xs = {k: torch.randn(rows, k).bfloat16() for k in {w.k for w in mats}}
            times: dict[str, list[float]] = {"gemv": [], "dense": []}
            for _ in range(args.reps):
                for label, limit in (("gemv", 1 << 20), ("dense", 0)):
                    t0 = time.perf_counter()
                    for w in mats:
                        # The block formats cap their GEMV rows: call the kernel directly.
                        if label == "gemv" and rows > w.gemv_rows(limit):
                            _gemv(w, xs[w.k])
                        else:
                            w.linear(xs[w.k], gemv_rows=limit)
                    times[label].append(time.perf_counter() - t0)
            g, d = statistics.median(times["gemv"]), statistics.median(times["dense"])
            print(f"| {kind} | {rows} | {1000 * g:.2f} | {1000 * d:.2f} | **{g / d:.2f}x** |",
                  flush=True)


def _gemv(w: QuantWeight, x: torch.Tensor) -> torch.Tensor:
    """The block GEMV on every row of ``x``, whatever the layout's cap."""
    from iron_batch import _core
    from iron_batch.platform.openmp import entry_points

    out = torch.empty(x.shape[0], w.n, dtype=torch.bfloat16)
    _core._gemv_quant(out.data_ptr(), x.data_ptr(), w.kind, *w.addresses, 0, rows=x.shape[0],
                      n=w.n, k=w.k, threads=torch.get_num_threads(), openmp=entry_points())
    return out


if __name__ == "__main__":
    main()
