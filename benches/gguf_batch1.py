"""Batch-1 decode of one GGUF file through the server (``--quantization gguf``) against
llama.cpp (``llama-cpp-python``, 2 threads) on the same file, in the same run.

    python benches/gguf_requantize.py smollm2-135m /tmp/smollm2-q4_k_m.gguf --type Q4_K_M
    python benches/gguf_batch1.py /tmp/smollm2-q4_k_m.gguf

iron-batch: the server's inter-token p50 over three requests (128-token random prompt, 32
new tokens, after one warm-up request); llama.cpp: its greedy decode steps after a
prefilled prompt of the same length (``benches/llamacpp_bench.py``).
"""

from __future__ import annotations

import argparse

from llamacpp_bench import batch1_ms_per_token  # benches/, next to this script
from torch_throughput import Server


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("gguf")
    ap.add_argument("--vocab", type=int, default=49152, help="prompt ids are drawn below it")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp threads")
    args = ap.parse_args()
    run = argparse.Namespace(requests=1, prompt_tokens=args.prompt_tokens,
                             new_tokens=args.new_tokens, max_batch_tokens=8192, warmup_s=2)
    server = Server(args.gguf, "bfloat16", args.vocab, run, ["--quantization", "gguf"])
    try:
        server.ms_per_token(101)
        ours = server.ms_per_token(3)
    finally:
        server.stop()
    llama = batch1_ms_per_token(args.gguf, prompt_tokens=args.prompt_tokens,
                                new_tokens=args.new_tokens, threads=args.threads, warmup_s=2)
    print(f"iron-batch server --quantization gguf: {ours:.1f} ms/token; llama.cpp "
          f"({args.threads} threads): {llama:.1f} ms/token; {ours / llama:.2f}x llama.cpp's")


if __name__ == "__main__":
    main()
