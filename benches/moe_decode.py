"""One mixture-of-experts layer at decode batch sizes: the selected-experts kernel against
the grouped path (torch GEMMs on each chosen expert's gathered rows), and against the
floor of reading the active experts' bytes once at copy bandwidth, measured side by side.

    python benches/moe_decode.py --shape qwen3-30b-a3b --quantization int4

The layer has random weights of the shape's published sizes (one layer: its experts and
router). Each figure is the median of ``--repeat`` calls; the copy bandwidth is sampled
right before and after.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from iron_batch.layers import quant
from iron_batch.layers.linear import Linear
from iron_batch.layers.moe import MoE, Router, stacked
from iron_batch.platform import cpu, switches

#: name -> (hidden, experts, expert rows, top k)
SHAPES = {
    "qwen3-30b-a3b": (2048, 128, 768, 8),
    "qwen3-moe-small": (768, 32, 384, 4),
    "mixtral-8x7b-half": (4096, 8, 7168, 2),
}


def copy_bandwidth_gbs() -> float:
    src = torch.empty(256 * 2**20 // 4, dtype=torch.float32).uniform_()
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(6):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.numel() * 4 / best / 1e9


def build(shape: str, mode: str | None) -> MoE:
    hidden, experts, inter, top_k = SHAPES[shape]
    kernels = cpu.select(torch.device("cpu"), torch.bfloat16, switches.read())
    torch.manual_seed(0)

    def weight(n: int, k: int) -> torch.Tensor | quant.QuantWeight:
        w = torch.randn(n, k) * 0.02
        if mode == "int8":
            return quant.quantize_int8(w)
        if mode == "int4":
            return quant.quantize_int4(w)
        return w.bfloat16()

    gate_up = stacked(Linear(weight(experts * 2 * inter, hidden), kernels=kernels), experts,
                      kernels)
    down = stacked(Linear(weight(experts * hidden, inter), kernels=kernels), experts, kernels)
    router = Router((torch.randn(experts, hidden) * 0.02).bfloat16(), top_k, renormalize=True)
    return MoE(router, gate_up, down, "silu")


def active_bytes(moe: MoE, ids: torch.Tensor) -> int:
    per_expert = sum(sum(t.numel() * t.element_size() for t in lin.tensors())
                     for lin in (moe.gate_up, moe.down)) // moe.num_experts
    return per_expert * len(set(ids.flatten().tolist()))


def timed(fn, repeat: int) -> float:  # type: ignore[no-untyped-def]
    for _ in range(3):
        fn()
    samples = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-moe-small")
    ap.add_argument("--quantization", choices=["int8", "int4"], default=None)
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--repeat", type=int, default=30)
    args = ap.parse_args()
    moe = build(args.shape, args.quantization)
    assert moe.decode_kernel
    before = copy_bandwidth_gbs()
    results = []
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, moe.router.weight.shape[1]).bfloat16()
            weights, ids = moe.router(x)
            # The kernel itself at every row count (``moe.experts`` takes it only up to
            # ``moe.kernel_rows``).
            kernel = timed(lambda x=x, w=weights, i=ids: moe._decode(x, w, i), args.repeat)
            grouped = timed(lambda x=x, w=weights, i=ids: moe._grouped(x, w, i), args.repeat)
            results.append((rows, active_bytes(moe, ids), kernel, grouped))
    after = copy_bandwidth_gbs()
    bw = (before + after) / 2
    mode = args.quantization or "bf16"
    print(f"{args.shape} experts in {mode}, {torch.get_num_threads()} threads, copy "
          f"bandwidth {before:.1f}/{after:.1f} GB/s")
    print("| rows | active expert MB | kernel ms | grouped ms | grouped / kernel "
          "| kernel / floor |")
    print("|---|---|---|---|---|---|")
    for rows, nbytes, kernel, grouped in results:
        floor = nbytes / (bw * 1e9)
        print(f"| {rows} | {nbytes / 1e6:.1f} | {kernel * 1e3:.2f} | {grouped * 1e3:.2f} | "
              f"{grouped / kernel:.2f}x | {kernel / floor:.2f}x |")


if __name__ == "__main__":
    main()
