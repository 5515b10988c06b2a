"""gpt-oss's MXFP4 experts kept in MXFP4: the dequantization is transformers' own
(``transformers.integrations.mxfp4``) bit for bit; the GEMV over the codes is within one
bf16 rounding of a float64 product; a tiny gpt-oss checkpoint with MXFP4 experts gives,
in float32, the greedy tokens transformers gives with the same weights dequantized (under
chunked prefill, prefix hits and preemption); in bf16 the decode kernel over the selected
experts' MXFP4 rows (with their biases and the clamped SwiGLU) stays within bf16 rounding
of the grouped path."""

from __future__ import annotations

import copy
import json
import shutil
from functools import cache
from pathlib import Path

import pytest
import torch
from iron_batch.backends.torch_backend import TorchBackend
from iron_batch.layers import mxfp4
from iron_batch.layers.moe import MoE
from iron_batch.layers.quant import QuantWeight
from safetensors.torch import save_file
from tiny_models import checkpoint, random_prompts, reference_model, run_scheduler
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

NAME = "gpt_oss"


def _random_mxfp4(shape: tuple[int, ...], seed: int,
                  exponents: tuple[int, int] = (122, 127)) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes ``[*shape, k / 32, 16]`` and exponents ``[*shape, k / 32]`` (shape's last
    entry is k), the exponents' E8M0 bytes in ``exponents`` (default: 2^-5 .. 2^-1)."""
    g = torch.Generator().manual_seed(seed)
    *lead, k = shape
    codes = torch.randint(0, 256, (*lead, k // 32, 16), generator=g, dtype=torch.uint8)
    exps = torch.randint(*exponents, (*lead, k // 32), generator=g, dtype=torch.uint8)
    return codes, exps


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantization_is_transformers_bit_for_bit(dtype: torch.dtype) -> None:
    codes, exps = _random_mxfp4((3, 48, 96), 1)
    exps[0, 0, 0], exps[1, 2, 1], exps[2, 5, 2] = 1, 140, 100  # extremes too
    theirs = convert_moe_packed_tensors(codes, exps, dtype=dtype)  # [E, k, n]
    for e in range(3):
        w = mxfp4.weight(codes[e], exps[e])
        ours = mxfp4.dequantize_f32(w) if dtype == torch.float32 else w.dequantize()
        assert ours.dtype == dtype
        assert torch.equal(ours.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                           theirs[e].T.contiguous().view(
                               torch.int16 if dtype == torch.bfloat16 else torch.int32))


def test_gemv_is_within_one_bf16_rounding_of_a_float64_product() -> None:
    codes, exps = _random_mxfp4((200, 160), 2)
    w = mxfp4.weight(codes, exps)
    dense = mxfp4.dequantize_f32(w).double()
    bias = torch.randn(200).to(torch.bfloat16)
    for rows in (1, 3, 8):
        x = torch.randn(rows, 160).to(torch.bfloat16)
        got = w.linear(x, bias, gemv_rows=8).double()
        want = x.double() @ dense.T + bias.double()
        assert torch.all((got - want).abs() <= want.abs() / 128 + 1e-4)
    # Above the GEMV's rows: the dequantized bf16 matrix (exact) and a dense product.
    x = torch.randn(40, 160).to(torch.bfloat16)
    got = w.linear(x, bias, gemv_rows=8).double()
    want = x.double() @ dense.T + bias.double()
    assert torch.all((got - want).abs() <= want.abs() / 64 + 1e-3)


@cache
def _mxfp4_checkpoint() -> tuple[Path, object]:
    """The tiny gpt-oss checkpoint with its experts replaced by random MXFP4 blocks (as a
    released checkpoint stores them), and transformers' model with those weights
    dequantized."""
    src = checkpoint(NAME)
    model = copy.deepcopy(reference_model(NAME))
    folder = src.parent / f"{NAME}-mxfp4"
    folder.mkdir(exist_ok=True)
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    cfg = model.config
    hidden, inter, experts = cfg.hidden_size, cfg.intermediate_size, cfg.num_local_experts
    for i, layer in enumerate(model.model.layers):
        pre = f"model.layers.{i}.mlp.experts."
        for j, (proj, n, k) in enumerate([("gate_up_proj", 2 * inter, hidden),
                                          ("down_proj", hidden, inter)]):
            # Weights of up to 6 * 2^-5, as wide as the float checkpoint's.
            codes, exps = _random_mxfp4((experts, n, k), 10 * i + j, (118, 123))
            with torch.no_grad():
                getattr(layer.mlp.experts, proj).copy_(
                    convert_moe_packed_tensors(codes, exps, dtype=torch.float32))
            del tensors[pre + proj]
            tensors[pre + proj + "_blocks"], tensors[pre + proj + "_scales"] = codes, exps
    save_file(tensors, str(folder / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (folder / "config.json").write_text(json.dumps(config))
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name.startswith("special"):
            shutil.copy(f, folder / f.name)
    return folder, model


def _hf_greedy(model: object, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(  # type: ignore[attr-defined]
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def _backend(dtype: str) -> TorchBackend:
    folder, _ = _mxfp4_checkpoint()
    return TorchBackend.from_model(str(folder), device="cpu", dtype=dtype,
                                   total_kv_blocks=24, kv_block_size=4)


def test_float32_mxfp4_model_gives_transformers_tokens_over_its_dequantized_weights() -> None:
    _, ref = _mxfp4_checkpoint()
    be = _backend("float32")
    for layer in be.model.layers:
        assert isinstance(layer.mlp, MoE)
        for lin in (layer.mlp.gate_up, layer.mlp.down):
            assert isinstance(lin.weight, QuantWeight) and lin.weight.kind == "mxfp4"
    prefix = random_prompts(50, [13])[0]
    prompts = [prefix + s for s in random_prompts(51, [4, 9, 2])] + random_prompts(
        52, [18, 6, 11, 7])
    outs, stats = run_scheduler(be, prompts, 12, max_batch_tokens=9, max_running_seqs=6)
    assert stats["prefix_cache_hit_tokens"] > 0 and stats["preemptions"] > 0
    assert outs == [_hf_greedy(ref, p, 12) for p in prompts]


def test_bf16_decode_kernel_reads_the_mxfp4_experts() -> None:
    be = _backend("bfloat16")
    moe = be.model.layers[0].mlp
    assert isinstance(moe, MoE) and moe.decode_kernel
    torch.manual_seed(4)
    for rows in (1, 2, 5, 8):
        x = torch.randn(rows, moe.router.weight.shape[1]).to(torch.bfloat16)
        weights, ids = moe.router(x)
        got = moe.experts(x, weights, ids).double()
        grouped = moe._grouped(x, weights, ids).double()
        # Both round the gate/up outputs and the activation to bf16, the kernel in its
        # own order of sums: within a few bf16 roundings of each other.
        scale = grouped.abs().max().item()
        assert (got - grouped).abs().max().item() <= 0.02 * scale + 1e-3
