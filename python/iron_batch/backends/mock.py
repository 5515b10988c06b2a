"""A backend with no weights: deterministic tokens and the latency of a memory-bound accelerator.

Tokens: each sampled token is a hash of (prompt hash, previous token, position), so it is a
function of the sequence alone. A preempted request that is re-prefilled over its prompt and
the tokens generated so far samples exactly the tokens an uninterrupted run would, and the
same request on a big or a tiny KV pool yields the same output.

Latency: a decode step on a memory-bound accelerator costs about the time to stream the
weights once, whatever the batch size, so every running sequence waits ``token_latency_us``
for its next token. Batching therefore multiplies throughput (a latency slept once per
sequence would cap every run at 1/latency tokens per second). Prompt tokens are
compute-bound and cost ``prefill_token_latency_us`` each on top of the step.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from iron_batch.backends.base import BackendBase, BackendInfo

if TYPE_CHECKING:
    from iron_batch._core import Batch
    from iron_batch.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1
_EMPTY = np.empty(0, dtype=np.int64)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer over uint64 arrays (wrapping arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _prompt_hash(prompt_token_ids: list[int]) -> int:
    h = 0x9E3779B97F4A7C15
    for token in prompt_token_ids:
        h = ((h ^ token) * 0x100000001B3) & _MASK64
    return h


#: The latency model's defaults (the server's and the worker's flags take them from here).
DEFAULT_TOKEN_LATENCY_US = 200.0
DEFAULT_PREFILL_TOKEN_LATENCY_US = 1.0


class MockBackend(BackendBase):
    """Backend protocol implementation for scheduler and server work (no model)."""

    eos_token_ids: list[int]
    model_name: str = "mock"

    def __init__(
        self,
        token_latency_us: float = DEFAULT_TOKEN_LATENCY_US,
        prefill_token_latency_us: float = DEFAULT_PREFILL_TOKEN_LATENCY_US,
        vocab_size: int = 32000,
    ) -> None:
        if token_latency_us < 0 or prefill_token_latency_us < 0:
            raise ValueError("mock latencies must be >= 0")
        if vocab_size < 2:
            raise ValueError("vocab_size must be >= 2")
        self.token_latency_s = token_latency_us / 1e6
        self.prefill_token_latency_s = prefill_token_latency_us / 1e6
        self.vocab_size = vocab_size
        self.eos_token_ids = []
        self._prompt_hashes: dict[str, int] = {}
        self.steps = 0

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        if params.grammar is not None:
            raise ValueError(
                "the mock backend has no logits to constrain: response_format, tools and "
                "guided decoding need a model backend (torch, or a torch worker)"
            )
        self._prompt_hashes[request_id] = _prompt_hash(prompt_token_ids)

    def remove_request(self, request_id: str) -> None:
        self._prompt_hashes.pop(request_id, None)

    def step_seconds(self, batch: Batch) -> float:
        """Modelled duration of one forward pass over ``batch``."""
        if batch.num_seqs == 0:
            return 0.0
        # Tokens beyond one per sequence are prompt (prefill) tokens.
        prefill_tokens = batch.num_tokens - batch.num_seqs
        return self.token_latency_s + prefill_tokens * self.prefill_token_latency_s

    def describe(self) -> BackendInfo:
        return BackendInfo(kind="mock")

    def execute(self, batch: Batch) -> np.ndarray:
        started = time.perf_counter()
        self.steps += 1
        rows = batch.sample_indices
        if len(rows) == 0:
            sampled = _EMPTY
        else:
            hashes = self._prompt_hashes
            prompt_h = np.fromiter(
                (hashes.get(rid, 0) for rid in batch.sample_request_ids),
                dtype=np.uint64,
                count=len(rows),
            )
            prev = batch.input_ids[rows].astype(np.uint64)
            pos = batch.positions[rows].astype(np.uint64)
            h = _mix64(prompt_h ^ _mix64(prev * np.uint64(0x9E3779B97F4A7C15) + pos))
            sampled = (h % np.uint64(self.vocab_size)).astype(np.int64)
        # Sleep to a deadline so the Python work above is part of the modelled step time,
        # not added to it. time.sleep releases the GIL, so the server keeps streaming.
        remaining = started + self.step_seconds(batch) - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)
        return sampled
