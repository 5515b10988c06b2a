"""What a request's consumer sees: :class:`TokenEvent` and, on an asyncio loop,
:class:`RequestStream` (filled by the engine thread once per step)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

#: One token's log-probability and its top alternatives: (logprob, [(token id, logprob)]).
Logprobs = tuple[float, list[tuple[int, float]]]
#: A step's: one per sample row.
StepLogprobs = list[Logprobs]
#: A prompt's, per position: None for the first token (nothing predicts it), else the
#: prompt token's log-probability and the top alternatives.
PromptLogprobs = list[Logprobs | None]


class TokenEvent:
    """One thing that happened to a request in one step.

    ``token_id`` is None for an event without a token: a request that ends without
    producing one (``max_new_tokens == 0``, abort, error) or was rejected at admission
    (``finish_reason == "rejected"``, ``error``/``error_type`` say why).

    ``logprobs`` is ``(chosen token logprob, [(token id, logprob)] top alternatives)`` for
    requests whose ``params.logprobs`` is set (and a backend that computes them).
    ``prompt_logprobs`` is set on a request's first token event when its
    ``params.prompt_logprobs`` is set: one entry per prompt token, None for the first.
    ``embedding`` is set on the first token event of a request with ``params.embed``.
    ``num_cached_tokens`` is set on the finishing event: prompt tokens the prefix cache
    served at the request's first admission (the scheduler forgets it once the request ends).
    """

    __slots__ = (
        "request_id",
        "index",
        "token_id",
        "text",
        "finished",
        "finish_reason",
        "error",
        "error_type",
        "logprobs",
        "num_cached_tokens",
        "prompt_logprobs",
        "embedding",
    )

    def __init__(
        self,
        request_id: str,
        index: int,
        token_id: int | None,
        text: str | None,
        finished: bool,
        finish_reason: str | None,
        error: str | None = None,
        error_type: str | None = None,
        logprobs: Logprobs | None = None,
        num_cached_tokens: int | None = None,
    ) -> None:
        self.request_id = request_id
        self.index = index
        self.token_id = token_id
        self.text = text
        self.finished = finished
        self.finish_reason = finish_reason
        self.error = error
        self.error_type = error_type
        self.logprobs = logprobs
        self.num_cached_tokens = num_cached_tokens
        self.prompt_logprobs: list[Logprobs | None] | None = None
        #: An embedding request's pooled hidden state (float32), on its first token event.
        self.embedding: Any = None

    def __repr__(self) -> str:
        return (
            f"TokenEvent({self.request_id!r}, index={self.index}, token_id={self.token_id}, "
            f"text={self.text!r}, finished={self.finished}, reason={self.finish_reason!r}"
            + (f", error={self.error!r}" if self.error else "")
            + ")"
        )


class RequestStream:
    """Asyncio side of one request: a buffer the engine fills once per step.

    Lives on the loop that called :meth:`iron_batch.engine.Engine.submit`; every method must
    be called there. ``get()`` returns every event that arrived since the last call, so a
    slow consumer catches up in one write instead of one wakeup per token. The buffer is
    bounded by ``limit`` (the engine's ``max_stream_buffer_events``; 0: unbounded): a
    consumer that falls that far behind (a client that stopped reading) gets its request
    aborted, with a final "abort" event that names the reason, so it cannot hold KV blocks
    or memory forever.
    """

    __slots__ = ("request_id", "done", "loop", "_on_abort", "_buf", "_waiter", "_closed",
                 "_limit")

    def __init__(
        self,
        request_id: str,
        loop: asyncio.AbstractEventLoop,
        limit: int,
        on_abort: Callable[[], None],
    ) -> None:
        self.request_id = request_id
        self.done = False
        self.loop = loop
        #: Asks the engine to abort the request (thread-safe).
        self._on_abort = on_abort
        self._buf: list[TokenEvent] = []
        self._waiter: asyncio.Future[None] | None = None
        self._closed = False
        self._limit = limit

    def push(self, event: TokenEvent) -> None:
        """Engine side (on the loop, through :func:`deliver`): one more event."""
        if self._closed:
            return
        buf = self._buf
        buf.append(event)
        if event.finished:
            self.done = True
        elif 0 < self._limit < len(buf):
            self._overflow(event)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def _overflow(self, last: TokenEvent) -> None:
        # Keep what is buffered (the client may still catch up and read it) and end with an
        # abort; drop whatever the engine sends before it processes the abort.
        self._closed = True
        self.done = True
        index = last.index + (1 if last.token_id is not None else 0)
        self._buf.append(
            TokenEvent(
                self.request_id, index, None, None, True, "abort",
                f"client too slow: more than {self._limit} events unread",
            )
        )
        self._on_abort()

    async def get(self) -> list[TokenEvent]:
        """Wait for and return the pending events; [] once the stream was aborted."""
        while not self._buf:
            if self._closed:
                return []
            waiter = self.loop.create_future()
            self._waiter = waiter
            await waiter
        events = self._buf
        self._buf = []
        return events

    def abort(self) -> None:
        """Stop the request (client went away): the engine frees its blocks next step."""
        if self._closed:
            return
        self._closed = True
        if not self.done:
            self._on_abort()
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> list[TokenEvent]:
        if self.done and not self._buf:
            raise StopAsyncIteration
        events = await self.get()
        if not events:
            raise StopAsyncIteration
        return events


def deliver(items: list[tuple[RequestStream, TokenEvent]]) -> None:
    """Runs on the asyncio loop: the one hop per engine step."""
    for stream, event in items:
        stream.push(event)
