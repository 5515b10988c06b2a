"""iron-batch: a Rust continuous-batching scheduler with Python backends and a server.

Importing this package never imports torch: the torch backend loads on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from iron_batch._core import (
    FINISH_REASONS,
    AllocatorError,
    Batch,
    BatchMismatch,
    BlockAllocator,
    CacheGroup,
    DuplicateRequest,
    IronBatchError,
    OutOfBlocks,
    RequestRejected,
    Scheduler,
    SchedulerConfig,
    StepEvents,
    UnknownRequest,
)
from iron_batch._core import __version__ as __version__

#: Names exported from modules above the core, imported on first use: the package itself
#: imports nothing but the core, so any module may import ``iron_batch._core`` without
#: running the engine's imports.
_LAZY = {
    "Engine": "iron_batch.engine",
    "TokenEvent": "iron_batch.engine",
    "LLM": "iron_batch.llm",
    "RequestOutput": "iron_batch.llm",
    "SamplingParams": "iron_batch.sampling_params",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'iron_batch' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value

__all__ = [
    "FINISH_REASONS",
    "AllocatorError",
    "Batch",
    "BatchMismatch",
    "BlockAllocator",
    "CacheGroup",
    "DuplicateRequest",
    "Engine",
    "IronBatchError",
    "LLM",
    "OutOfBlocks",
    "RequestOutput",
    "RequestRejected",
    "SamplingParams",
    "Scheduler",
    "SchedulerConfig",
    "StepEvents",
    "TokenEvent",
    "UnknownRequest",
]
