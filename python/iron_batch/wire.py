"""Binary frames between the server's RemoteBackend and ``python -m iron_batch.worker``.

One persistent TCP connection carries length-prefixed frames; each request frame gets one
reply frame, in order. An overlapping server sends the next step's EXECUTE before the
previous reply is back (its placeholders name that reply's rows, which the worker fills in
itself), so the round trip hides behind the worker's compute; without overlap a step costs
one round trip (or less with several decode steps per call). Nothing is pickled and
nothing received is executed: the batch travels as raw little-endian numpy arrays, and the
few control messages (hello, model info, per-request sampling settings) are small JSON
objects.

Frame: a 12-byte header ``<4sBBHI`` = magic ``b"IBW1"``, kind, flags (0), reserved (0),
body length; then the body.

Array (in EXECUTE and RESULT bodies): a 16-byte header ``<BB6xII`` = dtype code
(1 int32, 2 int64, 3 uint8), ndim (1 or 2), dim0, dim1 (0 for 1-D); then the data, padded
to a multiple of 8 bytes so every array starts 8-byte aligned in the body and can be used
in place (``np.frombuffer``) without copying.

Kinds:
- HELLO (client -> worker, first frame): JSON ``{"protocol": PROTOCOL, "api_key": str | null}``.
- INFO (worker -> client): JSON with the model name, KV geometry, limits, tokenizer and
  the speculative methods whose proposals the worker verifies.
- EXECUTE: ``<II`` (steps K, array count) then the arrays of :data:`EXECUTE_FIELDS`.
- RESULT: one int64 array ``[num_samples, K]``, then a UTF-8 JSON object (uint8 array,
  empty when there is nothing to say) with the logprobs requests asked for:
  ``"logprobs"``: per sample row null or ``[chosen, [[id, logprob], ...]]`` (K = 1 only);
  ``"prompt_logprobs"``: request handle -> per prompt token null or the same pair, for
  requests whose prompt was completed in this batch. A step whose rows verify proposals
  (``num_proposed``, K = 1) answers ``[num_samples, 1 + max proposals]`` instead, each
  row's accepted tokens first, with ``"num_accepted"`` (one count per row) in the JSON and
  its logprobs one per accepted token.
- ERROR: a UTF-8 message. The worker answers any bad frame with one and keeps serving.

Every EXECUTE is checked whole (dtypes, shapes, consistency, id and slot ranges) before
anything in it is applied, because an out-of-range index reaching a CUDA kernel would take
down the whole worker, not just one request.
"""

from __future__ import annotations

import json
import socket
import struct
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import numpy as np

from iron_batch._core import DRAFTED_BY_BACKEND
from iron_batch.batch import BATCH_FIELDS, I64
from iron_batch.batch import I32 as I32  # re-exported: the codec's dtypes

MAGIC = b"IBW1"
#: 2: RESULT carries JSON extras (logprobs), EXECUTE the sequences' handles (main's v2).
#: 3: EXECUTE also carries the batch's placeholders (overlapped steps, several frames in
#: flight): both of the earlier, separately numbered v2 changes.
#: 4: EXECUTE carries the cache-group fields (other groups' slots and tables, table
#: offsets, recurrent state slots).
#: 5: EXECUTE carries ``num_proposed``: the worker verifies proposals.
#: 6: INFO lists the ``speculative_methods`` the worker verifies; a draft model's proposal
#: rows arrive as ``DRAFTED_BY_BACKEND`` for the worker's draft to fill.
PROTOCOL = 6
HEADER = struct.Struct("<4sBBHI")
_ARRAY_HEADER = struct.Struct("<BB6xII")
_EXECUTE_PREFIX = struct.Struct("<II")

#: Body limit before a client has authenticated: a hello is tiny, so a stranger cannot make
#: the worker allocate much.
MAX_HELLO_BODY = 4096
#: Default body limit after authentication (a large batch is a few MB).
MAX_BODY = 256 * 2**20
#: Most decode steps one EXECUTE may ask for.
MAX_STEPS = 64
#: Most proposed tokens a sample row may verify (the scheduler's own bound).
MAX_PROPOSED = 64

_DTYPES: dict[int, np.dtype[Any]] = {
    1: np.dtype("<i4"),
    2: np.dtype("<i8"),
    3: np.dtype("u1"),
}
_CODES = {dt: code for code, dt in _DTYPES.items()}

U8 = np.dtype("u1")


class Kind(IntEnum):
    HELLO = 1
    INFO = 2
    EXECUTE = 3
    RESULT = 4
    ERROR = 5


class WireError(ValueError):
    """A malformed frame: bad magic, lengths, dtypes, shapes or out-of-range values."""


# ---------------------------------------------------------------------------- framing


def pack_header(kind: Kind, body_len: int) -> bytes:
    return HEADER.pack(MAGIC, int(kind), 0, 0, body_len)


def parse_header(data: bytes | bytearray | memoryview, max_body: int) -> tuple[Kind, int]:
    magic, kind, flags, reserved, length = HEADER.unpack(data)
    if magic != MAGIC:
        raise WireError(f"bad magic {bytes(magic)!r} (expected {MAGIC!r})")
    if flags or reserved:
        raise WireError("nonzero flags/reserved header fields")
    try:
        k = Kind(kind)
    except ValueError:
        raise WireError(f"unknown frame kind {kind}") from None
    if length > max_body:
        raise WireError(f"frame body of {length} bytes exceeds the limit of {max_body}")
    return k, length


def recv_exact(sock: socket.socket, n: int) -> bytearray:
    """Read exactly ``n`` bytes; ConnectionError when the peer closes first."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("connection closed by peer")
        got += k
    return buf


def read_frame(sock: socket.socket, max_body: int) -> tuple[Kind, bytearray]:
    kind, length = parse_header(recv_exact(sock, HEADER.size), max_body)
    return kind, recv_exact(sock, length) if length else bytearray()


def write_frame(sock: socket.socket, kind: Kind, parts: list[bytes | memoryview]) -> None:
    body_len = sum(len(p) for p in parts)
    # One buffer, one send: with TCP_NODELAY, several small sends would be several packets.
    sock.sendall(b"".join([pack_header(kind, body_len), *parts]))


def write_json(sock: socket.socket, kind: Kind, obj: Any) -> None:
    write_frame(sock, kind, [json.dumps(obj, separators=(",", ":")).encode()])


def write_error(sock: socket.socket, message: str) -> None:
    write_frame(sock, Kind.ERROR, [message.encode("utf-8", "replace")])


def parse_json(body: bytes | bytearray) -> dict[str, Any]:
    try:
        obj = json.loads(bytes(body).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise WireError(f"bad JSON body: {exc}") from None
    if not isinstance(obj, dict):
        raise WireError("JSON body must be an object")
    return obj


# ---------------------------------------------------------------------------- arrays


def encode_array(a: np.ndarray) -> list[bytes | memoryview]:
    dt = a.dtype.newbyteorder("<") if a.dtype.byteorder == ">" else a.dtype
    code = _CODES.get(np.dtype(dt))
    if code is None or a.ndim not in (1, 2):
        raise WireError(f"cannot send a {a.ndim}-D {a.dtype} array")
    a = np.ascontiguousarray(a, dtype=_DTYPES[code])
    d0 = a.shape[0]
    d1 = a.shape[1] if a.ndim == 2 else 0
    parts: list[bytes | memoryview] = [_ARRAY_HEADER.pack(code, a.ndim, d0, d1)]
    if a.nbytes:
        parts.append(a.data.cast("B"))
    pad = -a.nbytes % 8
    if pad:
        parts.append(b"\0" * pad)
    return parts


def decode_arrays(body: bytearray, offset: int, count: int) -> list[np.ndarray]:
    """``count`` arrays from ``body`` at ``offset``; the body must end right after them."""
    out: list[np.ndarray] = []
    size = len(body)
    for i in range(count):
        if offset + _ARRAY_HEADER.size > size:
            raise WireError(f"array {i}: truncated header")
        code, ndim, d0, d1 = _ARRAY_HEADER.unpack_from(body, offset)
        offset += _ARRAY_HEADER.size
        dt = _DTYPES.get(code)
        if dt is None:
            raise WireError(f"array {i}: unknown dtype code {code}")
        if ndim == 1:
            if d1:
                raise WireError(f"array {i}: 1-D array with a second dimension")
            shape: tuple[int, ...] = (d0,)
        elif ndim == 2:
            shape = (d0, d1)
        else:
            raise WireError(f"array {i}: ndim {ndim} (1 or 2 expected)")
        nbytes = d0 * (d1 if ndim == 2 else 1) * dt.itemsize
        end = offset + nbytes
        if end > size:
            raise WireError(f"array {i}: {nbytes} bytes of data overrun the frame")
        out.append(np.frombuffer(body, dtype=dt, count=nbytes // dt.itemsize,
                                 offset=offset).reshape(shape))
        offset = end + (-nbytes % 8)
    if offset != size:
        raise WireError(f"{size - offset} trailing bytes after the arrays")
    return out


# ---------------------------------------------------------------------------- execute

#: The arrays of an EXECUTE body, in order, with dtypes: the batch's own arrays
#: (:data:`iron_batch.batch.BATCH_FIELDS`, N sample rows), then the request bookkeeping
#: (R removed and A added requests).
EXECUTE_FIELDS: tuple[tuple[str, np.dtype[Any]], ...] = (
    *((f.name, f.dtype) for f in BATCH_FIELDS),
    ("sample_handles", I64),  # [N] request handles of the sample rows
    ("remove_handles", I64),  # [R] requests ended since the last frame
    ("add_handles", I64),  # [A] requests new since the last frame
    ("add_prompt_lens", I64),  # [A]
    ("add_prompt_tokens", I64),  # [sum(add_prompt_lens)]
    ("add_params", U8),  # UTF-8 JSON list of A sampling-settings objects
    ("seq_handles", I64),  # [S] request handle of every sequence (prompt logprobs)
)

#: Sampling settings a worker accepts per request (everything else stays in the server).
PARAM_FIELDS: dict[str, tuple[type, ...]] = {
    "temperature": (int, float),
    "top_k": (int,),
    "top_p": (int, float),
    "min_p": (int, float),
    "seed": (int, type(None)),
    "repetition_penalty": (int, float),
    "presence_penalty": (int, float),
    "frequency_penalty": (int, float),
    "logprobs": (int, type(None)),
    "prompt_logprobs": (int, type(None)),
    # llguidance grammar text (structured output); the worker's sampler enforces it.
    "grammar": (str, type(None)),
}


@dataclass
class WorkerLimits:
    """What the worker's KV storage and model allow; every index is checked against it."""

    num_kv_blocks: int
    kv_block_size: int
    vocab_size: int
    max_model_len: int | None
    #: Whether a draft model fills proposal rows here: only then may they carry
    #: ``DRAFTED_BY_BACKEND``.
    drafts: bool = False


_NDIM = {f.name: f.ndim for f in BATCH_FIELDS}


class ExecuteRequest:
    """A decoded EXECUTE: ``steps``, each array of :data:`EXECUTE_FIELDS` but the add_*
    ones as an attribute of its name, and ``adds``: (handle, prompt token ids, sampling
    settings) of each new request."""

    def __init__(
        self, steps: int, arrays: dict[str, np.ndarray],
        adds: list[tuple[int, list[int], dict[str, Any]]],
    ) -> None:
        self.steps = steps
        self.__dict__.update(arrays)
        self.adds = adds

    def batch(self) -> dict[str, np.ndarray]:
        """The batch's own arrays (:data:`iron_batch.batch.BATCH_FIELDS`) by name."""
        return {f.name: self.__dict__[f.name] for f in BATCH_FIELDS}

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def encode_execute(
    steps: int,
    batch_arrays: list[np.ndarray],
    sample_handles: np.ndarray,
    remove_handles: list[int],
    adds: list[tuple[int, list[int], dict[str, Any]]],
    seq_handles: np.ndarray | None = None,
) -> list[bytes | memoryview]:
    """Body parts of an EXECUTE; ``batch_arrays`` are the batch's arrays in
    :data:`iron_batch.batch.BATCH_FIELDS` order (:func:`iron_batch.batch.batch_arrays`)."""
    lens = [len(p) for _, p, _ in adds]
    tokens = [t for _, p, _ in adds for t in p]
    arrays = [
        *batch_arrays,
        sample_handles,
        np.asarray(remove_handles, dtype=I64),
        np.asarray([h for h, _, _ in adds], dtype=I64),
        np.asarray(lens, dtype=I64),
        np.asarray(tokens, dtype=I64),
        np.frombuffer(
            json.dumps([s for _, _, s in adds], separators=(",", ":")).encode(), dtype=U8
        ),
        np.zeros(len(batch_arrays[4]), dtype=I64) if seq_handles is None else seq_handles,
    ]
    parts: list[bytes | memoryview] = [_EXECUTE_PREFIX.pack(steps, len(arrays))]
    for (_name, dt), a in zip(EXECUTE_FIELDS, arrays, strict=True):
        # The scheduler's own dtypes already match: no copy then.
        parts.extend(encode_array(a if a.dtype == dt else a.astype(dt)))
    return parts


def _fail_unless(ok: bool | np.bool_, message: str) -> None:
    if not ok:
        raise WireError(message)


def _check_params(obj: Any) -> dict[str, Any]:
    _fail_unless(isinstance(obj, dict), "sampling settings must be JSON objects")
    out: dict[str, Any] = {}
    for key, value in obj.items():
        types = PARAM_FIELDS.get(key)
        _fail_unless(types is not None, f"unknown sampling setting {key!r}")
        assert types is not None
        _fail_unless(
            isinstance(value, types) and not isinstance(value, bool),
            f"sampling setting {key!r} has the wrong type",
        )
        out[key] = value
    return out


def _check_cache_groups(named: dict[str, np.ndarray], t: int, s: int,
                        limits: WorkerLimits) -> None:
    """Shapes and ranges of the cache-group fields (G attention groups)."""
    slots, tables = named["group_slot_mapping"], named["group_block_tables"]
    offsets = named["block_table_offsets"]
    g = slots.shape[0] + 1
    _fail_unless(slots.shape[1] == t or (slots.shape[0] == 0 and slots.size == 0),
                 "group_slot_mapping must be [groups - 1, num_tokens]")
    _fail_unless(tables.shape[0] == (g - 1) * s, "group_block_tables must have a row per "
                 "sequence of each group after the first")
    _fail_unless(offsets.shape == (g, s) or (s == 0 and offsets.size == 0),
                 "block_table_offsets must be [groups, num_seqs]")
    if offsets.size:
        _fail_unless(offsets.min() >= 0, "negative block table offset")
    if slots.size:
        _fail_unless(slots.min() >= 0 and slots.max() < limits.num_kv_blocks
                     * limits.kv_block_size, "group slot out of range")
    if tables.size:
        _fail_unless(tables.min() >= 0 and tables.max() < limits.num_kv_blocks,
                     "group block id out of range")
    state = [named[n] for n in ("state_slots", "state_fresh", "state_restore", "state_save")]
    _fail_unless(all(len(a) == len(state[0]) for a in state)
                 and len(state[0]) in (0, s), "state arrays must be empty or one per sequence")
    if len(state[0]):
        _fail_unless(state[0].min() >= 0, "negative state slot")
        _fail_unless(bool(np.isin(state[1], (0, 1)).all()), "state_fresh must be 0 or 1")
        _fail_unless(state[2].min() >= -1 and state[3].min() >= -1,
                     "state checkpoint slots must be -1 or a slot")


def decode_execute(body: bytearray, limits: WorkerLimits) -> ExecuteRequest:
    """Parse and check an EXECUTE body whole; raises WireError naming the first problem."""
    _fail_unless(len(body) >= _EXECUTE_PREFIX.size, "truncated EXECUTE body")
    steps, count = _EXECUTE_PREFIX.unpack_from(body, 0)
    _fail_unless(1 <= steps <= MAX_STEPS, f"steps must be in 1..{MAX_STEPS}, got {steps}")
    _fail_unless(count == len(EXECUTE_FIELDS),
                 f"EXECUTE carries {count} arrays, expected {len(EXECUTE_FIELDS)}")
    arrays = decode_arrays(body, _EXECUTE_PREFIX.size, count)
    named: dict[str, np.ndarray] = {}
    for (name, dt), a in zip(EXECUTE_FIELDS, arrays, strict=True):
        # Checked before the message is formatted: a dtype's str() is slow Python code,
        # and this runs for every array of every frame.
        if a.dtype != dt:
            raise WireError(f"{name}: dtype {a.dtype}, expected {dt}")
        if a.ndim != _NDIM.get(name, 1):
            raise WireError(f"{name}: wrong ndim")
        named[name] = a

    bs = limits.kv_block_size
    ids, pos, slots = named["input_ids"], named["positions"], named["slot_mapping"]
    qsl, seq_lens = named["query_start_loc"], named["seq_lens"]
    before = named["num_computed_before"]
    tables = named["block_tables"]
    rows, row_seqs = named["sample_indices"], named["sample_seq_indices"]
    max_steps, handles = named["sample_max_steps"], named["sample_handles"]
    t, s, n = len(ids), len(seq_lens), len(rows)
    b = tables.shape[1]
    _fail_unless(len(pos) == t and len(slots) == t, "token arrays differ in length")
    _fail_unless(len(qsl) == s + 1, "query_start_loc must have num_seqs + 1 entries")
    _fail_unless(len(before) == s and tables.shape[0] == s
                 and len(named["seq_handles"]) == s, "sequence arrays differ in length")
    _fail_unless(len(row_seqs) == n and len(max_steps) == n and len(handles) == n,
                 "sample arrays differ in length")
    if t:
        _fail_unless(pos.min() >= 0, "negative position")
        _fail_unless(slots.min() >= 0 and slots.max() < limits.num_kv_blocks * bs,
                     "slot out of range")
    _fail_unless(qsl[0] == 0 and qsl[-1] == t, "query_start_loc must run from 0 to num_tokens")
    qlen = np.diff(qsl)
    _fail_unless(s == 0 or qlen.min() >= 1, "every sequence needs at least one token")
    _check_cache_groups(named, t, s, limits)
    # A sliding first group's table starts at its offset: it covers up to (offset + B) blocks.
    reach = (named["block_table_offsets"][0].astype(np.int64) + b) * bs if s else 0
    if s:
        _fail_unless(before.min() >= 0, "negative num_computed_before")
        _fail_unless(np.array_equal(seq_lens, before + qlen),
                     "seq_lens != num_computed_before + query length")
        _fail_unless(bool((seq_lens <= reach).all()), "a sequence outgrows its block table")
        if tables.size:
            _fail_unless(tables.min() >= 0 and tables.max() < limits.num_kv_blocks,
                         "block id out of range")
    if n:
        _fail_unless(row_seqs.min() >= 0 and row_seqs.max() < s, "sample row of no sequence")
        _fail_unless(n == 1 or np.diff(row_seqs).min() > 0, "sample sequences must increase")
        # A sample row is the last token of its sequence: the lookahead steps continue it.
        _fail_unless(np.array_equal(rows, qsl[row_seqs + 1] - 1),
                     "sample_indices must be each sampled sequence's last token")
        _fail_unless(max_steps.min() >= 1 and max_steps.max() <= steps,
                     "sample_max_steps out of 1..steps")
        # Lookahead step j writes position seq_lens + j - 1; the last one must fit the table.
        last = seq_lens[row_seqs].astype(np.int64) + max_steps - 2
        _fail_unless(bool((last < reach[row_seqs]).all()),
                     "lookahead steps outgrow the block table")
    proposed = named["num_proposed"]
    _fail_unless(len(proposed) == n, "num_proposed needs one entry per sample row")
    if n and proposed.any():
        _fail_unless(proposed.min() >= 0 and proposed.max() <= MAX_PROPOSED,
                     f"num_proposed out of 0..{MAX_PROPOSED}")
        _fail_unless(steps == 1, "proposals need steps == 1")
        _fail_unless(bool((proposed < qlen[row_seqs]).all()),
                     "a sample row's proposals outrun its sequence's query")
        if limits.drafts and ids.max() == DRAFTED_BY_BACKEND:
            # The proposal rows a draft model on the worker fills carry the core's
            # placeholder id; no other row may.
            first = (qsl[row_seqs + 1] - proposed).astype(np.int64)
            k = proposed.astype(np.int64)
            within = np.arange(int(k.sum())) - np.repeat(np.cumsum(k) - k, k)
            in_proposal = np.zeros(t, dtype=bool)
            in_proposal[np.repeat(first, k) + within] = True
            ids = ids[~(in_proposal & (ids == DRAFTED_BY_BACKEND))]
    if t:
        _fail_unless(len(ids) == 0 or (ids.min() >= 0 and ids.max() < limits.vocab_size),
                     "input id out of range")
    holes, hole_rows = named["pending_token_indices"], named["pending_sample_rows"]
    _fail_unless(len(holes) == len(hole_rows), "placeholder arrays differ in length")
    if len(holes):
        _fail_unless(holes.min() >= 0 and holes.max() < t, "placeholder of no token")
        _fail_unless(hole_rows.min() >= 0, "negative placeholder sample row")
        _fail_unless(steps == 1, "placeholders need steps == 1")
    if limits.max_model_len is not None and s:
        top = seq_lens.astype(np.int64)
        if n:
            top[row_seqs] += max_steps - 1
        _fail_unless(int(top.max()) <= limits.max_model_len, "sequence beyond max_model_len")

    add_handles, lens = named["add_handles"], named["add_prompt_lens"]
    tokens = named["add_prompt_tokens"]
    _fail_unless(len(lens) == len(add_handles), "add arrays differ in length")
    _fail_unless(len(lens) == 0 or lens.min() >= 0, "negative prompt length")
    _fail_unless(int(lens.sum()) == len(tokens), "prompt token count mismatch")
    try:
        settings = json.loads(named["add_params"].tobytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise WireError("add_params is not UTF-8 JSON") from None
    _fail_unless(isinstance(settings, list) and len(settings) == len(add_handles),
                 "add_params must be a JSON list with one object per added request")
    adds: list[tuple[int, list[int], dict[str, Any]]] = []
    start = 0
    for h, k, p in zip(add_handles.tolist(), lens.tolist(), settings, strict=True):
        adds.append((h, tokens[start : start + k].tolist(), _check_params(p)))
        start += k
    arrays = {name: a for name, a in named.items() if not name.startswith("add_")}
    return ExecuteRequest(steps, arrays, adds)


def encode_result(
    tokens: np.ndarray, extras: dict[str, Any] | None = None
) -> list[bytes | memoryview]:
    blob = json.dumps(extras, separators=(",", ":")).encode() if extras else b""
    return [*encode_array(np.ascontiguousarray(tokens, dtype=I64)),
            *encode_array(np.frombuffer(blob, dtype=U8))]


def _check_logprob_pair(value: Any, vocab_size: int) -> tuple[float, list[tuple[int, float]]]:
    ok = isinstance(value, list) and len(value) == 2 and isinstance(value[1], list)
    _fail_unless(ok, "a logprob entry must be [logprob, [[id, logprob], ...]]")
    chosen, alts = value
    _fail_unless(isinstance(chosen, (int, float)) and not isinstance(chosen, bool),
                 "a logprob must be a number")
    out: list[tuple[int, float]] = []
    for alt in alts:
        _fail_unless(isinstance(alt, list) and len(alt) == 2 and isinstance(alt[0], int)
                     and not isinstance(alt[0], bool) and 0 <= alt[0] < vocab_size
                     and isinstance(alt[1], (int, float)) and not isinstance(alt[1], bool),
                     "a top logprob must be [id in the vocabulary, logprob]")
        out.append((int(alt[0]), float(alt[1])))
    return float(chosen), out


def _parse_extras(blob: np.ndarray) -> dict[str, Any]:
    """A RESULT's JSON object (empty when the worker had nothing to say)."""
    if not blob.size:
        return {}
    try:
        extras = json.loads(blob.tobytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise WireError("result extras are not UTF-8 JSON") from None
    _fail_unless(isinstance(extras, dict), "result extras must be a JSON object")
    return extras


def _check_extras(extras: dict[str, Any], num_samples: int, vocab_size: int) -> dict[str, Any]:
    """The logprob extras, checked; ``num_samples``: logprob entries expected (sample
    rows, or accepted tokens)."""
    out: dict[str, Any] = {}
    rows = extras.get("logprobs")
    if rows is not None:
        _fail_unless(isinstance(rows, list) and len(rows) == num_samples,
                     "logprobs must have one entry per sample row")
        out["logprobs"] = [None if r is None else _check_logprob_pair(r, vocab_size)
                           for r in rows]
    prompts = extras.get("prompt_logprobs")
    if prompts is not None:
        _fail_unless(isinstance(prompts, dict), "prompt_logprobs must be an object")
        checked: dict[int, list[Any]] = {}
        for handle, entries in prompts.items():
            _fail_unless(isinstance(handle, str) and handle.isdigit(),
                         "prompt_logprobs keys must be request handles")
            _fail_unless(isinstance(entries, list), "prompt_logprobs values must be lists")
            checked[int(handle)] = [None if e is None else _check_logprob_pair(e, vocab_size)
                                    for e in entries]
        out["prompt_logprobs"] = checked
    return out


def decode_result(
    body: bytearray, num_samples: int, steps: int, vocab_size: int,
    proposed: np.ndarray | None = None,
) -> tuple[np.ndarray, dict[str, Any]]:
    """The sampled tokens ``[num_samples, steps]`` and the checked logprob extras. A step
    that verified proposals (``proposed``, per sample row, any > 0) answers
    ``[num_samples, 1 + max(proposed)]``, row ``r``'s accepted tokens first, and
    ``num_accepted`` in its extras (1 to ``proposed[r] + 1`` per row); its logprobs, if
    any, are one per accepted token, in that order."""
    tokens, blob = decode_arrays(body, 0, 2)
    if proposed is not None and not proposed.any():
        proposed = None
    width = steps if proposed is None else 1 + int(proposed.max())
    _fail_unless(tokens.dtype == I64 and tokens.shape == (num_samples, width),
                 f"result is {tokens.dtype}{tokens.shape}, expected int64({num_samples}, {width})")
    if tokens.size:
        _fail_unless(tokens.min() >= 0 and tokens.max() < vocab_size, "sampled id out of range")
    _fail_unless(blob.dtype == U8 and blob.ndim == 1, "result extras must be a byte array")
    raw = _parse_extras(blob)
    if proposed is None:
        return tokens, _check_extras(raw, num_samples, vocab_size)
    counts = raw.get("num_accepted")
    _fail_unless(isinstance(counts, list) and len(counts) == num_samples
                 and all(isinstance(c, int) and not isinstance(c, bool) for c in counts),
                 "a step with proposals needs num_accepted, one count per sample row")
    accepted = np.asarray(counts, dtype=np.int64)
    _fail_unless(bool((accepted >= 1).all() and (accepted <= proposed + 1).all()),
                 "num_accepted out of 1..proposals + 1")
    extras = _check_extras(raw, int(accepted.sum()), vocab_size)
    extras["num_accepted"] = accepted
    return tokens, extras
