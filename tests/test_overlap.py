"""Overlapped steps (submit -> wait with the next step scheduled in between) give exactly
the tokens of sequential steps: greedy equal to transformers on every family, under
preemption, prefix hits and chunked prefill; sampling settings (seeds, penalties) and
logprobs equal to a run without overlap; stop strings, stop tokens and aborts leave no
block behind."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
import torch  # noqa: F401 - these tests must fail, not skip, without torch
from iron_batch import Engine, SamplingParams, SchedulerConfig, TokenEvent
from iron_batch.backends.base import BackendInfo
from iron_batch.backends.mock import MockBackend
from tiny_models import FAMILIES, backend, hf_greedy, random_prompts, run_scheduler

FAMILY_NAMES = list(FAMILIES)


def _expected(name: str, prompts: list[list[int]], max_new: list[int]) -> list[list[int]]:
    return [hf_greedy(name, p, n) for p, n in zip(prompts, max_new, strict=True)]


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_overlapped_greedy_matches_transformers_under_preemption_and_chunking(
    name: str,
) -> None:
    prompts = random_prompts(60, [9, 14, 6, 11, 17, 8, 30, 5])
    max_new = [14, 3, 9, 1, 12, 7, 10, 11]
    holes: list[int] = []

    def on_step(batch: Any) -> None:
        holes.append(len(batch.pending_token_indices))

    # 12 blocks of 4 and 7 tokens per step: preemption and chunked prefill both happen (in
    # a sliding group too, which holds at most a window and a chunk of each sequence).
    outs, stats = run_scheduler(
        backend(name), prompts, max_new, total_kv_blocks=12, max_batch_tokens=7,
        overlap_depth=1, on_step=on_step,
    )
    assert stats["preemptions"] > 0
    assert max(holes) > 1, "steps really ran on placeholders"
    assert outs == _expected(name, prompts, max_new)


@pytest.mark.parametrize("depth", [1, 2])
def test_overlapped_prefix_hits_match_transformers(depth: int) -> None:
    name = "qwen3"
    prefix = random_prompts(30, [37])[0]
    prompts = [prefix + s for s in random_prompts(31, [3, 5, 1, 9, 4, 2])]
    be = backend(name)
    run_scheduler(be, prompts[:1], 10, overlap_depth=depth)  # fills the cache
    outs, stats = run_scheduler(be, prompts, 10, max_running_seqs=2, overlap_depth=depth)
    assert stats["prefix_cache_hit_tokens"] > 0
    assert outs == _expected(name, prompts, [10] * len(prompts))


def test_a_stop_token_ends_the_request_and_its_wasted_row_leaks_nothing() -> None:
    name = "llama"
    prompts = random_prompts(70, [5, 8, 12])
    free_run = [hf_greedy(name, p, 12) for p in prompts]
    stop = free_run[1][4]
    outs, _ = run_scheduler(
        backend(name), prompts, 12, overlap_depth=1, stop_token_ids=[stop]
    )
    for got, full in zip(outs, free_run, strict=True):
        want = full[: full.index(stop) + 1] if stop in full else full
        assert got == want
    assert outs[1][-1] == stop and len(outs[1]) <= 5


# ------------------------------------------------------------------- through the engine


def _engine_run(
    be: Any, prompts: list[list[int]], params: list[SamplingParams], depth: int,
    **config: Any,
) -> tuple[list[TokenEvent], Engine]:
    cfg = SchedulerConfig(
        total_kv_blocks=config.pop("total_kv_blocks", be.num_kv_blocks or 256),
        kv_block_size=be.kv_block_size or 4,
        **config,
    )
    engine = Engine(be, cfg, overlap_depth=depth)
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"r{i}", p, sp)
    events: list[TokenEvent] = []
    while engine.has_unfinished():
        events.extend(engine.step())
    assert engine.scheduler.num_free_blocks == cfg.total_kv_blocks
    engine.scheduler.check_invariants()
    return events, engine


def _by_request(events: list[TokenEvent]) -> dict[str, tuple[list[int], str | None, str]]:
    out: dict[str, tuple[list[int], str | None, str]] = {}
    for e in events:
        toks, reason, text = out.get(e.request_id, ([], None, ""))
        assert reason is None, f"event after the end of {e.request_id}"
        if e.token_id is not None:
            toks = [*toks, e.token_id]
        out[e.request_id] = (toks, e.finish_reason if e.finished else None, text + (e.text or ""))
    return out


def test_seeds_penalties_and_logprobs_are_the_same_with_overlap() -> None:
    be = backend("mistral")
    prompts = random_prompts(80, [6, 11, 4, 9, 15, 7])
    params = [
        SamplingParams(max_new_tokens=16, temperature=0.9, seed=7),
        SamplingParams(max_new_tokens=16, repetition_penalty=1.6),
        SamplingParams(max_new_tokens=16, temperature=0.7, seed=3, presence_penalty=1.0,
                       frequency_penalty=0.5, top_k=40),
        SamplingParams(max_new_tokens=16, logprobs=3),
        SamplingParams(max_new_tokens=16, temperature=1.0, seed=11, top_p=0.8,
                       repetition_penalty=1.3, logprobs=2),
        SamplingParams(max_new_tokens=16),
    ]
    # A small pool: preempted requests resume with their penalty counts and seeds intact.
    runs = [_engine_run(be, prompts, params, depth, total_kv_blocks=14)
            for depth in (0, 1, 2)]
    assert runs[0][1].stats.scheduler["preemptions"] > 0
    reference = runs[0][0]
    ref_lp = [(e.request_id, e.token_id, e.logprobs) for e in reference if e.token_id is not None]
    for events, _ in runs[1:]:
        assert _by_request(events) == _by_request(reference)
        got_lp = [(e.request_id, e.token_id, e.logprobs) for e in events
                  if e.token_id is not None]
        # Per request, in order. Batches differ in shape with overlap (a stopped request's
        # wasted row), so float sums may differ in the last bits: values agree to 1e-5.
        for rid in {r for r, _, _ in ref_lp}:
            want = [(t, lp) for r, t, lp in ref_lp if r == rid]
            got = [(t, lp) for r, t, lp in got_lp if r == rid]
            assert [t for t, _ in got] == [t for t, _ in want]
            for (_, g), (_, w) in zip(got, want, strict=True):
                assert (g is None) == (w is None)
                if g is not None and w is not None:
                    assert g[0] == pytest.approx(w[0], abs=1e-5)
                    assert [i for i, _ in g[1]] == [i for i, _ in w[1]]
                    assert [v for _, v in g[1]] == pytest.approx([v for _, v in w[1]], abs=1e-5)
    with_lp = [e for e in reference if e.request_id == "r3" and e.token_id is not None]
    assert all(e.logprobs is not None and len(e.logprobs[1]) == 3 for e in with_lp)


def test_stop_strings_end_requests_alike_with_overlap() -> None:
    be = backend("qwen2")
    prompts = random_prompts(90, [5, 7, 9, 4])
    free = _by_request(_engine_run(be, prompts, [SamplingParams(max_new_tokens=20)] * 4, 0)[0])
    # A stop string out of the middle of each free-running text.
    params = [SamplingParams(max_new_tokens=20, stop=[free[f"r{i}"][2][6:8]])
              for i in range(4)]
    seq = _by_request(_engine_run(be, prompts, params, 0)[0])
    assert all(reason == "stop" for _, reason, _ in seq.values())
    for depth in (1, 2):
        assert _by_request(_engine_run(be, prompts, params, depth)[0]) == seq


class _ExecuteOnly:
    """A third-party backend that implements only the old ``execute`` seam (no
    BackendBase): the engine must still drive it, overlapped or not."""

    max_model_len = None
    tokenizer = None
    model_name = "execute-only"
    steps_per_call = 1
    num_kv_blocks = None
    kv_block_size = None

    def __init__(self) -> None:
        self.inner = MockBackend(0, 0)
        self.eos_token_ids: list[int] = []
        self.vocab_size = self.inner.vocab_size

    def add_request(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        self.inner.add_request(request_id, prompt, params)

    def remove_request(self, request_id: str) -> None:
        self.inner.remove_request(request_id)

    def execute(self, batch: Any) -> np.ndarray:
        # The mock's token depends on the input token: an unfilled placeholder shows.
        return self.inner.execute(batch)

    def describe(self) -> BackendInfo:
        return BackendInfo(kind="execute-only")


def test_a_backend_with_only_execute_runs_overlapped_with_the_same_tokens() -> None:
    prompts = random_prompts(100, [3, 8, 5, 13, 2])
    params = [SamplingParams(max_new_tokens=n) for n in (9, 1, 14, 6, 11)]
    ref = _by_request(_engine_run(MockBackend(0, 0), prompts, params, 0)[0])
    got = _by_request(_engine_run(_ExecuteOnly(), prompts, params, 1, total_kv_blocks=12)[0])
    assert got == ref


def test_an_abort_with_steps_in_flight_frees_every_block() -> None:
    engine = Engine(MockBackend(0, 0), SchedulerConfig(total_kv_blocks=64, kv_block_size=4),
                    overlap_depth=2)
    for i in range(4):
        engine.add_request(f"r{i}", [1, 2, 3, 4, 5], SamplingParams(max_new_tokens=50))
    events: list[TokenEvent] = []
    for _ in range(5):
        events.extend(engine.step())
    assert engine.scheduler.num_open_steps == 2
    engine.abort("r1")
    engine.abort("r2")
    while engine.has_unfinished():
        events.extend(engine.step())
    ends = {e.request_id: e.finish_reason for e in events if e.finished}
    assert ends == {"r0": "length", "r1": "abort", "r2": "abort", "r3": "length"}
    got = _by_request(events)
    assert len(got["r0"][0]) == 50 and len(got["r1"][0]) < 50
    assert engine.scheduler.num_free_blocks == 64


# ------------------------------------------------ overlap with the other request features


def test_prompt_logprobs_and_priorities_are_the_same_with_overlap() -> None:
    """Prompt logprobs are scored at submit and handed out with the first token, whatever
    the number of steps in flight; priorities reorder the queue, never a token."""
    be = backend("llama")
    prompts = random_prompts(95, [6, 13, 9, 4, 11])
    params = [
        SamplingParams(max_new_tokens=10, prompt_logprobs=2, priority=1),
        SamplingParams(max_new_tokens=10, priority=-1),
        SamplingParams(max_new_tokens=10, prompt_logprobs=0, logprobs=1),
        SamplingParams(max_new_tokens=10, priority=2),
        SamplingParams(max_new_tokens=10, prompt_logprobs=1, priority=-3),
    ]
    runs = [_engine_run(be, prompts, params, depth, total_kv_blocks=12, max_batch_tokens=8)
            for depth in (0, 1, 2)]
    assert runs[0][1].stats.scheduler["preemptions"] > 0

    def scored(events: list[TokenEvent]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for e in events:
            if e.prompt_logprobs is not None:
                assert e.index == 0 and e.token_id is not None
                assert e.request_id not in out
                out[e.request_id] = e.prompt_logprobs
        return out

    reference = scored(runs[0][0])
    assert sorted(reference) == ["r0", "r2", "r4"]
    for rid, entries in reference.items():
        i = int(rid[1:])
        assert len(entries) == len(prompts[i]) and entries[0] is None
        assert all(e is not None for e in entries[1:])
    for events, _ in runs[1:]:
        assert _by_request(events) == _by_request(runs[0][0])
        got = scored(events)
        assert sorted(got) == sorted(reference)
        for rid, want in reference.items():
            for g, w in zip(got[rid][1:], want[1:], strict=True):
                assert g[0] == pytest.approx(w[0], abs=1e-5)
                assert [t for t, _ in g[1]] == [t for t, _ in w[1]]


def test_grammars_hold_and_match_sequential_steps_with_overlap() -> None:
    """A matcher advances once per sampled token; with steps in flight every token sampled
    for a live request is still committed (preempted ones included), so constrained output
    is the same as without overlap and always matches."""
    import re

    from iron_batch.backends.torch_backend import TorchBackend
    from iron_batch.structured import choice_grammar, regex_grammar

    be = TorchBackend.from_model("smollm2-135m", device="cpu", total_kv_blocks=64,
                                 kv_block_size=4)
    tok = be.tokenizer
    assert tok is not None and be.supports_structured_output
    texts = ["The year was", "Pick one colour:", "My phone number is", "Hello"]
    prompts = [tok.encode(t) for t in texts]
    params = [
        SamplingParams(max_new_tokens=12, grammar=regex_grammar("[0-9]{4}")),
        SamplingParams(max_new_tokens=12, grammar=choice_grammar(["red", "green", "blue"]),
                       temperature=1.0, seed=5),
        SamplingParams(max_new_tokens=16, grammar=regex_grammar("[0-9]{3}-[0-9]{4}")),
        SamplingParams(max_new_tokens=12, priority=-1),
    ]
    # A pool of 5 blocks of 4: constrained requests are preempted with tokens in flight.
    done = [_engine_run(be, prompts, params, depth, total_kv_blocks=5) for depth in (0, 1, 2)]
    assert all(engine.stats.scheduler["preemptions"] > 0 for _, engine in done)
    runs = [_by_request(events) for events, _ in done]
    assert runs[1] == runs[0] and runs[2] == runs[0]
    text = {rid: tok.decode(toks) for rid, (toks, _, _) in runs[0].items()}
    assert re.fullmatch(r"[0-9]{4}", text["r0"])
    assert text["r1"] in ("red", "green", "blue")
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", text["r2"])


def test_tensor_parallel_broadcasts_placeholders_filled_in(monkeypatch: Any) -> None:
    """The TP backend's ``_logits`` hook sees the inputs with placeholders filled in (a
    device tensor of input ids): the other ranks get them as host arrays."""
    import threading

    from iron_batch.parallel import backend as tp
    from iron_batch.parallel.step_broadcast import Message

    sent: list[dict[str, Any]] = []
    forwarded: list[dict[str, Any]] = []

    class Model:
        def forward(self, **inputs: Any) -> torch.Tensor:
            forwarded.append(inputs)
            return torch.zeros(1, 4)

    be = tp.TensorParallelTorchBackend.__new__(tp.TensorParallelTorchBackend)
    be._failure = None
    be._local_ranks = []
    be._lock = threading.Lock()
    be.group = object()
    be.model = Model()
    monkeypatch.setattr(tp.step_broadcast, "send",
                        lambda group, kind, inputs: sent.append(inputs) if kind
                        == Message.STEP else None)
    ids = torch.tensor([5, 7, 9])
    be._logits({"input_ids": ids, "positions": np.arange(3)})
    assert isinstance(sent[0]["input_ids"], np.ndarray)
    assert sent[0]["input_ids"].tolist() == [5, 7, 9]
    assert forwarded[0]["input_ids"].tolist() == [5, 7, 9]


# ------------------------------------------------------ the default follows the backend


def _first_token_step(engine: Engine, prompt: list[int], new: int) -> tuple[int, list[int]]:
    """(the number of the step() call that returned the request's first token, its tokens)."""
    engine.add_request("r", prompt, SamplingParams(max_new_tokens=new, ignore_eos=True))
    steps, first, tokens = 0, 0, []
    while engine.has_unfinished():
        steps += 1
        for event in engine.step():
            if event.token_id is not None:
                tokens.append(event.token_id)
                first = first or steps
    return first, tokens


def test_a_cpu_backend_hands_each_token_out_from_the_step_that_computed_it() -> None:
    """On CPU the torch backend runs a step when it is submitted, so by default the engine
    keeps none in flight: the first token comes out of the prefill step itself, not a step
    later, with the same tokens as with a step in flight (asked for explicitly)."""
    prompt = random_prompts(61, [7])[0]
    be = backend("llama")
    assert be.asynchronous_submit is False
    default = Engine(be, SchedulerConfig(total_kv_blocks=64, kv_block_size=4))
    assert default.overlap_depth == 0
    first, tokens = _first_token_step(default, prompt, 5)
    in_flight = Engine(be, SchedulerConfig(total_kv_blocks=64, kv_block_size=4),
                       overlap_depth=1)
    first_overlapped, overlapped = _first_token_step(in_flight, prompt, 5)
    assert (first, first_overlapped) == (1, 2)
    assert tokens == overlapped == hf_greedy("llama", prompt, 5)


def test_the_mock_backend_runs_its_steps_when_submitted_too() -> None:
    engine = Engine(MockBackend(0, 0), SchedulerConfig(total_kv_blocks=16, kv_block_size=4))
    assert engine.overlap_depth == 0
    assert _first_token_step(engine, [1, 2, 3], 3)[0] == 1


class _FarBackend(MockBackend):
    """The mock behind a round trip: ``submit`` sends the step (its tokens are known at
    once) and returns; the result arrives ``latency_s`` later, as from a worker across a
    network, whatever else the engine does meanwhile."""

    asynchronous_submit = True

    def __init__(self, latency_s: float) -> None:
        super().__init__(0, 0)
        self.latency_s = latency_s

    def submit(self, batch: Any) -> Any:
        return (super().submit(batch), time.monotonic() + self.latency_s)

    def wait(self, handle: Any) -> Any:
        output, ready = handle
        time.sleep(max(0.0, ready - time.monotonic()))  # the round trip
        return output


def test_the_engine_keeps_more_steps_in_flight_over_a_long_round_trip() -> None:
    prompts = random_prompts(102, [5, 9])
    params = [SamplingParams(max_new_tokens=150, ignore_eos=True) for _ in prompts]
    ref = _by_request(_engine_run(MockBackend(0, 0), prompts, params, 0)[0])
    # Each result arrives 3 ms after its step is sent: with one step in flight the engine
    # waits most of each step; each step deeper raises the step rate, so the engine takes
    # it (overlap_depth None: its own choice).
    events, engine = _engine_run(_FarBackend(0.003), prompts, params, None)  # type: ignore[arg-type]
    assert _by_request(events) == ref
    assert engine.overlap_depth >= 2
    stats = engine.scheduler.stats()
    assert stats["free_blocks"] == stats["total_blocks"]
    # A backend whose submit runs the step to the end gets none in flight, and keeps none.
    events, engine = _engine_run(MockBackend(0, 0), prompts, params, None)  # type: ignore[arg-type]
    assert _by_request(events) == ref and engine.overlap_depth == 0
