"""Structured output (response_format, vLLM's guided fields) against SmolLM2-135M on CPU.

The model is tiny: asked for JSON without a grammar it rambles (one test shows it), with
one its output parses and validates every time, in any batch mix and under preemption.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest
import torch
from conftest import ServerHandle, ServerStarter
from iron_batch import Engine, SchedulerConfig
from iron_batch.backends.torch_backend import TorchBackend
from iron_batch.sampling import Sampler
from iron_batch.sampling_params import SamplingParams
from iron_batch.structured import (
    choice_grammar,
    json_schema_grammar,
    regex_grammar,
    strict_schema,
)
from iron_batch.structured.masking import GrammarMasker

MODEL = "smollm2-135m"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a person as JSON with name, age and city."}]


@pytest.fixture(scope="module")
def backend() -> TorchBackend:
    return TorchBackend.from_model(MODEL, device="cpu", total_kv_blocks=64)


@pytest.fixture(scope="module")
def smol(backend: TorchBackend) -> Iterator[ServerHandle]:
    starter = ServerStarter()
    yield starter(backend, total_kv_blocks=backend.num_kv_blocks,
                  kv_block_size=backend.kv_block_size, max_model_len=backend.max_model_len)
    starter.close()


@pytest.fixture(scope="module")
def client(smol: ServerHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{smol.url}/v1", api_key="unused", max_retries=0,
                         timeout=300)


def person_format() -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}


def test_json_schema_output_validates_in_a_mixed_batch(
    smol: ServerHandle, client: openai.OpenAI
) -> None:
    """Constrained and free requests at once, greedy and sampled: every constrained reply
    validates; the free ones are whatever the model says (not JSON, for this model)."""
    results: dict[str, Any] = {}

    def ask(key: str, **kw: Any) -> None:
        results[key] = client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=48, **kw  # type: ignore[arg-type]
        )

    jobs = [
        ("schema-greedy", {"temperature": 0, "response_format": person_format()}),
        ("schema-sampled", {"temperature": 1.0, "seed": 7,
                            "response_format": person_format()}),
        ("free", {"temperature": 0}),
        ("object", {"temperature": 0.7, "seed": 3,
                    "response_format": {"type": "json_object"}}),
    ]
    threads = [threading.Thread(target=ask, args=(k,), kwargs=kw) for k, kw in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for key in ("schema-greedy", "schema-sampled"):
        choice = results[key].choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    assert isinstance(json.loads(results["object"].choices[0].message.content), dict)
    free = results["free"].choices[0].message.content
    with pytest.raises((ValueError, jsonschema.ValidationError)):
        jsonschema.validate(json.loads(free), PERSON)
    smol.wait_idle()


def test_completions_endpoint_takes_response_format_and_streams_it(
    client: openai.OpenAI,
) -> None:
    kw: dict[str, Any] = dict(model=MODEL, prompt="A person in JSON:", max_tokens=48,
                              temperature=0, extra_body={"response_format": person_format()})
    full = client.completions.create(**kw).choices[0]
    assert full.finish_reason == "stop"
    jsonschema.validate(json.loads(full.text), PERSON)
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True))
    assert streamed == full.text


def test_vllm_regex_and_choice(client: openai.OpenAI) -> None:
    date = client.chat.completions.create(
        model=MODEL, max_tokens=16, temperature=0.8, seed=1,
        messages=[{"role": "user", "content": "When was the Eiffel Tower finished?"}],
        extra_body={"guided_regex": r"[12][0-9]{3}-[01][0-9]-[0-3][0-9]"},
    ).choices[0].message.content
    assert re.fullmatch(r"[12][0-9]{3}-[01][0-9]-[0-3][0-9]", date or ""), date
    choices = ["positive", "negative", "neutral"]
    for extra in ({"guided_choice": choices}, {"structured_outputs": {"choice": choices}}):
        label = client.chat.completions.create(
            model=MODEL, max_tokens=8, temperature=0,
            messages=[{"role": "user", "content": "Sentiment of 'I love it'?"}],
            extra_body=extra,
        ).choices[0].message.content
        assert label in choices


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"response_format": {"type": "json_schema",
                              "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
         "response_format.json_schema.schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"properties": {"a": {"$ref": "#/nowhere"}}}}}},
         "response_format.json_schema.schema"),
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ],
)
def test_invalid_constraint_is_a_400_before_anything_runs(
    smol: ServerHandle, body: dict[str, Any], param: str
) -> None:
    before = smol.engine.stats.scheduler["requests_added"]
    for path, extra in (("chat/completions", {"messages": ASK}), ("completions",
                                                                   {"prompt": "x"})):
        response = httpx.post(f"{smol.url}/v1/{path}", json={**extra, **body}, timeout=30)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param
        assert error["message"]
    assert smol.engine.stats.scheduler["requests_added"] == before


def test_the_mock_backend_refuses_constraints_with_a_400(start_server: Any) -> None:
    server = start_server(total_kv_blocks=64)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="does not support"):
        client.completions.create(model="mock", prompt=[1, 2, 3], max_tokens=4,
                                  extra_body={"response_format": {"type": "json_object"}})
    # And through the engine alone: the request is rejected at admission.
    engine = Engine(server.backend, SchedulerConfig(total_kv_blocks=8))
    engine.add_request("r", [1, 2], SamplingParams(grammar=json_schema_grammar(PERSON)))
    (event,) = engine.step()
    assert event.finish_reason == "rejected" and "mock backend" in (event.error or "")
    assert not engine.has_unfinished()


def test_preempted_constrained_requests_match_an_unpreempted_run(
    backend: TorchBackend,
) -> None:
    """A KV pool too small for the batch preempts and re-prefills sequences: the matcher,
    kept with the request's sampling state, must continue where it was, so the output
    equals a run that never preempted (greedy and seeded alike) and still validates."""
    tok = backend.tokenizer
    assert tok is not None
    grammar = json_schema_grammar(PERSON)
    prompts = [
        tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]),
                   add_special_tokens=False)
        for q in ("A person as JSON.", "Give me JSON for a person.", "JSON person please.")
    ]

    def run(blocks: int) -> tuple[dict[str, list[int]], dict[str, Any]]:
        engine = Engine(backend, SchedulerConfig(
            total_kv_blocks=blocks, kv_block_size=backend.kv_block_size,
            max_batch_tokens=256, max_running_seqs=3))
        for i, p in enumerate(prompts):
            params = SamplingParams(max_new_tokens=40, grammar=grammar,
                                    temperature=0.0 if i == 0 else 0.9, seed=i)
            engine.add_request(f"r{i}", p, params)
        tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
        while engine.has_unfinished():
            for ev in engine.step():
                assert ev.finish_reason in (None, "stop"), ev
                if ev.token_id is not None:
                    tokens[ev.request_id].append(ev.token_id)
        return tokens, engine.scheduler.stats()

    roomy, roomy_stats = run(64)
    assert roomy_stats["preemptions"] == 0
    # Each sequence needs up to 5 blocks of 16 slots; 8 cannot hold all three.
    tight, tight_stats = run(8)
    assert tight_stats["preemptions"] > 0
    assert tight == roomy
    assert tight_stats["free_blocks"] == tight_stats["total_blocks"]
    for ids in tight.values():
        text = tok.decode(ids)
        jsonschema.validate(json.loads(text), PERSON)


def test_masks_touch_only_the_constrained_rows(backend: TorchBackend) -> None:
    """One sampling step over a mixed batch: free rows (greedy and seeded) pick what they
    pick in a batch of their own; constrained rows pick only what their grammar allows."""
    tok = backend.tokenizer
    assert tok is not None
    vocab = backend.vocab_size
    masker = GrammarMasker(tok, vocab, backend.eos_token_ids)
    torch.manual_seed(0)
    logits = torch.randn(4, vocab) * 5
    kinds: list[SamplingParams] = [
        SamplingParams(),
        SamplingParams(grammar=choice_grammar(["yes", "no"]), temperature=1.0, seed=1),
        SamplingParams(temperature=1.0, seed=3),
        SamplingParams(grammar=regex_grammar("[0-9]{4}")),
    ]
    mixed = Sampler(vocab, torch.device("cpu"), masker)
    tokens, _ = mixed.sample(logits.clone(), [mixed.new_state([1], p) for p in kinds])
    plain = Sampler(vocab, torch.device("cpu"))
    alone, _ = plain.sample(logits[[0, 2]].clone(), [plain.new_state([1], kinds[i])
                                                      for i in (0, 2)])
    assert tokens[[0, 2]].tolist() == alone.tolist()
    assert tokens[0] == logits[0].argmax()
    assert tok.decode([int(tokens[1])]) in ("y", "ye", "yes", "n", "no")
    assert re.fullmatch(r"[0-9]{1,4}", tok.decode([int(tokens[3])]))


def test_strict_schema_closes_only_objects_that_list_their_properties() -> None:
    point = {"type": "object", "properties": {"x": {"type": "number"}}}
    schema = {
        "type": "object",
        "properties": {"where": point, "tags": {"type": "array", "items": point},
                       "meta": {"type": "object"},
                       "extra": {**point, "additionalProperties": {"type": "string"}}},
        "$defs": {"p": point},
        "allOf": [point],
    }
    strict = strict_schema(schema)
    assert "additionalProperties" not in schema  # the client's schema is left alone
    good = {"where": {"x": 1}, "tags": [{"x": 2}], "meta": {"any": "thing"},
            "extra": {"x": 3, "label": "ok"}}
    jsonschema.validate(good, strict)
    for bad in ({**good, "weather": "sunny"}, {**good, "where": {"x": 1, "y": 2}},
                {**good, "tags": [{"x": 2, "y": 3}]}):
        jsonschema.validate(bad, schema)  # plain JSON Schema takes undeclared properties
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, strict)
    assert strict["$defs"]["p"]["additionalProperties"] is False
    assert "additionalProperties" not in strict["allOf"][0]  # would forbid the others' names
    opened = strict_schema({**point, "additionalProperties": True})
    jsonschema.validate({"x": 1, "y": 2}, opened)
