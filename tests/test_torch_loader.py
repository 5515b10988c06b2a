"""Checkpoint loading: HF folders (sharded too), config variants, GGUF helpers, errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from iron_batch.backends.torch_backend import TorchBackend
from iron_batch.loader import resolve
from iron_batch.loader.gguf import unpermute_rope_rows
from iron_batch.models.registry import config_from_hf
from tiny_models import checkpoint, hf_greedy, random_prompts, reference_model, run_scheduler


def test_sharded_safetensors_load(tmp_path: Path) -> None:
    folder = tmp_path / "sharded"
    reference_model("qwen2").save_pretrained(folder, max_shard_size="20KB")
    assert (folder / "model.safetensors.index.json").is_file()
    be = TorchBackend.from_model(str(folder), device="cpu", total_kv_blocks=32, kv_block_size=8)
    assert be.tokenizer is None  # no tokenizer.json in this folder
    prompt = random_prompts(5, [11])[0]
    outs, _ = run_scheduler(be, [prompt], 8)
    assert outs[0] == hf_greedy("qwen2", prompt, 8)


def test_backend_attributes() -> None:
    be = TorchBackend.from_model(str(checkpoint("llama")), device="cpu", kv_cache_memory_gb=0.001)
    # 2 layers * 2 (k, v) * 2 kv heads * 16 dims * 4 bytes * 16 tokens = 8 KiB per block.
    assert be.num_kv_blocks == int(0.001 * 2**30) // 8192
    assert be.kv_block_size == 16
    assert be.max_model_len == 512
    assert be.eos_token_ids == [2]
    assert be.model_name == "llama"
    assert be.model.dtype == torch.float32


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    folder = tmp_path / "gpt2"
    shutil.copytree(checkpoint("llama"), folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="gpt2"):
        TorchBackend.from_model(str(folder), device="cpu", total_kv_blocks=4)


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "broken"
    shutil.copytree(checkpoint("qwen3"), folder)
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_norm\.weight"):
        TorchBackend.from_model(str(folder), device="cpu", total_kv_blocks=4)


def test_unknown_model_argument() -> None:
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        resolve("no-such-model")


def test_rope_config_layouts() -> None:
    base = dict(model_type="llama", vocab_size=8, hidden_size=8, intermediate_size=8,
                num_hidden_layers=1, num_attention_heads=2)
    v4 = config_from_hf({**base, "rope_theta": 5e5,
                              "rope_scaling": {"type": "linear", "factor": 4.0}})
    v5 = config_from_hf({**base, "rope_parameters": {
        "rope_type": "linear", "factor": 4.0, "rope_theta": 5e5}})
    assert v4.rope_theta == v5.rope_theta == 5e5
    assert v4.rope_scaling == v5.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    plain = config_from_hf(base)
    assert plain.rope_scaling == {"rope_type": "default"} and plain.rope_theta == 10000.0
    assert plain.head_dim == 4 and plain.num_kv_heads == 2 and not plain.tie_word_embeddings


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # As in llama.cpp convert_hf_to_gguf.py LlamaModel.permute.
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


@pytest.mark.parametrize("shape", [(8 * 6, 5), (8 * 6,)])
def test_gguf_unpermute_inverts_converter(shape: tuple[int, ...]) -> None:
    w = np.random.default_rng(0).normal(size=shape).astype(np.float32)
    assert np.array_equal(unpermute_rope_rows(_llama_cpp_permute(w, 6), 6), w)
    assert not np.array_equal(_llama_cpp_permute(w, 6), w)


def test_server_flags_size_the_kv_pool_from_a_memory_budget() -> None:
    """`--kv-cache-memory-gb` reaches the backend, and the scheduler's pool follows it."""
    from iron_batch.server.cli import build_engine, build_parser

    parser = build_parser()
    path = str(checkpoint("llama"))
    small = build_engine(parser.parse_args(
        ["--backend", "torch", "--model", path, "--device", "cpu", "--kv-cache-memory-gb",
         "0.001"]), parser)
    big = build_engine(parser.parse_args(
        ["--backend", "torch", "--model", path, "--device", "cpu", "--kv-cache-memory-gb",
         "0.004"]), parser)
    per_block = small.backend.model.kv_bytes_per_block(small.config.kv_block_size)
    assert small.config.total_kv_blocks == int(0.001 * 2**30 // per_block)
    assert big.config.total_kv_blocks == int(0.004 * 2**30 // per_block)
    assert small.scheduler.stats()["total_blocks"] == small.config.total_kv_blocks
    with pytest.raises(SystemExit):
        build_engine(parser.parse_args(["--kv-cache-memory-gb", "1"]), parser)  # mock backend
