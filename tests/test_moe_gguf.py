"""GGUF files of Qwen3-MoE, OLMoE, Qwen2-MoE and Mixtral (a ``llama`` file with experts),
written as llama.cpp's converter writes them (the experts stacked, one ``[experts, rows,
cols]`` tensor per projection and layer; the expert keys), load into the model the
safetensors checkpoint makes: the same greedy tokens; with ``--quantization gguf`` the Q8_0
experts stay in their blocks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from iron_batch.backends.torch_backend import TorchBackend
from iron_batch.layers.moe import MoE
from iron_batch.layers.quant import QuantWeight
from safetensors.numpy import load_file
from tiny_models import (
    random_prompts,
    run_scheduler,
    variant_checkpoint,
    write_gguf_byte_vocabulary,
)

#: family -> (llama.cpp architecture, config changes a GGUF file can say: llama.cpp makes
#: every Qwen3-MoE layer sparse: None drops the field, whose default is none dense).
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3_moe": ("qwen3moe", {"mlp_only_layers": None}),
    "olmoe": ("olmoe", {}),
    "qwen2_moe": ("qwen2moe", {}),
    # A llama file with experts; no key carries a sliding window.
    "mixtral": ("llama", {"sliding_window": None}),
}

_LAYER = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
_EXPERTS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps",
            "w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}
_LAYER["block_sparse_moe.gate"] = "ffn_gate_inp"


def _interleave(w: np.ndarray, heads: int) -> np.ndarray:
    """The converter's Llama q/k row order: each head's half-split rows as rope pairs."""
    return (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _checkpoint(name: str) -> Path:
    return variant_checkpoint(name, tuple(sorted(FAMILIES[name][1].items())))


def _tensors(arch: str, folder: Path, cfg: dict[str, Any]) -> dict[str, np.ndarray]:
    state = load_file(str(folder / "model.safetensors"))
    top = {"model.embed_tokens.weight": "token_embd.weight",
           "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
    out: dict[str, np.ndarray] = {}
    stacks: dict[str, dict[int, np.ndarray]] = {}
    for hf, value in state.items():
        w = value.astype(np.float32)
        if hf in top:
            out[top[hf]] = w
            continue
        parts = hf.split(".")
        layer, stem, suffix = parts[2], ".".join(parts[3:-1]), parts[-1]
        if stem.startswith(("mlp.experts.", "block_sparse_moe.experts.")):
            e, proj = int(parts[-3]), parts[-2]
            stacks.setdefault(f"blk.{layer}.{_EXPERTS[proj]}.{suffix}", {})[e] = w
            continue
        if arch == "llama" and stem in ("self_attn.q_proj", "self_attn.k_proj"):
            heads = cfg["num_attention_heads" if "q_proj" in stem else "num_key_value_heads"]
            w = _interleave(w, heads)
        if stem == "mlp.shared_expert_gate":
            w = w.reshape(-1)  # the converter writes the gate as a vector
        out[f"blk.{layer}.{_LAYER[stem]}.{suffix}"] = w
    for tname, by_expert in stacks.items():
        out[tname] = np.stack([by_expert[e] for e in sorted(by_expert)])
    return out


def write_gguf(name: str, out: Path, expert_type: str = "F32") -> Path:
    arch = FAMILIES[name][0]
    folder = _checkpoint(name)
    cfg = json.loads((folder / "config.json").read_text())
    tensors = _tensors(arch, folder, cfg)
    heads = cfg["num_attention_heads"]
    rope = cfg.get("rope_parameters") or {"rope_theta": cfg.get("rope_theta", 1e4)}
    kv: dict[str, Any] = {
        "block_count": cfg["num_hidden_layers"],
        "context_length": cfg["max_position_embeddings"],
        "embedding_length": cfg["hidden_size"],
        "feed_forward_length": cfg["intermediate_size"],
        "attention.head_count": heads,
        "attention.head_count_kv": cfg["num_key_value_heads"],
        "rope.freq_base": float(rope["rope_theta"]),
        "attention.layer_norm_rms_epsilon": float(cfg["rms_norm_eps"]),
        "expert_count": cfg.get("num_experts") or cfg["num_local_experts"],
        "expert_used_count": cfg["num_experts_per_tok"],
    }
    if arch == "llama":  # LlamaModel adds these
        kv["vocab_size"] = cfg["vocab_size"]
        kv["rope.dimension_count"] = cfg.get("head_dim") or cfg["hidden_size"] // heads
    if cfg.get("head_dim") is not None:
        kv["attention.key_length"] = kv["attention.value_length"] = cfg["head_dim"]
    if cfg.get("moe_intermediate_size"):
        kv["expert_feed_forward_length"] = cfg["moe_intermediate_size"]
    if cfg.get("shared_expert_intermediate_size"):
        kv["expert_shared_feed_forward_length"] = cfg["shared_expert_intermediate_size"]
    # The names agree with gguf-py's own table for the architecture.
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg["num_hidden_layers"])
    for tname in tensors:
        stem = tname.rsplit(".", 1)[0]
        assert stem in {names.get_name(k) for k in names.mapping} or tname in (
            "token_embd.weight", "output_norm.weight", "output.weight"), tname
    w = gguf.GGUFWriter(str(out), arch)
    for key, value in kv.items():
        if isinstance(value, float):
            w.add_float32(f"{arch}.{key}", value)
        else:
            w.add_uint32(f"{arch}.{key}", int(value))
    write_gguf_byte_vocabulary(w, folder, tensors["token_embd.weight"].shape[0])
    qtype = gguf.GGMLQuantizationType[expert_type]
    for tname, value in tensors.items():
        value = np.ascontiguousarray(value)
        if "_exps." in tname and qtype != gguf.GGMLQuantizationType.F32:
            w.add_tensor(tname, gguf.quants.quantize(value, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(tname, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _backend(path: Path, **kw: Any) -> TorchBackend:
    kw = {"device": "cpu", "dtype": "float32", **kw}
    return TorchBackend.from_model(str(path), total_kv_blocks=256, kv_block_size=4, **kw)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_gguf_gives_the_safetensors_tokens(name: str, tmp_path: Path) -> None:
    path = write_gguf(name, tmp_path / f"{name}.gguf")
    prompts = random_prompts(80, [11, 30, 3])
    from_gguf, _ = run_scheduler(_backend(path), prompts, 16)
    from_safetensors, _ = run_scheduler(_backend(_checkpoint(name)), prompts, 16)
    assert from_gguf == from_safetensors


def test_q8_experts_stay_in_their_blocks(tmp_path: Path) -> None:
    path = write_gguf("qwen3_moe", tmp_path / "q8.gguf", expert_type="Q8_0")
    quantized = _backend(path, dtype="bfloat16", quantization="gguf")
    dense = _backend(path)
    moes = [la.mlp for la in quantized.model.layers if isinstance(la.mlp, MoE)]
    assert len(moes) == 2
    assert all(isinstance(m.gate_up.weight, QuantWeight) and m.decode_kernel for m in moes)
    assert not any("experts" in t for t in quantized.model.dequantized)
    # The layer's output from its Q8_0 blocks: the dequantized file's float32 layer's.
    ref = dense.model.layers[0].mlp
    assert isinstance(ref, MoE)
    torch.manual_seed(2)
    x = torch.randn(3, ref.router.weight.shape[1])
    got = moes[0](x.bfloat16()).float()
    want = ref(x)
    assert ((got - want).norm() / want.norm()) < 0.03
