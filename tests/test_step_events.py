"""``Scheduler.commit`` returns its events as columns (``StepEvents``): what a caller sees
in them for tokens, finish reasons, lookahead, aborts, preemption, overlap, and how the
handles that ``add_request`` returns name the requests."""

from __future__ import annotations

import random

import numpy as np
import pytest
from iron_batch import FINISH_REASONS, Scheduler, SchedulerConfig, StepEvents


def test_finish_reason_codes_name_the_reasons() -> None:
    assert FINISH_REASONS == (None, "length", "stop", "abort")


def test_commit_returns_numpy_columns_one_row_per_event() -> None:
    s = Scheduler(SchedulerConfig(total_kv_blocks=16, kv_block_size=4))
    ha = s.add_request("a", [1, 2, 3], 3, stop_token_ids=[42])
    hb = s.add_request("b", [4, 5], 1)
    hz = s.add_request("z", [6], 0)
    assert len({ha, hb, hz}) == 3
    b = s.schedule()
    ev = s.commit(b, np.array([42, 8], dtype=np.int64))
    assert isinstance(ev, StepEvents) and len(ev) == 3 and ev.num_finished == 3
    assert ev.handles.dtype == np.int64 and ev.token_ids.dtype == np.int64
    assert ev.finish_reasons.dtype == np.uint8 and ev.finished.dtype == np.bool_
    # The request that ended without model work comes first, with no token (-1).
    assert ev.handles.tolist() == [hz, ha, hb]
    assert ev.request_ids == ["z", "a", "b"]
    assert ev.token_ids.tolist() == [-1, 42, 8]
    assert [FINISH_REASONS[c] for c in ev.finish_reasons.tolist()] == ["length", "stop", "length"]
    assert ev.finished.tolist() == [True, True, True]
    # Built once in Rust and handed over: the same arrays on every access.
    assert ev.handles is ev.handles or np.shares_memory(ev.handles, ev.handles)
    assert not s.has_work() and s.num_free_blocks == 16


def test_a_step_with_nothing_to_report_has_empty_columns() -> None:
    s = Scheduler(SchedulerConfig(total_kv_blocks=16, kv_block_size=4, max_batch_tokens=4))
    s.add_request("long", list(range(1, 10)), 2)
    ev = s.commit(s.schedule(), [])  # the first chunk of the prompt: nothing sampled
    assert len(ev) == 0 and ev.num_finished == 0 and ev.request_ids == []
    assert ev.handles.shape == ev.token_ids.shape == ev.finish_reasons.shape == (0,)


def test_unfinished_events_have_code_zero() -> None:
    s = Scheduler(SchedulerConfig(total_kv_blocks=16, kv_block_size=4))
    h = s.add_request("a", [1, 2], 5)
    ev = s.commit(s.schedule(), [9])
    assert ev.handles.tolist() == [h] and ev.token_ids.tolist() == [9]
    assert ev.finish_reasons.tolist() == [0] and ev.finished.tolist() == [False]
    assert ev.num_finished == 0


def test_lookahead_tokens_come_in_order_and_a_stop_drops_the_rest() -> None:
    s = Scheduler(SchedulerConfig(total_kv_blocks=32, kv_block_size=2))
    ha = s.add_request("a", [1, 2, 3], 10, stop_token_ids=[42])
    hb = s.add_request("b", [4, 5, 6], 2)
    b = s.schedule(lookahead=2)
    assert b.sample_max_steps.tolist() == [3, 2]
    ev = s.commit(b, np.array([[5, 42, 6], [7, 8, 9]]))
    assert ev.handles.tolist() == [ha, ha, hb, hb]
    assert ev.token_ids.tolist() == [5, 42, 7, 8]  # 6 came after the stop; 9 past the limit
    assert [FINISH_REASONS[c] for c in ev.finish_reasons.tolist()] == [None, "stop", None,
                                                                       "length"]
    assert ev.num_finished == 2 and not s.has_work()


def test_an_aborted_request_gets_no_event_and_a_finished_one_no_more() -> None:
    s = Scheduler(SchedulerConfig(total_kv_blocks=16, kv_block_size=2))
    s.add_request("gone", [1, 2], 5)
    hk = s.add_request("kept", [3, 4], 5)
    s.add_request("ended", [5, 6], 5)
    b = s.schedule()
    assert s.abort("gone") and s.finish("ended")
    ev = s.commit(b, [7, 8, 9])
    assert ev.request_ids == ["kept"] and ev.handles.tolist() == [hk]
    assert ev.token_ids.tolist() == [8]


def test_a_request_preempted_under_overlap_keeps_the_token_it_was_sampled() -> None:
    # Four blocks of two: "a" and "b" fill them after one token each. Scheduling a third
    # step over an open one needs a block for "a", so "b" (the later arrival) is preempted;
    # the open step's token for "b" still arrives, and "b" resumes over it.
    s = Scheduler(SchedulerConfig(total_kv_blocks=4, kv_block_size=2))
    ha = s.add_request("a", [1, 2, 3], 4)
    hb = s.add_request("b", [4, 5, 6], 4)
    s.commit(s.schedule(), [7, 8])
    b2 = s.schedule(overlap=True)
    b3 = s.schedule(overlap=True)
    assert s.stats()["preemptions"] == 1 and b3.request_ids == ["a"]
    ev = s.commit(b2, [9, 10])
    assert ev.handles.tolist() == [ha, hb] and ev.token_ids.tolist() == [9, 10]
    assert ev.num_finished == 0
    ev = s.commit(b3, [11])
    assert ev.handles.tolist() == [ha] and ev.token_ids.tolist() == [11]
    assert s.output_token_ids("b") == [8, 10]


def test_a_request_that_stops_under_overlap_ignores_its_row_in_the_next_step() -> None:
    s = Scheduler(SchedulerConfig(total_kv_blocks=16, kv_block_size=2))
    ha = s.add_request("a", [1, 2], 5, stop_token_ids=[42])
    hb = s.add_request("b", [3, 4], 5)
    b1 = s.schedule()
    b2 = s.schedule(overlap=True)  # "a"'s row here follows a token that will stop it
    ev = s.commit(b1, [42, 5])
    assert ev.handles.tolist() == [ha, hb] and ev.finish_reasons.tolist() == [2, 0]
    ev = s.commit(b2, [6, 7])
    assert ev.handles.tolist() == [hb] and ev.token_ids.tolist() == [7]


def test_a_handle_is_reused_only_after_the_next_schedule() -> None:
    s = Scheduler(SchedulerConfig(total_kv_blocks=16, kv_block_size=2))
    ha = s.add_request("a", [1, 2], 1)
    ev = s.commit(s.schedule(), [5])
    assert ev.handles.tolist() == [ha] and ev.num_finished == 1
    # Between the commit that ended "a" and the next schedule, its handle still names it.
    hb = s.add_request("b", [3], 2)
    assert hb != ha
    b = s.schedule()
    hc = s.add_request("c", [4], 2)
    assert hc == ha
    ev = s.commit(b, [6])
    assert ev.request_ids == ["b"] and ev.handles.tolist() == [hb]
    ev = s.commit(s.schedule(), [7, 8])
    assert ev.request_ids == ["b", "c"] and ev.handles.tolist() == [hb, hc]


@pytest.mark.parametrize("seed", range(4))
def test_a_per_handle_lookup_names_every_event_under_churn(seed: int) -> None:
    """Keep, as the engine does, a list from handle to request, set at add and cleared when
    the request ends; with adds, aborts, stops, overlap and preemption in a small pool it
    always names the request of every event, and every request gets its tokens in order."""
    rng = random.Random(seed)
    s = Scheduler(SchedulerConfig(total_kv_blocks=12, kv_block_size=2, max_batch_tokens=10,
                                  max_running_seqs=4))
    by_handle: dict[int, str] = {}
    limit: dict[str, int] = {}
    got: dict[str, list[int]] = {}
    ended: set[str] = set()
    aborted: set[str] = set()
    open_batches: list = []
    n = 0
    for _ in range(400):
        if rng.random() < 0.4:
            rid = f"r{n}"
            n += 1
            limit[rid] = rng.randrange(0, 9)
            got[rid] = []
            h = s.add_request(rid, [rng.randrange(1, 50) for _ in range(rng.randrange(1, 9))],
                              limit[rid], stop_token_ids=[0])
            assert h not in by_handle
            by_handle[h] = rid
        if by_handle and rng.random() < 0.05:
            h, rid = rng.choice(sorted(by_handle.items()))
            if s.abort(rid):
                del by_handle[h]
                ended.add(rid)
                aborted.add(rid)
        if s.has_work() and len(open_batches) < 2:
            open_batches.append(s.schedule(overlap=bool(open_batches)))
        if open_batches and (len(open_batches) == 2 or rng.random() < 0.5):
            b = open_batches.pop(0)
            sampled = np.array([rng.randrange(0, 50) for _ in range(b.num_samples)])
            ev = s.commit(b, sampled)
            for h, rid, tok, code in zip(ev.handles.tolist(), ev.request_ids,
                                         ev.token_ids.tolist(), ev.finish_reasons.tolist(),
                                         strict=True):
                assert by_handle[h] == rid and rid not in ended
                if tok >= 0:
                    got[rid].append(tok)
                if code:
                    if FINISH_REASONS[code] == "stop":
                        assert tok == 0
                    else:
                        assert FINISH_REASONS[code] == "length"
                        assert len(got[rid]) == limit[rid]
                    del by_handle[h]
                    ended.add(rid)
        s.check_invariants()
        for rid in by_handle.values():
            if limit[rid]:  # (one with 0 new tokens ended at add; its event is pending)
                assert s.output_token_ids(rid) == got[rid]
    for rid, toks in got.items():
        assert len(toks) <= limit[rid]
        assert 0 not in toks[:-1]  # nothing after a stop token
    assert len(ended - aborted) > 20 and aborted
    assert s.stats()["preemptions"] > 0
