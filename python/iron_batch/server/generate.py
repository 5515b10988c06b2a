"""POST /generate: the native front end, one NDJSON line per token, the last ``"done": true``.

Strict by design: unknown fields and explicit nulls are errors (see
:mod:`iron_batch.server.fields`). Per token the endpoint does one pre-encoded ``send`` and
nothing else, which is what lets the server keep up with the engine.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from typing import Any

from iron_batch.engine import Engine
from iron_batch.sampling_params import SamplingParams
from iron_batch.server import fields
from iron_batch.server.admission import Admission
from iron_batch.server.asgi import (
    ApiKeys,
    Receive,
    Scope,
    Send,
    authorized,
    in_flight,
    read_body,
    salted,
    send_error,
    submit,
    tenant_salt,
)
from iron_batch.server.errors import ApiError, rejected, unauthorized
from iron_batch.server.fields import MAX_REQUEST_ID_LEN
from iron_batch.stream import RequestStream

_PROMPT_FIELDS = ("prompt_tokens", "prompt_token_ids", "prompt")
ALLOWED_FIELDS = frozenset(
    (
        *_PROMPT_FIELDS,
        *(spec.name for spec in fields.SAMPLING),
        "max_new_tokens",
        "request_id",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "skip_special_tokens",
        "speculate",
    )
)


@dataclass
class GenerateRequest:
    request_id: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    #: The body field the prompt came in (error messages name it).
    prompt_field: str = "prompt_tokens"


def synthetic_prompt(n: int, vocab_size: int) -> list[int]:
    """The prompt behind ``"prompt_tokens": n``: a fixed sequence, the same for every request
    (so equal requests get equal outputs, and the prefix cache sees shared prefixes)."""
    return [(1 + i * 7919) % vocab_size for i in range(n)]


def parse_generate(raw: bytes, tokenizer: Any, vocab_size: int) -> GenerateRequest:
    """Turn a /generate body into a validated request, or raise :class:`ApiError`."""
    body = fields.parse_json_object(raw)
    unknown = sorted(set(body) - ALLOWED_FIELDS)
    if unknown:
        raise ApiError(f"unknown field(s): {', '.join(unknown)}", param=unknown[0])

    given = [name for name in _PROMPT_FIELDS if name in body]
    if len(given) != 1:
        raise ApiError("exactly one of prompt_tokens, prompt_token_ids, prompt is required")
    if "prompt_tokens" in body:
        n = fields.PROMPT_TOKENS.read(body, null_ok=False)
        prompt = synthetic_prompt(n, vocab_size)
    elif "prompt_token_ids" in body:
        prompt = fields.token_ids(body["prompt_token_ids"], "prompt_token_ids", vocab_size)
    else:
        text = body["prompt"]
        if not isinstance(text, str) or not text:
            raise ApiError("prompt must be a non-empty string", param="prompt")
        prompt = fields.encode_text(tokenizer, text, "prompt")
        if not prompt:
            raise ApiError("prompt encodes to no tokens", param="prompt")

    request_id = fields.read_str(body, "request_id", null_ok=False)
    if request_id is not None and not 0 < len(request_id) <= MAX_REQUEST_ID_LEN:
        raise ApiError(
            f"request_id must be a string of 1 to {MAX_REQUEST_ID_LEN} characters",
            param="request_id",
        )
    params = SamplingParams()
    max_new = fields.MAX_NEW_TOKENS.read(body, null_ok=False)
    if max_new is not None:
        params.max_new_tokens = max_new
    fields.read_sampling(body, params, tokenizer, vocab_size, null_ok=False)
    return GenerateRequest(request_id, prompt, fields.check(params), given[0])


# --- NDJSON lines ------------------------------------------------------------------------
# Built with bytes %-formatting: no dict, no json.dumps per token on the common path.

_LINE = b'{"token_index":%d,"token_id":%d,"done":false}\n'
_LINE_TEXT = b'{"token_index":%d,"token_id":%d,"text":%s,"done":false}\n'
_NDJSON_START = {
    "type": "http.response.start",
    "status": 200,
    "headers": [(b"content-type", b"application/x-ndjson"), (b"cache-control", b"no-cache")],
}


def encode_event(
    index: int,
    token_id: int | None,
    text: str | None,
    finished: bool,
    finish_reason: str | None,
    error: str | None,
) -> bytes:
    if not finished:
        if text is None:
            return _LINE % (index, token_id)
        return _LINE_TEXT % (index, token_id, json.dumps(text).encode())
    parts = [b'{"token_index":%d,"token_id":' % index]
    parts.append(b"null" if token_id is None else b"%d" % token_id)
    if text is not None:
        parts.append(b',"text":' + json.dumps(text).encode())
    parts.append(b',"done":true,"finish_reason":' + json.dumps(finish_reason).encode())
    if error is not None:
        parts.append(b',"error":' + json.dumps(error).encode())
    parts.append(b"}\n")
    return b"".join(parts)


class GenerateEndpoint:
    """POST /generate (raw ASGI)."""

    def __init__(
        self, engine: Engine, api_key: ApiKeys, admission: Admission,
        tenant_keys: tuple[bytes, ...] | None = None,
    ) -> None:
        self.engine = engine
        self.admission = admission
        self.api_key = api_key
        self.tenant_keys = tenant_keys
        backend = engine.backend
        self.tokenizer = backend.tokenizer
        self.vocab_size = backend.vocab_size
        self._ids = itertools.count()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        admission = self.admission
        try:
            if not authorized(scope, self.api_key):
                raise unauthorized()
            raw = await read_body(receive, admission.limits.max_body_bytes)
            if raw is None:
                return  # the client left while sending
            req = parse_generate(raw, self.tokenizer, self.vocab_size)
            prompt_len = len(req.prompt_token_ids)
            admission.check_size(prompt_len, req.params.max_new_tokens,
                                 prompt_param=req.prompt_field,
                                 new_tokens_param="max_new_tokens")
            admission.check_capacity(1, prompt_len)
            req.params.cache_salt = salted(tenant_salt(scope, self.tenant_keys),
                                           req.params.cache_salt)
            rid = req.request_id if req.request_id is not None else f"gen-{next(self._ids)}"
            streams = submit(self.engine, [(rid, req.prompt_token_ids, req.params)])
        except ApiError as exc:
            await send_error(send, exc)
            return
        async with in_flight(admission, receive, streams):
            await self._stream(streams[0], send)

    async def _stream(self, stream: RequestStream, send: Send) -> None:
        events = await stream.get()
        if not events:
            return  # client went away before anything happened
        first = events[0]
        if first.finish_reason == "rejected":
            await send_error(send, rejected(first.error, first.error_type))
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
