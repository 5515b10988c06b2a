"""llama.cpp's ``gpt-oss`` GGUF files, written here as its converter (``GptOssModel`` in
``convert_hf_to_gguf.py``) writes them from a tiny gpt-oss checkpoint: the MXFP4 experts
load as the same MXFP4 bytes the safetensors checkpoint gives (values those of
``gguf.quants.dequantize`` and of transformers' dequantization), the file gives the
safetensors model's greedy tokens and logits (MXFP4 experts, and float ones), on two
tensor-parallel ranks too; a file without a tensor a layer needs, or with a key this
implementation does not run, is refused in one line naming it."""

from __future__ import annotations

import json
import shutil
from functools import cache
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize
from iron_batch.backends.torch_backend import TorchBackend
from iron_batch.layers import mxfp4
from iron_batch.layers.moe import MoE
from iron_batch.layers.quant import QuantWeight
from safetensors.torch import load_file, save_file
from tiny_models import (
    greedy_on_one_and_two_ranks,
    random_prompts,
    run_scheduler,
    variant_checkpoint,
    write_gguf_byte_vocabulary,
)
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

NAME = "gpt_oss"
#: The tiny gpt-oss as llama.cpp runs any gpt-oss: the experts' SwiGLU clamped at 7 (a
#: constant of llama.cpp's graph, no key in the file). 64 intermediate rows: two ranks get
#: one 32-weight MXFP4 block of each expert's down projection.
_CHANGES = (("intermediate_size", 64), ("swiglu_limit", 7.0))


@cache
def _float_checkpoint() -> Path:
    return variant_checkpoint(NAME, _CHANGES)


@cache
def _mxfp4_checkpoint() -> Path:
    """The float checkpoint with its experts replaced by random MXFP4 blocks, stored as
    the released checkpoints store them (``*_blocks`` / ``*_scales``)."""
    src = _float_checkpoint()
    folder = src.parent / f"{src.name}-mxfp4"
    folder.mkdir(exist_ok=True)
    cfg = json.loads((src / "config.json").read_text())
    tensors = load_file(str(src / "model.safetensors"))
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    experts = cfg["num_local_experts"]
    g = torch.Generator().manual_seed(9)
    for i in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{i}.mlp.experts."
        for proj, n, k in (("gate_up_proj", 2 * inter, hidden), ("down_proj", hidden, inter)):
            del tensors[pre + proj]
            tensors[pre + proj + "_blocks"] = torch.randint(
                0, 256, (experts, n, k // 32, 16), generator=g, dtype=torch.uint8)
            # Weights of up to 6 * 2^-5, as wide as the float checkpoint's.
            tensors[pre + proj + "_scales"] = torch.randint(
                118, 123, (experts, n, k // 32), generator=g, dtype=torch.uint8)
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(
        {**cfg, "quantization_config": {"quant_method": "mxfp4"}}))
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special")):
            shutil.copy(f, folder / f.name)
    return folder


# ------------------------------------------------------------ the converter, as llama.cpp's


def _ggml_mxfp4(codes: np.ndarray, exps: np.ndarray) -> np.ndarray:
    """HF's MXFP4 (``codes`` ``[..., k / 32, 16]``: byte ``b`` holds weight ``2b`` in its
    low nibble and ``2b + 1`` in its high one; ``exps`` ``[..., k / 32]``) as ggml's
    ``block_mxfp4`` bytes ``[..., k / 32 * 17]``, what ``GptOssModel.repack_mxfp4`` writes:
    per block the exponent, then its ``transform_nibble_layout`` codes, byte ``j`` holding
    weight ``j`` in its low nibble and weight ``j + 16`` in its high one."""
    weights = np.stack([codes & 15, codes >> 4], axis=-1).reshape(*codes.shape[:-1], 32)
    ggml_codes = weights[..., :16] | (weights[..., 16:] << 4)
    blocks = np.concatenate([exps[..., None], ggml_codes], axis=-1)
    return np.ascontiguousarray(blocks.reshape(*blocks.shape[:-2], -1))


#: HF name (after ``model.layers.N.``) -> llama.cpp's (after ``blk.N.``).
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    **{f"self_attn.{h}_proj.{kind}": f"attn_{g}.{kind}"
       for h, g in (("q", "q"), ("k", "k"), ("v", "v"), ("o", "output"))
       for kind in ("weight", "bias")},
    # The converter names the sinks "...sinks.weight" before mapping them.
    "self_attn.sinks": "attn_sinks.weight",
    "mlp.router.weight": "ffn_gate_inp.weight",
    "mlp.router.bias": "ffn_gate_inp.bias",
    "mlp.experts.down_proj_bias": "ffn_down_exps.bias",
}


def _tensors(state: dict[str, torch.Tensor]) -> dict[str, tuple[np.ndarray, bool]]:
    """llama.cpp's tensors of an HF gpt-oss state: name -> (values, raw MXFP4 bytes)."""
    top = {"model.embed_tokens.weight": "token_embd.weight",
           "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
    out: dict[str, tuple[np.ndarray, bool]] = {}
    for hf, value in state.items():
        v = value.numpy()
        if hf in top:
            out[top[hf]] = (v.astype(np.float32), False)
            continue
        layer, stem = hf.split(".")[2], ".".join(hf.split(".")[3:])
        blk = f"blk.{layer}."
        if stem in _LAYER:
            out[blk + _LAYER[stem]] = (v.astype(np.float32), False)
        elif stem == "mlp.experts.gate_up_proj_bias":  # [E, 2I], gate and up interleaved
            out[blk + "ffn_gate_exps.bias"] = (v[:, 0::2].astype(np.float32), False)
            out[blk + "ffn_up_exps.bias"] = (v[:, 1::2].astype(np.float32), False)
        elif stem == "mlp.experts.gate_up_proj_blocks":  # rows interleaved, like the bias
            scales = state[hf.replace("_blocks", "_scales")].numpy()
            out[blk + "ffn_gate_exps.weight"] = (_ggml_mxfp4(v[:, 0::2], scales[:, 0::2]), True)
            out[blk + "ffn_up_exps.weight"] = (_ggml_mxfp4(v[:, 1::2], scales[:, 1::2]), True)
        elif stem == "mlp.experts.down_proj_blocks":
            scales = state[hf.replace("_blocks", "_scales")].numpy()
            out[blk + "ffn_down_exps.weight"] = (_ggml_mxfp4(v, scales), True)
        elif stem == "mlp.experts.gate_up_proj":  # float: [E, H, 2I], transposed first
            t = v.transpose(0, 2, 1)
            out[blk + "ffn_gate_exps.weight"] = (t[:, 0::2].astype(np.float32), False)
            out[blk + "ffn_up_exps.weight"] = (t[:, 1::2].astype(np.float32), False)
        elif stem == "mlp.experts.down_proj":  # float: [E, I, H]
            out[blk + "ffn_down_exps.weight"] = (v.transpose(0, 2, 1).astype(np.float32), False)
        else:
            assert stem.endswith("_scales"), hf
    return out


def write_gguf(folder: Path, out: Path, *, drop: tuple[str, ...] = (),
               extra: dict[str, Any] | None = None) -> Path:
    """The GGUF llama.cpp's converter writes of the checkpoint in ``folder``, less the
    tensors ``drop``, with the architecture keys ``extra`` added."""
    arch = "gpt-oss"
    cfg = json.loads((folder / "config.json").read_text())
    rope = cfg.get("rope_parameters") or {**(cfg.get("rope_scaling") or {}),
                                          "rope_theta": cfg.get("rope_theta")}
    assert rope["rope_type"] == "yarn"
    tensors = _tensors(load_file(str(folder / "model.safetensors")))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT_OSS, cfg["num_hidden_layers"])
    known = {names.get_name(k) for k in names.mapping}
    assert all(t.rsplit(".", 1)[0] in known for t in tensors), sorted(tensors)
    # TextModel.set_gguf_parameters, then GptOssModel's own.
    kv: dict[str, Any] = {
        "block_count": cfg["num_hidden_layers"],
        "context_length": cfg["max_position_embeddings"],
        "embedding_length": cfg["hidden_size"],
        "feed_forward_length": cfg["intermediate_size"],
        "attention.head_count": cfg["num_attention_heads"],
        "attention.head_count_kv": cfg["num_key_value_heads"],
        "rope.freq_base": float(rope["rope_theta"]),
        "attention.layer_norm_rms_epsilon": float(cfg["rms_norm_eps"]),
        "expert_count": cfg["num_local_experts"],
        "expert_used_count": cfg["num_experts_per_tok"],
        "attention.key_length": cfg["head_dim"],
        "attention.value_length": cfg["head_dim"],
        "rope.scaling.factor": float(rope["factor"]),
        "rope.scaling.original_context_length": rope["original_max_position_embeddings"],
        "rope.scaling.yarn_beta_fast": float(rope["beta_fast"]),
        "rope.scaling.yarn_beta_slow": float(rope["beta_slow"]),
        "attention.sliding_window": cfg["sliding_window"],
        "expert_feed_forward_length": cfg["intermediate_size"],
        **(extra or {}),
    }
    w = gguf.GGUFWriter(str(out), arch)
    w.add_string(f"{arch}.rope.scaling.type", "yarn")
    for key, value in kv.items():
        if isinstance(value, float):
            w.add_float32(f"{arch}.{key}", value)
        else:
            w.add_uint32(f"{arch}.{key}", int(value))
    write_gguf_byte_vocabulary(w, folder, tensors["token_embd.weight"][0].shape[0])
    for tname, (value, raw) in tensors.items():
        if tname in drop:
            continue
        if raw:
            w.add_tensor(tname, value, raw_dtype=gguf.GGMLQuantizationType.MXFP4)
        else:
            w.add_tensor(tname, np.ascontiguousarray(value))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@cache
def _gguf(experts: str) -> Path:
    folder = _mxfp4_checkpoint() if experts == "mxfp4" else _float_checkpoint()
    return write_gguf(folder, folder.parent / f"{folder.name}.gguf")


def _checkpoint(experts: str) -> Path:
    return _mxfp4_checkpoint() if experts == "mxfp4" else _float_checkpoint()


def _backend(path: Path, dtype: str = "float32") -> TorchBackend:
    return TorchBackend.from_model(str(path), device="cpu", dtype=dtype,
                                   total_kv_blocks=256, kv_block_size=4)


def _prompt_logits(model: Any, seq: list[int]) -> torch.Tensor:
    """Every position's logits of ``seq``, one prompt in one forward."""
    table = list(range(16))
    n = len(seq)
    slots = [table[p // 4] * 4 + p % 4 for p in range(n)]
    groups = len(model.cache_groups)
    return model.forward(
        input_ids=np.array(seq), positions=np.arange(n),
        slot_mapping=np.array(slots, np.int64), query_start_loc=np.array([0, n], np.int32),
        seq_lens=np.array([n], np.int32), num_computed_before=np.array([0], np.int32),
        block_tables=np.array([table], np.int32),
        group_slot_mapping=np.array([slots] * (groups - 1), np.int64),
        group_block_tables=np.array([table] * (groups - 1), np.int32),
        sample_indices=np.arange(n))


def _file_values(t: Any) -> np.ndarray:
    """An MXFP4 tensor of the file, dequantized by gguf-py (ggml's own rule)."""
    assert t.tensor_type == gguf.GGMLQuantizationType.MXFP4
    return dequantize(t.data, t.tensor_type)


# ------------------------------------------------------------------------------ the tests


def test_mxfp4_experts_load_as_the_files_blocks() -> None:
    """Each layer's stacked experts stay MXFP4 (in float32 and in bf16): the bytes the
    safetensors checkpoint loads as, whose values are ``gguf.quants.dequantize``'s of the
    file's tensors and transformers' of the checkpoint's."""
    path = _gguf("mxfp4")
    reader = gguf.GGUFReader(str(path))
    file = {t.name: t for t in reader.tensors}
    ours = _backend(path).model
    theirs = _backend(_mxfp4_checkpoint()).model
    state = load_file(str(_mxfp4_checkpoint() / "model.safetensors"))
    for i, (layer, ref) in enumerate(zip(ours.layers, theirs.layers, strict=True)):
        assert isinstance(layer.mlp, MoE) and isinstance(ref.mlp, MoE)
        experts = layer.mlp.num_experts
        for lin, ref_lin in ((layer.mlp.gate_up, ref.mlp.gate_up),
                             (layer.mlp.down, ref.mlp.down)):
            w = lin.weight
            assert isinstance(w, QuantWeight) and w.kind == "mxfp4"
            assert isinstance(ref_lin.weight, QuantWeight)
            assert torch.equal(w.quants, ref_lin.weight.quants)
            assert torch.equal(w.scale, ref_lin.weight.scale)
            torch.testing.assert_close(lin.bias, ref_lin.bias, rtol=0, atol=0)
        gate, up = (_file_values(file[f"blk.{i}.ffn_{p}_exps.weight"])
                    for p in ("gate", "up"))  # [E, I, H]
        want = np.concatenate([gate, up], axis=1).reshape(-1, gate.shape[2])
        got = mxfp4.dequantize_f32(layer.mlp.gate_up.weight).numpy()
        # Equal values (ggml's table has +0 for the code of -0: equal, not the same bits).
        assert np.array_equal(got, want)
        down = _file_values(file[f"blk.{i}.ffn_down_exps.weight"])  # [E, H, I]
        assert np.array_equal(mxfp4.dequantize_f32(layer.mlp.down.weight).numpy(),
                              down.reshape(-1, down.shape[2]))
        pre = f"model.layers.{i}.mlp.experts."
        hf = convert_moe_packed_tensors(state[pre + "gate_up_proj_blocks"],
                                        state[pre + "gate_up_proj_scales"],
                                        dtype=torch.float32)  # [E, H, 2I], interleaved
        assert np.array_equal(gate, hf[..., 0::2].transpose(1, 2).numpy())
        assert np.array_equal(up, hf[..., 1::2].transpose(1, 2).numpy())
        assert want.shape[0] == experts * 2 * gate.shape[1]
    # In bf16 too the experts stay MXFP4, and decode steps read them in the expert kernel.
    bf16 = _backend(path, "bfloat16").model.layers[0].mlp
    assert isinstance(bf16, MoE) and bf16.decode_kernel
    assert isinstance(bf16.gate_up.weight, QuantWeight) and bf16.gate_up.weight.kind == "mxfp4"


@pytest.mark.parametrize("experts", ["mxfp4", "float"])
def test_gguf_gives_the_safetensors_tokens_and_logits(experts: str) -> None:
    ours, theirs = _backend(_gguf(experts)), _backend(_checkpoint(experts))
    config = ours.model.config
    assert (config.swiglu_alpha, config.swiglu_limit) == (1.702, 7.0)
    assert [la.sliding_window for la in ours.model.layers] == [6, None]
    seq = random_prompts(60, [23])[0]
    torch.testing.assert_close(_prompt_logits(ours.model, seq),
                               _prompt_logits(theirs.model, seq), rtol=1e-5, atol=1e-5)
    prefix = random_prompts(61, [13])[0]
    prompts = [prefix + s for s in random_prompts(62, [4, 9, 2])] + random_prompts(
        63, [18, 6, 11, 7])
    from_gguf, stats = run_scheduler(ours, prompts, 12, max_batch_tokens=9,
                                     max_running_seqs=6)
    assert stats["prefix_cache_hit_tokens"] > 0
    from_safetensors, _ = run_scheduler(theirs, prompts, 12, max_batch_tokens=9,
                                        max_running_seqs=6)
    assert all(len(o) == 12 for o in from_gguf)
    assert from_gguf == from_safetensors


def test_tp2_equals_tp1_from_gguf() -> None:
    """Two ranks, each with half the heads and one MXFP4 block of every expert's 64
    intermediate rows, give one rank's tokens from the GGUF file."""
    tp1, tp2 = greedy_on_one_and_two_ranks(
        str(_gguf("mxfp4")), random_prompts(64, [1, 5, 11, 17, 23]), 10)
    assert all(len(o) == 10 for o in tp1)
    assert tp2 == tp1


@pytest.mark.parametrize("drop, extra, named", [
    (("blk.1.attn_sinks.weight",), {}, "blk.1.attn_sinks.weight"),
    (("blk.0.ffn_up_exps.bias",), {}, "blk.0.ffn_up_exps.bias"),
    ((), {"rope.freq_base_swa": 10000.0}, "gpt-oss.rope.freq_base_swa"),
    ((), {"attention.sliding_window_pattern": 3.0}, "gpt-oss.attention.sliding_window_pattern"),
])
def test_what_cannot_run_is_refused_in_one_line(
    drop: tuple[str, ...], extra: dict[str, Any], named: str, tmp_path: Path
) -> None:
    path = write_gguf(_mxfp4_checkpoint(), tmp_path / "bad.gguf", drop=drop, extra=extra)
    with pytest.raises(ValueError, match=named.replace(".", r"\.")) as err:
        _backend(path)
    assert "\n" not in str(err.value)
