"""GGUF files of Gemma 2, Gemma 3, Phi-3, OLMo 2, Granite and SmolLM3 load into the model the
safetensors checkpoint makes: the same greedy tokens.

Each file is written here from a tiny safetensors checkpoint the way llama.cpp's converter
(``convert_hf_to_gguf.py``) writes that architecture: its tensor names, its changes to the
tensors (q/k rows interleaved for the Llama-style ones, ``1 + w`` on Gemma's norms, no LM head
for Gemma 2, Gemma 3's embedding rows cut to the tokenizer's) and its metadata keys. Where a
tiny config says something no key carries (llama.cpp fixes it per architecture: which Gemma
layers slide, Gemma's query scale, SmolLM3's NoPE layers), the checkpoint is a variant that
agrees with llama.cpp's fixed choice.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Protocol

import gguf
import numpy as np
import pytest
import torch
from iron_batch.backends.torch_backend import TorchBackend
from iron_batch.loader import read_config, resolve
from iron_batch.models.registry import config_from_hf
from safetensors.numpy import load_file
from tiny_models import (
    backend,
    checkpoint,
    random_prompts,
    reference_model,
    run_scheduler,
    variant_checkpoint,
    write_gguf_byte_vocabulary,
)

FAMILIES = ["gemma2", "gemma3", "phi3", "olmo2", "granite", "smollm3"]

#: Config changes that make a tiny checkpoint one llama.cpp's GGUF can hold.
VARIANTS: dict[str, dict[str, Any]] = {
    # llama.cpp scales Gemma 2's queries by the head size (but in the 27B model).
    "gemma2": {"query_pre_attn_scalar": 16},
    # Five sliding layers to each global one; the converter keeps as many embedding rows
    # as the tokenizer has tokens (259 + 3 added), so the vocabulary is that size.
    "gemma3": {"num_hidden_layers": 6, "layer_types": None, "vocab_size": 262},
    # Every fourth layer without rotary.
    "smollm3": {"num_hidden_layers": 4, "no_rope_layers": None},
}

#: llama.cpp's ``general.architecture`` of each family (and of Llama, for its rope factors).
ARCH = {"gemma2": "gemma2", "gemma3": "gemma3", "phi3": "phi3", "olmo2": "olmo2",
        "granite": "granite", "smollm3": "smollm3", "llama": "llama"}


def _checkpoint(name: str) -> Path:
    changes = VARIANTS.get(name)
    if changes is None:
        return checkpoint(name)
    return variant_checkpoint(name, tuple(sorted(changes.items())))


# ----------------------------------------------------------------- the writer


def _block_names(arch: str) -> dict[str, str]:
    """HF layer tensor (after ``model.layers.N.``) -> llama.cpp's (after ``blk.N.``)."""
    names = {
        "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
        # Phi-3's fused tensors, kept fused (ffn_up holds gate then up).
        "self_attn.qkv_proj": "attn_qkv",
        "mlp.gate_up_proj": "ffn_up",
    }
    if arch in ("gemma2", "gemma3", "olmo2"):
        # Norms on the sublayers' outputs; Gemma's norm before the MLP is ffn_norm.
        names["post_attention_layernorm"] = "post_attention_norm"
        names["pre_feedforward_layernorm"] = "ffn_norm"
        names["post_feedforward_layernorm"] = "post_ffw_norm"
    return names


def _gguf_name(arch: str, hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight",
           "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    parts = hf.split(".")
    assert parts[:2] == ["model", "layers"], hf
    layer, stem, suffix = parts[2], ".".join(parts[3:-1]), parts[-1]
    return f"blk.{layer}.{_block_names(arch)[stem]}.{suffix}"


def _interleave(w: np.ndarray, heads: int) -> np.ndarray:
    """The converter's Llama q/k row order: each head's half-split rows as rope pairs."""
    return (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _tensors(arch: str, folder: Path, cfg: dict[str, Any],
             vocab_rows: int | None = None) -> dict[str, np.ndarray]:
    state = load_file(str(folder / "model.safetensors"))
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    tied = cfg.get("tie_word_embeddings", True)
    out: dict[str, np.ndarray] = {}
    for hf, value in state.items():
        w = value.astype(np.float32)
        if hf == "lm_head.weight" and (tied or arch == "gemma2"):
            continue  # tied, or Gemma 2 (llama.cpp runs its head off the embedding)
        if arch in ("gemma2", "gemma3") and hf.endswith("norm.weight"):
            w = w + 1.0  # Gemma's (1 + w) norms, stored as used
        if arch in ("granite", "smollm3", "llama"):  # LlamaModel.modify_tensors' permutation
            if hf.endswith(("q_proj.weight", "q_proj.bias")):
                w = _interleave(w, heads)
            elif hf.endswith(("k_proj.weight", "k_proj.bias")):
                w = _interleave(w, kv_heads)
        if arch == "gemma3" and hf == "model.embed_tokens.weight":
            if vocab_rows is None:
                tok = json.loads((folder / "tokenizer.json").read_text())
                vocab_rows = len(tok["model"]["vocab"]) + len(tok["added_tokens"])
            w = w[:vocab_rows]
        out[_gguf_name(arch, hf)] = w
    # The names agree with gguf-py's own table for the architecture.
    table = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg["num_hidden_layers"])
    for hf in state:
        if hf == "lm_head.weight" and _gguf_name(arch, hf) not in out:
            continue
        assert table.get_name(hf, try_suffixes=(".weight", ".bias")) == _gguf_name(arch, hf), hf
    return out


def _rope(cfg: dict[str, Any]) -> dict[str, Any]:
    """The global layers' rope parameters (transformers 5 or 4.x layout)."""
    params = cfg.get("rope_parameters") or {}
    params = params.get("full_attention", params)
    if not params:
        params = {**(cfg.get("rope_scaling") or {}), "rope_theta": cfg.get("rope_theta", 1e4)}
    return params


def _metadata(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The architecture keys the converter writes (without the ``arch.`` prefix)."""
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    rope = _rope(cfg)
    kv: dict[str, Any] = {}
    if arch == "gemma2":  # Gemma2Model.set_gguf_parameters: its own list, no rope keys
        kv.update({
            "context_length": cfg["max_position_embeddings"],
            "embedding_length": cfg["hidden_size"], "block_count": cfg["num_hidden_layers"],
            "feed_forward_length": cfg["intermediate_size"],
            "attention.head_count": heads, "attention.head_count_kv": kv_heads,
            "attention.layer_norm_rms_epsilon": float(cfg["rms_norm_eps"]),
            "attention.key_length": cfg["head_dim"], "attention.value_length": cfg["head_dim"],
            "attn_logit_softcapping": float(cfg["attn_logit_softcapping"]),
            "final_logit_softcapping": float(cfg["final_logit_softcapping"]),
            "attention.sliding_window": cfg["sliding_window"],
        })
        return kv
    if arch == "phi3":  # Phi3MiniModel: its own list, LongRoPE as factor tensors
        hidden = cfg["hidden_size"]
        partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
        kv.update({
            "context_length": cfg["max_position_embeddings"],
            "rope.scaling.original_context_length": cfg["original_max_position_embeddings"],
            "embedding_length": hidden, "feed_forward_length": cfg["intermediate_size"],
            "block_count": cfg["num_hidden_layers"], "attention.head_count": heads,
            "attention.head_count_kv": kv_heads,
            "attention.layer_norm_rms_epsilon": float(cfg["rms_norm_eps"]),
            "rope.dimension_count": int(partial * hidden) // heads,
            "rope.freq_base": float(rope["rope_theta"]),
            "attention.sliding_window": cfg.get("sliding_window") or 0,
        })
        if rope.get("long_factor"):
            scale = cfg["max_position_embeddings"] / cfg["original_max_position_embeddings"]
            orig = cfg["original_max_position_embeddings"]
            kv["rope.scaling.attn_factor"] = (
                math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1.0 else 1.0)
        return kv
    # TextModel.set_gguf_parameters (every other architecture here)
    if arch == "granite":
        cfg = {k: v for k, v in cfg.items() if k != "head_dim"}  # the converter drops it
    kv.update({
        "block_count": cfg["num_hidden_layers"],
        "context_length": cfg["max_position_embeddings"],
        "embedding_length": cfg["hidden_size"], "feed_forward_length": cfg["intermediate_size"],
        "attention.head_count": heads, "attention.head_count_kv": kv_heads,
    })
    if rope.get("rope_type") == "linear":
        kv["rope.scaling.type"] = "linear"
        kv["rope.scaling.factor"] = float(rope["factor"])
    kv["rope.freq_base"] = float(rope["rope_theta"])
    kv["attention.layer_norm_rms_epsilon"] = float(cfg["rms_norm_eps"])
    if cfg.get("head_dim") is not None:
        kv["attention.key_length"] = cfg["head_dim"]
        kv["attention.value_length"] = cfg["head_dim"]
    if arch in ("granite", "smollm3", "llama"):  # LlamaModel adds these
        kv["vocab_size"] = cfg["vocab_size"]
        kv["rope.dimension_count"] = cfg.get("head_dim") or cfg["hidden_size"] // heads
    if arch == "granite":
        for hf_key, key in (("attention_multiplier", "attention.scale"),
                            ("embedding_multiplier", "embedding_scale"),
                            ("residual_multiplier", "residual_scale"),
                            ("logits_scaling", "logit_scale")):
            if cfg.get(hf_key):
                kv[key] = float(cfg[hf_key])
    if arch == "gemma3":
        if cfg.get("final_logit_softcapping"):
            kv["final_logit_softcapping"] = float(cfg["final_logit_softcapping"])
        if cfg.get("sliding_window_pattern") != 1:
            kv["attention.sliding_window"] = cfg["sliding_window"]
    return kv


def _llama3_factors(cfg: dict[str, Any], rope: dict[str, Any]) -> np.ndarray:
    """What LlamaModel.generate_extra_tensors writes for Llama 3.1's rope scaling: one
    divisor per frequency (the long wavelengths slowed by ``factor``, the short ones kept,
    the band between blended)."""
    dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    base = rope["rope_theta"]
    factor = rope["factor"]
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old = rope.get("original_max_position_embeddings", 8192)
    out = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * base ** (i / dim)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def _put(w: gguf.GGUFWriter, key: str, value: Any) -> None:
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    else:
        w.add_array(key, value)


class Vocabulary(Protocol):
    """A tokenizer's GGUF keys, written in place of the checkpoint's byte vocabulary."""

    size: int

    def write(self, w: gguf.GGUFWriter) -> None: ...


def write_gguf(name: str, out: Path, overrides: dict[str, Any] | None = None, *,
               folder: Path | None = None, vocabulary: Vocabulary | None = None) -> Path:
    """The GGUF file llama.cpp's converter makes of checkpoint ``name`` (``overrides``:
    architecture keys changed, None to drop one; ``folder``: a checkpoint of that family
    to write instead; ``vocabulary``: the tokenizer to write, of the checkpoint's
    vocabulary size, instead of its byte-level one)."""
    folder = folder or _checkpoint(name)
    arch = ARCH[name]
    cfg = json.loads((folder / "config.json").read_text())
    tensors = _tensors(arch, folder, cfg, vocabulary.size if vocabulary else None)
    kv = {**_metadata(arch, cfg), **(overrides or {})}
    rope = _rope(cfg)
    if arch == "llama" and rope.get("rope_type") == "llama3":
        tensors["rope_freqs.weight"] = _llama3_factors(cfg, rope)
    if arch == "phi3" and rope.get("long_factor"):
        tensors["rope_factors_long.weight"] = np.asarray(rope["long_factor"], np.float32)
        tensors["rope_factors_short.weight"] = np.asarray(rope["short_factor"], np.float32)
    w = gguf.GGUFWriter(str(out), arch)
    for key, value in kv.items():
        if value is not None:
            _put(w, f"{arch}.{key}", value)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    if vocabulary is not None:
        vocabulary.write(w)
    else:
        write_gguf_byte_vocabulary(w, folder, tensors["token_embd.weight"].shape[0])
    for tname, value in tensors.items():
        w.add_tensor(tname, np.ascontiguousarray(value))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _backend(path: Path) -> TorchBackend:
    return TorchBackend.from_model(str(path), device="cpu", dtype="float32",
                                   total_kv_blocks=256, kv_block_size=4)


# ----------------------------------------------------------------- the tests


@pytest.mark.parametrize("name", FAMILIES)
def test_gguf_reads_the_checkpoints_config(name: str, tmp_path: Path) -> None:
    """The GGUF metadata says what config.json says, field by field."""
    folder = _checkpoint(name)
    path = write_gguf(name, tmp_path / f"{name}.gguf")
    want = dataclasses.asdict(config_from_hf(json.loads((folder / "config.json").read_text())))
    got = dataclasses.asdict(read_config(resolve(str(path))))
    # The file says eos once (tokenizer.ggml.eos_token_id) and holds its floats as float32;
    # the LongRoPE attention factor transformers derives, the converter writes.
    want["eos_token_ids"] = want["eos_token_ids"][:1]
    if name == "phi3":
        factor = got["rope_scaling"].pop("attention_factor")
        assert factor == pytest.approx(math.sqrt(1 + math.log(2) / math.log(256)), rel=1e-6)
    assert got == _to_float32(want)


def _to_float32(value: Any) -> Any:
    """``value`` with its floats compared to float32 precision."""
    if isinstance(value, float):
        return pytest.approx(value, rel=1e-6)
    if isinstance(value, dict):
        return {k: _to_float32(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_to_float32(v) for v in value)
    return value


@pytest.mark.parametrize("name", FAMILIES)
def test_gguf_gives_the_safetensors_tokens(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Greedy tokens of the GGUF file equal the safetensors checkpoint's, over sequences
    longer than the sliding windows (and, for Phi-3, past the position where LongRoPE's long
    factors take over); the loaded norms are the checkpoint's (Gemma's offset added once)."""
    if name == "gemma2":
        # The Rust decode attention kernel has no soft-capping (it refuses it): the torch
        # attention runs Gemma 2's decodes, for both checkpoints alike.
        monkeypatch.setenv("IRON_BATCH_CPU_ATTENTION", "torch")
    ref = _backend(_checkpoint(name))
    got = _backend(write_gguf(name, tmp_path / f"{name}.gguf"))
    assert [g for g in got.model.cache_groups] == ref.model.cache_groups
    assert torch.equal(got.model.norm.weight, ref.model.norm.weight)
    for a, b in zip(got.model.layers, ref.model.layers, strict=True):
        for slot in ("input_norm", "post_norm", "attn_out_norm", "mlp_out_norm"):
            na, nb = getattr(a, slot), getattr(b, slot)
            assert (na is None) == (nb is None)
            if na is not None:
                assert torch.equal(na.weight, nb.weight), slot
        if b.q_norm is not None:
            assert torch.equal(a.q_norm.weight, b.q_norm.weight)
        assert a.rotary_dim == b.rotary_dim and a.sliding_window == b.sliding_window
    lengths = [5, 37, 61] + ([270] if name == "phi3" else [])
    rng = np.random.default_rng(sum(map(ord, name)))
    prompts = [rng.integers(3, ref.vocab_size, size=n).tolist() for n in lengths]
    want, _ = run_scheduler(ref, prompts, 16)
    out, _ = run_scheduler(got, prompts, 16)
    assert out == want


@pytest.mark.parametrize(("name", "overrides", "named"), [
    ("olmo2", {"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0},
     "olmo2.rope.scaling.type = 'yarn'"),
    ("phi3", {"rope.scaling.type": "yarn"}, "phi3.rope.scaling.type = 'yarn'"),
    ("olmo2", {"attention.sliding_window": 4096}, "olmo2.attention.sliding_window = 4096"),
    ("granite", {"rope.scaling.finetuned": False}, "granite.rope.scaling.finetuned = False"),
])
def test_gguf_key_not_run_is_refused_by_name(
    name: str, overrides: dict[str, Any], named: str, tmp_path: Path
) -> None:
    path = write_gguf(name, tmp_path / f"{name}.gguf", overrides)
    with pytest.raises(ValueError) as err:
        _backend(path)
    message = str(err.value)
    assert named in message and "\n" not in message


def test_llama3_rope_scaling_reaches_a_gguf_file_as_frequency_factors(tmp_path: Path) -> None:
    """tiny_models' llama has Llama 3.1 rope scaling (factor 8 past 64 positions): its GGUF
    carries it as ``rope_freqs.weight``, which must be applied, not dropped."""
    path = write_gguf("llama", tmp_path / "llama.gguf")
    prompts = random_prompts(83, [5, 40, 90])
    want, _ = run_scheduler(backend("llama"), prompts, 24)
    got, _ = run_scheduler(_backend(path), prompts, 24)
    assert got == want
    # The frequencies are transformers' Llama 3.1 ones, which plain rope's are not.
    hf = reference_model("llama").model.rotary_emb.inv_freq
    ours = _backend(path).model.rotaries[0].inv_freq
    torch.testing.assert_close(ours, hf, rtol=1e-6, atol=0)
    assert not torch.allclose(ours, 1.0 / (500000.0 ** (torch.arange(0, 16, 2).float() / 16)))
