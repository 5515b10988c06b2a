"""OpenAI response shapes: logprobs, usage, the per-choice accumulator and SSE events."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from iron_batch.server.errors import ApiError, generation_failed, rejected
from iron_batch.server.openai.protocol import OpenAIRequest
from iron_batch.stream import Logprobs, TokenEvent

LogprobEntry = tuple[int, Logprobs]
DONE = b"data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


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
    entries: list[LogprobEntry],
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


def scored_completion_logprobs(
    prompt: list[int],
    prompt_logprobs: list[Logprobs | None] | None,
    entries: list[LogprobEntry],
    top: int,
    token_text: TokenText,
) -> dict[str, Any]:
    """``echo`` with ``logprobs``: every prompt token first (the first one's logprob and
    alternatives are null: nothing predicts it), then the generated tokens, in the legacy
    completions format that evaluation harnesses read."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    offsets: list[int] = []
    offset = 0
    for i, token_id in enumerate(prompt):
        text = token_text(token_id)
        entry = prompt_logprobs[i] if prompt_logprobs is not None and i < len(prompt_logprobs) \
            else None
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if entry is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        chosen, alternatives = entry
        token_logprobs.append(_finite(chosen))
        alt: dict[str, float] = {}
        for t, lp in alternatives[:top]:
            alt.setdefault(token_text(t), _finite(lp))
        top_logprobs.append(alt)
    generated = completion_logprobs(entries, top, token_text, offset)
    return {
        "tokens": tokens + generated["tokens"],
        "token_logprobs": token_logprobs + generated["token_logprobs"],
        "top_logprobs": top_logprobs + generated["top_logprobs"],
        "text_offset": offsets + generated["text_offset"],
    }


def chat_logprobs(
    entries: list[LogprobEntry],
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


@dataclass
class Choice:
    """Everything one engine request produced, for the final response and usage."""

    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    #: An embedding request's pooled hidden state (see iron_batch.pooling).
    embedding: Any = None
    logprobs: list[LogprobEntry] = field(default_factory=list)
    prompt_logprobs: list[Logprobs | None] | None = None
    finish_reason: str | None = None
    error: str | None = None
    error_type: str | None = None
    rejected: bool = False
    num_cached: int = 0
    done: bool = False

    def add(self, event: TokenEvent) -> None:
        if event.prompt_logprobs is not None:
            self.prompt_logprobs = event.prompt_logprobs
        if event.embedding is not None:
            self.embedding = event.embedding
        if event.token_id is not None:
            self.num_tokens += 1
            self.token_ids.append(event.token_id)
            if event.logprobs is not None:
                self.logprobs.append((event.token_id, event.logprobs))
        if event.text:
            self.text.append(event.text)
        if event.finished:
            self.done = True
            self.finish_reason = event.finish_reason
            self.rejected = event.finish_reason == "rejected"
            self.error_type = event.error_type
            # An abort may carry a reason (client too slow); it is not a failure.
            self.error = event.error if event.finish_reason in ("error", "rejected") else None
            if event.num_cached_tokens is not None:
                self.num_cached = event.num_cached_tokens
            if event.finish_reason == "error" and self.error is None:
                self.error = "generation failed"


    def failure(self) -> ApiError | None:
        """The error this choice ended with (rejected at admission: 4xx; failed: 500)."""
        if self.rejected:
            return rejected(self.error, self.error_type)
        if self.error is not None:
            return generation_failed(self.error)
        return None


def request_usage(req: OpenAIRequest, choices: list[Choice]) -> dict[str, Any]:
    # Each prompt is counted once however many choices share it (as OpenAI does); its
    # cached tokens are those of its first choice, the one whose prompt was computed/billed.
    prompt_tokens = sum(len(p) for p in req.prompts)
    cached = sum(choices[p * req.n].num_cached for p in range(len(req.prompts)))
    # Scoring only (max_tokens 0): the one token computed is not returned, nor billed.
    completion_tokens = 0 if req.score_only else sum(c.num_tokens for c in choices)
    return usage(prompt_tokens, completion_tokens, cached)
