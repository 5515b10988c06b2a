"""Decode steps with every decoder layer in one Rust call (``layers/decoder_stack.py``):
the same tokens and log-probabilities as the layer-by-layer Python path, on every tiny
family (GQA, qkv bias, Qwen3's q/k norms, a sliding window) and the mixture-of-experts
ones (sparse layers beside dense ones, a gated shared expert) in bf16 and quantized, one
sequence and several; bad calls are refused and change nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from iron_batch.backends.torch_backend import TorchBackend
from iron_batch.platform import cpu, switches
from tiny_models import FAMILIES, checkpoint, random_prompts, run_scheduler

#: The sparse families the stack runs (gpt-oss's sinks keep it on the layer path).
MOE_FAMILIES = ["mixtral", "olmoe", "qwen2_moe", "qwen3_moe"]


def _backend(name: str, quantization: str | None, fused: bool,
             monkeypatch: pytest.MonkeyPatch) -> TorchBackend:
    monkeypatch.setenv("IRON_BATCH_CPU_DECODER", "1" if fused else "0")
    be = TorchBackend.from_model(str(checkpoint(name)), device="cpu", dtype="bfloat16",
                                 total_kv_blocks=96, kv_block_size=4, quantization=quantization)
    # A family whose layers the stack does not describe (``one_call_decode`` False) keeps
    # the Python path with the switch on.
    assert (be.model.decoder is not None) == (fused and be.model.one_call_decode)
    return be


@pytest.mark.parametrize("quantization", [None, "int4", "int8"])
@pytest.mark.parametrize("name", [*sorted(FAMILIES), *MOE_FAMILIES])
def test_one_call_decode_gives_the_python_paths_tokens_and_logits(
    name: str, quantization: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Longer than mistral's 24-token window; batch 1 and a batch of 5 (the stack takes up
    # to 8 token rows: decode rows, and the prompts of 7 and 3 tokens as rows of their own).
    prompts = random_prompts(3, [40, 7, 19, 3, 28])
    runs = []
    for fused in (True, False):
        be = _backend(name, quantization, fused, monkeypatch)
        rows: list[int] = []
        alone = [_logits_run(be, [p], rows) for p in prompts[:2]]
        together = _logits_run(be, prompts, rows)
        runs.append((alone, together))
        if fused and be.model.one_call_decode:
            # The stack ran the decode steps, alone and batched.
            assert {1, 5, 7} <= set(rows) and max(rows) <= 8
        else:
            assert rows == []
    (fused_alone, fused_batch), (plain_alone, plain_batch) = runs
    for got, want in [*zip(fused_alone, plain_alone, strict=True), (fused_batch, plain_batch)]:
        assert got[0] == want[0]  # tokens
        torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)


def _logits_run(be: TorchBackend, prompts: list[list[int]],
                rows: list[int]) -> tuple[list[list[int]], torch.Tensor]:
    """Greedy tokens of each prompt, and every sampled step's logits (float32)."""
    logits: list[torch.Tensor] = []
    model = be.model
    forward = model._logits

    def keep(h: torch.Tensor, sample_indices: np.ndarray) -> torch.Tensor:
        out = forward(h, sample_indices)
        logits.append(out.clone())
        return out

    model._logits = keep  # type: ignore[method-assign]
    stack = model.decoder
    if stack is not None:
        decode = stack.decode

        def counted(h: torch.Tensor, *args, **kwargs):  # type: ignore[no-untyped-def]
            rows.append(h.shape[0])
            return decode(h, *args, **kwargs)

        stack.decode = counted  # type: ignore[method-assign]
    try:
        tokens, _ = run_scheduler(be, prompts, 24, max_batch_tokens=64)
    finally:
        del model._logits
        if stack is not None:
            del stack.decode
    return tokens, torch.cat(logits)


def test_the_stack_refuses_bad_calls_and_leaves_the_cache_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    be = _backend("llama", "int4", True, monkeypatch)
    model = be.model
    stack = model.decoder
    assert stack is not None
    hidden, hd = model.config.hidden_size, model.config.head_dim
    h = torch.randn(1, hidden).to(torch.bfloat16)
    cos = torch.ones(1, hd, dtype=torch.bfloat16)
    sin = torch.zeros(1, hd, dtype=torch.bfloat16)
    before = [c.clone() for c in model.kv_caches]
    table = np.zeros((1, 1), np.int32)
    good = dict(scale=0.1)
    bad_calls = [
        # a slot outside the cache
        (h, cos, sin, np.array([10**6]), table, np.array([1], np.int32)),
        # a block id outside the cache
        (h, cos, sin, np.array([0]), np.array([[10**6]], np.int32), np.array([1], np.int32)),
        # float32 rows
        (h.float(), cos, sin, np.array([0]), table, np.array([1], np.int32)),
        # more rows than the GEMV kernels serve
        (torch.zeros(stack.max_rows + 1, hidden, dtype=torch.bfloat16), cos, sin,
         np.zeros(stack.max_rows + 1), np.zeros((stack.max_rows + 1, 1), np.int32),
         np.ones(stack.max_rows + 1, np.int32)),
        # one slot for two rows
        (torch.zeros(2, hidden, dtype=torch.bfloat16), cos.repeat(2, 1), sin.repeat(2, 1),
         np.array([0]), np.zeros((2, 1), np.int32), np.ones(2, np.int32)),
    ]
    h_before = h.clone()
    for args in bad_calls:
        with pytest.raises(ValueError):
            stack.decode(*args, **good)
    assert torch.equal(h, h_before)
    for c, b in zip(model.kv_caches, before, strict=True):
        assert torch.equal(c, b)


def test_float32_models_keep_the_python_path() -> None:
    assert not cpu.select(torch.device("cpu"), torch.float32, switches.read()).decoder
    be = TorchBackend.from_model(str(checkpoint("llama")), device="cpu", dtype="float32",
                                 total_kv_blocks=32, kv_block_size=4)
    assert be.model.decoder is None


def test_a_layer_the_stack_cannot_describe_is_refused_by_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from iron_batch.layers.decoder_stack import DecoderStack

    be = _backend("mistral", None, True, monkeypatch)
    model = be.model
    c = model.config
    # Each layer carries its own window into the stack.
    assert [layer.sliding_window for layer in model.layers] == [c.sliding_window] * c.num_layers
    layer = model.layers[0]
    monkeypatch.setattr(layer.mlp, "activation_name", "relu2")
    with pytest.raises(ValueError, match="relu2"):
        DecoderStack(model.layers, hidden=c.hidden_size, heads=c.num_heads,
                     kv_heads=c.num_kv_heads, head_dim=c.head_dim, eps=c.rms_norm_eps)
