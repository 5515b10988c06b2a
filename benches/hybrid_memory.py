"""How many 8k-token sequences one KV pool serves with a Gemma-3-like layer pattern (by
default five sliding-window layers of 1024 tokens to one global layer; Gemma-3-1B's own is
``--window 512 --sliding-layers 22 --full-layers 4``), with cache groups against all-full
accounting (every layer keeps every token), through the real scheduler.

The pool is fixed in bytes: ``--full-seqs`` sequences of ``--context`` tokens if every layer
were full. With cache groups it is split by ``split_pool`` between a sliding group (one
layer unit per token per sliding layer) and a full group (one per full layer). Many
requests of ``--context`` tokens (prompt plus ``--new`` generated, long enough that memory,
not the token budget, bounds how many run) go through a model-free loop; we report how
many sequences run at once (the median over the middle half of the steps, and the most),
the blocks one sequence holds near full context (in blocks of one layer unit), and the
preemptions.

    python benches/hybrid_memory.py
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from iron_batch import CacheGroup, Scheduler, SchedulerConfig
from iron_batch._core import split_pool

#: Layer units per token of the sliding and the full group (set from the flags).
UNITS = {"sliding": 5, "full": 1}


def _units(cfg: SchedulerConfig, groups: list[dict]) -> int:
    """Layer-unit blocks the groups hold (all-full accounting: every layer per block)."""
    if not cfg.cache_groups:
        return sum(g["used"] for g in groups) * (UNITS["sliding"] + UNITS["full"])
    return sum(g["used"] * UNITS[g["kind"]] for g in groups)


def run(cfg: SchedulerConfig, requests: int, prompt: int, new: int) -> dict[str, float]:
    s = Scheduler(cfg)
    for i in range(requests):
        s.add_request(f"r{i}", np.arange(i, i + prompt) % 30000, new)
    peak = steps = 0
    running: list[int] = []
    held_at_full: list[float] = []
    start = time.perf_counter()
    while s.has_work():
        batch = s.schedule()
        s.commit(batch, np.full(batch.num_samples, 5))
        steps += 1
        peak = max(peak, s.num_running)
        running.append(s.num_running)
        lens = batch.seq_lens
        if len(lens) and lens.max() >= prompt + new - 1 and s.num_running:
            # Units of one layer-block held per running sequence near full context.
            held_at_full.append(_units(cfg, s.group_stats()) / s.num_running)
    stats = s.stats()
    busy = running[len(running) // 4 : 3 * len(running) // 4]
    return {"peak_running": peak, "median_running": float(np.median(busy)),
            "preemptions": stats["preemptions"], "steps": steps,
            "units_per_seq": float(np.median(held_at_full)) if held_at_full else 0.0,
            "seconds": time.perf_counter() - start}


def one_sequence_units(cfg: SchedulerConfig, context: int) -> int:
    """Layer-unit blocks one sequence holds when it decodes its last token alone."""
    s = Scheduler(cfg)
    s.add_request("one", np.arange(context - 64) % 30000, 64)
    units = 0
    while s.has_work():
        batch = s.schedule()
        if batch.num_samples and batch.num_tokens == 1:
            units = _units(cfg, s.group_stats())
        s.commit(batch, np.full(batch.num_samples, 5))
    return units


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--new", type=int, default=2048)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--sliding-layers", type=int, default=5)
    ap.add_argument("--full-layers", type=int, default=1)
    ap.add_argument("--full-seqs", type=int, default=40,
                    help="sequences the pool holds with all-full accounting")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--chunk", type=int, default=2048, help="max_batch_tokens")
    ap.add_argument("--block-size", type=int, default=16)
    args = ap.parse_args()
    bs, ctx = args.block_size, args.context
    UNITS.update(sliding=args.sliding_layers, full=args.full_layers)
    layers = args.sliding_layers + args.full_layers
    blocks_full = args.full_seqs * (ctx // bs)
    seqs = 4 * args.full_seqs + 64
    base = dict(kv_block_size=bs, max_batch_tokens=args.chunk, max_running_seqs=seqs)
    full = SchedulerConfig(total_kv_blocks=blocks_full, **base)
    # One layer unit per token per layer: the pool is blocks_full * bs * layers units.
    split = split_pool(blocks_full * bs * layers,
                       [("sliding", args.window, args.sliding_layers),
                        ("full", None, args.full_layers)], bs, seqs, ctx, bs)
    groups = [CacheGroup("sliding", split[0].size, window=args.window),
              CacheGroup("full", split[1].size)]
    hybrid = SchedulerConfig(total_kv_blocks=1, cache_groups=groups, **base)
    prompt = ctx - args.new
    a = run(full, args.requests, prompt, args.new)
    b = run(hybrid, args.requests, prompt, args.new)
    print(f"pool: {blocks_full} all-full blocks of {bs} tokens x {layers} layer units; groups: "
          f"sliding {split[0].size} blocks x {args.sliding_layers} units, full "
          f"{split[1].size} blocks x {args.full_layers} units")
    print("| accounting | sequences running (median of the middle half of the steps) | "
          f"most at once | layer-unit blocks per sequence near {ctx} tokens | preemptions "
          "| steps |")
    print("|---|---|---|---|---|---|")
    for name, r in (("all full", a), ("cache groups", b)):
        print(f"| {name} | {r['median_running']:.0f} | {r['peak_running']} | "
              f"{r['units_per_seq']:.0f} | {r['preemptions']} | {r['steps']} |")
    one_a, one_b = one_sequence_units(full, ctx), one_sequence_units(hybrid, ctx)
    print(f"one sequence at {ctx} tokens: {one_a} layer-unit blocks all full, {one_b} with "
          f"cache groups ({one_a / one_b:.2f}x fewer)")
    bound = layers * ctx / (args.full_layers * ctx + args.sliding_layers * args.window)
    print(f"exact-window bound: {bound:.2f}x")
    print(f"sequences served: {b['median_running'] / a['median_running']:.2f}x (median), "
          f"{b['peak_running'] / a['peak_running']:.2f}x (most at once)")


if __name__ == "__main__":
    main()
