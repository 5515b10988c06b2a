"""The scheduler step from Python at 256 decoding sequences with two cache groups (a
64-token sliding window, so blocks are released as sequences pass it, beside a full group)
against one group. Each round is a fresh process that drives both schedulers side by side,
alternating blocks of steps between them, so that whatever slows the machine in a moment
slows both; with ``--ab`` a third scheduler (one group) comes from another checkout's
package (its ``python`` folder, built) in a process of its own beside a one-group one.

    python benches/cache_group_step.py --rounds 10 [--ab ../other/python] [--clock cpu]

Each scheduler: 256 sequences of 16-token prompts and 64-255 new tokens (a finished one is
replaced), 300 warm-up steps, then ``--steps`` timed schedule + commit calls in blocks of 50,
alternating; the median per scheduler. ``--clock cpu`` times each call by the CPU time of
the calling thread rather than the wall clock.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

CHILD = r"""
import itertools, sys, time
import numpy as np
sys.path.insert(0, sys.argv[1])
from iron_batch import Scheduler, SchedulerConfig
blocks = 256 * 20 + 256

class Driver:
    def __init__(self, kind):
        kw = {}
        if kind == "two":
            from iron_batch import CacheGroup
            kw["cache_groups"] = [CacheGroup("sliding", blocks, window=64),
                                  CacheGroup("full", blocks)]
        self.s = Scheduler(SchedulerConfig(total_kv_blocks=blocks, kv_block_size=16,
                                           max_batch_tokens=8192, max_running_seqs=257, **kw))
        self.ids = itertools.count()
        self.sampled = np.full(257, 7, dtype=np.int64)
        self.times = []
        for i in range(256):
            self.add(64 + (i * 7) % 192)
        for _ in range(300):
            self.step()

    def add(self, m):
        n = next(self.ids)
        self.s.add_request(f"req-{n}", np.arange(n, n + 16, dtype=np.int64), m)

    def step(self):
        b = self.s.schedule()
        ev = self.s.commit(b, self.sampled[: b.sample_indices.shape[0]])
        for _ in range(int(ev.num_finished)):
            self.add(192)

kinds = sys.argv[2].split(",")
drivers = [Driver(k) for k in kinds]
clock = time.thread_time if sys.argv[4] == "cpu" else time.perf_counter
for _ in range(int(sys.argv[3]) // 50):
    for d in drivers:
        for _ in range(50):
            t = clock()
            d.step()
            d.times.append(clock() - t)
print(" ".join(str(np.median(d.times) * 1e6) for d in drivers))
"""


def child(path: str, kinds: str, steps: int, clock: str) -> list[float]:
    argv = [sys.executable, "-c", CHILD, path, kinds, str(steps), clock]
    out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
    return [float(x) for x in out.split()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--ab", help="another checkout's python folder (one group only)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="time each step by the wall clock or the thread's CPU time")
    args = ap.parse_args()
    here = str(__import__("pathlib").Path(__file__).resolve().parents[1] / "python")
    head = "| round | one group | two groups | two / one |"
    if args.ab:
        head += " one group, --ab | one group, beside it | this / --ab |"
    print(head)
    print("|---" * (head.count("|") - 1) + "|")
    ratios, ab_ratios = [], []
    for r in range(args.rounds):
        one, two = child(here, "one,two", args.steps, args.clock)
        ratios.append(two / one)
        row = f"| {r + 1} | {one:.1f} µs | {two:.1f} µs | {two / one:.2f}x |"
        if args.ab:
            (other,) = child(args.ab, "one", args.steps, args.clock)
            (mine,) = child(here, "one", args.steps, args.clock)
            ab_ratios.append(mine / other)
            row += f" {other:.1f} µs | {mine:.1f} µs | {mine / other:.2f}x |"
        print(row, flush=True)
    line = f"two / one: median {statistics.median(ratios):.2f}x"
    line += f" ({min(ratios):.2f}-{max(ratios):.2f}x over {len(ratios)} rounds)"
    if ab_ratios:
        line += f"; this / --ab: median {statistics.median(ab_ratios):.2f}x"
    print(line)


if __name__ == "__main__":
    main()
