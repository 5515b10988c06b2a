"""Where a Qwen3.5 prompt step's time goes, in process: the wall time of one step of
``--prompts`` prompts of ``--tokens`` tokens, and the time spent inside its parts (the
projections' GEMMs, the Gated DeltaNet layer and, inside it, the convolution and
delta-rule kernels, the gated norm, the q/k L2 norms, and the centred RMSNorms), each part
timed around its Python call. The last of ``--passes`` steps is printed.

    python benches/prompt_step_parts.py --shape qwen3.5-0.8b
"""

from __future__ import annotations

import argparse
import collections
import functools
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch_throughput as tt  # noqa: E402
from iron_batch import LLM, SamplingParams  # noqa: E402
from iron_batch.layers import cpu_kernels, delta_kernels, gated_delta  # noqa: E402
from iron_batch.models import qwen3_5  # noqa: E402

spent: collections.Counter[str] = collections.Counter()


def timed(owner: Any, name: str, part: str) -> None:
    inner = getattr(owner, name)

    @functools.wraps(inner)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[part] += time.perf_counter() - t

    setattr(owner, name, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3.5-0.8b",
                    choices=[s for s in tt.SHAPES if s.startswith("qwen3.5")])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--passes", type=int, default=3)
    args = ap.parse_args()
    # The kernels' module functions are called through their modules, so wrapping the
    # module attributes times every call.
    timed(cpu_kernels, "packed_linear", "projections (GEMM)")
    timed(gated_delta.GatedDeltaNet, "__call__", "Gated DeltaNet layers, all of them")
    timed(delta_kernels, "delta_rule_chunk", "  delta rule (chunk kernel)")
    timed(delta_kernels, "causal_conv", "  causal convolution kernel")
    timed(gated_delta.GatedDeltaNet, "_gated_norm", "  gated norm")
    timed(gated_delta, "l2_normalize", "  q/k L2 norms")
    timed(qwen3_5.CenteredNorm, "__call__", "centred RMSNorms")
    with tempfile.TemporaryDirectory() as tmp:
        folder = tt.build_shape_model(args.shape, torch.bfloat16, Path(tmp))
        tokens = args.prompts * args.tokens
        llm = LLM(model=str(folder), dtype="bfloat16", device="cpu", max_batch_tokens=tokens,
                  kv_cache_memory_gb=4)
        vocab = llm.backend.model.config.vocab_size
        rng = np.random.default_rng(0)
        engine = llm.engine
        params = SamplingParams(max_new_tokens=1, ignore_eos=True)
        for n in range(args.passes):
            prompts = rng.integers(100, vocab - 100, (args.prompts, args.tokens))
            for i, p in enumerate(prompts):
                engine.add_request(f"p{n}-{i}", p.tolist(), params)
            spent.clear()
            t = time.perf_counter()
            while engine.has_unfinished():
                engine.step()
            total = time.perf_counter() - t
    print(f"{args.shape}: one step of {args.prompts} prompts x {args.tokens} tokens: "
          f"{total * 1e3:.0f} ms")
    print("| part | ms |\n|---|---|")
    for part, seconds in spent.items():
        print(f"| {part} | {seconds * 1e3:.0f} |")


if __name__ == "__main__":
    main()
