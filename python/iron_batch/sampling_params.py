"""Per-request generation settings shared by the engine, the backends and the server."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Range:
    """The values a numeric setting accepts: ``lo <= x <= hi`` (``lo < x`` when
    ``lo_open``); ``hi`` None is unbounded above. ``integer``: ints only (never bools)."""

    lo: float
    hi: float | None = None
    lo_open: bool = False
    integer: bool = False

    def contains(self, value: object) -> bool:
        if isinstance(value, bool) or not isinstance(value, int if self.integer else (int, float)):
            return False
        above = value > self.lo if self.lo_open else value >= self.lo
        return above and (self.hi is None or value <= self.hi)

    def describe(self) -> str:
        left = "(" if self.lo_open else "["
        hi = "inf)" if self.hi is None else f"{_num(self.hi)}]"
        return f"{left}{_num(self.lo)}, {hi}"


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 2**64 else str(x)


#: Largest seed (seeds are non-negative 63-bit integers everywhere).
SEED_MAX = (1 << 63) - 1
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
MAX_LOGPROBS = 20

#: The one statement of each numeric setting's valid range: ``SamplingParams.validate``, the
#: HTTP parsers and the OpenAPI document all read it.
RANGES: dict[str, Range] = {
    "max_new_tokens": Range(0, None, integer=True),
    "temperature": Range(0.0, 100.0),
    "top_k": Range(-1, None, integer=True),
    "top_p": Range(0.0, 1.0, lo_open=True),
    "min_p": Range(0.0, 1.0),
    "seed": Range(0, SEED_MAX, integer=True),
    "repetition_penalty": Range(0.0, 100.0, lo_open=True),
    "presence_penalty": Range(-2.0, 2.0),
    "frequency_penalty": Range(-2.0, 2.0),
    "logprobs": Range(0, MAX_LOGPROBS, integer=True),
    "prompt_logprobs": Range(0, MAX_LOGPROBS, integer=True),
    "priority": Range(INT64_MIN, INT64_MAX, integer=True),
}
#: Settings that may be None (not given).
_OPTIONAL = frozenset(("seed", "logprobs", "prompt_logprobs"))


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
    #: Special tokens written out even where ``skip_special_tokens`` drops the others (the
    #: markers of a tool-call or thinking format made of special tokens, such as Gemma 4's).
    keep_special_tokens: list[str] = field(default_factory=list)
    #: Logprob of every prompt token but the first (which has none) and this many top
    #: alternatives per position. Such a request computes its whole prompt: it skips the
    #: prefix cache, whose blocks hold KV but no logits.
    prompt_logprobs: int | None = None
    # Scheduling rather than sampling, carried here so every front end passes them the
    # same way. priority: lower runs first (waiting queue and preemption order).
    priority: int = 0
    #: Requests with different salts never share prefix-cache blocks.
    cache_salt: str | None = None
    #: llguidance grammar (its JSON or Lark text) the output must match, enforced by a
    #: token mask where sampling happens; built by :mod:`iron_batch.structured`.
    grammar: str | None = None
    #: An embedding request: the prompt's hidden states pooled ("last" or "mean", see
    #: :mod:`iron_batch.pooling`) come with the first token event.
    embed: str | None = None
    #: False: no speculative decoding for this request (when the engine speculates).
    speculate: bool = True

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        for name, allowed in RANGES.items():
            value = getattr(self, name)
            if value is None and name in _OPTIONAL:
                continue
            if not allowed.contains(value):
                kind = "an integer" if allowed.integer else "a number"
                raise ValueError(f"{name} must be {kind} in {allowed.describe()}, got {value!r}")
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise ValueError("grammar must be a string")
        if self.embed is not None and self.embed not in ("last", "mean"):
            raise ValueError("embed must be 'last' or 'mean'")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a list of non-empty strings")
        if self.prompt_logprobs is not None and self.max_new_tokens == 0:
            # The prompt is scored by its prefill, which a request that ends at once skips.
            raise ValueError("prompt_logprobs needs max_new_tokens >= 1")
        if self.cache_salt is not None and (
            not isinstance(self.cache_salt, str) or not self.cache_salt
        ):
            raise ValueError("cache_salt must be a non-empty string")

    @property
    def allows_speculation(self) -> bool:
        """Whether the scheduler may propose tokens for this request: not opted out, and
        no grammar or penalties (see :mod:`iron_batch.speculative`)."""
        return (
            self.speculate
            and self.grammar is None
            and self.repetition_penalty == 1.0
            and self.presence_penalty == 0.0
            and self.frequency_penalty == 0.0
        )

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1
