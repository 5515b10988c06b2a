"""The page for people at ``/``: a chat playground and a live dashboard, plus the console
banner the CLI prints at start.

The page is static (``server/static``: HTML, CSS and hand-written JavaScript, no build step,
nothing fetched from elsewhere) and talks to the server's own endpoints: /v1/chat/completions
and /generate for the playground, and two small JSON endpoints here for the dashboard:

- ``GET /ui/api/info``: the server's configuration (model, dtype, backend, KV pool, limits).
- ``GET /ui/api/snapshots?after=SEQ``: the snapshots taken since ``SEQ``. A sampler task
  reads :class:`iron_batch.stats.EngineStats` once a second into a ring of the last
  ``HISTORY_SECONDS`` (memory is bounded whatever the readers do; a reader that polls late
  gets what is still in the ring and nothing queues up for it), so a page opened now
  still plots the last minutes.

Both need the API key like /metrics; the static files hold no data and do not.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
import time
from collections.abc import AsyncIterator
from importlib import resources
from typing import Any

from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

from iron_batch.engine import Engine
from iron_batch.platform.switches import SWITCHES
from iron_batch.server.admission import ServerLimits
from iron_batch.server.asgi import ApiKeys, guarded
from iron_batch.server.errors import ApiError
from iron_batch.stats import EngineStats, LatencyHistogram, bucket_upper_bound

#: Seconds of history the dashboard can plot (one snapshot a second).
HISTORY_SECONDS = 300
#: Latency percentiles of a snapshot cover observations of this many seconds before it.
LATENCY_WINDOW_S = 10
SAMPLE_INTERVAL_S = 1.0



def static_dir() -> str:
    return str(resources.files("iron_batch.server") / "static")


def server_info(
    engine: Engine,
    *,
    model_name: str,
    max_seq_tokens: int,
    limits: ServerLimits,
    auth: bool,
) -> dict[str, Any]:
    """What the page and the console banner show about this server's configuration."""
    backend = engine.backend
    config = engine.config
    described = backend.describe()
    kv_bytes = None
    if described.kv_bytes_per_block is not None:
        kv_bytes = described.kv_bytes_per_block * config.total_kv_blocks
    tokenizer = backend.tokenizer
    return {
        "model": model_name,
        "backend": described.kind,
        "backend_url": described.url,
        "dtype": described.dtype,
        "device": described.device,
        "switches": described.switches,
        "vocab_size": backend.vocab_size,
        "max_model_len": config.max_model_len,
        "tokenizer": tokenizer is not None,
        "chat_template": getattr(tokenizer, "chat_template", None) is not None,
        "steps_per_call": backend.steps_per_call,
        "kv": {
            "blocks": config.total_kv_blocks,
            "block_size": config.kv_block_size,
            "tokens": config.total_kv_blocks * config.kv_block_size,
            "bytes": kv_bytes,
            # What K/V are stored as (None: a backend without a cache of its own).
            "dtype": described.kv_cache_dtype,
        },
        "scheduler": {
            "max_batch_tokens": config.max_batch_tokens,
            "max_running_seqs": config.max_running_seqs,
            "prefix_caching": config.enable_prefix_caching,
        },
        "limits": {
            "max_seq_tokens": max_seq_tokens,
            "max_body_bytes": limits.max_body_bytes,
            "max_prompt_tokens": limits.max_prompt_tokens,
            "max_new_tokens": limits.max_new_tokens,
            "max_waiting_requests": limits.max_waiting_requests,
            "max_waiting_tokens": limits.max_waiting_tokens,
        },
        "auth": auth,
        "cache_groups": [{"kind": g.kind, "window": g.window, "size": g.size}
                         for g in config.cache_groups],
    }


def _bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"  # pragma: no cover


def banner(info: dict[str, Any], urls: list[str], *, ui: bool) -> str:
    """The lines the CLI prints once the server listens."""
    kv = info["kv"]
    sched = info["scheduler"]
    limits = info["limits"]
    model = f"{info['model']}  ({info['backend']} backend"
    if info.get("dtype"):
        model += f", {info['dtype']}"
    if info.get("device"):
        model += f" on {info['device']}"
    if info.get("backend_url"):
        model += f", worker {info['backend_url']}"
    model += ")"
    pool = f"{kv['blocks']} blocks x {kv['block_size']} tokens = {kv['tokens']} tokens"
    stored = [_bytes(kv["bytes"])] if kv.get("bytes") else []
    if kv.get("dtype"):
        stored.append(f"{kv['dtype']} K/V")
    if stored:
        pool += f" ({', '.join(stored)})"
    if not sched["prefix_caching"]:
        pool += ", prefix caching off"
    parts = [
        f"{sched['max_batch_tokens']} tokens/step",
        f"{sched['max_running_seqs']} running seqs",
        f"{limits['max_seq_tokens']} tokens/seq",
        f"{limits['max_waiting_requests']} waiting requests",
    ]
    if limits["max_waiting_tokens"] is not None:
        parts.append(f"{limits['max_waiting_tokens']} waiting prompt tokens")
    if limits["max_prompt_tokens"] is not None:
        parts.append(f"prompt <= {limits['max_prompt_tokens']}")
    if limits["max_new_tokens"] is not None:
        parts.append(f"max_new_tokens <= {limits['max_new_tokens']}")
    parts.append(f"body <= {_bytes(limits['max_body_bytes'])}")
    lines = ["iron-batch server ready"]
    label = "open" if ui else "url"
    for url in urls:
        lines.append(f"  {label:<9}{url}")
        label = ""
    if ui:
        lines.append("           (chat playground and live dashboard; --no-ui turns it off)")
    lines += [
        f"  {'model':<9}{model}",
        f"  {'KV pool':<9}{pool}",
        *_group_lines(info.get("cache_groups", [])),
        f"  {'limits':<9}{', '.join(parts)}",
    ]
    if info.get("switches"):
        defaults = {s.env: s.default for s in SWITCHES.values()}
        changed = [f"{k}={v}" for k, v in info["switches"].items() if defaults.get(k) != v]
        lines.append(f"  {'tuning':<9}{', '.join(changed) or 'defaults'}"
                     " (IRON_BATCH_* switches; see the README)")
    lines += [
        f"  {'api':<9}/v1 (OpenAI), /generate (NDJSON), /metrics, /health"
        + ("; API key required" if info["auth"] else ""),
    ]
    return "\n".join(lines)


def _group_lines(groups: list[dict[str, Any]]) -> list[str]:
    """The banner's line of cache groups (none without them)."""
    if not groups:
        return []
    each = []
    for i, g in enumerate(groups):
        unit = "slots" if g["kind"] == "state" else "blocks"
        kind = f"sliding {g['window']}" if g["kind"] == "sliding" else g["kind"]
        each.append(f"{i}: {kind}, {g['size']} {unit}")
    return [f"  {'groups':<9}{'; '.join(each)}"]


def _window_percentiles(
    now: list[int], before: list[int], qs: tuple[float, ...]
) -> list[float | None]:
    """Percentiles (ms) of the observations between two copies of a histogram's counts."""
    diff = [a - b for a, b in zip(now, before, strict=True)]
    total = sum(diff)
    if total <= 0:
        return [None] * len(qs)
    out: list[float | None] = []
    for q in qs:
        rank = max(1, math.ceil(q / 100.0 * total))
        seen = 0
        value = bucket_upper_bound(len(diff) - 1)
        for index, n in enumerate(diff):
            seen += n
            if seen >= rank:
                value = bucket_upper_bound(index) / math.sqrt(1.05)
                break
        out.append(round(value * 1000.0, 3))
    return out


class MetricsHistory:
    """Snapshots of the engine's stats, one per ``take()``, the last ``size`` kept."""

    def __init__(self, stats: EngineStats, size: int = HISTORY_SECONDS) -> None:
        self.stats = stats
        self.snapshots: collections.deque[dict[str, Any]] = collections.deque(maxlen=size)
        # (monotonic time, ttft counts, itl counts) of recent snapshots, for windows.
        self._marks: collections.deque[tuple[float, list[int], list[int]]] = (
            collections.deque(maxlen=LATENCY_WINDOW_S + 1)
        )
        self._seq = 0
        self._last: tuple[float, int, int, int, int] | None = None

    @staticmethod
    def _counts(hist: LatencyHistogram) -> list[int]:
        return list(hist.counts)

    def take(self) -> dict[str, Any]:
        stats = self.stats
        sched = stats.scheduler
        now = time.monotonic()
        tokens = stats.tokens_generated
        queries = sched.get("prefix_cache_query_tokens", 0)
        hits = sched.get("prefix_cache_hit_tokens", 0)
        preemptions = sched.get("preemptions", 0)
        ttft = self._counts(stats.ttft)
        itl = self._counts(stats.itl)
        tok_s = hit_rate = None
        preempt_s = 0.0
        if self._last is not None:
            t0, tokens0, queries0, hits0, preempt0 = self._last
            dt = max(now - t0, 1e-6)
            tok_s = round(max(tokens - tokens0, 0) / dt, 1)
            preempt_s = round(max(preemptions - preempt0, 0) / dt, 2)
            if queries > queries0:
                hit_rate = round((hits - hits0) / (queries - queries0), 4)
        self._last = (now, tokens, queries, hits, preemptions)
        self._marks.append((now, ttft, itl))
        _, ttft0, itl0 = self._marks[0]
        ttft_p50, ttft_p99 = _window_percentiles(ttft, ttft0, (50, 99))
        itl_p50, itl_p99 = _window_percentiles(itl, itl0, (50, 99))
        if len(self._marks) == 1:  # the first snapshot: everything so far
            zero = [0] * len(ttft)
            ttft_p50, ttft_p99 = _window_percentiles(ttft, zero, (50, 99))
            itl_p50, itl_p99 = _window_percentiles(itl, zero, (50, 99))
        self._seq += 1
        snap = {
            "seq": self._seq,
            "time": round(time.time(), 3),
            "tokens_generated": tokens,
            "requests_completed": stats.requests_completed,
            "tokens_per_sec": tok_s,
            "running": sched.get("running", 0),
            "waiting": sched.get("waiting", 0),
            "kv_blocks_total": sched.get("total_blocks", 0),
            "kv_blocks_used": sched.get("used_blocks", 0),
            "kv_blocks_cached": sched.get("cached_blocks", 0),
            "cache_groups": stats.cache_groups,
            "prefix_cache_hit_rate": hit_rate,
            "preemptions": preemptions,
            "preemptions_per_sec": preempt_s,
            "spec_drafted_tokens": sched.get("spec_drafted_tokens", 0),
            "spec_accepted_tokens": sched.get("spec_accepted_tokens", 0),
            "ttft_p50_ms": ttft_p50,
            "ttft_p99_ms": ttft_p99,
            "itl_p50_ms": itl_p50,
            "itl_p99_ms": itl_p99,
        }
        self.snapshots.append(snap)
        return snap

    def after(self, seq: int) -> list[dict[str, Any]]:
        return [s for s in self.snapshots if s["seq"] > seq]

    async def run(self, interval: float = SAMPLE_INTERVAL_S) -> None:
        while True:
            self.take()
            await asyncio.sleep(interval)


class UI:
    """The page's routes and its sampler task (started and stopped by the app's lifespan)."""

    def __init__(self, engine: Engine, info: dict[str, Any], api_key: ApiKeys) -> None:
        self.history = MetricsHistory(engine.stats)
        self.info = info
        self.api_key = api_key
        self._task: asyncio.Task[None] | None = None

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        self._task = asyncio.ensure_future(self.history.run())
        try:
            yield
        finally:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def routes(self) -> list[BaseRoute]:
        directory = static_dir()

        async def index(request: Request) -> Response:
            return FileResponse(f"{directory}/index.html", headers={"cache-control": "no-cache"})

        async def info(request: Request) -> Response:
            return JSONResponse(self.info)

        async def snapshots(request: Request) -> Response:
            raw = request.query_params.get("after", "0")
            try:
                after = int(raw)
            except ValueError:
                raise ApiError("after must be an integer", param="after") from None
            return JSONResponse({"snapshots": self.history.after(after)})

        return [
            Route("/", index, methods=["GET"]),
            Route("/ui/api/info", guarded(info, self.api_key), methods=["GET"]),
            Route("/ui/api/snapshots", guarded(snapshots, self.api_key), methods=["GET"]),
            Mount("/ui", app=StaticFiles(directory=directory), name="ui"),
        ]
