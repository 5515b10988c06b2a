"""Rank 0 → every rank: what each step's forward pass needs, in two broadcasts, no pickle.

The header is a fixed ``int64[1 + 3 * len(BATCH_FIELDS)]``: the message kind, then for each
field of the batch-field table (``iron_batch.batch``) its element count (-1 for a field not
sent) and its two dimensions (the second 0 for a 1-D field). A STEP sends the model inputs and any
cache-group fields (``CACHE_GROUP_FIELDS``) its backend hands over. The payload is those
arrays concatenated as one int64 tensor. Only rank 0 samples, so no sampling state needs to
travel: the other ranks only run the forward.
"""

from __future__ import annotations

from enum import IntEnum

import numpy as np
import torch

from iron_batch.batch import BATCH_FIELDS
from iron_batch.parallel.group import TensorParallelGroup

HEADER_LEN = 1 + 3 * len(BATCH_FIELDS)


class Message(IntEnum):
    STEP = 1
    #: Sent by an idle rank 0 so that the other ranks' wait never reaches the timeout.
    HEARTBEAT = 2
    STOP = 3


def send(group: TensorParallelGroup, kind: Message,
         inputs: dict[str, np.ndarray] | None = None) -> None:
    """Rank 0: broadcast a message (``inputs``: the batch arrays of a STEP, by field name)."""
    header = np.full(HEADER_LEN, -1, dtype=np.int64)
    header[0] = int(kind)
    arrays: list[np.ndarray] = []
    if inputs is not None:
        for i, f in enumerate(BATCH_FIELDS):
            if f.name not in inputs:
                continue
            a = np.asarray(inputs[f.name])
            header[1 + 3 * i] = a.size
            header[2 + 3 * i] = a.shape[0]
            header[3 + 3 * i] = a.shape[1] if a.ndim == 2 else 0
            arrays.append(a.reshape(-1))
    group.broadcast_host(torch.from_numpy(header))
    if arrays:
        payload = np.concatenate(arrays).astype(np.int64, copy=False)
        group.broadcast_host(torch.from_numpy(payload))


def receive(group: TensorParallelGroup) -> tuple[Message, dict[str, np.ndarray]]:
    """Ranks >= 1: the next message and, for a STEP, the arrays rank 0 sent."""
    header_t = torch.zeros(HEADER_LEN, dtype=torch.int64)
    group.broadcast_host(header_t)
    header = header_t.numpy()
    kind = Message(int(header[0]))
    if kind != Message.STEP:
        return kind, {}
    sizes = header[1::3]
    payload_t = torch.empty(int(sizes[sizes > 0].sum()), dtype=torch.int64)
    group.broadcast_host(payload_t)
    payload = payload_t.numpy()
    out: dict[str, np.ndarray] = {}
    start = 0
    for i, field in enumerate(BATCH_FIELDS):
        size, dim0, dim1 = (int(v) for v in header[1 + 3 * i : 4 + 3 * i])
        if size < 0:
            continue
        arr = payload[start : start + size].astype(field.dtype)
        if field.ndim == 2:
            arr = arr.reshape(dim0, dim1)
        out[field.name] = arr
        start += size
    return kind, out
