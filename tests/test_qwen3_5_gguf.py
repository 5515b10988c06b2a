"""Qwen3.5 from a GGUF file written here the way llama.cpp's converter writes ``qwen35``
(``conversion/qwen.py``: its tensor names and metadata keys; ``-exp(A_log)``; 1 added to the
norms but the gated one; value heads reordered from grouped to tiled where two value heads
share a key head): the config read back and the same greedy tokens as transformers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from iron_batch.backends.build import scheduler_config
from iron_batch.backends.torch_backend import TorchBackend
from iron_batch.loader import read_config, resolve
from safetensors.torch import load_file
from test_qwen3_5 import checkpoint, hf_greedy
from tiny_models import random_prompts, run_with_config

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
    }
    return f"blk.{i}.{names[rest]}"


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


def write_gguf(folder: Path, out: Path) -> Path:
    cfg = json.loads((folder / "config.json").read_text())
    tensors = load_file(str(folder / "model.safetensors"))
    w = gguf.GGUFWriter(str(out), ARCH)
    head_dim = cfg["head_dim"]
    rope = cfg.get("rope_parameters") or {}
    keys: dict[str, Any] = {
        "block_count": cfg["num_hidden_layers"], "context_length":
        cfg["max_position_embeddings"], "embedding_length": cfg["hidden_size"],
        "feed_forward_length": cfg["intermediate_size"],
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
    for key, value in keys.items():
        w.add_uint32(f"{ARCH}.{key}", int(value))
    w.add_float32(f"{ARCH}.rope.freq_base", float(rope.get("rope_theta", 10000.0)))
    w.add_float32(f"{ARCH}.attention.layer_norm_rms_epsilon", float(cfg["rms_norm_eps"]))
    w.add_array(f"{ARCH}.rope.dimension_sections", [11, 11, 10, 0])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    tok = json.loads((folder / "tokenizer.json").read_text())
    by_id = {i: t for t, i in tok["model"]["vocab"].items()}
    rows = cfg["vocab_size"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([by_id.get(i, f"[PAD{i}]") for i in range(rows)])
    w.add_token_types([gguf.TokenType.CONTROL if i < 3 else gguf.TokenType.NORMAL
                       if i in by_id else gguf.TokenType.UNUSED for i in range(rows)])
    w.add_token_merges([])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for name, t in tensors.items():
        w.add_tensor(_gguf_name(name), np.ascontiguousarray(
            _converted(name, t.float(), cfg).numpy()))
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
