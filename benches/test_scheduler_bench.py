"""Scheduler step cost from Python (schedule + commit, numpy batch included), steady state:
every sequence decodes; each finished one is replaced by a new request.

    pytest benches/test_scheduler_bench.py --benchmark-only
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from iron_batch import Scheduler, SchedulerConfig


class Steady:
    def __init__(self, running: int, prefill_per_step: int = 0) -> None:
        self.s = Scheduler(SchedulerConfig(total_kv_blocks=running * 20 + 256, kv_block_size=16,
                                           max_batch_tokens=8192, max_running_seqs=running + 1))
        self.ids = itertools.count()
        self.prefill_per_step = prefill_per_step
        self.sampled = np.full(running + 1, 7, dtype=np.int64)
        for i in range(running):
            self.add(64 + (i * 7) % 192)
        for _ in range(300):
            self.step()

    def add(self, max_new: int) -> None:
        n = next(self.ids)
        self.s.add_request(f"req-{n}", np.arange(n, n + 16, dtype=np.int64), max_new)

    def step(self) -> None:
        if self.prefill_per_step:
            n = next(self.ids)
            self.s.add_request(f"pre-{n}", np.arange(n, n + self.prefill_per_step), 1)
        b = self.s.schedule()
        events = self.s.commit(b, self.sampled[: b.sample_indices.shape[0]])
        for rid, _tok, done, _reason in events:
            if done and rid.startswith("req"):
                self.add(192)


@pytest.mark.parametrize("running", [16, 256, 1024])
def test_decode_step(benchmark, running: int) -> None:
    w = Steady(running)
    benchmark(w.step)
    assert w.s.num_running + w.s.num_waiting == running


def test_mixed_step_256_decodes_plus_512_prefill(benchmark) -> None:
    w = Steady(256, prefill_per_step=512)
    benchmark(w.step)
