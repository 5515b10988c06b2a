"""The arrays of a scheduler batch: one table for the wire codec, the worker and the torch
backend, so a field is added or renamed in one place.

``_core.Batch`` (the scheduler's batch) has each field as a numpy attribute; a worker
rebuilds the same attributes from a received frame as an :class:`ArrayBatch`. The torch
model's forward takes the fields marked ``model_input`` as keyword arguments.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

I32 = np.dtype("<i4")
I64 = np.dtype("<i8")


@dataclass(frozen=True)
class BatchField:
    name: str
    dtype: np.dtype[Any]
    #: Passed to the model's forward (the rest only matter to the scheduler and the worker).
    model_input: bool
    ndim: int = 1


#: T tokens, S sequences, B block-table columns, N sample rows, P placeholders.
BATCH_FIELDS: tuple[BatchField, ...] = (
    BatchField("input_ids", I64, True),  # [T]
    BatchField("positions", I64, True),  # [T]
    BatchField("slot_mapping", I64, True),  # [T]
    BatchField("query_start_loc", I32, True),  # [S + 1]
    BatchField("seq_lens", I32, True),  # [S]
    BatchField("num_computed_before", I32, True),  # [S]
    BatchField("block_tables", I32, True, ndim=2),  # [S, B]
    BatchField("sample_indices", I64, True),  # [N] token row of each sample
    BatchField("sample_seq_indices", I64, False),  # [N] sequence of each sample
    BatchField("sample_max_steps", I32, False),  # [N] decode steps it may take (lookahead)
    # [P] placeholders of an overlapped step: token rows whose id the previous step samples,
    # in its sample rows pending_sample_rows (filled in by the backend before the forward).
    BatchField("pending_token_indices", I64, False),  # [P]
    BatchField("pending_sample_rows", I64, False),  # [P]
    # Cache groups (G attention groups; see _core.Batch): the other groups' slots and
    # tables, every group's table offsets, and the recurrent state slots ([0] without one).
    BatchField("group_slot_mapping", I64, False, ndim=2),  # [G - 1, T]
    BatchField("group_block_tables", I32, False, ndim=2),  # [(G - 1) * S, B']
    BatchField("block_table_offsets", I32, False, ndim=2),  # [G, S]
    BatchField("state_slots", I32, False),  # [S] or [0]
    BatchField("state_fresh", I32, False),  # [S] or [0]
    BatchField("state_restore", I32, False),  # [S] or [0]
    BatchField("state_save", I32, False),  # [S] or [0]
    # [N] proposed tokens each sample row verifies (speculation; 0 without): its sequence's
    # last num_proposed[n] + 1 token rows are verification rows.
    BatchField("num_proposed", I32, False),  # [N]
)
BATCH_FIELD_NAMES = tuple(f.name for f in BATCH_FIELDS)
MODEL_INPUTS = tuple(f.name for f in BATCH_FIELDS if f.model_input)
#: The cache-group fields: what a backend needs beyond the model inputs for a model with
#: sliding-window or recurrent-state layers (and what the tensor-parallel broadcast carries).
CACHE_GROUP_FIELDS = (
    "group_slot_mapping", "group_block_tables", "block_table_offsets",
    "state_slots", "state_fresh", "state_restore", "state_save",
)


def absolute_block_tables(block_tables: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """A sliding group's tables (row ``r`` starting at logical block ``offsets[r]``) laid
    out from block 0, the released columns holding block 0: for attention code that indexes
    tables by position and hides what lies before the window with its mask."""
    if not offsets.size or not offsets.any():
        return block_tables
    rows, width = block_tables.shape
    out = np.zeros((rows, int(offsets.max()) + width), dtype=block_tables.dtype)
    cols = offsets.astype(np.int64)[:, None] + np.arange(width)
    out[np.arange(rows)[:, None], cols] = block_tables
    return out


#: Cache-group fields the model's forward takes (models with more than one attention group).
GROUP_MODEL_INPUTS = ("group_slot_mapping", "group_block_tables")


def group_model_inputs(batch: Any, group_blocks: list[int]) -> dict[str, np.ndarray]:
    """The forward's inputs for attention groups after the first: their slots, and their
    block tables laid out from block 0 (see :func:`absolute_block_tables`), each checked
    against its group's pool of ``group_blocks[g]`` blocks."""
    s = len(batch.seq_lens)
    tables, offsets = batch.group_block_tables, batch.block_table_offsets
    if s and len(offsets) != len(group_blocks):
        raise ValueError(f"the batch has {len(offsets)} cache groups, the model "
                         f"{len(group_blocks)}: schedule it with the backend's cache_groups")
    parts = []
    for g in range(1, len(group_blocks)):
        t = tables[(g - 1) * s : g * s]
        if t.size and int(t.max()) >= group_blocks[g]:
            raise ValueError(f"batch uses a block id beyond cache group {g}'s "
                             f"{group_blocks[g]} blocks")
        parts.append(absolute_block_tables(t, offsets[g]) if offsets.size else t)
    width = max((p.shape[1] for p in parts), default=0)
    joined = np.zeros((s * len(parts), width), dtype=np.int32)
    for g, p in enumerate(parts):
        joined[g * s : (g + 1) * s, : p.shape[1]] = p
    return {"group_slot_mapping": batch.group_slot_mapping, "group_block_tables": joined}


#: The recurrent-state fields the forward of a model with a state group takes.
STATE_MODEL_INPUTS = ("state_slots", "state_fresh", "state_restore", "state_save")


def state_model_inputs(batch: Any) -> dict[str, np.ndarray]:
    """The forward's inputs for a model with a recurrent-state group: per sequence, its
    slot, whether the step starts it fresh, the checkpoint slot to restore into it before
    the step and the one to save it into after (-1: none)."""
    if len(batch.seq_lens) and len(batch.state_slots) != len(batch.seq_lens):
        raise ValueError("the model keeps recurrent state: schedule it with the backend's "
                         "cache_groups (a state group gives each sequence a slot)")
    return {name: getattr(batch, name) for name in STATE_MODEL_INPUTS}


def batch_arrays(batch: Any) -> list[np.ndarray]:
    """The batch's arrays in :data:`BATCH_FIELDS` order."""
    return [getattr(batch, name) for name in BATCH_FIELD_NAMES]


def model_inputs(batch: Any) -> dict[str, np.ndarray]:
    """The keyword arguments of the model's forward for ``batch``."""
    return {name: getattr(batch, name) for name in MODEL_INPUTS}


class ArrayBatch:
    """The attributes of ``_core.Batch`` that backends read, from plain arrays (the worker
    builds one per received frame and per lookahead step)."""

    def __init__(
        self, sample_request_ids: list[str], request_ids: list[str] | None = None,
        **arrays: np.ndarray,
    ) -> None:
        missing = set(MODEL_INPUTS) - set(arrays)
        if missing:
            raise TypeError(f"ArrayBatch lacks {', '.join(sorted(missing))}")
        self.__dict__.update(arrays)
        self.sample_request_ids = sample_request_ids
        #: The request of every sequence (empty when the sender did not say).
        self.request_ids = request_ids if request_ids is not None else []

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_samples(self) -> int:
        return int(self.sample_indices.shape[0])
