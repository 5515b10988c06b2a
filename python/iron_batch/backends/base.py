"""The one interface between the engine and whatever computes tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from iron_batch.stream import PromptLogprobs, StepLogprobs

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
    handle, ``wait(handle)`` returns its :class:`StepOutput` (the sampled tokens, and the
    logprobs and prompt logprobs of the requests that asked for them). The engine keeps a
    step in flight while it schedules the next one, so a batch may hold placeholders
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
    #: The speculative methods whose proposals ``submit`` verifies: ``"ngram"`` (the
    #: scheduler proposes), ``"draft"`` (the backend's draft model fills the proposal rows);
    #: empty: none. Read with a default of ().
    speculative_methods: tuple[str, ...]

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

    def wait(self, handle: Any) -> StepOutput:
        """What a submitted step produced; waits for the device. Handles are waited in
        submission order."""
        ...

    def describe(self) -> BackendInfo:
        """What the server shows about this backend (the page at /, the console banner)."""
        ...

    #: Whether requests may set ``SamplingParams.prompt_logprobs`` (the engine rejects
    #: them otherwise).
    supports_prompt_logprobs: bool

    #: Whether requests may set ``SamplingParams.embed`` (the engine rejects them
    #: otherwise).
    supports_embeddings: bool


@dataclass(frozen=True)
class BackendInfo:
    """A backend's self-description for people: the kind (mock, torch, remote, ...), the
    compute dtype and device when it has them, the KV bytes of one block of
    ``kv_block_size`` slots when it knows them, a remote worker's address, and the
    tuning switches a model backend read at load."""

    kind: str
    dtype: str | None = None
    device: str | None = None
    kv_bytes_per_block: int | None = None
    url: str | None = None
    #: The tuning switches in force (environment name -> value; see
    #: ``platform/switches.py``), for backends that read them.
    switches: dict[str, str] | None = None
    #: What the KV cache stores K/V as ("bfloat16", "int8", ...), for backends with one.
    kv_cache_dtype: str | None = None




@dataclass
class StepOutput:
    """What one step gives the engine."""

    #: int64 sampled token ids: ``[sample rows]``, or ``[sample rows, K]`` for a backend
    #: that runs K decode steps per call.
    tokens: np.ndarray
    #: One (chosen-token logprob, top alternatives) per sample row when some request of
    #: the step asked for logprobs (one token per row only; with ``num_accepted``, one
    #: per token of the flat ``tokens``), else None.
    logprobs: StepLogprobs | None = None
    #: The prompt logprobs of requests that asked for them, once their prompt is
    #: computed (the step that samples their first token), by request id.
    prompt_logprobs: dict[str, PromptLogprobs] | None = None
    #: Embedding requests' pooled final hidden states (float32, not normalised; see
    #: ``iron_batch.pooling``), once their prompt is computed, by request id.
    embeddings: dict[str, np.ndarray] | None = None
    #: A step that verified proposals (``batch.num_proposed``): tokens each sample row
    #: accepted; ``tokens`` then holds every row's accepted tokens in turn (flat).
    num_accepted: np.ndarray | None = None


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
    speculative_methods: tuple[str, ...] = ()

    supports_prompt_logprobs: bool = False

    def describe(self) -> BackendInfo:
        return BackendInfo(kind=type(self).__name__)

    supports_embeddings: bool = False

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
        return StepOutput(tokens)

    def wait(self, handle: Any) -> StepOutput:
        assert isinstance(handle, StepOutput)
        return handle


class ExecuteOnly:
    """``submit``/``wait`` for a backend object that implements only ``execute`` (an older
    third-party backend that does not subclass :class:`BackendBase`), as BackendBase
    gives them."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self._previous_tokens: np.ndarray | None = None

    def submit(self, batch: Batch) -> StepOutput:
        try:
            fill_placeholders(batch, self._previous_tokens)
            tokens = np.asarray(self.backend.execute(batch))
        except BaseException:
            self._previous_tokens = None
            raise
        self._previous_tokens = tokens if tokens.ndim == 1 else tokens[:, 0]
        return StepOutput(tokens)

    def wait(self, handle: StepOutput) -> StepOutput:
        return handle
