"""Prompt scoring, as evaluation harnesses do it: every prompt token's logprob through
``/v1/completions`` with ``echo`` and ``logprobs``, compared position by position with
transformers' float32 log_softmax on the same tiny random-weight checkpoint: in one
prefill, in small chunks, after a warmed prefix cache, with preemption, and through the
remote worker. Also the tokenizer endpoints the harness's remote-tokenizer mode reads.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import torch
from conftest import ServerFactory, ServerHandle, ServerStarter
from iron_batch import LLM, Engine, SamplingParams, SchedulerConfig
from iron_batch.backends.remote import RemoteBackend
from iron_batch.backends.torch_backend import TorchBackend
from tiny_models import backend, checkpoint, random_prompts, reference_model

TOP = 3


def hf_logprobs(name: str, prompt: list[int]) -> torch.Tensor:
    """[len(prompt), vocab] float32 log_softmax of transformers' logits."""
    with torch.no_grad():
        logits = reference_model(name)(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def assert_prompt_logprobs_match(name: str, prompt: list[int], got: list[Any],
                                 top: int = TOP) -> None:
    """``got``: per prompt position None (first) or (logprob, [(id, logprob)])."""
    ref = hf_logprobs(name, prompt)
    assert len(got) == len(prompt)
    assert got[0] is None
    for i in range(1, len(prompt)):
        assert got[i] is not None, i
        chosen, alternatives = got[i]
        want = ref[i - 1]
        assert chosen == pytest.approx(want[prompt[i]].item(), abs=1e-4), i
        vals, ids = want.topk(top)
        assert [a for a, _ in alternatives] == ids.tolist(), i
        assert [v for _, v in alternatives] == pytest.approx(vals.tolist(), abs=1e-4), i


# ---------------------------------------------------------------------------- offline API


@pytest.mark.parametrize("name", ["llama", "qwen3"])
@pytest.mark.parametrize("max_batch_tokens", [512, 5])
def test_prompt_logprobs_equal_transformers_in_one_prefill_and_in_chunks(
    name: str, max_batch_tokens: int
) -> None:
    # Lengths around the 4-token block and the 5-token chunk; 1 has nothing to score; in
    # one prefill, 300 scored rows take more than one slice of the scorer's log_softmax.
    prompts = random_prompts(11, [1, 2, 4, 5, 9, 16, 23, 241])
    llm = LLM(backend=backend(name), max_batch_tokens=max_batch_tokens)
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=2, prompt_logprobs=TOP))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.prompt_logprobs is not None
        assert_prompt_logprobs_match(name, prompt, out.prompt_logprobs)
        assert len(out.token_ids) == 2
    stats = llm.engine.scheduler.stats()
    assert stats["free_blocks"] == stats["total_blocks"]


def test_prompt_logprobs_survive_preemption_and_skip_a_warm_prefix_cache() -> None:
    be = backend("llama")
    prompts = random_prompts(12, [14, 17, 11, 15, 13, 16])
    # 14 blocks of 4 for six prompts of 11-17 tokens and 12 new tokens each: preemption.
    llm = LLM(backend=be, total_kv_blocks=14, max_batch_tokens=8)
    warm = llm.generate(prompts[:2], SamplingParams(max_new_tokens=1))
    assert all(o.prompt_logprobs is None for o in warm)
    hits_before = llm.engine.scheduler.stats()["prefix_cache_hit_tokens"]
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=12, ignore_eos=True,
                                                prompt_logprobs=TOP))
    stats = llm.engine.scheduler.stats()
    assert stats["preemptions"] > 0
    # The warm prompts' blocks were cached, yet the scoring requests computed everything.
    assert stats["prefix_cache_hit_tokens"] == hits_before
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.prompt_logprobs is not None
        assert_prompt_logprobs_match("llama", prompt, out.prompt_logprobs)
    assert stats["free_blocks"] == stats["total_blocks"]


def test_prompt_logprobs_are_refused_by_a_backend_without_logits() -> None:
    from iron_batch.backends.mock import MockBackend

    llm = LLM(backend=MockBackend(0, 0))
    with pytest.raises(ValueError, match="prompt logprobs are not supported"):
        llm.generate([[5, 6, 7]], SamplingParams(prompt_logprobs=1))


# ---------------------------------------------------------------------------- HTTP


def _server(starter: ServerStarter, be: Any, **config: Any) -> ServerHandle:
    return starter(be, total_kv_blocks=be.num_kv_blocks, kv_block_size=be.kv_block_size,
                   max_model_len=be.max_model_len, **config)


@pytest.fixture(scope="module")
def tiny() -> Iterator[ServerHandle]:
    be = TorchBackend.from_model(str(checkpoint("llama")), device="cpu", dtype="float32",
                                 total_kv_blocks=256, kv_block_size=4)
    starter = ServerStarter()
    yield _server(starter, be, max_batch_tokens=6)  # every prompt here is chunked
    starter.close()


def client(srv: ServerHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60)


def score(srv: ServerHandle, prompt: Any, max_tokens: int = 1, logprobs: int = 1,
          **extra: Any) -> dict[str, Any]:
    """The harness's request, as lm_eval's local-completions sends it."""
    body = {"model": "llama", "prompt": prompt, "max_tokens": max_tokens, "echo": True,
            "logprobs": logprobs, "temperature": 0, "seed": 1234, **extra}
    response = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return dict(response.json())


def assert_http_scores_match(prompt: list[int], lp: dict[str, Any]) -> None:
    """A completions logprobs object's prompt part against transformers. Top alternatives
    are keyed by token text, and single bytes of multi-byte characters all read U+FFFD,
    so only their values are compared: the largest must be the model's top-1 (what the
    harness reads to decide greediness), and each one must be among the model's top-k."""
    ref = hf_logprobs("llama", prompt)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for i in range(1, len(prompt)):
        want = ref[i - 1]
        assert lp["token_logprobs"][i] == pytest.approx(want[prompt[i]].item(), abs=1e-4), i
        top = lp["top_logprobs"][i]
        vals = want.topk(TOP).values.tolist()
        assert max(top.values()) == pytest.approx(vals[0], abs=1e-4), i
        for v in top.values():
            assert min(abs(v - w) for w in vals) < 1e-4, i


def test_echo_logprobs_score_every_prompt_token_like_transformers(tiny: ServerHandle) -> None:
    prompts = random_prompts(5, [7, 13])
    out = score(tiny, prompts, logprobs=TOP)
    assert [c["index"] for c in out["choices"]] == [0, 1]
    for prompt, choice in zip(prompts, out["choices"], strict=True):
        lp = choice["logprobs"]
        # Every prompt token, then the one generated token.
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(prompt) + 1
        assert len(lp["top_logprobs"]) == len(lp["text_offset"]) == len(prompt) + 1
        assert_http_scores_match(prompt, lp)
        # The generated token is the greedy one and is the top-1 of its own position.
        ref = hf_logprobs("llama", prompt)[-1]
        assert lp["token_logprobs"][-1] == pytest.approx(ref.max().item(), abs=1e-4)
        assert max(lp["top_logprobs"][-1].values()) == lp["token_logprobs"][-1]
        assert choice["text"].startswith(backend("llama").tokenizer.decode(  # type: ignore
            prompt, skip_special_tokens=False))
        # The harness's greedy test: each position's top-1 value is in its top_logprobs.
        for i in range(1, len(prompt) + 1):
            assert max(lp["top_logprobs"][i].values()) >= lp["token_logprobs"][i]
    assert out["usage"]["prompt_tokens"] == sum(map(len, prompts))
    assert out["usage"]["completion_tokens"] == 2
    tiny.wait_idle()


def test_max_tokens_zero_scores_the_prompt_only(tiny: ServerHandle) -> None:
    prompt = random_prompts(6, [10])[0]
    out = score(tiny, prompt, max_tokens=0)
    (choice,) = out["choices"]
    lp = choice["logprobs"]
    assert len(lp["token_logprobs"]) == len(prompt)
    ref = hf_logprobs("llama", prompt)
    for i in range(1, len(prompt)):
        assert lp["token_logprobs"][i] == pytest.approx(ref[i - 1, prompt[i]].item(), abs=1e-4)
    assert choice["text"] == backend("llama").tokenizer.decode(  # type: ignore[union-attr]
        prompt, skip_special_tokens=False)
    assert out["usage"]["completion_tokens"] == 0
    tiny.wait_idle()


def test_a_warm_prefix_cache_does_not_change_the_scores(tiny: ServerHandle) -> None:
    prompt = random_prompts(7, [18])[0]
    c = client(tiny)
    plain = [c.completions.create(model="llama", prompt=prompt, max_tokens=1, temperature=0)
             for _ in range(2)]
    cached = plain[1].usage.prompt_tokens_details.cached_tokens  # type: ignore[union-attr]
    assert cached is not None and cached > 0, "the prompt is in the prefix cache"
    out = score(tiny, prompt)
    lp = out["choices"][0]["logprobs"]
    ref = hf_logprobs("llama", prompt)
    for i in range(1, len(prompt)):
        assert lp["token_logprobs"][i] == pytest.approx(ref[i - 1, prompt[i]].item(), abs=1e-4)
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    tiny.wait_idle()


def stream_choices(srv: ServerHandle, body: dict[str, Any]) -> dict[str, Any]:
    """POST a streaming completion; the one choice's text and logprobs, chunks joined."""
    import json

    text, lp = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    with httpx.stream("POST", f"{srv.url}/v1/completions", json={**body, "stream": True},
                      timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            (choice,) = json.loads(line[6:])["choices"]
            text += choice["text"]
            for key in lp:
                lp[key] += (choice["logprobs"] or {}).get(key, [])
    return {"text": text, "logprobs": lp}


@pytest.mark.parametrize("max_tokens", [0, 3])
def test_streamed_scoring_equals_the_whole_response(tiny: ServerHandle, max_tokens: int) -> None:
    body = {"prompt": random_prompts(8, [9])[0], "max_tokens": max_tokens, "echo": True,
            "logprobs": 2, "temperature": 0}
    whole = score(tiny, **body)["choices"][0]
    streamed = stream_choices(tiny, {"model": "llama", **body})
    assert streamed["text"] == whole["text"]
    assert streamed["logprobs"] == whole["logprobs"]
    assert len(whole["logprobs"]["tokens"]) == 9 + max_tokens
    tiny.wait_idle()


def test_scoring_bad_input_is_a_clear_400(tiny: ServerHandle, start_server: ServerFactory) -> None:
    body = {"prompt": [5, 6, 7], "echo": True, "logprobs": 1, "max_tokens": 1}
    r = httpx.post(f"{tiny.url}/v1/completions", json={**body, "logprobs": 21}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"
    mock = start_server()
    r = httpx.post(f"{mock.url}/v1/completions", json=body, timeout=10)
    assert r.status_code == 400
    assert "prompt logprobs are not supported" in r.json()["error"]["message"]
    mock.wait_idle()
    tiny.wait_idle()


def test_tokenizer_info_and_tokenize_for_remote_tokenizer_clients(tiny: ServerHandle,
                                                                  start_server: ServerFactory
                                                                  ) -> None:
    info = httpx.get(f"{tiny.url}/tokenizer_info", timeout=10).json()
    assert info["eos_token"] == "</s>" and info["bos_token"] == "<s>"
    assert info["pad_token"] is None  # the test tokenizer declares none
    assert "<|assistant|>" in info["chat_template"]
    assert info["model_max_length"] == 512
    # lm-eval resolves eos/bos ids by tokenizing their text without special tokens.
    for text, token_id in (("</s>", 2), ("<s>", 1)):
        r = httpx.post(f"{tiny.url}/tokenize",
                       json={"prompt": text, "add_special_tokens": False}, timeout=10)
        assert r.json()["tokens"] == [token_id]
    mock = start_server()
    r = httpx.get(f"{mock.url}/tokenizer_info", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "no_tokenizer"


# ---------------------------------------------------------------------------- remote worker


def test_scoring_and_logprobs_through_the_remote_worker(start_server: ServerFactory) -> None:
    from test_remote_backend import WorkerProcess

    w = WorkerProcess("--model", str(checkpoint("llama")), "--device", "cpu",
                      "--dtype", "float32", "--total-kv-blocks", "64", "--kv-block-size", "4")
    try:
        w.start()
        be = RemoteBackend(w.url)
        assert be.supports_prompt_logprobs
        srv = start_server(be, total_kv_blocks=be.num_kv_blocks,
                           kv_block_size=be.kv_block_size, max_model_len=be.max_model_len,
                           max_batch_tokens=5)
        prompts = random_prompts(9, [6, 12])
        out = score(srv, prompts, logprobs=TOP)
        for prompt, choice in zip(prompts, out["choices"], strict=True):
            lp = choice["logprobs"]
            assert len(lp["token_logprobs"]) == len(prompt) + 1
            assert_http_scores_match(prompt, lp)
            ref = hf_logprobs("llama", prompt)[-1]
            assert lp["token_logprobs"][-1] == pytest.approx(ref.max().item(), abs=1e-4)
        # Sampled-token logprobs come back too (one step per call).
        plain = client(srv).completions.create(model="llama", prompt=prompts[0], max_tokens=3,
                                               temperature=0, logprobs=2)
        lps = plain.choices[0].logprobs
        assert lps is not None and lps.token_logprobs is not None
        assert len(lps.token_logprobs) == 3
        assert all(lp_ is not None and lp_ <= 0 for lp_ in lps.token_logprobs)
        srv.wait_idle()
        be.close()
        # With several steps per call, sampled-token logprobs are refused up front.
        be4 = RemoteBackend(w.url, steps_per_call=4)
        engine = Engine(be4, SchedulerConfig(total_kv_blocks=be4.num_kv_blocks,
                                             kv_block_size=be4.kv_block_size))
        engine.add_request("x", [5, 6, 7], SamplingParams(logprobs=1))
        (event,) = engine.step()
        assert event.finish_reason == "rejected" and "steps-per-call 1" in (event.error or "")
        be4.close()
    finally:
        w.kill()
