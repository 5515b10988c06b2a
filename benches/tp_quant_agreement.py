"""How often tensor parallelism under a quantization changes a greedy token.

    python benches/tp_quant_agreement.py                      # SmolLM2: gguf, int8, int4
    python benches/tp_quant_agreement.py --prompts 32 --new-tokens 32

Each rank quantizes its own slices, and the partial sums are rounded to bf16 before the
all-reduce, so TP=2's logits differ from TP=1's by rounding: where TP=1's top two tokens are
nearly tied, TP=2 may pick the other one and continue its own text from there. For each
quantization this runs the same greedy requests at TP=1 and TP=2 (two local ranks) and
counts, per sequence, the tokens from the first difference on; it also reports TP=1's gap
between its top two log-probabilities at each first difference (a near tie is a small
gap), from the teacher-forced prompt log-probabilities of the prompt followed by TP=1's
output. float32 without quantization is the control: it must differ nowhere.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from iron_batch.llm import LLM
from iron_batch.sampling_params import SamplingParams

PROMPTS = [
    "The capital of France is", "def add(a, b):", "Once upon a time", "The weather today",
    "Here is a list of fruits:", "In 1905, Einstein", "The best way to learn Python is",
    "SELECT name FROM", "My favourite book is", "To make bread you need", "The sun is",
    "A haiku about the sea:", "Water boils at", "The three primary colours are",
    "import numpy as np\n", "Dear John,", "The first rule of", "Photosynthesis is",
    "Translate to French: cat", "The quick brown fox", "Step 1:", "Q: What is 2+2?\nA:",
    "The mitochondria", "Roses are red,", "Chapter one.", "An apple a day",
    "The function returns", "Paris is known for", "for i in range(", "Music is",
    "The moon orbits", "Hello, my name is",
]


def run(model: str, tp: int, dtype: str, quantization: str | None, prompts: list[list[int]],
        new: int) -> list[list[int]]:
    llm = LLM(model=model, tensor_parallel_size=tp, device="cpu", dtype=dtype,
              quantization=quantization, total_kv_blocks=512, kv_block_size=16)
    try:
        greedy = SamplingParams(max_new_tokens=new, ignore_eos=True)
        return [o.token_ids for o in llm.generate(prompts, greedy)]
    finally:
        llm.close()


def gaps(model: str, dtype: str, quantization: str | None, forced: list[list[int]]) -> list[Any]:
    """TP=1's top-2 prompt log-probabilities at every position of ``forced``."""
    llm = LLM(model=model, device="cpu", dtype=dtype, quantization=quantization,
              total_kv_blocks=512, kv_block_size=16)
    try:
        scored = llm.generate(forced, SamplingParams(max_new_tokens=1, prompt_logprobs=2,
                                                     ignore_eos=True))
        return [o.prompt_logprobs for o in scored]
    finally:
        llm.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompts", type=int, default=len(PROMPTS))
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--cases", default="float32:none,bfloat16:gguf,bfloat16:int8,bfloat16:int4",
                    help="dtype:quantization pairs (none: no quantization)")
    args = ap.parse_args()
    probe = LLM(model=args.model, device="cpu", total_kv_blocks=16)
    tok = probe.backend.tokenizer  # type: ignore[attr-defined]
    assert tok is not None
    prompts = [tok.encode(t) for t in PROMPTS[: args.prompts]]
    probe.close()
    print("| dtype | quantization | sequences that differ | tokens from the first difference on "
          "| TP=1's top-2 log-prob gap there (median, max) |")
    print("|---|---|---|---|---|")
    for case in args.cases.split(","):
        dtype, q = case.split(":")
        quant = None if q == "none" else q
        t1 = run(args.model, 1, dtype, quant, prompts, args.new_tokens)
        t2 = run(args.model, 2, dtype, quant, prompts, args.new_tokens)
        firsts = [next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
                  for a, b in zip(t1, t2, strict=True)]
        differ = [(k, f) for k, f in enumerate(firsts) if f is not None]
        flipped = sum(len(t1[k]) - f for k, f in differ)
        total = sum(len(t) for t in t1)
        gap_text = "-"
        if differ:
            forced = [prompts[k] + t1[k] for k, _ in differ]
            scores = gaps(args.model, dtype, quant, forced)
            found = []
            for (k, f), s in zip(differ, scores, strict=True):
                top = s[len(prompts[k]) + f][1]
                found.append(top[0][1] - top[1][1])
            gap_text = f"{statistics.median(found):.3f}, {max(found):.3f}"
        print(f"| {dtype} | {q} | {len(differ)} of {len(prompts)} | {flipped} of {total} "
              f"({flipped / total:.1%}) | {gap_text} |", flush=True)


if __name__ == "__main__":
    main()
