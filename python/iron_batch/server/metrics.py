"""/metrics: JSON fields, or Prometheus exposition when the client asks for text.

Both views read the same :class:`iron_batch.stats.EngineStats`. The Prometheus side is a
custom collector on a per-server registry (not the global one, so several servers in one
process, as in tests, never collide) that converts our fine log-spaced histograms into
Prometheus buckets at scrape time: nothing is observed twice per token.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import choose_encoder

from iron_batch.stats import EngineStats, LatencyHistogram

TTFT_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]
ITL_BUCKETS = [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0]


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 3)


def metrics_json(stats: EngineStats) -> dict[str, Any]:
    sched = stats.scheduler
    elapsed = stats.elapsed_secs
    query_tokens = sched.get("prefix_cache_query_tokens", 0)
    hits = sched.get("prefix_cache_hit_tokens", 0)
    drafted = sched.get("spec_drafted_tokens", 0)
    accepted = sched.get("spec_accepted_tokens", 0)
    out = {
        "elapsed_secs": round(elapsed, 3),
        "tokens_generated": stats.tokens_generated,
        "requests_completed": stats.requests_completed,
        "tokens_per_sec": round(stats.tokens_generated / elapsed, 1) if elapsed > 0 else 0.0,
        "ttft_p50_ms": _ms(stats.ttft.percentile(50)),
        "ttft_p99_ms": _ms(stats.ttft.percentile(99)),
        "itl_p50_ms": _ms(stats.itl.percentile(50)),
        "itl_p99_ms": _ms(stats.itl.percentile(99)),
        "requests_aborted": stats.requests_aborted,
        "requests_failed": stats.requests_failed,
        "kv_blocks_total": sched.get("total_blocks", 0),
        "kv_blocks_free": sched.get("free_blocks", 0),
        "running": sched.get("running", 0),
        "waiting": sched.get("waiting", 0),
        "preemptions": sched.get("preemptions", 0),
        "prefix_cache_hit_rate": round(hits / query_tokens, 4) if query_tokens else 0.0,
        # Speculative decoding (prompt lookup): tokens proposed and verified, and those the
        # model accepted.
        "spec_drafted_tokens": drafted,
        "spec_accepted_tokens": accepted,
        "spec_acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0,
    }
    if stats.cache_groups:
        # With cache groups, each group's pool (blocks, or state slots), in config order.
        out["cache_groups"] = [dict(g) for g in stats.cache_groups]
    return out


def _histogram(
    name: str, doc: str, hist: LatencyHistogram, bounds: list[float]
) -> HistogramMetricFamily:
    cumulative = hist.cumulative(bounds)
    buckets = [(repr(b), c) for b, c in zip(bounds, cumulative, strict=True)]
    buckets.append(("+Inf", hist.count))
    return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=hist.total)


class _EngineCollector:
    def __init__(self, stats: EngineStats) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats
        data = metrics_json(stats)
        yield CounterMetricFamily(
            "iron_batch_tokens_generated", "Tokens generated.", value=stats.tokens_generated
        )
        yield CounterMetricFamily(
            "iron_batch_requests_completed",
            "Requests that finished normally.",
            value=stats.requests_completed,
        )
        yield CounterMetricFamily(
            "iron_batch_requests_aborted", "Requests aborted.", value=stats.requests_aborted
        )
        yield CounterMetricFamily(
            "iron_batch_requests_failed", "Requests failed.", value=stats.requests_failed
        )
        yield CounterMetricFamily(
            "iron_batch_preemptions", "Sequences preempted.", value=data["preemptions"]
        )
        yield CounterMetricFamily(
            "iron_batch_spec_drafted_tokens",
            "Speculative decoding: tokens proposed (method ngram) and verified.",
            value=data["spec_drafted_tokens"],
        )
        yield CounterMetricFamily(
            "iron_batch_spec_accepted_tokens",
            "Speculative decoding: proposed tokens the model accepted (method ngram).",
            value=data["spec_accepted_tokens"],
        )
        gauges = {
            "elapsed_seconds": ("Seconds since the server started.", data["elapsed_secs"]),
            "tokens_per_second": (
                "Tokens generated per second since start.",
                data["tokens_per_sec"],
            ),
            "kv_blocks_total": ("KV cache blocks in the pool.", data["kv_blocks_total"]),
            "kv_blocks_free": ("KV cache blocks free.", data["kv_blocks_free"]),
            "running_requests": ("Sequences running.", data["running"]),
            "waiting_requests": ("Sequences waiting.", data["waiting"]),
            "prefix_cache_hit_rate": (
                "Prompt tokens served by the prefix cache / prompt tokens looked up.",
                data["prefix_cache_hit_rate"],
            ),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(f"iron_batch_{name}", doc, value=value)
        if stats.cache_groups:
            for field, doc in (("total", "in the pool"), ("used", "held by sequences"),
                               ("cached", "free with reusable content")):
                family = GaugeMetricFamily(
                    f"iron_batch_cache_group_{field}",
                    f"Blocks (attention groups) or state slots of each cache group {doc}.",
                    labels=["group", "kind"])
                for i, g in enumerate(stats.cache_groups):
                    family.add_metric([str(i), g["kind"]], g[field])
                yield family
        yield _histogram(
            "iron_batch_time_to_first_token_seconds",
            "Time from request arrival to its first token.",
            stats.ttft,
            TTFT_BUCKETS,
        )
        yield _histogram(
            "iron_batch_inter_token_latency_seconds",
            "Time between consecutive tokens of a request.",
            stats.itl,
            ITL_BUCKETS,
        )


def make_registry(stats: EngineStats) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_EngineCollector(stats))  # type: ignore[arg-type]
    return registry


def wants_prometheus(accept: str) -> bool:
    accept = accept.lower()
    return "text/plain" in accept or "application/openmetrics-text" in accept


def prometheus_text(registry: CollectorRegistry, accept: str) -> tuple[bytes, str]:
    """Exposition bytes and content type; OpenMetrics when the Accept header asks for it."""
    encoder, content_type = choose_encoder(accept)
    return encoder(registry), content_type
