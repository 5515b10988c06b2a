"""The bf16 GEMV's read bandwidth against a plain copy, in the same run.

Times ``y = x W^T`` for a 8192 x 4096 bf16 matrix (64 MiB, far past the caches) at 1 to 8
activation rows through the Rust GEMV, a copy of the same bytes (read + write counted) and
torch's sum over them (read only), best of 20 after a warm-up of several seconds, three rounds:

    python benches/gemv_bandwidth.py --rows 1 2 5 8
"""

from __future__ import annotations

import argparse
import time

import torch

try:
    from iron_batch.layers import cpu_kernels
except ImportError:  # builds from before the layers package
    from iron_batch.models import cpu_fused as cpu_kernels  # type: ignore[no-redef]


def best(f, reps: int = 20) -> float:  # type: ignore[no-untyped-def]
    f()
    out = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        out = min(out, time.perf_counter() - t0)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    torch.manual_seed(0)
    n, k = 8192, 4096
    w = torch.randn(n, k).bfloat16()
    src = torch.empty(n * k // 2, dtype=torch.float32).normal_()
    dst = torch.empty_like(src)
    end = time.time() + 6
    while time.time() < end:
        cpu_kernels.linear(torch.randn(1, k).bfloat16(), w, None)
    nbytes = n * k * 2
    for rnd in range(args.rounds):
        copy = best(lambda: dst.copy_(src))
        read = best(lambda: src.sum())
        parts = []
        for rows in args.rows:
            x = torch.randn(rows, k).bfloat16()
            s = best(lambda x=x: cpu_kernels.linear(x, w, None))
            parts.append(f"{rows} rows {s * 1e3:.2f} ms ({nbytes / s / 1e9:.1f} GB/s)")
        print(f"round {rnd}: copy {2 * nbytes / copy / 1e9:.1f} GB/s (read + write); "
              f"f32 sum {nbytes / read / 1e9:.1f} GB/s (read); " + ", ".join(parts))


if __name__ == "__main__":
    main()
