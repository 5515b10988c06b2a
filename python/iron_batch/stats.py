"""Bounded-memory latency histograms and engine counters.

The engine records one observation per generated token, so recording must be cheap and
memory must not grow with traffic: fixed log-spaced buckets instead of a sample list.
"""

from __future__ import annotations

import math
import time
from typing import Any

# Bucket edges grow by 5% from 1 µs to ~170 s: a percentile read from a bucket is off by
# at most 5%, good enough for p50/p99, and 390 ints of memory whatever the traffic.
_MIN_SECONDS = 1e-6
_GROWTH = 1.05
_LOG_GROWTH = math.log(_GROWTH)
_NUM_BUCKETS = 390


def bucket_upper_bound(index: int) -> float:
    """Upper edge (seconds) of bucket ``index``; bucket 0 also holds everything below 1 µs."""
    return _MIN_SECONDS * _GROWTH ** (index + 1)


class LatencyHistogram:
    """Counts of latencies in fixed log-spaced buckets, plus their sum.

    Only the engine thread writes; readers on other threads see a slightly stale but
    consistent-enough view (each field is one Python object, updated under the GIL).
    """

    __slots__ = ("counts", "count", "total")

    def __init__(self) -> None:
        self.counts = [0] * _NUM_BUCKETS
        self.count = 0
        self.total = 0.0

    def observe(self, seconds: float) -> None:
        if seconds <= _MIN_SECONDS:
            index = 0
        else:
            index = min(int(math.log(seconds / _MIN_SECONDS) / _LOG_GROWTH), _NUM_BUCKETS - 1)
        self.counts[index] += 1
        self.count += 1
        self.total += seconds

    def observe_many(self, seconds: float, n: int) -> None:
        """``n`` equal observations (tokens of one step share a timestamp)."""
        if n <= 0:
            return
        if seconds <= _MIN_SECONDS:
            index = 0
        else:
            index = min(int(math.log(seconds / _MIN_SECONDS) / _LOG_GROWTH), _NUM_BUCKETS - 1)
        self.counts[index] += n
        self.count += n
        self.total += seconds * n

    def percentile(self, q: float) -> float | None:
        """Approximate ``q``-th percentile (0..100) in seconds, None when empty."""
        count = self.count
        if count == 0:
            return None
        rank = max(1, math.ceil(q / 100.0 * count))
        seen = 0
        for index, n in enumerate(self.counts):
            seen += n
            if seen >= rank:
                # Geometric middle of the bucket: halves the worst-case relative error.
                return bucket_upper_bound(index) / math.sqrt(_GROWTH)
        return bucket_upper_bound(_NUM_BUCKETS - 1)

    def cumulative(self, bounds: list[float]) -> list[int]:
        """Cumulative counts at each of ``bounds`` (seconds, ascending), for Prometheus.

        A bound that falls inside one of our buckets counts that whole bucket, so the
        result is exact when the bounds are bucket edges and at most one bucket off otherwise.
        """
        result: list[int] = []
        seen = 0
        index = 0
        for bound in bounds:
            while index < _NUM_BUCKETS and bucket_upper_bound(index) <= bound * (1 + 1e-9):
                seen += self.counts[index]
                index += 1
            result.append(seen)
        return result


class EngineStats:
    """Counters the engine thread updates once per step; the server reads them."""

    def __init__(self) -> None:
        self.started_at = time.monotonic()
        self.tokens_generated = 0
        self.requests_completed = 0
        self.requests_aborted = 0
        self.requests_failed = 0
        self.ttft = LatencyHistogram()
        self.itl = LatencyHistogram()
        # Latest Scheduler.stats() snapshot, refreshed by the engine thread after every step
        # so that readers never touch the scheduler from another thread.
        self.scheduler: dict[str, int] = {}
        # Scheduler.group_stats() with cache groups configured (empty without): each
        # group's kind, window, total, used, free and cached blocks or state slots.
        self.cache_groups: list[dict[str, Any]] = []

    @property
    def elapsed_secs(self) -> float:
        return time.monotonic() - self.started_at
