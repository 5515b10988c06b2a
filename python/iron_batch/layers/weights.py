"""How layers read their weights: from a checkpoint source, whole or as this tensor-parallel
rank's slice, in the compute dtype or quantized as ``--quantization`` says.

A layer names the checkpoint tensors it is made of as :class:`Part` s (a column-parallel
projection holds some output rows of each, a row-parallel one some input columns); the
source reads just those (safetensors reads only the slice's bytes; GGUF blocks are cut on
block boundaries). Because the layer slices before it quantizes, tensor parallelism and
quantization compose.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from iron_batch.layers.quant import QuantWeight
from iron_batch.platform.cpu import CpuKernels


@dataclass(frozen=True)
class Part:
    """One checkpoint tensor, or a slice of it: ``rows`` of its output dimension
    (column-parallel) or ``cols`` of its input dimension (row-parallel)."""

    name: str
    rows: slice | None = None
    cols: slice | None = None


class WeightSource(Protocol):
    """A checkpoint's tensors by Hugging Face name."""

    def tensor(self, part: Part) -> torch.Tensor | None:
        """The part's values (the checkpoint's float dtype, on the CPU), or None when the
        checkpoint has no such tensor."""
        ...

    def quantized(self, part: Part) -> QuantWeight | None:
        """The part still in the checkpoint's quantized blocks (GGUF), or None when it is
        absent, stored as floats, in a layout no kernel reads, or cut off block bounds."""
        ...


@dataclass
class LoadContext:
    """What every layer of one model loads with."""

    source: WeightSource
    device: torch.device
    dtype: torch.dtype
    #: ``--quantization`` mode, or None for the checkpoint's floats in ``dtype``.
    quantization: str | None
    kernels: CpuKernels
    #: Checkpoint tensors ``--quantization gguf`` had to dequantize (no kernel for their
    #: type, or a slice off block bounds), filled in while loading.
    dequantized: list[str] = field(default_factory=list)

    def need(self, part: Part) -> torch.Tensor:
        """The part in the compute dtype on the device; a missing tensor is an error."""
        t = self.source.tensor(part)
        if t is None:
            raise ValueError(f"checkpoint is missing tensor {part.name!r}")
        return t.to(device=self.device, dtype=self.dtype)

    def need_float(self, part: Part) -> torch.Tensor:
        """The part as float32 (the source precision for quantizing it)."""
        t = self.source.tensor(part)
        if t is None:
            raise ValueError(f"checkpoint is missing tensor {part.name!r}")
        return t.float()
