"""The engine: one thread that turns requests into tokens by stepping the Rust scheduler.

One step: drain pending adds/aborts -> ``scheduler.schedule()`` -> ``backend.submit(batch)``
-> ``backend.wait`` -> ``scheduler.commit(batch, sampled)`` -> hand the step's token events
to each asyncio loop in a single ``call_soon_threadsafe``. The commit's events come as
columns (:class:`iron_batch.StepEvents`); the engine finds each event's request by its
scheduler handle in a list, and makes no Python object per event beyond the
:class:`TokenEvent` its stream gets.

Overlap (``overlap_depth`` >= 1, the default for a backend whose ``submit`` returns before
the step is done: ``asynchronous_submit``): the engine keeps steps in flight on the backend.
By default it starts at one and goes deeper (up to ``MAX_AUTO_OVERLAP_DEPTH``) while it
spends a share of its time waiting for results and each step deeper measurably raises the
step rate: a remote worker whose round trip is longer than a step needs two or three in
flight to stay busy. While step N runs it schedules step N+1 (decodes whose input is N's
token, not known yet, get a placeholder that the backend fills in on its side), submits it,
then waits for N, commits it and publishes its tokens. So the device (or a remote worker)
always has the next step queued while Python commits, detokenizes and publishes, and a
remote round trip overlaps the worker's compute. A sequence that stops in step N wastes its
row in N+1; the scheduler frees its blocks at N's commit and ignores the row.
``overlap_depth = 0`` runs the steps one after another (``--no-overlap``), the default for
a backend whose ``submit`` runs the step to the end (the torch backend on CPU, the mock):
there a step in flight hides nothing and only hands every token out one step later (a
request's first token too: SmolLM2 on CPU with 32 requests running, 98 against 67 ms).
Lookahead (``steps_per_call`` > 1) never overlaps. Only the engine thread touches the
scheduler and the backend, so neither needs locks; the rest of the world talks to it
through the inbox.

Three ways to drive it:
- ``start()`` runs the step loop on a background thread; ``submit()`` (called on an asyncio
  loop) returns a :class:`RequestStream` of events. The thread sleeps on a condition when
  there is nothing to do, so an idle engine costs no CPU.
- ``run()`` runs the same loop on the calling thread until ``shutdown()`` is called from
  another one; the asyncio loop then lives on that other thread. The server steps the model
  on its main thread this way (``server/cli.py``): the thread that loaded the model keeps
  its OpenMP team, and the model's large temporaries come from glibc's main arena, whose
  settings (``platform/heap.py``) keep them in the heap. Any other thread allocates from an
  arena of its own, where a block above 64 MiB is mapped and faulted in again at every step.
- Without either, ``add_request()`` + ``step()`` run everything on the caller's thread
  (the offline :class:`iron_batch.llm.LLM` does this).
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import gc
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from iron_batch._core import (
    FINISH_REASONS,
    IronBatchError,
    Scheduler,
    SchedulerConfig,
    StepEvents,
)
from iron_batch.backends.base import BackendError, ExecuteOnly, FatalBackendError, StepOutput
from iron_batch.platform.openmp import release_thread_pool
from iron_batch.sampling_params import SamplingParams
from iron_batch.stats import EngineStats
from iron_batch.stream import Logprobs, PromptLogprobs, RequestStream, TokenEvent, deliver

__all__ = ["DEFAULT_MAX_STREAM_BUFFER_EVENTS", "Engine", "EngineUnavailable", "RequestStream",
           "TokenEvent"]

if TYPE_CHECKING:
    from iron_batch.backends.base import Backend

logger = logging.getLogger(__name__)

#: The output of an empty step (nothing sampled).
_NOTHING = StepOutput(np.empty(0, dtype=np.int64))

#: Default bound on the events one :class:`RequestStream` holds for a consumer that does not
#: keep up (a client that stopped reading); past it the request is aborted.
DEFAULT_MAX_STREAM_BUFFER_EVENTS = 4096



#: The most steps in flight the engine keeps by itself (``overlap_depth=None``).
MAX_AUTO_OVERLAP_DEPTH = 4


class _DepthTuner:
    """Picks the steps kept in flight on an asynchronous backend (a remote worker, a
    device stream): one more while the engine spends a share of its time waiting for
    results and the deeper pipeline raises the step rate; back when a step deeper did not,
    trying again only after ``cooldown`` windows (the workload may have changed). A round
    trip longer than a step (a worker over a network) needs more than one step in flight
    to keep the worker busy.

    Measured over windows of ``window`` steps whose wait the pipeline's depth decided: a
    window broken by a drained pipeline (no work) starts over."""

    def __init__(self, depth: int, window: int = 16, waiting_share: float = 0.2,
                 gain: float = 1.05, cooldown: int = 8) -> None:
        self.depth = depth
        self.window = window
        self.waiting_share = waiting_share
        self.gain = gain
        self.cooldown = cooldown
        self._rest = 0  # windows to wait before the next trial
        self._trial: tuple[int, float] | None = None  # (depth before, its step rate)
        self._start()

    def _start(self) -> None:
        self._began = time.perf_counter()
        self._steps = 0
        self._waited = 0.0

    def interrupted(self) -> None:
        self._start()

    def waited(self, seconds: float) -> int:
        """One step's wait; returns the depth to keep from now on."""
        self._waited += seconds
        self._steps += 1
        if self._steps < self.window:
            return self.depth
        elapsed = time.perf_counter() - self._began
        rate = self._steps / elapsed
        waiting = self._waited > self.waiting_share * elapsed
        self._start()
        if self._trial is not None:
            before, before_rate = self._trial
            self._trial = None
            if rate < before_rate * self.gain:
                self.depth, self._rest = before, self.cooldown
                return self.depth
        if self._rest:
            self._rest -= 1
        elif waiting and self.depth < MAX_AUTO_OVERLAP_DEPTH:
            self._trial = (self.depth, rate)
            self.depth += 1
        return self.depth


class EngineUnavailable(RuntimeError):
    """``submit`` on an engine that is shutting down or has failed fatally."""


# --- inbox commands (any thread -> engine thread) ------------------------------------------


@dataclass(frozen=True)
class _Add:
    req: _Request


@dataclass(frozen=True)
class _Abort:
    """Abort this request object (not a later one that reuses its id)."""

    req: _Request


@dataclass(frozen=True)
class _AbortId:
    request_id: str


@dataclass(frozen=True)
class _AbortAll:
    pass


_Command = _Add | _Abort | _AbortId | _AbortAll


class _Request:
    """Engine-thread state of one live request."""

    __slots__ = (
        "request_id",
        "prompt_token_ids",
        "params",
        "sink",
        "detok",
        "arrival",
        "last_time",
        "num_tokens",
        "num_cached",
        "started",
        "handle",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        sink: RequestStream | None,
        arrival: float,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.sink = sink
        self.detok: Any = None
        self.arrival = arrival
        self.last_time: float | None = None
        self.num_tokens = 0
        # Prefix-cache hits at first admission; None until the scheduler has admitted it.
        self.num_cached: int | None = None
        # First token out (or ended without one): its prompt no longer counts as waiting.
        self.started = False
        # The scheduler's handle (slot) while the request is live there; None before.
        self.handle: int | None = None

    def decode(self, token_id: int, finished: bool) -> tuple[str | None, bool]:
        """The text ``token_id`` completes (None without a tokenizer) and whether it
        completes a stop string (then the text ends before it)."""
        detok = self.detok
        if detok is None:
            return None, False
        text, stop_matched = detok.add(token_id)
        if finished and not stop_matched:
            text += detok.flush()
        return text, stop_matched


@functools.cache
def _unfreeze_at_exit() -> None:
    atexit.register(gc.unfreeze)


class Engine:
    """Continuous batching over one backend; see the module docstring."""

    def __init__(
        self,
        backend: Backend,
        config: SchedulerConfig | None = None,
        *,
        max_consecutive_failures: int = 0,
        max_stream_buffer_events: int = DEFAULT_MAX_STREAM_BUFFER_EVENTS,
        overlap_depth: int | None = None,
    ) -> None:
        """``max_consecutive_failures``: that many failed steps in a row (0: never) are a
        fatal fault, like a :class:`FatalBackendError`: every live request fails, the thread
        stops, ``fatal_error`` says why and ``on_fatal`` is called (the server exits).
        ``max_stream_buffer_events``: see :class:`RequestStream` (0: unbounded).
        ``overlap_depth``: steps kept in flight while the next is scheduled (0: none,
        each step runs to the end before the next is scheduled; None: chosen by the
        engine: 0 for a backend whose ``submit`` runs the step to the end, else from 1 up
        as far as deeper pipelines measurably raise the step rate; see the module
        docstring). With steps in flight nothing is proposed: with speculation on and the
        engine's own choice, it keeps none in flight while a step could take proposals
        (fewer sequences running and waiting, up to ``max_running_seqs``, than
        ``speculative_max_rows``), and overlaps again above that."""
        full = hasattr(backend, "submit")
        overlaps = full and bool(backend.asynchronous_submit)
        if overlap_depth is not None and overlap_depth < 0:
            raise ValueError("overlap_depth must be >= 0")
        self.overlap_depth = (1 if overlaps else 0) if overlap_depth is None else overlap_depth
        self._depth = _DepthTuner(self.overlap_depth) if (
            overlap_depth is None and overlaps) else None
        # A sequence proposes only with no step of its own in flight, and only a step with
        # fewer sequences than this proposes at all: below it (counting those running and
        # waiting) the engine's own choice keeps no step in flight (a remote worker then
        # verifies proposals instead of hiding its round trip). 0: no such switch.
        self._proposal_rows = config.speculative_max_rows if (
            config is not None and config.num_speculative_tokens and self._depth is not None
        ) else 0
        # Steps submitted and not committed, oldest first: (batch, backend handle or None
        # for an empty batch, which is committed in its turn all the same).
        self._inflight: deque[tuple[Any, Any]] = deque()
        self.backend = backend
        steps: Any = backend if full else ExecuteOnly(backend)
        # An object with only ``execute`` (no BackendBase) computes tokens and nothing else.
        self._scores_prompts = full and bool(backend.supports_prompt_logprobs)
        self._embeds = full and bool(backend.supports_embeddings)
        self._submit = steps.submit
        self._wait = steps.wait
        self.config = config if config is not None else SchedulerConfig()
        method = self.config.speculative_method
        if self.config.num_speculative_tokens and method not in getattr(
                backend, "speculative_methods", ()):
            if method == "draft":
                raise ValueError("speculative_method 'draft' needs a backend with a draft "
                                 "model (--speculative-model, on the worker for a remote "
                                 "backend)")
            if "draft" in getattr(backend, "speculative_methods", ()):
                raise ValueError(f"speculative_method {method!r}: this backend runs a draft "
                                 "model, which fills every proposal row; use 'draft'")
            raise ValueError("speculative decoding is not supported by this backend "
                             f"({type(backend).__name__})")
        self.scheduler = Scheduler(self.config)
        self.stats = EngineStats()
        self._refresh_stats()
        self._requests: dict[str, _Request] = {}
        # The live requests by scheduler handle: how a commit's events find their request.
        self._by_handle: list[_Request | None] = []
        self._cond = threading.Condition(threading.Lock())
        self._inbox: list[_Command] = []
        self._stopping = False
        self._thread: threading.Thread | None = None
        # Whether start() made _thread (run() records the caller's thread there instead).
        self._own_thread = False
        self._idle_wake_s: float | None = None
        self._loop_done = threading.Event()
        self._tokenizer = backend.tokenizer
        self._eos = list(backend.eos_token_ids)
        # Liveness for /health: the loop stamps ``heartbeat`` every iteration and sets
        # ``idle`` while it sleeps with nothing to do (then an old stamp is not a stall).
        self.heartbeat = time.monotonic()
        self.idle = True
        # Live requests whose prefix-cache hit count is not captured yet (see _sample_extras).
        self._uncounted: set[str] = set()
        self.max_consecutive_failures = max_consecutive_failures
        self.max_stream_buffer_events = max_stream_buffer_events
        self._failed_steps = 0
        #: Set (once) when the engine stopped on a fatal fault.
        self.fatal_error: str | None = None
        #: Called on the engine thread after a fatal fault's error events are published.
        self.on_fatal: Callable[[str], None] | None = None
        # Prompt tokens of requests queued but not started: written under the lock when
        # added, by the engine thread alone when started; their difference is the backlog.
        self._prompt_tokens_in = 0
        self._prompt_tokens_started = 0
        # What is loaded by now (model, tokenizer, libraries: about a million objects)
        # lives as long as the process: take it out of the cyclic collector's view, whose
        # full passes otherwise walked it in the middle of decode steps (4% of a profile
        # of 64-sequence decoding). Process-wide and cheap to repeat; undone at exit, so
        # that the interpreter's last collection still finalizes those objects.
        gc.freeze()
        _unfreeze_at_exit()

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("engine already started")
        # The backend was built (and maybe warmed up) on this thread; from now on only the
        # engine thread runs it. An OpenMP team left behind here would throttle the engine
        # thread's team (see iron_batch.platform.openmp).
        release_thread_pool()
        self._thread = threading.Thread(target=self._loop, name="iron-batch-engine", daemon=True)
        self._own_thread = True
        self._thread.start()

    def run(self, ready: Callable[[], None] | None = None) -> None:
        """Run the step loop on the calling thread; returns once :meth:`shutdown` was called
        (from another thread) or a fatal fault stopped it. ``submit()`` works as with
        :meth:`start`, from an asyncio loop on another thread. ``ready`` is called once the
        engine counts as started, before the first step (start the other thread there)."""
        with self._cond:
            if self._thread is not None:
                raise RuntimeError("engine already started")
            self._thread = threading.current_thread()
            # A signal that the kernel hands to another thread (an OpenMP worker) does not
            # wake this one from a lock's wait, and Python runs its handlers on the main
            # thread only: an idle loop wakes this often to let them run.
            self._idle_wake_s = 0.2
        if ready is not None:
            ready()
        self._loop()

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Stop the loop and wait for it to end (up to ``timeout`` seconds; not when called
        on the loop's own thread); live requests end with finish_reason "abort"."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is None or self._thread is threading.current_thread():
            return
        if self._own_thread:
            self._thread.join(timeout)
        else:
            self._loop_done.wait(timeout)

    @property
    def started(self) -> bool:
        """Whether :meth:`start` or :meth:`run` was called (the loop may have ended since)."""
        return self._thread is not None

    @property
    def running(self) -> bool:
        return self._thread is not None and not self._loop_done.is_set()

    @property
    def num_waiting_requests(self) -> int:
        """Requests waiting for admission: the scheduler's waiting queue as of the last step
        plus those still in the inbox (a snapshot for soft caps)."""
        with self._cond:
            queued = sum(isinstance(c, _Add) for c in self._inbox)
        return self.stats.scheduler.get("waiting", 0) + queued

    @property
    def waiting_prompt_tokens(self) -> int:
        """Prompt tokens of requests submitted that have not produced a token yet."""
        return self._prompt_tokens_in - self._prompt_tokens_started

    # ------------------------------------------------------------------ requests in

    def _enqueue(self, item: _Command) -> None:
        with self._cond:
            if isinstance(item, _Add):
                if self._stopping and self._thread is not None:
                    # Checked under the lock: past this point nobody drains the inbox.
                    raise EngineUnavailable(
                        f"engine failed: {self.fatal_error}" if self.fatal_error
                        else "engine is shut down"
                    )
                self._prompt_tokens_in += len(item.req.prompt_token_ids)
            self._inbox.append(item)
            self._cond.notify()

    def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
    ) -> RequestStream:
        """Queue a request from an asyncio loop; events arrive on the returned stream.

        Admission errors (request can never fit, duplicate id) arrive as a first event with
        ``finish_reason == "rejected"``.
        """
        if self._stopping:
            raise EngineUnavailable(
                f"engine failed: {self.fatal_error}" if self.fatal_error else "engine is shut down"
            )
        loop = asyncio.get_running_loop()
        req = _Request(request_id, prompt_token_ids, params, None, time.perf_counter())
        stream = RequestStream(
            request_id, loop, self.max_stream_buffer_events, lambda: self._enqueue(_Abort(req))
        )
        req.sink = stream
        self._enqueue(_Add(req))
        return stream

    def add_request(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> None:
        """Queue a request for the synchronous API: its events come out of :meth:`step`."""
        req = _Request(request_id, list(prompt_token_ids), params, None, time.perf_counter())
        self._enqueue(_Add(req))

    def abort(self, request_id: str) -> None:
        self._enqueue(_AbortId(request_id))

    def abort_all(self) -> None:
        """Abort every request queued or live now (drain timeout at shutdown)."""
        self._enqueue(_AbortAll())

    def has_unfinished(self) -> bool:
        """Synchronous API: anything queued, live or in flight?"""
        return bool(self._requests) or bool(self._inbox) or bool(self._inflight)

    # ------------------------------------------------------------------ stepping

    def step(self) -> list[TokenEvent]:
        """Run one step on the caller's thread (only when the thread is not started)."""
        if self._thread is not None:
            raise RuntimeError("step() drives the engine synchronously; this one has a thread")
        return [event for _, event in self._step()]

    def _loop(self) -> None:
        try:
            self._run()
        finally:
            self._loop_done.set()

    def _run(self) -> None:
        empty_steps = 0
        busy = False
        while True:
            with self._cond:
                while not self._inbox and not busy and not self._stopping:
                    self.idle = True
                    self._cond.wait(self._idle_wake_s)
                self.idle = False
                self.heartbeat = time.monotonic()
                if self._stopping:
                    break
                if empty_steps > 2:
                    # has_work() but nothing schedulable and nothing to report: should not
                    # last, but never spin a core on it.
                    self._cond.wait(0.001)
            try:
                items = self._step()
            except Exception as exc:  # a scheduler bug must not kill the server
                logger.exception("engine step failed")
                items = self._fail_all(f"engine error: {exc}")
                self._failed_steps += 1
                self._check_fatal(exc, f"engine error: {exc}", items)
            empty_steps = 0 if items or not busy else empty_steps + 1
            if items:
                self._publish(items)
            busy = self.scheduler.has_work() or bool(self._inflight)
        self._publish(self._close())
        if self.fatal_error is not None and self.on_fatal is not None:
            try:
                self.on_fatal(self.fatal_error)
            except Exception:
                logger.exception("on_fatal callback failed")

    def _check_fatal(
        self, exc: BaseException, message: str, out: list[tuple[_Request, TokenEvent]]
    ) -> None:
        """After a failed step: a fatal fault fails everything live and stops the loop."""
        limit = self.max_consecutive_failures
        if not isinstance(exc, FatalBackendError) and not (
            limit > 0 and self._failed_steps >= limit
        ):
            return
        if not isinstance(exc, FatalBackendError):
            message = f"{message} ({self._failed_steps} failed steps in a row)"
        logger.critical("fatal engine fault, stopping: %s", message)
        try:
            self._fail_requests(set(self._requests), message, out)
        except Exception:
            logger.exception("failing requests failed")
        with self._cond:
            self.fatal_error = message
            self._stopping = True

    def _close(self) -> list[tuple[_Request, TokenEvent]]:
        out: list[tuple[_Request, TokenEvent]] = []
        self._collect_inflight()
        with self._cond:
            pending, self._inbox = self._inbox, []
        error = self.fatal_error
        for command in pending:
            if isinstance(command, _Add):
                req = command.req
                self._mark_started(req)
                if error is not None:
                    event = TokenEvent(req.request_id, 0, None, None, True, "error", error)
                else:
                    event = TokenEvent(req.request_id, 0, None, None, True, "abort")
                out.append((req, event))
        for req in list(self._requests.values()):
            try:
                self.scheduler.abort(req.request_id)
            except IronBatchError:
                logger.exception("abort at shutdown failed")
            self._retire(req)
            out.append(
                (req, TokenEvent(req.request_id, req.num_tokens, None, None, True, "abort"))
            )
        self._refresh_stats()
        return out

    def _refresh_stats(self) -> None:
        # Readers on other threads (/metrics, admission) see this snapshot, never the
        # scheduler itself.
        self.stats.scheduler = self.scheduler.stats()
        if self.config.cache_groups:
            self.stats.cache_groups = self.scheduler.group_stats()

    def _publish(self, items: list[tuple[_Request, TokenEvent]]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, TokenEvent]]] = {}
        for req, event in items:
            sink = req.sink
            if sink is None:
                continue
            batch = by_loop.get(sink.loop)
            if batch is None:
                batch = by_loop[sink.loop] = []
            batch.append((sink, event))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(deliver, batch)
            except RuntimeError:
                pass  # the loop is closed: nobody is listening any more

    def _step(self) -> list[tuple[_Request, TokenEvent]]:
        out: list[tuple[_Request, TokenEvent]] = []
        try:
            self._step_into(out)
        finally:
            self._refresh_stats()
        return out

    def _step_into(self, out: list[tuple[_Request, TokenEvent]]) -> None:
        self._drain(out)
        scheduler = self.scheduler
        backend = self.backend
        # A backend that runs several decode steps per call (remote) needs their KV slots
        # reserved now: lookahead = steps_per_call - 1. Those never overlap.
        lookahead = backend.steps_per_call - 1
        depth = self.overlap_depth if lookahead == 0 else 0
        inflight = self._inflight
        # Sequences the next steps may hold: the running ones and those waiting, up to the
        # scheduler's limit.
        proposing = bool(self._proposal_rows) and min(
            scheduler.num_running + scheduler.num_waiting, self.config.max_running_seqs
        ) < self._proposal_rows
        if proposing:
            depth = 0
        # A step that could take proposals is scheduled only over no step in flight (the
        # pipeline drains first).
        if scheduler.has_work() and not (proposing and inflight):
            # Over the steps in flight (a plain schedule also drops any left open by a
            # failed step: nothing is in flight then).
            batch = scheduler.schedule(lookahead=lookahead, overlap=bool(inflight))
            # Readers see admissions (blocks taken) while the backend runs, not a step late.
            self._refresh_stats()
            handle = None
            if batch.num_seqs:
                try:
                    handle = self._submit(batch)
                except Exception as exc:
                    self._backend_failed(exc, batch, out)
                    return
            inflight.append((batch, handle))
        if inflight and (len(inflight) > depth or not scheduler.has_work()):
            tuner = self._depth
            # A wait the pipeline's depth decided (not the end of the work) is a sample for
            # the depth tuner.
            timed = (tuner is not None and not proposing and len(inflight) > depth
                     and scheduler.has_work())
            batch, handle = inflight.popleft()
            if handle is None:
                output = _NOTHING
            else:
                try:
                    started = time.perf_counter()
                    output = self._wait(handle)
                    if tuner is not None:
                        if timed:
                            self.overlap_depth = tuner.waited(time.perf_counter() - started)
                        else:
                            tuner.interrupted()
                except Exception as exc:
                    self._backend_failed(exc, batch, out)
                    return
                self._failed_steps = 0
            extras = self._sample_extras(batch, output) if batch.num_samples else None
            events = scheduler.commit(batch, output.tokens, output.num_accepted)
            if len(events):
                self._on_commit(events, out, extras, output.prompt_logprobs, output.embeddings)

    def _collect_inflight(self) -> set[str]:
        """Wait out every step in flight, ignoring its result (so the backend's replies
        stay in step with its requests); returns the requests they held."""
        ids: set[str] = set()
        while self._inflight:
            batch, handle = self._inflight.popleft()
            ids.update(batch.request_ids)
            if handle is not None:
                try:
                    self._wait(handle)
                except Exception:
                    logger.debug("discarded step failed too", exc_info=True)
        return ids

    def _backend_failed(
        self, exc: Exception, batch: Any, out: list[tuple[_Request, TokenEvent]]
    ) -> None:
        """A step failed in submit or wait: its requests fail, and so do those of every
        other step in flight (their inputs may be its tokens); the scheduler's open steps
        are dropped by the next (plain) schedule."""
        logger.exception("backend step failed")
        self._failed_steps += 1
        ids = set(batch.request_ids) | self._collect_inflight()
        self._fail_requests(ids, f"backend error: {exc}", out)
        if isinstance(exc, BackendError) and exc.invalidates_kv:
            # The backend lost its KV (remote worker gone): every live request and every
            # prefix-cache entry points at KV that no longer exists.
            self._fail_requests(set(self._requests), f"backend error: {exc}", out)
            self.scheduler = Scheduler(self.config)
            self._by_handle = []
        self._check_fatal(exc, f"backend error: {exc}", out)

    def _sample_extras(
        self, batch: Any, output: StepOutput
    ) -> dict[str, list[Logprobs]] | None:
        """Per-request data that must be read before ``commit`` ends requests.

        Captures the prefix-cache hit count of requests sampling for the first time (the
        scheduler only answers for live requests), and maps the backend's per-sample-row
        logprobs to request ids for those that asked (a list: a row that verified
        proposals gives one per accepted token, in order). Not with lookahead: there the
        backend's rows no longer match tokens one to one.
        """
        rids: list[str] = batch.sample_request_ids
        requests = self._requests
        uncounted = self._uncounted
        if uncounted:
            for rid in rids:
                if rid in uncounted:
                    uncounted.discard(rid)
                    req = requests.get(rid)
                    if req is not None:
                        req.num_cached = self.scheduler.num_cached_prompt_tokens(rid)
        rows = output.logprobs
        if np.ndim(output.tokens) != 1 or rows is None or len(rows) != len(output.tokens):
            return None
        counts = (output.num_accepted.tolist() if output.num_accepted is not None
                  else [1] * len(rids))
        if len(counts) != len(rids):
            return None
        wanted: dict[str, list[Logprobs]] = {}
        at = 0
        for rid, n in zip(rids, counts, strict=True):
            req = requests.get(rid)
            if req is not None and req.params.logprobs is not None:
                wanted[rid] = rows[at : at + n]
            at += n
        return wanted

    def _on_commit(
        self,
        events: StepEvents,
        out: list[tuple[_Request, TokenEvent]],
        extras: dict[str, list[Logprobs]] | None = None,
        prompt_logprobs: dict[str, PromptLogprobs] | None = None,
        embeddings: dict[str, np.ndarray] | None = None,
    ) -> None:
        now = time.perf_counter()
        stats = self.stats
        ttft = stats.ttft
        by_handle = self._by_handle
        reasons = FINISH_REASONS
        tokens = 0
        # Requests that also got a token last step share the same gap: count gaps per
        # previous timestamp and observe each distinct one once (one log() per step).
        # Events of requests with the same previous timestamp mostly come in runs.
        gaps: dict[float, int] = {}
        run_last = 0.0
        run = 0
        for handle, token, code in zip(
            events.handles.tolist(), events.token_ids.tolist(),
            events.finish_reasons.tolist(), strict=True,
        ):
            req = by_handle[handle]
            if req is None:
                # Already retired earlier in this step: a stop string matched on one of the
                # request's several lookahead tokens; the rest are discarded.
                continue
            finished = code != 0
            reason = reasons[code]
            index = req.num_tokens
            if token < 0:
                # Ended without a token (max_new_tokens == 0).
                event = TokenEvent(req.request_id, index, None, None, finished, reason)
            else:
                req.num_tokens = index + 1
                tokens += 1
                last = req.last_time
                if last is None:
                    ttft.observe(now - req.arrival)
                    self._mark_started(req)
                elif last == run_last:
                    run += 1
                else:
                    if run:
                        gaps[run_last] = gaps.get(run_last, 0) + run
                    run_last = last
                    run = 1
                req.last_time = now
                text: str | None = None
                if req.detok is not None:
                    text, stop_matched = req.decode(token, finished)
                    if stop_matched:
                        if not finished:
                            # The scheduler only knows token ids; a stop string is ours to
                            # enforce, from this thread, before the next schedule().
                            self.scheduler.finish(req.request_id)
                            finished = True
                        reason = "stop"
                event = TokenEvent(req.request_id, index, token, text, finished, reason)
                if extras:
                    # The request's logprobs in token order (several from a verified run).
                    mine = extras.get(req.request_id)
                    if mine:
                        event.logprobs = mine[0]
                        extras[req.request_id] = mine[1:]
                if index == 0 and prompt_logprobs:
                    event.prompt_logprobs = prompt_logprobs.get(req.request_id)
                if index == 0 and embeddings:
                    event.embedding = embeddings.get(req.request_id)
            if finished:
                stats.requests_completed += 1
                event.num_cached_tokens = req.num_cached or 0
                self._retire(req)
            out.append((req, event))
        if run:
            gaps[run_last] = gaps.get(run_last, 0) + run
        itl = stats.itl
        for last, n in gaps.items():
            itl.observe_many(now - last, n)
        stats.tokens_generated += tokens

    def _drain(self, out: list[tuple[_Request, TokenEvent]]) -> None:
        with self._cond:
            if not self._inbox:
                return
            items, self._inbox = self._inbox, []
        for command in items:
            if isinstance(command, _Add):
                self._admit(command.req, out)
            elif isinstance(command, _Abort):
                target = command.req
                # Only if still live and the same request (not a later one reusing the id).
                if self._requests.get(target.request_id) is target:
                    self._abort(target, out)
            elif isinstance(command, _AbortAll):
                for live in list(self._requests.values()):
                    self._abort(live, out)
            else:
                live = self._requests.get(command.request_id)
                if live is not None:
                    self._abort(live, out)

    def _admit(self, req: _Request, out: list[tuple[_Request, TokenEvent]]) -> None:
        request_id = req.request_id
        params = req.params
        if request_id in self._requests:
            self._reject(req, f"request id {request_id!r} is already live", "DuplicateRequest", out)
            return
        stop_ids = list(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids.extend(self._eos)
        if params.prompt_logprobs is not None and not self._scores_prompts:
            self._reject(req, "prompt logprobs are not supported by this backend",
                         "ValueError", out)
            return
        if params.embed is not None and not self._embeds:
            self._reject(req, "embeddings are not supported by this backend", "ValueError", out)
            return
        try:
            self.backend.add_request(request_id, req.prompt_token_ids, params)
        except (ValueError, TypeError) as exc:
            self._reject(req, str(exc), "ValueError", out)
            return
        try:
            handle = self.scheduler.add_request(
                request_id, req.prompt_token_ids, params.max_new_tokens, stop_ids,
                priority=params.priority, cache_salt=params.cache_salt,
                # A cached block has KV but no logits (nor hidden states): compute the
                # whole prompt to score it or to mean-pool it.
                skip_prefix_cache=params.prompt_logprobs is not None or params.embed == "mean",
                speculate=params.allows_speculation,
            )
        except (IronBatchError, ValueError, TypeError, OverflowError) as exc:
            self.backend.remove_request(request_id)
            self._reject(req, str(exc), type(exc).__name__, out)
            return
        self._requests[request_id] = req
        req.handle = handle
        by_handle = self._by_handle
        if handle >= len(by_handle):
            by_handle.extend([None] * (handle + 1 - len(by_handle)))
        by_handle[handle] = req
        self._uncounted.add(request_id)
        if self._tokenizer is not None:
            from iron_batch.tokenizer import IncrementalDetokenizer

            req.detok = IncrementalDetokenizer(
                self._tokenizer, req.prompt_token_ids, params.stop, params.skip_special_tokens,
                params.keep_special_tokens,
            )

    def _reject(
        self,
        req: _Request,
        message: str,
        error_type: str,
        out: list[tuple[_Request, TokenEvent]],
    ) -> None:
        self._mark_started(req)
        out.append(
            (
                req,
                TokenEvent(req.request_id, 0, None, None, True, "rejected", message, error_type),
            )
        )

    def _abort(self, req: _Request, out: list[tuple[_Request, TokenEvent]]) -> None:
        self.scheduler.abort(req.request_id)
        self.stats.requests_aborted += 1
        self._retire(req)
        out.append(
            (
                req,
                TokenEvent(
                    req.request_id, req.num_tokens, None, None, True, "abort",
                    num_cached_tokens=req.num_cached or 0,
                ),
            )
        )

    def _mark_started(self, req: _Request) -> None:
        if not req.started:
            req.started = True
            self._prompt_tokens_started += len(req.prompt_token_ids)

    def _retire(self, req: _Request) -> None:
        self._mark_started(req)
        self._requests.pop(req.request_id, None)
        handle = req.handle
        if handle is not None:
            req.handle = None
            by_handle = self._by_handle
            if handle < len(by_handle) and by_handle[handle] is req:
                by_handle[handle] = None
        self._uncounted.discard(req.request_id)
        try:
            self.backend.remove_request(req.request_id)
        except Exception:
            logger.exception("backend.remove_request failed")

    def _fail_requests(
        self, request_ids: set[str], message: str, out: list[tuple[_Request, TokenEvent]]
    ) -> None:
        for request_id in request_ids:
            req = self._requests.get(request_id)
            try:
                self.scheduler.abort(request_id)
            except IronBatchError:
                logger.exception("abort after failure failed")
            if req is None:
                continue
            self.stats.requests_failed += 1
            self._retire(req)
            out.append(
                (
                    req,
                    TokenEvent(request_id, req.num_tokens, None, None, True, "error", message),
                )
            )

    def _fail_all(self, message: str) -> list[tuple[_Request, TokenEvent]]:
        out: list[tuple[_Request, TokenEvent]] = []
        try:
            self._collect_inflight()
            self._fail_requests(set(self._requests), message, out)
            self._refresh_stats()
        except Exception:
            logger.exception("failing requests failed")
        return out
