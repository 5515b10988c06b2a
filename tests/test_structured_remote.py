"""Constrained decoding with the model in a worker process: the grammar travels with its
request in the EXECUTE frame and the worker's sampler enforces it, lookahead steps and
preemption included. A worker that cannot enforce grammars says so in its INFO, and the
server refuses constrained requests instead of sending them."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
from iron_batch import Engine, SamplingParams, SchedulerConfig, wire
from iron_batch.backends.remote import RemoteBackend
from iron_batch.structured import json_schema_grammar
from test_remote_backend import WorkerProcess, _assert_all_blocks_free, _mock_worker
from test_remote_backend import worker_factory as worker_factory  # noqa: F401 (fixture)
from test_wire_codec import LIMITS, execute_body, good_batch

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 16},
                   "rain": {"type": "boolean"}},
    "required": ["city", "rain"],
    "additionalProperties": False,
}


def test_the_grammar_setting_crosses_the_wire_as_text() -> None:
    grammar = json_schema_grammar(SCHEMA)
    fields = good_batch()
    fields["add_params"] = np.frombuffer(
        json.dumps([{"temperature": 0.5, "grammar": grammar}]).encode(), wire.U8
    )
    (add,) = wire.decode_execute(execute_body(fields), LIMITS).adds
    assert add[2]["grammar"] == grammar
    fields["add_params"] = np.frombuffer(b'[{"grammar": {"type": "object"}}]', wire.U8)
    with pytest.raises(wire.WireError, match="'grammar' has the wrong type"):
        wire.decode_execute(execute_body(fields), LIMITS)


def test_a_torch_worker_enforces_the_grammar_with_lookahead_and_preemption(
    worker_factory: list[WorkerProcess],  # noqa: F811
) -> None:
    w = WorkerProcess("--model", "smollm2-135m", "--device", "cpu", "--dtype", "float32",
                      "--total-kv-blocks", "8", "--kv-block-size", "16")
    worker_factory.append(w)
    w.start(timeout=120)
    be = RemoteBackend(w.url, steps_per_call=4, timeout=120)
    assert be.supports_structured_output
    tok = be.tokenizer
    assert tok is not None
    engine = Engine(be, SchedulerConfig(total_kv_blocks=8, kv_block_size=16,
                                        max_batch_tokens=256, max_running_seqs=3,
                                        max_model_len=be.max_model_len))
    grammar = json_schema_grammar(SCHEMA)
    for i, q in enumerate(("Weather in Paris as JSON.", "Is it raining in Oslo? JSON.",
                           "JSON weather report for Rome.")):
        prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]),
                            add_special_tokens=False)
        engine.add_request(f"r{i}", prompt, SamplingParams(
            max_new_tokens=40, grammar=grammar, temperature=0.9 * (i > 0), seed=i))
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for ev in engine.step():
            assert ev.finish_reason in (None, "stop"), ev
            if ev.token_id is not None:
                tokens.setdefault(ev.request_id, []).append(ev.token_id)
    assert engine.scheduler.stats()["preemptions"] > 0
    assert len(tokens) == 3
    for ids in tokens.values():
        jsonschema.validate(json.loads(tok.decode(ids)), SCHEMA)
    _assert_all_blocks_free(engine)


def test_a_mock_worker_refuses_grammars_at_admission(
    worker_factory: list[WorkerProcess],  # noqa: F811
) -> None:
    w = _mock_worker(worker_factory)
    be = RemoteBackend(w.url)
    assert not be.supports_structured_output
    engine = Engine(be, SchedulerConfig(total_kv_blocks=be.num_kv_blocks,
                                        kv_block_size=be.kv_block_size))
    engine.add_request("r", [5, 6], SamplingParams(grammar=json_schema_grammar(SCHEMA)))
    engine.add_request("ok", [5, 6], SamplingParams(max_new_tokens=3, ignore_eos=True))
    events = []
    while engine.has_unfinished():
        events.extend(engine.step())
    rejected = [e for e in events if e.request_id == "r"]
    assert [(e.finish_reason, "structured output" in (e.error or "")) for e in rejected] == [
        ("rejected", True)]
    assert sum(e.token_id is not None for e in events if e.request_id == "ok") == 3
    _assert_all_blocks_free(engine)
