"""The gated MLP: one fused gate/up projection, a gated activation, the down projection."""

from __future__ import annotations

from collections.abc import Callable

import torch

from iron_batch.layers.activation import GATED_ACTIVATIONS
from iron_batch.layers.linear import Linear


class GatedMLP:
    def __init__(
        self,
        gate_up: Linear,
        down: Linear,
        activation: str,
        *,
        max_rows: int | None = None,
    ) -> None:
        """``max_rows``: the most rows taken at once (None: any number), so that the
        gate/up activation stays a heap block on CPU: a long prompt step's would be one
        block above glibc's 32 MiB limit for heap allocations (8192 x 9728 bf16 is 160 MB),
        mapped fresh from the kernel, faulted in and zeroed in every layer of every such
        step (see ``platform/heap.py``)."""
        if activation not in GATED_ACTIVATIONS:
            raise ValueError(f"unsupported MLP activation {activation!r} (supported: "
                             f"{', '.join(GATED_ACTIVATIONS)})")
        self.gate_up = gate_up
        self.down = down
        #: The checkpoint's name for it (``hidden_act``).
        self.activation_name = activation
        self.activation: Callable[[torch.Tensor], torch.Tensor] = GATED_ACTIVATIONS[activation]
        self.max_rows = max_rows

    def linears(self) -> list[Linear]:
        """Its projections (what a step streams from memory)."""
        return [self.gate_up, self.down]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = self.max_rows
        if rows is None or x.shape[0] <= rows:
            return self.down(self.activation(self.gate_up(x)))
        return torch.cat([self(x[i : i + rows]) for i in range(0, x.shape[0], rows)])
