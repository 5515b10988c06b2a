"""Batch 1 (and W) of one GGUF file through the server (``--quantization gguf``) against
llama.cpp (``llama-cpp-python``, 2 threads) on the same file, in the same run.

    python benches/gguf_requantize.py smollm2-135m /tmp/smollm2-q4_k_m.gguf --type Q4_K_M
    python benches/gguf_batch1.py /tmp/smollm2-q4_k_m.gguf --rounds 5
    python benches/gguf_batch1.py /tmp/smollm2-q4_k_m.gguf --rounds 3 --w 16
    python benches/gguf_batch1.py /tmp/qwen3moe-q4_k_m.gguf --rounds 3 --floor

iron-batch: the server's inter-token p50 over three requests (128-token random prompt, 32
new tokens, after one warm-up request); llama.cpp: its greedy decode steps after a
prefilled prompt of the same length (``benches/llamacpp_bench.py``). With ``--w N``, also W:
N requests at once through the server (output tok/s, prefill included) against llama.cpp's
own batched decoding of N sequences in one context (``llama_batch``, one ``llama_decode``
a step for all of them; the prefill included too), the closest llama.cpp has to a server
batching N users. Rounds alternate which engine goes first; the server stays up (idle, it
takes no CPU) while llama.cpp runs. The table gives each round and the median of the
rounds' ratios. With ``--floor``, also our batch 1 against the bytes a decoded token reads
(:func:`active_bytes`) over the copy bandwidth sampled right before and after our run.
"""

from __future__ import annotations

import argparse
import statistics

from llamacpp_bench import batch1_ms_per_token, parallel_tok_s  # benches/, next to this script
from torch_throughput import Server, copy_bandwidth_gbs


def active_bytes(path: str) -> float:
    """Bytes of the file's tensors a decoded token reads: every matrix but the token
    embedding (one row of it; all of it where it is also the LM head), and of a layer's
    stacked experts (``*_exps``) the share ``expert_used_count / expert_count``."""
    import gguf

    reader = gguf.GGUFReader(path)
    meta = {f.name.split(".", 1)[-1]: f.contents() for f in reader.fields.values()
            if f.name.endswith(("expert_count", "expert_used_count"))}
    share = meta["expert_used_count"] / meta["expert_count"] if meta else 1.0
    names = {t.name for t in reader.tensors}
    total = 0.0
    for t in reader.tensors:
        if t.name == "token_embd.weight" and "output.weight" in names:
            continue
        total += int(t.n_bytes) * (share if "_exps." in t.name else 1.0)
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("gguf")
    ap.add_argument("--vocab", type=int, default=49152, help="prompt ids are drawn below it")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp threads")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--w", type=int, default=0, help="also W: this many requests at once")
    ap.add_argument("--no-batch1", action="store_true", help="W only")
    ap.add_argument("--floor", action="store_true",
                    help="also our batch 1 against active bytes / copy bandwidth")
    args = ap.parse_args()
    run = argparse.Namespace(requests=max(args.w, 1), prompt_tokens=args.prompt_tokens,
                             new_tokens=args.new_tokens, max_batch_tokens=8192, warmup_s=2)
    server = Server(args.gguf, "bfloat16", args.vocab, run, ["--quantization", "gguf"])
    rows: list[dict[str, float]] = []
    active = active_bytes(args.gguf) if args.floor else 0.0
    if args.floor:
        print(f"active bytes per decoded token: {active / 1e6:.1f} MB", flush=True)
    try:
        server.ms_per_token(101)  # warm-up
        for r in range(args.rounds):
            row: dict[str, float] = {}

            def ours(row: dict[str, float] = row, r: int = r) -> None:
                if not args.no_batch1:
                    before = copy_bandwidth_gbs()
                    row["ours_b1"] = server.ms_per_token(3 + 10 * r)
                    if args.floor:
                        best = max(before, copy_bandwidth_gbs())
                        row["floor"] = active / (best * 1e9) * 1e3
                if args.w:
                    row["ours_w"] = server.throughput(1000 + 10 * r)

            def llama(row: dict[str, float] = row, r: int = r) -> None:
                if not args.no_batch1:
                    row["llama_b1"] = batch1_ms_per_token(
                        args.gguf, prompt_tokens=args.prompt_tokens,
                        new_tokens=args.new_tokens, threads=args.threads, warmup_s=2, seed=r)
                if args.w:
                    row["llama_w"] = parallel_tok_s(
                        args.gguf, sequences=args.w, prompt_tokens=args.prompt_tokens,
                        new_tokens=args.new_tokens, threads=args.threads, seed=r,
                        verbose=False)

            for step in ((ours, llama) if r % 2 == 0 else (llama, ours)):
                step()
            rows.append(row)
            print(f"round {r + 1}: " + ", ".join(f"{k} {v:.1f}" for k, v in row.items()),
                  flush=True)
    finally:
        server.stop()
    print("| round | iron-batch ms/token | llama.cpp ms/token | **ratio** | iron-batch W tok/s "
          "| llama.cpp W tok/s | **ratio** |")
    print("|---|---|---|---|---|---|---|")
    b1 = [row["ours_b1"] / row["llama_b1"] for row in rows if "ours_b1" in row]
    w = [row["ours_w"] / row["llama_w"] for row in rows if "ours_w" in row]
    for i, row in enumerate(rows):
        cells = [f"{row.get(k, float('nan')):.1f}" for k in ("ours_b1", "llama_b1")]
        cells.append(f"{row['ours_b1'] / row['llama_b1']:.2f}x" if "ours_b1" in row else "")
        cells += [f"{row.get(k, float('nan')):.1f}" for k in ("ours_w", "llama_w")]
        cells.append(f"{row['ours_w'] / row['llama_w']:.2f}x" if "ours_w" in row else "")
        print(f"| {i + 1} | " + " | ".join(cells) + " |")
    if b1:
        print(f"batch 1: median ratio {statistics.median(b1):.2f}x llama.cpp's ms/token "
              f"({min(b1):.2f}-{max(b1):.2f})")
    fl = [row["ours_b1"] / row["floor"] for row in rows if "floor" in row]
    if fl:
        floors = ", ".join(f"{row['floor']:.1f}" for row in rows if "floor" in row)
        print(f"batch 1: median {statistics.median(fl):.2f}x the floor ({min(fl):.2f}-"
              f"{max(fl):.2f}; floors {floors} ms)")
    if w:
        print(f"W={args.w}: median ratio {statistics.median(w):.2f}x llama.cpp's tok/s "
              f"({min(w):.2f}-{max(w):.2f})")


if __name__ == "__main__":
    main()
