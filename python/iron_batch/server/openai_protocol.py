"""OpenAI-compatible request validation and response shaping.

Requests: a JSON body becomes an :class:`OpenAIRequest` (token-id prompts plus one
:class:`SamplingParams` per choice) or an :class:`OpenAIError` carrying the HTTP status and
the OpenAI error shape, so the official client raises its typed exceptions.

Leniency is deliberate where clients differ: ``null`` means "not given" for every optional
field (several SDKs send explicit nulls), and unknown fields are ignored (clients add
vendor fields freely). Fields we know but cannot honour (tools, logit_bias, suffix, ...)
are 400s rather than silently ignored, so nobody gets a quietly different behaviour.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from iron_batch.sampling_params import SamplingParams

MAX_CHOICES = 128  # n * number of prompts, per request
MAX_PROMPTS = 64  # batched completion prompts
MAX_STOP = 16
MAX_LOGPROBS = 20
MAX_TOKENS = 1 << 20
MAX_MESSAGES = 4096
_INT64_MIN = -(1 << 63)
_INT64_MAX = (1 << 63) - 1

Kind = Literal["completion", "chat"]


class OpenAIError(Exception):
    """An error response: ``{"error": {"message", "type", "param", "code"}}`` + status."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def payload(self) -> dict[str, Any]:
        return {
            "error": {
                "message": str(self),
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def body(self) -> bytes:
        return json.dumps(self.payload()).encode()


def auth_error() -> OpenAIError:
    return OpenAIError(
        "invalid or missing API key (send 'Authorization: Bearer KEY')",
        status=401,
        type="authentication_error",
        code="invalid_api_key",
    )


@dataclass
class ModelInfo:
    """What validation needs to know about the served model."""

    name: str
    tokenizer: Any  # iron_batch.tokenizer.Tokenizer or None
    vocab_size: int
    #: Longest sequence (prompt + output) the scheduler accepts: KV pool and model context.
    max_seq_tokens: int
    #: Server limits (--max-prompt-tokens, --max-new-tokens-limit); None: no limit.
    max_prompt_tokens: int | None = None
    max_new_tokens: int | None = None


@dataclass
class OpenAIRequest:
    kind: Kind
    model: str
    #: Token ids of each prompt (completions may batch several; chat has one).
    prompts: list[list[int]]
    #: Prompt text per prompt, for ``echo`` (None when given as token ids).
    prompt_texts: list[str | None]
    #: Sampling settings per prompt and choice: ``params[p][i]``.
    params: list[list[SamplingParams]]
    n: int
    stream: bool = False
    include_usage: bool = False
    #: None: no logprobs; else the number of top alternatives per token.
    logprobs: int | None = None
    echo: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def num_choices(self) -> int:
        return self.n * len(self.prompts)


# --- body parsing -------------------------------------------------------------------------


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def parse_json_object(raw: bytes) -> dict[str, Any]:
    try:
        # Decode first: json.loads(bytes) would guess UTF-16/32 from the first bytes.
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise OpenAIError("body is not valid UTF-8") from exc
    try:
        body = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        raise OpenAIError(f"malformed JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise OpenAIError("body must be a JSON object")
    return body


def _get(body: dict[str, Any], name: str) -> Any:
    return body.get(name)  # missing and null are the same thing


def _bool(body: dict[str, Any], name: str, default: bool) -> bool:
    value = _get(body, name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise OpenAIError(f"{name} must be true or false", param=name)
    return value


def _int(body: dict[str, Any], name: str, lo: int, hi: int) -> int | None:
    value = _get(body, name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise OpenAIError(f"{name} must be an integer", param=name)
    if not lo <= value <= hi:
        raise OpenAIError(f"{name} must be between {lo} and {hi}, got {value}", param=name)
    return value


def _float(body: dict[str, Any], name: str, lo: float, hi: float) -> float | None:
    value = _get(body, name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise OpenAIError(f"{name} must be a number", param=name)
    value = float(value)
    if not (math.isfinite(value) and lo <= value <= hi):
        raise OpenAIError(f"{name} must be between {lo} and {hi}, got {value}", param=name)
    return value


def _str(body: dict[str, Any], name: str) -> str | None:
    value = _get(body, name)
    if value is not None and not isinstance(value, str):
        raise OpenAIError(f"{name} must be a string", param=name)
    return value


def _token_ids(value: Any, name: str, vocab_size: int) -> list[int]:
    if not isinstance(value, list) or not value:
        raise OpenAIError(f"{name} must be a non-empty list of token ids", param=name)
    if len(value) > MAX_TOKENS:
        raise OpenAIError(f"{name} has more than {MAX_TOKENS} tokens", param=name)
    for token in value:
        if isinstance(token, bool) or not isinstance(token, int):
            raise OpenAIError(f"{name} must contain only integers", param=name)
        if not 0 <= token < vocab_size:
            raise OpenAIError(
                f"{name} contains {token}, outside the vocabulary [0, {vocab_size})", param=name
            )
    return value


def _encode(model: ModelInfo, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
    if model.tokenizer is None:
        raise OpenAIError(
            f"{param} as text needs a tokenizer; this model has none (send token ids)",
            param=param,
        )
    try:
        return list(model.tokenizer.encode(text, add_special_tokens=add_special_tokens))
    except Exception as exc:  # the tokenizer's own validation: still the client's input
        raise OpenAIError(f"{param} could not be tokenized: {exc}", param=param) from exc


def check_model(body: dict[str, Any], model: ModelInfo) -> str:
    name = _str(body, "model")
    # Optional here (the official client always sends it): curl users need not know it.
    if name is not None and name != model.name:
        raise OpenAIError(
            f"the model {name!r} does not exist; this server serves {model.name!r}",
            status=404,
            param="model",
            code="model_not_found",
        )
    return model.name


def _reject_unsupported(body: dict[str, Any], names: tuple[str, ...]) -> None:
    for name in names:
        value = _get(body, name)
        if value not in (None, "", [], {}):
            raise OpenAIError(f"{name} is not supported by this server", param=name)


def _common_params(body: dict[str, Any], model: ModelInfo) -> SamplingParams:
    """The sampling fields shared by completions and chat (OpenAI defaults)."""
    params = SamplingParams()
    # OpenAI's default temperature is 1 (ours, for /generate, is greedy).
    temperature = _float(body, "temperature", 0.0, 100.0)
    params.temperature = 1.0 if temperature is None else temperature
    top_p = _float(body, "top_p", 0.0, 1.0)
    if top_p is not None:
        if top_p == 0.0:
            raise OpenAIError("top_p must be greater than 0", param="top_p")
        params.top_p = top_p
    top_k = _int(body, "top_k", -1, MAX_TOKENS)
    if top_k is not None:
        params.top_k = top_k
    min_p = _float(body, "min_p", 0.0, 1.0)
    if min_p is not None:
        params.min_p = min_p
    for name in ("presence_penalty", "frequency_penalty"):
        value = _float(body, name, -2.0, 2.0)
        if value is not None:
            setattr(params, name, value)
    rep = _float(body, "repetition_penalty", 0.0, 100.0)
    if rep is not None:
        if rep == 0.0:
            raise OpenAIError(
                "repetition_penalty must be greater than 0", param="repetition_penalty"
            )
        params.repetition_penalty = rep
    params.seed = _int(body, "seed", _INT64_MIN, _INT64_MAX)
    stop = _get(body, "stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise OpenAIError("stop must be a string or a list of strings", param="stop")
        stop = [s for s in stop if s]  # an empty stop string would end every request at once
        if len(stop) > MAX_STOP:
            raise OpenAIError(f"stop has more than {MAX_STOP} strings", param="stop")
        if stop and model.tokenizer is None:
            raise OpenAIError("stop strings need a tokenizer; this model has none", param="stop")
        params.stop = stop
    stop_ids = _get(body, "stop_token_ids")
    if stop_ids is not None:
        params.stop_token_ids = (
            _token_ids(stop_ids, "stop_token_ids", model.vocab_size) if stop_ids else []
        )
    params.ignore_eos = _bool(body, "ignore_eos", False)
    params.skip_special_tokens = _bool(body, "skip_special_tokens", True)
    return params


def _max_tokens(body: dict[str, Any], names: tuple[str, ...], default: int | None) -> int | None:
    for name in names:
        value = _int(body, name, 0, _INT64_MAX)
        if value is not None:
            return value
    return default


def _stream_options(body: dict[str, Any], stream: bool) -> bool:
    options = _get(body, "stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise OpenAIError("stream_options must be an object", param="stream_options")
    if not stream:
        raise OpenAIError(
            "stream_options is only allowed with stream: true", param="stream_options"
        )
    return _bool(options, "include_usage", False)


def _per_choice(
    base: SamplingParams, prompts: list[list[int]], requested: int | None, n: int,
    model: ModelInfo, prompt_param: str,
) -> list[list[SamplingParams]]:
    out: list[list[SamplingParams]] = []
    cap = model.max_new_tokens
    if requested is not None and cap is not None and requested > cap:
        raise OpenAIError(
            f"max_tokens is {requested}; this server allows at most {cap}", param="max_tokens"
        )
    for prompt in prompts:
        if model.max_prompt_tokens is not None and len(prompt) > model.max_prompt_tokens:
            raise OpenAIError(
                f"the prompt has {len(prompt)} tokens; this server accepts at most "
                f"{model.max_prompt_tokens}",
                param=prompt_param,
                code="context_length_exceeded",
            )
        room = model.max_seq_tokens - len(prompt)
        if room < (1 if requested != 0 else 0):
            raise OpenAIError(
                f"the prompt has {len(prompt)} tokens; this server fits at most "
                f"{model.max_seq_tokens} tokens (prompt and completion) per sequence",
                param=prompt_param,
                code="context_length_exceeded",
            )
        # Clamped, not rejected: "as much as fits" is what clients asking for a lot mean.
        max_new = room if requested is None else min(requested, room)
        if cap is not None:
            max_new = min(max_new, cap)
        choices = []
        for i in range(n):
            params = dataclasses.replace(
                base, max_new_tokens=max_new, stop=list(base.stop),
                stop_token_ids=list(base.stop_token_ids),
            )
            if base.seed is not None:
                # Distinct but reproducible choices; wrapped into int64 for every backend.
                params.seed = ((base.seed + i - _INT64_MIN) % (1 << 64)) + _INT64_MIN
            choices.append(params)
        out.append(choices)
    try:
        out[0][0].validate()
    except ValueError as exc:
        raise OpenAIError(str(exc)) from exc
    return out


def _n(body: dict[str, Any], num_prompts: int) -> int:
    n = _int(body, "n", 1, MAX_CHOICES)
    n = 1 if n is None else n
    if n * num_prompts > MAX_CHOICES:
        raise OpenAIError(f"n times the number of prompts must be at most {MAX_CHOICES}",
                          param="n")
    best_of = _int(body, "best_of", 1, MAX_CHOICES)
    if best_of is not None and best_of != n:
        raise OpenAIError("best_of other than n is not supported", param="best_of")
    return n


def _completion_prompts(
    value: Any, model: ModelInfo
) -> tuple[list[list[int]], list[str | None]]:
    """prompt: a string, a list of strings, a list of token ids, or a list of those lists."""
    if isinstance(value, str):
        items: list[Any] = [value]
    elif isinstance(value, list) and value and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    ):
        items = [value]
    elif isinstance(value, list) and value:
        items = value
    else:
        raise OpenAIError(
            "prompt must be a string, a list of strings, a list of token ids or a list of "
            "token-id lists",
            param="prompt",
        )
    if len(items) > MAX_PROMPTS:
        raise OpenAIError(f"at most {MAX_PROMPTS} prompts per request", param="prompt")
    prompts: list[list[int]] = []
    texts: list[str | None] = []
    for item in items:
        if isinstance(item, str):
            ids = _encode(model, item, "prompt")
            if not ids:
                raise OpenAIError("prompt encodes to no tokens", param="prompt")
            prompts.append(ids)
            texts.append(item)
        else:
            ids = _token_ids(item, "prompt", model.vocab_size)
            prompts.append(list(ids))
            texts.append(None)
    return prompts, texts


def parse_completion(body: dict[str, Any], model: ModelInfo) -> OpenAIRequest:
    name = check_model(body, model)
    _reject_unsupported(body, ("suffix", "logit_bias"))
    if "prompt" not in body or body["prompt"] is None:
        raise OpenAIError("prompt is required", param="prompt")
    prompts, texts = _completion_prompts(body["prompt"], model)
    base = _common_params(body, model)
    logprobs = _int(body, "logprobs", 0, MAX_LOGPROBS)
    base.logprobs = logprobs
    echo = _bool(body, "echo", False)
    if echo and logprobs is not None:
        # The prompt's logprobs would need a prompt-scoring pass we do not run.
        raise OpenAIError("echo with logprobs is not supported", param="echo")
    stream = _bool(body, "stream", False)
    include_usage = _stream_options(body, stream)
    n = _n(body, len(prompts))
    requested = _max_tokens(body, ("max_tokens",), 16)  # OpenAI's completions default
    params = _per_choice(base, prompts, requested, n, model, "prompt")
    if echo:
        for i, text in enumerate(texts):
            if text is None and model.tokenizer is not None:
                texts[i] = model.tokenizer.decode(prompts[i], skip_special_tokens=False)
    return OpenAIRequest(
        "completion", name, prompts, texts, params, n, stream, include_usage, logprobs, echo
    )


_ROLES = {"system", "developer", "user", "assistant", "tool"}


def _messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise OpenAIError("messages must be a non-empty list", param="messages")
    if len(value) > MAX_MESSAGES:
        raise OpenAIError(f"at most {MAX_MESSAGES} messages", param="messages")
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(value):
        param = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise OpenAIError(f"{param} must be an object", param=param)
        role = msg.get("role")
        if role not in _ROLES:
            raise OpenAIError(
                f"{param}.role must be one of {', '.join(sorted(_ROLES))}", param=param
            )
        content = msg.get("content")
        if content is None:
            text = ""
        elif isinstance(content, str):
            text = content
        elif isinstance(content, list):
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(
                    part.get("text"), str
                ):
                    raise OpenAIError(
                        f"{param}.content: only text parts are supported", param=param
                    )
                parts.append(part["text"])
            text = "".join(parts)
        else:
            raise OpenAIError(f"{param}.content must be a string or a list of parts",
                              param=param)
        # Templates written for HF know "system", not OpenAI's newer "developer".
        entry: dict[str, Any] = {"role": "system" if role == "developer" else role,
                                 "content": text}
        if isinstance(msg.get("name"), str):
            entry["name"] = msg["name"]
        out.append(entry)
    return out


def render_chat(model: ModelInfo, messages: list[dict[str, Any]],
                add_generation_prompt: bool = True) -> str:
    tok = model.tokenizer
    if tok is None or getattr(tok, "chat_template", None) is None:
        raise OpenAIError("this model has no chat template; use /v1/completions",
                          param="messages")
    try:
        return str(tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt))
    except Exception as exc:  # jinja TemplateError (e.g. roles must alternate) and kin
        raise OpenAIError(f"chat template failed: {exc}", param="messages") from exc


def chat_prompt_ids(model: ModelInfo, messages: list[dict[str, Any]],
                    add_generation_prompt: bool = True) -> list[int]:
    text = render_chat(model, messages, add_generation_prompt)
    # The template writes BOS itself where the model wants one.
    return _encode(model, text, "messages", add_special_tokens=False)


def parse_chat(body: dict[str, Any], model: ModelInfo) -> OpenAIRequest:
    name = check_model(body, model)
    _reject_unsupported(body, ("tools", "functions", "logit_bias", "audio", "prediction"))
    tool_choice = _get(body, "tool_choice")
    if tool_choice not in (None, "none", "auto"):
        raise OpenAIError("tool_choice is not supported", param="tool_choice")
    fmt = _get(body, "response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise OpenAIError("only response_format {\"type\": \"text\"} is supported",
                          param="response_format")
    messages = _messages(_get(body, "messages"))
    add_gen = _bool(body, "add_generation_prompt", True)
    prompt = chat_prompt_ids(model, messages, add_gen)
    if not prompt:
        raise OpenAIError("messages render to no tokens", param="messages")
    base = _common_params(body, model)
    want = _bool(body, "logprobs", False)
    top = _int(body, "top_logprobs", 0, MAX_LOGPROBS)
    if top is not None and not want:
        raise OpenAIError("top_logprobs needs logprobs: true", param="top_logprobs")
    logprobs = (top or 0) if want else None
    base.logprobs = logprobs
    stream = _bool(body, "stream", False)
    include_usage = _stream_options(body, stream)
    n = _n(body, 1)
    requested = _max_tokens(body, ("max_completion_tokens", "max_tokens"), None)
    params = _per_choice(base, [prompt], requested, n, model, "messages")
    return OpenAIRequest(
        "chat", name, [prompt], [None], params, n, stream, include_usage, logprobs, False
    )


# --- responses ----------------------------------------------------------------------------


class TokenText:
    """Token id -> display string for logprobs, cached (the same ids recur constantly)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self._cache: dict[int, str] = {}
        self.has_tokenizer = tokenizer is not None

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            if self._tok is None:
                text = f"token_id:{token_id}"
            else:
                # Special tokens shown as themselves: an empty string would hide an eos.
                text = self._tok.decode([token_id], skip_special_tokens=False)
            if len(self._cache) < 65536:
                self._cache[token_id] = text
        return text


def _finite(x: float) -> float:
    # JSON has no -inf; a masked token's logprob is "as unlikely as it gets".
    return x if math.isfinite(x) else -9999.0


def completion_logprobs(
    entries: list[tuple[int, tuple[float, list[tuple[int, float]]]]],
    top: int,
    token_text: TokenText,
    text_start: int,
) -> dict[str, Any]:
    """Legacy completions format: parallel lists of tokens, logprobs and top dicts."""
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[str, float]] = []
    offsets: list[int] = []
    offset = text_start
    for token_id, (chosen, alternatives) in entries:
        text = token_text(token_id)
        tokens.append(text)
        token_logprobs.append(_finite(chosen))
        # Keyed by text, so ids that decode alike (partial UTF-8 bytes -> U+FFFD) collide:
        # keep the first, most likely one.
        alt: dict[str, float] = {}
        for t, lp in alternatives[:top]:
            alt.setdefault(token_text(t), _finite(lp))
        top_logprobs.append(alt)
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }


def chat_logprobs(
    entries: list[tuple[int, tuple[float, list[tuple[int, float]]]]],
    top: int,
    token_text: TokenText,
) -> dict[str, Any]:
    content = []
    for token_id, (chosen, alternatives) in entries:
        text = token_text(token_id)
        content.append(
            {
                "token": text,
                "logprob": _finite(chosen),
                "bytes": list(text.encode("utf-8")),
                "top_logprobs": [
                    {"token": (t_text := token_text(t)), "logprob": _finite(lp),
                     "bytes": list(t_text.encode("utf-8"))}
                    for t, lp in alternatives[:top]
                ],
            }
        )
    return {"content": content}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def finish_reason(reason: str | None) -> str | None:
    # The scheduler's reasons already match OpenAI's ("stop" covers eos, stop ids and stop
    # strings); an abort at shutdown has no OpenAI name and is passed through as is.
    return reason
