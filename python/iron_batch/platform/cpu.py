"""Which Rust CPU kernels a model uses, decided once at load from the device, the compute
dtype, this build of ``iron_batch._core`` and the tuning switches."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from iron_batch import _core
from iron_batch.platform import huge_pages
from iron_batch.platform.switches import Switches

_KERNEL_DTYPES = (torch.bfloat16, torch.float32)


def _has(*names: str) -> bool:
    return all(getattr(_core, n, None) is not None for n in names)


@functools.cache
def cpu_info() -> tuple[str, frozenset[str]] | None:
    """The first CPU's vendor and feature flags as ``/proc/cpuinfo`` gives them (None
    where it cannot be read)."""
    try:
        lines = open("/proc/cpuinfo").read().splitlines()
    except OSError:
        return None

    def field(name: str) -> str:
        line = next((line for line in lines if line.startswith(name)), "")
        return line.partition(":")[2].strip()

    return field("vendor_id"), frozenset(field("flags").split())


@functools.cache
def bf16_gemm_is_native() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX-512 BF16 or AMX). Elsewhere torch's
    bf16 GEMM emulates it: on an AVX2 EPYC a 64-row product with a 1536 x 576 matrix took
    97 ms in bf16 and 13 ms in f32 over the same (bf16-rounded) weights, so projections of
    many rows multiply in f32 there (or by the Rust GEMV, faster still up to a few hundred
    rows)."""
    info = cpu_info()
    if info is None:
        return True
    return bool(info[1] & {"avx512_bf16", "amx_bf16"})


@functools.cache
def bf16_dot_is_no_faster() -> bool:
    """Whether this CPU has bf16 dot products (AVX-512 BF16) that multiply no faster than
    its f32 FMAs: an Intel core without AMX (Cooper Lake, or a Sapphire/Emerald/Granite
    Rapids whose AMX the hypervisor hides). There a ``vdpbf16ps`` (32 products) took
    0.74 ns against 0.18 ns for an f32 FMA (16 products; the kernels' ``instruction_rates``
    bench), and oneDNN's packed bf16 GEMM ran at
    0.55-0.6x the speed of torch's f32 GEMM over the same weights (a 2-vCPU Emerald
    Rapids: 64 to 512 rows, 768 to 3072 wide); AMD's Zen 4 and 5 issue ``vdpbf16ps`` at
    twice the FMAs' products, and AMX far faster still, so bf16 wins there."""
    info = cpu_info()
    if info is None:
        return False
    vendor, flags = info
    return (vendor == "GenuineIntel" and "avx512_bf16" in flags
            and not flags & {"amx_bf16", "amx_tile"})


#: Where the CPU's bf16 dot products are no faster than its f32 FMAs and steps of many rows
#: multiply in f32: the most rows a bf16 projection takes the Rust GEMV for. Below about 32
#: rows torch's f32 GEMM pays more for its conversions and its small tiles than it gains
#: (a 2-vCPU Emerald Rapids, 9 to 64 rows: SmolLM2's 120 projections 1.6x the GEMV's time
#: at 16 rows, 1.0x at 32, 0.83x at 64; a Llama-3.2-3B layer's 1.3x, 0.87x, 0.67x).
F32_GEMM_GEMV_ROWS = 32


def _gemv_rows(switches: Switches) -> int:
    """``CpuKernels.wide_gemv_rows`` (0: the GEMV's own 8)."""
    if not bf16_gemm_is_native():
        return switches.cpu_gemv_rows
    return F32_GEMM_GEMV_ROWS if f32_gemm(switches) else 0


def f32_gemm(switches: Switches) -> bool:
    """Whether bf16 projections of more rows than the GEMV takes multiply in f32 over a
    widened weight (``IRON_BATCH_CPU_GEMM``; ``auto``: where the CPU has no bf16
    arithmetic, unless ``IRON_BATCH_CPU_GEMV_ROWS`` is 0, or where its bf16 dot products
    are no faster than its f32 FMAs)."""
    if switches.cpu_gemm != "auto":
        return switches.cpu_gemm == "f32"
    if not bf16_gemm_is_native():
        return switches.cpu_gemv_rows > 0
    return bf16_dot_is_no_faster()


@dataclass(frozen=True)
class CpuKernels:
    """Each a yes/no for this model (all no off the CPU)."""

    #: Decode attention read in place from the paged cache (bf16 and float32).
    attention: bool = False
    #: bf16 prompt rows through the same kernel, each a query over its own prefix.
    prefill_attention: bool = False
    #: RMSNorm with the residual add, rotary + KV store, per-head norms.
    fused: bool = False
    #: The bf16 GEMV for one or two activation rows (projections and LM head).
    gemv: bool = False
    #: oneDNN-packed copies of bf16 projections for larger steps.
    prepack: bool = False
    #: bf16 projections of up to this many rows by the Rust GEMV (0: the GEMV's own 8):
    #: ``IRON_BATCH_CPU_GEMV_ROWS`` where the CPU has no bf16 arithmetic,
    #: :data:`F32_GEMM_GEMV_ROWS` where it multiplies many rows in f32 for speed.
    wide_gemv_rows: int = 0
    #: bf16 projections of more rows than the GEMV takes multiply in f32 over a widened
    #: weight (see :func:`f32_gemm`); False: torch's bf16 GEMM (oneDNN's packed layout).
    f32_gemm: bool = False
    #: Every decoder layer of a decode step in one Rust call.
    decoder: bool = False
    #: Weights and KV cache on 2 MiB pages.
    huge_pages: bool = False
    #: Freed activations kept in the heap.
    keep_freed_memory: bool = False
    #: Every thread's allocations from glibc's main arena.
    one_malloc_arena: bool = False
    #: Activation rows up to which quantized projections take the block GEMV.
    quant_gemv_rows: int = 16


def select(device: torch.device, dtype: torch.dtype, switches: Switches) -> CpuKernels:
    if device.type != "cpu":
        return CpuKernels(quant_gemv_rows=switches.quant_gemv_rows)
    kernels = switches.cpu_attention == "kernel"
    attention = kernels and dtype in _KERNEL_DTYPES and _has("_paged_decode_attention")
    fused = attention and _has("_add_rms_norm", "_rope_store_kv")
    bf16 = dtype == torch.bfloat16
    gemv = fused and bf16 and _has("_gemv_bf16")
    return CpuKernels(
        attention=attention,
        prefill_attention=attention and bf16 and switches.cpu_prefill_attention == "kernel",
        fused=fused,
        gemv=gemv,
        wide_gemv_rows=_gemv_rows(switches) if gemv else 0,
        f32_gemm=bf16 and f32_gemm(switches),
        prepack=(
            kernels and bf16 and switches.cpu_prepack
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        ),
        decoder=fused and bf16 and switches.cpu_decoder and _has("_DecoderStack"),
        huge_pages=switches.huge_pages and huge_pages.supported(),
        keep_freed_memory=switches.keep_freed_memory,
        one_malloc_arena=switches.one_malloc_arena,
        quant_gemv_rows=switches.quant_gemv_rows,
    )


@contextmanager
def few_rows(
    device: torch.device, dtype: torch.dtype, rows: int, few: int
) -> Iterator[None]:
    """Around a forward of ``rows`` token rows: oneDNN's bf16/fp16 kernels win from a few
    rows up, but for up to ``few`` (one or two: batch-1 decode, a pure GEMV over weights
    that do not fit in cache) ATen's own kernel streams the weights about 25% faster on
    CPU, so oneDNN is off for such a forward."""
    if device.type != "cpu" or dtype == torch.float32 or rows > few or not (
        torch.backends.mkldnn.enabled
    ):
        yield
        return
    # The attribute, not mkldnn.flags(): that one also resets oneDNN's TF32 switch and
    # warns about Intel GPUs on every call.
    torch.backends.mkldnn.enabled = False
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = True
