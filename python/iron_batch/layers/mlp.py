"""The gated MLP: one fused gate/up projection, a gated activation, the down projection."""

from __future__ import annotations

from collections.abc import Callable

import torch

from iron_batch.layers import cpu_kernels
from iron_batch.layers.activation import GATED_ACTIVATIONS
from iron_batch.layers.linear import Linear

#: Gated activations the fused CPU kernels run for bf16 rows, faster than torch's chain:
#: GeGLU's at about half its time (64 to 2048 rows of Gemma 3's 6912). SwiGLU's kernel
#: is not (0.8-1.1x torch's), so torch keeps it.
_FUSED = ("gelu_pytorch_tanh", "gelu_tanh")


class GatedMLP:
    def __init__(
        self,
        gate_up: Linear,
        down: Linear,
        activation: str,
        *,
        max_rows: int | None = None,
        fused: bool = False,
    ) -> None:
        """``max_rows``: the most rows taken at once (None: any number), so that the
        gate/up activation stays a heap block on CPU: a long prompt step's would be one
        block above glibc's 32 MiB limit for heap allocations (8192 x 9728 bf16 is 160 MB),
        mapped fresh from the kernel, faulted in and zeroed in every layer of every such
        step (see ``platform/heap.py``). ``fused``: the CPU's fused kernels are on
        (``platform/cpu.py``): a GeGLU of bf16 rows is then one parallel Rust pass, which
        rounds as torch's chain does up to the last bit of a few values near zero."""
        if activation not in GATED_ACTIVATIONS:
            raise ValueError(f"unsupported MLP activation {activation!r} (supported: "
                             f"{', '.join(GATED_ACTIVATIONS)})")
        self.gate_up = gate_up
        self.down = down
        #: The checkpoint's name for it (``hidden_act``).
        self.activation_name = activation
        self.activation: Callable[[torch.Tensor], torch.Tensor] = GATED_ACTIVATIONS[activation]
        if fused and activation in _FUSED:
            self.activation = self._fused_activation
        self.max_rows = max_rows

    def linears(self) -> list[Linear]:
        """Its projections (what a step streams from memory)."""
        return [self.gate_up, self.down]

    def _fused_activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.dtype == torch.bfloat16 and gate_up.dim() == 2:
            return cpu_kernels.gated_activation(gate_up, self.activation_name)
        return GATED_ACTIVATIONS[self.activation_name](gate_up)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = self.max_rows
        if rows is None or x.shape[0] <= rows:
            return self.down(self.activation(self.gate_up(x)))
        return torch.cat([self(x[i : i + rows]) for i in range(0, x.shape[0], rows)])
