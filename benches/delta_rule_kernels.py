"""The Gated DeltaNet CPU kernels one by one, at the Qwen3.5-0.8B shape (16 value heads of
128 x 128, 6144 convolution channels with a kernel of 4), through the functions the model
calls (``iron_batch.layers.delta_kernels``):

- decode: one token for each of ``--rows`` sequences over 18 layers' state pools (the
  states far past the caches, as in a decode step), float32 and bf16 states, with the
  state bytes read and written per second;
- the causal convolution of a decode step (``--rows`` sequences, one layer);
- a prompt chunk of ``--tokens`` tokens of one sequence: the convolution and the chunked
  delta rule (float32 and bf16 states), one layer.

Best of several calls after a warm-up, in ms. Two builds side by side, the builds taking
turns each round:

    python benches/delta_rule_kernels.py --rounds 3 --ab OTHER_CHECKOUT/python
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

from ab_builds import best_seconds, run  # benches/, next to this script


def _best_ms(fn: Callable[[], Any], calls: int, warmup_s: float) -> float:
    return best_seconds(fn, calls, warmup_s) * 1e3


def measure(rows: int, tokens: int, warmup_s: float) -> dict[str, float]:
    import torch
    from iron_batch.layers import delta_kernels as dk

    torch.manual_seed(0)
    heads, d, channels, layers = 16, 128, 6144, 18
    out: dict[str, float] = {}
    q = torch.randn(rows, heads, d)
    k = torch.nn.functional.normalize(torch.randn(rows, heads, d), dim=-1)
    v = torch.randn(rows, heads, d)
    g, beta = -torch.rand(rows, heads), torch.rand(rows, heads)
    slots = torch.arange(rows)
    for dtype in (torch.float32, torch.bfloat16):
        pools = [torch.zeros(rows, heads, d, d, dtype=dtype) for _ in range(layers)]

        def step(pools: list[torch.Tensor] = pools) -> None:
            for pool in pools:
                dk.delta_rule_decode(q, k, v, g, beta, pool, slots)

        name = "f32" if dtype == torch.float32 else "bf16"
        ms = _best_ms(step, 10, warmup_s)
        out[f"decode_{name}_ms"] = ms
        out[f"decode_{name}_gbs"] = 2 * sum(p.nbytes for p in pools) / ms / 1e6
    x = torch.randn(rows, channels).bfloat16()
    weight = torch.randn(channels, 4).bfloat16()
    windows = torch.zeros(rows, channels, 3)
    out["conv_decode_ms"] = _best_ms(lambda: dk.causal_conv(x, windows, weight, slots), 30,
                                     warmup_s / 4)
    xc = torch.randn(tokens, channels).bfloat16()
    window = torch.zeros(channels, 3)
    out["conv_chunk_ms"] = _best_ms(lambda: dk.causal_conv(xc, window, weight, None), 10,
                                    warmup_s / 4)
    qc = torch.randn(tokens, heads, d) * d**-0.5
    kc = torch.nn.functional.normalize(torch.randn(tokens, heads, d), dim=-1)
    vc = torch.randn(tokens, heads, d)
    gc, bc = -torch.rand(tokens, heads) * 0.1, torch.rand(tokens, heads)
    for dtype in (torch.float32, torch.bfloat16):
        state = torch.zeros(heads, d, d, dtype=dtype)
        name = "f32" if dtype == torch.float32 else "bf16"
        out[f"chunk_{name}_ms"] = _best_ms(
            lambda s=state: dk.delta_rule_chunk(qc, kc, vc, gc, bc, s), 10, warmup_s / 4)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=16, help="decoding sequences")
    ap.add_argument("--tokens", type=int, default=128, help="tokens of the prompt chunk")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup-s", type=float, default=5.0)
    ap.add_argument("--ab", help="the python/ folder of another checkout (built in place): "
                    "measured in turn with this one")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure(args.rows, args.tokens, args.warmup_s)))
        return
    run(__file__, ["--rows", str(args.rows), "--tokens", str(args.tokens), "--warmup-s",
                   str(args.warmup_s)], args.rounds, args.ab)

if __name__ == "__main__":
    main()
