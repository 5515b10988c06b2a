"""The CPU GEMVs by activation row count, two builds in one process: what each extra row of
a step (a speculative step's verification rows, a batch of decoding sequences) costs in
bf16 (``--sets bf16``: ``_gemv_bf16``), in the "q4" and "q8" layouts that GGUF
Q4_0/Q4_1/Q8_0 matrices and ``--quantization int4|int8`` run on, and in the GGUF block
formats kept in their own bytes.

SmolLM2-135M's projections (30 layers of q/k/v, o, gate/up and down, random Q4 blocks) and
its 49152 x 576 Q8 LM head, each set called matrix by matrix through
``iron_batch._core._gemv_quant`` as a decode step calls them; plus the same projections in
Q8 (``--quantization int8``) and in Q5_0 (what llama.cpp's Q4_K_M makes of most of
SmolLM2's matrices); and three layers of a Llama-3.2-3B shape's projections in Q4_K and two
in Q6_K; and 32 experts of a Qwen3-30B-A3B shape, each a 1536 x 2048 gate/up in Q4_K and
a 2048 x 768 down in Q6_K (what Q4_K_M makes of them), rows of three super-blocks
(``--sets`` picks). Both builds' extension modules are loaded side by side and
called in turns, the order flipping every repetition, so that both meet the same minutes of
this machine's memory bandwidth; each figure is the median of ``--reps`` calls.

    python benches/quant_rows.py --other /path/to/other/checkout/python
    python benches/quant_rows.py --other OTHER/python --sets q4_k q6_k q5_0 --rows 1 4 8
    python benches/quant_rows.py --other OTHER/python --sets moe_k q4_k q6_k --rows 1 2 4
    python benches/quant_rows.py --other OTHER/python --sets bf16 --rows 1 2 5 8
    python benches/quant_rows.py --other OTHER/python --sets bf16_4b --rows 1 2

``bf16_4b``: four layers of a Qwen3.5-4B shape's MLP in bf16 (18432 x 2560 gate/up, 2560 x
9216 down), 566 MB.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import statistics
import time
from pathlib import Path
from types import ModuleType

import numpy as np
import torch
from iron_batch.platform.openmp import entry_points

LAYERS = 30
# (n, k) of one layer's projections: fused q/k/v, o, fused gate/up, down.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
HEAD = (49152, 576)
# A Llama-3.2-3B layer's projections: fused q/k/v, o, fused gate/up, down.
LLAMA3B = [(5120, 3072), (3072, 3072), (16384, 3072), (3072, 8192)]
# A Qwen3.5-4B layer's MLP: fused gate/up, down (bf16, four layers: 566 MB, past the caches).
QWEN35_4B_MLP = [(18432, 2560), (2560, 9216)]
# A Qwen3-30B-A3B expert's projections: fused gate/up (Q4_K), down (Q6_K).
EXPERT = [(1536, 2048, "q4_k"), (2048, 768, "q6_k")]
# GGUF block formats: values a block, bytes a block, offsets of the block's f16 fields.
BLOCK_FORMATS = {"q4_k": (256, 144, (0, 2)), "q6_k": (256, 210, (208,)), "q5_0": (32, 22, (0,))}

Matrix = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, int, int, str]


def load_core(python_dir: str, name: str) -> ModuleType:
    """The ``_core`` extension of the checkout whose ``python/`` folder is ``python_dir``."""
    found = glob.glob(str(Path(python_dir) / "iron_batch" / "_core*.so"))
    if not found:
        raise SystemExit(f"no built iron_batch/_core*.so under {python_dir}")
    spec = importlib.util.spec_from_file_location(f"{name}._core", found[0])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def matrix(rng: np.random.Generator, n: int, k: int, kind: str) -> Matrix:
    bits = 4 if kind == "q4" else 8
    quants = torch.from_numpy(rng.integers(0, 256, size=n * k * bits // 8, dtype=np.uint8))
    scale = torch.from_numpy((rng.random(n * k // 32) * 0.004 + 0.001).astype(np.float16))
    low = torch.from_numpy((rng.random(n * k // 32) * -0.02).astype(np.float16))
    return quants, scale, low, n, k, kind


def blocks(rng: np.random.Generator, n: int, k: int, kind: str) -> Matrix:
    """Random blocks of a GGUF format, their f16 fields small finite scales."""
    values, size, halves = BLOCK_FORMATS[kind]
    data = rng.integers(0, 256, size=(n * k // values, size), dtype=np.uint8)
    for at in halves:
        data[:, at:at + 2] = np.array([0.002], dtype=np.float16).view(np.uint8)
    return torch.from_numpy(data.reshape(-1)), None, None, n, k, kind


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--other", required=True,
                    help="the python/ folder of the other checkout (built in place)")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 5, 8])
    ap.add_argument("--reps", type=int, default=21)
    ap.add_argument("--warmup-s", type=float, default=5.0)
    ap.add_argument("--sets", nargs="+", default=["q4", "q8"],
                    choices=["bf16", "bf16_4b", "q4", "q8", "q5_0", "q4_k", "q6_k", "moe_k"])
    args = ap.parse_args()
    this = load_core(str(Path(__file__).resolve().parents[1] / "python"), "this")
    other = load_core(args.other, "other")
    rng = np.random.default_rng(0)
    sets: dict[str, list[Matrix]] = {}
    if "bf16" in args.sets:
        torch.manual_seed(0)
        sets["bf16 projections"] = [(torch.randn(n, k).bfloat16() / 8, None, None, n, k, "bf16")
                                    for _ in range(LAYERS) for n, k in SHAPES]
        sets["bf16 LM head"] = [(torch.randn(*HEAD).bfloat16() / 8, None, None, *HEAD, "bf16")]
    if "bf16_4b" in args.sets:
        torch.manual_seed(0)
        sets["bf16 Qwen3.5-4B MLP, 4 layers"] = [
            (torch.randn(n, k).bfloat16() / 8, None, None, n, k, "bf16")
            for _ in range(4) for n, k in QWEN35_4B_MLP]
    if "q4" in args.sets:
        sets["q4 projections"] = [matrix(rng, n, k, "q4") for _ in range(LAYERS) for n, k in SHAPES]
    if "q8" in args.sets:
        sets["q8 LM head"] = [matrix(rng, *HEAD, "q8")]
        sets["q8 projections"] = [matrix(rng, n, k, "q8") for _ in range(LAYERS)
                                  for n, k in SHAPES]
    if "q5_0" in args.sets:
        sets["q5_0 projections"] = [blocks(rng, n, k, "q5_0") for _ in range(LAYERS)
                                    for n, k in SHAPES]
    for kind, layers in (("q4_k", 3), ("q6_k", 2)):
        if kind in args.sets:
            sets[f"{kind} 3B layers"] = [blocks(rng, n, k, kind) for _ in range(layers)
                                         for n, k in LLAMA3B]
    if "moe_k" in args.sets:
        sets["moe_k 32 experts"] = [blocks(rng, n, k, kind) for _ in range(32)
                                    for n, k, kind in EXPERT]
    threads = torch.get_num_threads()
    openmp = entry_points()
    xs = {(r, k): torch.randn(r, k).bfloat16() for r in args.rows
          for k in (576, 768, 1536, 2048, 2560, 3072, 8192, 9216)}
    ys: dict[tuple[int, int], torch.Tensor] = {}

    def call(core: ModuleType, mats: list[Matrix], rows: int) -> None:
        for quants, scale, low, n, k, kind in mats:
            x = xs[(rows, k)]
            y = ys.setdefault((rows, n), torch.empty(rows, n, dtype=torch.bfloat16))
            if kind == "bf16":
                core._gemv_bf16(y.data_ptr(), x.data_ptr(), quants.data_ptr(), 0, rows=rows,
                                n=n, k=k, threads=threads, openmp=openmp)
                continue
            core._gemv_quant(y.data_ptr(), x.data_ptr(), kind, quants.data_ptr(),
                             0 if scale is None else scale.data_ptr(),
                             0 if low is None else low.data_ptr(), 0, rows=rows, n=n, k=k,
                             threads=threads, openmp=openmp)

    deadline = time.monotonic() + args.warmup_s
    while time.monotonic() < deadline:
        for core in (this, other):
            call(core, next(iter(sets.values())), 1)
    print("| matrices | rows | other (ms) | this (ms) | **this / other** |")
    print("|---|---|---|---|---|")
    for name, mats in sets.items():
        for rows in args.rows:
            times: dict[str, list[float]] = {"this": [], "other": []}
            for rep in range(args.reps):
                order = [("this", this), ("other", other)]
                for label, core in order if rep % 2 else order[::-1]:
                    t0 = time.perf_counter()
                    call(core, mats, rows)
                    times[label].append(time.perf_counter() - t0)
            a, b = statistics.median(times["other"]), statistics.median(times["this"])
            print(f"| {name} | {rows} | {1000 * a:.2f} | {1000 * b:.2f} | **{b / a:.2f}x** |",
                  flush=True)


if __name__ == "__main__":
    main()
