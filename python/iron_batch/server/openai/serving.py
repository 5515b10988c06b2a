"""OpenAI-compatible endpoints: /v1/models, /v1/completions, /v1/chat/completions, plus
/tokenize and /detokenize.

The two generation endpoints are raw ASGI callables, like /generate (see
:mod:`iron_batch.server.asgi`). Each choice is one engine request; ``n`` choices of one
prompt are ``n`` requests with the same prompt, so the prefix cache shares the prompt's KV
between them.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from iron_batch.engine import Engine
from iron_batch.server.admission import Admission
from iron_batch.server.asgi import (
    ApiKeys,
    Receive,
    Scope,
    Send,
    authorized,
    guarded,
    in_flight,
    read_body,
    read_json,
    salted,
    send_error,
    send_json,
    submit,
    tenant_salt,
)
from iron_batch.server.errors import ApiError, unauthorized
from iron_batch.server.fields import parse_json_object
from iron_batch.server.openai.output import OutputStream, assistant_message, splitter
from iron_batch.server.openai.protocol import (
    ModelInfo,
    OpenAIRequest,
    chat_prompt_ids,
    check_model,
    messages_from,
    parse_chat,
    parse_completion,
    template_kwargs,
)
from iron_batch.server.openai.reasoning import reasoning_format
from iron_batch.server.openai.responses import (
    DONE,
    Choice,
    LogprobEntry,
    TokenText,
    chat_logprobs,
    completion_logprobs,
    request_usage,
    scored_completion_logprobs,
    sse,
)
from iron_batch.server.openai.tools import read_tool_list
from iron_batch.stream import RequestStream, TokenEvent

_SSE_START = {
    "type": "http.response.start",
    "status": 200,
    "headers": [
        (b"content-type", b"text/event-stream; charset=utf-8"),
        (b"cache-control", b"no-cache"),
        (b"x-accel-buffering", b"no"),  # proxies (nginx) must not hold events back
    ],
}


class OpenAIServer:
    """Holds what every OpenAI endpoint needs; ``routes()`` gives the Starlette routes."""

    def __init__(
        self,
        engine: Engine,
        *,
        api_key: ApiKeys,
        admission: Admission,
        served_model_name: str | None = None,
        tenant_keys: tuple[bytes, ...] | None = None,
        reasoning_parser: str = "auto",
    ) -> None:
        self.engine = engine
        self.api_key = api_key
        self.tenant_keys = tenant_keys
        self.admission = admission
        backend = engine.backend
        config = engine.config
        pool = config.total_kv_blocks * config.kv_block_size
        limit = config.max_model_len
        self.model = ModelInfo(
            name=served_model_name or backend.model_name,
            tokenizer=backend.tokenizer,
            vocab_size=backend.vocab_size,
            max_seq_tokens=pool if limit is None else min(pool, limit),
            limits=admission.limits,
            structured_output=backend.supports_structured_output,
            reasoning=reasoning_format(getattr(backend.tokenizer, "chat_template", None),
                                       reasoning_parser, backend.tokenizer),
        )
        #: The backend pools hidden states (/v1/embeddings), of this many components.
        self.embeddings = bool(getattr(backend, "supports_embeddings", False))
        config_of_model = getattr(getattr(backend, "model", None), "config", None)
        self.embedding_size: int | None = getattr(config_of_model, "hidden_size", None)
        self.created = int(time.time())
        self.token_text = TokenText(self.model.tokenizer)
        self._ids = itertools.count()
        # Request ids unique across restarts too (clients log and correlate them).
        self._id_prefix = f"{os.getpid():x}{self.created:x}"

    def routes(self) -> list[Route]:
        key = self.api_key
        return [
            Route("/v1/models", guarded(self.list_models, key), methods=["GET"]),
            Route("/v1/models/{model:path}", guarded(self.get_model, key), methods=["GET"]),
            Route("/v1/completions", _Generation(self, "completion"), methods=["POST"]),
            Route("/v1/chat/completions", _Generation(self, "chat"), methods=["POST"]),
            Route("/tokenize", guarded(self.tokenize, key), methods=["POST"]),
            Route("/detokenize", guarded(self.detokenize, key), methods=["POST"]),
            Route("/tokenizer_info", guarded(self.tokenizer_info, key), methods=["GET"]),
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
        return await read_json(request, self.admission.limits.max_body_bytes)

    async def tokenize(self, request: Request) -> Response:
        body = await self._json_body(request)
        check_model(body, self.model)
        tokenizer = self.model.tokenizer
        if tokenizer is None:
            raise ApiError("this model has no tokenizer")
        has_prompt = body.get("prompt") is not None
        has_messages = body.get("messages") is not None
        if has_prompt == has_messages:
            raise ApiError("exactly one of prompt and messages is required")
        if has_prompt:
            prompt = body["prompt"]
            if not isinstance(prompt, str):
                raise ApiError("prompt must be a string", param="prompt")
            add_special = body.get("add_special_tokens", True)
            if not isinstance(add_special, bool):
                raise ApiError("add_special_tokens must be true or false",
                               param="add_special_tokens")
            try:
                tokens = list(tokenizer.encode(prompt, add_special_tokens=add_special))
            except Exception as exc:
                raise ApiError(f"prompt could not be tokenized: {exc}", param="prompt") from exc
        else:
            add_gen = body.get("add_generation_prompt", True)
            if not isinstance(add_gen, bool):
                raise ApiError("add_generation_prompt must be true or false",
                               param="add_generation_prompt")
            declared = [t.declaration for t in read_tool_list(body)]
            tokens = chat_prompt_ids(self.model, messages_from(body["messages"]), add_gen,
                                     declared or None, template_kwargs(body))
        return JSONResponse(
            {"tokens": tokens, "count": len(tokens), "max_model_len": self.model.max_seq_tokens}
        )

    async def tokenizer_info(self, request: Request) -> Response:
        """What a client needs to tokenize as the server does (lm-evaluation-harness's
        remote tokenizer reads it): special tokens, chat template, context length."""
        tokenizer = self.model.tokenizer
        if tokenizer is None:
            raise ApiError("this model has no tokenizer", status=404, code="no_tokenizer")
        return JSONResponse({
            "eos_token": getattr(tokenizer, "eos_token", None),
            "bos_token": getattr(tokenizer, "bos_token", None),
            "pad_token": getattr(tokenizer, "pad_token", None),
            "chat_template": getattr(tokenizer, "chat_template", None),
            "model_max_length": self.model.max_seq_tokens,
        })

    async def detokenize(self, request: Request) -> Response:
        body = await self._json_body(request)
        check_model(body, self.model)
        if self.model.tokenizer is None:
            raise ApiError("this model has no tokenizer")
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.model.vocab_size
            for t in tokens
        ):
            raise ApiError(
                f"tokens must be a list of token ids in [0, {self.model.vocab_size})",
                param="tokens",
            )
        return JSONResponse({"prompt": self.model.tokenizer.decode(tokens)})

    # ------------------------------------------------------------------ generation

    def new_id(self, prefix: str) -> str:
        """An id unique to this server process (and across its restarts)."""
        return f"{prefix}{self._id_prefix}{next(self._ids):x}"

    def submit(
        self, req: OpenAIRequest, prefix: str | None = None
    ) -> tuple[str, list[RequestStream]]:
        """One engine request per (prompt, choice); choice index = prompt * n + i."""
        self.admission.check_capacity(req.num_choices, sum(len(p) for p in req.prompts) * req.n)
        if prefix is None:
            prefix = "cmpl-" if req.kind == "completion" else "chatcmpl-"
        response_id = self.new_id(prefix)
        streams = submit(self.engine, [
            (f"{response_id}-{p * req.n + i}", list(prompt), params)
            for p, prompt in enumerate(req.prompts)
            for i, params in enumerate(req.params[p])
        ])
        return response_id, streams


async def collect(streams: list[RequestStream]) -> list[Choice] | None:
    """Every event of ``streams``, one :class:`Choice` each; None when one was aborted (the
    client is gone)."""
    choices = [Choice() for _ in streams]

    async def drain(stream: RequestStream, choice: Choice) -> None:
        async for events in stream:
            for event in events:
                choice.add(event)

    await asyncio.gather(*(drain(s, c) for s, c in zip(streams, choices, strict=True)))
    return choices if all(c.done for c in choices) else None


def first_failure(choices: list[Choice]) -> ApiError | None:
    """The error to answer with: a rejection (the client's fault) before a failure (ours)."""
    failures = sorted((f for c in choices if (f := c.failure()) is not None),
                      key=lambda f: f.status)
    return failures[0] if failures else None


class GenerationEndpoint:
    """A raw ASGI endpoint that generates: the API key, the body, the request's parse, its
    submission (with the tenant's cache salt) and its in-flight context are here; a front
    end gives ``parse`` and ``respond`` (and ``send_error``, for its own error shape)."""

    #: Response id prefix (None: the OpenAI endpoints' own).
    id_prefix: str | None = None

    def __init__(self, server: OpenAIServer) -> None:
        self.server = server

    def parse(self, body: dict[str, Any], scope: Scope) -> tuple[OpenAIRequest, Any]:
        """(engine request, front-end context) of a JSON body; ApiError for bad input."""
        raise NotImplementedError

    async def respond(self, req: OpenAIRequest, context: Any, response_id: str,
                      streams: list[RequestStream], send: Send) -> None:
        raise NotImplementedError

    async def send_error(self, send: Send, exc: ApiError) -> None:
        await send_error(send, exc)

    async def results(self, streams: list[RequestStream], send: Send) -> list[Choice] | None:
        """Every choice, once all are done; None when the client left, or when one failed
        (its error is sent)."""
        choices = await collect(streams)
        if choices is None:
            return None
        failure = first_failure(choices)
        if failure is not None:
            await self.send_error(send, failure)
            return None
        return choices

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        server = self.server
        try:
            if not authorized(scope, server.api_key):
                raise unauthorized()
            raw = await read_body(receive, server.admission.limits.max_body_bytes)
            if raw is None:
                return  # the client left while sending
            req, context = self.parse(parse_json_object(raw), scope)
            tenant = tenant_salt(scope, server.tenant_keys)
            if tenant is not None:
                for per_prompt in req.params:
                    for params in per_prompt:
                        params.cache_salt = salted(tenant, params.cache_salt)
            response_id, streams = server.submit(req, self.id_prefix)
        except ApiError as exc:
            await self.send_error(send, exc)
            return
        async with in_flight(server.admission, receive, streams):
            await self.respond(req, context, response_id, streams, send)


class _Generation(GenerationEndpoint):
    """POST /v1/completions and /v1/chat/completions (raw ASGI, see the module docstring)."""

    def __init__(self, server: OpenAIServer, kind: str) -> None:
        super().__init__(server)
        self.kind = kind

    def parse(self, body: dict[str, Any], scope: Scope) -> tuple[OpenAIRequest, Any]:
        parse = parse_completion if self.kind == "completion" else parse_chat
        return parse(body, self.server.model), None

    async def respond(self, req: OpenAIRequest, context: Any, response_id: str,
                      streams: list[RequestStream], send: Send) -> None:
        if req.stream:
            await self._stream(req, response_id, streams, send)
        else:
            await self._complete(req, response_id, streams, send)

    # ---------------------------------------------------------------- non-streaming

    async def _complete(
        self, req: OpenAIRequest, response_id: str, streams: list[RequestStream], send: Send
    ) -> None:
        created = int(time.time())
        choices = await self.results(streams, send)
        if choices is None:
            return
        token_text = self.server.token_text
        out = []
        for index, c in enumerate(choices):
            text = "".join(c.text)
            lp: dict[str, Any] | None = None
            if req.kind == "completion":
                prompt_text = req.prompt_texts[index // req.n] if req.echo else None
                if req.score_only:
                    text = ""
                if prompt_text:
                    text = prompt_text + text
                if req.prompt_logprobs:
                    generated = [] if req.score_only else c.logprobs
                    lp = scored_completion_logprobs(
                        req.prompts[index // req.n], c.prompt_logprobs, generated,
                        req.logprobs or 0, token_text,
                    )
                elif req.logprobs is not None:
                    lp = completion_logprobs(c.logprobs, req.logprobs, token_text, 0)
                out.append({"index": index, "text": text, "logprobs": lp,
                            "finish_reason": c.finish_reason})
            else:
                if req.logprobs is not None:
                    lp = chat_logprobs(c.logprobs, req.logprobs, token_text)
                message, reason = assistant_message(
                    text, c.finish_reason, req.tool_plan,
                    splitter(req.reasoning, req.reasoning_open),
                )
                out.append({"index": index, "message": message, "logprobs": lp,
                            "finish_reason": reason})
        body = {
            "id": response_id,
            "object": "text_completion" if req.kind == "completion" else "chat.completion",
            "created": created,
            "model": req.model,
            "choices": out,
            "usage": request_usage(req, choices),
        }
        await send_json(send, 200, json.dumps(body).encode())

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
        choices = [Choice() for _ in streams]
        token_text = self.server.token_text

        def tail_now() -> dict[str, Any]:
            # continuous_usage_stats: every chunk says the usage so far (guidellm reads it).
            return {"usage": request_usage(req, choices)} if req.continuous_usage else tail
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
                    first.append(sse({**head, "choices": [
                        {"index": index, "delta": delta, "logprobs": None,
                         "finish_reason": None}], **tail_now()}))
                elif (req.echo and req.prompt_texts[index // req.n]
                      and not req.prompt_logprobs):
                    # (A scored prompt is echoed with its logprobs, on its first token.)
                    first.append(sse({**head, "choices": [
                        {"index": index, "text": req.prompt_texts[index // req.n],
                         "logprobs": None, "finish_reason": None}], **tail_now()}))
            if first:
                await send({"type": "http.response.body", "body": b"".join(first),
                            "more_body": True})
            open_streams = len(streams)
            text_offsets = [0] * len(streams)
            output_streams = None
            if req.tool_plan is not None or req.reasoning is not None:
                output_streams = [
                    OutputStream(req.tool_plan, splitter(req.reasoning, req.reasoning_open))
                    for _ in streams
                ]
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
                        failure = choice.failure()
                        if failure is not None:
                            # Too late for a status: the error is the stream's last event.
                            parts.append(sse(failure.payload()))
                            await send({"type": "http.response.body",
                                        "body": b"".join(parts) + DONE, "more_body": False})
                            return
                        chunk = self._chunk(req, index, event, token_text, text_offsets,
                                            output_streams)
                        if chunk is not None:
                            parts.append(sse({**head, "choices": [chunk], **tail_now()}))
                if parts:
                    await send({"type": "http.response.body", "body": b"".join(parts),
                                "more_body": True})
            if not all(c.done for c in choices):
                return  # aborted: the client is gone
            end = b""
            if req.include_usage:
                end = sse({**head, "choices": [], "usage": request_usage(req, choices)})
            await send({"type": "http.response.body", "body": end + DONE, "more_body": False})
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
        output_streams: list[OutputStream] | None = None,
    ) -> dict[str, Any] | None:
        text = event.text or ""
        reason = event.finish_reason if event.finished else None
        if output_streams is not None:
            delta, reason = output_streams[index].feed(text, event.finished, reason)
            lp = None
            if req.logprobs is not None and event.token_id is not None and event.logprobs:
                lp = chat_logprobs([(event.token_id, event.logprobs)], req.logprobs, token_text)
            if not delta and lp is None and not event.finished:
                return None
            return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": reason}
        entries: list[LogprobEntry] = []
        if req.logprobs is not None and event.token_id is not None and event.logprobs:
            entries.append((event.token_id, event.logprobs))
        if req.score_only:
            # Nothing generated is returned: the token computed to score the prompt is not.
            text, entries = "", []
        if req.prompt_logprobs and event.prompt_logprobs is not None:
            # The first token: the echoed prompt and its logprobs come with it.
            lp = scored_completion_logprobs(
                req.prompts[index // req.n], event.prompt_logprobs, entries,
                req.logprobs or 0, token_text,
            )
            text_offsets[index] = sum(len(t) for t in lp["tokens"])
            prompt_text = req.prompt_texts[index // req.n] or ""
            return {"index": index, "text": prompt_text + text, "logprobs": lp,
                    "finish_reason": reason}
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


