"""Decode steps on CPU with every decoder layer in one Rust call (``decode_layers`` in
``rust/kernels/src/decoder.rs``).

At batch 1 the Python path costs a millisecond or more per token in interpreter round
trips and tensor allocations around a dozen kernels per layer; a quantized SmolLM2 step is
about 6 ms. The stack runs the same kernels back to back, so it gives the Python path's
values (the activations aside: SiLU's own ``exp`` and GELU-tanh's own ``tanh``, equal but
for the rare value on a bf16 rounding boundary). Its layers are pre-norm (Llama, Qwen,
Mistral, SmolLM3, Phi-3, Granite), norm-after (OLMo 2) or both (Gemma 2 and 3), and
Gemma 4's (per-layer head shapes, the weightless v norm, values from the k projection,
K/V shared from an earlier layer, per-layer embeddings, a scalar on each layer's output,
norms that round once): see :class:`StackLayer` for what it reads and
:meth:`DecoderStack.decode` for several rotary tables and cache groups. It serves steps
where every row decodes and there are few enough rows for the GEMV kernels (2 for bf16
weights, ``IRON_BATCH_QUANT_GEMV_ROWS`` for quantized ones); other steps take the Python
path. A layer's MLP may be sparse (``layers/moe.py``'s :class:`MoE`, when
:func:`stacks_moe` says the stack runs it): the router, its Rust routing, the chosen
experts and a shared expert run in the same call. bf16 only; off with
``IRON_BATCH_CPU_DECODER=0`` (and with
``IRON_BATCH_CPU_ATTENTION=torch``; see ``platform/switches.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from iron_batch import _core
from iron_batch.layers.cpu_kernels import BF16_GEMV_MAX_ROWS
from iron_batch.layers.linear import Linear
from iron_batch.layers.moe import MoE, expert_addresses, expert_kind
from iron_batch.layers.norm import HeadNorm, RMSNorm
from iron_batch.layers.quant import GEMV_MAX_ROWS, QuantWeight
from iron_batch.platform.openmp import entry_points

_STACK = getattr(_core, "_DecoderStack", None)


class _MLP(Protocol):
    gate_up: Linear
    down: Linear
    activation_name: str


class StackLayer(Protocol):
    """What the stack reads of a decoder layer (``models/decoder.py``'s ``DecoderLayer``):
    fused q/k/v, an MLP with fused gate/up. Read with ``getattr`` and these defaults, so a
    layer that lacks one has today's pre-norm layout:

    - ``input_norm``, ``post_norm``: RMSNorms before the attention and before the MLP (None:
      the sublayer reads the residual itself, as OLMo 2's do);
    - ``attn_out_norm``, ``mlp_out_norm`` (None): RMSNorms of the attention output (after
      ``o``) and of the MLP output before they join the residual (Gemma's
      ``post_attention_layernorm`` / ``post_feedforward_layernorm``, OLMo 2's);
    - ``q_norm``, ``k_norm``: RMSNorms of q and k before the rotation, ``.weight`` of
      ``head_dim`` (per head) or of the whole projection's width (OLMo 2);
    - ``sliding_window`` (None: every position); ``rotary_dim`` (``head_dim``; less:
      partial rotary; 0: none); ``rope_table`` (0): which of the step's rotary tables;
      ``scale`` (None: the step's); ``softcap`` (None: off); ``residual_scale`` (1.0:
      Granite's ``residual_multiplier`` elsewhere); ``cache_group`` (0): which cache group
      holds the layer's KV.

    Gemma 4's layers (``models/gemma4.py``'s ``Gemma4Layer``) add, each optional:

    - ``head_dim``, ``kv_heads`` (0 or absent: the stack's): the layer's head shape;
    - ``v_norm``: a norm of each value head whose weight is all ones (weightless);
    - ``v_from_k``: the values are the k projection's output (``qkv`` is q and k);
    - ``kv_source``: an earlier layer whose K/V this one attends over (``qkv`` is q alone;
      it stores nothing, and its cache is that layer's tensor);
    - ``ple_gate``, ``ple_proj``, ``ple_norm``: the per-layer-embedding block after the
      MLP, ``h += ple_norm(ple_proj(act(ple_gate(h)) * per_layer[:, i]))`` with the MLP's
      activation and the step's ``per_layer`` vectors (see :meth:`DecoderStack.decode`);
    - ``layer_scalar`` (a one-element tensor; None: one): the layer's output residual is
      multiplied by it.

    A norm with ``rounds_once`` true (``Gemma4Norm``) rounds once, its statistics and
    weight product in float32; a layer's norms all round one way.
    """

    input_norm: RMSNorm | None
    qkv: Linear
    q_norm: HeadNorm | None
    k_norm: HeadNorm | None
    o: Linear
    post_norm: RMSNorm | None
    sliding_window: int | None

    @property
    def mlp(self) -> _MLP: ...


def stacks_moe(moe: MoE) -> bool:
    """Whether the one-call stack runs this sparse MLP: a bf16 router without bias or
    expert scales whose softmax comes first and that routes in Rust, experts without
    biases or gpt-oss's activation, and a shared expert (if any) with the experts'
    activation."""
    r = moe.router
    shared_fits = moe.shared is None or moe.shared.activation_name == moe.activation_name
    return (r.routes_in_rust and r.bias is None and moe.swiglu_limits is None
            and moe.gate_up.bias is None and moe.down.bias is None and shared_fits)


class TensorAddresses:
    """Checked tensors handed to a Rust stack by address, kept alive with it."""

    #: How errors name the stack.
    _name = "decoder stack"

    def __init__(self, max_rows: int) -> None:
        self._keep: list[torch.Tensor] = []
        #: Most rows a step may have: the tightest GEMV over the projections.
        self.max_rows = max_rows

    def _address(self, t: torch.Tensor | None, shape: tuple[int, ...],
                 dtype: torch.dtype = torch.bfloat16) -> int:
        """The address of a checked contiguous CPU tensor of ``shape`` and ``dtype`` (0 for
        None)."""
        if t is None:
            return 0
        if (t.dtype != dtype or t.device.type != "cpu" or not t.is_contiguous()
                or tuple(t.shape) != shape):
            raise ValueError(f"{self._name}: need a contiguous {dtype} CPU tensor {shape}, "
                             f"got {tuple(t.shape)} {t.dtype} on {t.device}")
        self._keep.append(t)
        return t.data_ptr()

    def _projection(
        self, weight: torch.Tensor | QuantWeight, bias: torch.Tensor | None
    ) -> tuple[str, int, int, int, int, int, int]:
        """(kind, weight or quants, scale, min, bias, n, k) of a projection."""
        n, k = weight.shape
        bias_at = self._address(bias, (n,))
        if isinstance(weight, QuantWeight):
            self._keep.extend(t for t in (weight.quants, weight.scale, weight.min) if t is not None)
            return (weight.kind, *weight.addresses, bias_at, n, k)
        return ("bf16", self._address(weight, (n, k)), 0, 0, bias_at, n, k)

    def _linear(self, linear: Linear) -> tuple[str, int, int, int, int, int, int]:
        """A projection's spec; a bf16 one, or a GGUF block format, bounds the rows of a
        step."""
        if isinstance(linear.weight, QuantWeight):
            self.max_rows = linear.weight.gemv_rows(self.max_rows)
        else:
            self.max_rows = min(self.max_rows, BF16_GEMV_MAX_ROWS)
        return self._projection(linear.weight, linear.bias)

    def _moe(self, moe: MoE) -> tuple:
        """A sparse MLP's spec (see ``_core.pyi``'s ``_MoeSpec``)."""
        if not stacks_moe(moe):
            raise ValueError(f"{self._name}: a sparse MLP it does not run (see stacks_moe)")
        r = moe.router
        self.max_rows = min(self.max_rows, BF16_GEMV_MAX_ROWS)
        experts = []
        for stack in (moe.gate_up, moe.down):
            w = stack.weight
            if isinstance(w, QuantWeight):
                self._keep.extend(t for t in (w.quants, w.scale, w.min) if t is not None)
            else:
                self._address(w, tuple(w.shape))
            experts.append((expert_kind(w), *expert_addresses(w)))
        shared = None
        if moe.shared is not None:
            gate = None
            if moe.shared_gate is not None:
                gate = self._projection(moe.shared_gate, None)
            shared = (self._linear(moe.shared.gate_up), self._linear(moe.shared.down), gate)
        return (self._projection(r.weight, None), r.top_k, r.renormalize, r.weights_in_float,
                experts[0], experts[1], moe.num_experts, moe.down.shape[1], shared)


class DecoderStack(TensorAddresses):
    """A model's decoder layers for one-call decode steps. Holds the tensors whose
    addresses the Rust stack keeps, so they live as long as it does.

    Each layer is, in torch terms (norms absent are identities)::

        d = o(attention(input_norm(h)))        # q/k norms, rotary, window, scale, softcap
        h = h + residual_scale * attn_out_norm(d)
        d = down(act(gate_up(post_norm(h))))
        h = h + residual_scale * mlp_out_norm(d)
        h = h + ple_norm(ple_proj(act(ple_gate(h)) * per_layer[:, i]))   # Gemma 4
        h = h * layer_scalar                                              # Gemma 4
    """

    def __init__(
        self,
        layers: Sequence[StackLayer],
        *,
        hidden: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        eps: float,
        quant_gemv_rows: int = GEMV_MAX_ROWS,
    ) -> None:
        super().__init__(quant_gemv_rows)
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.hidden = hidden
        self.eps = float(eps)
        #: Each layer's cache group, rotary table and rotated dims.
        self.cache_groups: list[int] = []
        self.rope_tables: list[tuple[int, int]] = []
        #: Each layer's (head_dim, kv_heads), and whether it stores K/V of its own.
        self.layer_shapes: list[tuple[int, int]] = []
        self.stores: list[bool] = []
        #: Width of the per-layer-embedding vectors a step takes (0: none).
        self.ple_dim = 0
        specs = []
        for layer in layers:
            if getattr(layer, "sinks", None) is not None:
                # The Rust stack's attention takes no sinks: such a layer is never run
                # there (gpt-oss decodes layer by layer).
                raise ValueError("the one-call decode stack has no attention sinks")
            hd = int(getattr(layer, "head_dim", None) or head_dim)
            kvh = int(getattr(layer, "kv_heads", None) or kv_heads)
            self.layer_shapes.append((hd, kvh))
            moe = self._moe(layer.mlp) if isinstance(layer.mlp, MoE) else None
            dense = [] if moe is not None else [layer.mlp.gate_up, layer.mlp.down]
            projections = [self._linear(linear) for linear in [layer.qkv, layer.o, *dense]]
            once = self._rounding(layer)
            norms = tuple(
                self._norm(getattr(layer, name, None), name)
                for name in ("input_norm", "attn_out_norm", "post_norm", "mlp_out_norm")
            )
            rotary_dim = getattr(layer, "rotary_dim", None)
            rotary_dim = hd if rotary_dim is None else int(rotary_dim)
            rope_table = int(getattr(layer, "rope_table", 0) or 0)
            scale = getattr(layer, "scale", None)
            cache_group = int(getattr(layer, "cache_group", 0) or 0)
            self.cache_groups.append(cache_group)
            self.rope_tables.append((rope_table, rotary_dim))
            attention = (
                int(getattr(layer, "sliding_window", None) or 0),
                rotary_dim,
                rope_table,
                None if scale is None else float(scale),
                float(getattr(layer, "softcap", None) or 0.0),
                cache_group,
            )
            specs.append((
                norms,
                self._head_norm(getattr(layer, "q_norm", None)),
                self._head_norm(getattr(layer, "k_norm", None)),
                projections,
                layer.mlp.activation_name,
                attention,
                float(getattr(layer, "residual_scale", 1.0)),
                (*self._extras(layer, hd, kvh, once), moe),
            ))
        assert _STACK is not None
        self._stack = _STACK(specs, hidden=hidden, heads=heads, kv_heads=kv_heads,
                             head_dim=head_dim)

    @staticmethod
    def _rounding(layer: StackLayer) -> bool:
        """Whether the layer's norms round once (Gemma 4's); they must all agree."""
        names = ("input_norm", "attn_out_norm", "post_norm", "mlp_out_norm", "q_norm",
                 "k_norm", "v_norm", "ple_norm")
        kinds = {bool(getattr(n, "rounds_once", False))
                 for n in (getattr(layer, name, None) for name in names) if n is not None}
        if len(kinds) > 1:
            raise ValueError("decoder stack: a layer's norms must all round the same way")
        return kinds == {True}

    def _weight(self, norm: RMSNorm | HeadNorm) -> torch.Tensor:
        """A norm's weight in bf16: a norm that rounds once may keep a float32 copy of its
        bf16 weight (refused unless it converts back exactly)."""
        eps = getattr(norm, "eps", None)
        if eps is not None and abs(float(eps) - self.eps) > 1e-12:
            raise ValueError(f"decoder stack: a norm's eps {eps} differs from the model's "
                             f"{self.eps}")
        w = norm.weight
        if w.dtype == torch.float32 and getattr(norm, "rounds_once", False):
            w16 = w.to(torch.bfloat16)
            if not torch.equal(w16.float(), w):
                raise ValueError("decoder stack: a float32 norm weight that bf16 cannot hold")
            w = w16
        return w

    def _norm(self, norm: RMSNorm | None, name: str) -> int:
        """A ``hidden``-wide RMSNorm's weight address (0: no norm)."""
        if norm is None:
            return 0
        return self._address(self._weight(norm), (self.hidden,))

    def _head_norm(self, norm: HeadNorm | None) -> tuple[int, int]:
        """(address, length) of a q/k norm's weight ((0, 0): none). The length (per head or
        the whole projection) is the Rust stack's to check, with every other size."""
        if norm is None:
            return (0, 0)
        w = self._weight(norm)
        return (self._address(w, (w.numel(),)), w.numel())

    def _extras(self, layer: StackLayer, hd: int, kvh: int, once: bool) -> tuple:
        """Gemma 4's part of a layer's spec (see :class:`StackLayer`)."""
        v_norm = getattr(layer, "v_norm", None)
        if v_norm is not None:
            w = self._weight(v_norm)
            if w.shape != (hd,) or not bool((w == 1).all()):
                raise ValueError("decoder stack: the v norm must be weightless (ones) over "
                                 "each head")
        source = getattr(layer, "kv_source", None)
        self.stores.append(source is None)
        ple = None
        gate, proj = getattr(layer, "ple_gate", None), getattr(layer, "ple_proj", None)
        if gate is not None or proj is not None:
            norm = getattr(layer, "ple_norm", None)
            if gate is None or proj is None or norm is None:
                raise ValueError("decoder stack: a per-layer-embedding block needs its gate, "
                                 "projection and norm")
            dim = int(gate.weight.shape[0])
            if self.ple_dim not in (0, dim):
                raise ValueError("decoder stack: per-layer-embedding blocks of several widths")
            self.ple_dim = dim
            ple = (self._linear(gate), self._linear(proj), self._norm(norm, "ple_norm"))
        scalar = getattr(layer, "layer_scalar", None)
        # A layer that computes no K/V has no values to take from its keys.
        v_from_k = source is None and bool(getattr(layer, "v_from_k", False))
        return (hd, kvh, once, v_norm is not None, v_from_k,
                None if source is None else int(source), ple,
                None if scalar is None else float(scalar.float().reshape(())))

    def set_caches(self, caches: list[torch.Tensor], block_size: int) -> None:
        """The layers' caches, each ``[2, blocks, block_size, kv_heads, head_dim]`` bf16 (or all
        int8, ``head_dim + 4`` bytes a row) in its layer's head shape: ``blocks`` may differ
        between cache groups, not within one. A layer that attends over another's K/V
        passes that layer's tensor (it is neither read nor written as its own)."""
        if len(caches) != len(self.cache_groups):
            raise ValueError(f"decoder stack: {len(caches)} caches for "
                             f"{len(self.cache_groups)} layers")
        blocks: dict[int, int] = {}
        # int8 caches: rows of head_dim values and their 4-byte scale (attention/kv_int8.py).
        int8 = bool(caches) and caches[0].dtype == torch.int8
        dtype = torch.int8 if int8 else torch.bfloat16
        for group, (hd, kvh), c in zip(self.cache_groups, self.layer_shapes, caches,
                                       strict=True):
            row = hd + 4 if int8 else hd
            shape = (2, blocks.setdefault(group, c.shape[1]), block_size, kvh, row)
            if (c.dtype != dtype or c.device.type != "cpu" or not c.is_contiguous()
                    or tuple(c.shape) != shape):
                raise ValueError(f"decoder stack: every cache of group {group} must be "
                                 f"contiguous {dtype} {shape}, got {tuple(c.shape)} {c.dtype}")
        self._caches = caches
        self._stack.set_caches([(c[0].data_ptr(), c[1].data_ptr()) for c in caches],
                               [c.shape[1] for c in caches], block_size, int8=int8)

    def decode(
        self,
        h: torch.Tensor,
        cos: torch.Tensor | None,
        sin: torch.Tensor | None,
        slots: np.ndarray | None,
        block_tables: np.ndarray | None,
        seq_lens: np.ndarray | None,
        *,
        scale: float,
        ropes: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None,
        groups: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]] | None = None,
        per_layer: torch.Tensor | None = None,
    ) -> None:
        """Every layer over the residual rows ``h`` [rows, hidden] (in place): each row one
        decoding sequence, its new token's K/V stored at ``slots``; ``block_tables`` and
        ``seq_lens`` (which count the new token) as the attention kernel takes them;
        ``cos``/``sin`` [rows, rotary_dim] the rotary table; ``scale`` the attention scale
        of layers without their own.

        The general form, for models with several rotary tables or cache groups:
        ``ropes`` a list of (cos, sin) pairs, each [rows, dim] bf16, that replaces
        ``cos``/``sin`` (a layer uses ``ropes[layer.rope_table]``, whose dim must be its
        ``rotary_dim``); ``groups`` a list of (slots, block_tables, seq_lens), group 0
        first, that replaces the three positional arrays (a layer stores and reads its KV
        by ``groups[layer.cache_group]``, in blocks of its own cache; a sliding group's
        tables laid out from position 0, as ``batch.absolute_block_tables`` lays them out:
        every entry up to a row's length must name a block of the group's caches). Either
        may be given alone; the positional arguments it replaces may then be None. A group
        no layer uses is not read. ``per_layer`` [rows, layers, ple_dim] bf16: each row's
        vector for each layer's per-layer-embedding block (needed when the layers have
        them, else ignored).
        """
        rows = h.shape[0]
        if (h.dtype != torch.bfloat16 or not h.is_contiguous()
                or tuple(h.shape) != (rows, self.hidden) or not 0 < rows <= self.max_rows):
            raise ValueError(f"decoder stack: h must be contiguous bf16 [1..{self.max_rows}, "
                             f"{self.hidden}], got {tuple(h.shape)} {h.dtype}")
        if ropes is None:
            ropes = [] if cos is None or sin is None else [(cos, sin)]
        tables = []
        for c, s in ropes:
            c = c.reshape(rows, -1).contiguous()
            s = s.reshape(rows, -1).contiguous()
            if (c.dtype != torch.bfloat16 or s.dtype != torch.bfloat16 or c.shape != s.shape
                    or c.device.type != "cpu" or s.device.type != "cpu"):
                raise ValueError("decoder stack: rotary tables must be bf16 CPU [rows, dim] "
                                 "pairs of one shape")
            tables.append((c, s))
        if groups is None:
            if slots is None or block_tables is None or seq_lens is None:
                raise ValueError("decoder stack: slots, block_tables and seq_lens, or groups")
            groups = [(slots, block_tables, seq_lens)]
        arrays = []
        for g_slots, g_tables, g_lens in groups:
            g_tables = np.ascontiguousarray(g_tables, dtype=np.int32)
            if g_tables.ndim != 2:
                raise ValueError("decoder stack: block tables must be [rows, width]")
            arrays.append((np.ascontiguousarray(g_slots, dtype=np.int64), g_tables,
                           np.ascontiguousarray(g_lens, dtype=np.int32)))
        per_layer_at = 0
        if self.ple_dim:
            want = (rows, len(self.stores), self.ple_dim)
            if (per_layer is None or per_layer.dtype != torch.bfloat16
                    or per_layer.device.type != "cpu" or not per_layer.is_contiguous()
                    or tuple(per_layer.shape) != want):
                got = None if per_layer is None else (tuple(per_layer.shape), per_layer.dtype)
                raise ValueError(f"decoder stack: per_layer must be contiguous bf16 {want}, "
                                 f"got {got}")
            per_layer_at = per_layer.data_ptr()
        self._stack.decode(
            h.data_ptr(), [(c.data_ptr(), s.data_ptr(), c.shape[1]) for c, s in tables],
            arrays, scale=float(scale), eps=self.eps,
            threads=torch.get_num_threads(), openmp=entry_points(), per_layer=per_layer_at,
        )
