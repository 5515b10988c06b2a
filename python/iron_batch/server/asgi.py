"""ASGI plumbing every endpoint shares: auth, body reading, sending JSON and errors, and
the in-flight context of a generation request (admission count + abort on disconnect).

The generation endpoints are raw ASGI callables rather than Starlette endpoints: they watch
``receive()`` for ``http.disconnect`` while the engine works and stream one pre-encoded
``send`` per step, with no response object per chunk. The small endpoints are Starlette
functions wrapped by :func:`guarded`, which gives them the same auth and error handling.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping, Sequence
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from iron_batch.engine import Engine, EngineUnavailable
from iron_batch.sampling_params import SamplingParams
from iron_batch.server.admission import Admission
from iron_batch.server.errors import ApiError, unauthorized, unavailable
from iron_batch.stream import RequestStream

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Handler = Callable[[Request], Awaitable[Response]]

JSON_HEADERS = [(b"content-type", b"application/json")]

#: The server's API key, or its several keys (one per tenant), or None (open).
ApiKeys = bytes | tuple[bytes, ...] | None


def api_key_bytes(api_key: str | Sequence[str] | None) -> ApiKeys:
    if api_key is None or isinstance(api_key, str):
        return api_key.encode() if api_key else None
    keys = tuple(dict.fromkeys(k.encode() for k in api_key if k))
    if not keys:
        return None
    return keys[0] if len(keys) == 1 else keys


def _matched_key(scope: Scope, api_key: ApiKeys) -> bytes | None:
    """The configured key the request carries, if any: in ``Authorization: Bearer`` (OpenAI's
    clients) or else in ``x-api-key`` (Anthropic's)."""
    if api_key is None:
        return None
    keys = api_key if isinstance(api_key, tuple) else (api_key,)
    token: bytes | None = None
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, bearer = value.partition(b" ")
            if scheme.lower() != b"bearer":
                return None
            token = bearer.strip()
            break
        if name == b"x-api-key" and token is None:
            token = value.strip()
    if token is None:
        return None
    found = None
    for key in keys:  # every key compared: the time says nothing about which
        if hmac.compare_digest(token, key):
            found = key
    return found


def authorized(scope: Scope, api_key: ApiKeys) -> bool:
    """Whether the request carries one of the server's keys (always, without any)."""
    return api_key is None or _matched_key(scope, api_key) is not None


def tenant_salt(scope: Scope, tenant_keys: tuple[bytes, ...] | None) -> str | None:
    """With several API keys, each key is a tenant: the prefix-cache salt its requests get,
    so that no tenant can probe another's prompts through time to first token."""
    if not tenant_keys:
        return None
    key = _matched_key(scope, tenant_keys)
    if key is None:
        return None
    return "tenant:" + hashlib.sha256(key).hexdigest()[:32]


def tenant_id(scope: Scope, api_key: ApiKeys) -> str | None:
    """Who owns what a request stores: its API key's digest (None on an open server, or
    with one key, where every client is the same tenant)."""
    if not isinstance(api_key, tuple):
        return None
    key = _matched_key(scope, api_key)
    return None if key is None else hashlib.sha256(key).hexdigest()


def salted(tenant: str | None, client_salt: str | None) -> str | None:
    """A tenant's salt with the client's own ``cache_salt`` inside it."""
    if tenant is None:
        return client_salt
    return tenant if client_salt is None else f"{tenant}/{client_salt}"


async def read_body(receive: Receive, limit: int) -> bytes | None:
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
            raise ApiError(f"body larger than {limit} bytes", status=413)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def send_json(send: Send, status: int, body: bytes,
                    headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": JSON_HEADERS + (headers or [])})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def send_error(send: Send, exc: ApiError) -> None:
    headers = [(k.lower().encode(), v.encode()) for k, v in exc.headers.items()]
    await send_json(send, exc.status, exc.body(), headers)


def error_response(exc: ApiError) -> Response:
    return JSONResponse(exc.payload(), status_code=exc.status, headers=exc.headers)


def guarded(handler: Handler, api_key: ApiKeys) -> Handler:
    """A Starlette endpoint with the API key check and ApiError -> error response."""

    async def endpoint(request: Request) -> Response:
        if not authorized(request.scope, api_key):
            return error_response(unauthorized())
        try:
            return await handler(request)
        except ApiError as exc:
            return error_response(exc)

    return endpoint


async def read_json(request: Request, limit: int) -> dict[str, Any]:
    """A Starlette request's body as a JSON object (see ``fields.parse_json_object``)."""
    from iron_batch.server.fields import parse_json_object

    raw = await read_body(request.receive, limit)
    if raw is None:
        raise ApiError("client disconnected")
    return parse_json_object(raw)


def submit(
    engine: Engine, requests: list[tuple[str, list[int], SamplingParams]]
) -> list[RequestStream]:
    """Submit every request or none: 503 when the engine cannot take work."""
    streams: list[RequestStream] = []
    try:
        for request_id, prompt, params in requests:
            streams.append(engine.submit(request_id, prompt, params))
    except EngineUnavailable as exc:
        for stream in streams:
            stream.abort()
        raise unavailable(str(exc), "engine_unavailable") from exc
    return streams


@contextlib.asynccontextmanager
async def in_flight(
    admission: Admission, receive: Receive, streams: list[RequestStream]
) -> AsyncIterator[None]:
    """While a response is written: counted as active (the drain waits for it); the client's
    disconnect (or a broken connection, or leaving the block) aborts ``streams``.

    After the body, ``receive()`` returns only when the client disconnects: abort then,
    whether we are streaming or still waiting to answer a non-streaming request.
    """

    def abort_all() -> None:
        for stream in streams:
            if not stream.done:
                stream.abort()

    def on_message(task: asyncio.Future[Message]) -> None:
        if task.cancelled() or task.exception() is not None:
            return
        if task.result().get("type") == "http.disconnect":
            abort_all()

    admission.active += 1
    listener = asyncio.ensure_future(receive())
    listener.add_done_callback(on_message)
    try:
        yield
    except OSError:
        pass  # the connection broke under us: abort below
    finally:
        admission.active -= 1
        listener.cancel()
        abort_all()


def dumps(obj: Any) -> bytes:
    return json.dumps(obj).encode()
