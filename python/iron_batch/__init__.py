"""iron-batch: a Rust continuous-batching scheduler with Python backends and a server.

Importing this package never imports torch: the torch backend loads on first use.
"""

from __future__ import annotations

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
from iron_batch.engine import Engine, TokenEvent
from iron_batch.llm import LLM, RequestOutput
from iron_batch.sampling_params import SamplingParams

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
