"""/v1/embeddings with the official ``openai`` client, on a tiny random-weight Qwen3,
checked against transformers' final hidden states on the same weights (float32)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import tiny_models
import torch
from conftest import ServerHandle, ServerStarter
from iron_batch.backends.torch_backend import TorchBackend
from iron_batch.pooling import PoolingConfig, read_pooling_config
from iron_batch.tokenizer import Tokenizer

TEXTS = ["the cat sat on the mat", "a quick brown fox", "embeddings, pooled"]


def reference(ids: list[int], mode: str) -> np.ndarray:
    """transformers' final-normed hidden states of ``ids``, pooled and normalised."""
    model = tiny_models.reference_model("qwen3")
    with torch.no_grad():
        hidden = model.model(input_ids=torch.tensor([ids])).last_hidden_state[0]
    pooled = hidden[-1] if mode == "last" else hidden.mean(dim=0)
    vector = pooled.double().numpy()
    return vector / np.linalg.norm(vector)


def cosine(a: Any, b: Any) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def _server(starter: ServerStarter, mode: str, max_batch_tokens: int) -> ServerHandle:
    folder = tiny_models.checkpoint("qwen3")
    backend = TorchBackend.from_model(str(folder), device="cpu", dtype="float32",
                                      total_kv_blocks=256, kv_block_size=4)
    return starter(backend, total_kv_blocks=256, kv_block_size=4,
                   max_batch_tokens=max_batch_tokens, max_model_len=512,
                   app_options={"pooling": PoolingConfig(mode, True)})


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, ServerHandle]]:
    starter = ServerStarter()
    # A small token budget: longer inputs are prefilled in several chunks.
    yield {"last": _server(starter, "last", 16), "mean": _server(starter, "mean", 16)}
    starter.close()


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_folder(tiny_models.checkpoint("qwen3"))


def client(server: ServerHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize("mode", ["last", "mean"])
def test_embeddings_match_transformers(servers: dict[str, ServerHandle], tokenizer: Tokenizer,
                                       mode: str) -> None:
    server = servers[mode]
    out = client(server).embeddings.create(model="qwen3", input=TEXTS)  # base64 on the wire
    assert [d.index for d in out.data] == [0, 1, 2]
    for text, item in zip(TEXTS, out.data, strict=True):
        ids = tokenizer.encode(text)
        assert len(ids) > 16  # spans more than one prefill chunk
        vector = np.asarray(item.embedding)
        assert abs(np.linalg.norm(vector) - 1) < 1e-5
        assert cosine(vector, reference(ids, mode)) >= 0.9999
    assert out.usage.prompt_tokens == sum(len(tokenizer.encode(t)) for t in TEXTS)
    # Token ids and the float encoding give the same vectors.
    ids = [tokenizer.encode(t) for t in TEXTS]
    floats = client(server).embeddings.create(model="qwen3", input=ids,
                                              encoding_format="float")
    for a, b in zip(out.data, floats.data, strict=True):
        assert np.allclose(a.embedding, b.embedding, atol=1e-6)
    server.wait_idle()


def test_dimensions_keep_the_first_components_renormalised(
    servers: dict[str, ServerHandle], tokenizer: Tokenizer,
) -> None:
    server = servers["last"]
    out = client(server).embeddings.create(model="qwen3", input=TEXTS[0], dimensions=8)
    vector = np.asarray(out.data[0].embedding)
    assert vector.shape == (8,) and abs(np.linalg.norm(vector) - 1) < 1e-5
    expected = reference(tokenizer.encode(TEXTS[0]), "last")[:8]
    assert cosine(vector, expected) >= 0.9999


def test_embeddings_share_batches_with_generation(servers: dict[str, ServerHandle],
                                                  tokenizer: Tokenizer) -> None:
    server = servers["mean"]
    result: dict[str, Any] = {}

    def generate() -> None:
        result["gen"] = httpx.post(f"{server.url}/v1/completions", json={
            "prompt": "once upon a time", "max_tokens": 60, "temperature": 0}, timeout=120)

    thread = threading.Thread(target=generate)
    thread.start()
    out = client(server).embeddings.create(model="qwen3", input=TEXTS * 4)
    thread.join(120)
    assert result["gen"].status_code == 200
    assert result["gen"].json()["usage"]["completion_tokens"] == 60
    for text, item in zip(TEXTS * 4, out.data, strict=True):
        assert cosine(item.embedding, reference(tokenizer.encode(text), "mean")) >= 0.9999
    server.wait_idle()


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "input"),
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": 5}, "input"),
        ({"input": [1, 99999]}, "input"),
        ({"input": ["a"] * 500}, "input"),
        ({"input": "a" * 5000}, "input"),
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "hi", "dimensions": 0}, "dimensions"),
        ({"input": "hi", "dimensions": 10_000}, "dimensions"),
        ({"input": "hi", "dimensions": True}, "dimensions"),
        ({"input": "hi", "model": "nope"}, "model"),
    ],
)
def test_bad_input_is_a_400_and_changes_nothing(servers: dict[str, ServerHandle],
                                                body: dict[str, Any], param: str) -> None:
    server = servers["last"]
    before = server.engine.stats.scheduler["requests_added"]
    response = httpx.post(f"{server.url}/v1/embeddings", json=body, timeout=30)
    assert 400 <= response.status_code < 500, response.text
    assert response.json()["error"]["param"] == param
    assert server.engine.stats.scheduler["requests_added"] == before


def test_a_backend_without_hidden_states_says_so(start_server: Any) -> None:
    server = start_server()
    with pytest.raises(openai.BadRequestError, match="embeddings"):
        client(server).embeddings.create(model="mock", input=[[1, 2, 3]])


def test_pooling_follows_the_sentence_transformers_config(tmp_path: Path) -> None:
    assert read_pooling_config(tmp_path) == PoolingConfig("last", True)
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"pooling_mode_mean_tokens": True, "pooling_mode_lasttoken": False}))
    modules = [{"idx": 0, "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    assert read_pooling_config(tmp_path) == PoolingConfig("mean", False)
    modules.append({"idx": 2, "path": "2_Normalize",
                    "type": "sentence_transformers.models.Normalize"})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    assert read_pooling_config(tmp_path) == PoolingConfig("mean", True)
    assert read_pooling_config(tmp_path, "last") == PoolingConfig("last", True)


def test_the_offline_api_pools_too(tokenizer: Tokenizer) -> None:
    from iron_batch import LLM, SamplingParams

    llm = LLM(str(tiny_models.checkpoint("qwen3")), device="cpu", dtype="float32",
              total_kv_blocks=64, kv_block_size=4, max_batch_tokens=8)
    outs = llm.generate(TEXTS, SamplingParams(max_new_tokens=1, embed="mean"))
    for text, out in zip(TEXTS, outs, strict=True):
        assert cosine(out.embedding, reference(tokenizer.encode(text), "mean")) >= 0.9999
