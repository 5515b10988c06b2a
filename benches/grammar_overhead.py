"""What constrained decoding costs, and whom: SmolLM2-135M on CPU, one process.

    python benches/grammar_overhead.py --batch 8 --constrained 2

1. Decode steps of the real engine (forward + sampling + masks): a batch of ``--batch``
   free requests, against the same batch where ``--constrained`` of them follow a JSON
   schema (an array of objects long enough never to close within the run). Rounds of the
   two alternate, so a noisy machine shifts both alike; medians are reported.
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


def decode_step_ms(backend: TorchBackend, batch: int, constrained: int, steps: int) -> float:
    """Median wall time of one engine step once every request is decoding."""
    assert 0 <= constrained <= batch
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
            max_new_tokens=steps + 4, ignore_eos=True,
            grammar=grammar if i < constrained else None))
    started: set[str] = set()
    while len(started) < batch:  # prefill
        started.update(ev.request_id for ev in engine.step())
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        events = engine.step()
        times.append(time.perf_counter() - t)
        assert len(events) == batch and all(ev.error is None for ev in events)
    while engine.has_unfinished():
        engine.step()
    return statistics.median(times) * 1e3


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
    b, c = args.batch, args.constrained

    free_ms, mixed_ms = [], []
    decode_step_ms(backend, b, c, 4)  # warm up both paths (and llguidance's tokenizer)
    for _ in range(args.rounds):
        free_ms.append(decode_step_ms(backend, b, 0, args.steps))
        mixed_ms.append(decode_step_ms(backend, b, c, args.steps))
    free, mixed = statistics.median(free_ms), statistics.median(mixed_ms)
    # The least disturbed round of each: on a shared machine the floor is the steadier figure.
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

    print(f"model {args.model}, batch {b}, {c} constrained, {args.steps} decode steps x "
          f"{args.rounds} rounds, torch threads {torch.get_num_threads()}\n")
    print("| decode step (engine) | median ms | vs free | best round ms | vs free |")
    print("|---|---|---|---|---|")
    print(f"| {b} free | {free:.2f} | 1.00x | {free_min:.2f} | 1.00x |")
    print(f"| {b - c} free + {c} JSON schema | {mixed:.2f} | {mixed / free:.3f}x | "
          f"{mixed_min:.2f} | {mixed_min / free_min:.3f}x |")
    print(f"\nrounds, free: {', '.join(f'{x:.2f}' for x in free_ms)}; "
          f"mixed: {', '.join(f'{x:.2f}' for x in mixed_ms)}\n")
    print(f"| sampler alone, batch of {b} | median µs | vs no grammar engine |")
    print("|---|---|---|")
    print(f"| {b} free, no grammar engine | {s_plain:.0f} | 1.00x |")
    print(f"| {b} free, grammar engine installed | {s_engine:.0f} | {s_engine / s_plain:.3f}x |")
    print(f"| {b - c} free + {c} JSON schema | {s_mixed:.0f} | {s_mixed / s_plain:.3f}x |")


if __name__ == "__main__":
    main()
