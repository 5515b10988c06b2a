"""Embeddings: the prompt's final-normed hidden states pooled into one vector, gathered from
the prefill chunks as they run (the way :mod:`iron_batch.prompt_logprobs` gathers logits).

An embedding request is an ordinary engine request (``SamplingParams.embed`` set, one token
to sample, which nobody reads), so it shares batches with generation and its prompt may be
chunked over several steps. ``last`` pooling (Qwen3-Embedding and other decoder embedders)
keeps the last prompt position's state, which every request computes even after a
prefix-cache hit; ``mean`` averages every prompt position, so such a request skips the
prefix cache, as a prompt-scoring one does. After a preemption the prompt is computed
again; positions already pooled are not added twice.

How a checkpoint pools and whether it normalises is in its sentence-transformers files
(``modules.json``, ``1_Pooling/config.json``): :func:`read_pooling_config`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

POOLING_MODES = ("last", "mean")


@dataclass(frozen=True)
class PoolingConfig:
    mode: str = "last"
    normalize: bool = True


def read_pooling_config(folder: str | Path | None, mode: str | None = None) -> PoolingConfig:
    """The checkpoint's sentence-transformers pooling (last token and normalised when it
    has none); ``mode`` overrides the pooling it says."""
    pooling, normalize = "last", True
    root = Path(folder) if folder is not None else None
    if root is not None and (root / "modules.json").is_file():
        modules = json.loads((root / "modules.json").read_text())
        types = [str(m.get("type", "")) for m in modules if isinstance(m, dict)]
        normalize = any(t.endswith("Normalize") for t in types)
        for m in modules:
            if isinstance(m, dict) and str(m.get("type", "")).endswith("Pooling"):
                config = root / str(m.get("path", "")) / "config.json"
                if config.is_file():
                    settings = json.loads(config.read_text())
                    if settings.get("pooling_mode_mean_tokens"):
                        pooling = "mean"
                    elif settings.get("pooling_mode_lasttoken"):
                        pooling = "last"
    if mode is not None:
        if mode not in POOLING_MODES:
            raise ValueError(f"pooling must be one of {', '.join(POOLING_MODES)}")
        pooling = mode
    return PoolingConfig(pooling, normalize)


def finish_embedding(vector: np.ndarray, normalize: bool, dimensions: int | None) -> np.ndarray:
    """The vector a client gets: the first ``dimensions`` (Matryoshka truncation), then
    unit length when the checkpoint normalises."""
    out = np.asarray(vector, dtype=np.float32)
    if dimensions is not None:
        out = out[:dimensions]
    if normalize:
        norm = float(np.linalg.norm(out))
        if norm > 0:
            out = out / norm
    return out.astype(np.float32, copy=False)


@dataclass
class _Pool:
    prompt_len: int
    mode: str
    total: np.ndarray | None = None
    pooled: int = 0  # prompt positions [0, pooled) are in ``total``
    taken: bool = False


@dataclass
class PoolingRows:
    """Token rows of one batch whose hidden states an embedding needs."""

    rows: np.ndarray  # int64 [M]
    owners: list[_Pool]
    #: Per owner: the prompt positions [first, end) its run of rows holds.
    spans: list[tuple[int, int]]


class PromptPooler:
    def __init__(self) -> None:
        self._requests: dict[str, _Pool] = {}

    def add_request(self, request_id: str, prompt_len: int, mode: str | None) -> None:
        if mode is None:
            self._requests.pop(request_id, None)
        else:
            self._requests[request_id] = _Pool(prompt_len, mode)

    def remove_request(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def rows(self, batch: Any) -> PoolingRows | None:
        if not self._requests:
            return None
        qsl = batch.query_start_loc
        before = batch.num_computed_before
        rows: list[np.ndarray] = []
        owners: list[_Pool] = []
        spans: list[tuple[int, int]] = []
        for s, rid in enumerate(batch.request_ids):
            pool = self._requests.get(rid)
            if pool is None or pool.taken:
                continue
            start = int(before[s])
            end = min(start + int(qsl[s + 1]) - int(qsl[s]), pool.prompt_len)
            first = pool.prompt_len - 1 if pool.mode == "last" else max(start, pool.pooled)
            if end <= first or first < start:
                continue
            row0 = int(qsl[s]) + (first - start)
            rows.append(np.arange(row0, row0 + end - first, dtype=np.int64))
            owners.append(pool)
            spans.append((first, end))
        if not rows:
            return None
        return PoolingRows(np.concatenate(rows), owners, spans)

    @torch.inference_mode()
    def record(self, hidden: torch.Tensor, need: PoolingRows) -> None:
        """Add ``hidden`` (float32 ``[M, hidden]``, the rows of ``need``) to their pools."""
        at = 0
        for pool, (first, end) in zip(need.owners, need.spans, strict=True):
            n = end - first
            part = hidden[at:at + n].sum(dim=0, dtype=torch.float64).cpu().numpy()
            at += n
            pool.total = part if pool.total is None or pool.mode == "last" else pool.total + part
            pool.pooled = end

    def take_finished(self, request_ids: list[str]) -> dict[str, np.ndarray] | None:
        """The pooled vectors of those of ``request_ids`` (a step's sampling requests, whose
        prompts are computed) not handed out yet."""
        if not self._requests:
            return None
        found = {}
        for rid in request_ids:
            vector = self.take(rid)
            if vector is not None:
                found[rid] = vector
        return found or None

    def take(self, request_id: str) -> np.ndarray | None:
        """The pooled vector (float32, not normalised) once the prompt is computed."""
        pool = self._requests.get(request_id)
        if pool is None or pool.taken or pool.total is None:
            return None
        pool.taken = True
        count = 1 if pool.mode == "last" else pool.prompt_len
        return (pool.total / count).astype(np.float32)
