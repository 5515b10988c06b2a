"""Gemma 4 with its mixture-of-experts layers (``enable_moe_block``) against transformers'
Gemma 4 causal LM: greedy tokens equal transformers' through the scheduler (chunked
prefill, preemption, prefix hits, wide batches, sliding layers on bounded memory, two
tensor-parallel ranks) with every expert of every layer chosen; every position's float32
logits agree; the experts' output equals transformers' router and experts when every and
when few experts are chosen; bf16 and int8 experts stay close to the float32 ones; decode
steps run layer by layer (the one-call decode stack has no experts)."""

from __future__ import annotations

import pytest
import torch
from iron_batch.backends.torch_backend import TorchBackend
from iron_batch.layers.moe import DECODE_MAX_ROWS, Router
from iron_batch.layers.quant import QuantWeight
from iron_batch.llm import LLM
from iron_batch.models.gemma4 import Gemma4Experts, Gemma4Layer
from iron_batch.sampling_params import SamplingParams
from tiny_models import (
    backend,
    checkpoint,
    hf_greedy,
    prefix_hit_run,
    random_prompts,
    reference_model,
    run_scheduler,
    sixteen_requests_run,
)

NAME = "gemma4_moe"


def _experts(be: TorchBackend) -> list[Gemma4Experts]:
    out = []
    for layer in be.model.layers:
        assert isinstance(layer, Gemma4Layer) and layer.experts is not None
        out.append(layer.experts)
    return out


def _expected(name: str, prompts: list[list[int]], max_new: list[int]) -> list[list[int]]:
    return [hf_greedy(name, p, n) for p, n in zip(prompts, max_new, strict=True)]


@pytest.fixture
def chosen(monkeypatch: pytest.MonkeyPatch) -> dict[int, set[int]]:
    """The experts each router (by ``id``) picks for some row while the test runs."""
    seen: dict[int, set[int]] = {}
    route = Router.__call__

    def recording(self: Router, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = route(self, x)
        seen.setdefault(id(self), set()).update(ids.flatten().tolist())
        return weights, ids

    monkeypatch.setattr(Router, "__call__", recording)
    return seen


def _every_expert_chosen(be: TorchBackend, chosen: dict[int, set[int]]) -> None:
    for i, e in enumerate(_experts(be)):
        assert chosen[id(e.moe.router)] == set(range(e.moe.num_experts)), f"layer {i}"


def test_the_config_puts_experts_in_every_layer_and_decodes_layer_by_layer() -> None:
    be = backend(NAME)
    c = be.model.config
    assert (c.num_experts, c.top_k, c.expert_intermediate_size) == (8, 2, 32)
    for e in _experts(be):
        assert e.moe.num_experts == 8 and e.moe.router.top_k == 2
        assert e.moe.gate_up.shape == (8 * 2 * 32, 64) and e.moe.down.shape == (8 * 64, 32)
    assert not be.model.one_call_decode and be.model.decoder is None
    # The dense model keeps the one-call stack where the switches give it one.
    assert backend("gemma4").model.one_call_decode


@pytest.mark.parametrize("name", [NAME, "gemma4_moe_plain"])
def test_chunked_prefill_and_preemption_are_exact_against_transformers(
    name: str, chosen: dict[int, set[int]]
) -> None:
    # Longer than the 20-token window; chunked prefill and preemption on a small pool.
    be = backend(name)
    prompts = random_prompts(11, [45, 7, 26, 3])
    outs, stats = run_scheduler(be, prompts, 16, max_batch_tokens=16, total_kv_blocks=24)
    assert outs == _expected(name, prompts, [16] * len(prompts))
    assert stats["preemptions"] > 0
    _every_expert_chosen(be, chosen)


def test_prefix_hits_match_transformers(chosen: dict[int, set[int]]) -> None:
    be = backend(NAME)
    prompts, outs = prefix_hit_run(be)
    assert outs == _expected(NAME, prompts, [10] * len(prompts))
    _every_expert_chosen(be, chosen)


def test_sixteen_concurrent_requests() -> None:
    prompts, max_new, outs = sixteen_requests_run(backend(NAME))
    assert outs == _expected(NAME, prompts, max_new)


def _reference_experts(i: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                        torch.Tensor]:
    """transformers' experts of layer ``i`` for the residual ``h`` (float32): their output,
    the experts each row chose, and each row's router probabilities."""
    layer = reference_model(NAME).model.layers[i]
    with torch.no_grad():
        x = h.float()
        probs, weights, ids = layer.router(x)
        return layer.experts(layer.pre_feedforward_layernorm_2(x), ids, weights), ids, probs


def test_experts_equal_transformers_when_every_and_when_few_are_chosen() -> None:
    for i, e in enumerate(_experts(backend(NAME))):
        torch.manual_seed(3 + i)
        wide = torch.randn(64, 64)
        want, ids, _ = _reference_experts(i, wide)
        assert set(ids.flatten().tolist()) == set(range(e.moe.num_experts))
        torch.testing.assert_close(e(wide), want, rtol=1e-5, atol=1e-5)
        one = wide[:1]
        torch.testing.assert_close(e(one), _reference_experts(i, one)[0], rtol=1e-5,
                                   atol=1e-5)


@pytest.mark.parametrize(("quantization", "tolerance"), [(None, 0.02), ("int8", 0.03)])
def test_bf16_and_int8_experts_stay_close_to_float32(
    quantization: str | None, tolerance: float
) -> None:
    """The Rust experts kernel (steps of few rows) and the grouped path from Python (more
    rows), with Gemma 4's expert scales in the routing weights, against transformers'
    float32 router and experts: each row routed as there unless its k-th and next
    experts' probabilities nearly tie, and the rows routed alike close."""
    be = TorchBackend.from_model(str(checkpoint(NAME)), device="cpu", dtype="bfloat16",
                                 total_kv_blocks=16, kv_block_size=4,
                                 quantization=quantization)
    # No one-call decode stack, even where the switches give the dense model one in bf16:
    # it has no experts.
    assert be.model.decoder is None
    torch.manual_seed(5)
    x = torch.randn(24, 64).bfloat16()
    for i, e in enumerate(_experts(be)):
        assert e.moe.decode_kernel
        assert isinstance(e.moe.gate_up.weight, QuantWeight) == (quantization == "int8")
        want, want_ids, probs = _reference_experts(i, x)
        k = e.moe.router.top_k
        _, ids = e.moe.router(e.router_norm(x) * e.router_scale * e.router_root)
        alike = (ids.sort(dim=1).values == want_ids.sort(dim=1).values).all(dim=1)
        top = probs.topk(k + 1, dim=1).values
        assert bool((alike | (top[:, k - 1] - top[:, k] < 0.01)).all()), i
        assert int(alike.sum()) >= 20
        for rows in (1, DECODE_MAX_ROWS, 24):
            got = e(x[:rows].contiguous()).float()
            keep = alike[:rows]
            err = (got[keep] - want[:rows][keep]).norm() / want[:rows][keep].norm()
            assert err < tolerance, (i, rows, float(err))


def test_two_ranks_give_transformers_tokens() -> None:
    # Each rank holds half of every expert's intermediate rows (and of the dense MLP's);
    # the router is whole on both. Chunked prefill and preemption on a small pool.
    prompts = random_prompts(11, [45, 7, 26, 3])
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    llm = LLM(model=str(checkpoint(NAME)), tensor_parallel_size=2, device="cpu",
              dtype="float32", kv_block_size=4, total_kv_blocks=24, max_batch_tokens=16)
    try:
        outs = [o.token_ids for o in llm.generate(prompts, params)]
        stats = llm.engine.scheduler.stats()
    finally:
        llm.close()
    assert stats["preemptions"] > 0
    assert stats["free_blocks"] == stats["total_blocks"]
    assert outs == _expected(NAME, prompts, [16] * len(prompts))
