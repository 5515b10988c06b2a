"""Rank 0 → every rank: what each step's forward pass needs, in two broadcasts, no pickle.

The header is a fixed ``int64[2 + len(MODEL_INPUTS)]``: the message kind, the block-table
width, and the element count of each model input of the batch-field table
(``iron_batch.batch``). The payload is those arrays concatenated as one int64 tensor. Only
rank 0 samples, so no sampling state needs to travel: the other ranks only run the forward.
"""

from __future__ import annotations

from enum import IntEnum

import numpy as np
import torch

from iron_batch.batch import BATCH_FIELDS, MODEL_INPUTS
from iron_batch.parallel.group import TensorParallelGroup

_FIELDS = [f for f in BATCH_FIELDS if f.model_input]
HEADER_LEN = 2 + len(_FIELDS)


class Message(IntEnum):
    STEP = 1
    #: Sent by an idle rank 0 so that the other ranks' wait never reaches the timeout.
    HEARTBEAT = 2
    STOP = 3


def send(group: TensorParallelGroup, kind: Message,
         inputs: dict[str, np.ndarray] | None = None) -> None:
    """Rank 0: broadcast a message (``inputs``: the model inputs of a STEP)."""
    header = np.zeros(HEADER_LEN, dtype=np.int64)
    header[0] = int(kind)
    arrays: list[np.ndarray] = []
    if inputs is not None:
        tables = inputs["block_tables"]
        header[1] = tables.shape[1] if tables.ndim == 2 else 0
        arrays = [np.asarray(inputs[f.name]).reshape(-1) for f in _FIELDS]
        header[2:] = [a.size for a in arrays]
    group.broadcast_host(torch.from_numpy(header))
    if arrays:
        payload = np.concatenate(arrays).astype(np.int64, copy=False)
        group.broadcast_host(torch.from_numpy(payload))


def receive(group: TensorParallelGroup) -> tuple[Message, dict[str, np.ndarray]]:
    """Ranks >= 1: the next message and, for a STEP, the model inputs."""
    header_t = torch.zeros(HEADER_LEN, dtype=torch.int64)
    group.broadcast_host(header_t)
    header = header_t.numpy()
    kind = Message(int(header[0]))
    if kind != Message.STEP:
        return kind, {}
    sizes = header[2:].tolist()
    payload_t = torch.empty(int(sum(sizes)), dtype=torch.int64)
    group.broadcast_host(payload_t)
    payload = payload_t.numpy()
    out: dict[str, np.ndarray] = {}
    start = 0
    for field, size in zip(_FIELDS, sizes, strict=True):
        arr = payload[start : start + size].astype(field.dtype)
        if field.ndim == 2:
            arr = arr.reshape(out["seq_lens"].shape[0], int(header[1]))
        out[field.name] = arr
        start += size
    assert tuple(out) == MODEL_INPUTS
    return kind, out
