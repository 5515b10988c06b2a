"""Backend whose model runs in another process or host (``python -m iron_batch.worker``).

The scheduler stays here; the worker owns the model and the KV cache that the scheduler's
block ids index. Each ``execute`` is one round trip on a persistent TCP connection: the
batch's numpy arrays as they are (:mod:`iron_batch.wire`), plus the requests added and
removed since the previous call, so request bookkeeping never costs a round trip of its
own. ``submit`` sends a frame and returns; ``wait`` reads its reply. An overlapping engine
sends step N+1 before step N's reply is back: the worker, which reads frames in order,
fills N+1's placeholders in from N's result and starts it as soon as N is done, so the
round trip hides behind compute. With ``steps_per_call = K`` (no overlap) the engine
schedules with ``lookahead = K - 1`` and the worker runs up to K decode steps per sampled
sequence per call, which divides the number of round trips per token by up to K.

Faults and invalidation. When the connection is lost (worker died, hung past ``timeout``,
answered garbage) nothing the worker held can be trusted any more: a restarted worker has
an empty KV cache, and a hung one may still write into blocks the scheduler frees. So
:class:`WorkerLost` carries ``invalidates_kv = True``, and the engine then fails every live
request (not just the batch's) and replaces its scheduler, dropping a prefix cache that
points at KV the next worker never computed. The next ``execute`` reconnects; the worker
starts a fresh session for the new connection. A worker that answers a well-formed ERROR
(bad batch, model exception) keeps its session: only that batch fails
(:class:`RemoteBackendError`, no invalidation).

Sampling state (penalty counts, seeded generators, grammar matchers) lives in the worker,
which samples the lookahead tokens itself; a grammar travels as text with its request.
Logprobs come back in the RESULT frame: those of the sampled tokens (with one step per call
only: requests asking for them are rejected at admission otherwise) and, for requests with
``prompt_logprobs``, those of the prompt, once the worker has computed the whole prompt.
"""

from __future__ import annotations

import select
import socket
from itertools import count
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import numpy as np

from iron_batch import wire
from iron_batch._core import CacheGroup
from iron_batch.backends.base import BackendBase, BackendError, BackendInfo, StepOutput
from iron_batch.batch import batch_arrays
from iron_batch.wire import Kind, WireError

if TYPE_CHECKING:
    from iron_batch._core import Batch
    from iron_batch.sampling_params import SamplingParams
    from iron_batch.tokenizer import Tokenizer

#: INFO fields that size the server's scheduler: a reconnect must find the same values.
_GEOMETRY = ("kv_block_size", "max_model_len", "vocab_size")


#: Seconds one worker call may take before its requests fail (``--backend-timeout``).
DEFAULT_TIMEOUT_S = 30.0


class RemoteBackendError(BackendError):
    """The worker refused or failed one batch; the connection and its KV are intact."""


class WorkerLost(RemoteBackendError):
    """The connection to the worker is gone: its KV cache and request state are lost.

    The engine fails every live request and starts a fresh scheduler when it sees
    ``invalidates_kv``; the next ``execute`` reconnects.
    """

    invalidates_kv = True


def parse_url(url: str) -> tuple[str, int]:
    """``tcp://host:port``, ``host:port`` (or any scheme with a host and a port)."""
    parts = urlsplit(url if "//" in url else f"tcp://{url}")
    if not parts.hostname or parts.port is None:
        raise ValueError(f"worker URL needs a host and a port, got {url!r}")
    return parts.hostname, parts.port


def _sampling_settings(params: SamplingParams) -> dict[str, Any]:
    return {name: getattr(params, name) for name in wire.PARAM_FIELDS}


def _tokenizer_from_info(info: dict[str, Any] | None) -> Tokenizer | None:
    if not info:
        return None
    from iron_batch.tokenizer import Tokenizer

    return Tokenizer.from_info(info)


class RemoteBackend(BackendBase):
    """Backend protocol over a worker connection; connects (and reads INFO) on creation."""

    #: ``submit`` sends a frame and returns: the round trip hides behind a step in flight.
    asynchronous_submit = True

    def __init__(
        self,
        url: str,
        *,
        api_key: str | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        steps_per_call: int = 1,
        max_reply_body: int = wire.MAX_BODY,
    ) -> None:
        if not 1 <= steps_per_call <= wire.MAX_STEPS:
            raise ValueError(f"steps_per_call must be in 1..{wire.MAX_STEPS}")
        if not timeout > 0:
            raise ValueError("timeout must be > 0")
        self.url = url
        self.address = parse_url(url)
        self.api_key = api_key
        self.timeout = timeout
        #: Decode steps per call; the engine schedules with lookahead = steps_per_call - 1.
        self.steps_per_call = steps_per_call
        self.max_reply_body = max_reply_body
        self._sock: socket.socket | None = None
        self._handles: dict[str, int] = {}
        self._next_handle = count(1)
        #: handle -> (prompt, sampling settings), kept to re-send after an ERROR reply.
        self._requests: dict[int, tuple[list[int], dict[str, Any]]] = {}
        self._pending_adds: dict[int, tuple[list[int], dict[str, Any]]] = {}
        self._pending_removes: list[int] = []
        self._sent: set[int] = set()
        # EXECUTE frames sent whose reply is not read yet, and the connection's number
        # (a step sent on an older connection has no reply coming).
        self._outstanding = 0
        self._generation = 0
        self.reconnects = 0
        self._rids: dict[int, str] = {}
        info = self._connect()
        self.info = info
        self.model_name: str = str(info["model_name"])
        self.num_kv_blocks: int = int(info["num_kv_blocks"])
        self.kv_block_size: int = int(info["kv_block_size"])
        self.max_model_len: int | None = info["max_model_len"]
        self.vocab_size: int = int(info["vocab_size"])
        self.eos_token_ids: list[int] = [int(i) for i in info["eos_token_ids"]]
        self.tokenizer: Tokenizer | None = _tokenizer_from_info(info.get("tokenizer"))
        self.supports_prompt_logprobs = bool(info.get("supports_prompt_logprobs", False))
        # The worker samples, so the worker enforces grammars (an older one may not).
        self.supports_structured_output = info.get("structured_output") is True
        # The methods whose proposals the worker verifies (prompt lookup runs in this
        # process's scheduler; a draft model on the worker fills the proposal rows there);
        # one step per call: lookahead steps and proposal rows do not mix.
        methods = info.get("speculative_methods") or []
        self.speculative_methods: tuple[str, ...] = tuple(
            m for m in ("ngram", "draft") if m in methods) if steps_per_call == 1 else ()
        #: The worker model's cache groups, which the server's scheduler must keep too.
        self.cache_groups: list[CacheGroup] = [
            CacheGroup(str(kind), int(size), window=window, unit_bytes=int(unit))
            for kind, size, window, unit in info.get("cache_groups") or []]

    # ------------------------------------------------------------------ connection

    def _connect(self) -> dict[str, Any]:
        try:
            sock = socket.create_connection(self.address, timeout=self.timeout)
        except OSError as exc:
            raise ConnectionError(f"cannot reach worker at {self.url}: {exc}") from exc
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            wire.write_json(sock, Kind.HELLO, {"protocol": wire.PROTOCOL,
                                               "api_key": self.api_key})
            kind, body = wire.read_frame(sock, self.max_reply_body)
            if kind == Kind.ERROR:
                raise ConnectionRefusedError(
                    f"worker at {self.url} refused: {bytes(body).decode('utf-8', 'replace')}"
                )
            if kind != Kind.INFO:
                raise WireError(f"expected INFO, got {kind.name}")
            info = wire.parse_json(body)
            for key in ("model_name", "num_kv_blocks", "eos_token_ids", *_GEOMETRY):
                if key not in info:
                    raise WireError(f"INFO lacks {key!r}")
        except (OSError, WireError) as exc:
            sock.close()
            if isinstance(exc, ConnectionRefusedError):
                raise
            raise ConnectionError(f"handshake with worker at {self.url} failed: {exc}") from exc
        self._sock = sock
        return info

    def _reconnect(self) -> None:
        try:
            info = self._connect()
        except ConnectionError as exc:
            # Nothing was sent: this batch fails, but no KV was lost since the last reset.
            raise RemoteBackendError(str(exc)) from None
        changed = [k for k in _GEOMETRY if info[k] != self.info[k]]
        if info["num_kv_blocks"] < self.num_kv_blocks:
            changed.append("num_kv_blocks")
        if info.get("cache_groups") != self.info.get("cache_groups"):
            changed.append("cache_groups")
        if changed:
            self.close()
            raise RemoteBackendError(
                f"worker at {self.url} came back with different {', '.join(changed)}; "
                "restart the server to adopt it"
            )
        self.reconnects += 1

    def _lose(self, why: str) -> WorkerLost:
        """Drop the connection; everything the worker held is forgotten on this side too."""
        self.close()
        self._outstanding = 0
        self._generation += 1
        # Requests still registered are re-announced to the next session.
        for handle in self._sent:
            if handle in self._requests:
                self._pending_adds[handle] = self._requests[handle]
        self._sent.clear()
        self._pending_removes.clear()
        return WorkerLost(f"worker at {self.url}: {why}")

    def close(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None

    def _peer_closed(self, sock: socket.socket) -> bool:
        """Between calls the worker never speaks: readable now means EOF or garbage."""
        readable, _, _ = select.select([sock], [], [], 0)
        return bool(readable)

    # ------------------------------------------------------------------ requests

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        if params.logprobs is not None and self.steps_per_call > 1:
            raise ValueError("logprobs need one step per call on the remote backend "
                             "(--steps-per-call 1)")
        if params.grammar is not None and not self.supports_structured_output:
            raise ValueError(f"the worker at {self.url} does not support structured output")
        if request_id in self._handles:
            self.remove_request(request_id)
        handle = next(self._next_handle)
        entry = (list(prompt_token_ids), _sampling_settings(params))
        self._handles[request_id] = handle
        self._rids[handle] = request_id
        self._requests[handle] = entry
        self._pending_adds[handle] = entry  # goes out with the next execute

    def remove_request(self, request_id: str) -> None:
        handle = self._handles.pop(request_id, None)
        if handle is None:
            return
        self._rids.pop(handle, None)
        self._requests.pop(handle, None)
        if self._pending_adds.pop(handle, None) is None and handle in self._sent:
            self._sent.discard(handle)
            self._pending_removes.append(handle)

    def _handle_of(self, request_id: str) -> int:
        handle = self._handles.get(request_id)
        if handle is None:
            # Scheduler-only users may skip add_request: greedy, like the torch backend.
            from iron_batch.sampling_params import SamplingParams

            self.add_request(request_id, [], SamplingParams())
            handle = self._handles[request_id]
        return handle

    # ------------------------------------------------------------------ execute

    def describe(self) -> BackendInfo:
        info = self.info if isinstance(self.info, dict) else {}
        dtype, device = info.get("dtype"), info.get("device")
        kv_dtype, kv_bytes = info.get("kv_cache_dtype"), info.get("kv_bytes_per_block")
        return BackendInfo(
            kind="remote",
            dtype=dtype if isinstance(dtype, str) else None,
            device=device if isinstance(device, str) else None,
            url=self.url,
            kv_cache_dtype=kv_dtype if isinstance(kv_dtype, str) else None,
            kv_bytes_per_block=kv_bytes if isinstance(kv_bytes, int) else None,
        )

    def execute(self, batch: Batch) -> np.ndarray:
        """[num_samples] int64 when steps_per_call == 1, else [num_samples, K] int64."""
        return self.wait(self.submit(batch)).tokens

    def submit(self, batch: Batch) -> _SentStep:
        """Send the step's EXECUTE and return at once: the worker runs it while the engine
        schedules the next one, whose frame may go out before this reply is back (the
        worker fills its placeholders in from this step's result)."""
        k = self.steps_per_call
        if self._sock is None:
            if self._outstanding:
                raise self._lose("connection lost with steps in flight")
            self._reconnect()
        sock = self._sock
        assert sock is not None
        # Between calls an idle worker never speaks: readable now means EOF or garbage.
        if not self._outstanding and self._peer_closed(sock):
            raise self._lose("connection closed while idle")
        handles = np.fromiter(
            (self._handle_of(rid) for rid in batch.sample_request_ids),
            dtype=np.int64,
            count=len(batch.sample_indices),
        )
        seq_handles = np.fromiter(
            (self._handle_of(rid) for rid in batch.request_ids),
            dtype=np.int64,
            count=batch.num_seqs,
        )
        adds = [(h, p, s) for h, (p, s) in self._pending_adds.items()]
        removes = self._pending_removes
        parts = wire.encode_execute(k, batch_arrays(batch), handles, removes, adds, seq_handles)
        try:
            sock.settimeout(self.timeout)
            wire.write_frame(sock, Kind.EXECUTE, parts)
        except TimeoutError:
            raise self._lose(f"could not send within {self.timeout:g} s") from None
        except OSError as exc:
            raise self._lose(f"connection lost: {exc}") from None
        # Later frames must not announce these requests again (that would reset their
        # sampling state on the worker); an ERROR reply puts them back.
        for h, _, _ in adds:
            self._sent.add(h)
            self._pending_adds.pop(h, None)
        self._pending_removes = []
        self._outstanding += 1
        proposed = getattr(batch, "num_proposed", None)
        proposed = proposed.copy() if proposed is not None and proposed.any() else None
        return _SentStep(self._generation, len(handles), k, adds, removes, proposed)

    def wait(self, handle: _SentStep) -> StepOutput:
        if handle.generation != self._generation or self._sock is None:
            raise WorkerLost(f"worker at {self.url}: connection lost before this step's reply")
        sock = self._sock
        k = handle.steps
        try:
            sock.settimeout(self.timeout)
            kind, body = wire.read_frame(sock, self.max_reply_body)
        except TimeoutError:
            raise self._lose(f"no answer within {self.timeout:g} s") from None
        except WireError as exc:
            raise self._lose(f"garbage reply: {exc}") from None
        except OSError as exc:
            raise self._lose(f"connection lost: {exc}") from None
        self._outstanding -= 1
        if kind == Kind.ERROR:
            # The worker may or may not have applied this frame's adds and removes; both
            # are idempotent there, so they simply go out again with the next frame.
            for h, p, s in handle.adds:
                if h in self._requests:
                    self._sent.discard(h)
                    self._pending_adds[h] = (p, s)
            self._pending_removes.extend(handle.removes)
            raise RemoteBackendError(
                f"worker error: {bytes(body).decode('utf-8', 'replace')}"
            )
        if kind != Kind.RESULT:
            raise self._lose(f"unexpected {kind.name} reply")
        try:
            tokens, extras = wire.decode_result(body, handle.num_samples, k, self.vocab_size,
                                                handle.proposed)
        except WireError as exc:
            raise self._lose(f"garbage reply: {exc}") from None
        # Each reply carries the logprobs of its own step's rows (with overlap too).
        prompts = {}
        for h, entries in extras.get("prompt_logprobs", {}).items():
            rid = self._rids.get(h)
            if rid is not None:
                prompts[rid] = entries
        accepted = extras.get("num_accepted")
        if accepted is not None:
            # Each row's accepted tokens in turn (flat), as a verifying step gives them.
            flat = np.concatenate([row[:c] for row, c in zip(tokens, accepted.tolist(),
                                                              strict=True)])
            return StepOutput(flat, extras.get("logprobs"), prompts or None,
                              num_accepted=accepted)
        return StepOutput(tokens[:, 0].copy() if k == 1 else tokens, extras.get("logprobs"),
                          prompts or None)


class _SentStep:
    """A step whose EXECUTE went out on connection ``generation``; what its reply needs."""

    __slots__ = ("generation", "num_samples", "steps", "adds", "removes", "proposed")

    def __init__(
        self, generation: int, num_samples: int, steps: int,
        adds: list[tuple[int, list[int], dict[str, Any]]], removes: list[int],
        proposed: np.ndarray | None = None,
    ) -> None:
        self.generation = generation
        self.num_samples = num_samples
        self.steps = steps
        self.adds = adds
        self.removes = removes
        #: Proposals per sample row when the step verifies some (else None).
        self.proposed = proposed
