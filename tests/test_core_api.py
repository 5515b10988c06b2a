"""The Rust scheduler through its Python API: the DESIGN loop, arrays, errors, and a
hypothesis state machine that checks invariants after every operation."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from iron_batch import (
    FINISH_REASONS,
    AllocatorError,
    BatchMismatch,
    BlockAllocator,
    DuplicateRequest,
    IronBatchError,
    OutOfBlocks,
    RequestRejected,
    Scheduler,
    SchedulerConfig,
    StepEvents,
)


def rows(events: StepEvents) -> list[tuple[str, int | None, bool, str | None]]:
    """The events as ``(request_id, token_id or None, finished, finish_reason or None)``."""
    return [
        (rid, None if tok < 0 else tok, done, FINISH_REASONS[code])
        for rid, tok, done, code in zip(
            events.request_ids, events.token_ids.tolist(), events.finished.tolist(),
            events.finish_reasons.tolist(), strict=True,
        )
    ]


def context_model(batch, kv: dict[int, int], block_size: int) -> np.ndarray:
    """Next token = hash of the whole context, read back through slot mapping and block
    tables, so any lost, repeated or misplaced token changes the output."""
    for slot, tok in zip(batch.slot_mapping.tolist(), batch.input_ids.tolist(), strict=True):
        kv[slot] = tok
    out = []
    for seq in batch.sample_seq_indices.tolist():
        n = int(batch.seq_lens[seq])
        table = batch.block_tables[seq]
        h = 17
        for p in range(n):
            h = (h * 31 + kv[int(table[p // block_size]) * block_size + p % block_size]) % 1000
        out.append(h)
    return np.asarray(out, dtype=np.int64)


def run_all(s: Scheduler, requests: dict[str, list[int]], max_new: int) -> dict[str, list[int]]:
    for rid, prompt in requests.items():
        s.add_request(rid, prompt, max_new)
    kv: dict[int, int] = {}
    out: dict[str, list[int]] = {rid: [] for rid in requests}
    finished: set[str] = set()
    while s.has_work():
        batch = s.schedule()
        events = s.commit(batch, context_model(batch, kv, s.config.kv_block_size))
        for rid, tok, done, _reason in rows(events):
            assert rid not in finished
            if tok is not None:
                out[rid].append(tok)
            if done:
                finished.add(rid)
        s.check_invariants()
    assert finished == set(requests)
    return out


def test_design_loop_runs_and_frees_every_block():
    s = Scheduler(SchedulerConfig(total_kv_blocks=64, kv_block_size=4, max_batch_tokens=32))
    out = run_all(s, {f"r{i}": list(range(i, i + 5 + i)) for i in range(6)}, max_new=7)
    assert all(len(toks) == 7 for toks in out.values())
    stats = s.stats()
    assert stats["free_blocks"] == stats["total_blocks"] == 64
    assert stats["requests_finished"] == 6


def test_preemption_and_prefix_cache_do_not_change_outputs():
    reqs = {f"r{i}": [1, 2, 3, 4, 5, 6, 7, 8] + [i] * (1 + i % 4) for i in range(10)}
    big = run_all(Scheduler(SchedulerConfig(total_kv_blocks=1024, kv_block_size=2,
                                            enable_prefix_caching=False)), reqs, 9)
    small_sched = Scheduler(SchedulerConfig(total_kv_blocks=12, kv_block_size=2,
                                            max_batch_tokens=6))
    small = run_all(small_sched, reqs, 9)
    assert small == big
    assert small_sched.stats()["preemptions"] > 0
    assert small_sched.stats()["prefix_cache_hit_tokens"] > 0


def test_batch_arrays_have_documented_shapes_and_dtypes():
    s = Scheduler(SchedulerConfig(total_kv_blocks=16, kv_block_size=4))
    s.add_request("a", [5, 6, 7, 8, 9], 2)
    s.add_request("b", np.array([1, 2], dtype=np.int32), 2)
    b = s.schedule()
    assert (b.num_seqs, b.num_tokens, len(b)) == (2, 7, 2)
    assert b.input_ids.dtype == np.int64 and b.input_ids.tolist() == [5, 6, 7, 8, 9, 1, 2]
    assert b.positions.tolist() == [0, 1, 2, 3, 4, 0, 1]
    assert b.slot_mapping.dtype == np.int64
    assert b.query_start_loc.dtype == np.int32 and b.query_start_loc.tolist() == [0, 5, 7]
    assert b.seq_lens.tolist() == [5, 2]
    assert b.block_tables.shape == (2, 2) and b.block_tables.dtype == np.int32
    assert b.sample_indices.tolist() == [4, 6]
    assert b.sample_seq_indices.tolist() == [0, 1]
    assert b.request_ids == ["a", "b"] and b.sample_request_ids == ["a", "b"]
    # The arrays are the same objects on every access (built once, no copy per access).
    assert b.input_ids is b.input_ids or np.shares_memory(b.input_ids, b.input_ids)
    events = s.commit(b, np.array([11, 12], dtype=np.int64))
    assert rows(events) == [("a", 11, False, None), ("b", 12, False, None)]
    assert s.output_token_ids("a") == [11]


def test_errors_are_typed_and_change_nothing():
    s = Scheduler(SchedulerConfig(total_kv_blocks=4, kv_block_size=4, max_model_len=12))
    with pytest.raises(RequestRejected, match="KV pool of 16 tokens"):
        s.add_request("big", list(range(10)), 10)
    with pytest.raises(RequestRejected, match="model context of 12"):
        s.add_request("ctx", list(range(10)), 3)
    with pytest.raises(RequestRejected):
        s.add_request("empty", [], 3)
    with pytest.raises(ValueError, match="out of range"):
        s.add_request("neg", [1, -2], 3)
    with pytest.raises(ValueError, match="list of integers"):
        s.add_request("str", ["a"], 3)  # type: ignore[list-item]
    assert not s.has_work() and s.stats()["requests_added"] == 0
    s.add_request("ok", [1, 2], 3)
    with pytest.raises(DuplicateRequest):
        s.add_request("ok", [1], 1)
    assert isinstance(DuplicateRequest("x"), IronBatchError)
    b = s.schedule()
    with pytest.raises(BatchMismatch, match="expected 1 x 1 sampled"):
        s.commit(b, [])
    other = Scheduler(SchedulerConfig())
    with pytest.raises(BatchMismatch, match="another Scheduler"):
        other.commit(b, [1])
    s.commit(b, [3])
    with pytest.raises(BatchMismatch, match="already committed"):
        s.commit(b, [3])
    with pytest.raises(ValueError):
        Scheduler(SchedulerConfig(kv_block_size=0))


def test_zero_max_new_tokens_finishes_with_one_event_and_no_model_work():
    s = Scheduler(SchedulerConfig())
    s.add_request("z", [1, 2, 3], 0)
    b = s.schedule()
    assert b.num_seqs == 0 and b.num_tokens == 0
    assert rows(s.commit(b, [])) == [("z", None, True, "length")]
    assert not s.has_work()


def test_stop_token_abort_and_finish():
    s = Scheduler(SchedulerConfig(total_kv_blocks=8, kv_block_size=2))
    s.add_request("stop", [1, 2, 3], 10, stop_token_ids=[42])
    s.add_request("abort", [1, 2, 3], 10)
    s.add_request("fin", [4, 5], 10)
    b = s.schedule()
    assert s.abort("abort") and not s.abort("abort")
    ev = rows(s.commit(b, [42, 7, 8]))  # the aborted row's token is dropped
    assert ("stop", 42, True, "stop") in ev and ("fin", 8, False, None) in ev
    assert all(e[0] != "abort" for e in ev)
    assert s.finish("fin") and not s.is_live("fin")
    assert s.num_free_blocks == 8 and not s.has_work()


def test_block_allocator_direct_use():
    a = BlockAllocator(4, 2)
    assert a.allocate(3) == [0, 1, 2]
    with pytest.raises(OutOfBlocks):
        a.allocate(2)
    assert a.num_free == 1
    h0 = a.publish(0, None, [1, 2])
    a.publish(1, h0, [3, 4])
    a.free([2, 1, 0])
    assert a.free_queue() == [3, 2, 1, 0]
    with pytest.raises(AllocatorError, match="double free"):
        a.free([0])
    assert a.match_prefix([1, 2, 3, 4, 5]) == [0, 1]
    assert a.ref_count(0) == 1 and a.num_cached == 2
    a.check_invariants()


@settings(max_examples=60, stateful_step_count=60, deadline=None)
class SchedulerMachine(RuleBasedStateMachine):
    """Random add/step/abort under a tiny pool; invariants checked after every rule."""

    def __init__(self) -> None:
        super().__init__()
        self.s = Scheduler(SchedulerConfig(total_kv_blocks=10, kv_block_size=2,
                                           max_batch_tokens=7, max_running_seqs=3))
        self.kv: dict[int, int] = {}
        self.n = 0
        self.live: set[str] = set()
        self.ended: set[str] = set()
        self.tokens: dict[str, list[int]] = {}
        self.max_new: dict[str, int] = {}

    @rule(prompt=st.lists(st.integers(0, 5), min_size=1, max_size=12),
          max_new=st.integers(0, 6))
    def add(self, prompt: list[int], max_new: int) -> None:
        rid = f"r{self.n}"
        self.n += 1
        self.s.add_request(rid, prompt, max_new)
        self.live.add(rid)
        self.tokens[rid] = []
        self.max_new[rid] = max_new

    @rule()
    def step(self) -> None:
        b = self.s.schedule()
        for rid, tok, done, reason in rows(self.s.commit(b, context_model(b, self.kv, 2))):
            assert rid in self.live, f"event for ended request {rid}"
            if tok is not None:
                self.tokens[rid].append(tok)
            if done:
                assert reason == "length"
                assert len(self.tokens[rid]) == self.max_new[rid]
                self.live.discard(rid)
                self.ended.add(rid)

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.live)))
        if not self.s.abort(rid):
            # Only a max_new_tokens=0 request ends at add; its event is still to come.
            assert self.max_new[rid] == 0
            return
        self.live.discard(rid)
        self.ended.add(rid)

    @invariant()
    def consistent(self) -> None:
        self.s.check_invariants()
        st_ = self.s.stats()
        assert st_["running"] + st_["waiting"] <= len(self.live)

    def teardown(self) -> None:
        for _ in range(10_000):
            if not self.s.has_work():
                break
            self.step()
        assert not self.live
        assert self.s.num_free_blocks == 10


TestSchedulerMachine = SchedulerMachine.TestCase
