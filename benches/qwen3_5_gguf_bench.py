"""Batch-1 decode of a Qwen3.5-shaped random model from one ``qwen35`` GGUF file: the
iron-batch server against llama.cpp (``llama-cpp-python``, 2 threads) on the same file, and
both against the bandwidth floor (weight bytes plus the state bytes one token reads, over
the copy bandwidth sampled right before and after each figure).

    python benches/qwen3_5_gguf_bench.py --shape qwen3.5-0.8b --rounds 2
    python benches/qwen3_5_gguf_bench.py --shape qwen3.5-0.8b --type Q8_0

The shape's random bf16 checkpoint (``benches/torch_throughput.py``'s ``SHAPES``) is written
as llama.cpp's converter writes ``qwen35`` (``models/qwen3_5_gguf.py``: its tensor names,
``-exp(A_log)``, 1 added to the norms but the gated one, value heads tiled where a key head
serves several): matrices in bf16, vectors and convolution weights in float32. ``--type``
requantizes it with ``llama_model_quantize`` (iron-batch then serves it with
``--quantization gguf``). The engines take turns, one loaded at a time: each round starts
the server, measures it (the inter-token p50 of three requests after a warm-up one), stops
it, then measures llama.cpp's greedy decode steps (``benches/llamacpp_bench.py``).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import re
import statistics
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from iron_batch.models.qwen3_5_gguf import GGUF_NAMES
from llamacpp_bench import batch1_ms_per_token  # benches/, next to this script
from torch_throughput import Server, build_shape_model, copy_bandwidth_gbs

ARCH = "qwen35"


def _tile(t: torch.Tensor, dim: int, key_heads: int, per_key: int, width: int) -> torch.Tensor:
    """Value heads along ``dim`` from grouped by key head to tiled, as the converter."""
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], key_heads, per_key, width, *shape[dim + 1:])
    return t.transpose(dim, dim + 1).reshape(shape)


def _converted(name: str, t: torch.Tensor, cfg: dict[str, Any]) -> torch.Tensor:
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv, r = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], nv // nk
    if ".linear_attn." in name and r > 1:
        if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
            qk = 2 * nk * dk
            t = torch.cat([t[:qk], _tile(t[qk:], 0, nk, r, dv)])
        elif name.endswith("in_proj_z.weight"):
            t = _tile(t, 0, nk, r, dv)
        elif name.endswith(("in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias")):
            t = _tile(t, 0, nk, r, 1)
        elif name.endswith("out_proj.weight"):
            t = _tile(t, 1, nk, r, dv)
    if name.endswith("A_log"):
        return -t.float().exp()
    if "conv1d" in name:
        return t.float().squeeze(1)
    if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        return t.float() + 1
    return t


def _gguf_names() -> list[tuple[re.Pattern[str], str]]:
    out = []
    for gguf_name, hf in GGUF_NAMES.items():
        pattern = re.escape(hf).replace(re.escape("{i}"), r"(\d+)")
        out.append((re.compile(pattern + "$"), gguf_name))
    return out


def write_gguf(folder: Path, out: Path) -> Path:
    """The checkpoint in ``folder`` as a ``qwen35`` GGUF (placeholder tokens beyond the
    byte alphabet: the benchmark feeds token ids)."""
    import gguf
    from safetensors import safe_open

    cfg = json.loads((folder / "config.json").read_text())
    w = gguf.GGUFWriter(str(out), ARCH)
    head_dim = cfg["head_dim"]
    rope = cfg.get("rope_parameters") or {}
    keys = {
        "block_count": cfg["num_hidden_layers"], "context_length": 4096,
        "embedding_length": cfg["hidden_size"], "feed_forward_length": cfg["intermediate_size"],
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
    w.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)
    alphabet = sorted(_byte_alphabet())
    tokens = ["<pad>", "<s>", "</s>", *alphabet, "\u0120t"]  # llama.cpp needs one merge
    tokens += [f"[PAD{i}]" for i in range(len(tokens), cfg["vocab_size"])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if i < 3 else gguf.TokenType.NORMAL
                       for i in range(len(tokens))])
    w.add_token_merges(["\u0120 t"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    names = _gguf_names()
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            t = _converted(name, f.get_tensor(name), cfg)
            gguf_name = next(g.replace("{i}", m.group(1)) if m.groups() else g
                             for p, g in names if (m := p.match(name)))
            if t.dtype == torch.bfloat16 and t.ndim == 2:  # vectors in float32
                w.add_tensor(gguf_name, t.contiguous().view(torch.int16).numpy().view(np.uint16),
                             raw_dtype=gguf.GGMLQuantizationType.BF16)
            else:
                w.add_tensor(gguf_name, np.ascontiguousarray(t.float().numpy()))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _byte_alphabet() -> list[str]:
    from tokenizers.pre_tokenizers import ByteLevel

    return list(ByteLevel.alphabet())


def requantize(src: Path, dst: Path, type_name: str) -> Path:
    import llama_cpp as llc

    params = llc.llama_model_quantize_default_params()
    params.ftype = getattr(llc, f"LLAMA_FTYPE_MOSTLY_{type_name}")
    params.nthread = 2
    if llc.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params)):
        raise SystemExit(f"llama_model_quantize to {type_name} failed")
    return dst


def bytes_per_token(folder: Path) -> tuple[int, int]:
    """(the weight bytes a decode step reads, the state bytes it reads): every tensor of
    the checkpoint but an untied embedding table (one row of it is read); per linear layer
    its convolution windows and delta-rule matrices, float32."""
    from safetensors import safe_open

    cfg = json.loads((folder / "config.json").read_text())
    weights = 0
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        for name in f.keys():  # noqa: SIM118
            if name == "model.embed_tokens.weight" and not cfg.get("tie_word_embeddings"):
                continue
            t = f.get_slice(name)
            weights += int(np.prod(t.get_shape())) * 2
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    linear = sum(t == "linear_attention" for t in cfg["layer_types"])
    channels = 2 * nk * dk + nv * dv
    state = 4 * linear * (channels * (cfg["linear_conv_kernel_dim"] - 1) + nv * dk * dv)
    return weights, state


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shape", default="qwen3.5-0.8b")
    ap.add_argument("--type", help="requantize the bf16 file to this llama.cpp type (Q8_0, ...)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp threads")
    ap.add_argument("--json", help="write the numbers here")
    args = ap.parse_args()
    tmp = tempfile.TemporaryDirectory()
    folder = build_shape_model(args.shape, torch.bfloat16, Path(tmp.name) / "hf")
    path = write_gguf(folder, Path(tmp.name) / "model-bf16.gguf")
    extra: list[str] = []
    if args.type:
        path = requantize(path, Path(tmp.name) / f"model-{args.type}.gguf", args.type)
        extra = ["--quantization", "gguf"]
    weights, state = bytes_per_token(folder)
    if args.type:  # the quantized file's bytes (its embedding table counted whole)
        weights = path.stat().st_size
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    run = argparse.Namespace(requests=1, prompt_tokens=args.prompt_tokens,
                             new_tokens=args.new_tokens, max_batch_tokens=8192, warmup_s=2)
    rounds = []
    for r in range(args.rounds):
        server = Server(str(path), "bfloat16", vocab, run, extra)
        try:
            server.ms_per_token(100 + r)
            before = copy_bandwidth_gbs()
            ours = server.ms_per_token(r)
            ours_bw = max(before, copy_bandwidth_gbs())
        finally:
            server.stop()
        before = copy_bandwidth_gbs()
        llama = batch1_ms_per_token(str(path), prompt_tokens=args.prompt_tokens,
                                    new_tokens=args.new_tokens, threads=args.threads,
                                    warmup_s=2)
        llama_bw = max(before, copy_bandwidth_gbs())
        row = {"ours_ms": ours, "llama_ms": llama,
               "ours_floor_ms": (weights + state) / (ours_bw * 1e9) * 1e3,
               "llama_floor_ms": (weights + state) / (llama_bw * 1e9) * 1e3}
        row["ours_vs_llama"] = ours / llama
        row["ours_vs_floor"] = ours / row["ours_floor_ms"]
        rounds.append(row)
        print(f"round {r + 1}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()), flush=True)

    def med(key: str) -> float:
        return statistics.median(row[key] for row in rounds)

    kind = args.type or "bf16"
    print(f"\n{args.shape} from one {kind} GGUF, batch 1 ({args.prompt_tokens}-token prompt, "
          f"{args.new_tokens} new); bf16 weights {weights / 1e6:.0f} MB, state {state / 1e6:.1f} "
          f"MB per sequence; medians of {len(rounds)} rounds")
    print("| engine | ms/token | vs llama.cpp | vs bandwidth floor |")
    print("|---|---|---|---|")
    print(f"| iron-batch server{' --quantization gguf' if args.type else ''} | "
          f"{med('ours_ms'):.1f} | {med('ours_vs_llama'):.2f}x | {med('ours_vs_floor'):.2f}x |")
    print(f"| llama.cpp ({args.threads} threads) | {med('llama_ms'):.1f} | 1.00x | "
          f"{med('llama_ms') / med('llama_floor_ms'):.2f}x |")
    if args.json:
        Path(args.json).write_text(json.dumps({"shape": args.shape, "type": kind,
                                               "weight_bytes": weights, "state_bytes": state,
                                               "rounds": rounds}, indent=2))


if __name__ == "__main__":
    main()
