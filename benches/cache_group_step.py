"""The scheduler step from Python at 256 decoding sequences with two cache groups (a
64-token sliding window, so blocks are released as sequences pass it, beside a full group)
against one group, in interleaved rounds of separate processes; with ``--ab`` also one
group on another checkout's package (its ``python`` folder, built).

    python benches/cache_group_step.py --rounds 3 [--ab ../main/python] [--clock cpu]

Each process: 256 sequences of 16-token prompts and 64-255 new tokens (a finished one is
replaced), 300 warm-up steps, then the median of ``--steps`` schedule + commit calls.
``--clock cpu`` times each call by the CPU time of the calling thread rather than the wall
clock, so that time the process spends descheduled on a loaded machine is not counted.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

CHILD = r"""
import itertools, sys, time
import numpy as np
sys.path.insert(0, sys.argv[1])
from iron_batch import Scheduler, SchedulerConfig
blocks = 256 * 20 + 256
kw = {}
if sys.argv[2] == "two":
    from iron_batch import CacheGroup
    kw["cache_groups"] = [CacheGroup("sliding", blocks, window=64), CacheGroup("full", blocks)]
s = Scheduler(SchedulerConfig(total_kv_blocks=blocks, kv_block_size=16, max_batch_tokens=8192,
                              max_running_seqs=257, **kw))
ids = itertools.count()
def add(m):
    n = next(ids)
    s.add_request(f"req-{n}", np.arange(n, n + 16, dtype=np.int64), m)
for i in range(256):
    add(64 + (i * 7) % 192)
sampled = np.full(257, 7, dtype=np.int64)
def step():
    b = s.schedule()
    ev = s.commit(b, sampled[: b.sample_indices.shape[0]])
    for _ in range(int(ev.num_finished)):
        add(192)
for _ in range(300):
    step()
clock = time.thread_time if sys.argv[4] == "cpu" else time.perf_counter
ts = []
for _ in range(int(sys.argv[3])):
    t = clock()
    step()
    ts.append(clock() - t)
print(np.median(ts) * 1e6)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--ab", help="another checkout's python folder (one group only)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="time each step by the wall clock or the thread's CPU time")
    args = ap.parse_args()
    here = str(__import__("pathlib").Path(__file__).resolve().parents[1] / "python")
    runs = [("one group", here, "one"), ("two groups", here, "two")]
    if args.ab:
        runs.insert(0, ("one group, --ab", args.ab, "one"))
    print("| round | " + " | ".join(name for name, _, _ in runs) + " | two / one |")
    print("|---" * (len(runs) + 2) + "|")
    for r in range(args.rounds):
        got = {}
        for name, path, kind in runs:
            argv = [sys.executable, "-c", CHILD, path, kind, str(args.steps), args.clock]
            out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
            got[name] = float(out)
        cells = " | ".join(f"{got[name]:.1f} µs" for name, _, _ in runs)
        print(f"| {r + 1} | {cells} | {got['two groups'] / got['one group']:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
