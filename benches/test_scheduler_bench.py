"""Scheduler step cost from Python (schedule + commit, numpy batch and events included),
steady state: every sequence decodes; each finished one is replaced by a new request.

The events are consumed as the engine consumes them: per-request state is looked up by the
handle ``add_request`` returned, the per-token part works on whole columns (here: each
request's count of generated tokens), and Python objects are touched only for the requests
that finished (their id is looked up, the request retired and replaced).

    pytest benches/test_scheduler_bench.py --benchmark-only
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from iron_batch import CacheGroup, Scheduler, SchedulerConfig


class Steady:
    def __init__(self, running: int, prefill_per_step: int = 0, two_groups: bool = False) -> None:
        blocks = running * 20 + 256
        # Two groups: a 64-token sliding window (sequences reach 208 tokens, so blocks are
        # released) beside a full group, each with the one-group pool.
        groups = ([CacheGroup("sliding", blocks, window=64), CacheGroup("full", blocks)]
                  if two_groups else [])
        self.s = Scheduler(SchedulerConfig(total_kv_blocks=blocks, kv_block_size=16,
                                           max_batch_tokens=8192, max_running_seqs=running + 1,
                                           cache_groups=groups))
        self.ids = itertools.count()
        self.prefill_per_step = prefill_per_step
        self.sampled = np.full(running + 1, 7, dtype=np.int64)
        # Per handle: the request id, and its tokens so far.
        self.by_handle: list[str | None] = []
        self.num_tokens = np.zeros(0, dtype=np.int64)
        self.completed = 0
        for i in range(running):
            self.add(64 + (i * 7) % 192)
        for _ in range(300):
            self.step()

    def track(self, handle: int, request_id: str) -> None:
        if handle >= len(self.by_handle):
            grow = handle + 1 - len(self.by_handle)
            self.by_handle.extend([None] * grow)
            self.num_tokens = np.concatenate([self.num_tokens, np.zeros(grow, np.int64)])
        self.by_handle[handle] = request_id
        self.num_tokens[handle] = 0

    def add(self, max_new: int) -> None:
        n = next(self.ids)
        rid = f"req-{n}"
        self.track(self.s.add_request(rid, np.arange(n, n + 16, dtype=np.int64), max_new), rid)

    def step(self) -> None:
        if self.prefill_per_step:
            n = next(self.ids)
            rid = f"pre-{n}"
            self.track(self.s.add_request(rid, np.arange(n, n + self.prefill_per_step), 1), rid)
        b = self.s.schedule()
        events = self.s.commit(b, self.sampled[: b.sample_indices.shape[0]])
        handles = events.handles
        # One event per token here (no lookahead): a handle appears at most once.
        self.num_tokens[handles] += events.token_ids >= 0
        if events.num_finished:
            by_handle = self.by_handle
            for h in handles[events.finished].tolist():
                rid = by_handle[h]
                by_handle[h] = None
                self.completed += 1
                if rid is not None and rid.startswith("req"):
                    self.add(192)


@pytest.mark.parametrize("running", [16, 256, 1024])
def test_decode_step(benchmark, running: int) -> None:
    w = Steady(running)
    done = w.completed
    benchmark(w.step)
    assert w.s.num_running + w.s.num_waiting == running
    assert w.completed > done
    live = [h for h, rid in enumerate(w.by_handle) if rid is not None]
    assert len(live) == running and all(0 <= w.num_tokens[h] <= 192 for h in live)
    assert w.num_tokens[live].sum() > running * 32


def test_mixed_step_256_decodes_plus_512_prefill(benchmark) -> None:
    w = Steady(256, prefill_per_step=512)
    benchmark(w.step)


@pytest.mark.parametrize("two_groups", [False, True], ids=["one_group", "two_groups"])
def test_decode_step_256_cache_groups(benchmark, two_groups: bool) -> None:
    w = Steady(256, two_groups=two_groups)
    benchmark(w.step)
    assert w.s.num_running + w.s.num_waiting == 256
    if two_groups:
        assert w.s.stats()["sliding_blocks_released"] > 0
