"""Mixture-of-experts families (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE): float32 greedy tokens
equal transformers' through the scheduler (chunked prefill, prefix hits, preemption, wide
decode batches); the sparse layer equals transformers' block when every expert and when
few are chosen; tied router scores pick transformers' experts; bf16 and quantized experts
(the decode kernel over the selected experts' rows) stay close to the float32 block."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from iron_batch.backends.torch_backend import TorchBackend
from iron_batch.layers.moe import DECODE_MAX_ROWS, SMALL_EXPERTS_MAX_ROWS, MoE, Router
from iron_batch.models.registry import SUPPORTED_MODEL_TYPES
from iron_batch.platform import cpu, switches
from tiny_models import (
    backend,
    checkpoint,
    hf_greedy,
    prefix_hit_run,
    random_prompts,
    reference_model,
    run_scheduler,
    sixteen_requests_run,
    write_byte_tokenizer,
)

MOE_FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"]


def _expected(name: str, prompts: list[list[int]], max_new: list[int]) -> list[list[int]]:
    return [hf_greedy(name, p, n) for p, n in zip(prompts, max_new, strict=True)]


def test_the_moe_families_are_registered() -> None:
    for name in MOE_FAMILIES:
        assert name in SUPPORTED_MODEL_TYPES


@pytest.mark.parametrize("name", MOE_FAMILIES)
def test_chunked_prefill_and_prefix_hits_match_transformers(name: str) -> None:
    prompts, outs = prefix_hit_run(backend(name))
    assert outs == _expected(name, prompts, [10] * len(prompts))


@pytest.mark.parametrize("name", MOE_FAMILIES)
def test_preemption_keeps_output_exact(name: str) -> None:
    prompts = random_prompts(40, [9, 14, 6, 11, 17, 8, 12, 5])
    max_new = [22] * len(prompts)
    outs, stats = run_scheduler(backend(name), prompts, max_new, total_kv_blocks=18,
                                max_running_seqs=8)
    assert stats["preemptions"] > 0
    assert outs == _expected(name, prompts, max_new)


@pytest.mark.parametrize("name", MOE_FAMILIES)
def test_sixteen_concurrent_requests(name: str) -> None:
    prompts, max_new, outs = sixteen_requests_run(backend(name))
    assert outs == _expected(name, prompts, max_new)


def _sparse(be: TorchBackend) -> tuple[int, MoE]:
    i, layer = next((i, la) for i, la in enumerate(be.model.layers) if isinstance(la.mlp, MoE))
    assert isinstance(layer.mlp, MoE)
    return i, layer.mlp


def _reference_block(name: str, i: int, x: torch.Tensor) -> torch.Tensor:
    block = reference_model(name).model.layers[i].mlp
    with torch.no_grad():
        return block(x.float()[None])[0]


@pytest.mark.parametrize("name", MOE_FAMILIES)
def test_layer_equals_transformers_when_every_and_when_few_experts_are_chosen(
    name: str,
) -> None:
    i, moe = _sparse(backend(name))
    torch.manual_seed(3)
    wide = torch.randn(64, moe.router.weight.shape[1])
    _, ids = moe.router(wide)
    assert set(ids.flatten().tolist()) == set(range(moe.num_experts))  # every expert
    torch.testing.assert_close(moe(wide), _reference_block(name, i, wide), rtol=1e-5,
                               atol=1e-5)
    one = wide[:1]
    _, ids = moe.router(one)
    assert len(set(ids.flatten().tolist())) < moe.num_experts  # some expert unchosen
    torch.testing.assert_close(moe(one), _reference_block(name, i, one), rtol=1e-5,
                               atol=1e-5)


def test_shared_expert_and_dense_layers_are_where_the_config_puts_them() -> None:
    qwen3 = backend("qwen3_moe").model.layers
    assert [isinstance(la.mlp, MoE) for la in qwen3] == [True, False]  # mlp_only_layers
    qwen2 = backend("qwen2_moe").model.layers
    assert all(isinstance(la.mlp, MoE) and la.mlp.shared is not None
               and la.mlp.shared_gate is not None for la in qwen2)
    mixtral = backend("mixtral")
    assert [la.sliding_window for la in mixtral.model.layers] == [24, 24]


@pytest.mark.parametrize("name", ["qwen3_moe", "olmoe"])
def test_tied_router_scores_pick_the_experts_transformers_picks(
    name: str, tmp_path: Path
) -> None:
    """Every router row of the first layer equal: each token's scores all tie, and which
    experts serve it is torch.topk's choice among equals (not the lowest indices)."""
    model = copy.deepcopy(reference_model(name))
    with torch.no_grad():
        router = model.model.layers[0].mlp.gate.weight
        router.copy_(router[0].expand_as(router))
    model.save_pretrained(tmp_path)
    write_byte_tokenizer(tmp_path)
    be = TorchBackend.from_model(str(tmp_path), device="cpu", dtype="float32",
                                 total_kv_blocks=64, kv_block_size=4)
    prompts = random_prompts(60, [13, 4])
    outs, _ = run_scheduler(be, prompts, 12)
    want = []
    for p in prompts:
        with torch.no_grad():
            out = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p),
                                 dtype=torch.long), max_new_tokens=12, do_sample=False,
                                 pad_token_id=0, eos_token_id=None)
        want.append(out[0, len(p):].tolist())
    assert outs == want
    # The ties are real, and resolved in torch.topk's order, not by lowest index.
    weights, ids = _sparse(be)[1].router(torch.randn(4, model.config.hidden_size))
    assert torch.all(weights == weights[0, 0])
    assert any(sorted(row) != list(range(ids.shape[1])) for row in ids.tolist())


@pytest.mark.parametrize(("experts", "top_k"), [(8, 2), (8, 3), (60, 4), (64, 8),
                                              (128, 8), (256, 8)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_bf16_routers_pick_what_torch_topk_picks_ties_included(
    experts: int, top_k: int, renormalize: bool
) -> None:
    """bf16 routers on the CPU route in Rust (as the one-call decode step does). Experts
    that share a router row get the same logits, so rows tie at the k-th place; the chosen
    experts and their weights are transformers' recipe on the same logits: softmax in
    float32, torch.topk, renormalised where asked, rounded to bf16."""
    torch.manual_seed(experts * 100 + top_k)
    hidden = 64
    distinct = torch.randn(max(2, experts // 8), hidden)
    weight = distinct[torch.randint(0, distinct.shape[0], (experts,))].bfloat16()
    kernels = cpu.select(torch.device("cpu"), torch.bfloat16, switches.read())
    router = Router(weight, top_k, renormalize=renormalize, kernels=kernels)
    assert router.routes_in_rust
    x = torch.randn(300, hidden).bfloat16()
    boundary_ties = lowest_index_differs = 0
    for rows in (1, DECODE_MAX_ROWS, 300):  # the Rust GEMV's logits, and oneDNN's
        logits = router.project(x[:rows]) if router.project is not None else None
        assert logits is not None
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top, want_ids = torch.topk(probs, top_k, dim=-1)
        if renormalize:
            top = top / top.sum(dim=-1, keepdim=True)
        got, got_ids = router(x[:rows])
        assert got.dtype == torch.bfloat16 and got_ids.shape == (rows, top_k)
        assert torch.equal(got_ids.sort(dim=-1).values, want_ids.sort(dim=-1).values)
        order, want_order = got_ids.argsort(dim=-1), want_ids.argsort(dim=-1)
        torch.testing.assert_close(got.float().gather(1, order),
                                   top.bfloat16().float().gather(1, want_order),
                                   rtol=2**-8, atol=0)
        ranked = probs.sort(dim=-1, descending=True, stable=True)
        boundary_ties += int((ranked.values[:, top_k - 1] == ranked.values[:, top_k]).sum())
        lowest = ranked.indices[:, :top_k].sort(dim=-1).values
        lowest_index_differs += int((lowest != want_ids.sort(dim=-1).values).any(-1).sum())
    assert boundary_ties > 0  # the ties this test is about
    if experts >= 60:
        assert lowest_index_differs > 0  # torch's order is not a lowest-index rule
    # torch's other branch (a partial sort, k * 64 <= experts) stays with torch.topk.
    wide = torch.zeros(64, hidden, dtype=torch.bfloat16)
    assert not Router(wide, 1, renormalize=False, kernels=kernels).routes_in_rust


@pytest.mark.parametrize(("name", "quantization", "tolerance"), [
    ("qwen3_moe", None, 0.02),
    ("mixtral", None, 0.02),
    ("qwen2_moe", "int8", 0.03),
    # 4 bits in groups of 32 of normal weights: ~8% error per projection, two in a row.
    ("mixtral", "int4", 0.2),
])
def test_bf16_and_quantized_experts_stay_close_to_float32(
    name: str, quantization: str | None, tolerance: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The experts kernel (the selected experts' rows only, in one call) and the grouped
    path from Python (one GEMM per expert) against transformers' float32 block, and
    against each other: a row's output does not depend on how many rows share its step,
    nor on which path serves them. (Many rows in torch's bf16 GEMM, so that the dense GEMV
    takes its own 8 rows where the CPU has bf16 arithmetic.)"""
    monkeypatch.setenv("IRON_BATCH_CPU_GEMM", "bf16")
    be = TorchBackend.from_model(str(checkpoint(name)), device="cpu", dtype="bfloat16",
                                 total_kv_blocks=16, kv_block_size=4,
                                 quantization=quantization)
    i, moe = _sparse(be)
    assert moe.decode_kernel
    torch.manual_seed(5)
    x = torch.randn(24, moe.router.weight.shape[1]).bfloat16()
    want = _reference_block(name, i, x)
    weights, ids = moe.router(x)
    grouped = moe._grouped(x, weights, ids).float()  # 24 rows grouped by expert in Python
    # The kernel itself at any row count (a step takes it where no expert has more rows
    # than its GEMV takes): each row exactly what it gets alone.
    alone = torch.cat([moe._decode(x[r:r + 1], weights[r:r + 1], ids[r:r + 1])
                       for r in range(x.shape[0])])
    for rows in (1, 2, 5, DECODE_MAX_ROWS, 24):
        got = moe._decode(x[:rows].contiguous(), weights[:rows], ids[:rows])
        assert torch.equal(got, alone[:rows]), f"{rows} rows: a row differs from itself alone"
        torch.testing.assert_close(got.float(), grouped[:rows], rtol=0.02, atol=0.02)
        torch.testing.assert_close(moe.experts(x[:rows].contiguous(), weights[:rows],
                                               ids[:rows]).float(), grouped[:rows],
                                   rtol=0.02, atol=0.02)
    # A step of up to SMALL_EXPERTS_MAX_ROWS rows over small experts takes the kernel even
    # where an expert has more rows than one GEMV pass (a 24-row decode step here): each
    # row is then what it gets alone (bf16 experts: one pass is 8 rows; quantized: 16).
    assert moe.small_experts and x.shape[0] <= SMALL_EXPERTS_MAX_ROWS
    if quantization is None:
        assert int(torch.bincount(ids.reshape(-1)).max()) > moe.kernel_rows
    assert torch.equal(moe.experts(x, weights, ids), alone)
    if moe.shared is not None:
        grouped = moe(x).float()
    err = (grouped - want).norm() / want.norm()
    assert err < tolerance


@pytest.mark.parametrize("gemm", ["bf16", "f32"])
def test_a_prompt_sized_step_of_bf16_experts_stays_close_to_float32(
    gemm: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompt's rows grouped by expert, each expert's GEMM above the GEMV's rows: in
    torch's bf16 GEMM, or in f32 over the f32 copy that the stacked experts keep where
    ``IRON_BATCH_CPU_GEMM`` says f32. Either is close to transformers' float32 block, row
    by row."""
    monkeypatch.setenv("IRON_BATCH_CPU_GEMM", gemm)
    be = TorchBackend.from_model(str(checkpoint("qwen3_moe")), device="cpu",
                                 dtype="bfloat16", total_kv_blocks=16, kv_block_size=4)
    i, moe = _sparse(be)
    assert (moe.gate_up.wide is not None) == (gemm == "f32")
    assert (moe.down.wide is not None) == (gemm == "f32")
    torch.manual_seed(6)
    x = torch.randn(2400, moe.router.weight.shape[1]).bfloat16()
    want = _reference_block("qwen3_moe", i, x)
    weights, ids = moe.router(x)
    # Every chosen expert's rows past what its GEMV takes: GEMMs, not GEMV passes.
    gemv_rows = max(moe.gate_up.dense_gemv_rows, moe.down.dense_gemv_rows)
    assert int(torch.bincount(ids.reshape(-1), minlength=moe.num_experts).min()) > gemv_rows
    got = moe._grouped(x, weights, ids).float()
    per_row = (got - want).norm(dim=1) / want.norm(dim=1)
    assert float(per_row.median()) < 0.01
    # A few rows' bf16 router logits tie near the float32 ones' choice and pick another
    # expert (5 of 2400 here); every other row stays within about one bf16 rounding.
    assert int((per_row > 0.05).sum()) <= x.shape[0] // 100
