"""Limits and backpressure shared by /generate and the OpenAI endpoints, and the drain.

Every generation request passes :meth:`Admission.check` before it reaches the engine: too
big is the client's fault (400/413, see :class:`ServerLimits`), a full queue, a failed
engine or a server shutting down is 503 + Retry-After. A request that was accepted is never
dropped to make room: limits only ever refuse new work.

:meth:`Admission.drain` is the graceful half of SIGTERM: no new requests, in-flight ones get
``timeout`` seconds to finish, then the engine aborts the rest so each client still gets a
final line (finish_reason "abort") before its connection closes.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from iron_batch.engine import Engine
from iron_batch.server.protocol import MAX_BODY_BYTES

DEFAULT_MAX_WAITING_REQUESTS = 4096
#: Seconds a client is told to wait when the server is full.
RETRY_AFTER_S = 1
#: After the drain timeout aborts what is left, how long the handlers get to write the
#: final lines before the server closes their connections anyway.
ABORT_GRACE_S = 5.0


@dataclass
class ServerLimits:
    """Per-request and queue limits (None: no limit beyond the KV pool / model context)."""

    max_body_bytes: int = MAX_BODY_BYTES
    max_prompt_tokens: int | None = None
    max_new_tokens: int | None = None
    max_waiting_requests: int = DEFAULT_MAX_WAITING_REQUESTS
    max_waiting_tokens: int | None = None


class Unavailable(Exception):
    """503: the request is fine but the server cannot take it now."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code
        self.status = 503
        self.headers = {"Retry-After": str(RETRY_AFTER_S)}


class Admission:
    """Admission control and in-flight bookkeeping for one app."""

    def __init__(self, engine: Engine, limits: ServerLimits) -> None:
        self.engine = engine
        self.limits = limits
        self.draining = False
        #: Generation handlers between submit and their last write.
        self.active = 0

    def check(self, num_requests: int, num_prompt_tokens: int) -> None:
        """Raise :class:`Unavailable` unless ``num_requests`` new engine requests with this
        many prompt tokens in all may be queued now."""
        if self.draining:
            raise Unavailable("the server is shutting down", "server_shutting_down")
        engine = self.engine
        if engine.fatal_error is not None:
            raise Unavailable(f"the engine has failed: {engine.fatal_error}", "engine_failed")
        limits = self.limits
        # Racy snapshots of the engine thread's state, which is fine for a soft cap: the
        # scheduler's waiting queue as of the last step, plus what the inbox holds.
        waiting = engine.stats.scheduler.get("waiting", 0) + len(engine._inbox)
        if waiting + num_requests > limits.max_waiting_requests:
            raise Unavailable(
                f"the server is full ({waiting} requests waiting); retry later",
                "server_overloaded",
            )
        cap = limits.max_waiting_tokens
        if cap is not None:
            queued = engine.waiting_prompt_tokens
            # An empty queue takes anything (a prompt over the cap would wait forever).
            if queued > 0 and queued + num_prompt_tokens > cap:
                raise Unavailable(
                    f"the server is full ({queued} prompt tokens waiting); retry later",
                    "server_overloaded",
                )

    async def drain(self, timeout: float) -> None:
        """Refuse new requests, let in-flight ones finish for ``timeout`` seconds, then abort
        the rest and give their handlers a moment to write the final lines."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.active and loop.time() < deadline:
            await asyncio.sleep(0.02)
        if not self.active:
            return
        self.engine.abort_all()
        deadline = loop.time() + ABORT_GRACE_S
        while self.active and loop.time() < deadline:
            await asyncio.sleep(0.02)
