"""What constrained decoding costs, and whom: SmolLM2-135M on CPU, one process.

    python benches/grammar_overhead.py --batch 8 --constrained 2

1. Decode steps of the real engine (forward + sampling + masks): a batch of ``--batch``
   free requests, against the same batch where ``--constrained`` of them follow a JSON
   schema (an array of objects long enough never to close within the run). Two engines,
   each on its own copy of the model, are stepped alternately, so that a noisy machine
   shifts both alike; the figure is the median of the per-pair time ratios.
2. The sampler alone on random logits: the same free batch with and without a grammar
   engine installed (what the feature costs requests that do not use it), and the mixed
   batch (what computing and applying the masks costs the step).

Every figure of one invocation comes from the same run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from iron_batch import Engine, SamplingParams, SchedulerConfig
from iron_batch.backends.torch_backend import TorchBackend
from iron_batch.sampling import Sampler
from iron_batch.structured import json_schema_grammar
from iron_batch.structured.masking import GrammarMasker

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
LONG = {"type": "array", "items": PERSON, "minItems": 100}


def _engine(backend: TorchBackend, batch: int, constrained: int, new_tokens: int) -> Engine:
    """An engine whose ``batch`` requests are all decoding (prompts prefilled)."""
    tok = backend.tokenizer
    assert tok is not None
    grammar = json_schema_grammar(LONG)
    engine = Engine(backend, SchedulerConfig(
        total_kv_blocks=backend.num_kv_blocks, kv_block_size=backend.kv_block_size,
        max_batch_tokens=4096, max_running_seqs=batch))
    for i in range(batch):
        prompt = tok.encode(tok.apply_chat_template(
            [{"role": "user", "content": f"List {i + 3} people as JSON."}]),
            add_special_tokens=False)
        engine.add_request(f"r{i}", prompt, SamplingParams(
            max_new_tokens=new_tokens, ignore_eos=True,
            grammar=grammar if i < constrained else None))
    started: set[str] = set()
    while len(started) < batch:
        started.update(ev.request_id for ev in engine.step())
    return engine


def paired_steps_ms(
    free_backend: TorchBackend, mixed_backend: TorchBackend, batch: int, constrained: int,
    steps: int,
) -> tuple[list[float], list[float]]:
    """Decode step times of a free and a mixed engine, stepped alternately (each on its
    own copy of the model), so that both see the same machine at the same moment."""
    free = _engine(free_backend, batch, 0, steps + 2)
    mixed = _engine(mixed_backend, batch, constrained, steps + 2)
    free_ms, mixed_ms = [], []
    pair = [(free, free_ms), (mixed, mixed_ms)]
    for _ in range(steps):
        pair.reverse()  # each goes first every other step: no order bias
        for engine, out in pair:
            t = time.perf_counter()
            events = engine.step()
            out.append((time.perf_counter() - t) * 1e3)
            assert len(events) == batch and all(ev.error is None for ev in events)
    for engine in (free, mixed):
        while engine.has_unfinished():
            engine.step()
    return free_ms, mixed_ms


def sampler_us(sampler: Sampler, logits: torch.Tensor, grammars: list[str | None],
               reps: int) -> float:
    states = [sampler.new_state([1, 2, 3], SamplingParams(max_new_tokens=10**6, grammar=g))
              for g in grammars]
    sampler.sample(logits.clone(), states)  # warm up
    times = []
    for _ in range(reps):
        x = logits.clone()
        t = time.perf_counter()
        sampler.sample(x, states)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--constrained", type=int, default=2)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--sampler-reps", type=int, default=200)
    args = p.parse_args()
    torch.manual_seed(0)
    backend = TorchBackend.from_model(args.model, device="cpu", total_kv_blocks=256)
    twin = TorchBackend.from_model(args.model, device="cpu", total_kv_blocks=256)
    b, c = args.batch, args.constrained

    paired_steps_ms(backend, twin, b, c, 4)  # warm up both paths (and llguidance's tokenizer)
    free_ms, mixed_ms = [], []
    for _ in range(args.rounds):
        f, m = paired_steps_ms(backend, twin, b, c, args.steps)
        free_ms += f
        mixed_ms += m
    free, mixed = statistics.median(free_ms), statistics.median(mixed_ms)
    ratio = statistics.median(m / f for f, m in zip(free_ms, mixed_ms, strict=True))
    free_min, mixed_min = min(free_ms), min(mixed_ms)

    vocab = backend.vocab_size
    assert backend.tokenizer is not None
    logits = torch.randn(b, vocab) * 4
    plain = Sampler(vocab, torch.device("cpu"))
    masker = GrammarMasker(backend.tokenizer, vocab, backend.eos_token_ids)
    with_engine = Sampler(vocab, torch.device("cpu"), masker)
    grammar = json_schema_grammar(LONG)
    reps = args.sampler_reps
    s_plain = sampler_us(plain, logits, [None] * b, reps)
    s_engine = sampler_us(with_engine, logits, [None] * b, reps)
    s_mixed = sampler_us(with_engine, logits, [grammar] * c + [None] * (b - c), reps)

    print(f"model {args.model}, batch {b}, {c} constrained, {args.rounds} rounds of "
          f"{args.steps} paired decode steps, torch threads {torch.get_num_threads()}\n")
    print("| decode step (engine) | median ms | fastest ms | median of paired ratios |")
    print("|---|---|---|---|")
    print(f"| {b} free | {free:.2f} | {free_min:.2f} | 1.00x |")
    print(f"| {b - c} free + {c} JSON schema | {mixed:.2f} | {mixed_min:.2f} | {ratio:.3f}x |")
    print()
    print(f"| sampler alone, batch of {b} | median µs | vs no grammar engine |")
    print("|---|---|---|")
    print(f"| {b} free, no grammar engine | {s_plain:.0f} | 1.00x |")
    print(f"| {b} free, grammar engine installed | {s_engine:.0f} | {s_engine / s_plain:.3f}x |")
    print(f"| {b - c} free + {c} JSON schema | {s_mixed:.0f} | {s_mixed / s_plain:.3f}x |")


if __name__ == "__main__":
    main()
