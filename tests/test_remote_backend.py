"""The remote backend: scheduler here, model in a ``python -m iron_batch.worker`` subprocess.

Workers listen on 127.0.0.1 port 0 (they print the port they got) and are killed by the
fixtures. Nothing sleeps a fixed time: every wait polls a condition against a deadline.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from conftest import wait_for
from iron_batch import Engine, SamplingParams, Scheduler, SchedulerConfig, TokenEvent, wire
from iron_batch.backends.mock import MockBackend
from iron_batch.backends.remote import RemoteBackend, RemoteBackendError
from iron_batch.batch import batch_arrays
from iron_batch.wire import Kind

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class WorkerProcess:
    """A worker subprocess; ``start`` waits for its "listening on" line."""

    def __init__(self, *args: str) -> None:
        self.args = list(args)
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self._log = tempfile.TemporaryFile()

    def start(self, port: int = 0, timeout: float = 30.0) -> WorkerProcess:
        env = dict(os.environ, PYTHONPATH=os.path.join(_ROOT, "python"))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "iron_batch.worker", "--addr", f"127.0.0.1:{port}",
             *self.args],
            stdout=subprocess.PIPE, stderr=self._log, env=env,
        )
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        out = b""
        while b"\n" not in out:
            left = deadline - time.monotonic()
            if left <= 0 or self.proc.poll() is not None:
                self._log.seek(0)
                raise AssertionError(f"worker did not start: {out!r} {self._log.read()!r}")
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                out += os.read(fd, 4096)
        self.port = int(out.split(b"\n")[0].rsplit(b":", 1)[1])
        return self

    @property
    def url(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def worker_factory() -> Iterator[list[WorkerProcess]]:
    started: list[WorkerProcess] = []
    yield started
    for w in started:
        w.kill()


def _mock_worker(started: list[WorkerProcess], *extra: str) -> WorkerProcess:
    w = WorkerProcess("--backend", "mock", "--mock-token-latency-us", "0",
                      "--mock-prefill-token-latency-us", "0", "--total-kv-blocks", "40",
                      "--kv-block-size", "4", *extra)
    started.append(w)
    return w.start()


def _config(
    be: RemoteBackend | None = None, blocks: int = 40, block_size: int = 4
) -> SchedulerConfig:
    if be is not None:
        blocks, block_size = be.num_kv_blocks, be.kv_block_size
    return SchedulerConfig(total_kv_blocks=blocks, kv_block_size=block_size,
                           max_batch_tokens=64, max_running_seqs=8,
                           max_model_len=None if be is None else be.max_model_len)


def _requests(seed: int, n: int, vocab: int = 300) -> list[tuple[list[int], int]]:
    rng = np.random.default_rng(seed)
    return [
        (rng.integers(3, vocab, size=int(rng.integers(1, 20))).tolist(), int(rng.integers(1, 25)))
        for _ in range(n)
    ]


def _drive(
    engine: Engine,
    reqs: list[tuple[list[int], int]],
    params: SamplingParams | None = None,
    prefix: str = "r",
) -> tuple[dict[str, list[int]], list[TokenEvent]]:
    """Run the engine on the caller's thread until every request ended."""
    base = params or SamplingParams(ignore_eos=True)
    for i, (prompt, max_new) in enumerate(reqs):
        p = SamplingParams(**{**base.__dict__, "max_new_tokens": max_new})
        engine.add_request(f"{prefix}{i}", prompt, p)
    tokens: dict[str, list[int]] = {f"{prefix}{i}": [] for i in range(len(reqs))}
    ends: list[TokenEvent] = []
    deadline = time.monotonic() + 30
    while engine.has_unfinished():
        assert time.monotonic() < deadline, "engine made no progress"
        for ev in engine.step():
            if ev.token_id is not None:
                tokens[ev.request_id].append(ev.token_id)
            if ev.finished:
                ends.append(ev)
    return tokens, ends


def _assert_all_blocks_free(engine: Engine) -> None:
    stats = engine.scheduler.stats()
    assert stats["free_blocks"] == stats["total_blocks"]
    assert stats["running"] == 0 and stats["waiting"] == 0
    engine.scheduler.check_invariants()


# ---------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("k", [1, 4])
def test_mock_worker_matches_in_process_with_preemption(
    worker_factory: list[WorkerProcess], k: int
) -> None:
    w = _mock_worker(worker_factory)
    reqs = _requests(1, 12)
    ref, _ = _drive(Engine(MockBackend(0, 0), _config()), reqs)
    be = RemoteBackend(w.url, steps_per_call=k)
    engine = Engine(be, _config(be))
    got, ends = _drive(engine, reqs)
    assert got == ref
    assert all(e.error is None for e in ends)
    assert engine.scheduler.stats()["preemptions"] > 0
    _assert_all_blocks_free(engine)


def test_lookahead_honours_stop_tokens_found_mid_call(worker_factory: list[WorkerProcess]) -> None:
    w = _mock_worker(worker_factory)
    reqs = [(p, 20) for p, _ in _requests(2, 6)]
    ref, _ = _drive(Engine(MockBackend(0, 0), _config()), reqs)
    # Stop at each request's third token: inside the first 4-token call for most of them.
    stops = sorted({toks[2] for toks in ref.values()})
    params = SamplingParams(ignore_eos=True, stop_token_ids=stops)
    expected, _ = _drive(Engine(MockBackend(0, 0), _config()), reqs, params)
    be = RemoteBackend(w.url, steps_per_call=4)
    engine = Engine(be, _config(be))
    got, _ = _drive(engine, reqs, params)
    assert got == expected
    assert all(len(t) <= 3 for t in got.values())
    _assert_all_blocks_free(engine)


@pytest.fixture(scope="module")
def torch_checkpoint() -> str:
    pytest.importorskip("torch")
    from tiny_models import checkpoint

    return str(checkpoint("llama"))


@pytest.mark.parametrize("k", [1, 4])
def test_torch_worker_matches_in_process_torch(
    worker_factory: list[WorkerProcess], torch_checkpoint: str, k: int
) -> None:
    from tiny_models import backend, random_prompts, run_scheduler

    w = WorkerProcess("--model", torch_checkpoint, "--device", "cpu", "--dtype", "float32",
                      "--total-kv-blocks", "18", "--kv-block-size", "4")
    worker_factory.append(w)
    w.start()
    prompts = random_prompts(40, [9, 14, 6, 11, 17, 8])
    max_new = [14, 10, 16, 12, 9, 15]
    ref, _ = run_scheduler(backend("llama"), prompts, max_new)
    be = RemoteBackend(w.url, steps_per_call=k)
    assert (be.num_kv_blocks, be.kv_block_size, be.vocab_size) == (18, 4, 320)
    assert be.tokenizer is not None and be.eos_token_ids == [2]
    engine = Engine(be, _config(be))
    got, ends = _drive(engine, list(zip(prompts, max_new, strict=True)))
    assert [got[f"r{i}"] for i in range(len(prompts))] == ref
    assert all(e.error is None for e in ends)
    assert engine.scheduler.stats()["preemptions"] > 0
    _assert_all_blocks_free(engine)


@pytest.mark.parametrize("depth", [None, 1])
def test_speculation_through_a_worker_gives_the_local_tokens(
    worker_factory: list[WorkerProcess], torch_checkpoint: str, depth: int | None
) -> None:
    """Prompt lookup in the server's scheduler, proposals verified on the worker: the
    greedy tokens of a local run without speculation, the proposals and acceptances of a
    local run with it, and the accepted tokens' logprobs; every block free after. With
    fewer sequences than a step proposes for, the engine's own choice keeps no step in
    flight; with one in flight by request, nothing is proposed and the tokens are the
    same."""
    from tiny_models import backend

    w = WorkerProcess("--model", torch_checkpoint, "--device", "cpu", "--dtype", "float32",
                      "--total-kv-blocks", "64", "--kv-block-size", "4")
    worker_factory.append(w)
    w.start()
    prompts = []
    for i in range(4):
        phrase = [(7 * i + 3 * j + 5) % 300 for j in range(5 + i)]
        prompts.append(phrase * 3 + phrase[:2])
    reqs = [(p, 24) for p in prompts]
    params = SamplingParams(ignore_eos=True, logprobs=2)
    spec = {"num_speculative_tokens": 4}

    def local(**extra: int) -> tuple[dict[str, list[int]], Engine]:
        cfg = SchedulerConfig(total_kv_blocks=64, kv_block_size=4, max_batch_tokens=64,
                              max_running_seqs=8, **extra)
        engine = Engine(backend("llama"), cfg, overlap_depth=0)
        return _drive(engine, reqs, params)[0], engine

    want, _ = local()
    ref, ref_engine = local(**spec)
    assert ref == want
    be = RemoteBackend(w.url)
    assert be.speculative_methods == ("ngram",)  # no draft model on this worker
    cfg = _config(be)
    cfg.num_speculative_tokens = 4
    engine = Engine(be, cfg, overlap_depth=depth)
    events: list[TokenEvent] = []
    for i, (prompt, n) in enumerate(reqs):
        engine.add_request(f"r{i}", prompt, SamplingParams(**{**params.__dict__,
                                                                "max_new_tokens": n}))
    deadline = time.monotonic() + 60
    while engine.has_unfinished():
        assert time.monotonic() < deadline, "engine made no progress"
        events.extend(engine.step())
    got = {f"r{i}": [e.token_id for e in events if e.request_id == f"r{i}"
                     and e.token_id is not None] for i in range(len(reqs))}
    assert all(e.error is None for e in events)
    assert got == want
    stats, ref_stats = engine.scheduler.stats(), ref_engine.scheduler.stats()
    counts = (stats["spec_drafted_tokens"], stats["spec_accepted_tokens"])
    if depth is None:  # no step in flight: the same steps as the local run
        assert counts == (ref_stats["spec_drafted_tokens"], ref_stats["spec_accepted_tokens"])
        assert counts[1] > 0
    else:
        assert counts == (0, 0)
    assert all(e.logprobs is not None for e in events if e.token_id is not None)
    _assert_all_blocks_free(engine)


def test_speculation_over_a_worker_overlaps_steps_while_too_many_run_to_propose(
    worker_factory: list[WorkerProcess], torch_checkpoint: str
) -> None:
    """Prompt lookup over a worker with 12 sequences: while 8 or more run (no step takes
    proposals then) the engine keeps steps in flight, as without speculation; once fewer
    run it drains them and proposes. The greedy tokens are those of a local run without
    speculation, and every block is free after."""
    from tiny_models import backend

    w = WorkerProcess("--model", torch_checkpoint, "--device", "cpu", "--dtype", "float32",
                      "--total-kv-blocks", "200", "--kv-block-size", "4")
    worker_factory.append(w)
    w.start()
    reqs = []
    for i in range(12):
        phrase = [(5 * i + 3 * j + 7) % 300 for j in range(4 + i % 5)]
        reqs.append((phrase * 3 + phrase[:2], 12 + 3 * i))

    def config(**extra: int) -> SchedulerConfig:
        return SchedulerConfig(total_kv_blocks=200, kv_block_size=4, max_batch_tokens=256,
                               max_running_seqs=12, **extra)

    want, _ = _drive(Engine(backend("llama"), config(), overlap_depth=0), reqs)
    be = RemoteBackend(w.url)
    steps: list[tuple[int, int, int]] = []  # (placeholders, proposals, sequences running)
    submit = be.submit

    def watched(batch: Any) -> Any:
        steps.append((len(batch.pending_token_indices), int(batch.num_proposed.sum()),
                      engine.scheduler.num_running))
        return submit(batch)

    be.submit = watched  # type: ignore[method-assign]
    engine = Engine(be, config(num_speculative_tokens=4))
    got, ends = _drive(engine, reqs)
    assert got == want
    assert all(e.error is None for e in ends)
    overlapped = [s for s in steps if s[0] > 0]
    proposing = [s for s in steps if s[1] > 0]
    assert overlapped and all(s[2] >= 8 for s in overlapped)
    assert proposing and all(s[2] < 8 for s in proposing)
    assert engine.scheduler.stats()["spec_accepted_tokens"] > 0
    _assert_all_blocks_free(engine)


@pytest.mark.parametrize("draft", ["itself", "other"])
def test_a_worker_with_a_draft_model_drafts_for_its_server(
    worker_factory: list[WorkerProcess], torch_checkpoint: str, draft: str
) -> None:
    """``--speculative-model`` on the worker: the server's scheduler reserves the proposal
    rows, the worker's draft fills them and its model verifies them. Greedy tokens are
    those of a local run without speculation, the proposals and acceptances those of a
    local run with the same draft; logprobs come with every token; every block is free
    after. A model drafting for itself is right every time, another one mostly not."""
    from iron_batch.backends.torch_backend import TorchBackend
    from tiny_models import random_prompts, variant_checkpoint

    path = torch_checkpoint if draft == "itself" else str(
        variant_checkpoint("llama", (("num_hidden_layers", 1),)))
    geometry = ("--device", "cpu", "--dtype", "float32", "--total-kv-blocks", "20",
                "--kv-block-size", "4")
    w = WorkerProcess("--model", torch_checkpoint, *geometry, "--speculative-model", path)
    worker_factory.append(w)
    w.start()
    reqs = list(zip(random_prompts(43, [9, 14, 6, 11, 17]), [20, 14, 18, 12, 16],
                    strict=True))
    params = SamplingParams(ignore_eos=True, logprobs=1)

    def local(**spec: int | str) -> tuple[dict[str, list[int]], dict[str, int]]:
        be = TorchBackend.from_model(torch_checkpoint, device="cpu", dtype="float32",
                                     total_kv_blocks=20, kv_block_size=4,
                                     speculative_model=path if spec else None)
        engine = Engine(be, SchedulerConfig(total_kv_blocks=20, kv_block_size=4,
                                            max_batch_tokens=64, max_running_seqs=8,
                                            **spec))
        got, ends = _drive(engine, reqs, params)
        assert all(e.error is None for e in ends)
        return got, engine.scheduler.stats()

    spec = {"num_speculative_tokens": 3, "speculative_method": "draft"}
    want, _ = local()
    _, ref_stats = local(**spec)
    be = RemoteBackend(w.url)
    # The worker's draft fills every proposal row: prompt lookup's would be overwritten.
    assert be.speculative_methods == ("draft",)
    lookup = _config(be)
    lookup.num_speculative_tokens = 3
    with pytest.raises(ValueError, match="fills every proposal row"):
        Engine(be, lookup)
    cfg = _config(be)
    cfg.num_speculative_tokens, cfg.speculative_method = 3, "draft"
    engine = Engine(be, cfg)
    got, ends = _drive(engine, reqs, params)
    assert got == want
    assert all(e.error is None for e in ends)
    stats = engine.scheduler.stats()
    counts = (stats["spec_drafted_tokens"], stats["spec_accepted_tokens"])
    assert counts == (ref_stats["spec_drafted_tokens"], ref_stats["spec_accepted_tokens"])
    assert counts[0] > 0
    if draft == "itself":
        assert counts[1] == counts[0]
    else:
        assert counts[1] < counts[0]
    assert stats["preemptions"] > 0
    _assert_all_blocks_free(engine)


def test_a_draft_method_the_worker_cannot_run_is_refused_in_one_line(
    worker_factory: list[WorkerProcess],
) -> None:
    """``--speculative-method draft`` against a worker started without a draft model: the
    server exits with a usage error naming the worker and the flag it needs."""
    w = _mock_worker(worker_factory)
    result = subprocess.run(
        [sys.executable, "-m", "iron_batch.server", "--addr", "127.0.0.1:0", "--backend",
         "remote", "--backend-url", w.url, "--speculative-method", "draft"],
        capture_output=True, text=True, timeout=60,
        env=dict(os.environ, PYTHONPATH=os.path.join(_ROOT, "python")),
    )
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert w.url in last and "--speculative-model" in last, result.stderr
    assert "Traceback" not in result.stderr


def test_a_gemma_worker_gives_the_server_its_cache_groups(
    worker_factory: list[WorkerProcess]
) -> None:
    """A model with sliding and global layers on a worker: the server's scheduler keeps the
    worker's two cache groups (releasing sliding blocks), and the tokens stay exact."""
    pytest.importorskip("torch")
    from iron_batch.backends.build import scheduler_config
    from tiny_models import checkpoint, hf_greedy, random_prompts

    w = WorkerProcess("--model", str(checkpoint("gemma2")), "--device", "cpu", "--dtype",
                      "float32", "--total-kv-blocks", "64", "--kv-block-size", "4")
    worker_factory.append(w)
    w.start()
    be = RemoteBackend(w.url)
    assert [(g.kind, g.size, g.window) for g in be.cache_groups] == [
        ("full", 64, None), ("sliding", 64, 24)]
    cfg = scheduler_config(be, max_batch_tokens=16, max_running_seqs=8)
    engine = Engine(be, cfg)
    prompts = random_prompts(42, [40, 9, 31])
    got, ends = _drive(engine, [(p, 20) for p in prompts])
    assert [got[f"r{i}"] for i in range(len(prompts))] == [hf_greedy("gemma2", p, 20)
                                                           for p in prompts]
    assert all(e.error is None for e in ends)
    assert engine.scheduler.stats()["sliding_blocks_released"] > 0
    assert [g["used"] for g in engine.scheduler.group_stats()] == [0, 0]


@pytest.mark.parametrize("depth", [0, 2])
def test_overlapped_torch_worker_keeps_seeds_and_penalties_exact(
    worker_factory: list[WorkerProcess], torch_checkpoint: str, depth: int
) -> None:
    """Several steps in flight on a slow link: the worker fills the placeholders in and
    samples with the request's own seed and penalty counts, as in process."""
    from tiny_models import backend, random_prompts

    w = WorkerProcess("--model", torch_checkpoint, "--device", "cpu", "--dtype", "float32",
                      "--total-kv-blocks", "18", "--kv-block-size", "4", "--delay-ms", "1")
    worker_factory.append(w)
    w.start()
    reqs = list(zip(random_prompts(41, [9, 14, 6, 11, 17, 8]), [14, 10, 16, 12, 9, 15],
                    strict=True))
    params = SamplingParams(temperature=0.8, seed=5, repetition_penalty=1.3,
                            presence_penalty=0.5, ignore_eos=True)
    local = backend("llama")
    ref, _ = _drive(Engine(local, _config(None, 256, 4), overlap_depth=0), reqs, params)
    be = RemoteBackend(w.url)
    engine = Engine(be, _config(be), overlap_depth=depth)
    got, ends = _drive(engine, reqs, params)
    assert got == ref
    assert all(e.error is None for e in ends)
    assert engine.scheduler.stats()["preemptions"] > 0
    _assert_all_blocks_free(engine)


@pytest.mark.parametrize("depth", [1, 2])
def test_overlapped_torch_worker_carries_logprobs_and_prompt_logprobs(
    worker_factory: list[WorkerProcess], torch_checkpoint: str, depth: int
) -> None:
    """With steps in flight each RESULT still carries its own step's logprobs, and prompt
    logprobs arrive with a request's first token, as in process without overlap."""
    from tiny_models import backend, random_prompts

    w = WorkerProcess("--model", torch_checkpoint, "--device", "cpu", "--dtype", "float32",
                      "--total-kv-blocks", "18", "--kv-block-size", "4", "--delay-ms", "1")
    worker_factory.append(w)
    w.start()
    prompts = random_prompts(43, [9, 14, 6, 11])
    params = [SamplingParams(max_new_tokens=8, ignore_eos=True, logprobs=2),
              SamplingParams(max_new_tokens=8, ignore_eos=True, prompt_logprobs=1),
              SamplingParams(max_new_tokens=8, ignore_eos=True, logprobs=0, prompt_logprobs=0),
              SamplingParams(max_new_tokens=8, ignore_eos=True)]

    def run(engine: Engine) -> dict[str, list[TokenEvent]]:
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            engine.add_request(f"r{i}", prompt, p)
        out: dict[str, list[TokenEvent]] = {}
        deadline = time.monotonic() + 60
        while engine.has_unfinished():
            assert time.monotonic() < deadline, "engine made no progress"
            for ev in engine.step():
                out.setdefault(ev.request_id, []).append(ev)
        return out

    ref = run(Engine(backend("llama"), _config(None, 256, 4), overlap_depth=0))
    be = RemoteBackend(w.url)
    engine = Engine(be, _config(be), overlap_depth=depth)
    got = run(engine)
    assert engine.scheduler.stats()["preemptions"] > 0
    _assert_all_blocks_free(engine)
    for rid, want in ref.items():
        have = got[rid]
        assert [e.token_id for e in have] == [e.token_id for e in want]
        for g, r in zip(have, want, strict=True):
            assert (g.logprobs is None) == (r.logprobs is None), rid
            if r.logprobs is not None and g.logprobs is not None:
                assert g.logprobs[0] == pytest.approx(r.logprobs[0], abs=1e-4)
                assert [t for t, _ in g.logprobs[1]] == [t for t, _ in r.logprobs[1]]
            assert (g.prompt_logprobs is None) == (r.prompt_logprobs is None), rid
            if r.prompt_logprobs is not None and g.prompt_logprobs is not None:
                assert g.index == 0 and len(g.prompt_logprobs) == len(r.prompt_logprobs)
                for a, b in zip(g.prompt_logprobs[1:], r.prompt_logprobs[1:], strict=True):
                    assert a is not None and b is not None
                    assert a[0] == pytest.approx(b[0], abs=1e-4)
    assert got["r1"][0].prompt_logprobs is not None and got["r0"][0].logprobs is not None


def test_overlapped_mock_worker_honours_stop_tokens(worker_factory: list[WorkerProcess]) -> None:
    w = _mock_worker(worker_factory, "--delay-ms", "1")
    reqs = [(p, 20) for p, _ in _requests(3, 8)]
    ref, _ = _drive(Engine(MockBackend(0, 0), _config(), overlap_depth=0), reqs)
    stops = sorted({toks[2] for toks in ref.values()})
    params = SamplingParams(ignore_eos=True, stop_token_ids=stops)
    expected, _ = _drive(Engine(MockBackend(0, 0), _config(), overlap_depth=0), reqs, params)
    for depth in (None, 1, 2):
        be = RemoteBackend(w.url)
        engine = Engine(be, _config(be), overlap_depth=depth)
        # A remote step runs on the worker while the engine schedules: one in flight by
        # default.
        assert engine.overlap_depth == (depth or 1)
        got, _ = _drive(engine, reqs, params, prefix=f"d{depth}-")
        assert list(got.values()) == list(expected.values())
        assert all(len(t) <= 3 for t in got.values())
        _assert_all_blocks_free(engine)
        be.close()


# ---------------------------------------------------------------------------- bad frames


def _hello(sock: socket.socket, key: str | None = None) -> tuple[Kind, dict[str, object]]:
    wire.write_json(sock, Kind.HELLO, {"protocol": wire.PROTOCOL, "api_key": key})
    kind, body = wire.read_frame(sock, wire.MAX_BODY)
    return kind, json.loads(bytes(body)) if kind == Kind.INFO else {"error": bytes(body)}


def _execute_arrays() -> tuple[list[np.ndarray], np.ndarray]:
    """A real two-request prefill batch from the scheduler, as EXECUTE arrays."""
    s = Scheduler(_config())
    s.add_request("a", [5, 6, 7], 4)
    s.add_request("b", [8, 9], 4)
    b = s.schedule()
    return [np.array(a) for a in batch_arrays(b)], np.array([1, 2], dtype=np.int64)


def _send_execute(sock: socket.socket, arrays: list[np.ndarray], handles: np.ndarray,
                  steps: int = 1) -> tuple[Kind, bytearray]:
    # Built by hand rather than by encode_execute, which would fix the dtypes we break.
    empty = np.zeros(0, dtype=np.int64)
    seqs = np.arange(len(arrays[4]), dtype=np.int64)
    rest = [handles, empty, empty, empty, empty, np.frombuffer(b"[]", dtype=np.uint8), seqs]
    parts: list[bytes | memoryview] = [struct.pack("<II", steps, len(arrays) + len(rest))]
    for a in [*arrays, *rest]:
        parts.extend(wire.encode_array(a))
    wire.write_frame(sock, Kind.EXECUTE, parts)
    return wire.read_frame(sock, wire.MAX_BODY)


def test_malformed_frames_are_rejected_and_the_worker_keeps_serving(
    worker_factory: list[WorkerProcess],
) -> None:
    w = _mock_worker(worker_factory)
    addr = ("127.0.0.1", w.port)
    with socket.create_connection(addr, timeout=10) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\n\r\n")  # bad magic: error reply, then hang up
        kind, body = wire.read_frame(sock, wire.MAX_BODY)
        assert kind == Kind.ERROR and b"bad magic" in body
    with socket.create_connection(addr, timeout=10) as sock:
        sock.sendall(wire.pack_header(Kind.HELLO, 10**9))  # huge length before auth
        kind, body = wire.read_frame(sock, wire.MAX_BODY)
        assert kind == Kind.ERROR and b"exceeds" in body
    with socket.create_connection(addr, timeout=10) as sock:
        assert _hello(sock)[0] == Kind.INFO
        good, handles = _execute_arrays()

        def rejected(arrays: list[np.ndarray], steps: int = 1) -> bytes:
            kind, body = _send_execute(sock, arrays, handles, steps)
            assert kind == Kind.ERROR, body
            return bytes(body)

        bad = list(good)
        bad[0] = good[0].astype(np.int32)  # wrong dtype
        assert b"dtype" in rejected(bad)
        bad = list(good)
        bad[6] = good[6].copy()
        bad[6][0, 0] = 40  # block id beyond the worker's 40 blocks
        assert b"block id out of range" in rejected(bad)
        bad = list(good)
        bad[2] = good[2].copy()
        bad[2][0] = -1  # negative slot
        assert b"slot out of range" in rejected(bad)
        bad = list(good)
        bad[5] = good[5][:1]  # num_computed_before shape
        assert b"differ in length" in rejected(bad)
        bad = list(good)
        bad[9] = np.array([5, 1], dtype=np.int32)  # more steps than the call asks for
        assert b"sample_max_steps" in rejected(bad)
        # Lengths that overrun the body, trailing bytes, unknown dtype code.
        parts = wire.encode_execute(1, good, handles, [], [])
        body_bytes = b"".join(bytes(p) for p in parts)
        for broken in (body_bytes[:-8], body_bytes + b"\0" * 8,
                       body_bytes[:8] + b"\x09" + body_bytes[9:]):
            wire.write_frame(sock, Kind.EXECUTE, [broken])
            kind, _ = wire.read_frame(sock, wire.MAX_BODY)
            assert kind == Kind.ERROR
        wire.write_json(sock, Kind.HELLO, {})  # wrong kind mid-session
        assert wire.read_frame(sock, wire.MAX_BODY)[0] == Kind.ERROR
        # The same connection still runs a good batch.
        kind, body = _send_execute(sock, good, handles)
        assert kind == Kind.RESULT
        assert wire.decode_result(body, 2, 1, 32000)[0].shape == (2, 1)
    # And new clients are served as before.
    be = RemoteBackend(w.url)
    engine = Engine(be, _config(be))
    got, _ = _drive(engine, _requests(3, 3))
    assert all(got.values())


def test_api_key_guards_the_worker(worker_factory: list[WorkerProcess]) -> None:
    w = _mock_worker(worker_factory, "--api-key", "s3cret")
    with socket.create_connection(("127.0.0.1", w.port), timeout=10) as sock:
        kind, reply = _hello(sock, "wrong")
        assert kind == Kind.ERROR and b"invalid api key" in reply["error"]  # type: ignore[operator]
    with pytest.raises(ConnectionRefusedError, match="invalid api key"):
        RemoteBackend(w.url, api_key="nope")
    be = RemoteBackend(w.url, api_key="s3cret")
    got, _ = _drive(Engine(be, _config(be)), _requests(4, 2))
    assert all(got.values())


# ---------------------------------------------------------------------------- faults


def test_worker_killed_mid_run_fails_requests_then_recovers(
    worker_factory: list[WorkerProcess],
) -> None:
    w = _mock_worker(worker_factory)
    be = RemoteBackend(w.url, steps_per_call=2, timeout=10)
    engine = Engine(be, _config(be))
    reqs = [(p, 24) for p, _ in _requests(5, 6)]
    for i, (prompt, max_new) in enumerate(reqs):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_new_tokens=max_new,
                                                            ignore_eos=True))
    seen = 0
    while seen < 10:  # some tokens out, every request still running
        seen += sum(ev.token_id is not None for ev in engine.step())
    w.kill()
    events = wait_for(engine.step, what="the failure events")
    failed = {ev.request_id for ev in events if ev.finish_reason == "error"}
    assert failed == {f"r{i}" for i in range(len(reqs))}
    assert all("worker" in (ev.error or "") for ev in events)
    assert not engine.has_unfinished()
    _assert_all_blocks_free(engine)

    w.start(port=w.port)  # same address: the server reconnects on its own
    fresh = _requests(6, 4)
    ref, _ = _drive(Engine(MockBackend(0, 0), _config()), fresh, prefix="n")
    got, ends = _drive(engine, fresh, prefix="n")
    assert got == ref and all(e.error is None for e in ends)
    assert be.reconnects == 1
    _assert_all_blocks_free(engine)


def test_hung_worker_times_out_and_is_used_again(worker_factory: list[WorkerProcess]) -> None:
    w = _mock_worker(worker_factory)
    be = RemoteBackend(w.url, timeout=0.5)
    engine = Engine(be, _config(be))
    engine.add_request("h", [5, 6, 7], SamplingParams(max_new_tokens=8))
    engine.step()
    assert w.proc is not None
    pid = w.proc.pid
    os.kill(pid, signal.SIGSTOP)

    def stopped() -> bool:  # the signal lands asynchronously
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "T"

    try:
        wait_for(stopped, what="the worker to stop")
        started = time.monotonic()
        # (With overlap, a reply that was already on its way still commits first.)
        events = wait_for(lambda: [e for e in engine.step() if e.finished], what="the timeout")
        assert time.monotonic() - started < 5
        assert [ev.finish_reason for ev in events] == ["error"]
        assert "no answer within" in (events[0].error or "")
        _assert_all_blocks_free(engine)
    finally:
        os.kill(pid, signal.SIGCONT)
    got, ends = _drive(engine, _requests(7, 3))
    assert all(got.values()) and all(e.error is None for e in ends)


def test_garbage_reply_fails_the_batch_not_the_server() -> None:
    info = {"model_name": "fake", "num_kv_blocks": 40, "kv_block_size": 4,
            "max_model_len": None, "eos_token_ids": [], "vocab_size": 1000}
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def fake_worker() -> None:
        conn, _ = listener.accept()
        with conn:
            wire.read_frame(conn, wire.MAX_BODY)
            wire.write_json(conn, Kind.INFO, info)
            wire.read_frame(conn, wire.MAX_BODY)
            # A result of the wrong shape, then noise.
            wire.write_frame(conn, Kind.RESULT, wire.encode_result(np.zeros((7, 3))))
            conn.sendall(b"\xff" * 64)

    thread = threading.Thread(target=fake_worker, daemon=True)
    thread.start()
    try:
        be = RemoteBackend(f"127.0.0.1:{port}", timeout=5)
        engine = Engine(be, _config(be))
        engine.add_request("g", [5, 6], SamplingParams(max_new_tokens=3))
        engine.add_request("g2", [7], SamplingParams(max_new_tokens=3))
        events = wait_for(engine.step, what="the reply")  # a first step only submits
        assert {ev.request_id for ev in events} == {"g", "g2"}
        assert all("garbage reply" in (ev.error or "") for ev in events)
        _assert_all_blocks_free(engine)
    finally:
        listener.close()
        thread.join(5)
    # The fake worker is gone for good: the next batch fails cleanly too, nothing hangs.
    engine.add_request("g3", [8], SamplingParams(max_new_tokens=1))
    (ev,) = engine.step()
    assert ev.finish_reason == "error" and "cannot reach worker" in (ev.error or "")


def test_bad_url_and_unreachable_worker() -> None:
    with pytest.raises(ValueError):
        RemoteBackend("no-port-here")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ConnectionError):
        RemoteBackend(f"127.0.0.1:{port}", timeout=2)
    assert issubclass(RemoteBackendError, RuntimeError)


def test_server_cli_drives_a_worker_with_the_original_flags(
    worker_factory: list[WorkerProcess],
) -> None:
    """`python -m iron_batch.server --backend real --backend-url URL`, end to end over HTTP:
    the server sizes its pool from the worker and streams the same tokens the in-process
    mock gives."""
    import httpx
    from conftest import free_port

    w = _mock_worker(worker_factory)
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "iron_batch.server", "--addr", f"127.0.0.1:{port}",
         "--backend", "real", "--backend-url", w.url, "--steps-per-call", "4"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        env=dict(os.environ, PYTHONPATH=os.path.join(_ROOT, "python")),
    )
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        if proc.poll() is not None:
            raise AssertionError(proc.stdout.read() if proc.stdout else b"")
        try:
            return httpx.get(f"{url}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(up, 30, "server /health")
        prompt = [5, 6, 7, 8, 9]
        r = httpx.post(f"{url}/generate",
                       json={"prompt_token_ids": prompt, "max_new_tokens": 10}, timeout=30)
        assert r.status_code == 200
        lines = [json.loads(x) for x in r.text.splitlines()]
        assert [x["token_index"] for x in lines] == list(range(10))
        assert lines[-1]["done"] and lines[-1]["finish_reason"] == "length"

        local = Engine(MockBackend(token_latency_us=0, prefill_token_latency_us=0),
                       _config())
        local.add_request("x", prompt, SamplingParams(max_new_tokens=10))
        want = []
        while local.has_unfinished():
            want += [e.token_id for e in local.step() if e.token_id is not None]
        assert [x["token_id"] for x in lines] == want

        metrics = httpx.get(f"{url}/metrics").json()
        assert metrics["kv_blocks_total"] == 40  # the worker's pool, not the default 4096
        assert metrics["kv_blocks_free"] == 40
        too_big = httpx.post(f"{url}/generate",
                             json={"prompt_tokens": 150, "max_new_tokens": 20}, timeout=30)
        assert too_big.status_code == 400
    finally:
        proc.terminate()
        proc.wait(timeout=20)


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--total-kv-blocks", "-5"), ("--kv-block-size", "0"), ("--delay-ms", "nan"),
     ("--addr", "nohost")],
)
def test_worker_rejects_bad_flags_before_listening(flag: str, value: str) -> None:
    """A worker with a nonsense pool or delay must not start serving it."""
    result = subprocess.run(
        [sys.executable, "-m", "iron_batch.worker", "--backend", "mock", flag, value],
        capture_output=True, text=True, timeout=60,
        env=dict(os.environ, PYTHONPATH=os.path.join(_ROOT, "python")),
    )
    assert result.returncode == 2
    assert flag in result.stderr and "Traceback" not in result.stderr
    assert "listening" not in result.stdout
