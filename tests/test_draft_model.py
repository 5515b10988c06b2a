"""Speculative decoding with a draft model (``speculative_model``): the same tokens as
without it (greedy and seeded), with a draft that agrees (the model itself) and one that
mostly does not (another random model), under preemption and prefix hits; every block free
afterwards; a draft with another vocabulary is refused at load."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from conftest import ServerFactory
from iron_batch import LLM, SamplingParams
from iron_batch.backends.build import BackendConfigError

from tests import tiny_models


def _prompts() -> list[list[int]]:
    """Four prompts, two sharing a prefix of three blocks (of 4 tokens)."""
    shared = tiny_models.random_prompts(11, [12])[0]
    rest = tiny_models.random_prompts(12, [5, 9, 17, 3])
    return [shared + rest[0], rest[1], shared + rest[2], rest[3]]


def _run(kwargs: dict, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
         rounds: int = 1) -> tuple[list[list[int]], dict]:
    llm = LLM(**kwargs)
    outs = []
    for _ in range(rounds):  # a second round hits the prefix cache
        outs = [o.token_ids for o in llm.generate(prompts, params)]
    stats = llm.engine.stats.scheduler
    assert stats["free_blocks"] == stats["total_blocks"], "blocks left held"
    return outs, stats


def _common(name: str = "llama", blocks: int = 256) -> dict:
    return dict(model=str(tiny_models.checkpoint(name)), device="cpu", dtype="float32",
                total_kv_blocks=blocks, kv_block_size=4)


def _other_draft() -> str:
    """A random llama of one layer with the same tokenizer: its guesses are mostly wrong."""
    return str(tiny_models.variant_checkpoint("llama", (("num_hidden_layers", 1),)))


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_with_a_draft_gives_the_tokens_of_greedy_without(k: int) -> None:
    prompts = _prompts()
    params = SamplingParams(max_new_tokens=32)
    want, _ = _run(_common(), prompts, params)
    path = _common()["model"]
    got, stats = _run({**_common(), "speculative_model": path, "num_speculative_tokens": k},
                      prompts, params, rounds=2)
    assert got == want
    assert stats["prefix_cache_hit_tokens"] > 0
    # The model drafting for itself is right about every proposal.
    assert stats["spec_drafted_tokens"] > 0
    assert stats["spec_accepted_tokens"] == stats["spec_drafted_tokens"], stats
    got, stats = _run({**_common(), "speculative_model": _other_draft(),
                       "num_speculative_tokens": k}, prompts, params, rounds=2)
    assert got == want
    assert 0 < stats["spec_drafted_tokens"]
    assert stats["spec_accepted_tokens"] < stats["spec_drafted_tokens"], stats


def test_a_small_pool_preempts_and_a_draft_still_gives_the_same_tokens() -> None:
    prompts = _prompts()
    params = SamplingParams(max_new_tokens=40)
    want, _ = _run(_common(), prompts, params)
    for draft in (_common()["model"], _other_draft()):
        got, stats = _run({**_common(blocks=22), "speculative_model": draft,
                           "num_speculative_tokens": 4}, prompts, params)
        assert got == want
        assert stats["preemptions"] > 0
        assert stats["spec_drafted_tokens"] > 0
        if draft == _common()["model"]:
            # Its KV survives preemption (re-prefilled with the target's): always right.
            assert stats["spec_accepted_tokens"] == stats["spec_drafted_tokens"], stats


def test_seeded_sampling_with_a_draft_gives_the_same_tokens() -> None:
    prompts = _prompts()
    params = [SamplingParams(max_new_tokens=24, temperature=t, top_k=k, top_p=p, seed=s)
              for (t, k, p, s) in [(0.3, 0, 1.0, 1), (0.8, 20, 0.9, 2), (1.0, 0, 1.0, 3),
                                   (0.5, 5, 1.0, 4)]]
    want, _ = _run(_common(), prompts, params)
    got, stats = _run({**_common(), "speculative_model": _common()["model"],
                       "num_speculative_tokens": 3}, prompts, params)
    assert got == want
    assert stats["spec_accepted_tokens"] > 0


def test_requests_that_opt_out_still_match_and_draft_nothing() -> None:
    prompts = _prompts()
    params = SamplingParams(max_new_tokens=20, speculate=False)
    want, _ = _run(_common(), prompts, params)
    got, stats = _run({**_common(), "speculative_model": _common()["model"]}, prompts, params)
    assert got == want
    assert stats["spec_drafted_tokens"] == 0


def _other_vocabulary(tmp_path: Path) -> str:
    """The tiny llama with one more token in its tokenizer."""
    from tokenizers import Tokenizer

    folder = tmp_path / "other-vocab"
    shutil.copytree(tiny_models.checkpoint("llama"), folder)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_tokens(["<extra>"])
    tok.save(str(folder / "tokenizer.json"))
    return str(folder)


def test_a_draft_with_another_vocabulary_is_refused_at_load(tmp_path: Path) -> None:
    with pytest.raises(BackendConfigError, match="vocabulary .* differs from the target's"):
        LLM(**_common(), speculative_model=_other_vocabulary(tmp_path))


def test_the_server_refuses_a_draft_with_another_vocabulary_in_one_line(
    tmp_path: Path,
) -> None:
    base = [sys.executable, "-m", "iron_batch.server", "--backend", "torch", "--model",
            _common()["model"], "--device", "cpu", "--total-kv-blocks", "64",
            "--addr", "127.0.0.1:0", "--speculative-method", "draft"]
    cmd = [*base, "--speculative-model", _other_vocabulary(tmp_path)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2
    last = out.stderr.strip().splitlines()[-1]
    assert "--speculative-model" in last and "differs from the target's" in last
    # Flags that need each other.
    out = subprocess.run(base, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2
    assert "--speculative-method draft needs --speculative-model" in out.stderr


def test_the_server_drafts_and_reports_it(start_server: ServerFactory) -> None:
    from iron_batch.backends.torch_backend import TorchBackend

    path = _common()["model"]
    backend = TorchBackend.from_model(path, device="cpu", dtype="float32", total_kv_blocks=128,
                                      kv_block_size=4, speculative_model=_other_draft())
    srv = start_server(backend, total_kv_blocks=128, kv_block_size=4,
                       num_speculative_tokens=4, speculative_method="draft")
    prompts = _prompts()
    want = [o.token_ids for o in LLM(**_common()).generate(
        prompts, SamplingParams(max_new_tokens=20))]
    got = [[line["token_id"] for line in srv.generate(
        {"prompt_token_ids": p, "max_new_tokens": 20, "temperature": 0})[1]
        if line.get("token_id") is not None] for p in prompts]
    assert got == want
    data = httpx.get(f"{srv.url}/metrics").json()
    assert data["spec_drafted_tokens"] > 0, json.dumps(data)
    stats = srv.engine.stats.scheduler
    assert stats["free_blocks"] == stats["total_blocks"]


@pytest.mark.parametrize("quantization", [None, "int4"])
def test_smollm2_bf16_greedy_is_unchanged_by_a_draft(quantization: str | None) -> None:
    # SmolLM2 drafting for itself (bf16) or for its int4 copy: the verification rows run
    # the one-call decode step, whose rows compute what a one-row decode step computes.
    common = dict(model="smollm2-135m", device="cpu", dtype="bfloat16", total_kv_blocks=128)
    llm = LLM(**common)
    tok = llm.backend.tokenizer
    prompt = tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France? Answer in a sentence."}],
        add_generation_prompt=True))
    params = SamplingParams(max_new_tokens=48)
    want = llm.generate([prompt], params)[0].token_ids
    spec = LLM(**common, speculative_model="smollm2-135m",
               speculative_quantization=quantization)
    got = spec.generate([prompt], params)[0].token_ids
    assert got == want
    stats = spec.engine.stats.scheduler
    assert stats["spec_accepted_tokens"] > 0
    assert stats["free_blocks"] == stats["total_blocks"]
