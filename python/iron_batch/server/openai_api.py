"""OpenAI-compatible endpoints: /v1/models, /v1/completions, /v1/chat/completions, plus
/tokenize, /detokenize and /openapi.json.

The two generation endpoints are raw ASGI callables, like /generate: they must watch
``receive()`` for ``http.disconnect`` while the engine works (a client that gives up on a
long non-streaming request must not keep its sequences running) and stream server-sent
events without a per-chunk response object. Each choice is one engine request; ``n``
choices of one prompt are ``n`` requests with the same prompt, so the prefix cache shares
the prompt's KV between them.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from iron_batch.engine import Engine, EngineUnavailable, RequestStream, TokenEvent
from iron_batch.server.admission import RETRY_AFTER_S, Admission, Unavailable
from iron_batch.server.app import Message, Receive, Scope, Send, _check_api_key, _read_body
from iron_batch.server.openai_protocol import (
    ModelInfo,
    OpenAIError,
    OpenAIRequest,
    TokenText,
    auth_error,
    chat_logprobs,
    chat_prompt_ids,
    check_model,
    completion_logprobs,
    finish_reason,
    parse_chat,
    parse_completion,
    parse_json_object,
    usage,
)
from iron_batch.server.protocol import BadRequest

_JSON_HEADERS = [(b"content-type", b"application/json")]
_SSE_START = {
    "type": "http.response.start",
    "status": 200,
    "headers": [
        (b"content-type", b"text/event-stream; charset=utf-8"),
        (b"cache-control", b"no-cache"),
        (b"x-accel-buffering", b"no"),  # proxies (nginx) must not hold events back
    ],
}
_DONE = b"data: [DONE]\n\n"

LogprobEntry = tuple[int, tuple[float, list[tuple[int, float]]]]


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


async def _send_error(send: Send, exc: OpenAIError) -> None:
    headers = list(_JSON_HEADERS)
    headers.extend((k.lower().encode(), v.encode()) for k, v in exc.headers.items())
    await send({"type": "http.response.start", "status": exc.status, "headers": headers})
    await send({"type": "http.response.body", "body": exc.body(), "more_body": False})


def _error_response(exc: OpenAIError) -> Response:
    return JSONResponse(exc.payload(), status_code=exc.status, headers=exc.headers)


@dataclass
class _Choice:
    """Everything one engine request produced, for the final response and usage."""

    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    logprobs: list[LogprobEntry] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    rejected: bool = False
    num_cached: int = 0
    done: bool = False

    def add(self, event: TokenEvent) -> None:
        if event.token_id is not None:
            self.num_tokens += 1
            if event.logprobs is not None:
                self.logprobs.append((event.token_id, event.logprobs))
        if event.text:
            self.text.append(event.text)
        if event.finished:
            self.done = True
            self.finish_reason = event.finish_reason
            self.rejected = event.finish_reason == "rejected"
            # An abort may carry a reason (client too slow); it is not a failure.
            self.error = event.error if event.finish_reason in ("error", "rejected") else None
            if event.num_cached_tokens is not None:
                self.num_cached = event.num_cached_tokens
            if event.finish_reason == "error" and self.error is None:
                self.error = "generation failed"


class OpenAIServer:
    """Holds what every OpenAI endpoint needs; ``routes()`` gives the Starlette routes."""

    def __init__(
        self,
        engine: Engine,
        *,
        api_key: str | None = None,
        admission: Admission,
        served_model_name: str | None = None,
        vocab_size: int,
    ) -> None:
        self.engine = engine
        self.api_key = api_key.encode() if api_key else None
        self.admission = admission
        limits = admission.limits
        backend = engine.backend
        config = engine.config
        pool = config.total_kv_blocks * config.kv_block_size
        limit = config.max_model_len
        self.model = ModelInfo(
            name=served_model_name or str(getattr(backend, "model_name", "iron-batch")),
            tokenizer=getattr(backend, "tokenizer", None),
            vocab_size=vocab_size,
            max_seq_tokens=pool if limit is None else min(pool, limit),
            max_prompt_tokens=limits.max_prompt_tokens,
            max_new_tokens=limits.max_new_tokens,
        )
        self.created = int(time.time())
        self.token_text = TokenText(self.model.tokenizer)
        self._ids = itertools.count()
        # Request ids unique across restarts too (clients log and correlate them).
        self._id_prefix = f"{os.getpid():x}{self.created:x}"

    # ------------------------------------------------------------------ plumbing

    def authorized(self, scope: Scope) -> bool:
        return _check_api_key(scope["headers"], self.api_key)

    def _check_capacity(self, req: OpenAIRequest) -> None:
        tokens = sum(len(p) for p in req.prompts) * req.n
        try:
            self.admission.check(req.num_choices, tokens)
        except Unavailable as exc:
            raise OpenAIError(
                str(exc), status=503, type="server_error", code=exc.code, headers=exc.headers
            ) from exc

    def routes(self) -> list[Route]:
        from iron_batch.server.openapi import openapi_schema

        schema = openapi_schema(self.model.name)

        def guarded(
            handler: Callable[[Request], Awaitable[Response]],
        ) -> Callable[[Request], Awaitable[Response]]:
            async def endpoint(request: Request) -> Response:
                if not self.authorized(request.scope):
                    return _error_response(auth_error())
                try:
                    return await handler(request)
                except OpenAIError as exc:
                    return _error_response(exc)

            return endpoint

        async def openapi(request: Request) -> Response:
            return JSONResponse(schema)

        return [
            Route("/v1/models", guarded(self.list_models), methods=["GET"]),
            Route("/v1/models/{model:path}", guarded(self.get_model), methods=["GET"]),
            Route("/v1/completions", _Generation(self, "completion"), methods=["POST"]),
            Route("/v1/chat/completions", _Generation(self, "chat"), methods=["POST"]),
            Route("/tokenize", guarded(self.tokenize), methods=["POST"]),
            Route("/detokenize", guarded(self.detokenize), methods=["POST"]),
            Route("/openapi.json", guarded(openapi), methods=["GET"]),
        ]

    # ------------------------------------------------------------------ small endpoints

    def _model_card(self) -> dict[str, Any]:
        return {
            "id": self.model.name,
            "object": "model",
            "created": self.created,
            "owned_by": "iron-batch",
            "max_model_len": self.model.max_seq_tokens,
        }

    async def list_models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def get_model(self, request: Request) -> Response:
        check_model({"model": request.path_params["model"]}, self.model)
        return JSONResponse(self._model_card())

    async def _json_body(self, request: Request) -> dict[str, Any]:
        try:
            raw = await _read_body(request.receive, self.admission.limits.max_body_bytes)
        except BadRequest as exc:
            raise OpenAIError(str(exc), status=exc.status) from exc
        if raw is None:
            raise OpenAIError("client disconnected")
        return parse_json_object(raw)

    async def tokenize(self, request: Request) -> Response:
        body = await self._json_body(request)
        check_model(body, self.model)
        if self.model.tokenizer is None:
            raise OpenAIError("this model has no tokenizer")
        has_prompt = body.get("prompt") is not None
        has_messages = body.get("messages") is not None
        if has_prompt == has_messages:
            raise OpenAIError("exactly one of prompt and messages is required")
        if has_prompt:
            prompt = body["prompt"]
            if not isinstance(prompt, str):
                raise OpenAIError("prompt must be a string", param="prompt")
            add_special = body.get("add_special_tokens", True)
            if not isinstance(add_special, bool):
                raise OpenAIError("add_special_tokens must be true or false",
                                  param="add_special_tokens")
            try:
                tokens = list(self.model.tokenizer.encode(prompt, add_special_tokens=add_special))
            except Exception as exc:
                raise OpenAIError(f"prompt could not be tokenized: {exc}", param="prompt") from exc
        else:
            from iron_batch.server.openai_protocol import _messages

            add_gen = body.get("add_generation_prompt", True)
            if not isinstance(add_gen, bool):
                raise OpenAIError("add_generation_prompt must be true or false",
                                  param="add_generation_prompt")
            tokens = chat_prompt_ids(self.model, _messages(body["messages"]), add_gen)
        return JSONResponse(
            {"tokens": tokens, "count": len(tokens), "max_model_len": self.model.max_seq_tokens}
        )

    async def detokenize(self, request: Request) -> Response:
        body = await self._json_body(request)
        check_model(body, self.model)
        if self.model.tokenizer is None:
            raise OpenAIError("this model has no tokenizer")
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.model.vocab_size
            for t in tokens
        ):
            raise OpenAIError(
                f"tokens must be a list of token ids in [0, {self.model.vocab_size})",
                param="tokens",
            )
        return JSONResponse({"prompt": self.model.tokenizer.decode(tokens)})

    # ------------------------------------------------------------------ generation

    def submit(self, req: OpenAIRequest) -> tuple[str, list[RequestStream]]:
        """One engine request per (prompt, choice); choice index = prompt * n + i."""
        self._check_capacity(req)
        prefix = "cmpl" if req.kind == "completion" else "chatcmpl"
        response_id = f"{prefix}-{self._id_prefix}{next(self._ids):x}"
        streams: list[RequestStream] = []
        try:
            for p, prompt in enumerate(req.prompts):
                for i, params in enumerate(req.params[p]):
                    streams.append(
                        self.engine.submit(f"{response_id}-{p * req.n + i}", list(prompt), params)
                    )
        except EngineUnavailable as exc:
            for stream in streams:
                stream.abort()
            raise OpenAIError(
                str(exc), status=503, type="server_error", code="engine_unavailable",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            ) from exc
        return response_id, streams


class _Generation:
    """POST /v1/completions and /v1/chat/completions (raw ASGI, see the module docstring)."""

    def __init__(self, server: OpenAIServer, kind: str) -> None:
        self.server = server
        self.kind = kind

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        server = self.server
        if not server.authorized(scope):
            await _send_error(send, auth_error())
            return
        try:
            try:
                raw = await _read_body(receive, server.admission.limits.max_body_bytes)
            except BadRequest as exc:
                raise OpenAIError(str(exc), status=exc.status) from exc
            if raw is None:
                return  # the client left while sending
            body = parse_json_object(raw)
            parse = parse_completion if self.kind == "completion" else parse_chat
            req = parse(body, server.model)
            response_id, streams = server.submit(req)
        except OpenAIError as exc:
            await _send_error(send, exc)
            return

        def abort_all() -> None:
            for stream in streams:
                if not stream.done:
                    stream.abort()

        # After the body, receive() returns only when the client disconnects: abort then,
        # whether we are streaming or still waiting to answer a non-streaming request.
        server.admission.active += 1
        listener = asyncio.ensure_future(receive())
        listener.add_done_callback(lambda task: _on_disconnect(task, abort_all))
        try:
            if req.stream:
                await self._stream(req, response_id, streams, send)
            else:
                await self._complete(req, response_id, streams, send)
        except OSError:
            pass  # the connection broke under us: abort below
        finally:
            server.admission.active -= 1
            listener.cancel()
            abort_all()

    # ---------------------------------------------------------------- non-streaming

    async def _complete(
        self, req: OpenAIRequest, response_id: str, streams: list[RequestStream], send: Send
    ) -> None:
        created = int(time.time())
        choices = [_Choice() for _ in streams]

        async def collect(stream: RequestStream, choice: _Choice) -> None:
            async for events in stream:
                for event in events:
                    choice.add(event)

        await asyncio.gather(*(collect(s, c) for s, c in zip(streams, choices, strict=True)))
        if not all(c.done for c in choices):
            return  # aborted: the client is gone
        for c in choices:
            if c.rejected:
                await _send_error(send, OpenAIError(c.error or "request rejected"))
                return
        for c in choices:
            if c.error is not None:
                await _send_error(
                    send, OpenAIError(c.error, status=500, type="server_error")
                )
                return
        token_text = self.server.token_text
        out = []
        for index, c in enumerate(choices):
            text = "".join(c.text)
            lp: dict[str, Any] | None = None
            if req.kind == "completion":
                prompt_text = req.prompt_texts[index // req.n] if req.echo else None
                if prompt_text:
                    text = prompt_text + text
                if req.logprobs is not None:
                    lp = completion_logprobs(c.logprobs, req.logprobs, token_text, 0)
                out.append({"index": index, "text": text, "logprobs": lp,
                            "finish_reason": finish_reason(c.finish_reason)})
            else:
                if req.logprobs is not None:
                    lp = chat_logprobs(c.logprobs, req.logprobs, token_text)
                out.append({"index": index,
                            "message": {"role": "assistant", "content": text},
                            "logprobs": lp,
                            "finish_reason": finish_reason(c.finish_reason)})
        body = {
            "id": response_id,
            "object": "text_completion" if req.kind == "completion" else "chat.completion",
            "created": created,
            "model": req.model,
            "choices": out,
            "usage": _usage(req, choices),
        }
        payload = json.dumps(body).encode()
        await send({"type": "http.response.start", "status": 200, "headers": _JSON_HEADERS})
        await send({"type": "http.response.body", "body": payload, "more_body": False})

    # ---------------------------------------------------------------- streaming

    async def _stream(
        self, req: OpenAIRequest, response_id: str, streams: list[RequestStream], send: Send
    ) -> None:
        created = int(time.time())
        is_chat = req.kind == "chat"
        head = {
            "id": response_id,
            "object": "chat.completion.chunk" if is_chat else "text_completion",
            "created": created,
            "model": req.model,
        }
        # Chunks carry "usage": null when usage is coming at the end (OpenAI's shape).
        tail: dict[str, Any] = {"usage": None} if req.include_usage else {}
        choices = [_Choice() for _ in streams]
        token_text = self.server.token_text
        # Bounded: while a slow client blocks our writes, the pumps stop and events pile up
        # in each RequestStream, whose own bound aborts the request (see RequestStream).
        queue: asyncio.Queue[tuple[int, list[TokenEvent] | None]] = asyncio.Queue(
            maxsize=2 * len(streams)
        )

        async def pump(index: int, stream: RequestStream) -> None:
            # No try/finally: only our own finally below cancels a pump, once nobody reads.
            async for events in stream:
                await queue.put((index, events))
            await queue.put((index, None))

        pumps = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
        try:
            await send(_SSE_START)
            first: list[bytes] = []
            for index in range(len(streams)):
                if is_chat:
                    delta = {"role": "assistant", "content": ""}
                    first.append(_sse({**head, "choices": [
                        {"index": index, "delta": delta, "logprobs": None,
                         "finish_reason": None}], **tail}))
                elif req.echo and req.prompt_texts[index // req.n]:
                    first.append(_sse({**head, "choices": [
                        {"index": index, "text": req.prompt_texts[index // req.n],
                         "logprobs": None, "finish_reason": None}], **tail}))
            if first:
                await send({"type": "http.response.body", "body": b"".join(first),
                            "more_body": True})
            open_streams = len(streams)
            text_offsets = [0] * len(streams)
            while open_streams:
                items = [await queue.get()]
                while not queue.empty():  # everything this step produced, in one write
                    items.append(queue.get_nowait())
                parts: list[bytes] = []
                for index, events in items:
                    if events is None:
                        open_streams -= 1
                        continue
                    choice = choices[index]
                    for event in events:
                        choice.add(event)
                        if choice.rejected or choice.error is not None:
                            parts.append(_sse(OpenAIError(
                                choice.error or "request rejected",
                                status=400 if choice.rejected else 500,
                                type="invalid_request_error" if choice.rejected
                                else "server_error",
                            ).payload()))
                            await send({"type": "http.response.body",
                                        "body": b"".join(parts) + _DONE, "more_body": False})
                            return
                        chunk = self._chunk(req, index, event, token_text, text_offsets)
                        if chunk is not None:
                            parts.append(_sse({**head, "choices": [chunk], **tail}))
                if parts:
                    await send({"type": "http.response.body", "body": b"".join(parts),
                                "more_body": True})
            if not all(c.done for c in choices):
                return  # aborted: the client is gone
            end = b""
            if req.include_usage:
                end = _sse({**head, "choices": [], "usage": _usage(req, choices)})
            await send({"type": "http.response.body", "body": end + _DONE, "more_body": False})
        except OSError:
            return  # the connection broke under us; the caller aborts the requests
        finally:
            for task in pumps:
                task.cancel()

    @staticmethod
    def _chunk(
        req: OpenAIRequest,
        index: int,
        event: TokenEvent,
        token_text: TokenText,
        text_offsets: list[int],
    ) -> dict[str, Any] | None:
        text = event.text or ""
        reason = finish_reason(event.finish_reason) if event.finished else None
        entries: list[LogprobEntry] = []
        if req.logprobs is not None and event.token_id is not None and event.logprobs:
            entries.append((event.token_id, event.logprobs))
        if not text and not entries and not event.finished and token_text.has_tokenizer:
            # Text held back (partial UTF-8 or a possible stop string). Without a tokenizer
            # there is never text: send the empty chunk anyway, as a sign of progress.
            return None
        lp: dict[str, Any] | None = None
        if req.kind == "chat":
            if entries:
                lp = chat_logprobs(entries, req.logprobs or 0, token_text)
            delta = {"content": text} if text or not event.finished else {}
            return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": reason}
        if entries:
            lp = completion_logprobs(entries, req.logprobs or 0, token_text, text_offsets[index])
            text_offsets[index] += sum(len(t) for t in lp["tokens"])
        return {"index": index, "text": text, "logprobs": lp, "finish_reason": reason}


def _usage(req: OpenAIRequest, choices: list[_Choice]) -> dict[str, Any]:
    # Each prompt is counted once however many choices share it (as OpenAI does); its
    # cached tokens are those of its first choice, the one whose prompt was computed/billed.
    prompt_tokens = sum(len(p) for p in req.prompts)
    cached = sum(choices[p * req.n].num_cached for p in range(len(req.prompts)))
    completion_tokens = sum(c.num_tokens for c in choices)
    return usage(prompt_tokens, completion_tokens, cached)


def _on_disconnect(task: asyncio.Future[Message], abort: Callable[[], None]) -> None:
    if task.cancelled() or task.exception() is not None:
        return
    if task.result().get("type") == "http.disconnect":
        abort()
