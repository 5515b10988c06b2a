"""Per-request generation settings shared by the engine, the backends and the server."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    ``temperature == 0`` (the default) is greedy decoding. ``top_k <= 0`` and
    ``top_p == 1`` disable those filters. ``seed`` makes sampling reproducible per request,
    independent of which other requests share the batch.
    """

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            raise ValueError("max_new_tokens must be a non-negative integer")
        if not (self.temperature >= 0.0) or self.temperature > 100.0:
            raise ValueError("temperature must be between 0 and 100")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError("top_k must be -1, 0 (disabled) or a positive integer")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError("top_p must be in (0, 1]")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError("min_p must be in [0, 1]")
        if not (self.repetition_penalty > 0.0) or self.repetition_penalty > 100.0:
            raise ValueError("repetition_penalty must be in (0, 100]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (-2.0 <= value <= 2.0):
                raise ValueError(f"{name} must be in [-2, 2]")
        if self.logprobs is not None and not (0 <= self.logprobs <= 20):
            raise ValueError("logprobs must be between 0 and 20")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError("seed must be an integer")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a list of non-empty strings")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1
