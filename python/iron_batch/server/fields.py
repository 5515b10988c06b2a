"""Request fields: the one table of names, types and ranges, and the readers that apply it.

``/generate`` (:mod:`iron_batch.server.generate`), the OpenAI endpoints
(:mod:`iron_batch.server.openai.protocol`) and the OpenAPI document
(:mod:`iron_batch.server.openapi`) all read the fields below; nothing restates a range.
Numeric sampling ranges come from :data:`iron_batch.sampling_params.RANGES`, so the offline
API's ``SamplingParams.validate`` agrees with the server too.

Strict everywhere: a bool is not an int, a float is not an int, NaN/Infinity are not JSON.
Two deliberate differences between the front ends stay, as flags of the readers:
``/generate`` rejects unknown fields and explicit nulls; the OpenAI endpoints ignore unknown
fields and read null as "not given" (several SDKs send both).
Every failure is an :class:`~iron_batch.server.errors.ApiError` (400) naming the field.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from iron_batch.sampling_params import RANGES, Range, SamplingParams
from iron_batch.server.errors import ApiError

#: Hard ceiling on any token count in a request: bounds the work done before the
#: scheduler can reject a request that would never fit the KV pool.
MAX_TOKENS = 1 << 20
MAX_BODY_BYTES = 16 << 20
MAX_STOP = 16
MAX_REQUEST_ID_LEN = 256
MAX_CHOICES = 128  # n * number of prompts, per OpenAI request
MAX_PROMPTS = 64  # batched completion prompts
MAX_MESSAGES = 4096
INT64_MAX = (1 << 63) - 1


@dataclass(frozen=True)
class Number:
    """A numeric field: its name, its range and how the OpenAPI document describes it."""

    name: str
    range: Range
    description: str | None = None
    default: float | None = None

    def read(self, body: dict[str, Any], *, null_ok: bool) -> Any:
        """The field's value, None when absent (or null, with ``null_ok``); ApiError when
        it has the wrong type or is out of range."""
        if self.name not in body:
            return None
        value = body[self.name]
        if value is None and null_ok:
            return None
        r = self.range
        if isinstance(value, bool) or not isinstance(value, int if r.integer else (int, float)):
            kind = "an integer" if r.integer else "a number"
            raise ApiError(f"{self.name} must be {kind}", param=self.name)
        if not r.integer:
            value = float(value)
            if not math.isfinite(value):
                raise ApiError(f"{self.name} must be finite", param=self.name)
        if not r.contains(value):
            raise ApiError(
                f"{self.name} must be in {r.describe()}, got {value}", param=self.name
            )
        return value

    def schema(self) -> dict[str, Any]:
        r = self.range
        out: dict[str, Any] = {"type": "integer" if r.integer else "number"}
        out["exclusiveMinimum" if r.lo_open else "minimum"] = r.lo
        if r.hi is not None:
            out["maximum"] = r.hi
        if self.default is not None:
            out["default"] = self.default
        if self.description:
            out["description"] = self.description
        return out


def _sampling(name: str, hi: float | None = None, **kw: Any) -> Number:
    r = RANGES[name]
    if hi is not None:
        r = Range(r.lo, hi, r.lo_open, r.integer)
    return Number(name, r, **kw)


#: Sampling settings both front ends accept under the same names (set on SamplingParams).
SAMPLING: tuple[Number, ...] = (
    _sampling("temperature"),
    _sampling("top_p"),
    _sampling("top_k", MAX_TOKENS),
    _sampling("min_p"),
    _sampling("repetition_penalty"),
    _sampling("presence_penalty"),
    _sampling("frequency_penalty"),
    _sampling("seed"),
)
SEED = SAMPLING[-1]
TEMPERATURE = SAMPLING[0]

# /generate
PROMPT_TOKENS = Number("prompt_tokens", Range(1, MAX_TOKENS, integer=True),
                       "A synthetic prompt of this many tokens.")
MAX_NEW_TOKENS = _sampling("max_new_tokens", MAX_TOKENS, default=16)
# OpenAI
MAX_TOKENS_FIELD = Number("max_tokens", Range(0, INT64_MAX, integer=True),
                          "Clamped to what fits the model context and the KV pool.")
MAX_COMPLETION_TOKENS = Number("max_completion_tokens", MAX_TOKENS_FIELD.range,
                               MAX_TOKENS_FIELD.description)
N = Number("n", Range(1, MAX_CHOICES, integer=True))
BEST_OF = Number("best_of", N.range, "Must equal n.")
LOGPROBS = _sampling("logprobs")
PRIORITY = Number("priority", RANGES["priority"],
                  "Lower runs first (waiting queue and preemption order); default 0.")
MAX_CACHE_SALT_LEN = 1024
TOP_LOGPROBS = Number("top_logprobs", RANGES["logprobs"], "Needs logprobs: true.")


# --- body ---------------------------------------------------------------------------------


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """A request body that must be a UTF-8 JSON object; NaN/Infinity and pathologically deep
    nesting (which exhausts the parser's recursion) are client errors, not server errors."""
    try:
        # Decode first: json.loads(bytes) would guess UTF-16/32 from the first bytes.
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError("body is not valid UTF-8") from exc
    try:
        body = json.loads(text, parse_constant=_reject_constant)
    except ValueError as exc:
        raise ApiError(f"malformed JSON: {exc}") from exc
    except RecursionError as exc:
        raise ApiError("malformed JSON: nested too deeply") from exc
    if not isinstance(body, dict):
        raise ApiError("body must be a JSON object")
    return body


# --- readers ------------------------------------------------------------------------------


def read_bool(body: dict[str, Any], name: str, default: bool, *, null_ok: bool) -> bool:
    if name not in body or (null_ok and body[name] is None):
        return default
    value = body[name]
    if not isinstance(value, bool):
        raise ApiError(f"{name} must be true or false", param=name)
    return value


def read_str(body: dict[str, Any], name: str, *, null_ok: bool) -> str | None:
    if name not in body or (null_ok and body[name] is None):
        return None
    value = body[name]
    if not isinstance(value, str):
        raise ApiError(f"{name} must be a string", param=name)
    return value


def token_ids(value: Any, name: str, vocab_size: int, *, allow_empty: bool = False) -> list[int]:
    """A list of token ids, each in ``[0, vocab_size)`` (an id outside the model's embedding
    would fail the backend's whole batch)."""
    if not isinstance(value, list):
        raise ApiError(f"{name} must be a list of token ids", param=name)
    if not value and not allow_empty:
        raise ApiError(f"{name} must not be empty", param=name)
    if len(value) > MAX_TOKENS:
        raise ApiError(f"{name} has more than {MAX_TOKENS} tokens", param=name)
    for token in value:
        if isinstance(token, bool) or not isinstance(token, int):
            raise ApiError(f"{name} must contain only integers", param=name)
        if not 0 <= token < vocab_size:
            raise ApiError(
                f"{name} contains {token}, outside the vocabulary [0, {vocab_size})", param=name
            )
    return value


def encode_text(
    tokenizer: Any, text: str, param: str, *, add_special_tokens: bool = True
) -> list[int]:
    """Text to token ids; the tokenizer's own complaints are still the client's input."""
    if tokenizer is None:
        raise ApiError(
            f"{param} as text needs a tokenizer; this model has none (send token ids)",
            param=param,
        )
    try:
        return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
    except Exception as exc:
        raise ApiError(f"{param} could not be tokenized: {exc}", param=param) from exc


def read_stop(body: dict[str, Any], tokenizer: Any, *, null_ok: bool) -> list[str] | None:
    """``stop``: a non-empty string or a list of them (an empty stop string would end every
    request at once); stop strings are matched on text, so they need a tokenizer."""
    if "stop" not in body or (null_ok and body["stop"] is None):
        return None
    stop = body["stop"]
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise ApiError("stop must be a non-empty string or a list of them", param="stop")
    if len(stop) > MAX_STOP:
        raise ApiError(f"stop has more than {MAX_STOP} strings", param="stop")
    if stop and tokenizer is None:
        raise ApiError("stop strings need a tokenizer; this model has none", param="stop")
    return stop


def read_sampling(
    body: dict[str, Any], params: SamplingParams, tokenizer: Any, vocab_size: int,
    *, null_ok: bool,
) -> SamplingParams:
    """Every field both front ends share, onto ``params`` (fields not given keep its value)."""
    for spec in SAMPLING:
        value = spec.read(body, null_ok=null_ok)
        if value is not None:
            setattr(params, spec.name, value)
    stop = read_stop(body, tokenizer, null_ok=null_ok)
    if stop is not None:
        params.stop = stop
    if "stop_token_ids" in body and not (null_ok and body["stop_token_ids"] is None):
        params.stop_token_ids = token_ids(
            body["stop_token_ids"], "stop_token_ids", vocab_size, allow_empty=True
        )
    params.ignore_eos = read_bool(body, "ignore_eos", params.ignore_eos, null_ok=null_ok)
    params.skip_special_tokens = read_bool(
        body, "skip_special_tokens", params.skip_special_tokens, null_ok=null_ok
    )
    params.speculate = read_bool(body, "speculate", params.speculate, null_ok=null_ok)
    return params


def check(params: SamplingParams) -> SamplingParams:
    """``params.validate()`` as a 400 (rules across fields the readers cannot see alone)."""
    try:
        params.validate()
    except ValueError as exc:
        raise ApiError(str(exc)) from exc
    return params


def sampling_schema(*, nullable: bool) -> dict[str, Any]:
    """OpenAPI properties of :func:`read_sampling`'s fields."""
    stop_item = {"type": "string", "minLength": 1}
    props: dict[str, Any] = {spec.name: spec.schema() for spec in SAMPLING}
    props["seed"]["description"] = "Reproducible sampling; OpenAI choice i uses seed + i."
    props["stop"] = {"anyOf": [stop_item, {"type": "array", "items": stop_item,
                                           "maxItems": MAX_STOP}]}
    props["stop_token_ids"] = {"type": "array", "items": {"type": "integer", "minimum": 0}}
    props["ignore_eos"] = {"type": "boolean"}
    props["skip_special_tokens"] = {"type": "boolean"}
    props["speculate"] = {"type": "boolean", "description": "false: no speculative decoding "
                          "for this request (when the server speculates)."}
    if nullable:
        props = {k: nullable_schema(v) for k, v in props.items()}
    return props


def nullable_schema(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}
