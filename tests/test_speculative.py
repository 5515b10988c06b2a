"""Speculative decoding (prompt lookup) through the public API: the same tokens as without
it, greedy and seeded, in float32 and bf16, on tiny random models and on SmolLM2; proposals
really get verified and accepted; every block is free afterwards."""

from __future__ import annotations

import httpx
import pytest
from conftest import ServerFactory
from iron_batch import LLM, SamplingParams

from tests import tiny_models


def _copy_prompts(vocab: int) -> list[list[int]]:
    """Prompts that repeat a phrase (what prompt lookup can copy), of a few lengths."""
    out = []
    for i in range(4):
        phrase = [(7 * i + 3 * j + 1) % vocab for j in range(5 + i)]
        out.append(phrase * (3 + i % 2) + phrase[:2])
    return out


def _run(llm_kwargs: dict, prompts: list[list[int]], params: SamplingParams) -> tuple:
    llm = LLM(**llm_kwargs)
    outs = llm.generate(prompts, params)
    stats = llm.engine.stats.scheduler
    assert stats["free_blocks"] == stats["total_blocks"], "blocks left held"
    return [o.token_ids for o in outs], stats


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_greedy_with_speculation_gives_the_tokens_of_greedy_without(name: str, dtype: str) -> None:
    path = str(tiny_models.checkpoint(name))
    common = dict(model=path, device="cpu", dtype=dtype, total_kv_blocks=256, kv_block_size=4)
    prompts = _copy_prompts(64)
    params = SamplingParams(max_new_tokens=40)
    want, _ = _run(common, prompts, params)
    for k in (1, 3, 6):
        got, stats = _run({**common, "num_speculative_tokens": k}, prompts, params)
        assert got == want, f"k={k}"
        assert stats["spec_drafted_tokens"] > 0
    # A random model on copy prompts falls into loops that lookup predicts.
    assert stats["spec_accepted_tokens"] > 0, stats


def test_seeded_sampling_gives_the_same_tokens_with_speculation() -> None:
    path = str(tiny_models.checkpoint("llama"))
    common = dict(model=path, device="cpu", total_kv_blocks=256, kv_block_size=4)
    prompts = _copy_prompts(64)
    params = [SamplingParams(max_new_tokens=30, temperature=t, top_k=k, top_p=p, min_p=m, seed=s)
              for (t, k, p, m, s) in [(0.1, 0, 1.0, 0.0, 1), (0.7, 20, 0.9, 0.0, 2),
                                      (0.1, 0, 1.0, 0.1, 3), (1.0, 5, 1.0, 0.0, 4)]]
    want = [o.token_ids for o in LLM(**common).generate(prompts, params)]
    llm = LLM(**common, num_speculative_tokens=4)
    got = [o.token_ids for o in llm.generate(prompts, params)]
    assert got == want
    # Low temperatures on a random model still pick what lookup proposes now and then.
    assert llm.engine.stats.scheduler["spec_accepted_tokens"] > 0


def test_requests_that_opt_out_or_use_penalties_do_not_speculate() -> None:
    path = str(tiny_models.checkpoint("llama"))
    common = dict(model=path, device="cpu", total_kv_blocks=256, kv_block_size=4)
    prompts = _copy_prompts(64)[:2]
    for params in (SamplingParams(max_new_tokens=20, speculate=False),
                   SamplingParams(max_new_tokens=20, repetition_penalty=1.3)):
        want = [o.token_ids for o in LLM(**common).generate(prompts, params)]
        llm = LLM(**common, num_speculative_tokens=4)
        got = llm.generate(prompts, params)
        assert [o.token_ids for o in got] == want
        assert llm.engine.stats.scheduler["spec_drafted_tokens"] == 0


def _logprob_run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list:
    """Per request: its tokens, and per token the (token, logprob, top alternatives) the
    engine streams, and its prompt logprobs."""
    from iron_batch.engine import Engine

    engine: Engine = llm.engine
    out = []
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"lp{id(llm)}-{i}", prompt, p)
    events: dict[str, list] = {}
    while engine.has_unfinished():
        for ev in engine.step():
            events.setdefault(ev.request_id, []).append(ev)
    for i in range(len(prompts)):
        evs = [e for e in events[f"lp{id(llm)}-{i}"] if e.token_id is not None]
        out.append(([e.token_id for e in evs],
                    [None if e.logprobs is None else (e.logprobs[0], e.logprobs[1])
                     for e in evs],
                    evs[0].prompt_logprobs))
    return out


def test_logprobs_and_prompt_logprobs_come_with_speculation_and_are_the_same() -> None:
    path = str(tiny_models.checkpoint("llama"))
    common = dict(model=path, device="cpu", dtype="float32", total_kv_blocks=256,
                  kv_block_size=4)
    prompts = _copy_prompts(64)
    params = [SamplingParams(max_new_tokens=30, logprobs=3, prompt_logprobs=2),
              SamplingParams(max_new_tokens=30, logprobs=0),
              SamplingParams(max_new_tokens=30),
              SamplingParams(max_new_tokens=30, logprobs=1, temperature=0.7, seed=5)]
    want = _logprob_run(LLM(**common), prompts, params)
    for kwargs in ({"num_speculative_tokens": 4}, {"speculative_model": path}):
        llm = LLM(**common, **kwargs)
        got = _logprob_run(llm, prompts, params)
        assert llm.engine.stats.scheduler["spec_accepted_tokens"] > 0, kwargs
        for (gt, glp, gp), (wt, wlp, wp), p in zip(got, want, params, strict=True):
            assert gt == wt
            if p.logprobs is None:
                assert all(x is None for x in glp)
                continue
            assert len(glp) == len(wt) and all(x is not None for x in glp)
            for (gv, galt), (wv, walt) in zip(glp, wlp, strict=True):
                assert gv == pytest.approx(wv, abs=1e-5)
                assert [t for t, _ in galt] == [t for t, _ in walt]
                assert [v for _, v in galt] == pytest.approx([v for _, v in walt], abs=1e-5)
            if p.prompt_logprobs is not None:
                assert gp is not None and len(gp) == len(wp)
                for g, w in zip(gp[1:], wp[1:], strict=True):
                    assert g[0] == pytest.approx(w[0], abs=1e-5)
        stats = llm.engine.stats.scheduler
        assert stats["free_blocks"] == stats["total_blocks"]


def test_speculating_and_plain_requests_share_steps_and_stop_where_they_would() -> None:
    path = str(tiny_models.checkpoint("llama"))
    common = dict(model=path, device="cpu", total_kv_blocks=256, kv_block_size=4)
    prompts = _copy_prompts(64)
    base = LLM(**common).generate(prompts, SamplingParams(max_new_tokens=30))
    # Stop on a token each request generates late in its run.
    params = [SamplingParams(max_new_tokens=30, stop_token_ids=[o.token_ids[20]],
                             speculate=i % 2 == 0, logprobs=None if i % 2 == 0 else 1)
              for i, o in enumerate(base)]
    want = [(o.token_ids, o.finish_reason) for o in LLM(**common).generate(prompts, params)]
    llm = LLM(**common, num_speculative_tokens=5)
    got = [(o.token_ids, o.finish_reason) for o in llm.generate(prompts, params)]
    assert got == want
    assert all(reason == "stop" for _, reason in got)


def test_a_small_pool_preempts_and_still_gives_the_same_tokens() -> None:
    path = str(tiny_models.checkpoint("llama"))
    prompts = _copy_prompts(64)
    params = SamplingParams(max_new_tokens=40)
    big, _ = _run(dict(model=path, device="cpu", total_kv_blocks=256, kv_block_size=4),
                  prompts, params)
    got, stats = _run(dict(model=path, device="cpu", total_kv_blocks=24, kv_block_size=4,
                           num_speculative_tokens=4), prompts, params)
    assert got == big
    assert stats["preemptions"] > 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_smollm2_greedy_is_unchanged_by_speculation(dtype: str) -> None:
    # In bf16 the verification rows run the one-call decode step and the GEMVs, whose rows
    # compute what a one-row decode step computes, bit for bit.
    common = dict(model="smollm2-135m", device="cpu", dtype=dtype, total_kv_blocks=128)
    text = ("def add(a, b):\n    return a + b\n\n"
            "Rewrite the function above with type hints:\n")
    llm = LLM(**common)
    tok = llm.backend.tokenizer
    prompt = tok.encode(text)
    params = SamplingParams(max_new_tokens=96)
    want = llm.generate([prompt], params)[0].token_ids
    spec = LLM(**common, num_speculative_tokens=4)
    got = spec.generate([prompt], params)[0].token_ids
    assert got == want
    assert spec.engine.stats.scheduler["spec_accepted_tokens"] > 0


def test_the_server_speculates_reports_it_and_lets_a_request_opt_out(
    start_server: ServerFactory,
) -> None:
    backend = tiny_models.backend("llama", total_kv_blocks=256, kv_block_size=4)
    srv = start_server(backend, total_kv_blocks=256, kv_block_size=4, num_speculative_tokens=4)
    bodies = [{"prompt_token_ids": p, "max_new_tokens": 30, "temperature": 0}
              for p in _copy_prompts(64)]

    def tokens(extra: dict) -> list[list[int]]:
        return [[line["token_id"] for line in srv.generate({**b, **extra})[1]
                 if line.get("token_id") is not None] for b in bodies]

    spec_tokens = tokens({})
    data = httpx.get(f"{srv.url}/metrics").json()
    assert data["spec_drafted_tokens"] > 0
    assert 0 < data["spec_accepted_tokens"] <= data["spec_drafted_tokens"]
    assert data["spec_acceptance_rate"] == round(
        data["spec_accepted_tokens"] / data["spec_drafted_tokens"], 4)
    text = httpx.get(f"{srv.url}/metrics", headers={"Accept": "text/plain"}).text
    assert f"iron_batch_spec_accepted_tokens_total {data['spec_accepted_tokens']}.0" in text
    # Opted out: nothing more is proposed, and the tokens are the same.
    assert tokens({"speculate": False}) == spec_tokens
    assert httpx.get(f"{srv.url}/metrics").json()["spec_drafted_tokens"] == data[
        "spec_drafted_tokens"]
    bad = httpx.post(f"{srv.url}/generate", json={**bodies[0], "speculate": "no"})
    assert bad.status_code == 400 and "speculate" in bad.text
    stats = srv.engine.stats.scheduler
    assert stats["free_blocks"] == stats["total_blocks"]
