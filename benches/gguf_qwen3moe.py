"""A Qwen3-30B-A3B-shaped GGUF (``qwen3moe``) with random weights, in f16, for llama.cpp's
quantizer; by default with 16 of the 48 layers, so that its Q4_K_M file (about 6 GiB) fits
this 24 GiB machine twice (the server's copy and llama.cpp's mapping of the file).

    python benches/gguf_qwen3moe.py /tmp/qwen3moe-f16.gguf --layers 16
    python benches/gguf_requantize.py /tmp/qwen3moe-f16.gguf /tmp/qwen3moe-q4_k_m.gguf --type Q4_K_M
    python benches/gguf_batch1.py /tmp/qwen3moe-q4_k_m.gguf --rounds 3 --floor

Qwen3-30B-A3B's published shape: 48 layers, hidden 2048, 32 query / 4 K/V heads of 128
with per-head q/k norms, 128 experts of 768 rows of which each token takes 8 (weights
renormalised), no shared expert, vocabulary 151936, an untied LM head, rope base 1e6.
Every layer's experts are 604M weights and a token reads 8 of 128 of them, so the cut
keeps what a decoded token reads per layer and scales the whole by a third. The weights
and tokenizer are made as ``gguf_llama3b.py`` makes them; the router is random too, so a
token's experts are close to a uniform draw.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from gguf_llama3b import add_tokenizer, write_random  # benches/, next to this script

SHAPE = dict(layers=48, hidden=2048, heads=32, kv_heads=4, head_dim=128, experts=128,
             used=8, expert_ffn=768, vocab=151936, rope_theta=1e6, eps=1e-6, context=8192)


def tensors(shape: dict[str, float]) -> list[tuple[str, tuple[int, ...], bool]]:
    """(GGUF name, numpy shape, is a norm) in file order."""
    h, d = int(shape["hidden"]), int(shape["head_dim"])
    q, kv = int(shape["heads"]) * d, int(shape["kv_heads"]) * d
    n, f = int(shape["experts"]), int(shape["expert_ffn"])
    out: list[tuple[str, tuple[int, ...], bool]] = [
        ("token_embd.weight", (int(shape["vocab"]), h), False)]
    for i in range(int(shape["layers"])):
        out += [
            (f"blk.{i}.attn_norm.weight", (h,), True),
            (f"blk.{i}.attn_q.weight", (q, h), False),
            (f"blk.{i}.attn_k.weight", (kv, h), False),
            (f"blk.{i}.attn_v.weight", (kv, h), False),
            (f"blk.{i}.attn_q_norm.weight", (d,), True),
            (f"blk.{i}.attn_k_norm.weight", (d,), True),
            (f"blk.{i}.attn_output.weight", (h, q), False),
            (f"blk.{i}.ffn_norm.weight", (h,), True),
            (f"blk.{i}.ffn_gate_inp.weight", (n, h), False),
            (f"blk.{i}.ffn_gate_exps.weight", (n, f, h), False),
            (f"blk.{i}.ffn_up_exps.weight", (n, f, h), False),
            (f"blk.{i}.ffn_down_exps.weight", (n, h, f), False),
        ]
    out += [("output_norm.weight", (h,), True),
            ("output.weight", (int(shape["vocab"]), h), False)]
    return out


def write(out: Path, shape: dict[str, float], seed: int = 0) -> None:
    import gguf

    w = gguf.GGUFWriter(str(out), "qwen3moe")
    w.add_block_count(int(shape["layers"]))
    w.add_context_length(int(shape["context"]))
    w.add_embedding_length(int(shape["hidden"]))
    w.add_feed_forward_length(int(shape["expert_ffn"]) * int(shape["used"]))
    w.add_head_count(int(shape["heads"]))
    w.add_head_count_kv(int(shape["kv_heads"]))
    w.add_key_length(int(shape["head_dim"]))
    w.add_value_length(int(shape["head_dim"]))
    w.add_rope_freq_base(float(shape["rope_theta"]))
    w.add_layer_norm_rms_eps(float(shape["eps"]))
    w.add_expert_count(int(shape["experts"]))
    w.add_expert_used_count(int(shape["used"]))
    w.add_expert_feed_forward_length(int(shape["expert_ffn"]))
    w.add_vocab_size(int(shape["vocab"]))
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    add_tokenizer(w, int(shape["vocab"]))
    write_random(w, tensors(shape), seed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=16, help="of Qwen3-30B-A3B's 48")
    args = ap.parse_args()
    write(Path(args.out), {**SHAPE, "layers": args.layers})
    print(f"{args.out}: {Path(args.out).stat().st_size / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
