"""Qwen3.5 from a GGUF file written here the way llama.cpp's converter writes ``qwen35``
(``conversion/qwen.py``: its tensor names and metadata keys; ``-exp(A_log)``; 1 added to the
norms but the gated one; value heads reordered from grouped to tiled where two value heads
share a key head): the config read back and the same greedy tokens as transformers. Also
``qwen35moe`` (the experts stacked per layer and projection, kept in their Q8_0 blocks under
``--quantization gguf``), and the multi-token-prediction layer the converter appends."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from iron_batch.backends.build import scheduler_config
from iron_batch.backends.torch_backend import TorchBackend
from iron_batch.layers.moe import MoE
from iron_batch.layers.quant import QuantWeight
from iron_batch.loader import read_config, resolve
from safetensors.torch import load_file
from test_qwen3_5 import checkpoint, hf_greedy
from tiny_models import random_prompts, run_with_config, write_gguf_byte_vocabulary

ARCH = "qwen35"


def _tile(t: torch.Tensor, dim: int, key_heads: int, per_key: int, width: int) -> torch.Tensor:
    """The converter's reorder: [key head, value head of it, width] -> [value, key, width]."""
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], key_heads, per_key, width, *shape[dim + 1:])
    return t.transpose(dim, dim + 1).reshape(shape)


def _gguf_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
           "output_norm.weight", "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    _, _, i, rest = hf.split(".", 3)
    names = {
        "input_layernorm.weight": "attn_norm.weight",
        "post_attention_layernorm.weight": "post_attention_norm.weight",
        "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.v_proj.weight": "attn_v.weight",
        "self_attn.o_proj.weight": "attn_output.weight",
        "self_attn.q_norm.weight": "attn_q_norm.weight",
        "self_attn.k_norm.weight": "attn_k_norm.weight",
        "linear_attn.in_proj_qkv.weight": "attn_qkv.weight",
        "linear_attn.in_proj_z.weight": "attn_gate.weight",
        "linear_attn.in_proj_b.weight": "ssm_beta.weight",
        "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
        "linear_attn.conv1d.weight": "ssm_conv1d.weight",
        "linear_attn.A_log": "ssm_a", "linear_attn.dt_bias": "ssm_dt.bias",
        "linear_attn.norm.weight": "ssm_norm.weight",
        "linear_attn.out_proj.weight": "ssm_out.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
        # Qwen3.5-MoE: the router, the shared expert and its gate.
        "mlp.gate.weight": "ffn_gate_inp.weight",
        "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
        "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
        "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
        "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
    }
    return f"blk.{i}.{names[rest]}"


_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(?:(\d+)\.)?(\w+?)(?:\.weight)?$")


def _gguf_tensors(tensors: dict[str, torch.Tensor], cfg: dict[str, Any]) -> dict[str, np.ndarray]:
    """Every tensor under its GGUF name, converted; experts stacked into one
    ``[experts, rows, cols]`` tensor per layer and projection (transformers' fused
    ``gate_up_proj`` split into its gate and up halves), as the converter writes them."""
    out: dict[str, np.ndarray] = {}
    stacks: dict[str, dict[int, torch.Tensor]] = {}
    for name, t in tensors.items():
        t = t.float()
        expert = _EXPERT.match(name)
        if expert is None:
            t = _converted(name, t, cfg)
            if name.endswith("shared_expert_gate.weight"):
                t = t.reshape(-1)  # the converter writes the gate as a vector
            out[_gguf_name(name)] = np.ascontiguousarray(t.numpy())
            continue
        layer, e, proj = expert.groups()
        if e is not None:  # one tensor per expert, as save_pretrained writes them
            key = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps",
                   "down_proj": "ffn_down_exps"}[proj]
            stacks.setdefault(f"blk.{layer}.{key}.weight", {})[int(e)] = t
        elif proj == "gate_up_proj":
            half = t.shape[1] // 2
            out[f"blk.{layer}.ffn_gate_exps.weight"] = np.ascontiguousarray(t[:, :half].numpy())
            out[f"blk.{layer}.ffn_up_exps.weight"] = np.ascontiguousarray(t[:, half:].numpy())
        else:
            out[f"blk.{layer}.ffn_down_exps.weight"] = np.ascontiguousarray(t.numpy())
    for tname, by_expert in stacks.items():
        out[tname] = np.stack([by_expert[e].numpy() for e in sorted(by_expert)])
    return out


def _converted(name: str, t: torch.Tensor, cfg: dict[str, Any]) -> torch.Tensor:
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv, r = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], nv // nk
    if ".linear_attn." in name and r > 1:
        qk = 2 * nk * dk
        if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
            t = torch.cat([t[:qk], _tile(t[qk:], 0, nk, r, dv)])
        elif name.endswith("in_proj_z.weight"):
            t = _tile(t, 0, nk, r, dv)
        elif name.endswith(("in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias")):
            t = _tile(t, 0, nk, r, 1)
        elif name.endswith("out_proj.weight"):
            t = _tile(t, 1, nk, r, dv)
    if name.endswith("A_log"):
        t = -torch.exp(t)
    elif "conv1d" in name:
        t = t.squeeze()
    elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        t = t + 1
    return t


def write_gguf(folder: Path, out: Path, mtp_layers: int = 0, expert_type: str = "F32") -> Path:
    """``qwen35``, or ``qwen35moe`` for a checkpoint with experts. ``mtp_layers``: that
    many multi-token-prediction layers after the model's own, counted in ``block_count``
    with ``nextn_predict_layers`` saying so, as the converter writes them by default."""
    cfg = json.loads((folder / "config.json").read_text())
    tensors = load_file(str(folder / "model.safetensors"))
    moe = bool(cfg.get("num_experts"))
    arch = "qwen35moe" if moe else ARCH
    w = gguf.GGUFWriter(str(out), arch)
    head_dim = cfg["head_dim"]
    rope = cfg.get("rope_parameters") or {}
    layers = cfg["num_hidden_layers"]
    keys: dict[str, Any] = {
        "block_count": layers + mtp_layers, "context_length":
        cfg["max_position_embeddings"], "embedding_length": cfg["hidden_size"],
        "attention.head_count": cfg["num_attention_heads"],
        "attention.head_count_kv": cfg["num_key_value_heads"],
        "attention.key_length": head_dim, "attention.value_length": head_dim,
        "ssm.conv_kernel": cfg["linear_conv_kernel_dim"],
        "ssm.state_size": cfg["linear_key_head_dim"],
        "ssm.group_count": cfg["linear_num_key_heads"],
        "ssm.time_step_rank": cfg["linear_num_value_heads"],
        "ssm.inner_size": cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"],
        "full_attention_interval": 4,
        "rope.dimension_count": int(head_dim * rope.get("partial_rotary_factor", 0.25)),
    }
    if moe:  # the converter writes no dense size: the config has none
        keys.update({"expert_count": cfg["num_experts"],
                     "expert_used_count": cfg["num_experts_per_tok"],
                     "expert_feed_forward_length": cfg["moe_intermediate_size"],
                     "expert_shared_feed_forward_length":
                     cfg["shared_expert_intermediate_size"]})
    else:
        keys["feed_forward_length"] = cfg["intermediate_size"]
    if mtp_layers:
        keys["nextn_predict_layers"] = mtp_layers
    for key, value in keys.items():
        w.add_uint32(f"{arch}.{key}", int(value))
    w.add_float32(f"{arch}.rope.freq_base", float(rope.get("rope_theta", 10000.0)))
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", float(cfg["rms_norm_eps"]))
    w.add_array(f"{arch}.rope.dimension_sections", [11, 11, 10, 0])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    write_gguf_byte_vocabulary(w, folder, cfg["vocab_size"])
    converted = _gguf_tensors(tensors, cfg)
    hidden = cfg["hidden_size"]
    rng = np.random.default_rng(5)
    for i in range(layers, layers + mtp_layers):
        # Some of a prediction layer's tensors (shapes its own): none of them is read.
        converted[f"blk.{i}.nextn.eh_proj.weight"] = rng.standard_normal(
            (hidden, 2 * hidden), dtype=np.float32)
        converted[f"blk.{i}.nextn.enorm.weight"] = np.ones(hidden, np.float32)
        converted[f"blk.{i}.attn_norm.weight"] = np.ones(hidden, np.float32)
        converted[f"blk.{i}.attn_q.weight"] = rng.standard_normal((3, hidden), dtype=np.float32)
    # The names agree with gguf-py's own table for the architecture.
    table = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], layers + mtp_layers)
    known = {table.get_name(k) for k in table.mapping}
    for tname in converted:
        assert tname.rsplit(".", 1)[0] in known or tname.startswith(
            ("token_embd.", "output_norm.", "output.")) or tname.endswith(".ssm_a") or (
            ".nextn." in tname), tname  # (gguf-py's table lists no nextn tensors here)
    qtype = gguf.GGMLQuantizationType[expert_type]
    for tname, value in converted.items():
        if "_exps." in tname and qtype != gguf.GGMLQuantizationType.F32:
            w.add_tensor(tname, gguf.quants.quantize(value, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(tname, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def test_a_qwen35_gguf_reads_the_config_and_gives_transformers_tokens(tmp_path: Path) -> None:
    name = "untied"  # two value heads per key head: the converter's reorder applies
    path = write_gguf(checkpoint(name), tmp_path / "qwen35.gguf")
    cfg = read_config(resolve(str(path)))
    want = read_config(resolve(str(checkpoint(name))))
    for field in ("linear_layers", "linear_key_heads", "linear_value_heads", "linear_key_dim",
                  "linear_value_dim", "linear_conv_kernel", "rotary_dim", "head_dim",
                  "num_kv_heads"):
        assert getattr(cfg, field) == getattr(want, field), field
    be = TorchBackend.from_model(str(path), device="cpu", dtype="float32", total_kv_blocks=64,
                                 kv_block_size=4)
    prompts = random_prompts(23, [9, 37])
    outs, s = run_with_config(be, scheduler_config(be, max_batch_tokens=16), prompts, 12)
    assert outs == [hf_greedy(name, p, 12) for p in prompts]
    assert all(g["used"] == 0 for g in s.group_stats())


@pytest.mark.parametrize("name", ["untied", "moe"])
def test_a_prediction_layer_counted_in_block_count_is_not_read(name: str, tmp_path: Path) -> None:
    """The converter writes Qwen3.5's multi-token-prediction layer after the model's own
    layers and counts it in ``block_count``: the model keeps its own layers and the same
    tokens (dense ``qwen35``, and ``qwen35moe``)."""
    path = write_gguf(checkpoint(name), tmp_path / f"{name}.gguf", mtp_layers=1)
    cfg = read_config(resolve(str(path)))
    assert len(cfg.linear_layers) == 4
    be = TorchBackend.from_model(str(path), device="cpu", dtype="float32", total_kv_blocks=64,
                                 kv_block_size=4)
    assert len(be.model.layers) == 4
    prompts = random_prompts(24, [11, 30])
    outs, s = run_with_config(be, scheduler_config(be, max_batch_tokens=16), prompts, 10)
    assert outs == [hf_greedy(name, p, 10) for p in prompts]
    assert all(g["used"] == 0 for g in s.group_stats())


def test_a_qwen35moe_gguf_stacks_the_experts_and_gives_transformers_tokens(
    tmp_path: Path,
) -> None:
    """``qwen35moe``: Qwen3.5's layers with the experts stacked per layer and projection,
    the router, the shared expert and its gate (a vector), and no dense MLP size."""
    path = write_gguf(checkpoint("moe"), tmp_path / "qwen35moe.gguf")
    cfg = read_config(resolve(str(path)))
    want = read_config(resolve(str(checkpoint("moe"))))
    for field in ("num_experts", "top_k", "expert_intermediate_size",
                  "shared_intermediate_size", "norm_topk_prob", "linear_layers",
                  "linear_value_heads"):
        assert getattr(cfg, field) == getattr(want, field), field
    be = TorchBackend.from_model(str(path), device="cpu", dtype="float32", total_kv_blocks=64,
                                 kv_block_size=4)
    prompts = random_prompts(25, [7, 33, 2])
    outs, s = run_with_config(be, scheduler_config(be, max_batch_tokens=16), prompts, 12)
    assert outs == [hf_greedy("moe", p, 12) for p in prompts]
    assert all(g["used"] == 0 for g in s.group_stats())


def test_qwen35moe_q8_experts_stay_in_their_blocks(tmp_path: Path) -> None:
    """``--quantization gguf``: the stacked Q8_0 experts are read as blocks, expert by
    expert, and each sparse layer gives the float32 layer's output within the MoE
    families' tolerance."""
    path = write_gguf(checkpoint("moe"), tmp_path / "q8.gguf", expert_type="Q8_0")
    quantized = TorchBackend.from_model(str(path), device="cpu", dtype="bfloat16",
                                        quantization="gguf", total_kv_blocks=64,
                                        kv_block_size=4)
    dense = TorchBackend.from_model(str(path), device="cpu", dtype="float32",
                                    total_kv_blocks=64, kv_block_size=4)
    moes = [la.mlp for la in quantized.model.layers]
    assert all(isinstance(m, MoE) and isinstance(m.gate_up.weight, QuantWeight) for m in moes)
    assert not any("experts" in t for t in quantized.model.dequantized)
    torch.manual_seed(2)
    for layer in (0, 3):
        ref = dense.model.layers[layer].mlp
        x = torch.randn(5, 64)
        got = moes[layer](x.bfloat16()).float()
        want = ref(x)
        assert ((got - want).norm() / want.norm()) < 0.03
