"""The engine without HTTP: synchronous stepping, the thread + asyncio API, the mock backend."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import numpy as np
import pytest
from conftest import TextMockBackend, wait_for
from iron_batch import LLM, Engine, SamplingParams, SchedulerConfig
from iron_batch.backends.base import Backend, BackendError
from iron_batch.backends.mock import MockBackend
from iron_batch.engine import TokenEvent


def fast_mock() -> MockBackend:
    return MockBackend(token_latency_us=0, prefill_token_latency_us=0)


def prompts(n: int, length: int = 10) -> list[list[int]]:
    return [[(31 * i + j) % 1000 + 1 for j in range(length)] for i in range(n)]


def test_mock_backend_satisfies_protocol() -> None:
    assert isinstance(fast_mock(), Backend)


def test_llm_generate_mock() -> None:
    llm = LLM(backend=fast_mock(), total_kv_blocks=64)
    outs = llm.generate(prompts(3), [SamplingParams(max_new_tokens=n) for n in (5, 0, 9)])
    assert [len(o.token_ids) for o in outs] == [5, 0, 9]
    assert [o.finish_reason for o in outs] == ["length"] * 3
    assert outs[0].prompt_token_ids == prompts(3)[0]
    # Deterministic: the same prompt gives the same tokens in a new engine.
    again = LLM(backend=fast_mock()).generate([prompts(1)[0]], SamplingParams(max_new_tokens=5))
    assert again[0].token_ids == outs[0].token_ids
    assert llm.engine.stats.scheduler["free_blocks"] == 64


def test_llm_rejects_request_that_never_fits() -> None:
    llm = LLM(backend=fast_mock(), total_kv_blocks=4, kv_block_size=4)
    with pytest.raises(ValueError, match="KV"):
        llm.generate([[1] * 10], SamplingParams(max_new_tokens=10))
    # The engine is clean afterwards.
    assert not llm.engine.has_unfinished()
    assert len(llm.generate([[1, 2]], SamplingParams(max_new_tokens=3))[0].token_ids) == 3


def test_llm_needs_model_or_backend() -> None:
    with pytest.raises(ValueError):
        LLM()
    with pytest.raises(ValueError, match="text prompts"):
        LLM(backend=fast_mock()).generate(["hello"])


def test_preemption_gives_the_same_tokens_as_a_big_pool() -> None:
    work = prompts(10, 9)
    params = SamplingParams(max_new_tokens=30)
    tiny = LLM(backend=fast_mock(), total_kv_blocks=16, kv_block_size=4)
    big = LLM(backend=fast_mock(), total_kv_blocks=1024, kv_block_size=4)
    tiny_out = tiny.generate(work, params)
    big_out = big.generate(work, params)
    assert tiny.engine.stats.scheduler["preemptions"] > 0
    assert [o.token_ids for o in tiny_out] == [o.token_ids for o in big_out]
    assert all(len(o.token_ids) == 30 for o in tiny_out)
    assert tiny.engine.stats.scheduler["free_blocks"] == 16


def test_stop_string_finishes_through_the_scheduler() -> None:
    llm = LLM(backend=TextMockBackend(token_latency_us=0))
    full = llm.generate(["abc"], SamplingParams(max_new_tokens=20))[0]
    assert full.text == "".join(chr(97 + t) for t in full.token_ids)
    stop = full.text[6:8]
    cut = llm.generate(["abc"], SamplingParams(max_new_tokens=20, stop=[stop]))[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index(stop)]
    assert len(cut.token_ids) < 20
    assert llm.engine.stats.scheduler["running"] == 0


def test_eos_and_stop_token_ids() -> None:
    backend = fast_mock()
    first = LLM(backend=backend).generate([[1, 2, 3]], SamplingParams(max_new_tokens=8))[0]
    stop_at = first.token_ids[3]
    backend.eos_token_ids = [stop_at]
    llm = LLM(backend=backend)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_new_tokens=8))[0]
    assert out.token_ids == first.token_ids[:4]
    assert out.finish_reason == "stop"
    ignored = llm.generate([[1, 2, 3]], SamplingParams(max_new_tokens=8, ignore_eos=True))[0]
    assert ignored.token_ids == first.token_ids
    by_param = LLM(backend=fast_mock()).generate(
        [[1, 2, 3]], SamplingParams(max_new_tokens=8, stop_token_ids=[stop_at])
    )[0]
    assert by_param.token_ids == first.token_ids[:4]


@pytest.mark.parametrize("depth", [0, 1])
def test_requests_that_come_and_go_each_get_exactly_their_own_tokens(depth: int) -> None:
    """Requests added, stopped, aborted and their ids reused while others run, in a pool
    small enough to preempt: every request's events carry its own tokens, indexed from 0,
    and end once (the engine finds each event's request by its scheduler handle, which the
    scheduler recycles)."""
    rng = random.Random(depth)
    work = []
    for i, prompt in enumerate(prompts(40, 6)):
        params = SamplingParams(max_new_tokens=rng.randrange(0, 14))
        work.append((f"r{i % 7}", prompt, params))
    reference = [o.token_ids for o in LLM(backend=fast_mock()).generate(
        [p for _, p, _ in work], [params for _, _, params in work])]
    # Half of them stop on their third token (when they get that far).
    for k, (_, _, params) in enumerate(work):
        if k % 2 and len(reference[k]) > 3:
            params.stop_token_ids = [reference[k][2]]
            reference[k] = reference[k][: reference[k].index(reference[k][2]) + 1]
    engine = Engine(fast_mock(), SchedulerConfig(total_kv_blocks=20, kv_block_size=2,
                                                 max_running_seqs=5, max_batch_tokens=16),
                    overlap_depth=depth)
    live: dict[str, int] = {}  # request id -> index into work
    got: dict[int, list[TokenEvent]] = {}
    aborted: set[int] = set()
    todo = list(range(len(work)))
    while todo or engine.has_unfinished():
        for _ in range(rng.randrange(0, 3)):
            if todo and work[todo[0]][0] not in live:
                k = todo.pop(0)
                rid, prompt, params = work[k]
                live[rid] = k
                got[k] = []
                engine.add_request(rid, prompt, params)
        if live and rng.random() < 0.08:
            rid = rng.choice(sorted(live))
            aborted.add(live[rid])
            engine.abort(rid)
        for event in engine.step():
            k = live[event.request_id]
            assert not got[k] or not got[k][-1].finished
            got[k].append(event)
            if event.finished:
                del live[event.request_id]
    assert not live and engine.stats.scheduler["preemptions"] > 0
    assert engine.stats.scheduler["free_blocks"] == 20
    reasons: list[str | None] = []
    for k, events in got.items():
        tokens = [e.token_id for e in events if e.token_id is not None]
        assert [e.index for e in events if e.token_id is not None] == list(range(len(tokens)))
        assert events[-1].finished and sum(e.finished for e in events) == 1
        reason = events[-1].finish_reason
        reasons.append(reason)
        if reason == "abort":
            assert k in aborted and tokens == reference[k][: len(tokens)]
        else:
            assert tokens == reference[k]
            stops = work[k][2].stop_token_ids
            assert reason == ("stop" if tokens and tokens[-1] in stops else "length")
    assert len(got) == len(work)
    assert {"abort", "stop", "length"} <= set(reasons)


class LookaheadAlphabet(TextMockBackend):
    """Three decode steps per call, like a remote worker: the token at position p is letter
    p % 26, so a prompt "abc" continues "defghij..."."""

    steps_per_call = 3

    def __init__(self) -> None:
        super().__init__(token_latency_us=0)

    def execute(self, batch):  # type: ignore[no-untyped-def]
        pos = batch.positions[batch.sample_indices]
        return (pos[:, None] + np.arange(1, 4)) % 26


def test_a_stop_string_matched_mid_lookahead_drops_the_rest_of_the_call() -> None:
    llm = LLM(backend=LookaheadAlphabet())
    outs = llm.generate(["abc", "abcdefghijk", "abc"], [
        SamplingParams(max_new_tokens=10, stop=["fg"]),  # "def", then "g" ends it: "hi" dropped
        SamplingParams(max_new_tokens=4, stop=["m"]),  # "l", then "m" ends it: "n" dropped
        SamplingParams(max_new_tokens=5),
    ])
    assert [(o.text, o.finish_reason) for o in outs] == [
        ("de", "stop"), ("l", "stop"), ("defgh", "length")]
    assert [len(o.token_ids) for o in outs] == [4, 2, 5]
    assert llm.engine.stats.scheduler["free_blocks"] == llm.engine.config.total_kv_blocks
    assert llm.engine.stats.scheduler["running"] == 0


class LostKV(BackendError):
    invalidates_kv = True


class KVLosingBackend(MockBackend):
    def __init__(self) -> None:
        super().__init__(0, 0)
        self.fail_at = -1

    def execute(self, batch):  # type: ignore[no-untyped-def]
        if self.steps == self.fail_at:
            self.steps += 1
            raise LostKV("worker gone")
        return super().execute(batch)


@pytest.mark.parametrize("depth", [0, 1])
def test_a_backend_that_loses_its_kv_fails_everything_and_a_fresh_scheduler_goes_on(
    depth: int,
) -> None:
    backend = KVLosingBackend()
    engine = Engine(backend, SchedulerConfig(total_kv_blocks=64), overlap_depth=depth)
    for rid in ("a", "b", "c"):
        engine.add_request(rid, [1, 2, 3], SamplingParams(max_new_tokens=8))
    engine.step()
    engine.step()
    backend.fail_at = backend.steps
    failed: list[TokenEvent] = []
    while engine.has_unfinished():
        failed.extend(engine.step())
    assert {e.request_id for e in failed if e.finished} == {"a", "b", "c"}
    assert {e.finish_reason for e in failed if e.finished} == {"error"}
    engine.add_request("d", [1, 2, 3], SamplingParams(max_new_tokens=5))
    engine.add_request("a", [4, 5, 6], SamplingParams(max_new_tokens=3))
    after: dict[str, list[TokenEvent]] = {"a": [], "d": []}
    while engine.has_unfinished():
        for event in engine.step():
            after[event.request_id].append(event)
    assert [e.index for e in after["d"]] == [0, 1, 2, 3, 4]
    assert [e.index for e in after["a"]] == [0, 1, 2]
    assert after["d"][-1].finish_reason == after["a"][-1].finish_reason == "length"
    assert engine.stats.scheduler["free_blocks"] == 64


class FailingBackend(MockBackend):
    def __init__(self) -> None:
        super().__init__(0, 0)
        self.fail = True

    def execute(self, batch):  # type: ignore[no-untyped-def]
        if self.fail:
            self.fail = False
            raise RuntimeError("device fell off the bus")
        return super().execute(batch)


def test_backend_error_fails_the_batch_and_engine_goes_on() -> None:
    engine = Engine(FailingBackend(), SchedulerConfig(total_kv_blocks=64))
    engine.add_request("a", [1, 2, 3], SamplingParams(max_new_tokens=4))
    events = engine.step()
    assert [(e.request_id, e.finish_reason) for e in events] == [("a", "error")]
    assert events[0].error is not None and "bus" in events[0].error
    engine.add_request("b", [1, 2, 3], SamplingParams(max_new_tokens=4))
    got: list[TokenEvent] = []
    while engine.has_unfinished():
        got.extend(engine.step())
    assert [e.index for e in got] == [0, 1, 2, 3]
    assert engine.stats.scheduler["free_blocks"] == 64
    assert engine.stats.requests_failed == 1


async def _collect(engine: Engine, request_id: str, prompt: list[int], n: int) -> list[TokenEvent]:
    stream = engine.submit(request_id, prompt, SamplingParams(max_new_tokens=n))
    out: list[TokenEvent] = []
    async for events in stream:
        out.extend(events)
    return out


def test_threaded_engine_with_asyncio_streams() -> None:
    engine = Engine(MockBackend(50, 0), SchedulerConfig(total_kv_blocks=256))
    engine.start()
    try:

        async def main() -> list[list[TokenEvent]]:
            jobs = [_collect(engine, f"r{i}", p, 5 + i) for i, p in enumerate(prompts(20))]
            return await asyncio.gather(*jobs)

        results = asyncio.run(main())
        for i, events in enumerate(results):
            assert [e.index for e in events] == list(range(5 + i))
            assert events[-1].finished and events[-1].finish_reason == "length"
            assert not any(e.finished for e in events[:-1])
        assert wait_for(lambda: engine.stats.scheduler["free_blocks"] == 256)
    finally:
        engine.shutdown()
    assert not engine.running


def test_duplicate_and_rejected_arrive_as_events() -> None:
    engine = Engine(MockBackend(1000, 0), SchedulerConfig(total_kv_blocks=8, kv_block_size=4))
    engine.start()
    try:

        async def main() -> tuple[list[TokenEvent], list[TokenEvent], list[TokenEvent]]:
            long = engine.submit("x", [1, 2], SamplingParams(max_new_tokens=20))
            first = await long.get()
            dup = await engine.submit("x", [1, 2], SamplingParams(max_new_tokens=2)).get()
            huge = await engine.submit("y", [1] * 40, SamplingParams(max_new_tokens=2)).get()
            long.abort()
            return first, dup, huge

        first, dup, huge = asyncio.run(main())
        assert first[0].token_id is not None
        assert dup[0].finish_reason == "rejected" and dup[0].error_type == "DuplicateRequest"
        assert huge[0].finish_reason == "rejected" and "KV" in (huge[0].error or "")
        assert wait_for(lambda: engine.stats.scheduler["free_blocks"] == 8)
        assert wait_for(lambda: engine.stats.requests_aborted == 1)
    finally:
        engine.shutdown()


def test_shutdown_ends_live_requests_with_abort() -> None:
    engine = Engine(MockBackend(1000, 0), SchedulerConfig())
    engine.start()

    async def main() -> list[TokenEvent]:
        stream = engine.submit("long", [1, 2, 3], SamplingParams(max_new_tokens=50_000))
        events = await stream.get()
        # Joining the engine thread blocks, so do it off the loop.
        await asyncio.to_thread(engine.shutdown)
        async for more in stream:
            events.extend(more)
        return events

    events = asyncio.run(main())
    assert events[-1].finished and events[-1].finish_reason == "abort"
    assert engine.stats.scheduler["free_blocks"] == engine.config.total_kv_blocks


class _RecordingCondition(threading.Condition):
    """The engine's condition, recording how its thread waits: an untimed wait parks it
    until a notify; a timed one would be a polling loop."""

    def __init__(self) -> None:
        super().__init__(threading.Lock())
        self.timeouts: list[float | None] = []
        self.parked = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        self.timeouts.append(timeout)
        if timeout is None:
            self.parked.set()
        return super().wait(timeout)


def test_idle_engine_uses_no_cpu_and_wakes_for_work() -> None:
    """An idle engine thread sleeps (no busy polling, no empty steps), and a request that
    arrives later still gets served at once."""
    engine = Engine(fast_mock(), SchedulerConfig())
    cond = _RecordingCondition()
    engine._cond = cond  # before start: every use of the condition goes through this one
    engine.start()
    try:
        assert cond.parked.wait(10), "the idle engine thread never parked"
        steps = engine.backend.steps  # type: ignore[attr-defined]
        cpu = time.process_time()
        beat = engine.heartbeat  # stamped once per loop iteration
        # Parked in an untimed wait: it cannot iterate, step or spend CPU until notified,
        # and it never waited with a timeout (a poll) on the way there.
        assert cond.timeouts and all(t is None for t in cond.timeouts), cond.timeouts
        assert time.process_time() - cpu < 0.1
        assert engine.heartbeat == beat and engine.idle
        assert engine.backend.steps == steps  # type: ignore[attr-defined]

        async def main() -> list[TokenEvent]:
            events: list[TokenEvent] = []
            async for batch in engine.submit("late", [1, 2, 3], SamplingParams(max_new_tokens=3)):
                events.extend(batch)
            return events

        events = asyncio.run(main())
        assert [e.index for e in events if e.token_id is not None] == [0, 1, 2]
        assert events[-1].finish_reason == "length"
    finally:
        engine.shutdown()


def test_batching_raises_throughput_with_concurrency() -> None:
    """A decode step costs the same for 1 or 32 sequences: tok/s must grow with batch."""
    latency_us = 2000.0

    def tokens_per_sec(concurrency: int) -> float:
        llm = LLM(backend=MockBackend(latency_us, 0))
        started = time.perf_counter()
        outs = llm.generate(prompts(concurrency), SamplingParams(max_new_tokens=20))
        elapsed = time.perf_counter() - started
        return sum(len(o.token_ids) for o in outs) / elapsed

    one = tokens_per_sec(1)
    many = tokens_per_sec(32)
    assert one < 1e6 / latency_us * 1.05  # one sequence: at most one token per step
    assert many > 8 * one, (one, many)


def test_mock_prefill_cost_scales_with_prompt_tokens() -> None:
    backend = MockBackend(token_latency_us=100, prefill_token_latency_us=10)

    class FakeBatch:
        num_seqs = 2
        num_tokens = 2 + 500

    assert backend.step_seconds(FakeBatch()) == pytest.approx(100e-6 + 500 * 10e-6)  # type: ignore[arg-type]


def test_mock_tokens_in_vocab() -> None:
    backend = MockBackend(0, 0, vocab_size=50)
    llm = LLM(backend=backend)
    out = llm.generate(prompts(4), SamplingParams(max_new_tokens=50))
    ids = np.array([t for o in out for t in o.token_ids])
    assert ids.min() >= 0 and ids.max() < 50
    assert len(set(ids.tolist())) > 10  # not a constant


def test_run_steps_on_the_calling_thread_until_another_thread_shuts_it_down() -> None:
    # How the server drives it: the loop on the thread that loaded the model, the asyncio
    # loop (and the shutdown) on another.
    backend = fast_mock()
    stepping: set[str] = set()
    execute = backend.execute

    def recording(batch: object) -> object:
        stepping.add(threading.current_thread().name)
        return execute(batch)  # type: ignore[arg-type]

    backend.execute = recording  # type: ignore[method-assign]
    engine = Engine(backend, SchedulerConfig())
    got: dict[str, object] = {}

    def client() -> None:
        async def consume() -> list[TokenEvent]:
            events: list[TokenEvent] = []
            async for batch in engine.submit("r", [1, 2, 3], SamplingParams(max_new_tokens=4)):
                events.extend(batch)
            return events

        try:
            got["running"] = engine.running
            got["events"] = asyncio.run(consume())
        finally:
            engine.shutdown()

    other = threading.Thread(target=client, name="client")
    engine.run(ready=other.start)
    other.join(10)
    events = got["events"]
    assert isinstance(events, list)
    assert [e.token_id is not None for e in events] == [True] * 4
    assert events[-1].finished and events[-1].finish_reason == "length"
    assert got["running"] is True
    assert stepping == {threading.current_thread().name}
    assert engine.started and not engine.running
    with pytest.raises(RuntimeError, match="already started"):
        engine.run()


def test_engine_step_is_for_unthreaded_engines_only() -> None:
    engine = Engine(fast_mock(), SchedulerConfig())
    engine.start()
    try:
        with pytest.raises(RuntimeError):
            engine.step()
    finally:
        engine.shutdown()
    assert not engine.running
    assert "iron-batch-engine" not in {t.name for t in threading.enumerate()}
    # Without a thread, step() is the way to drive it.
    sync = Engine(fast_mock(), SchedulerConfig())
    sync.add_request("r", [1, 2], SamplingParams(max_new_tokens=2))
    events = [e for _ in range(10) if sync.has_unfinished() for e in sync.step()]
    assert [e.token_id is not None for e in events] == [True, True]
    assert events[-1].finished
