"""``python -m iron_batch.worker``: the model half of a split deployment.

The server keeps the scheduler; this process keeps the model and its KV cache, whose block
ids are the scheduler's. The server connects (persistent TCP, frames of
:mod:`iron_batch.wire`), learns the KV geometry from the INFO reply and sizes its allocator
to match, then sends one EXECUTE per scheduler step: the batch as raw arrays, plus the
requests added and removed since the previous frame (so request bookkeeping costs no round
trip of its own). The worker runs the batch, then up to ``sample_max_steps[r] - 1`` more
decode steps per sampled row, and answers ``[num_samples, K]`` token ids.

One client session at a time: a new authenticated connection takes over (the server
reconnects after a timeout or a network error), and the worker forgets the old session's
requests, because the server starts over with a fresh scheduler then. The KV tensor is not
cleared: a fresh scheduler never reads a slot before writing it.
"""

from __future__ import annotations

import argparse
import hmac
import json
import logging
import os
import queue
import socket
import threading
import time
from typing import Any

import numpy as np

from iron_batch import wire
from iron_batch.backends.base import StepOutput
from iron_batch.batch import ArrayBatch
from iron_batch.platform.openmp import release_thread_pool
from iron_batch.sampling_params import SamplingParams
from iron_batch.wire import ExecuteRequest, Kind, WireError, WorkerLimits

logger = logging.getLogger("iron_batch.worker")

#: Seconds a new connection has to send its hello; a silent stranger must not hold a thread.
HELLO_TIMEOUT_S = 10.0


def run_steps(
    backend: Any, req: ExecuteRequest, block_size: int, previous: np.ndarray | None = None
) -> tuple[np.ndarray, dict[str, Any]]:
    """Run the received batch, then the lookahead decode steps: [num_samples, K] int64
    (a step that verified proposals: each row's accepted tokens, ``num_accepted`` in the
    extras), and the RESULT extras (logprobs of the first step's samples, prompt logprobs of the
    requests whose prompt this batch completed) for requests that asked.

    Placeholders (an overlapped step) are filled in from ``previous``, the first column of
    the previous frame's result, here on the worker: the server never waits for it.

    Step j >= 1 feeds row r's token from step j - 1 at position ``seq_lens[seq] + j - 1``,
    into the slot the scheduler reserved for it in the sequence's block table. Every token
    sampled here goes through the backend's sampler, surplus ones (after a stop the server
    will find) included, so per-request sampling state sees them all; the request ends at
    that stop anyway, so the extra counts are never used.
    """
    rids = [str(h) for h in req.sample_handles.tolist()]
    seq_rids = [str(h) for h in req.seq_handles.tolist()]
    arrays = req.batch()
    holes, rows = arrays.pop("pending_token_indices"), arrays.pop("pending_sample_rows")
    if len(holes):
        if previous is None or int(rows.max()) >= len(previous):
            raise ValueError("placeholders name rows of no previous result")
        arrays["input_ids"][holes] = previous[rows]
    step = backend.wait(backend.submit(ArrayBatch(rids, seq_rids, **arrays)))
    first = step.tokens
    n, k = len(rids), req.steps
    if step.num_accepted is not None:
        # Proposals verified (one step): each row's accepted tokens, left-aligned.
        counts = np.asarray(step.num_accepted, dtype=np.int64)
        out = np.zeros((n, 1 + int(req.num_proposed.max())), dtype=np.int64)
        ends = np.cumsum(counts)
        for r, (end, c) in enumerate(zip(ends.tolist(), counts.tolist(), strict=True)):
            out[r, :c] = first[end - c : end]
        extras = _extras(step, rids, 1, accepted=int(counts.sum()))
        extras["num_accepted"] = counts.tolist()
        return out, extras
    out = np.zeros((n, k), dtype=np.int64)  # unused entries stay 0 (the server ignores them)
    extras = _extras(step, rids, k)
    if n == 0:
        return out, extras
    out[:, 0] = first
    active = np.arange(n)
    prev = np.asarray(first, dtype=np.int64)
    seqs = req.sample_seq_indices
    base = req.seq_lens[seqs].astype(np.int64)
    for j in range(1, k):
        keep = req.sample_max_steps[active] > j
        active, prev = active[keep], prev[keep]
        m = len(active)
        if m == 0:
            break
        pos = base[active] + (j - 1)
        tables = req.block_tables[seqs[active]]
        slots = tables[np.arange(m), pos // block_size].astype(np.int64) * block_size + (
            pos % block_size
        )
        prev = np.asarray(
            backend.execute(
                ArrayBatch(
                    [rids[i] for i in active.tolist()],
                    input_ids=prev,
                    positions=pos,
                    slot_mapping=slots,
                    query_start_loc=np.arange(m + 1, dtype=np.int32),
                    seq_lens=(pos + 1).astype(np.int32),
                    num_computed_before=pos.astype(np.int32),
                    block_tables=tables,
                    sample_indices=np.arange(m, dtype=np.int64),
                    sample_seq_indices=np.arange(m, dtype=np.int64),
                    sample_max_steps=np.ones(m, dtype=np.int32),
                )
            ),
            dtype=np.int64,
        )
        out[active, j] = prev
    return out, extras


def _extras(step: StepOutput, rids: list[str], steps: int,
            accepted: int | None = None) -> dict[str, Any]:
    """``accepted``: a step that verified proposals, with this many accepted tokens (its
    logprobs are one per token)."""
    extras: dict[str, Any] = {}
    rows = step.logprobs if steps == 1 else None
    if rows is not None and len(rows) == (len(rids) if accepted is None else accepted):
        extras["logprobs"] = [None if r is None else [r[0], [list(a) for a in r[1]]]
                              for r in rows]
    if step.prompt_logprobs:
        extras["prompt_logprobs"] = {
            rid: [None if e is None else [e[0], [list(a) for a in e[1]]] for e in entries]
            for rid, entries in step.prompt_logprobs.items()
        }
    return extras


class Worker:
    """Serves one backend to one client session at a time (see the module docstring)."""

    def __init__(
        self,
        backend: Any,
        info: dict[str, Any],
        *,
        api_key: str | None = None,
        delay_s: float = 0.0,
        max_body: int = wire.MAX_BODY,
    ) -> None:
        self.backend = backend
        self.info = info
        self.limits = WorkerLimits(
            num_kv_blocks=int(info["num_kv_blocks"]),
            kv_block_size=int(info["kv_block_size"]),
            vocab_size=int(info["vocab_size"]),
            max_model_len=info["max_model_len"],
            drafts="draft" in info.get("speculative_methods", ()),
        )
        self.api_key = api_key
        self.delay_s = delay_s
        self.max_body = max_body
        # Held while a batch runs and while a session starts: one batch at a time.
        self._lock = threading.Lock()
        self._session = 0
        self._live: set[int] = set()
        # First column of the session's last result: what the next frame's placeholders
        # read. None after an error (a frame that names it then fails too).
        self._previous: np.ndarray | None = None

    # ------------------------------------------------------------------ serving

    def serve(self, listener: socket.socket) -> None:
        # Batches run on connection threads: free this thread's OpenMP team (it loaded the
        # model) so that it does not throttle theirs (see iron_batch.platform.openmp).
        release_thread_pool()
        while True:
            conn, peer = listener.accept()
            threading.Thread(
                target=self._serve_connection, args=(conn, peer), daemon=True,
                name=f"worker-conn-{peer}",
            ).start()

    def _delay(self) -> None:
        if self.delay_s:
            time.sleep(self.delay_s)  # emulated network round trip (benchmarks)

    def _reply(self, conn: socket.socket, kind: Kind, parts: list[bytes | memoryview]) -> None:
        self._delay()
        wire.write_frame(conn, kind, parts)

    def _error(self, conn: socket.socket, message: str) -> None:
        self._delay()
        wire.write_error(conn, message)

    def _serve_connection(self, conn: socket.socket, peer: Any) -> None:
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            replies = _DelayedReplies(conn, self.delay_s)
            try:
                session = self._handshake(conn)
                if session is not None:
                    self._session_loop(conn, session, replies)
            except (ConnectionError, TimeoutError, OSError) as exc:
                logger.info("connection from %s ended: %s", peer, exc)
            finally:
                replies.close()

    def _handshake(self, conn: socket.socket) -> int | None:
        conn.settimeout(HELLO_TIMEOUT_S)
        try:
            kind, body = wire.read_frame(conn, wire.MAX_HELLO_BODY)
            if kind != Kind.HELLO:
                raise WireError("the first frame must be HELLO")
            hello = wire.parse_json(body)
        except WireError as exc:
            self._error(conn, f"bad hello: {exc}")
            return None
        if hello.get("protocol") != wire.PROTOCOL:
            self._error(conn, f"protocol {hello.get('protocol')!r} unsupported "
                              f"(worker speaks {wire.PROTOCOL})")
            return None
        if self.api_key is not None:
            key = hello.get("api_key")
            if not isinstance(key, str) or not hmac.compare_digest(
                key.encode(), self.api_key.encode()
            ):
                self._error(conn, "invalid api key")
                return None
        conn.settimeout(None)
        with self._lock:
            self._session += 1
            session = self._session
            # The new client has a fresh scheduler: the old session's requests are gone.
            for handle in self._live:
                self.backend.remove_request(str(handle))
            self._live.clear()
            self._previous = None
        self._reply(conn, Kind.INFO, [json.dumps(self.info).encode()])
        return session

    def _session_loop(
        self, conn: socket.socket, session: int, replies: _DelayedReplies
    ) -> None:
        def error(message: str) -> None:
            self._previous = None
            replies.send(Kind.ERROR, [message.encode("utf-8", "replace")])

        # The next frame is read, decoded and checked on a thread of its own while this one
        # runs the current batch (a forward releases the GIL), so a client with steps in
        # flight finds its next batch ready when the last one ends. Replies keep the order
        # of the frames. Two frames at most wait decoded: a client that floods the
        # connection is held back by TCP, as when frames were read one at a time.
        frames: queue.Queue[_Frame] = queue.Queue(maxsize=2)
        stop = threading.Event()
        reader = threading.Thread(target=self._read_frames, args=(conn, frames, stop),
                                  daemon=True, name="worker-frames")
        reader.start()
        try:
            while True:
                item = frames.get()
                if isinstance(item, BaseException):
                    raise item  # the connection ended: as if read on this thread
                if isinstance(item, _Refused):
                    error(item.message)
                    if item.hang_up:
                        return
                    continue
                req, params = item
                with self._lock:
                    if self._session != session:
                        return  # another connection took over; this client is gone
                    try:
                        tokens, extras = self._run(req, params)
                    except Exception as exc:  # a model error fails one batch, not the worker
                        logger.exception("execute failed")
                        error(f"execute failed: {type(exc).__name__}: {exc}")
                        continue
                    # A later frame's placeholders take each row's last token.
                    counts = extras.get("num_accepted")
                    self._previous = (tokens[:, 0].copy() if counts is None else
                                      tokens[np.arange(len(tokens)), np.asarray(counts) - 1])
                replies.send(Kind.RESULT, wire.encode_result(tokens, extras))
        finally:
            stop.set()

    def _read_frames(
        self, conn: socket.socket, out: queue.Queue[_Frame], stop: threading.Event
    ) -> None:
        """Read and decode frames in order into ``out`` until the connection ends (its
        exception is the last item) or a frame loses the framing (a hang-up refusal)."""

        def put(item: _Frame) -> bool:
            while not stop.is_set():
                try:
                    out.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False

        try:
            while not stop.is_set():
                try:
                    kind, body = wire.read_frame(conn, self.max_body)
                except WireError as exc:
                    # The header is bad, so frame boundaries are lost: answer, then hang up.
                    put(_Refused(f"malformed frame: {exc}", hang_up=True))
                    return
                if kind != Kind.EXECUTE:
                    item: _Frame = _Refused(f"unexpected frame kind {kind.name}")
                else:
                    try:
                        req = wire.decode_execute(body, self.limits)
                        params = [SamplingParams(**s) for _, _, s in req.adds]
                        for p in params:
                            p.validate()
                        item = (req, params)
                    except (WireError, ValueError, TypeError) as exc:
                        item = _Refused(f"malformed EXECUTE: {exc}")
                if not put(item):
                    return
        except BaseException as exc:
            # The connection ended (or reading failed otherwise): the batch loop raises it
            # after the frames before it, as if it had read the frame itself.
            put(exc)

    def _run(
        self, req: ExecuteRequest, params: list[SamplingParams]
    ) -> tuple[np.ndarray, dict[str, Any]]:
        backend = self.backend
        for handle in req.remove_handles.tolist():
            backend.remove_request(str(handle))
            self._live.discard(handle)
        for (handle, prompt, _), p in zip(req.adds, params, strict=True):
            backend.add_request(str(handle), prompt, p)
            self._live.add(handle)
        return run_steps(backend, req, self.limits.kv_block_size, self._previous)


class _Refused:
    """A frame the worker answers with an ERROR (and, with ``hang_up``, closes on)."""

    def __init__(self, message: str, hang_up: bool = False) -> None:
        self.message = message
        self.hang_up = hang_up


#: What the frame reader hands the batch loop: a decoded batch with its requests' sampling
#: settings, a refusal, or the exception that ended the connection.
_Frame = tuple[ExecuteRequest, list[SamplingParams]] | _Refused | BaseException


class _DelayedReplies:
    """Sends a connection's replies in order, each ``delay_s`` after it was ready (an
    emulated network latency, for benchmarks). The worker goes on with the next frame
    meanwhile, as it would behind a real network; without a delay, replies go out at once
    on the caller's thread."""

    def __init__(self, conn: socket.socket, delay_s: float) -> None:
        self.conn = conn
        self.delay_s = delay_s
        self._queue: queue.SimpleQueue[tuple[float, Kind, list[bytes | memoryview]] | None]
        self._queue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        if delay_s > 0:
            self._thread = threading.Thread(target=self._run, daemon=True,
                                            name="worker-replies")
            self._thread.start()

    def send(self, kind: Kind, parts: list[bytes | memoryview]) -> None:
        if self._thread is None:
            wire.write_frame(self.conn, kind, parts)
        else:
            # The parts may view buffers the next frame reuses: keep a copy.
            self._queue.put((time.monotonic() + self.delay_s, kind, [b"".join(parts)]))

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            due, kind, parts = item
            pause = due - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            try:
                wire.write_frame(self.conn, kind, parts)
            except OSError:
                return

    def close(self) -> None:
        """Send what is queued, then stop."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=self.delay_s + 5.0)


# ---------------------------------------------------------------------------- backends


def build_backend(args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    """The backend and the INFO the server sizes its scheduler from."""
    from iron_batch.backends.build import build_backend as build
    from iron_batch.backends.build import scheduler_config, shared_options

    backend = build(args.backend, **shared_options(args))
    # The pool the server's scheduler will index: the backend's own, or the flags'.
    config = scheduler_config(
        backend, total_kv_blocks=args.total_kv_blocks, kv_block_size=args.kv_block_size
    )
    tokenizer = backend.tokenizer
    described = backend.describe()
    return backend, {
        "model_name": backend.model_name,
        "num_kv_blocks": config.total_kv_blocks,
        "kv_block_size": config.kv_block_size,
        "max_model_len": backend.max_model_len,
        "eos_token_ids": list(backend.eos_token_ids),
        "vocab_size": backend.vocab_size,
        "tokenizer": tokenizer.to_info() if tokenizer is not None else None,
        "supports_prompt_logprobs": bool(backend.supports_prompt_logprobs),
        "structured_output": bool(backend.supports_structured_output),
        # The speculative methods whose proposals the worker verifies (draft: it runs a
        # draft model, --speculative-model).
        "speculative_methods": list(getattr(backend, "speculative_methods", ())),
        # The model's cache groups (sliding-window layers): the server schedules the same.
        "cache_groups": [[g.kind, g.size, g.window, g.unit_bytes]
                         for g in config.cache_groups],
        # What the page and the banner show of the worker's cache.
        "kv_cache_dtype": described.kv_cache_dtype,
        "kv_bytes_per_block": described.kv_bytes_per_block,
    }


def build_parser() -> argparse.ArgumentParser:
    from iron_batch import flags
    from iron_batch.cli_args import non_negative_float, parse_addr

    p = argparse.ArgumentParser(
        prog="python -m iron_batch.worker",
        description="Serve a model (and its KV cache) to an iron-batch server over TCP.",
    )
    p.add_argument("--addr", type=parse_addr, default="127.0.0.1:9090",
                   help="HOST:PORT to listen on; port 0 picks a free one (default "
                   "127.0.0.1:9090). The chosen address is printed on stdout.")
    p.add_argument("--backend", choices=("torch", "mock"), default="torch",
                   help="torch (a local checkpoint, --model) or mock (no weights, for tests)")
    flags.add(p, flags.MODEL_FLAGS)
    flags.add(p, flags.DRAFT_FLAGS)
    p.add_argument("--api-key", default=os.environ.get("IRON_BATCH_WORKER_API_KEY"),
                   help="clients must send this key in their first frame "
                   "(default $IRON_BATCH_WORKER_API_KEY; none: open)")
    p.add_argument("--delay-ms", type=non_negative_float, default=0.0,
                   help="added round-trip delay per reply, to emulate a network (benchmarks)")
    flags.add(p, ("--mock-token-latency-us", "--mock-prefill-token-latency-us"))
    p.add_argument("--log-level", default="warning",
                   choices=("critical", "error", "warning", "info", "debug"))
    return p


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper())
    if args.delay_ms < 0:
        raise SystemExit("--delay-ms must be >= 0")
    from iron_batch.backends.build import BackendConfigError

    try:
        backend, info = build_backend(args)
    except BackendConfigError as exc:
        parser.error(str(exc))
    host, port = args.addr
    listener = socket.create_server((host, port), reuse_port=False, backlog=16)
    bound = listener.getsockname()
    # Tests and scripts wait for this line (and read the port when --addr ends in :0).
    print(f"iron_batch.worker listening on {bound[0]}:{bound[1]}", flush=True)
    worker = Worker(backend, info, api_key=args.api_key, delay_s=args.delay_ms / 1e3)
    try:
        worker.serve(listener)
    except KeyboardInterrupt:
        pass
    finally:
        listener.close()


if __name__ == "__main__":
    main()
