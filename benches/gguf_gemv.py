"""The GGUF block GEMV (K-quants, Q5_0/Q5_1, Q4_1, Q8_0 in the file's own bytes, and the
"q8" and "q4" layouts that plain Q8_0, Q4_0 and Q4_1 matrices are regrouped into) format by
format: the weight bytes read per second at 1, 2 and 4 activation rows, through the kernel
the quantized projections call (``iron_batch._core._gemv_quant``), against a copy of as
many bytes in the same run.

Each format gets matrices of 4096 x 8192 random blocks (small finite scales) that add up to
``--mib`` MiB, more than the last-level cache, called one after another as a model's layers
would be; the best of several such passes after a warm-up. Two builds side by side, taking
turns each round:

    python benches/gguf_gemv.py --rounds 3 --ab OTHER_CHECKOUT/python
"""

from __future__ import annotations

import argparse
import json

from ab_builds import best_seconds, run  # benches/, next to this script

# (layout name, values a block, bytes a block, offsets of the block's f16 fields)
FORMATS = [
    ("q4_k", 256, 144, (0, 2)),
    ("q5_k", 256, 176, (0, 2)),
    ("q6_k", 256, 210, (208,)),
    ("q5_0", 32, 22, (0,)),
    ("q5_1", 32, 24, (0, 2)),
    ("q4_1", 32, 20, (0, 2)),
    ("q8_0", 32, 34, (0,)),
]
N, K = 4096, 8192


def measure(rows: list[int], mib: int, warmup_s: float) -> dict[str, float]:
    import numpy as np
    import torch
    from iron_batch import _core

    rng = np.random.default_rng(0)
    threads = torch.get_num_threads()
    out: dict[str, float] = {}
    src = torch.empty(mib << 18, dtype=torch.float32).normal_()
    dst = torch.empty_like(src)
    copy = best_seconds(lambda: dst.copy_(src), 10, 1.0)
    out["copy GB/s (read + write)"] = 2 * src.numel() * 4 / copy / 1e9
    for name, values, size, halves in FORMATS:
        blocks = N * K // values
        count = max(1, (mib << 20) // (blocks * size))
        mats = []
        for _ in range(count):
            data = rng.integers(0, 256, size=(blocks, size), dtype=np.uint8)
            scale = np.array([0.002], dtype=np.float16).view(np.uint8)
            for at in halves:
                data[:, at:at + 2] = scale
            mats.append(torch.from_numpy(data.reshape(-1)))
        nbytes = count * blocks * size
        for r in rows:
            x = torch.randn(r, K).bfloat16()
            y = torch.empty(r, N, dtype=torch.bfloat16)

            def call(x: torch.Tensor = x, y: torch.Tensor = y, r: int = r,
                     mats: list[torch.Tensor] = mats, name: str = name) -> None:
                for m in mats:
                    _core._gemv_quant(y.data_ptr(), x.data_ptr(), name, m.data_ptr(), 0, 0, 0,
                                      rows=r, n=N, k=K, threads=threads)

            s = best_seconds(call, 5, warmup_s)
            out[f"{name} {r} row GB/s"] = nbytes / s / 1e9
    # The layouts Q8_0, Q4_0 and Q4_1 matrices are regrouped into at load (`crate::quant`):
    # "q8" i8 quants, "q4" packed nibbles, each with an f16 scale (and min) per 32 weights.
    for name, bits in (("q8", 8), ("q4", 4)):
        count = max(1, (mib << 20) // (N * K * bits // 8))
        mats = [(torch.from_numpy(rng.integers(0, 256, size=N * K * bits // 8, dtype=np.uint8)),
                 torch.full((N * K // 32,), 0.002, dtype=torch.float16),
                 torch.full((N * K // 32,), -0.01, dtype=torch.float16)) for _ in range(count)]
        nbytes = count * (N * K * bits // 8 + N * K // 32 * (2 if bits == 8 else 4))
        for r in rows:
            x = torch.randn(r, K).bfloat16()
            y = torch.empty(r, N, dtype=torch.bfloat16)

            def call_regrouped(x: torch.Tensor = x, y: torch.Tensor = y, r: int = r,
                               mats: list[tuple[torch.Tensor, ...]] = mats,
                               name: str = name) -> None:
                for q, scale, low in mats:
                    _core._gemv_quant(y.data_ptr(), x.data_ptr(), name, q.data_ptr(),
                                      scale.data_ptr(), low.data_ptr(), 0, rows=r, n=N, k=K,
                                      threads=threads)

            s = best_seconds(call_regrouped, 5, warmup_s)
            out[f"{name} (regrouped) {r} row GB/s"] = nbytes / s / 1e9
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--mib", type=int, default=256, help="MiB of weights per format")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup-s", type=float, default=2.0)
    ap.add_argument("--ab", help="the python/ folder of another checkout (built in place): "
                    "measured in turn with this one")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure(args.rows, args.mib, args.warmup_s)))
        return
    run(__file__, ["--mib", str(args.mib), "--warmup-s", str(args.warmup_s), "--rows",
                   *map(str, args.rows)], args.rounds, args.ab, digits=1)

if __name__ == "__main__":
    main()
