"""A linear projection ``y = x W^T (+ b)``: one matrix made of one or more checkpoint
tensors stacked by rows (fused q/k/v, fused gate/up), dense or quantized, whole or this
rank's tensor-parallel part.

Which kernel runs is the layer's business, decided by its weight and the step's rows:
quantized weights run the block GEMV (up to ``quant_gemv_rows`` rows) or a dequantized
GEMM; dense bf16 ones on CPU the Rust GEMV for up to 8 rows (``CpuKernels.wide_gemv_rows``
where the CPU has no bf16 arithmetic or multiplies many rows in f32) and, above, either an
f32 GEMM over a widened weight (kept from load where it fits, see :meth:`Linear.prepack`)
where ``CpuKernels.f32_gemm`` says f32 multiplies faster, or oneDNN's packed bf16 layout;
everything else ``F.linear``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import replace

import torch
import torch.nn.functional as F

from iron_batch.layers import cpu_kernels, quant
from iron_batch.layers.quant import QuantWeight
from iron_batch.layers.weights import LoadContext, Part
from iron_batch.platform.cpu import CpuKernels

#: A projection matrix: dense, or quantized (``--quantization``, see ``layers/quant.py``).
Weight = torch.Tensor | QuantWeight

#: The most of the memory this process may use that f32 copies of a model's projections
#: may take (:func:`f32_copies_fit`); past it, the projections keep oneDNN's packed bf16
#: layout instead.
F32_COPIES_SHARE = 0.25


class Linear:
    def __init__(
        self, weight: Weight, bias: torch.Tensor | None = None, *, kernels: CpuKernels
    ) -> None:
        self.weight = weight
        self.bias = bias
        #: oneDNN-packed copy of a dense bf16 weight (see :meth:`prepack`).
        self.packed: torch.Tensor | None = None
        #: f32 copy of a dense bf16 weight for steps of many rows (see :meth:`prepack`).
        self.wide: torch.Tensor | None = None
        self.gemv = kernels.gemv and isinstance(weight, torch.Tensor)
        self.gemv_rows = kernels.quant_gemv_rows
        #: Rows up to which a dense bf16 weight takes the Rust GEMV (see ``CpuKernels``),
        #: and whether larger steps multiply in f32.
        self.dense_gemv_rows = max(cpu_kernels.BF16_GEMV_MAX_ROWS, kernels.wide_gemv_rows)
        self.widen = kernels.f32_gemm

    @classmethod
    def load(
        cls,
        ctx: LoadContext,
        parts: Sequence[Part],
        *,
        biases: Sequence[Part] | None = None,
        head: bool = False,
    ) -> Linear:
        """The row-wise concatenation of ``parts``, quantized as ``ctx.quantization``
        says (``head``: the LM head, which int4 keeps at 8 bits as llama.cpp does)."""
        bias = None
        if biases is not None:
            bias = torch.cat([ctx.need(b) for b in biases]) if len(biases) > 1 else ctx.need(
                biases[0])
        return cls(_load_weight(ctx, parts, head), bias, kernels=ctx.kernels)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)  # type: ignore[return-value]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.weight, self.bias
        if isinstance(w, QuantWeight):
            # None: widened where the CPU has no bf16 arithmetic (whatever the switches).
            return w.linear(x, b, self.gemv_rows, widen=self.widen or None)
        if self.gemv and x.shape[0] <= self.dense_gemv_rows:
            return cpu_kernels.linear(x, w, b)
        if self.wide is not None:
            return quant.wide_linear(x, self.wide, b)
        if self.packed is not None:
            return cpu_kernels.packed_linear(x, self.packed, b)
        if self.widen and self.gemv:
            return quant.widened_linear(x, w, b)
        return F.linear(x, w, b)

    def prepack(self, f32_copy: bool = True) -> None:
        """Keep a copy of a dense weight for steps of many rows, made once: in f32 where
        such steps multiply in f32 and ``f32_copy`` allows it, else in oneDNN's packed
        layout where this torch and CPU make one (``F.linear`` would reorder the plain
        weight inside every call; without either, a step that multiplies in f32 widens the
        weight into a reused buffer). The plain weight stays for the one-row GEMV and a
        tied embedding."""
        if not isinstance(self.weight, torch.Tensor):
            return
        if self.widen and self.gemv and f32_copy:
            self.wide = self.weight.float()
            return
        self.packed = cpu_kernels.prepack(self.weight)

    def tensors(self) -> list[torch.Tensor]:
        """The tensors that hold the weight's values (what a decode step streams)."""
        w = self.weight
        if isinstance(w, QuantWeight):
            return [w.quants, w.scale] + ([w.min] if w.min is not None else [])
        return [w]

    def replace_tensors(self, tensors: list[torch.Tensor]) -> None:
        """Put the weight over ``tensors`` (copies of :meth:`tensors`, in its order)."""
        w = self.weight
        if isinstance(w, QuantWeight):
            low = tensors[2] if w.min is not None else None
            self.weight = replace(w, quants=tensors[0], scale=tensors[1], min=low)
        else:
            self.weight = tensors[0]


def _load_weight(ctx: LoadContext, parts: Sequence[Part], head: bool) -> Weight:
    mode = ctx.quantization
    if mode == "gguf":
        blocks = [ctx.source.quantized(p) for p in parts]
        if all(b is not None for b in blocks):
            joined = blocks[0] if len(blocks) == 1 else quant.concat(blocks)  # type: ignore[arg-type]
            if joined is not None:
                return joined
        ctx.dequantized.extend(p.name for p, b in zip(parts, blocks, strict=True) if b is None)
    if mode in ("int8", "int4"):
        return float_weight(ctx, torch.cat([ctx.need_float(p) for p in parts]), head=head)
    return torch.cat([ctx.need(p) for p in parts]) if len(parts) > 1 else ctx.need(parts[0])


def float_weight(ctx: LoadContext, dense: torch.Tensor, *, head: bool = False) -> Weight:
    """A matrix of the checkpoint's floats that its family cut or reshaped itself (not one
    tensor's rows), stored as ``ctx.quantization`` says: int8 or int4 blocks, else in the
    compute dtype (``gguf``: the floats, as for a tensor with no blocks); contiguous."""
    mode = ctx.quantization
    dense = dense.contiguous()
    if mode in ("int8", "int4"):
        dense = dense.float()
        if mode == "int4" and not head and dense.shape[1] % 64 == 0:
            return quant.quantize_int4(dense)
        return quant.quantize_int8(dense)
    return dense.to(device=ctx.device, dtype=ctx.dtype)


def f32_copies_fit(linears: Sequence[Linear], ranks: int = 1) -> bool:
    """Whether f32 copies of these projections' dense weights, made by each of ``ranks``
    processes on this machine (tensor-parallel shards of one model), take at most
    :data:`F32_COPIES_SHARE` of the memory this process may use: the machine's, or its
    control group's limit where that is lower."""
    wide = sum(4 * lin.weight.numel() for lin in linears if isinstance(lin.weight, torch.Tensor))
    memory = usable_memory()
    return memory is not None and ranks * wide <= F32_COPIES_SHARE * memory


def usable_memory() -> int | None:
    """Bytes of memory this process may use: physical memory, or the cgroup v2 (or v1)
    limit where one is set lower; None where neither can be read."""
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            limit = open(path).read().strip()
        except OSError:
            continue
        if limit.isdigit():
            memory = min(memory, int(limit))
    return memory
