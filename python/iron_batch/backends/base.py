"""The one interface between the engine and whatever computes tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    from iron_batch._core import Batch
    from iron_batch.sampling_params import SamplingParams
    from iron_batch.tokenizer import Tokenizer


class FatalBackendError(RuntimeError):
    """Raised by ``Backend.execute`` when the backend cannot go on (device lost, worker gone
    for good): unlike any other exception, which fails only that step's requests, it fails
    every live request and stops the engine; the server's /health then fails and the
    process exits non-zero. The engine treats ``max_consecutive_failures`` failed steps in a
    row the same way."""


class BackendError(RuntimeError):
    """A failed ``execute`` that says what it broke. With ``invalidates_kv`` the backend lost
    its KV storage (a remote worker gone): the engine then fails every live request, not
    just the batch's, and starts a fresh scheduler (its prefix cache points at lost KV)."""

    invalidates_kv: bool = False


@runtime_checkable
class Backend(Protocol):
    """Advance a whole batch by one token per sample row: the one place an accelerator
    plugs in.

    The device seam is submit -> fence: ``submit(batch)`` starts a step and returns a
    handle, ``wait(handle)`` returns its sampled tokens. The engine keeps a step in flight
    while it schedules the next one, so a batch may hold placeholders
    (``batch.pending_token_indices``): input tokens that the previous *submitted* step
    samples, in its rows ``batch.pending_sample_rows``. ``submit`` fills them in on the
    backend's side (the device, the worker) before running. Steps are submitted and waited
    in the same order. A backend that cannot overlap implements only ``execute`` and
    inherits :class:`BackendBase`, whose ``submit`` fills the placeholders in from the
    previous result and runs ``execute``, and whose ``wait`` returns what it got.

    Per-request state (penalty counts, seeded generators) is updated where tokens are
    sampled, at submit; a request's state is bound to a step when it is submitted, so
    ``remove_request`` may come while that step is still in flight.

    The engine tells the backend about each request (its sampling settings) before the
    request is first scheduled and after it ends, so per-request state such as penalties,
    seeded generators or logprobs can live in the backend. Block ids in the batch index the
    backend's own KV storage; the scheduler never sees a tensor.
    """

    #: Largest context the model supports, or None when unbounded (mock).
    max_model_len: int | None
    #: Token ids that end generation unless the request sets ignore_eos.
    eos_token_ids: list[int]
    #: Text tokenizer, or None for token-id-only backends (mock).
    tokenizer: Tokenizer | None
    #: Short name shown by the server (/v1/models).
    model_name: str
    #: Token ids must be in [0, vocab_size); add_request raises ValueError otherwise.
    vocab_size: int
    #: Decode steps one ``execute`` runs per sampled row; the engine schedules with
    #: ``lookahead = steps_per_call - 1`` and ``execute`` returns ``[rows, K]`` when K > 1.
    steps_per_call: int
    #: KV geometry of a backend that owns its KV storage (the scheduler must match it), or
    #: None when the scheduler's configuration decides (mock).
    num_kv_blocks: int | None
    kv_block_size: int | None
    #: Whether ``add_request`` accepts ``params.grammar`` (constrained decoding needs the
    #: logits and the tokenizer where sampling happens); the server answers 400 otherwise.
    supports_structured_output: bool
    #: Whether ``submit`` returns before its step's work is done (kernels queued on a CUDA
    #: stream, a frame sent to a worker). Only then does a step in flight hide anything,
    #: and the engine keeps one by default; a backend whose ``submit`` runs the step to the
    #: end (CPU) would only hand each token out a step late. Read with a default of False.
    asynchronous_submit: bool

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> None: ...

    def remove_request(self, request_id: str) -> None: ...

    def execute(self, batch: Batch) -> np.ndarray:
        """Return int64 sampled token ids, one per ``batch.sample_indices`` row. Runs to
        the end; the batch's input ids are final (no placeholders)."""
        ...

    def submit(self, batch: Batch) -> Any:
        """Start one step (placeholders filled in from the previous submitted step's
        output); returns a handle for :meth:`wait`."""
        ...

    def wait(self, handle: Any) -> np.ndarray:
        """The sampled tokens of a submitted step, as ``execute`` returns them; waits for
        the device. Handles are waited in submission order."""
        ...

    def describe(self) -> BackendInfo:
        """What the server shows about this backend (the page at /, the console banner)."""
        ...

    def last_logprobs(self) -> list[tuple[float, list[tuple[int, float]]]] | None:
        """Logprobs of the sample rows of the step the last ``wait`` (or ``execute``)
        returned, for requests that asked for them: one (chosen-token logprob, top
        alternatives) per sample row, or None when no request in the batch wants
        logprobs."""
        ...

    #: Whether requests may set ``SamplingParams.prompt_logprobs`` (the engine rejects
    #: them otherwise).
    supports_prompt_logprobs: bool

    def take_prompt_logprobs(
        self, request_id: str
    ) -> list[tuple[float, list[tuple[int, float]]] | None] | None:
        """Once the request's prompt is computed (the engine asks at its first token): the
        logprob of each prompt token (None for the first) with its top alternatives, as
        ``params.prompt_logprobs`` asked; None when it did not ask. Given out once."""
        ...

    #: Whether requests may set ``SamplingParams.embed`` (the engine rejects them
    #: otherwise).
    supports_embeddings: bool

    def take_embedding(self, request_id: str) -> np.ndarray | None:
        """Once the request's prompt is computed: its pooled final hidden state (float32,
        not normalised), as ``params.embed`` asked; None when it did not ask. Given once."""
        ...


@dataclass(frozen=True)
class BackendInfo:
    """A backend's self-description for people: the kind (mock, torch, remote, ...), the
    compute dtype and device when it has them, the KV bytes of one block of
    ``kv_block_size`` slots when it knows them, and a remote worker's address."""

    kind: str
    dtype: str | None = None
    device: str | None = None
    kv_bytes_per_block: int | None = None
    url: str | None = None


Logprobs = list[tuple[float, list[tuple[int, float]]]]


@dataclass
class ExecutedStep:
    """The handle of :meth:`BackendBase.submit`: a step already run to the end."""

    tokens: np.ndarray
    logprobs: Logprobs | None


def fill_placeholders(batch: Any, previous: np.ndarray | None) -> None:
    """Write the previous step's sampled tokens into ``batch.input_ids`` where the
    scheduler left placeholders (in place, on the host)."""
    idx = getattr(batch, "pending_token_indices", None)
    if idx is None or len(idx) == 0:
        return
    rows = batch.pending_sample_rows
    if previous is None or previous.ndim != 1 or int(rows.max()) >= len(previous):
        raise ValueError("the batch has placeholders but no previous step sampled them")
    batch.input_ids[idx] = previous[rows]


class BackendBase:
    """Defaults for the optional parts of :class:`Backend` (subclass to get them)."""

    max_model_len: int | None = None
    tokenizer: Tokenizer | None = None
    model_name: str = "backend"
    steps_per_call: int = 1
    num_kv_blocks: int | None = None
    kv_block_size: int | None = None
    supports_structured_output: bool = False
    asynchronous_submit: bool = False

    def describe(self) -> BackendInfo:
        return BackendInfo(kind=type(self).__name__)

    def last_logprobs(self) -> list[tuple[float, list[tuple[int, float]]]] | None:
        return None

    supports_prompt_logprobs: bool = False

    def take_prompt_logprobs(
        self, request_id: str
    ) -> list[tuple[float, list[tuple[int, float]]] | None] | None:
        return None

    supports_embeddings: bool = False

    def take_embedding(self, request_id: str) -> np.ndarray | None:
        return None

    # A backend that cannot overlap: submit runs the step, wait hands back its result.
    _previous_tokens: np.ndarray | None = None

    def submit(self, batch: Batch) -> Any:
        try:
            fill_placeholders(batch, self._previous_tokens)
            tokens = np.asarray(self.execute(batch))
        except BaseException:
            self._previous_tokens = None
            raise
        self._previous_tokens = tokens if tokens.ndim == 1 else tokens[:, 0]
        return ExecutedStep(tokens, self.last_logprobs())

    def wait(self, handle: Any) -> np.ndarray:
        assert isinstance(handle, ExecutedStep)
        return handle.tokens


class ExecuteOnly:
    """``submit``/``wait`` for a backend object that implements only ``execute`` (an older
    third-party backend that does not subclass :class:`BackendBase`), as BackendBase
    gives them."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self._previous_tokens: np.ndarray | None = None

    def submit(self, batch: Batch) -> ExecutedStep:
        try:
            fill_placeholders(batch, self._previous_tokens)
            tokens = np.asarray(self.backend.execute(batch))
        except BaseException:
            self._previous_tokens = None
            raise
        self._previous_tokens = tokens if tokens.ndim == 1 else tokens[:, 0]
        return ExecutedStep(tokens, self.backend.last_logprobs())

    def wait(self, handle: ExecutedStep) -> np.ndarray:
        return handle.tokens
