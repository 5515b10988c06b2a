"""gpt-oss: float32 greedy tokens equal transformers' ``GptOssForCausalLM`` through the
scheduler (chunked prefill, prefix hits, preemption, wide decode batches, sequences longer
than the sliding window) on both CPU attention routes (the Rust paged kernel with sinks,
and torch's); the sparse layer equals transformers' when every expert and when few are
chosen; bf16 prompt rows through the kernel stay as close to transformers as SDPA's
route; the attention sinks in the kernel match a float64 reference; what cannot run
sinks refuses them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from iron_batch.attention import cpu_kernel
from iron_batch.backends.torch_backend import TorchBackend
from iron_batch.layers.moe import DECODE_MAX_ROWS, MoE
from iron_batch.models.registry import SUPPORTED_MODEL_TYPES
from tiny_models import (
    checkpoint,
    greedy_on_one_and_two_ranks,
    hf_greedy,
    prefix_hit_run,
    random_prompts,
    reference_model,
    run_scheduler,
)

NAME = "gpt_oss"
ROUTES = ["kernel", "torch"]


def _backend(route: str, monkeypatch: pytest.MonkeyPatch, dtype: str = "float32",
             **kw: int) -> TorchBackend:
    monkeypatch.setenv("IRON_BATCH_CPU_ATTENTION", route)
    return TorchBackend.from_model(str(checkpoint(NAME)), device="cpu", dtype=dtype,
                                   total_kv_blocks=kw.get("total_kv_blocks", 256),
                                   kv_block_size=4)


def _expected(prompts: list[list[int]], max_new: list[int]) -> list[list[int]]:
    return [hf_greedy(NAME, p, n) for p, n in zip(prompts, max_new, strict=True)]


def test_gpt_oss_is_registered_with_its_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    assert NAME in SUPPORTED_MODEL_TYPES
    model = _backend("kernel", monkeypatch).model
    # Sliding layers first, alternating; the sliding ones on a cache group of their own.
    assert [la.sliding_window for la in model.layers] == [6, None]
    assert model.cache_groups == [("full", None), ("sliding", 6)]
    ref = reference_model(NAME).model.layers
    for ours, theirs in zip(model.layers, ref, strict=True):
        assert ours.sinks is not None
        torch.testing.assert_close(ours.sinks, theirs.self_attn.sinks.detach())
        assert isinstance(ours.mlp, MoE) and ours.mlp.activation_name == "clamped_swiglu"
    # The one-call decode stack has no sinks: decode steps run layer by layer.
    assert model.decoder is None


@pytest.mark.parametrize("route", ROUTES)
def test_chunked_prefill_and_prefix_hits_match_transformers(
    route: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts, outs = prefix_hit_run(_backend(route, monkeypatch), (17, 25))
    assert outs == _expected(prompts, [10] * len(prompts))


@pytest.mark.parametrize("route", ROUTES)
def test_preemption_keeps_output_exact(route: str, monkeypatch: pytest.MonkeyPatch) -> None:
    prompts = random_prompts(40, [9, 14, 6, 11, 17, 8, 12, 5])
    max_new = [14] * len(prompts)
    outs, stats = run_scheduler(_backend(route, monkeypatch), prompts, max_new,
                                total_kv_blocks=18, max_running_seqs=8)
    assert stats["preemptions"] > 0
    assert outs == _expected(prompts, max_new)


def test_sixteen_concurrent_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    lengths = [1, 2, 3, 5, 8, 11, 16, 17, 23, 31, 4, 9, 40, 6, 27, 12]
    max_new = [12, 3, 20, 7, 16, 1, 9, 14, 5, 18, 11, 2, 8, 13, 6, 10]
    prompts = random_prompts(20, lengths)
    widths: list[int] = []
    outs, _ = run_scheduler(_backend("kernel", monkeypatch), prompts, max_new,
                            on_step=lambda b: widths.append(len(b.sample_indices)))
    assert outs == _expected(prompts, max_new)
    assert max(widths) > DECODE_MAX_ROWS


def test_layer_equals_transformers_when_every_and_when_few_experts_are_chosen(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = _backend("kernel", monkeypatch).model
    moe = model.layers[0].mlp
    assert isinstance(moe, MoE)
    block = reference_model(NAME).model.layers[0].mlp
    torch.manual_seed(3)
    wide = torch.randn(64, moe.router.weight.shape[1])
    _, ids = moe.router(wide)
    assert set(ids.flatten().tolist()) == set(range(moe.num_experts))
    with torch.no_grad():
        want = block(wide[None])[0][0]
    torch.testing.assert_close(moe(wide), want, rtol=1e-5, atol=1e-5)
    few = wide[:1]
    _, ids = moe.router(few)
    assert len(set(ids.flatten().tolist())) < moe.num_experts  # some expert chosen by none
    with torch.no_grad():
        want = block(few[None])[0][0]
    torch.testing.assert_close(moe(few), want, rtol=1e-5, atol=1e-5)


def _chunked_logits(model: object, seqs: list[list[int]], steps: list[int]) -> list[torch.Tensor]:
    """Every position's logits, the sequences side by side, each advancing by its step's
    number of tokens per forward (on block tables of its own)."""
    block = 4
    tables = [[j + 16 * i for j in range(16)] for i in range(len(seqs))]
    done = [0] * len(seqs)
    out: list[list[torch.Tensor]] = [[] for _ in seqs]
    while any(d < len(s) for d, s in zip(done, seqs, strict=True)):
        ids, pos, slots, qsl, lens, before, owner = [], [], [], [0], [], [], []
        live = [i for i, s in enumerate(seqs) if done[i] < len(s)]
        for i in live:
            take = min(steps[i], len(seqs[i]) - done[i])
            for p in range(done[i], done[i] + take):
                ids.append(seqs[i][p])
                pos.append(p)
                slots.append(tables[i][p // block] * block + p % block)
                owner.append(i)
            before.append(done[i])
            done[i] += take
            qsl.append(qsl[-1] + take)
            lens.append(done[i])
        groups = len(model.cache_groups)  # type: ignore[attr-defined]
        logits = model.forward(  # type: ignore[attr-defined]
            input_ids=np.array(ids), positions=np.array(pos),
            slot_mapping=np.array(slots, np.int64),
            query_start_loc=np.array(qsl, np.int32), seq_lens=np.array(lens, np.int32),
            num_computed_before=np.array(before, np.int32),
            block_tables=np.array([tables[i] for i in live], np.int32),
            group_slot_mapping=np.array([slots] * (groups - 1), np.int64),
            group_block_tables=np.array([tables[i] for i in live] * (groups - 1), np.int32),
            sample_indices=np.arange(len(ids)),
        )
        for row, i in enumerate(owner):
            out[i].append(logits[row])
    return [torch.stack(o) for o in out]


def test_bf16_prompt_rows_through_the_kernel_stay_close_to_transformers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """bf16 prompt rows attend through the kernel with sinks, each over its own prefix
    (chunks behind cached context, past the 6-token window, beside another sequence's
    decodes): every position's logits as close to transformers' float32 model as the
    SDPA route's."""
    seqs = random_prompts(13, [30, 20])
    ref = reference_model(NAME)
    with torch.no_grad():
        want = [ref(torch.tensor([s])).logits[0] for s in seqs]
    errors = {}
    for route in ("kernel", "sdpa"):
        monkeypatch.setenv("IRON_BATCH_CPU_PREFILL_ATTENTION", route)
        be = _backend("kernel", monkeypatch, dtype="bfloat16", total_kv_blocks=96)
        got = _chunked_logits(be.model, seqs, [7, 1])
        errors[route] = max((g - w).abs().max().item() for g, w in zip(got, want, strict=True))
    assert errors["kernel"] <= 0.3, errors
    assert errors["kernel"] <= 2 * errors["sdpa"] + 0.02, errors


def _reference_attention(q: np.ndarray, keys: list[np.ndarray], values: list[np.ndarray],
                         sinks: np.ndarray, scale: float, window: int) -> np.ndarray:
    """float64: per sequence and head, softmax over its last ``window`` keys (0: all) and
    the head's sink, the sink's share dropped."""
    seqs, heads, hd = q.shape
    out = np.zeros((seqs, heads, hd))
    for s in range(seqs):
        k, v = keys[s], values[s]
        if window:
            k, v = k[-window:], v[-window:]
        group = heads // k.shape[1]
        for h in range(heads):
            scores = k[:, h // group] @ q[s, h] * scale
            top = max(scores.max(), sinks[h])
            p = np.exp(scores - top)
            out[s, h] = p @ v[:, h // group] / (p.sum() + np.exp(sinks[h] - top))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 5])
def test_kernel_sinks_match_a_float64_reference(dtype: torch.dtype, window: int) -> None:
    rng = np.random.default_rng(5)
    heads, kv_heads, hd, block, nblocks = 8, 2, 64, 4, 32
    lens = np.array([1, 7, 13, 30], np.int32)
    cache = torch.from_numpy(rng.normal(size=(2, nblocks, block, kv_heads, hd))).to(dtype)
    tables = rng.permutation(nblocks)[: 4 * 8].reshape(4, 8).astype(np.int32)
    q = torch.from_numpy(rng.normal(size=(4, heads, hd))).to(dtype)
    # Sinks above, among and below the scores: each changes the softmax differently.
    sinks = torch.tensor([3.0, -2.0, 0.0, 8.0, -30.0, 1.5, 0.5, -0.5])
    got = cpu_kernel.paged_decode_attention(q, cache, tables, lens, 0.125, window or None,
                                            sinks=sinks)
    c = cache.double().numpy()
    keys = [np.concatenate([c[0, b] for b in tables[s]])[: lens[s]] for s in range(4)]
    values = [np.concatenate([c[1, b] for b in tables[s]])[: lens[s]] for s in range(4)]
    want = _reference_attention(q.double().numpy(), keys, values, sinks.double().numpy(),
                                0.125, window)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    np.testing.assert_allclose(got.double().numpy().reshape(want.shape), want, atol=tol,
                               rtol=tol)
    plain = cpu_kernel.paged_decode_attention(q, cache, tables, lens, 0.125, window or None)
    assert not torch.equal(plain, got)  # the sinks changed the output


def test_what_cannot_run_sinks_refuses_them(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _backend("kernel", monkeypatch).model
    with pytest.raises(ValueError, match="int8"):
        model.set_kv_cache_dtype("int8")
    cache = torch.zeros(2, 4, 4, 2, 68, dtype=torch.int8)
    with pytest.raises(ValueError, match="int8"):
        cpu_kernel.paged_decode_attention(
            torch.zeros(1, 4, 64), cache, np.zeros((1, 1), np.int32), np.ones(1, np.int32),
            0.125, None, sinks=torch.zeros(4))


def test_tp2_equals_tp1() -> None:
    """Two ranks, each with half the heads (and their sinks) and half of every expert's
    intermediate rows, give TP=1's greedy tokens."""
    tp1, tp2 = greedy_on_one_and_two_ranks(
        str(checkpoint(NAME)), random_prompts(21, [1, 5, 11, 17, 23]), 10)
    assert all(len(o) == 10 for o in tp1)
    assert tp2 == tp1
