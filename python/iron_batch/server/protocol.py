"""Validation of /generate bodies and the pre-encoded NDJSON lines it streams.

Validation is strict on purpose: a bool is not an int, a float is not an int, unknown
fields are errors. Every failure is a :class:`BadRequest` naming the field, which the
server turns into a 4xx JSON body before any 200 is sent.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from iron_batch.sampling_params import SamplingParams

#: Hard ceiling on any token count in a request: bounds the work done before the
#: scheduler can reject a request that would never fit the KV pool.
MAX_TOKENS = 1 << 20
MAX_BODY_BYTES = 16 << 20
MAX_STOP_ITEMS = 16
MAX_REQUEST_ID_LEN = 256

_PROMPT_FIELDS = ("prompt_tokens", "prompt_token_ids", "prompt")
_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)
_ALLOWED_FIELDS = frozenset(
    (
        *_PROMPT_FIELDS,
        *_FLOAT_FIELDS,
        "max_new_tokens",
        "request_id",
        "top_k",
        "seed",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "skip_special_tokens",
    )
)


class BadRequest(Exception):
    """A client error; ``status`` is the HTTP code, ``param`` the offending field."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param

    def body(self) -> bytes:
        return error_body(str(self), "invalid_request_error", self.param)


def error_body(message: str, kind: str, param: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": kind, "param": param}}).encode()


@dataclass
class GenerateRequest:
    request_id: str | None
    prompt_token_ids: list[int]
    params: SamplingParams


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _int(body: dict[str, Any], name: str, lo: int, hi: int, default: int | None) -> int | None:
    value = body.get(name, default)
    if value is None and default is None and name not in body:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{name} must be an integer", param=name)
    if not lo <= value <= hi:
        raise BadRequest(f"{name} must be between {lo} and {hi}, got {value}", param=name)
    return value


def _float(body: dict[str, Any], name: str) -> float | None:
    if name not in body:
        return None
    value = body[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRequest(f"{name} must be a number", param=name)
    value = float(value)
    if not math.isfinite(value):
        raise BadRequest(f"{name} must be finite", param=name)
    return value


def _token_list(value: Any, name: str, vocab_size: int, allow_empty: bool) -> list[int]:
    if not isinstance(value, list):
        raise BadRequest(f"{name} must be a list of integers", param=name)
    if not value and not allow_empty:
        raise BadRequest(f"{name} must not be empty", param=name)
    if len(value) > MAX_TOKENS:
        raise BadRequest(f"{name} has more than {MAX_TOKENS} tokens", param=name)
    for token in value:
        if isinstance(token, bool) or not isinstance(token, int):
            raise BadRequest(f"{name} must contain only integers", param=name)
        if not 0 <= token < vocab_size:
            raise BadRequest(
                f"{name} contains {token}, outside the vocabulary [0, {vocab_size})", param=name
            )
    return value


def synthetic_prompt(n: int, vocab_size: int) -> list[int]:
    """The prompt behind ``"prompt_tokens": n``: a fixed sequence, the same for every request
    (so equal requests get equal outputs, and the prefix cache sees shared prefixes)."""
    return [(1 + i * 7919) % vocab_size for i in range(n)]


def load_json_object(text: str) -> dict[str, Any]:
    """Parse a request body that must be a JSON object; NaN/Infinity and pathologically deep
    nesting (which exhausts the parser's recursion) are client errors, not server errors."""
    try:
        body = json.loads(text, parse_constant=_reject_constant)
    except ValueError as exc:
        raise BadRequest(f"malformed JSON: {exc}") from exc
    except RecursionError as exc:
        raise BadRequest("malformed JSON: nested too deeply") from exc
    if not isinstance(body, dict):
        raise BadRequest("body must be a JSON object")
    return body


def parse_generate(raw: bytes, tokenizer: Any, vocab_size: int) -> GenerateRequest:
    """Turn a /generate body into a validated request, or raise :class:`BadRequest`."""
    try:
        # Decode first: json.loads(bytes) would guess UTF-16/32 from the first bytes.
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRequest("body is not valid UTF-8") from exc
    body = load_json_object(text)
    unknown = sorted(set(body) - _ALLOWED_FIELDS)
    if unknown:
        raise BadRequest(f"unknown field(s): {', '.join(unknown)}", param=unknown[0])

    given = [name for name in _PROMPT_FIELDS if name in body]
    if len(given) != 1:
        raise BadRequest("exactly one of prompt_tokens, prompt_token_ids, prompt is required")
    if "prompt_tokens" in body:
        n = _int(body, "prompt_tokens", 1, MAX_TOKENS, None)
        assert n is not None
        prompt = synthetic_prompt(n, vocab_size)
    elif "prompt_token_ids" in body:
        prompt = _token_list(body["prompt_token_ids"], "prompt_token_ids", vocab_size, False)
    else:
        text = body["prompt"]
        if not isinstance(text, str) or not text:
            raise BadRequest("prompt must be a non-empty string", param="prompt")
        if tokenizer is None:
            raise BadRequest(
                "prompt (text) needs a tokenizer; this backend has none, "
                "send prompt_tokens or prompt_token_ids",
                param="prompt",
            )
        try:
            prompt = list(tokenizer.encode(text))
        except Exception as exc:  # the tokenizer's own validation: still the client's input
            raise BadRequest(f"prompt could not be tokenized: {exc}", param="prompt") from exc
        if not prompt:
            raise BadRequest("prompt encodes to no tokens", param="prompt")

    request_id = body.get("request_id")
    if request_id is not None and (
        not isinstance(request_id, str) or not 0 < len(request_id) <= MAX_REQUEST_ID_LEN
    ):
        raise BadRequest(
            f"request_id must be a string of 1 to {MAX_REQUEST_ID_LEN} characters",
            param="request_id",
        )

    max_new_tokens = _int(body, "max_new_tokens", 0, MAX_TOKENS, 16)
    assert max_new_tokens is not None
    params = SamplingParams(max_new_tokens=max_new_tokens)
    for name in _FLOAT_FIELDS:
        value = _float(body, name)
        if value is not None:
            setattr(params, name, value)
    top_k = _int(body, "top_k", -1, MAX_TOKENS, None)
    if top_k is not None:
        params.top_k = top_k
    seed = _int(body, "seed", 0, (1 << 63) - 1, None)
    if seed is not None:
        params.seed = seed
    if "stop" in body:
        stop = body["stop"]
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise BadRequest("stop must be a non-empty string or a list of them", param="stop")
        if len(stop) > MAX_STOP_ITEMS:
            raise BadRequest(f"stop has more than {MAX_STOP_ITEMS} strings", param="stop")
        if stop and tokenizer is None:
            raise BadRequest("stop strings need a tokenizer; this backend has none", param="stop")
        params.stop = stop
    if "stop_token_ids" in body:
        params.stop_token_ids = _token_list(
            body["stop_token_ids"], "stop_token_ids", vocab_size, True
        )
    for name in ("ignore_eos", "skip_special_tokens"):
        if name in body:
            if not isinstance(body[name], bool):
                raise BadRequest(f"{name} must be true or false", param=name)
            setattr(params, name, body[name])
    try:
        params.validate()
    except ValueError as exc:
        raise BadRequest(str(exc)) from exc
    return GenerateRequest(request_id, prompt, params)


# --- NDJSON lines ------------------------------------------------------------------------
# Built with bytes %-formatting: no dict, no json.dumps per token on the common path.

_LINE = b'{"token_index":%d,"token_id":%d,"done":false}\n'
_LINE_TEXT = b'{"token_index":%d,"token_id":%d,"text":%s,"done":false}\n'


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
