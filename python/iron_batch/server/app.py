"""The Starlette app: /generate (raw ASGI hot path), /metrics, /health.

/generate is a plain ASGI callable rather than a Starlette endpoint + StreamingResponse:
per token it does one pre-encoded ``send`` and nothing else (no response object, no
per-chunk task group), which is what lets the server keep up with the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
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

from iron_batch.engine import Engine, EngineUnavailable, RequestStream
from iron_batch.server.admission import RETRY_AFTER_S, Admission, ServerLimits, Unavailable
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


async def _read_body(receive: Receive, limit: int = MAX_BODY_BYTES) -> bytes | None:
    """The whole request body, or None when the client left; 413 past ``limit`` bytes."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BadRequest(f"body larger than {limit} bytes", status=413)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _send_unavailable(send: Send, exc: Unavailable | EngineUnavailable) -> None:
    code = getattr(exc, "code", "engine_unavailable")
    body = json.dumps(
        {"error": {"message": str(exc), "type": "server_error", "param": None, "code": code}}
    ).encode()
    headers = [*_JSON_HEADERS, (b"retry-after", b"%d" % RETRY_AFTER_S)]
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def check_request_size(
    limits: ServerLimits, prompt_len: int, max_new_tokens: int | None, new_tokens_name: str
) -> str | None:
    """Why a request is too big for this server's limits (a 400), or None."""
    if limits.max_prompt_tokens is not None and prompt_len > limits.max_prompt_tokens:
        return (f"the prompt has {prompt_len} tokens; this server accepts at most "
                f"{limits.max_prompt_tokens}")
    if (limits.max_new_tokens is not None and max_new_tokens is not None
            and max_new_tokens > limits.max_new_tokens):
        return (f"{new_tokens_name} is {max_new_tokens}; this server allows at most "
                f"{limits.max_new_tokens}")
    return None


class GenerateEndpoint:
    """POST /generate: one NDJSON line per token, last line ``"done": true``."""

    def __init__(self, engine: Engine, api_key: str | None, admission: Admission) -> None:
        self.engine = engine
        self.admission = admission
        self.limits = admission.limits
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
            raw = await _read_body(receive, self.limits.max_body_bytes)
            if raw is None:
                return
            req = parse_generate(raw, self.tokenizer, self.vocab_size)
            too_big = check_request_size(
                self.limits, len(req.prompt_token_ids), req.params.max_new_tokens,
                "max_new_tokens",
            )
            if too_big is not None:
                raise BadRequest(too_big)
        except BadRequest as exc:
            await _send_json(send, exc.status, exc.body())
            return
        request_id = req.request_id if req.request_id is not None else f"gen-{next(self._ids)}"
        try:
            self.admission.check(1, len(req.prompt_token_ids))
            stream = self.engine.submit(request_id, req.prompt_token_ids, req.params)
        except (Unavailable, EngineUnavailable) as exc:
            await _send_unavailable(send, exc)
            return
        self.admission.active += 1
        # After the body, receive() only returns when the client disconnects (or the
        # response completes): that is our abort signal, even before the first token.
        listener = asyncio.ensure_future(receive())
        listener.add_done_callback(lambda task: _on_disconnect(task, stream))
        try:
            await self._stream(stream, send)
        except OSError:
            pass  # the connection broke under us: abort below
        finally:
            self.admission.active -= 1
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
    limits: ServerLimits | None = None,
) -> Starlette:
    """The server app; its lifespan starts the engine thread and stops it.

    ``limits`` bound bodies, prompts, max_new_tokens and the waiting queue on every
    generation endpoint; ``max_waiting_requests``, when given, overrides its queue cap
    (503 + Retry-After beyond it). ``served_model_name`` is the model id of /v1 (default:
    the backend's model_name). ``app.state.admission`` drains the app at shutdown.
    """
    # Imported here: openai_api imports this module's helpers.
    from iron_batch.server.openai_api import OpenAIServer

    limits = dataclasses.replace(limits) if limits is not None else ServerLimits()
    if max_waiting_requests is not None:
        limits.max_waiting_requests = max_waiting_requests
    admission = Admission(engine, limits)

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
        if engine.fatal_error is not None:
            return JSONResponse(
                {"status": "engine failed", "error": engine.fatal_error}, status_code=503
            )
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
        Route("/generate", GenerateEndpoint(engine, api_key, admission), methods=["POST"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
    ]
    openai_server = OpenAIServer(
        engine,
        api_key=api_key,
        admission=admission,
        served_model_name=served_model_name,
        vocab_size=_vocab_size(engine.backend),
    )
    routes.extend(openai_server.routes())
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.engine = engine
    app.state.registry = registry
    app.state.admission = admission
    return app
