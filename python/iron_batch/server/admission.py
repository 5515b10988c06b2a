"""Limits and backpressure shared by /generate and the OpenAI endpoints, and the drain.

Every generation request passes :meth:`Admission.check_size` (too big is the client's fault:
400) and :meth:`Admission.check_capacity` (a full queue, a failed engine or a server shutting
down is 503 + Retry-After) before it reaches the engine. Bodies over ``max_body_bytes`` are a
413 while they are read (:func:`iron_batch.server.asgi.read_body`). A request that was
accepted is never dropped to make room: limits only ever refuse new work.

:meth:`Admission.drain` is the graceful half of SIGTERM: no new requests, in-flight ones get
``timeout`` seconds to finish, then the engine aborts the rest so each client still gets a
final line (finish_reason "abort") before its connection closes.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING

from iron_batch.server.errors import ApiError, unavailable
from iron_batch.server.fields import MAX_BODY_BYTES

if TYPE_CHECKING:
    from iron_batch.engine import Engine

DEFAULT_MAX_WAITING_REQUESTS = 4096
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


def check_size(
    limits: ServerLimits, prompt_len: int, max_new_tokens: int | None, *, prompt_param: str,
    new_tokens_param: str,
) -> None:
    """400 unless one prompt of ``prompt_len`` tokens asking for ``max_new_tokens``
    (None: not given) is within ``limits``."""
    if limits.max_prompt_tokens is not None and prompt_len > limits.max_prompt_tokens:
        raise ApiError(
            f"the prompt has {prompt_len} tokens; this server accepts at most "
            f"{limits.max_prompt_tokens}",
            param=prompt_param, code="context_length_exceeded",
        )
    cap = limits.max_new_tokens
    if cap is not None and max_new_tokens is not None and max_new_tokens > cap:
        raise ApiError(
            f"{new_tokens_param} is {max_new_tokens}; this server allows at most {cap}",
            param=new_tokens_param,
        )


class Admission:
    """Admission control and in-flight bookkeeping for one app."""

    def __init__(self, engine: Engine, limits: ServerLimits) -> None:
        self.engine = engine
        self.limits = limits
        self.draining = False
        #: Generation handlers between submit and their last write.
        self.active = 0

    def check_size(
        self, prompt_len: int, max_new_tokens: int | None, *, prompt_param: str,
        new_tokens_param: str,
    ) -> None:
        check_size(self.limits, prompt_len, max_new_tokens, prompt_param=prompt_param,
                   new_tokens_param=new_tokens_param)

    def check_capacity(self, num_requests: int, num_prompt_tokens: int) -> None:
        """503 unless ``num_requests`` new engine requests with this many prompt tokens in
        all may be queued now."""
        if self.draining:
            raise unavailable("the server is shutting down", "server_shutting_down")
        engine = self.engine
        if engine.fatal_error is not None:
            raise unavailable(f"the engine has failed: {engine.fatal_error}", "engine_failed")
        limits = self.limits
        # A racy snapshot of the engine thread's queue, which is fine for a soft cap.
        waiting = engine.num_waiting_requests
        if waiting + num_requests > limits.max_waiting_requests:
            raise unavailable(
                f"the server is full ({waiting} requests waiting); retry later",
                "server_overloaded",
            )
        cap = limits.max_waiting_tokens
        if cap is not None:
            queued = engine.waiting_prompt_tokens
            # An empty queue takes anything (a prompt over the cap would wait forever).
            if queued > 0 and queued + num_prompt_tokens > cap:
                raise unavailable(
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
