"""The Starlette app: /generate (raw ASGI hot path), /metrics, /health.

/generate is a plain ASGI callable rather than a Starlette endpoint + StreamingResponse:
per token it does one pre-encoded ``send`` and nothing else (no response object, no
per-chunk task group), which is what lets the server keep up with the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from iron_batch.engine import Engine, RequestStream
from iron_batch.server.metrics import (
    make_registry,
    metrics_json,
    prometheus_text,
    wants_prometheus,
)
from iron_batch.server.protocol import (
    MAX_BODY_BYTES,
    BadRequest,
    encode_event,
    error_body,
    parse_generate,
)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_JSON_HEADERS = [(b"content-type", b"application/json")]
_NDJSON_START = {
    "type": "http.response.start",
    "status": 200,
    "headers": [(b"content-type", b"application/x-ndjson"), (b"cache-control", b"no-cache")],
}
# Admission errors from the engine -> HTTP status.
_REJECT_STATUS = {"DuplicateRequest": 409}


async def _send_json(send: Send, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status, "headers": _JSON_HEADERS})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _check_api_key(headers: list[tuple[bytes, bytes]], api_key: bytes | None) -> bool:
    if api_key is None:
        return True
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), api_key)
    return False


async def _read_body(receive: Receive) -> bytes | None:
    """The whole request body, or None when the client left or it exceeds the limit."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise BadRequest(f"body larger than {MAX_BODY_BYTES} bytes", status=413)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


class GenerateEndpoint:
    """POST /generate: one NDJSON line per token, last line ``"done": true``."""

    def __init__(self, engine: Engine, api_key: str | None) -> None:
        self.engine = engine
        self.api_key = api_key.encode() if api_key else None
        backend = engine.backend
        self.tokenizer = getattr(backend, "tokenizer", None)
        self.vocab_size = _vocab_size(backend)
        self._ids = itertools.count()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not _check_api_key(scope["headers"], self.api_key):
            await _send_json(send, 401, error_body("invalid or missing API key", "auth_error"))
            return
        try:
            raw = await _read_body(receive)
            if raw is None:
                return
            req = parse_generate(raw, self.tokenizer, self.vocab_size)
        except BadRequest as exc:
            await _send_json(send, exc.status, exc.body())
            return
        request_id = req.request_id if req.request_id is not None else f"gen-{next(self._ids)}"
        stream = self.engine.submit(request_id, req.prompt_token_ids, req.params)
        # After the body, receive() only returns when the client disconnects (or the
        # response completes): that is our abort signal, even before the first token.
        listener = asyncio.ensure_future(receive())
        listener.add_done_callback(lambda task: _on_disconnect(task, stream))
        try:
            await self._stream(stream, send)
        finally:
            listener.cancel()
            if not stream.done:
                stream.abort()

    async def _stream(self, stream: RequestStream, send: Send) -> None:
        events = await stream.get()
        if not events:
            return  # client went away before anything happened
        first = events[0]
        if first.finish_reason == "rejected":
            status = _REJECT_STATUS.get(first.error_type or "", 400)
            kind = "conflict" if status == 409 else "invalid_request_error"
            await _send_json(send, status, error_body(first.error or "rejected", kind))
            return
        await send(_NDJSON_START)
        while True:
            done = False
            if len(events) == 1:
                e = events[0]
                done = e.finished
                chunk = encode_event(e.index, e.token_id, e.text, done, e.finish_reason, e.error)
            else:
                parts = []
                for e in events:
                    parts.append(
                        encode_event(
                            e.index, e.token_id, e.text, e.finished, e.finish_reason, e.error
                        )
                    )
                    if e.finished:
                        done = True
                        break
                chunk = b"".join(parts)
            await send({"type": "http.response.body", "body": chunk, "more_body": not done})
            if done:
                return
            events = await stream.get()
            if not events:
                return  # aborted: the client is gone, nothing more to write


def _vocab_size(backend: Any) -> int:
    """Bound for client-supplied token ids: an id outside the model's embedding would fail
    the backend's whole batch, so it must be a 400 here. The Backend protocol has no
    vocab_size yet; the torch backend's model config has it."""
    for owner in (backend, getattr(getattr(backend, "model", None), "config", None)):
        size = getattr(owner, "vocab_size", None)
        if isinstance(size, int) and size > 0:
            return size
    return (1 << 31) - 1


def _on_disconnect(task: asyncio.Future[Message], stream: RequestStream) -> None:
    if task.cancelled() or task.exception() is not None:
        return
    if task.result().get("type") == "http.disconnect" and not stream.done:
        stream.abort()


#: /health fails when the engine has been inside one loop iteration this long: a step
#: that slow is a hang (a long CPU prefill takes seconds, not a minute).
HEALTH_STALL_S = 60.0


def create_app(
    engine: Engine,
    *,
    api_key: str | None = None,
    max_waiting_requests: int | None = None,
    served_model_name: str | None = None,
) -> Starlette:
    """The server app; its lifespan starts the engine thread and stops it.

    ``max_waiting_requests`` caps the queue the OpenAI endpoints add to (503 beyond it);
    ``served_model_name`` is the model id of /v1 (default: the backend's model_name).
    """
    # Imported here: openai_api imports this module's helpers.
    from iron_batch.server.openai_api import DEFAULT_MAX_WAITING_REQUESTS, OpenAIServer

    registry = make_registry(engine.stats)
    api_key_bytes = api_key.encode() if api_key else None

    async def metrics(request: Request) -> Response:
        if not _check_api_key(request.scope["headers"], api_key_bytes):
            return Response(error_body("invalid or missing API key", "auth_error"), 401)
        accept = request.headers.get("accept", "")
        if wants_prometheus(accept):
            body, content_type = prometheus_text(registry, accept)
            return Response(body, media_type=content_type)
        return Response(json.dumps(metrics_json(engine.stats)), media_type="application/json")

    async def health(request: Request) -> Response:
        if engine._thread is not None and not engine.running:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        if (
            engine._thread is not None
            and not engine.idle
            and time.monotonic() - engine.heartbeat > HEALTH_STALL_S
        ):
            return JSONResponse({"status": "engine stalled"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if engine._thread is None:
            engine.start()
        try:
            yield
        finally:
            # Joining the thread blocks; do it off the loop so late deliveries still land.
            await asyncio.to_thread(engine.shutdown)

    routes = [
        Route("/generate", GenerateEndpoint(engine, api_key), methods=["POST"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
    ]
    openai_server = OpenAIServer(
        engine,
        api_key=api_key,
        max_waiting_requests=(
            DEFAULT_MAX_WAITING_REQUESTS if max_waiting_requests is None else max_waiting_requests
        ),
        served_model_name=served_model_name,
        vocab_size=_vocab_size(engine.backend),
    )
    routes.extend(openai_server.routes())
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.engine = engine
    app.state.registry = registry
    return app
