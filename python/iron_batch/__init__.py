"""iron-batch: a continuous-batching LLM serving engine with a Rust core."""

from iron_batch._core import (
    AllocatorError,
    Batch,
    BatchMismatch,
    BlockAllocator,
    DuplicateRequest,
    IronBatchError,
    OutOfBlocks,
    RequestRejected,
    Scheduler,
    SchedulerConfig,
    UnknownRequest,
)
from iron_batch._core import __version__ as __version__
from iron_batch.sampling_params import SamplingParams

__all__ = [
    "AllocatorError",
    "Batch",
    "BatchMismatch",
    "BlockAllocator",
    "DuplicateRequest",
    "IronBatchError",
    "OutOfBlocks",
    "RequestRejected",
    "SamplingParams",
    "Scheduler",
    "SchedulerConfig",
    "UnknownRequest",
]
