"""Prompt logprobs: the logprob of every prompt token under the model, gathered from the
prefill chunks as they run.

The logits at position ``p`` predict token ``p + 1``, so a prefill chunk over positions
``[start, end)`` scores prompt tokens ``start + 1 .. min(end, prompt_len - 1)``; the last
prompt position's logits are the first sample row and score no prompt token. Chunked
prefill therefore needs nothing special: each chunk scores its own positions. A prefix-cache
hit would skip positions whose logits were never kept, so a request that wants prompt
logprobs is admitted with ``skip_prefix_cache`` (the scheduler computes its whole prompt;
the blocks it computes are still published for later requests). After a preemption the
prompt is computed again; positions already scored are left as they are, and once the
engine has taken the list no row is scored again.

One :class:`PromptScorer` per backend that computes logits (torch, and the worker's).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from iron_batch.stream import PromptLogprobs

_ROWS_PER_SLICE = 256


@dataclass
class _Scores:
    prompt: list[int]
    top: int
    entries: PromptLogprobs = field(default_factory=list)
    taken: bool = False

    def __post_init__(self) -> None:
        self.entries = [None] * len(self.prompt)


@dataclass
class ScoringRows:
    """Extra logits rows one batch needs: token row, request, and prompt position scored."""

    rows: np.ndarray  # int64 [M] token rows of the batch
    owners: list[_Scores]
    targets: list[int]  # prompt position each row scores (p + 1)


class PromptScorer:
    def __init__(self) -> None:
        self._requests: dict[str, _Scores] = {}

    def add_request(self, request_id: str, prompt: list[int], top: int | None) -> None:
        if top is None:
            self._requests.pop(request_id, None)
        else:
            self._requests[request_id] = _Scores(list(prompt), top)

    def remove_request(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def rows(self, batch: Any) -> ScoringRows | None:
        """The token rows of ``batch`` whose logits score a prompt token, or None.

        ``batch.request_ids`` names each sequence of the batch (mid-prefill ones too)."""
        if not self._requests:
            return None
        ids: list[str] = batch.request_ids
        qsl = batch.query_start_loc
        before = batch.num_computed_before
        rows: list[np.ndarray] = []
        owners: list[_Scores] = []
        targets: list[int] = []
        for s, rid in enumerate(ids):
            scores = self._requests.get(rid)
            if scores is None or scores.taken:
                continue
            start = int(before[s])
            n = int(qsl[s + 1]) - int(qsl[s])
            # Positions p in [start, start + n) with p + 1 a prompt position.
            last = min(start + n, len(scores.prompt) - 1)
            if last <= start:
                continue
            count = last - start
            rows.append(np.arange(int(qsl[s]), int(qsl[s]) + count, dtype=np.int64))
            owners.extend([scores] * count)
            targets.extend(range(start + 1, last + 1))
        if not rows:
            return None
        return ScoringRows(np.concatenate(rows), owners, targets)

    @torch.inference_mode()
    def record(self, logits: torch.Tensor, need: ScoringRows) -> None:
        """Score ``need`` from its rows' float32 logits ``[M, vocab]``, a slice of rows at a
        time (a long prefill chunk's log_softmax would double a large logits tensor)."""
        k = max(o.top for o in need.owners)
        token_ids = [o.prompt[t] for o, t in zip(need.owners, need.targets, strict=True)]
        for lo in range(0, len(token_ids), _ROWS_PER_SLICE):
            hi = min(lo + _ROWS_PER_SLICE, len(token_ids))
            logprobs = torch.log_softmax(logits[lo:hi].float(), dim=-1)
            index = torch.tensor(token_ids[lo:hi], device=logprobs.device)[:, None]
            chosen = logprobs.gather(1, index)[:, 0].tolist()
            top_vals: list[list[float]] = []
            top_ids: list[list[int]] = []
            if k > 0:
                vals, ids = logprobs.topk(k, dim=-1)
                top_vals, top_ids = vals.tolist(), ids.tolist()
            for i in range(hi - lo):
                owner, target = need.owners[lo + i], need.targets[lo + i]
                alts: list[tuple[int, float]] = []
                if owner.top > 0:
                    alts = list(zip(top_ids[i][: owner.top], top_vals[i][: owner.top],
                                    strict=True))
                owner.entries[target] = (chosen[i], alts)

    def take_finished(self, request_ids: list[str]) -> dict[str, PromptLogprobs] | None:
        """The prompt logprobs of those of ``request_ids`` (a step's sampling requests,
        whose prompts that step finished or had finished) not handed out yet."""
        if not self._requests:
            return None
        found = {}
        for rid in request_ids:
            entries = self.take(rid)
            if entries is not None:
                found[rid] = entries
        return found or None

    def take(self, request_id: str) -> PromptLogprobs | None:
        """The request's prompt logprobs, once its prompt is computed (then never again)."""
        scores = self._requests.get(request_id)
        if scores is None or scores.taken:
            return None
        scores.taken = True
        return scores.entries
