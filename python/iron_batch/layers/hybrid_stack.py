"""Decode steps on CPU with every layer of a Gated DeltaNet hybrid (Qwen3.5's layout) in one
Rust call (``decode_hybrid_layers`` in ``rust/kernels/src/hybrid_decoder.rs``).

Layer by layer from Python, a Gated DeltaNet layer at batch 1 is some forty small torch
operations around its two projections, which on a small CPU cost a quarter of the step. The
stack runs the same kernels (GEMV, causal convolution, delta rule, paged attention) with
the small steps between them as Rust loops, rounding where the Python path rounds; its f32
reductions add in another order than torch's, so its values are the Python path's within a
last f32 bit before each rounding, not bit for bit.

It serves steps where every row is one sequence's next token and there are few enough rows
for the GEMV kernels; other steps (prompt chunks, proposals under verification) take the
Python path. bf16 only; off with ``IRON_BATCH_CPU_DECODER=0`` (``platform/switches.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import torch

from iron_batch import _core
from iron_batch.layers.decoder_stack import TensorAddresses
from iron_batch.layers.gated_delta import GatedDeltaNet
from iron_batch.layers.moe import MoE
from iron_batch.layers.quant import GEMV_MAX_ROWS
from iron_batch.platform.openmp import entry_points

_STACK = getattr(_core, "_HybridStack", None)


def available() -> bool:
    return _STACK is not None


class CentredNorm(Protocol):
    """An RMSNorm by ``1 + w``: ``weight`` holds ``1 + w`` in float32."""

    weight: torch.Tensor
    eps: float


class HybridStack(TensorAddresses):
    """A hybrid model's layers for one-call decode steps; holds the tensors whose addresses
    the Rust stack keeps.

    What it reads of a layer: ``input_norm`` and ``post_norm`` (:class:`CentredNorm`),
    ``mlp`` (a :class:`GatedMLP`, or a :class:`MoE` that ``stacks_moe`` accepts), and either
    ``mixer`` (a :class:`GatedDeltaNet`, with ``state``: the layer's index among the delta
    layers) or a gated attention: ``qkv`` (each head's q followed by its gate, then k and
    v), ``q_norm`` and ``k_norm`` (:class:`CentredNorm` of ``head_dim``), ``o``, ``scale``
    and ``cache`` (the layer's index among the attention layers)."""

    _name = "hybrid stack"

    def __init__(
        self,
        layers: Sequence[Any],
        *,
        hidden: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        rotary_dim: int,
        eps: float,
        quant_gemv_rows: int = GEMV_MAX_ROWS,
    ) -> None:
        super().__init__(quant_gemv_rows)
        self.hidden, self.eps = hidden, float(eps)
        specs: list[dict[str, Any]] = []
        shape: tuple[int, int, int, int] | None = None
        for layer in layers:
            mixer = getattr(layer, "mixer", None)
            spec: dict[str, Any] = dict(
                input_norm=self._norm(layer.input_norm, (hidden,)),
                post_norm=self._norm(layer.post_norm, (hidden,)),
                activation=layer.mlp.activation_name,
                q_norm=0, k_norm=0, rotary_dim=0, scale=0.0, cache=0,
                conv_weight=0, kernel=0, neg_a=0, dt_bias=0, norm=0, state=0,
            )
            if isinstance(layer.mlp, MoE):
                spec.update(gate_up=None, down=None, moe=self._moe(layer.mlp))
            else:
                spec.update(gate_up=self._linear(layer.mlp.gate_up),
                            down=self._linear(layer.mlp.down), moe=None)
            if isinstance(mixer, GatedDeltaNet):
                dims = (mixer.key_heads, mixer.value_heads, mixer.key_dim, mixer.value_dim)
                if shape is not None and dims != shape:
                    raise ValueError("hybrid stack: delta layers of different head shapes")
                shape = dims
                if abs(mixer.eps - self.eps) > 1e-12:
                    raise ValueError(f"hybrid stack: a gated norm's eps {mixer.eps} differs "
                                     f"from the model's {self.eps}")
                hv, dv = mixer.value_heads, mixer.value_dim
                spec.update(
                    kind="delta", mix_in=self._linear(mixer.in_proj),
                    mix_out=self._linear(mixer.out_proj),
                    conv_weight=self._address(mixer.conv_weight,
                                              (mixer.conv_channels, mixer.kernel)),
                    kernel=mixer.kernel,
                    neg_a=self._address(mixer.neg_a.contiguous(), (hv,), torch.float32),
                    dt_bias=self._address(mixer.dt_bias.contiguous(), (hv,), torch.float32),
                    norm=self._address(mixer.norm_weight, (dv,)), state=int(layer.state))
            else:
                spec.update(
                    kind="attention", mix_in=self._linear(layer.qkv),
                    mix_out=self._linear(layer.o),
                    q_norm=self._norm(layer.q_norm, (head_dim,)),
                    k_norm=self._norm(layer.k_norm, (head_dim,)),
                    rotary_dim=rotary_dim, scale=float(layer.scale), cache=int(layer.cache))
            specs.append(spec)
        key_heads, value_heads, key_dim, value_dim = shape or (1, 1, 1, 1)
        self.channels = 2 * key_heads * key_dim + value_heads * value_dim
        self.rotary_dim = rotary_dim
        assert _STACK is not None
        self._stack = _STACK(specs, hidden=hidden, heads=heads, kv_heads=kv_heads,
                             head_dim=head_dim, key_heads=key_heads, value_heads=value_heads,
                             key_dim=key_dim, value_dim=value_dim)
        self._shape = (kv_heads, head_dim, value_heads, key_dim, value_dim)

    def _norm(self, norm: CentredNorm, shape: tuple[int, ...]) -> int:
        if abs(float(norm.eps) - self.eps) > 1e-12:
            raise ValueError(f"hybrid stack: a norm's eps {norm.eps} differs from the "
                             f"model's {self.eps}")
        return self._address(norm.weight, shape, torch.float32)

    def set_caches(self, kv_caches: list[torch.Tensor], conv_states: torch.Tensor,
                   delta_states: torch.Tensor, block_size: int) -> None:
        """The attention layers' caches (each ``[2, blocks, block_size, kv_heads,
        head_dim]`` bf16) and the delta layers' pools (``[layers, slots, channels, kernel
        - 1]`` float32 and ``[layers, slots, value_heads, key_dim, value_dim]`` float32
        or bf16)."""
        kv_heads, hd, hv, dk, dv = self._shape
        blocks = kv_caches[0].shape[1] if kv_caches else 0
        for c in kv_caches:
            if (c.dtype != torch.bfloat16 or c.device.type != "cpu" or not c.is_contiguous()
                    or tuple(c.shape) != (2, blocks, block_size, kv_heads, hd)):
                raise ValueError("hybrid stack: every KV cache must be contiguous bf16 "
                                 f"{(2, blocks, block_size, kv_heads, hd)}")
        layers, slots = delta_states.shape[:2]
        if delta_states.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError("hybrid stack: delta states must be float32 or bf16, not "
                             f"{delta_states.dtype}")
        for t, tail, dtype in ((conv_states, conv_states.shape[2:], torch.float32),
                               (delta_states, (hv, dk, dv), delta_states.dtype)):
            if (t.dtype != dtype or t.device.type != "cpu" or not t.is_contiguous()
                    or tuple(t.shape[:2]) != (layers, slots) or tuple(t.shape[2:]) != tuple(tail)):
                raise ValueError("hybrid stack: state pools must be contiguous "
                                 "[layers, slots, ...] (windows float32)")
        if layers and conv_states.shape[2] != self.channels:
            raise ValueError(f"hybrid stack: {conv_states.shape[2]} convolution channels, "
                             f"the layers have {self.channels}")
        self._pools = (kv_caches, conv_states, delta_states)
        self._stack.set_caches(
            [(c[0].data_ptr(), c[1].data_ptr()) for c in kv_caches], blocks, block_size,
            [(conv_states[i].data_ptr(), delta_states[i].data_ptr()) for i in range(layers)],
            slots, state_bf16=delta_states.dtype == torch.bfloat16)

    def decode(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               slots: np.ndarray, block_tables: np.ndarray, seq_lens: np.ndarray,
               state_slots: np.ndarray) -> None:
        """Every layer over ``h`` [rows, hidden] (in place), each row one sequence's next
        token: its K/V stored at ``slots``, attending over its ``block_tables`` row up to
        ``seq_lens`` (with the new token), its state advanced in ``state_slots``;
        ``cos``/``sin`` [rows, rotary_dim] bf16."""
        rows = h.shape[0]
        if (h.dtype != torch.bfloat16 or not h.is_contiguous()
                or tuple(h.shape) != (rows, self.hidden) or not 0 < rows <= self.max_rows):
            raise ValueError(f"hybrid stack: h must be contiguous bf16 [1..{self.max_rows}, "
                             f"{self.hidden}], got {tuple(h.shape)} {h.dtype}")
        cos = cos.reshape(rows, -1).contiguous()
        sin = sin.reshape(rows, -1).contiguous()
        if (cos.dtype != torch.bfloat16 or sin.dtype != torch.bfloat16
                or cos.shape != (rows, self.rotary_dim) or sin.shape != cos.shape):
            raise ValueError(f"hybrid stack: rotary tables must be bf16 [rows, "
                             f"{self.rotary_dim}]")
        tables = np.ascontiguousarray(block_tables, dtype=np.int32)
        if tables.ndim != 2:
            raise ValueError("hybrid stack: block tables must be [rows, width]")
        self._stack.decode(
            h.data_ptr(), (cos.data_ptr(), sin.data_ptr(), self.rotary_dim),
            np.ascontiguousarray(slots, dtype=np.int64), tables,
            np.ascontiguousarray(seq_lens, dtype=np.int32),
            np.ascontiguousarray(state_slots, dtype=np.int64),
            eps=self.eps, threads=torch.get_num_threads(), openmp=entry_points())
