"""Two builds of iron-batch measured in turn by one kernel benchmark.

A benchmark script measures once in a child process (its ``--one`` flag prints one JSON
line of figures). :func:`run` starts that child for this checkout's build and, given
``--ab``, for another checkout's ``python/`` folder (built in place), the two taking turns
each round, and prints the median of each figure with the ratio of the two builds.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any


def best_seconds(fn: Callable[[], Any], calls: int, warmup_s: float) -> float:
    """The fastest of ``calls`` calls of ``fn`` after calling it for ``warmup_s`` seconds."""
    end = time.perf_counter() + warmup_s
    while time.perf_counter() < end:
        fn()
    best = float("inf")
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def run(script: str, child_args: list[str], rounds: int, other: str | None,
        digits: int = 2) -> None:
    """Measure ``script --one *child_args`` ``rounds`` times per build and print the table."""
    here = os.path.join(os.path.dirname(os.path.abspath(script)), "..", "python")
    builds = {"this": here} | ({"other": other} if other else {})
    results: dict[str, list[dict[str, float]]] = {name: [] for name in builds}
    for r in range(rounds):
        order = list(builds) if r % 2 == 0 else list(builds)[::-1]
        for name in order:
            env = dict(os.environ, PYTHONPATH=builds[name])
            cmd = [sys.executable, script, "--one", *child_args]
            line = subprocess.run(cmd, env=env, check=True, capture_output=True,
                                  text=True).stdout.strip().splitlines()[-1]
            results[name].append(json.loads(line))
            print(name, line, flush=True)
    names = list(builds)
    head = "| figure | " + " | ".join(names) + (" | this / other |" if other else " |")
    print("\n" + head)
    print("|---" * (len(names) + 1 + bool(other)) + "|")
    for key in results["this"][0]:
        med = {n: statistics.median(row[key] for row in results[n]) for n in names}
        cells = " | ".join(f"{med[n]:.{digits}f}" for n in names)
        ratio = f" | {med['this'] / med['other']:.2f}x" if other else ""
        print(f"| {key} | {cells}{ratio} |")
