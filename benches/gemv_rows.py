"""The bf16 GEMV of two builds side by side, in one process: SmolLM2-135M's 30 layers of
projections and its LM head at several activation row counts. Each build's extension is
loaded from its checkout and the two are called in turns (medians of ``--reps`` calls after
a warm-up), so each pair of figures meets the same seconds of the machine's memory
bandwidth.

    python benches/gemv_rows.py --other OTHER/python --rows 1 2 5 8
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from iron_batch.platform.openmp import entry_points  # noqa: E402
from quant_rows import load_core  # noqa: E402

#: SmolLM2-135M: hidden 576, q/k/v 576+2*192, MLP 1536, vocabulary 49152.
LAYER = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
HEAD = (49152, 576)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--other", required=True, help="the other build's python/ folder")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 5, 8])
    ap.add_argument("--reps", type=int, default=21)
    args = ap.parse_args()
    here = load_core(str(Path(__file__).resolve().parent.parent / "python"), "this")
    other = load_core(args.other, "other")
    torch.manual_seed(0)
    sets = {
        "projections (30 layers)": [torch.randn(n, k).bfloat16() / 8
                                    for _ in range(30) for n, k in LAYER],
        "LM head": [torch.randn(*HEAD).bfloat16() / 8],
    }
    threads = torch.get_num_threads()
    openmp = entry_points()  # the OpenMP team both builds run on, as the model does

    def call(core: ModuleType, mats: list[torch.Tensor], rows: int) -> float:
        xs = {k: torch.randn(rows, k).bfloat16() for k in {m.shape[1] for m in mats}}
        outs = [torch.empty(rows, m.shape[0], dtype=torch.bfloat16) for m in mats]
        t = time.perf_counter()
        for m, o in zip(mats, outs, strict=True):
            core._gemv_bf16(o.data_ptr(), xs[m.shape[1]].data_ptr(), m.data_ptr(), 0,
                            rows=rows, n=m.shape[0], k=m.shape[1], threads=threads,
                            openmp=openmp)
        return time.perf_counter() - t

    for core in (here, other):  # warm-up
        for _ in range(20):
            call(core, sets["projections (30 layers)"], 1)
    print("| matrices | rows | other (ms) | this (ms) | this / other |")
    print("|---|---|---|---|---|")
    for name, mats in sets.items():
        for rows in args.rows:
            t: dict[str, list[float]] = {"this": [], "other": []}
            for i in range(args.reps):
                order = (("this", here), ("other", other))
                for label, core in order if i % 2 == 0 else order[::-1]:
                    t[label].append(call(core, mats, rows))
            a, b = statistics.median(t["this"]), statistics.median(t["other"])
            print(f"| {name} | {rows} | {b * 1e3:.2f} | {a * 1e3:.2f} | {a / b:.2f}x |",
                  flush=True)


if __name__ == "__main__":
    main()
