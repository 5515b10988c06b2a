"""How far a GGUF file's logits through ``--quantization gguf`` are from transformers'
float32 on the file's own dequantized weights: on the decode path (one-row GEMV steps over
the blocks, the activations in the kernels' fixed point) and on the prompt path (a dense
bf16 GEMM over the dequantized weights).

transformers loads the file (``gguf_file=``, dequantized to float32) and continues each of
the prompts greedily for ``--tokens`` tokens; those continuations are then fed to
iron-batch one decode step a token, and as one prompt. For each position: the largest
|logit difference| over the vocabulary; printed: its mean over positions, its maximum, and
how often the top token is transformers' own.

    python benches/gguf_logit_error.py /tmp/smollm2-q4_k_m.gguf
    PYTHONPATH=/other/checkout/python python benches/gguf_logit_error.py FILE   # another build
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from iron_batch.backends.torch_backend import TorchBackend  # noqa: E402
from test_quantization import _decode_logits, _prefill_logits  # noqa: E402

PROMPTS = ["The history of the Roman Empire", "def fibonacci(n):",
           "Explain how photosynthesis works.", "Once upon a time, in a small village,",
           "The best way to learn a new language is", "import numpy as np\n",
           "In 1969, the first man", "To make a cup of tea, you"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf")
    ap.add_argument("--tokens", type=int, default=48)
    args = ap.parse_args()
    path = Path(args.gguf)
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    be = TorchBackend.from_model(str(path), device="cpu", total_kv_blocks=256,
                                 kv_block_size=16, quantization="gguf")
    out = {}
    for name, fn in (("decode", _decode_logits), ("prompt", _prefill_logits)):
        worst, top1, count = [], 0, 0
        for prompt in PROMPTS:
            ids = tok(prompt, return_tensors="pt").input_ids
            with torch.no_grad():
                seq = ref.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                   max_new_tokens=args.tokens, pad_token_id=0)[0]
                want = ref(seq[None]).logits[0]
                got = fn(be.model, seq.tolist()).float()
            worst.append((got - want).abs().amax(-1))
            top1 += int((got.argmax(-1) == want.argmax(-1)).sum())
            count += len(seq)
        w = torch.cat(worst)
        out[name] = {"mean of the largest |logit diff|": round(w.mean().item(), 3),
                     "largest": round(w.max().item(), 3),
                     "same top token": round(top1 / count, 4)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
