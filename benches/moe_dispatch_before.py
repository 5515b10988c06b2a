"""Run ``python -m MODULE ...`` with the mixture-of-experts dispatch of before: the experts
kernel for steps of up to 8 rows only, the grouped path for every larger step. For
``build_compare.py``, as one side of a comparison of the dispatch alone:

    printf '#!/bin/sh\\nexec python benches/moe_dispatch_before.py "$@"\\n' > old.sh
    chmod +x old.sh
    python benches/build_compare.py --build old=./old.sh --build new=python --shape ...
"""

import runpy
import sys

from iron_batch.layers import moe

moe.MoE._few_per_expert = lambda self, ids: False  # type: ignore[method-assign]
if sys.argv[1:2] != ["-m"] or len(sys.argv) < 3:
    raise SystemExit("usage: moe_dispatch_before.py -m MODULE [ARGS...]")
module = sys.argv[2]
sys.argv = [module] + sys.argv[3:]
runpy.run_module(module, run_name="__main__", alter_sys=True)
