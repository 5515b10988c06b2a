"""Type stub for the Rust extension ``iron_batch._core``.

The scheduler owns sequences, queues and KV block ids; it never sees a tensor.
One engine step is ``schedule()`` -> model forward -> ``commit(batch, sampled)``.
"""

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

__version__: str
#: The input id of a proposal row that the backend's draft model fills in.
DRAFTED_BY_BACKEND: int

class IronBatchError(Exception):
    """Base class of every error raised by the Rust core."""

class RequestRejected(IronBatchError, ValueError):
    """The request can never be served (too long for the KV pool or the model context)."""

class DuplicateRequest(IronBatchError, ValueError):
    """A request with this id is already known to the scheduler."""

class UnknownRequest(IronBatchError, KeyError):
    """No live request has this id."""

class AllocatorError(IronBatchError, RuntimeError):
    """Misuse of the block allocator: double free, unknown block id."""

class OutOfBlocks(IronBatchError, RuntimeError):
    """Not enough free KV blocks for an allocation (nothing was taken)."""

class BatchMismatch(IronBatchError, ValueError):
    """``commit`` got a batch that is not the last scheduled one, or the wrong number of tokens."""

class CacheGroup:
    """Layers with one cache spec: ``kind`` "full" (K and V of every token), "sliding" (of
    the last ``window`` tokens: position p attends to p - window + 1 ..= p) or "state" (one
    fixed-size recurrent state per sequence). ``size`` is the group's pool in blocks, or in
    state slots; ``unit_bytes`` the bytes of one block or slot (for the usage figures)."""

    @property
    def kind(self) -> str: ...
    @property
    def size(self) -> int: ...
    @property
    def window(self) -> int | None: ...
    @property
    def unit_bytes(self) -> int: ...
    def __init__(
        self, kind: str, size: int, window: int | None = None, unit_bytes: int = 0
    ) -> None: ...

def split_pool(
    pool_bytes: int,
    groups: Sequence[tuple[str, int | None, int]],
    kv_block_size: int,
    max_running_seqs: int,
    context: int,
    chunk: int,
) -> list[CacheGroup]:
    """Split a pool of bytes between groups given as (kind, window, bytes per token or per
    state slot): a state group gets two slots per running sequence; the attention groups share
    the rest so that each serves as many sequences of ``context`` tokens (a sliding one
    holds its window and a chunk of ``chunk`` tokens)."""

class SchedulerConfig:
    total_kv_blocks: int
    kv_block_size: int
    max_batch_tokens: int
    max_running_seqs: int
    enable_prefix_caching: bool
    max_model_len: int | None
    #: Empty: one full group of ``total_kv_blocks`` (which is otherwise unused). At most one
    #: state group and at least one attention group.
    cache_groups: list[CacheGroup]
    #: With a state group: save a checkpoint every this many blocks, besides the one at the
    #: end of each prompt (0: only those).
    state_checkpoint_interval: int
    #: Speculative decoding (prompt lookup): the most tokens proposed and verified per
    #: decoding sequence per step (0: off); proposals stop once a step has
    #: ``speculative_max_rows`` query rows; n-grams of these lengths are matched.
    num_speculative_tokens: int
    speculative_max_rows: int
    speculative_ngram_min: int
    speculative_ngram_max: int
    #: Where proposals come from: "ngram" (prompt lookup, in the core) or "draft" (the
    #: core reserves the rows, filled with ``DRAFTED_BY_BACKEND`` placeholders, and the
    #: backend's draft model picks their tokens before the forward).
    speculative_method: str
    def __init__(
        self,
        total_kv_blocks: int = 4096,
        kv_block_size: int = 16,
        max_batch_tokens: int = 8192,
        max_running_seqs: int = 256,
        enable_prefix_caching: bool = True,
        max_model_len: int | None = None,
        cache_groups: Sequence[CacheGroup] = ...,
        state_checkpoint_interval: int = 0,
        *,
        num_speculative_tokens: int = 0,
        speculative_max_rows: int = 8,
        speculative_ngram_min: int = 2,
        speculative_ngram_max: int = 4,
        speculative_method: str = "ngram",
    ) -> None: ...

class Batch:
    """One forward pass, flattened. Arrays are owned by numpy (no copy from Rust)."""

    @property
    def step(self) -> int:
        """Step number. Batches are committed in the order they were scheduled; a plain
        ``schedule`` discards every batch not committed yet."""
    @property
    def num_seqs(self) -> int: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def num_samples(self) -> int: ...
    @property
    def input_ids(self) -> npt.NDArray[np.int64]:
        """[num_tokens] token ids to run."""
    @property
    def positions(self) -> npt.NDArray[np.int64]:
        """[num_tokens] absolute position of each token in its sequence."""
    @property
    def slot_mapping(self) -> npt.NDArray[np.int64]:
        """[num_tokens] KV slot to write = block_id * kv_block_size + offset."""
    @property
    def query_start_loc(self) -> npt.NDArray[np.int32]:
        """[num_seqs + 1] cumulative query lengths; seq i owns rows [q[i], q[i+1])."""
    @property
    def seq_lens(self) -> npt.NDArray[np.int32]:
        """[num_seqs] context length of each sequence after this step."""
    @property
    def block_tables(self) -> npt.NDArray[np.int32]:
        """[num_seqs, max_blocks] block ids, padded with 0 past each sequence's blocks."""
    @property
    def sample_indices(self) -> npt.NDArray[np.int64]:
        """[num_samples] token rows whose logits give a sampled token."""
    @property
    def sample_seq_indices(self) -> npt.NDArray[np.int64]:
        """[num_samples] the batch sequence index of each sample row."""
    @property
    def sample_max_steps(self) -> npt.NDArray[np.int32]:
        """[num_samples] tokens each sample row may produce: 1, or up to lookahead + 1."""
    @property
    def num_proposed(self) -> npt.NDArray[np.int32]:
        """[num_samples] proposed tokens each sample row verifies (speculative decoding):
        with ``k`` of them, ``input_ids[s - k + 1 : s + 1]`` (``s = sample_indices[r]``)
        are the proposals and the logits of rows ``s - k .. s`` verify them; commit takes
        1 to ``k + 1`` tokens for the row (``num_accepted``)."""
    @property
    def pending_token_indices(self) -> npt.NDArray[np.int64]:
        """[P] placeholders (``schedule(overlap=True)``): rows of ``input_ids`` that hold 0
        because their token is sampled by the previous step, still running."""
    @property
    def pending_sample_rows(self) -> npt.NDArray[np.int64]:
        """[P] the previous step's sample row whose token fills each placeholder."""
    @property
    def request_ids(self) -> list[str]:
        """[num_seqs] request id of each sequence in the batch."""
    @property
    def sample_request_ids(self) -> list[str]:
        """[num_samples] request id of each sample row."""
    @property
    def num_computed_before(self) -> npt.NDArray[np.int32]:
        """[num_seqs] tokens already in the KV cache before this step."""
    @property
    def group_slot_mapping(self) -> npt.NDArray[np.int64]:
        """[attention groups - 1, num_tokens] KV slots of the attention groups after the
        first (whose slots are ``slot_mapping``)."""
    @property
    def group_block_tables(self) -> npt.NDArray[np.int32]:
        """[(attention groups - 1) * num_seqs, width]: group g's (g >= 1) block table is rows
        (g - 1) * num_seqs .. g * num_seqs, padded with 0."""
    @property
    def block_table_offsets(self) -> npt.NDArray[np.int32]:
        """[attention groups, num_seqs] logical block of each table row's first column: a
        sliding group's blocks before it are released; 0 in full groups."""
    @property
    def state_slots(self) -> npt.NDArray[np.int32]:
        """[num_seqs] each sequence's state slot (empty without a state group)."""
    @property
    def state_fresh(self) -> npt.NDArray[np.int32]:
        """[num_seqs] 1 where the step begins a fresh (zero) state in the slot."""
    @property
    def state_restore(self) -> npt.NDArray[np.int32]:
        """[num_seqs] checkpoint slot to copy into the state slot before the step, or -1."""
    @property
    def state_save(self) -> npt.NDArray[np.int32]:
        """[num_seqs] slot to copy the state into after the step's own tokens (a checkpoint
        at the end of the row's chunk, which is block-aligned), or -1."""

FINISH_REASONS: tuple[None, str, str, str]
"""``FINISH_REASONS[code]`` names a ``StepEvents.finish_reasons`` code:
``(None, "length", "stop", "abort")``. 0 (None) is an event whose request goes on; commit
never reports "abort" (an aborted request has no more events)."""

class StepEvents:
    """One commit's events as columns: event ``i`` is row ``i`` of each array. The arrays
    are owned by numpy (moved from Rust, no copy); no Python object is made per event.

    Order: requests that ended without model work (``max_new_tokens == 0``) first, then the
    batch's rows in order; with lookahead, a request's tokens are consecutive rows."""

    @property
    def handles(self) -> npt.NDArray[np.int64]:
        """[N] the handle of each event's request, as ``Scheduler.add_request`` returned it."""
    @property
    def token_ids(self) -> npt.NDArray[np.int64]:
        """[N] the accepted token, or -1 for an event without one (a request that ended
        without producing a token)."""
    @property
    def finish_reasons(self) -> npt.NDArray[np.uint8]:
        """[N] 0 while the request goes on; else the code of why it ended (see
        ``FINISH_REASONS``): 1 length, 2 stop. The scheduler has freed its blocks."""
    @property
    def finished(self) -> npt.NDArray[np.bool_]:
        """[N] ``finish_reasons != 0`` (a new array on every access)."""
    @property
    def num_finished(self) -> int:
        """Events that end their request."""
    @property
    def request_ids(self) -> list[str]:
        """[N] request id of each event (a list built on every access)."""
    def __len__(self) -> int: ...

class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None: ...
    @property
    def config(self) -> SchedulerConfig: ...
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int] | npt.NDArray[np.integer],
        max_new_tokens: int,
        stop_token_ids: Sequence[int] = (),
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        skip_prefix_cache: bool = False,
        speculate: bool = True,
    ) -> int:
        """Queue a request; returns its handle, the small int that names it in
        ``StepEvents.handles``. Raises RequestRejected or DuplicateRequest, changing nothing.

        A handle is the request's slot: it names the request from here until the first
        ``schedule`` after the commit (or abort, or finish) that ended it; only a request
        added after that ``schedule`` may get the same handle. So a list indexed by handle,
        set here and cleared when the request ends, names the request of every event.

        ``priority``: lower runs first; the waiting queue and the choice of preemption
        victim follow (priority, arrival). ``cache_salt``: requests with different salts
        never share prefix-cache blocks. ``skip_prefix_cache``: compute every prompt token
        (for prompt logprobs); the blocks are still published for later requests.
        ``speculate=False``: never propose tokens for it (with speculation on)."""
    def schedule(self, lookahead: int = 0, *, overlap: bool = False) -> Batch:
        """Pick the next step's work. An empty batch (num_seqs == 0) means nothing to run.
        With ``lookahead = K - 1`` KV slots are reserved so that each sampled sequence can
        run up to ``batch.sample_max_steps[r]`` (at most K) decode steps before ``commit``.

        With ``overlap=True`` the batches scheduled and not yet committed stay open: each
        running sequence is assumed to have one more token per open step that sampled it,
        and a decode whose input is such a token gets a placeholder
        (``pending_token_indices``/``pending_sample_rows``) for the backend to fill in from
        the previous step's output. Commit the open batches oldest first; a sequence that
        stops meanwhile wastes at most its rows in later batches, which commit ignores.
        Raises BatchMismatch when lookahead would meet an open step. Without ``overlap``,
        open batches are discarded (they can no longer be committed)."""
    def commit(
        self,
        batch: Batch,
        sampled: Sequence[int] | npt.NDArray[np.integer],
        num_accepted: Sequence[int] | npt.NDArray[np.integer] | None = None,
    ) -> StepEvents:
        """Apply the sampled tokens: 1-D, one per sample row; or 2-D ``[num_samples, K]``
        for a lookahead batch (tokens past a stop condition are discarded). Returns the
        step's events as columns, one event per accepted token. Requests with
        ``max_new_tokens == 0`` finish through an event with no token (-1). Rows of requests
        aborted or finished since ``schedule`` are dropped; a request preempted since (by a
        later ``schedule(overlap=True)``) still gets its token.

        With ``num_accepted`` (one count per sample row; needed for a batch with
        proposals): ``sampled`` is every row's accepted tokens in turn, 1 to
        ``num_proposed[r] + 1`` of them, all but the last equal to the row's proposals. The
        rest is rolled back (KV slots, blocks taken only for them); only accepted tokens
        are ever published to the prefix cache."""
    def abort(self, request_id: str) -> bool:
        """Free everything the request holds; False if it is not live (already ended)."""
    def finish(self, request_id: str) -> bool:
        """End a live request from outside (its caller says why, e.g. a stop string
        matched): frees its blocks and emits no event."""
    def has_work(self) -> bool: ...
    def is_live(self, request_id: str) -> bool: ...
    def output_token_ids(self, request_id: str) -> list[int]: ...
    @property
    def num_open_steps(self) -> int:
        """Batches scheduled and not committed yet."""
    def num_cached_prompt_tokens(self, request_id: str) -> int:
        """Prompt tokens served by the prefix cache on the request's first admission."""
    @property
    def num_running(self) -> int: ...
    @property
    def num_waiting(self) -> int: ...
    @property
    def num_free_blocks(self) -> int: ...
    def stats(self) -> dict[str, int]:
        """Counters: total_blocks, free_blocks, used_blocks, cached_blocks, running, waiting,
        preemptions, prefix_cache_queries, prefix_cache_hit_tokens, prefix_cache_query_tokens,
        requests_added, requests_finished, requests_aborted, sliding_blocks_released,
        state_checkpoints_saved, state_checkpoint_hits, spec_rows, spec_drafted_tokens,
        spec_accepted_tokens. The block counts are the first
        attention group's."""
    def group_stats(self) -> list[dict[str, Any]]:
        """Each cache group's pool in config order: kind, window, total, used, free, cached
        (blocks or state slots) and unit_bytes."""
    def check_invariants(self) -> None:
        """Raise AllocatorError if any internal invariant is broken (for tests)."""

class BlockAllocator:
    def __init__(
        self, total_blocks: int, block_size: int, enable_prefix_caching: bool = True
    ) -> None: ...
    def allocate(self, n: int) -> list[int]: ...
    def free(self, blocks: Sequence[int]) -> None: ...
    def ref_count(self, block: int) -> int: ...
    @property
    def num_free(self) -> int: ...
    @property
    def num_cached(self) -> int: ...
    def publish(self, block: int, parent_hash: int | None, token_ids: Sequence[int]) -> int:
        """Register a full, computed block in the prefix cache; returns its chained hash."""
    def match_prefix(self, token_ids: Sequence[int]) -> list[int]:
        """Longest chain of cached full blocks for these tokens, never covering the last
        token; takes a reference on each block returned."""

def _paged_decode_attention(
    out: int,
    q: int,
    k_cache: int,
    v_cache: int,
    block_tables: npt.NDArray[np.int32],
    seq_lens: npt.NDArray[np.int32],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    num_blocks: int,
    sliding_window: int,
    scale: float,
    bf16: bool,
    threads: int,
    openmp: tuple[int, int, int] | None = None,
    softcap: float = 0.0,
    sinks: int = 0,
) -> None:
    """Decode attention over raw CPU tensor addresses (``softcap`` 0: off, else each score
    becomes ``softcap * tanh(score / softcap)``; ``sinks`` 0: none, else the address of
    ``num_heads`` float32 sink logits); call it through
    ``iron_batch.attention.cpu_kernel``, which validates every tensor first."""

def _add_rms_norm(
    out: int,
    residual: int,
    delta: int,
    weight: int,
    *,
    rows: int,
    dim: int,
    eps: float,
    bf16: bool,
    threads: int,
    openmp: tuple[int, int, int] | None = None,
    round_once: bool = False,
) -> None:
    """Fused residual add + RMSNorm over raw CPU tensor addresses (delta 0: no add);
    ``round_once``: Gemma 4's rounding (normalized value times weight in float32, one
    rounding). Call it through ``iron_batch.layers.cpu_kernels``."""

def _rope_store_kv(
    q_out: int,
    k_cache: int,
    v_cache: int,
    qkv: int,
    cos: int,
    sin: int,
    slots: npt.NDArray[np.int64],
    *,
    heads: int,
    kv_heads: int,
    head_dim: int,
    num_slots: int,
    bf16: bool,
    rotary_dim: int | None = None,
) -> None:
    """Rotary embedding + KV store over raw CPU tensor addresses (``cos``/``sin``
    [tokens, rotary_dim], None: head_dim); call it through ``iron_batch.layers.cpu_kernels``."""

def _paged_decode_attention_int8(
    out: int,
    q: int,
    k_cache: int,
    v_cache: int,
    block_tables: npt.NDArray[np.int32],
    seq_lens: npt.NDArray[np.int32],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    num_blocks: int,
    sliding_window: int,
    scale: float,
    bf16: bool,
    threads: int,
    openmp: tuple[int, int, int] | None = None,
    softcap: float = 0.0,
) -> None:
    """``_paged_decode_attention`` over int8 caches (rows of ``head_dim`` int8 values and
    their float32 scale); call it through ``iron_batch.attention.cpu_kernel``."""

def _rope_store_kv_int8(
    q_out: int,
    k_cache: int,
    v_cache: int,
    qkv: int,
    cos: int,
    sin: int,
    slots: npt.NDArray[np.int64],
    *,
    heads: int,
    kv_heads: int,
    head_dim: int,
    num_slots: int,
    bf16: bool,
    rotary_dim: int | None = None,
) -> None:
    """``_rope_store_kv`` into int8 caches (each row quantized with its own scale); call it
    through ``iron_batch.layers.cpu_kernels``."""

def _gated_activation(
    out: int, gate_up: int, *, rows: int, inter: int, activation: str, threads: int = 1,
    openmp: tuple[int, int, int] | None = None,
) -> None:
    """``act(gate) * up`` of bf16 ``gate_up`` [rows, 2 * inter] into ``out`` [rows, inter]
    (``activation``: "silu", "gelu_pytorch_tanh" / "gelu_tanh"), row ranges on up to
    ``threads`` threads; call it through ``iron_batch.layers.cpu_kernels``."""

def _gemv_bf16(
    out: int,
    x: int,
    weight: int,
    bias: int,
    *,
    rows: int,
    n: int,
    k: int,
    threads: int,
    openmp: tuple[int, int, int] | None = None,
) -> None:
    """``out = x @ weight.T (+ bias)`` for 1-2 bf16 rows over raw CPU tensor addresses;
    call it through ``iron_batch.layers.cpu_kernels.linear``."""

def _gemv_quant(
    out: int,
    x: int,
    kind: str,
    quants: int,
    scale: int,
    min: int,
    bias: int,
    *,
    rows: int,
    n: int,
    k: int,
    threads: int,
    openmp: tuple[int, int, int] | None = None,
) -> None:
    """``out = x @ W.T (+ bias)`` for bf16 rows against a quantized matrix (``kind`` "q4" or
    "q8") over raw CPU tensor addresses; call it through ``iron_batch.models.quant``."""

def _moe_route(
    ids: int,
    weights: int,
    logits: int,
    *,
    rows: int,
    experts: int,
    top_k: int,
    renormalize: bool,
    weights_in_float: bool,
) -> None:
    """A router's expert ids (i32) and weights (f32) ``[rows, top_k]`` from bf16 logits
    ``[rows, experts]``: softmax, torch.topk's choice, renormalised where asked; call it
    through ``iron_batch.layers.moe.Router``."""

def _moe_experts(
    out: int,
    x: int,
    ids: int,
    weights: int,
    gate_up_kind: str,
    gu_quants: int,
    gu_scale: int,
    gu_min: int,
    down_kind: str,
    dn_quants: int,
    dn_scale: int,
    dn_min: int,
    *,
    rows: int,
    top_k: int,
    experts: int,
    hidden: int,
    inter: int,
    activation: str,
    bf16: bool,
    threads: int,
    openmp: tuple[int, int, int] | None = None,
) -> None:
    """A decode step's selected experts (1-8 bf16 rows; stacked expert weights, "bf16",
    "q4" or "q8") over raw CPU tensor addresses; call it through
    ``iron_batch.layers.moe.MoE``."""

def _dequantize_bf16(
    out: int,
    kind: str,
    quants: int,
    scale: int,
    min: int,
    *,
    n: int,
    k: int,
    threads: int,
    openmp: tuple[int, int, int] | None = None,
) -> None:
    """The quantized matrix as bf16 into ``out``; call it through
    ``iron_batch.models.quant``."""

def _q4_layout(k: int) -> tuple[np.ndarray, np.ndarray]:
    """Where each weight of a ``k``-wide Q4 row lives: (int64 byte index, bool high nibble)
    arrays of ``k`` (the layout of ``rust/kernels/src/quant.rs``)."""

_ProjectionSpec = tuple[str, int, int, int, int, int, int]
#: (sliding window or 0, rotary_dim, rope_table, scale or None, softcap or 0, cache_group)
_AttentionSpec = tuple[int, int, int, float | None, float, int]
#: Gemma 4's: (head_dim, kv_heads (0: the stack's), norms round once, v norm, v from k,
#: kv_source or None, (gate, proj, norm address) of a per-layer-embedding block or None,
#: layer scalar or None)
#: A stacked expert projection: (kind, weight or quants, scale, min).
_ExpertsSpec = tuple[str, int, int, int]
#: A sparse MLP: (router, top_k, renormalize, weights in float, gate_up experts, down
#: experts, experts, inter, shared expert (gate_up, down, sigmoid gate or None) or None).
_MoeSpec = tuple[
    _ProjectionSpec, int, bool, bool, _ExpertsSpec, _ExpertsSpec, int, int,
    tuple[_ProjectionSpec, _ProjectionSpec, _ProjectionSpec | None] | None,
]
_ExtrasSpec = tuple[
    int, int, bool, bool, bool, int | None,
    tuple[_ProjectionSpec, _ProjectionSpec, int] | None, float | None, _MoeSpec | None,
]
_LayerSpec = tuple[
    tuple[int, int, int, int],
    tuple[int, int],
    tuple[int, int],
    list[_ProjectionSpec],
    str,
    _AttentionSpec,
    float,
    _ExtrasSpec,
]

class _DecoderStack:
    """A model's decoder layers by address, for one-call decode steps (see
    ``iron_batch.layers.decoder_stack``, which checks and keeps the tensors). Each layer:
    ((input, attention-output, pre-MLP, MLP-output norm; 0 absent), (q norm, its length),
    (k norm, its length), [qkv, o, gate_up, down] ([qkv, o] for a sparse layer),
    activation name, (sliding window or 0, rotary_dim, rope_table, scale or None, softcap
    or 0, cache_group), residual_scale, Gemma 4's extras and the sparse MLP); an activation
    the stack does not have is a ValueError."""

    def __init__(
        self,
        layers: list[_LayerSpec],
        *,
        hidden: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
    ) -> None: ...
    def set_caches(
        self,
        caches: list[tuple[int, int]],
        num_blocks: list[int],
        block_size: int,
        int8: bool = False,
    ) -> None: ...
    def decode(
        self,
        h: int,
        ropes: list[tuple[int, int, int]],
        groups: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
        *,
        scale: float,
        eps: float,
        threads: int,
        openmp: tuple[int, int, int] | None = None,
        per_layer: int = 0,
    ) -> None: ...

def _delta_rule_decode(
    states: int,
    slots: npt.NDArray[np.int64],
    q: int,
    k: int,
    v: int,
    g: int,
    beta: int,
    out: int,
    *,
    num_slots: int,
    heads: int,
    key_dim: int,
    value_dim: int,
    threads: int,
    openmp: tuple[int, int, int] | None = None,
) -> None: ...
def _delta_rule_chunk(
    state: int,
    q: int,
    k: int,
    v: int,
    g: int,
    beta: int,
    out: int,
    *,
    tokens: int,
    heads: int,
    key_dim: int,
    value_dim: int,
    threads: int,
    openmp: tuple[int, int, int] | None = None,
) -> None: ...
def _causal_conv(
    x: int,
    windows: int,
    weight: int,
    out: int,
    slots: npt.NDArray[np.int64] | None = None,
    *,
    tokens: int,
    num_slots: int,
    channels: int,
    kernel: int,
    bf16: bool,
    threads: int,
    openmp: tuple[int, int, int] | None = None,
) -> None: ...
