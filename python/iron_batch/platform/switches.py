"""The tuning switches: environment variables that turn a CPU optimisation off or move a
threshold, for comparison runs and for machines where a default does not pay.

Every switch is declared here once, with its default and what it does; :func:`read` reads
them all at model load (never per step) into one :class:`Switches`, which the model keeps,
the console banner prints and ``describe()`` reports. A value outside a switch's choices is
refused with one line naming the switch.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class Switch:
    env: str
    default: str
    #: The values it takes, or () for an integer of at least ``minimum``.
    choices: tuple[str, ...]
    doc: str
    minimum: int = 1


#: Every switch, by the attribute of :class:`Switches` that holds its value.
SWITCHES: dict[str, Switch] = {
    "cpu_attention": Switch(
        "IRON_BATCH_CPU_ATTENTION", "kernel", ("kernel", "torch"),
        "CPU attention, fused norms, rotary and GEMVs by the Rust kernels (kernel) or by "
        "torch ops only (torch)."),
    "cpu_prefill_attention": Switch(
        "IRON_BATCH_CPU_PREFILL_ATTENTION", "kernel", ("kernel", "sdpa"),
        "bf16 prompt rows attend through the Rust kernel, each a query over its own prefix "
        "(kernel), or through torch's SDPA (sdpa)."),
    "cpu_decoder": Switch(
        "IRON_BATCH_CPU_DECODER", "1", ("1", "0"),
        "Decode steps with few rows run every layer in one Rust call (1) or layer by layer "
        "from Python (0)."),
    "cpu_prepack": Switch(
        "IRON_BATCH_CPU_PREPACK", "1", ("1", "0"),
        "bf16 projections keep a copy for prompt-sized steps (1): f32 where those steps "
        "multiply in f32 and the copies take at most a quarter of memory, else "
        "oneDNN-packed; or none (0)."),
    "cpu_gemv_rows": Switch(
        "IRON_BATCH_CPU_GEMV_ROWS", "192", (),
        "On a CPU without bf16 arithmetic (no AVX-512 BF16 or AMX), bf16 projections of up "
        "to this many rows (at least 8) run the Rust GEMV and larger ones an f32 GEMM over "
        "a widened copy of the weight; 0 leaves them to torch's bf16 GEMM above 8 rows.",
        minimum=0),
    "cpu_gemm": Switch(
        "IRON_BATCH_CPU_GEMM", "auto", ("auto", "bf16", "f32"),
        "bf16 projections of more rows than the Rust GEMV takes (prompts, large batches) "
        "multiply in f32 over a widened copy of the weight (f32) or in torch's bf16 GEMM "
        "(bf16); auto: f32 on a CPU without bf16 arithmetic (unless "
        "IRON_BATCH_CPU_GEMV_ROWS is 0) and on Intel CPUs with AVX-512 BF16 but no AMX, "
        "whose bf16 dot products are no faster than their f32 FMAs. Quantized weights "
        "multiply in f32 wherever the CPU has no bf16 arithmetic."),
    "huge_pages": Switch(
        "IRON_BATCH_HUGE_PAGES", "1", ("1", "0"),
        "CPU weights and KV cache on 2 MiB pages where Linux gives them (1), or 4 KiB (0)."),
    "keep_freed_memory": Switch(
        "IRON_BATCH_KEEP_FREED_MEMORY", "1", ("1", "0"),
        "Freed CPU activations stay in the heap for the next step (1), or go back to the "
        "kernel as glibc decides (0)."),
    "one_malloc_arena": Switch(
        "IRON_BATCH_ONE_MALLOC_ARENA", "0", ("1", "0"),
        "Every thread allocates from glibc's main arena (1), or each from its own (0). The "
        "server steps the model on its main thread, whose arena keeps large activations "
        "between steps either way; the switch is for programs that run `Engine.start()` "
        "(the engine on a thread of its own), at a cost in batch-1 latency."),
    "quant_gemv_rows": Switch(
        "IRON_BATCH_QUANT_GEMV_ROWS", "16", (),
        "Activation rows up to which quantized projections run the block GEMV (GGUF "
        "Q5_0 and Q5_1 matrices, and K-quant ones under 4M weights: at most 8 of them); "
        "above, a bf16 dequantization and a dense GEMM."),
}


class SwitchError(ValueError):
    """A tuning switch set to a value it does not take."""


@dataclass(frozen=True)
class Switches:
    """The switches' values as read at load."""

    cpu_attention: str = "kernel"
    cpu_prefill_attention: str = "kernel"
    cpu_decoder: bool = True
    cpu_prepack: bool = True
    cpu_gemv_rows: int = 192
    cpu_gemm: str = "auto"
    huge_pages: bool = True
    keep_freed_memory: bool = True
    one_malloc_arena: bool = False
    quant_gemv_rows: int = 16

    def changed(self) -> dict[str, str]:
        """The switches set away from their defaults: environment name -> value."""
        out = {}
        for f in fields(self):
            switch = SWITCHES[f.name]
            value = _text(getattr(self, f.name))
            if value != switch.default:
                out[switch.env] = value
        return out

    def as_dict(self) -> dict[str, str]:
        """Every switch: environment name -> value in force."""
        return {SWITCHES[f.name].env: _text(getattr(self, f.name)) for f in fields(self)}


def _text(value: object) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


def read(environ: Mapping[str, str] | None = None) -> Switches:
    """Every switch from the environment (``os.environ`` by default)."""
    env = os.environ if environ is None else environ
    values: dict[str, object] = {}
    for f in fields(Switches):
        switch = SWITCHES[f.name]
        raw = env.get(switch.env, switch.default).strip()
        if switch.choices:
            if raw not in switch.choices:
                raise SwitchError(f"{switch.env}={raw!r}: takes {' or '.join(switch.choices)}")
            values[f.name] = raw == "1" if switch.choices == ("1", "0") else raw
        else:
            if not raw.isdigit() or int(raw) < switch.minimum:
                what = "a positive integer" if switch.minimum == 1 else (
                    f"an integer of at least {switch.minimum}")
                raise SwitchError(f"{switch.env}={raw!r}: takes {what}")
            values[f.name] = int(raw)
    return Switches(**values)  # type: ignore[arg-type]

