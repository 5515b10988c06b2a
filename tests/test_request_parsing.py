"""Request parsing without HTTP: /generate and /v1 bodies become SamplingParams through the
same field table, so both front ends accept and refuse the same values, with one error shape."""

from __future__ import annotations

import json
from typing import Any

import pytest
from iron_batch.sampling_params import SamplingParams
from iron_batch.server.admission import ServerLimits, check_size
from iron_batch.server.errors import ApiError
from iron_batch.server.generate import parse_generate
from iron_batch.server.openai.protocol import ModelInfo, parse_completion
from iron_batch.server.openapi import openapi_schema

VOCAB = 1000
MODEL = ModelInfo(name="m", tokenizer=None, vocab_size=VOCAB, max_seq_tokens=4096)


def generate(**fields: Any) -> SamplingParams:
    raw = json.dumps({"prompt_token_ids": [1, 2, 3], **fields}).encode()
    return parse_generate(raw, None, VOCAB).params


def completion(model: ModelInfo = MODEL, **fields: Any) -> list[SamplingParams]:
    req = parse_completion({"prompt": [1, 2, 3], **fields}, model)
    return [p for choices in req.params for p in choices]


def refusal(parse: Any, **fields: Any) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse(**fields)
    return info.value


SHARED_BAD = [
    ("temperature", -0.5), ("temperature", 100.5), ("top_p", 0), ("top_p", 1.5),
    ("top_k", -2), ("top_k", 1.5), ("min_p", 2), ("repetition_penalty", 0),
    ("presence_penalty", 3), ("frequency_penalty", -3), ("seed", -1), ("seed", 2**63),
    ("seed", "7"), ("temperature", True), ("stop", ""), ("stop", [""]), ("stop", 5),
    ("stop_token_ids", [VOCAB]), ("stop_token_ids", [1.0]), ("ignore_eos", 1),
]


@pytest.mark.parametrize(("name", "value"), SHARED_BAD)
def test_both_front_ends_refuse_the_same_values_naming_the_field(name: str, value: Any) -> None:
    for parse in (generate, completion):
        error = refusal(parse, **{name: value})
        assert error.status == 400
        assert error.param == name, (parse.__name__, error)
        assert error.payload()["error"]["type"] == "invalid_request_error"


SHARED_EDGES = [
    ("temperature", 0), ("temperature", 100), ("top_p", 1), ("top_k", -1), ("min_p", 1),
    ("repetition_penalty", 100), ("presence_penalty", -2), ("frequency_penalty", 2),
    ("seed", 0), ("seed", 2**63 - 1),
]


@pytest.mark.parametrize(("name", "value"), SHARED_EDGES)
def test_both_front_ends_accept_the_edges(name: str, value: Any) -> None:
    assert getattr(generate(**{name: value}), name) == value
    assert getattr(completion(**{name: value})[0], name) == value


def test_strictness_differs_only_where_documented() -> None:
    # /generate: unknown fields and explicit nulls are errors; /v1 ignores / reads "absent".
    assert refusal(generate, beam_width=2).param == "beam_width"
    assert refusal(generate, temperature=None).param == "temperature"
    assert completion(beam_width=2, temperature=None)[0].temperature == 1.0
    # Defaults differ on purpose: /generate is greedy, OpenAI's temperature is 1.
    assert generate().temperature == 0.0


def test_choice_seeds_wrap_inside_the_seed_range() -> None:
    seeds = [p.seed for p in completion(seed=2**63 - 1, n=3)]
    assert seeds == [2**63 - 1, 0, 1]
    for seed in seeds:
        SamplingParams(seed=seed).validate()


def test_server_limits_give_one_error_on_both_front_ends() -> None:
    limits = ServerLimits(max_prompt_tokens=2, max_new_tokens=8)
    limited = ModelInfo(name="m", tokenizer=None, vocab_size=VOCAB, max_seq_tokens=4096,
                        limits=limits)
    too_long = refusal(completion, model=limited)
    assert (too_long.status, too_long.code, too_long.param) == (
        400, "context_length_exceeded", "prompt")
    too_many = refusal(completion, model=limited, prompt=[1], max_tokens=9)
    assert (too_many.status, too_many.param) == (400, "max_tokens")
    assert completion(model=limited, prompt=[1], max_tokens=8)[0].max_new_tokens == 8
    # /generate's request goes through the same check, naming its own fields.
    raw = json.dumps({"prompt_token_ids": [1, 2, 3], "max_new_tokens": 9}).encode()
    req = parse_generate(raw, None, VOCAB)
    with pytest.raises(ApiError) as info:
        check_size(limits, len(req.prompt_token_ids), req.params.max_new_tokens,
                   prompt_param=req.prompt_field, new_tokens_param="max_new_tokens")
    assert (info.value.code, info.value.param) == ("context_length_exceeded", "prompt_token_ids")


def test_error_body_has_one_shape() -> None:
    body = json.loads(ApiError("nope", param="x").body())
    assert body == {"error": {"message": "nope", "type": "invalid_request_error",
                              "param": "x", "code": None}}
    assert ApiError("k", status=401).type == "authentication_error"
    assert ApiError("s", status=503).type == "server_error"


def test_malformed_bodies_are_400s() -> None:
    for raw in (b"{nope", b"[1]", b'{"prompt_tokens": NaN}', b"\xff", b"[" * 100_000):
        with pytest.raises(ApiError) as info:
            parse_generate(raw, None, VOCAB)
        assert info.value.status == 400


def test_openapi_states_the_ranges_the_parsers_apply() -> None:
    schemas = openapi_schema("m")["components"]["schemas"]
    generate_seed = schemas["GenerateRequest"]["properties"]["seed"]
    completion_seed = schemas["CompletionRequest"]["properties"]["seed"]["anyOf"][0]
    assert generate_seed["minimum"] == completion_seed["minimum"] == 0
    assert generate_seed["maximum"] == completion_seed["maximum"] == 2**63 - 1
    top_p = schemas["GenerateRequest"]["properties"]["top_p"]
    assert top_p["exclusiveMinimum"] == 0 and top_p["maximum"] == 1
    refusal(generate, top_p=top_p["exclusiveMinimum"])
    generate(top_p=top_p["maximum"])
