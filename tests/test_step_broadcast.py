"""The tensor-parallel step broadcast carries a batch's model inputs and cache-group fields
(per-group tables and slots, table offsets, state slots) to the other ranks unchanged."""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from iron_batch import CacheGroup, Scheduler, SchedulerConfig  # noqa: E402
from iron_batch.batch import BATCH_FIELD_NAMES, MODEL_INPUTS  # noqa: E402
from iron_batch.parallel import step_broadcast  # noqa: E402
from iron_batch.parallel.step_broadcast import Message  # noqa: E402


class Wire:
    """Two ends of a broadcast: rank 0's tensors are queued, the receiver copies them in."""

    def __init__(self) -> None:
        self.sent: deque[Any] = deque()

    def sender(self) -> Any:
        wire = self

        class Rank0:
            def broadcast_host(self, t: Any) -> None:
                wire.sent.append(t.clone())

        return Rank0()

    def receiver(self) -> Any:
        wire = self

        class Rank1:
            def broadcast_host(self, t: Any) -> None:
                got = wire.sent.popleft()
                assert got.shape == t.shape and got.dtype == t.dtype
                t.copy_(got)

        return Rank1()


def hybrid_batch() -> Any:
    s = Scheduler(SchedulerConfig(
        kv_block_size=4, max_batch_tokens=8, cache_groups=[
            CacheGroup("full", 32), CacheGroup("sliding", 32, window=6), CacheGroup("state", 8),
        ]))
    s.add_request("a", list(range(1, 15)), 8)
    s.add_request("b", [7, 8, 9], 8)
    for _ in range(4):  # past a's window: its sliding table starts at an offset
        batch = s.schedule()
        s.commit(batch, np.full(batch.num_samples, 3))
    batch = s.schedule()
    assert batch.block_table_offsets[1].max() > 0 and len(batch.state_slots) == 2
    return batch


def test_a_step_with_cache_group_fields_arrives_whole() -> None:
    batch = hybrid_batch()
    sent = {name: getattr(batch, name) for name in BATCH_FIELD_NAMES}
    wire = Wire()
    step_broadcast.send(wire.sender(), Message.STEP, sent)
    kind, got = step_broadcast.receive(wire.receiver())
    assert kind == Message.STEP and set(got) == set(sent)
    for name, array in sent.items():
        assert got[name].dtype == array.dtype and got[name].shape == array.shape, name
        assert np.array_equal(got[name], array), name


def test_model_inputs_alone_and_control_messages_arrive_as_sent() -> None:
    batch = hybrid_batch()
    wire = Wire()
    step_broadcast.send(wire.sender(), Message.STEP,
                        {name: getattr(batch, name) for name in MODEL_INPUTS})
    step_broadcast.send(wire.sender(), Message.HEARTBEAT)
    kind, got = step_broadcast.receive(wire.receiver())
    assert kind == Message.STEP and tuple(got) == MODEL_INPUTS
    assert np.array_equal(got["block_tables"], batch.block_tables)
    assert step_broadcast.receive(wire.receiver()) == (Message.HEARTBEAT, {})
    assert not wire.sent
