"""Read a llama.cpp GGUF checkpoint: metadata as an HF-style config and tensors by HF name.

Quantized tensors are dequantized to float32 at load. llama.cpp's converter permutes the
rows of Q and K (interleaved rope pairs instead of HF's half split); we undo it here so the
model code has a single rope layout.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import torch

SUPPORTED_GGUF_ARCHS = ("llama", "qwen2", "qwen3")

# GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N.").
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")


def read_fields(reader: Any) -> dict[str, Any]:
    """All GGUF metadata as Python values (strings decoded, arrays as lists)."""
    import gguf

    out: dict[str, Any] = {}
    for key, f in reader.fields.items():
        if not f.types:
            continue
        if f.types[0] == gguf.GGUFValueType.ARRAY:
            if len(f.types) > 1 and f.types[1] == gguf.GGUFValueType.STRING:
                out[key] = [bytes(f.parts[i]).decode("utf-8", errors="replace") for i in f.data]
            else:
                out[key] = [f.parts[i].tolist()[0] for i in f.data]
        elif f.types[0] == gguf.GGUFValueType.STRING:
            out[key] = bytes(f.parts[f.data[0]]).decode("utf-8", errors="replace")
        else:
            out[key] = f.parts[f.data[0]].tolist()[0]
    return out


def hf_config_from_gguf(fields: dict[str, Any], num_tensors_named: set[str]) -> dict[str, Any]:
    arch = fields.get("general.architecture", "")
    if arch not in SUPPORTED_GGUF_ARCHS:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r} (supported: {', '.join(SUPPORTED_GGUF_ARCHS)})"
        )

    def get(key: str, default: Any = None) -> Any:
        return fields.get(f"{arch}.{key}", default)

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    vocab = get("vocab_size") or len(fields.get("tokenizer.ggml.tokens", []))
    cfg: dict[str, Any] = {
        "model_type": arch,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(get("context_length", 4096)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in num_tensors_named,
        "bos_token_id": fields.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": fields.get("tokenizer.ggml.eos_token_id"),
    }
    scaling_type = get("rope.scaling.type")
    if scaling_type == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    elif scaling_type not in (None, "none"):
        raise ValueError(f"unsupported GGUF rope scaling {scaling_type!r}")
    return cfg


def unpermute_rope_rows(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp convert's ``permute(w, n_head, n_head_kv)`` on Q or K rows.

    The converter maps each head's rows from [2, dim/2] (HF half split) to [dim/2, 2]
    (interleaved pairs) via reshape(n_head, 2, d/2, ...).swapaxes(1, 2); we swap back.
    """
    shape = weight.shape
    half = shape[0] // n_head // 2
    return weight.reshape(n_head, half, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


class GGUFTensors:
    """Dequantized tensors of a GGUF file, looked up by HF name."""

    def __init__(self, reader: Any, config: dict[str, Any]) -> None:
        self._by_hf_name: dict[str, Any] = {}
        for t in reader.tensors:
            hf = _hf_name(t.name)
            if hf is not None:
                self._by_hf_name[hf] = t
        self._heads = config["num_attention_heads"]
        self._kv_heads = config["num_key_value_heads"]
        # Only llama-arch conversions permute Q/K; qwen2/qwen3 keep HF's layout.
        self._permuted = config["model_type"] == "llama"

    def __call__(self, name: str) -> torch.Tensor | None:
        from gguf.quants import dequantize

        t = self._by_hf_name.get(name)
        if t is None:
            return None
        arr = dequantize(t.data, t.tensor_type)
        arr = np.asarray(arr, dtype=np.float32).reshape([int(d) for d in reversed(t.shape)])
        if self._permuted and name.endswith(("q_proj.weight", "q_proj.bias")):
            arr = unpermute_rope_rows(arr, self._heads)
        elif self._permuted and name.endswith(("k_proj.weight", "k_proj.bias")):
            arr = unpermute_rope_rows(arr, self._kv_heads)
        arr = np.ascontiguousarray(arr)
        if not arr.flags.writeable:  # float tensors come back as views of the mmap
            arr = arr.copy()
        return torch.from_numpy(arr)


    def raw(self, name: str) -> tuple[str, np.ndarray, int, int] | None:
        """A tensor's type name, its bytes ``[rows, row bytes]`` in HF row order, and its
        ``[n, k]`` shape, without dequantizing (None when the file has no such tensor)."""
        t = self._by_hf_name.get(name)
        if t is None or len(t.shape) != 2:
            return None
        k, n = (int(d) for d in t.shape)
        data = np.asarray(t.data).view(np.uint8).reshape(n, -1)
        if self._permuted and name.endswith("q_proj.weight"):
            data = unpermute_rope_rows(data, self._heads)
        elif self._permuted and name.endswith("k_proj.weight"):
            data = unpermute_rope_rows(data, self._kv_heads)
        return t.tensor_type.name, data, n, k


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    return None
