"""The worker wire codec on its own: every way a frame can be refused, and round trips.

No worker process here: bodies are built in memory (and frames sent over a socket pair), so
each error path of ``iron_batch.wire`` is hit directly and named by its message.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import struct
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from iron_batch import wire
from iron_batch._core import DRAFTED_BY_BACKEND
from iron_batch.batch import BATCH_FIELDS
from iron_batch.wire import Kind, WireError

NUM_BATCH_FIELDS = len(BATCH_FIELDS)

LIMITS = wire.WorkerLimits(num_kv_blocks=8, kv_block_size=4, vocab_size=100, max_model_len=16)


# ---------------------------------------------------------------------------- helpers


def body_of(parts: list[bytes | memoryview]) -> bytearray:
    return bytearray(b"".join(bytes(p) for p in parts))


def arrays_body(arrays: list[np.ndarray]) -> bytearray:
    parts: list[bytes | memoryview] = []
    for a in arrays:
        parts.extend(wire.encode_array(a))
    return body_of(parts)


def good_batch() -> dict[str, np.ndarray]:
    """Two sequences in blocks of 4: "0" prefills 3 tokens in block 2, "1" decodes its 6th
    token in blocks 0 and 1 with one lookahead step; one request added, one removed."""
    i32, i64 = wire.I32, wire.I64
    return {
        "input_ids": np.array([5, 6, 7, 8], i64),
        "positions": np.array([0, 1, 2, 5], i64),
        "slot_mapping": np.array([8, 9, 10, 5], i64),
        "query_start_loc": np.array([0, 3, 4], i32),
        "seq_lens": np.array([3, 6], i32),
        "num_computed_before": np.array([0, 5], i32),
        "block_tables": np.array([[2, 0], [0, 1]], i32),
        "sample_indices": np.array([2, 3], i64),
        "sample_seq_indices": np.array([0, 1], i64),
        "sample_max_steps": np.array([1, 2], i32),
        "pending_token_indices": np.zeros(0, i64),
        "pending_sample_rows": np.zeros(0, i64),
        # One full-attention group and no state group: the cache-group fields are empty.
        "group_slot_mapping": np.zeros((0, 4), i64),
        "group_block_tables": np.zeros((0, 0), i32),
        "block_table_offsets": np.zeros((1, 2), i32),
        "state_slots": np.zeros(0, i32),
        "state_fresh": np.zeros(0, i32),
        "state_restore": np.zeros(0, i32),
        "state_save": np.zeros(0, i32),
        "num_proposed": np.zeros(2, i32),
        "sample_handles": np.array([10, 11], i64),
        "remove_handles": np.array([3], i64),
        "add_handles": np.array([10], i64),
        "add_prompt_lens": np.array([3], i64),
        "add_prompt_tokens": np.array([5, 6, 7], i64),
        "add_params": np.frombuffer(b'[{"temperature":0.5,"seed":null}]', wire.U8),
        "seq_handles": np.array([10, 11], i64),
    }


def execute_body(
    fields: dict[str, np.ndarray], steps: int = 2, count: int | None = None
) -> bytearray:
    """An EXECUTE body of exactly these arrays, dtypes as given (no casting)."""
    arrays = list(fields.values())
    prefix = struct.pack("<II", steps, len(arrays) if count is None else count)
    return bytearray(prefix) + arrays_body(arrays)


def with_(**changes: Any) -> dict[str, np.ndarray]:
    fields = good_batch()
    for name, value in changes.items():
        fields[name] = value if isinstance(value, np.ndarray) else np.asarray(
            value, fields[name].dtype
        )
    return fields


def refused(body: bytearray, limits: wire.WorkerLimits = LIMITS) -> str:
    with pytest.raises(WireError) as exc:
        wire.decode_execute(body, limits)
    return str(exc.value)


# ---------------------------------------------------------------------------- headers


def test_a_header_round_trips_and_a_body_at_the_limit_is_allowed() -> None:
    header = wire.pack_header(Kind.EXECUTE, 4096)
    assert len(header) == wire.HEADER.size == 12
    assert wire.parse_header(header, max_body=4096) == (Kind.EXECUTE, 4096)


@pytest.mark.parametrize(
    ("header", "message"),
    [
        (b"IBW2" + bytes([1, 0, 0, 0]) + (0).to_bytes(4, "little"), "bad magic"),
        (b"IBW1" + bytes([1, 1, 0, 0]) + (0).to_bytes(4, "little"), "nonzero flags"),
        (b"IBW1" + bytes([1, 0, 0, 1]) + (0).to_bytes(4, "little"), "nonzero flags"),
        (b"IBW1" + bytes([0, 0, 0, 0]) + (0).to_bytes(4, "little"), "unknown frame kind 0"),
        (b"IBW1" + bytes([6, 0, 0, 0]) + (0).to_bytes(4, "little"), "unknown frame kind 6"),
        (b"IBW1" + bytes([1, 0, 0, 0]) + (101).to_bytes(4, "little"), "exceeds the limit of 100"),
    ],
)
def test_bad_headers_are_refused(header: bytes, message: str) -> None:
    with pytest.raises(WireError, match=message):
        wire.parse_header(header, max_body=100)


def test_a_peer_that_closes_mid_frame_is_a_connection_error() -> None:
    a, b = socket.socketpair()
    with a, b:
        a.sendall(wire.pack_header(Kind.RESULT, 10) + b"12345")
        a.close()
        with pytest.raises(ConnectionError):
            wire.read_frame(b, wire.MAX_BODY)


def test_an_empty_body_reads_as_empty() -> None:
    a, b = socket.socketpair()
    with a, b:
        wire.write_frame(a, Kind.ERROR, [])
        assert wire.read_frame(b, wire.MAX_BODY) == (Kind.ERROR, bytearray())


# ---------------------------------------------------------------------------- JSON


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"\xff\xfe", "bad JSON body"),
        (b"{not json", "bad JSON body"),
        (b"[1, 2]", "must be an object"),
        (b'"text"', "must be an object"),
    ],
)
def test_bad_json_bodies_are_refused(body: bytes, message: str) -> None:
    with pytest.raises(WireError, match=message):
        wire.parse_json(bytearray(body))


def test_json_frames_round_trip_over_a_socket() -> None:
    a, b = socket.socketpair()
    with a, b:
        wire.write_json(a, Kind.HELLO, {"protocol": wire.PROTOCOL, "api_key": "k\u00e9y"})
        kind, body = wire.read_frame(b, wire.MAX_HELLO_BODY)
        assert kind == Kind.HELLO
        assert wire.parse_json(body) == {"protocol": wire.PROTOCOL, "api_key": "k\u00e9y"}
        wire.write_error(a, "bad \udcff input")  # unencodable text is replaced, not an error
        kind, body = wire.read_frame(b, wire.MAX_BODY)
        assert kind == Kind.ERROR and body.decode() == "bad ? input"


# ---------------------------------------------------------------------------- arrays


@pytest.mark.parametrize(
    "array",
    [np.zeros(3, np.float64), np.zeros(3, np.int16), np.int64(5), np.zeros((1, 1, 1), np.int32)],
    ids=["float64", "int16", "0-D", "3-D"],
)
def test_arrays_the_codec_has_no_code_for_are_refused(array: np.ndarray) -> None:
    with pytest.raises(WireError, match="cannot send"):
        wire.encode_array(np.asarray(array))


def test_big_endian_and_strided_arrays_are_sent_as_their_values() -> None:
    big = np.array([1, -2, 3], dtype=">i4")
    strided = np.arange(12, dtype=np.int64).reshape(3, 4)[:, ::2]
    a, b = wire.decode_arrays(arrays_body([big, strided]), 0, 2)
    assert a.dtype == wire.I32 and a.tolist() == [1, -2, 3]
    assert b.dtype == wire.I64 and b.tolist() == strided.tolist()


def _array_header(code: int, ndim: int, d0: int, d1: int) -> bytes:
    return struct.pack("<BB6xII", code, ndim, d0, d1)


@pytest.mark.parametrize(
    ("body", "count", "message"),
    [
        (_array_header(1, 1, 2, 0)[:15], 1, "array 0: truncated header"),
        (_array_header(9, 1, 0, 0), 1, "array 0: unknown dtype code 9"),
        (_array_header(1, 1, 2, 3) + bytes(8), 1, "array 0: 1-D array with a second dimension"),
        (_array_header(1, 0, 0, 0), 1, r"array 0: ndim 0 \(1 or 2 expected\)"),
        (_array_header(1, 3, 1, 1) + bytes(8), 1, r"array 0: ndim 3"),
        (_array_header(2, 1, 2, 0) + bytes(15), 1, "array 0: 16 bytes of data overrun"),
        (_array_header(1, 2, 2, 3) + bytes(16), 1, "array 0: 24 bytes of data overrun"),
        (_array_header(3, 1, 8, 0) + bytes(8) + bytes(8), 1, "8 trailing bytes"),
        # The second array's header is the one cut short.
        (_array_header(3, 1, 1, 0) + bytes(8) + bytes(4), 2, "array 1: truncated header"),
    ],
)
def test_malformed_arrays_are_refused(body: bytes, count: int, message: str) -> None:
    with pytest.raises(WireError, match=message):
        wire.decode_arrays(bytearray(body), 0, count)


def test_an_array_padded_to_eight_bytes_fits_exactly() -> None:
    # Three uint8 values take 3 bytes plus 5 of padding; a header plus 8 bytes is whole.
    body = bytearray(_array_header(3, 1, 3, 0) + b"\x01\x02\x03" + bytes(5))
    (a,) = wire.decode_arrays(body, 0, 1)
    assert a.tolist() == [1, 2, 3]


# ---------------------------------------------------------------------------- execute


def test_a_good_execute_decodes_to_what_was_encoded() -> None:
    fields = good_batch()
    batch = [fields[name] for name, _ in wire.EXECUTE_FIELDS[:NUM_BATCH_FIELDS]]
    adds = [(10, [5, 6, 7], {"temperature": 0.5, "seed": None})]
    encoded = body_of(wire.encode_execute(2, batch, fields["sample_handles"], [3], adds,
                                          fields["seq_handles"]))
    assert encoded == execute_body(fields)
    req = wire.decode_execute(encoded, LIMITS)
    assert req.steps == 2 and req.num_seqs == 2 and req.num_tokens == 4
    for name, _ in wire.EXECUTE_FIELDS[: NUM_BATCH_FIELDS + 2]:
        assert np.array_equal(getattr(req, name), fields[name]), name
    assert req.adds == adds


def test_encode_execute_sends_each_field_in_its_own_dtype() -> None:
    # A caller's int32 ids or int64 lengths are converted, not sent as they are.
    fields = good_batch()
    batch = [fields[name].astype(np.int32 if dt == wire.I64 else np.int64)
             for name, dt in wire.EXECUTE_FIELDS[:NUM_BATCH_FIELDS]]
    handles = fields["sample_handles"].astype(np.int32)
    adds = [(10, [5, 6, 7], {"temperature": 0.5, "seed": None})]
    body = body_of(wire.encode_execute(2, batch, handles, [3], adds,
                                       fields["seq_handles"].astype(np.int32)))
    assert body == execute_body(fields)


@pytest.mark.parametrize(("steps", "ok"), [(0, False), (1, True), (wire.MAX_STEPS, True),
                                           (wire.MAX_STEPS + 1, False)])
def test_steps_must_be_in_range(steps: int, ok: bool) -> None:
    fields = with_(sample_max_steps=[1, 1])
    if ok:
        assert wire.decode_execute(execute_body(fields, steps=steps), LIMITS).steps == steps
    else:
        assert refused(execute_body(fields, steps=steps)).startswith("steps must be in 1..")


def test_placeholders_of_a_one_step_execute_are_accepted() -> None:
    fields = with_(sample_max_steps=[1, 1], pending_token_indices=[3],
                   pending_sample_rows=[5])
    req = wire.decode_execute(execute_body(fields, steps=1), LIMITS)
    assert req.pending_token_indices.tolist() == [3]
    assert req.pending_sample_rows.tolist() == [5]


def test_short_bodies_and_wrong_array_counts_are_refused() -> None:
    assert refused(bytearray(b"\x01\x00\x00\x00")) == "truncated EXECUTE body"
    # The 8-byte prefix alone is whole; the arrays it announces are what is missing.
    count = len(wire.EXECUTE_FIELDS)
    assert count == 27  # 20 batch arrays (placeholders, cache groups, proposals), 7 of bookkeeping
    assert refused(bytearray(struct.pack("<II", 1, count))) == "array 0: truncated header"
    fields = good_batch()
    assert f"carries {count - 1} arrays, expected {count}" in refused(
        execute_body(fields, count=count - 1)
    )


@pytest.mark.parametrize("name", [name for name, _ in wire.EXECUTE_FIELDS])
def test_each_field_must_have_its_dtype(name: str) -> None:
    fields = good_batch()
    dtype = wire.U8 if fields[name].dtype != wire.U8 else wire.I32
    fields[name] = fields[name].astype(dtype)
    assert refused(execute_body(fields)).startswith(f"{name}: dtype")


def test_each_field_must_have_its_rank() -> None:
    fields = with_(block_tables=np.array([2, 0, 0, 1], wire.I32))
    assert refused(execute_body(fields)) == "block_tables: wrong ndim"
    fields = with_(seq_lens=np.array([[3, 6]], wire.I32))
    assert refused(execute_body(fields)) == "seq_lens: wrong ndim"


Change = Callable[[dict[str, np.ndarray]], None]


def _set(**changes: Any) -> Change:
    def apply(fields: dict[str, np.ndarray]) -> None:
        for name, value in changes.items():
            fields[name] = np.asarray(value, fields[name].dtype)

    return apply


def _limits(**changes: Any) -> wire.WorkerLimits:
    return wire.WorkerLimits(**{**LIMITS.__dict__, **changes})


CONSISTENCY = [
    # (change, limits, message)
    (_set(positions=[0, 1, 2]), LIMITS, "token arrays differ in length"),
    (_set(slot_mapping=[8, 9, 10]), LIMITS, "token arrays differ in length"),
    (_set(query_start_loc=[0, 4]), LIMITS, "query_start_loc must have num_seqs + 1 entries"),
    (_set(num_computed_before=[0]), LIMITS, "sequence arrays differ in length"),
    (_set(block_tables=[[2, 0]]), LIMITS, "sequence arrays differ in length"),
    (_set(sample_seq_indices=[0]), LIMITS, "sample arrays differ in length"),
    (_set(sample_max_steps=[1]), LIMITS, "sample arrays differ in length"),
    (_set(sample_handles=[10]), LIMITS, "sample arrays differ in length"),
    (_set(input_ids=[5, 6, -1, 8]), LIMITS, "input id out of range"),
    (_set(input_ids=[5, 6, 100, 8]), LIMITS, "input id out of range"),
    (_set(positions=[-1, 1, 2, 5]), LIMITS, "negative position"),
    (_set(slot_mapping=[-1, 9, 10, 5]), LIMITS, "slot out of range"),
    (_set(slot_mapping=[8, 9, 32, 5]), LIMITS, "slot out of range"),
    (_set(query_start_loc=[1, 3, 4]), LIMITS, "query_start_loc must run from 0 to num_tokens"),
    (_set(query_start_loc=[0, 3, 3]), LIMITS, "query_start_loc must run from 0 to num_tokens"),
    (_set(query_start_loc=[0, 0, 4], seq_lens=[0, 9], num_computed_before=[0, 5]), LIMITS,
     "every sequence needs at least one token"),
    (_set(num_computed_before=[-1, 5], seq_lens=[2, 6]), LIMITS, "negative num_computed_before"),
    (_set(seq_lens=[3, 7]), LIMITS, "seq_lens != num_computed_before + query length"),
    (_set(seq_lens=[3, 9], num_computed_before=[0, 8], sample_max_steps=[1, 1]), LIMITS,
     "a sequence outgrows its block table"),
    (_set(block_tables=[[8, 0], [0, 1]]), LIMITS, "block id out of range"),
    (_set(block_tables=[[-1, 0], [0, 1]]), LIMITS, "block id out of range"),
    (_set(sample_seq_indices=[0, 2]), LIMITS, "sample row of no sequence"),
    (_set(sample_seq_indices=[-1, 1]), LIMITS, "sample row of no sequence"),
    (_set(sample_seq_indices=[1, 1], sample_indices=[3, 3]), LIMITS,
     "sample sequences must increase"),
    (_set(sample_indices=[1, 3]), LIMITS,
     "sample_indices must be each sampled sequence's last token"),
    (_set(sample_max_steps=[0, 2]), LIMITS, "sample_max_steps out of 1..steps"),
    (_set(sample_max_steps=[1, 3]), LIMITS, "sample_max_steps out of 1..steps"),
    # Sequence 1 holds 6 tokens in 8 slots: a third step would write position 8.
    (_set(seq_lens=[3, 7], num_computed_before=[0, 6], sample_max_steps=[1, 2],
          positions=[0, 1, 2, 6]), _limits(max_model_len=None), None),
    (_set(seq_lens=[3, 8], num_computed_before=[0, 7], sample_max_steps=[1, 2],
          positions=[0, 1, 2, 7]), LIMITS, "lookahead steps outgrow the block table"),
    # 6 tokens plus one lookahead step need a context of 7.
    (_set(), _limits(max_model_len=7), None),
    (_set(), _limits(max_model_len=6), "sequence beyond max_model_len"),
    (_set(pending_token_indices=[3], pending_sample_rows=[]), LIMITS,
     "placeholder arrays differ in length"),
    (_set(pending_token_indices=[4], pending_sample_rows=[0]), LIMITS, "placeholder of no token"),
    (_set(pending_token_indices=[-1], pending_sample_rows=[0]), LIMITS,
     "placeholder of no token"),
    (_set(pending_token_indices=[3], pending_sample_rows=[-1]), LIMITS,
     "negative placeholder sample row"),
    # Placeholders come from an overlapped step, which never has lookahead.
    (_set(pending_token_indices=[3], pending_sample_rows=[0]), LIMITS,
     "placeholders need steps == 1"),
    (_set(add_prompt_lens=[3, 0]), LIMITS, "add arrays differ in length"),
    (_set(add_prompt_lens=[-1], add_prompt_tokens=[]), LIMITS, "negative prompt length"),
    (_set(add_prompt_lens=[2]), LIMITS, "prompt token count mismatch"),
    (_set(add_params=np.frombuffer(b"\xff[]", wire.U8)), LIMITS, "add_params is not UTF-8 JSON"),
    (_set(add_params=np.frombuffer(b"[{}", wire.U8)), LIMITS, "add_params is not UTF-8 JSON"),
    (_set(add_params=np.frombuffer(b"{}", wire.U8)), LIMITS,
     "add_params must be a JSON list with one object per added request"),
    (_set(add_params=np.frombuffer(b"[{},{}]", wire.U8)), LIMITS,
     "add_params must be a JSON list with one object per added request"),
    (_set(add_params=np.frombuffer(b"[3]", wire.U8)), LIMITS,
     "sampling settings must be JSON objects"),
    (_set(add_params=np.frombuffer(b'[{"beam_width":2}]', wire.U8)), LIMITS,
     "unknown sampling setting 'beam_width'"),
    (_set(add_params=np.frombuffer(b'[{"top_k":1.5}]', wire.U8)), LIMITS,
     "sampling setting 'top_k' has the wrong type"),
    (_set(add_params=np.frombuffer(b'[{"temperature":true}]', wire.U8)), LIMITS,
     "sampling setting 'temperature' has the wrong type"),
    (_set(add_params=np.frombuffer(b'[{"seed":"7"}]', wire.U8)), LIMITS,
     "sampling setting 'seed' has the wrong type"),
]


@pytest.mark.parametrize(("change", "limits", "message"), CONSISTENCY)
def test_each_inconsistency_is_refused_by_name(
    change: Change, limits: wire.WorkerLimits, message: str | None
) -> None:
    fields = good_batch()
    change(fields)
    body = execute_body(fields)
    if message is None:
        wire.decode_execute(body, limits)  # the edge itself is allowed
    else:
        assert refused(body, limits) == message


def test_an_empty_step_is_allowed() -> None:
    two_d = {f.name for f in BATCH_FIELDS if f.ndim == 2}
    empty = {name: np.zeros((0, 0) if name in two_d else 0, dt)
             for name, dt in wire.EXECUTE_FIELDS}
    empty["query_start_loc"] = np.zeros(1, wire.I32)
    empty["add_params"] = np.frombuffer(b"[]", wire.U8)
    req = wire.decode_execute(execute_body(empty, steps=1), LIMITS)
    assert (req.num_seqs, req.num_tokens, req.adds) == (0, 0, [])


def test_proposals_to_verify_are_checked() -> None:
    """``num_proposed``: one count per sample row, within its sequence's query rows, and
    only in a step of its own (no lookahead)."""
    # Sequence 1 decodes its last token with two proposals: query rows 3..5.
    spec = dict(input_ids=[5, 6, 7, 8, 9, 10], positions=[0, 1, 2, 5, 6, 7],
                slot_mapping=[8, 9, 10, 5, 6, 7], query_start_loc=[0, 3, 6], seq_lens=[3, 8],
                sample_indices=[2, 5], sample_max_steps=[1, 1], num_proposed=[0, 2])
    req = wire.decode_execute(execute_body(with_(**spec), steps=1), LIMITS)
    assert req.num_proposed.tolist() == [0, 2]
    for changes, steps, message in [
        ({"num_proposed": [2]}, 1, "num_proposed needs one entry per sample row"),
        ({"num_proposed": [0, -1]}, 1, "num_proposed out of 0..64"),
        ({"num_proposed": [0, 65]}, 1, "num_proposed out of 0..64"),
        ({"num_proposed": [0, 3]}, 1, "a sample row's proposals outrun its sequence's query"),
        ({}, 2, "proposals need steps == 1"),
    ]:
        assert refused(execute_body(with_(**{**spec, **changes}), steps=steps)) == message
    # A draft model on the worker fills proposal rows that carry the core's placeholder id;
    # the placeholder anywhere else, or at a worker with no draft, is an id out of range.
    drafted = [5, 6, 7, 8, DRAFTED_BY_BACKEND, DRAFTED_BY_BACKEND]
    drafting = dataclasses.replace(LIMITS, drafts=True)
    req = wire.decode_execute(execute_body(with_(**{**spec, "input_ids": drafted}), steps=1),
                              drafting)
    assert req.input_ids.tolist() == drafted
    assert refused(execute_body(with_(**{**spec, "input_ids": drafted}), steps=1)) == (
        "input id out of range")
    for ids in ([5, 6, 7, DRAFTED_BY_BACKEND, 9, 10], [5, DRAFTED_BY_BACKEND, 7, 8, 9, 10]):
        with pytest.raises(WireError, match="input id out of range"):
            wire.decode_execute(execute_body(with_(**{**spec, "input_ids": ids}), steps=1),
                                drafting)


def test_a_verifying_steps_result_carries_its_accepted_tokens() -> None:
    """Rows that verified proposals answer with their accepted tokens, left-aligned, and
    ``num_accepted``; logprobs come one per accepted token."""
    proposed = np.array([2, 0, 1], np.int32)
    tokens = np.array([[4, 5, 6], [7, 0, 0], [8, 0, 0]], np.int64)
    extras = {"num_accepted": [3, 1, 1],
              "logprobs": [[-0.5, []], [-0.25, []], None, [-1.0, []], [-2.0, []]]}
    got, back = wire.decode_result(body_of(wire.encode_result(tokens, extras)), 3, 1, 10,
                                   proposed)
    assert np.array_equal(got, tokens) and back["num_accepted"].tolist() == [3, 1, 1]
    assert back["logprobs"][2] is None and len(back["logprobs"]) == 5
    for bad_tokens, bad, message in [
        (tokens, {}, "needs num_accepted"),
        (tokens, {"num_accepted": [3, 1]}, "needs num_accepted"),
        (tokens, {"num_accepted": [3, 0, 1]}, r"out of 1..proposals \+ 1"),
        (tokens, {"num_accepted": [3, 2, 1]}, r"out of 1..proposals \+ 1"),
        (tokens, {"num_accepted": [3, 1, 1], "logprobs": [None]}, "one entry per sample row"),
        (tokens[:, :2], {"num_accepted": [2, 1, 1]}, r"expected int64\(3, 3\)"),
    ]:
        with pytest.raises(WireError, match=message):
            wire.decode_result(body_of(wire.encode_result(bad_tokens, bad)), 3, 1, 10,
                               proposed)


# ---------------------------------------------------------------------------- results


def test_results_round_trip_and_are_checked() -> None:
    tokens = np.array([[0, 2], [3, 99]], np.int64)  # both ends of the vocabulary
    body = body_of(wire.encode_result(tokens))
    got, extras = wire.decode_result(body, 2, 2, 100)
    assert np.array_equal(got, tokens) and extras == {}
    with pytest.raises(WireError, match=r"result is int64\(2, 2\), expected int64\(2, 1\)"):
        wire.decode_result(body, 2, 1, 100)
    with pytest.raises(WireError, match="sampled id out of range"):
        wire.decode_result(body, 2, 2, 99)
    negative = body_of(wire.encode_result(np.array([[-1]])))
    with pytest.raises(WireError, match="sampled id out of range"):
        wire.decode_result(negative, 1, 1, 100)
    wrong_dtype = arrays_body([np.array([[1]], np.int32), np.zeros(0, wire.U8)])
    with pytest.raises(WireError, match=r"result is int32\(1, 1\)"):
        wire.decode_result(wrong_dtype, 1, 1, 100)


def test_result_logprobs_round_trip_and_are_checked() -> None:
    tokens = np.array([[4], [7]], np.int64)
    extras = {"logprobs": [[-0.5, [[4, -0.5], [9, -1.25]]], None],
              "prompt_logprobs": {"12": [None, [-2.0, [[3, -1.0]]]]}}
    got, back = wire.decode_result(body_of(wire.encode_result(tokens, extras)), 2, 1, 10)
    assert np.array_equal(got, tokens)
    assert back == {"logprobs": [(-0.5, [(4, -0.5), (9, -1.25)]), None],
                    "prompt_logprobs": {12: [None, (-2.0, [(3, -1.0)])]}}
    for bad, message in [
        ({"logprobs": [None]}, "one entry per sample row"),
        ({"logprobs": [[-1.0, [[10, -1.0]]], None]}, "id in the vocabulary"),
        ({"logprobs": [["x", []], None]}, "a logprob must be a number"),
        ({"prompt_logprobs": {"h": []}}, "request handles"),
        ({"prompt_logprobs": {"1": [[0.0]]}}, r"\[logprob, \[\[id, logprob\]"),
    ]:
        with pytest.raises(WireError, match=message):
            wire.decode_result(body_of(wire.encode_result(tokens, bad)), 2, 1, 10)
    garbage = arrays_body([tokens, np.frombuffer(b"{", wire.U8)])
    with pytest.raises(WireError, match="not UTF-8 JSON"):
        wire.decode_result(garbage, 2, 1, 10)


# ---------------------------------------------------------------------------- properties

DTYPES = [wire.I32, wire.I64, wire.U8]


@st.composite
def arrays(draw: st.DrawFn) -> np.ndarray:
    dt = draw(st.sampled_from(DTYPES))
    shape = draw(st.sampled_from([(draw(st.integers(0, 9)),),
                                  (draw(st.integers(0, 4)), draw(st.integers(0, 4)))]))
    info = np.iinfo(dt)
    values = draw(st.lists(st.integers(int(info.min), int(info.max)),
                           min_size=int(np.prod(shape)), max_size=int(np.prod(shape))))
    return np.array(values, dtype=dt).reshape(shape)


@settings(max_examples=200, deadline=None)
@given(st.lists(arrays(), max_size=5))
def test_arrays_round_trip_aligned(values: list[np.ndarray]) -> None:
    body = arrays_body(values)
    assert len(body) % 8 == 0
    decoded = wire.decode_arrays(body, 0, len(values))
    for got, want in zip(decoded, values, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert np.array_equal(got, want)


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(list(Kind)), st.binary(max_size=300))
def test_frames_round_trip_over_a_socket(kind: Kind, body: bytes) -> None:
    a, b = socket.socketpair()
    with a, b:
        # Split in two parts so the frame is joined from pieces as the codec does.
        wire.write_frame(a, kind, [body[:7], memoryview(body[7:])])
        assert wire.read_frame(b, max_body=300) == (kind, bytearray(body))


@st.composite
def batches(draw: st.DrawFn) -> tuple[int, dict[str, np.ndarray], list[Any], wire.WorkerLimits]:
    """A consistent EXECUTE as a scheduler would send it: sequences of random lengths, some
    sampled with lookahead, block tables sized to hold them."""
    bs = draw(st.integers(1, 4))
    steps = draw(st.integers(1, 4))
    n = draw(st.integers(0, 4))
    before = [draw(st.integers(0, 9)) for _ in range(n)]
    qlen = [draw(st.integers(1, 5)) for _ in range(n)]
    sampled = [draw(st.booleans()) for _ in range(n)]
    max_steps = [draw(st.integers(1, steps)) if s else 0 for s in sampled]
    lens = [b + q for b, q in zip(before, qlen, strict=True)]
    need = [-(-(ln + max(m, 1) - 1) // bs) for ln, m in zip(lens, max_steps, strict=True)]
    width = max(need, default=0)
    num_blocks = max(width, 1) * 2
    tables = [[draw(st.integers(0, num_blocks - 1)) for _ in range(width)] for _ in range(n)]
    positions = [p for b, ln in zip(before, lens, strict=True) for p in range(b, ln)]
    owner = [i for i, q in enumerate(qlen) for _ in range(q)]
    slots = [tables[i][p // bs] * bs + p % bs for i, p in zip(owner, positions, strict=True)]
    qsl = np.concatenate([[0], np.cumsum(qlen, dtype=np.int64)]).astype(np.int32)
    rows = [i for i in range(n) if sampled[i]]
    vocab = 50
    adds = [
        (draw(st.integers(0, 2**40)), draw(st.lists(st.integers(0, vocab - 1), max_size=4)),
         draw(st.fixed_dictionaries({}, optional={"temperature": st.floats(0, 2),
                                                  "top_k": st.integers(0, 50),
                                                  "seed": st.none() | st.integers(0, 99)})))
        for _ in range(draw(st.integers(0, 3)))
    ]
    i32, i64 = wire.I32, wire.I64
    fields = {
        "input_ids": np.array([draw(st.integers(0, vocab - 1)) for _ in positions], i64),
        "positions": np.array(positions, i64),
        "slot_mapping": np.array(slots, i64),
        "query_start_loc": qsl,
        "seq_lens": np.array(lens, i32),
        "num_computed_before": np.array(before, i32),
        "block_tables": np.array(tables, i32).reshape(n, width),
        "sample_indices": np.array([qsl[i + 1] - 1 for i in rows], i64),
        "sample_seq_indices": np.array(rows, i64),
        "sample_max_steps": np.array([max_steps[i] for i in rows], i32),
        "pending_token_indices": np.zeros(0, i64),
        "pending_sample_rows": np.zeros(0, i64),
        "group_slot_mapping": np.zeros((0, len(positions)), i64),
        "group_block_tables": np.zeros((0, 0), i32),
        "block_table_offsets": np.zeros((1, n), i32),
        "state_slots": np.zeros(0, i32),
        "state_fresh": np.zeros(0, i32),
        "state_restore": np.zeros(0, i32),
        "state_save": np.zeros(0, i32),
        "num_proposed": np.zeros(len(rows), i32),
        "sample_handles": np.array([draw(st.integers(0, 2**40)) for _ in rows], i64),
        "remove_handles": np.array(draw(st.lists(st.integers(0, 2**40), max_size=3)), i64),
        "seq_handles": np.array([draw(st.integers(0, 2**40)) for _ in range(n)], i64),
    }
    limits = wire.WorkerLimits(num_kv_blocks=num_blocks, kv_block_size=bs, vocab_size=vocab,
                               max_model_len=draw(st.none() | st.just(width * bs + steps)))
    return steps, fields, adds, limits


@settings(max_examples=200, deadline=None)
@given(batches())
def test_every_consistent_execute_round_trips(
    batch: tuple[int, dict[str, np.ndarray], list[Any], wire.WorkerLimits],
) -> None:
    steps, fields, adds, limits = batch
    arrays_ = [fields[name] for name, _ in wire.EXECUTE_FIELDS[:NUM_BATCH_FIELDS]]
    parts = wire.encode_execute(steps, arrays_, fields["sample_handles"],
                                fields["remove_handles"].tolist(), adds, fields["seq_handles"])
    req = wire.decode_execute(body_of(parts), limits)
    assert req.steps == steps
    for name, _ in wire.EXECUTE_FIELDS[: NUM_BATCH_FIELDS + 2]:
        got = getattr(req, name)
        assert got.dtype == fields[name].dtype and np.array_equal(got, fields[name]), name
    assert req.adds == [(h, p, json.loads(json.dumps(s))) for h, p, s in adds]


def hybrid_batch() -> dict[str, np.ndarray]:
    """good_batch with a second (sliding) attention group and a state group: sequence "1"
    has released its sliding group's block 0, so that table starts at logical block 1."""
    i32, i64 = wire.I32, wire.I64
    return with_(
        group_slot_mapping=np.array([[12, 13, 14, 21]], i64),
        group_block_tables=np.array([[3], [5]], i32),
        block_table_offsets=np.array([[0, 0], [0, 1]], i32),
        state_slots=np.array([0, 1], i32),
        state_fresh=np.array([1, 0], i32),
        state_restore=np.array([-1, -1], i32),
        state_save=np.array([2, -1], i32),
    )


def test_an_execute_with_cache_groups_decodes_to_what_was_encoded() -> None:
    fields = hybrid_batch()
    batch = [fields[name] for name, _ in wire.EXECUTE_FIELDS[:NUM_BATCH_FIELDS]]
    encoded = body_of(wire.encode_execute(2, batch, fields["sample_handles"], [3],
                                          [(10, [5, 6, 7], {"temperature": 0.5, "seed": None})],
                                          fields["seq_handles"]))
    req = wire.decode_execute(encoded, LIMITS)
    for name in ("group_slot_mapping", "group_block_tables", "block_table_offsets",
                 "state_slots", "state_fresh", "state_restore", "state_save"):
        assert np.array_equal(getattr(req, name), fields[name]), name
        assert np.array_equal(req.batch()[name], fields[name]), name


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"group_slot_mapping": np.zeros((1, 3), np.int64)}, "group_slot_mapping must be"),
        ({"group_block_tables": np.zeros((1, 1), np.int32)}, "group_block_tables must have"),
        ({"block_table_offsets": np.zeros((1, 2), np.int32)}, "block_table_offsets must be"),
        ({"block_table_offsets": np.array([[0, -1], [0, 0]], np.int32)}, "negative block"),
        ({"group_slot_mapping": np.array([[0, 1, 2, 10**6]], np.int64)}, "group slot out"),
        ({"group_block_tables": np.array([[3], [10**6]], np.int32)}, "group block id out"),
        ({"state_fresh": np.array([1], np.int32)}, "state arrays must be"),
        ({"state_slots": np.array([0, -1], np.int32)}, "negative state slot"),
        ({"state_fresh": np.array([2, 0], np.int32)}, "state_fresh must be 0 or 1"),
        ({"state_save": np.array([-2, 0], np.int32)}, "state checkpoint slots"),
        # The first group's offset moves its reach: sequence 1 reaches block 2 + 1 = 3.
        ({"block_table_offsets": np.array([[0, 0], [0, 1]], np.int32),
          "seq_lens": np.array([3, 9], np.int32),
          "num_computed_before": np.array([0, 8], np.int32)}, "outgrows its block table"),
    ],
)
def test_bad_cache_group_fields_are_refused(changes: dict[str, np.ndarray],
                                            message: str) -> None:
    fields = hybrid_batch()
    fields.update(changes)
    assert message in refused(execute_body(fields))


def test_a_sliding_first_group_may_reach_past_its_table_width() -> None:
    # Sequence 1 decodes position 9 from a table of 2 columns starting at logical block 1.
    fields = hybrid_batch()
    fields.update(block_table_offsets=np.array([[0, 1], [0, 1]], np.int32),
                  seq_lens=np.array([3, 10], np.int32),
                  num_computed_before=np.array([0, 9], np.int32),
                  sample_max_steps=np.array([1, 1], np.int32),
                  positions=np.array([0, 1, 2, 9], np.int64))
    req = wire.decode_execute(execute_body(fields), LIMITS)
    assert req.seq_lens.tolist() == [3, 10]
