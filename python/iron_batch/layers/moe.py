"""A mixture-of-experts MLP: a router that picks ``top_k`` of ``num_experts`` gated MLPs
per token and weights their outputs, and optionally a shared expert every token runs
(Qwen2-MoE's, scaled by a sigmoid gate).

The experts' weights are stacked, one matrix per projection for the whole layer
(:class:`StackedLinear`: expert ``e``'s gate/up rows are rows ``e * 2I .. (e + 1) * 2I``,
its down rows ``e * H .. (e + 1) * H``), dense or quantized like any projection, so that
the experts kernel (``rust/kernels/src/moe.rs``) reads only the rows of the experts a step
selected, each expert's GEMV on the rows that chose it, in one call. A step where some
expert has more rows than its GEMV takes (:func:`kernel_rows`) groups the tokens by expert
from Python instead: one GEMM per expert that some row chose, on the gathered rows,
scattered back weighted.

Routing follows transformers' modeling files: softmax over the router logits in float32,
``torch.topk`` over the probabilities (its order and its tie-breaking), renormalised over
the chosen ``k`` where the family says so, and multiplied by a learned scale of each chosen
expert where it has them (Gemma 4); or (gpt-oss) ``torch.topk`` over the logits (with the
router's bias) and a softmax over the ``k`` chosen ones.

gpt-oss's experts also have biases (each expert's slice of a stacked bias), their own
activation (:func:`clamped_swiglu`) and MXFP4 weights (``layers/mxfp4.py``), all of which
the decode kernel takes too.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.nn.functional as F

from iron_batch import _core
from iron_batch.layers import mxfp4
from iron_batch.layers.activation import GATED_ACTIVATIONS
from iron_batch.layers.linear import Linear
from iron_batch.layers.mlp import GatedMLP
from iron_batch.layers.quant import QuantWeight
from iron_batch.platform.cpu import CpuKernels
from iron_batch.platform.openmp import entry_points

_EXPERTS = getattr(_core, "_moe_experts", None)
_ROUTE = getattr(_core, "_moe_route", None)

#: Rows up to which the selected-experts kernel always serves a step (a decode step's).
#: A larger step takes it too when no expert gets more rows than its projections give the
#: GEMV (:func:`kernel_rows`): the grouped path would run the same GEMVs, one Python call
#: per expert. Otherwise tokens are grouped by expert from Python and each expert's rows
#: run as one GEMM.
DECODE_MAX_ROWS = 8
#: Steps of up to this many rows take the kernel whatever each expert's rows, where an
#: expert's weights (gate/up and down) are at most :data:`SMALL_EXPERT_BYTES`: its GEMV
#: passes of a few rows each then read it from the caches after the first, and cost less
#: than the grouped path's Python loop over the experts. One layer of the small Qwen3-MoE
#: shape (32 experts of 2.3 MB, top 4; ``benches/moe_decode.py``): the kernel takes 0.62x
#: the grouped path's time at 64 rows, 1.08x at 128.
SMALL_EXPERTS_MAX_ROWS = 64
SMALL_EXPERT_BYTES = 16 << 20


class StackedLinear(Linear):
    """One projection of every expert, stacked by rows: ``experts`` blocks of ``rows``
    rows each (and, where the experts have biases, their biases stacked the same way).
    Its whole matrix is never multiplied: oneDNN never packs it, but where steps of many
    rows multiply in f32 it keeps an f32 copy whose rows each expert's GEMM reads."""

    experts: int
    rows: int
    kernels: CpuKernels

    def prepack(self, f32_copy: bool = True) -> None:
        """The f32 copy where steps of many rows multiply in f32 (see
        :meth:`Linear.prepack`); nothing else: experts run one at a time."""
        if self.widen and self.gemv and f32_copy and isinstance(self.weight, torch.Tensor):
            self.wide = self.weight.float()

    def expert(self, e: int) -> Linear:
        """Expert ``e``'s rows as a projection of their own (views, nothing copied)."""
        n, w = self.rows, self.weight
        lo, hi = e * n, (e + 1) * n
        if isinstance(w, QuantWeight):
            part: torch.Tensor | QuantWeight = replace(
                w, n=n, quants=w.quants[lo:hi], scale=w.scale[lo:hi],
                min=None if w.min is None else w.min[lo:hi])
        else:
            part = w[lo:hi]
        bias = None if self.bias is None else self.bias[lo:hi]
        if isinstance(part, QuantWeight) and part.kind == "mxfp4":
            return mxfp4.Mxfp4Linear(part, bias, kernels=self.kernels)
        out = Linear(part, bias, kernels=self.kernels)
        if self.wide is not None:
            out.wide = self.wide[lo:hi]
        return out


def stacked(
    linear: Linear, experts: int, kernels: CpuKernels, *, biased: bool = False
) -> StackedLinear:
    """``linear`` (every expert's rows, in expert order; with a bias of as many rows only
    where ``biased``) as a :class:`StackedLinear` whose experts run on ``kernels``."""
    n = linear.shape[0]
    if n % experts or (linear.bias is not None) != biased:
        raise ValueError(f"{n} stacked rows (bias: {linear.bias is not None}) are not "
                         f"{experts} experts' {'biased' if biased else 'bias-free'} rows")
    out = StackedLinear(linear.weight, linear.bias, kernels=kernels)
    out.experts, out.rows, out.kernels = experts, n // experts, kernels
    return out


class Router:
    """Router logits ``x @ W.T (+ b)``, softmax in float32, the top ``k`` experts of each
    row and their weights (renormalised over the ``k`` when ``renormalize``)."""

    def __init__(
        self,
        weight: torch.Tensor,
        top_k: int,
        *,
        renormalize: bool,
        bias: torch.Tensor | None = None,
        weights_in_float: bool = False,
        softmax_after_topk: bool = False,
        expert_scales: torch.Tensor | None = None,
        kernels: CpuKernels | None = None,
    ) -> None:
        """``weights_in_float``: the routing weights stay float32 (Mixtral's); else they
        are rounded to the compute dtype (the Qwen MoEs' and OLMoE's).
        ``softmax_after_topk`` (gpt-oss): the top ``k`` of the logits, then a softmax over
        those ``k`` in the logits' dtype. ``expert_scales`` ``[experts]`` (Gemma 4): each
        chosen expert's weight, after the renormalisation, times its scale. ``kernels``:
        bf16 logits come from the model's projection kernels and route in Rust where the
        router is plain (no scales, softmax first, ``k * 64 > experts``)."""
        if not 0 < top_k <= weight.shape[0]:
            raise ValueError(f"top_k {top_k} of {weight.shape[0]} experts")
        if expert_scales is not None and expert_scales.shape != (weight.shape[0],):
            raise ValueError(f"{tuple(expert_scales.shape)} expert scales for "
                             f"{weight.shape[0]} experts")
        self.weight = weight
        self.bias = bias
        self.top_k = top_k
        self.renormalize = renormalize
        self.weights_in_float = weights_in_float
        self.softmax_after_topk = softmax_after_topk
        self.expert_scales = expert_scales
        bf16 = kernels is not None and weight.dtype == torch.bfloat16
        self.project = Linear(weight, bias, kernels=kernels) if bf16 else None
        #: Whether bf16 CPU logits route in Rust (:meth:`_route`).
        self.routes_in_rust = (bf16 and _ROUTE is not None and not softmax_after_topk
                               and expert_scales is None and top_k * 64 > weight.shape[0])

    @property
    def num_experts(self) -> int:
        return int(self.weight.shape[0])

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights ``[rows, k]``, expert ids ``[rows, k]`` int64), best first."""
        if self.project is not None:
            logits = self.project(x)
        else:
            logits = F.linear(x, self.weight, self.bias)
        if (self.routes_in_rust and logits.device.type == "cpu"
                and logits.dtype == torch.bfloat16 and logits.shape[0] > 0):
            return self._route(logits.contiguous())
        if self.softmax_after_topk:
            top, ids = torch.topk(logits, self.top_k, dim=-1)
            return torch.softmax(top, dim=-1), ids
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            top = top / top.sum(dim=-1, keepdim=True)
        if self.expert_scales is not None:
            top = top * self.expert_scales[ids]
        if not self.weights_in_float:
            top = top.to(logits.dtype)
        return top, ids

    def _route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`__call__`'s routing of bf16 ``logits`` in Rust."""
        rows, k = logits.shape[0], self.top_k
        ids = torch.empty(rows, k, dtype=torch.int32)
        weights = torch.empty(rows, k, dtype=torch.float32)
        assert _ROUTE is not None
        _ROUTE(ids.data_ptr(), weights.data_ptr(), logits.data_ptr(), rows=rows,
               experts=self.num_experts, top_k=k, renormalize=self.renormalize,
               weights_in_float=self.weights_in_float)
        if not self.weights_in_float:
            weights = weights.to(logits.dtype)  # bf16 values already: exact
        return weights, ids.long()


class MoE:
    """The sparse MLP of one layer (see the module's docstring)."""

    def __init__(
        self,
        router: Router,
        gate_up: StackedLinear,
        down: StackedLinear,
        activation: str,
        *,
        shared: GatedMLP | None = None,
        shared_gate: torch.Tensor | None = None,
        swiglu_limits: tuple[float, float] | None = None,
        kernels: CpuKernels | None = None,
    ) -> None:
        """``gate_up``: each expert's gate rows then its up rows ``[E * 2I, H]``;
        ``down``: ``[E * H, I]``; ``shared_gate`` ``[1, H]``: the shared expert's output
        is scaled by ``sigmoid(x @ shared_gate.T)`` (None: added as it is).
        ``swiglu_limits`` (alpha, limit): the experts' activation is
        :func:`clamped_swiglu` (gpt-oss) instead of ``activation``. ``kernels``: a bf16
        shared gate runs on the model's projection kernels (as the decode step runs it)."""
        if activation not in GATED_ACTIVATIONS:
            raise ValueError(f"unsupported MLP activation {activation!r} (supported: "
                             f"{', '.join(GATED_ACTIVATIONS)})")
        experts = router.num_experts
        if gate_up.experts != experts or down.experts != experts:
            raise ValueError("router and expert weights disagree on the number of experts")
        self.router = router
        self.gate_up = gate_up
        self.down = down
        self.activation_name = activation
        self.activation: Callable[[torch.Tensor], torch.Tensor] = GATED_ACTIVATIONS[activation]
        self.swiglu_limits = swiglu_limits
        if swiglu_limits is not None:
            alpha, limit = swiglu_limits
            self.activation_name = "clamped_swiglu"
            self.activation = functools.partial(clamped_swiglu, alpha=alpha, limit=limit)
        self.shared = shared
        self.shared_gate = shared_gate
        self.shared_gate_linear = (
            Linear(shared_gate, None, kernels=kernels)
            if kernels is not None and shared_gate is not None
            and shared_gate.dtype == torch.bfloat16 else None)
        #: Whether steps may run the Rust kernel over the selected experts' rows, and the
        #: most rows of one expert it takes in a step of more than DECODE_MAX_ROWS rows.
        self.decode_kernel = _EXPERTS is not None and _decodable(gate_up, down)
        self.kernel_rows = min(kernel_rows(gate_up), kernel_rows(down))
        #: Whether steps of up to SMALL_EXPERTS_MAX_ROWS rows always take the kernel.
        self.small_experts = (_expert_bytes(gate_up) + _expert_bytes(down)
                              <= SMALL_EXPERT_BYTES)

    @property
    def num_experts(self) -> int:
        return self.router.num_experts

    def linears(self) -> list[Linear]:
        """The projections a step may stream (the experts' stacked ones, the shared
        expert's)."""
        out: list[Linear] = [self.gate_up, self.down]
        return out + (self.shared.linears() if self.shared is not None else [])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.router(x)
        out = self.experts(x, weights, ids)
        if self.shared is not None:
            shared = self.shared(x)
            if self.shared_gate_linear is not None:
                shared = torch.sigmoid(self.shared_gate_linear(x)) * shared
            elif self.shared_gate is not None:
                shared = torch.sigmoid(F.linear(x, self.shared_gate)) * shared
            out = out + shared
        return out

    def experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``sum_j weights[t, j] * expert_{ids[t, j]}(x[t])`` for each row ``t``."""
        rows = x.shape[0]
        if (self.decode_kernel and rows > 0 and x.dtype == torch.bfloat16
                and x.is_contiguous()
                and (rows <= DECODE_MAX_ROWS
                     or (self.small_experts and rows <= SMALL_EXPERTS_MAX_ROWS)
                     or self._few_per_expert(ids))):
            return self._decode(x, weights, ids)
        return self._grouped(x, weights, ids)

    def _few_per_expert(self, ids: torch.Tensor) -> bool:
        """Whether no expert is chosen by more rows than :attr:`kernel_rows`."""
        if ids.shape[0] <= self.kernel_rows:  # a row chooses an expert once at most
            return True
        counts = torch.bincount(ids.reshape(-1), minlength=self.num_experts)
        return int(counts.max()) <= self.kernel_rows

    def _grouped(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Rows gathered by expert (stable: in row order within each), one GEMM per chosen
        expert, the outputs weighted and summed back into their rows."""
        rows, k = ids.shape
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        token = order // k
        gathered = x[token]
        outs = torch.empty(rows * k, x.shape[1], dtype=x.dtype, device=x.device)
        start = 0
        for e, count in enumerate(counts):
            if count == 0:
                continue
            seg = gathered[start : start + count]
            h = self.down.expert(e)(self.activation(self.gate_up.expert(e)(seg)))
            outs[start : start + count] = h
            start += count
        w = weights.reshape(-1)[order, None]
        scaled = outs * w
        out = torch.zeros(rows, x.shape[1], dtype=x.dtype, device=x.device)
        return out.index_add_(0, token, scaled.to(x.dtype))

    def _decode(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The Rust kernel: each selected expert's rows read once for every row that chose
        it, nothing of the other experts."""
        rows, k = ids.shape
        out = torch.empty_like(x)
        gate_up, down = self.gate_up, self.down
        ids32 = ids.to(torch.int32).contiguous()
        w32 = weights.float().contiguous()
        biases = [b.to(torch.bfloat16).contiguous() if b is not None else None
                  for b in (gate_up.bias, down.bias)]
        _EXPERTS(
            out.data_ptr(), x.data_ptr(), ids32.data_ptr(), w32.data_ptr(),
            expert_kind(gate_up.weight), *expert_addresses(gate_up.weight),
            expert_kind(down.weight), *expert_addresses(down.weight),
            rows=rows, top_k=k, experts=self.num_experts, hidden=x.shape[1],
            inter=down.shape[1], activation=self.activation_name,
            bf16=x.dtype == torch.bfloat16, threads=torch.get_num_threads(),
            openmp=entry_points(),
            gu_bias=0 if biases[0] is None else biases[0].data_ptr(),
            dn_bias=0 if biases[1] is None else biases[1].data_ptr(),
            swiglu=self.swiglu_limits,
        )
        return out


def clamped_swiglu(gate_up: torch.Tensor, *, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's gated activation of ``[rows, 2 * inter]`` (the gate first):
    ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with ``g`` the gate
    clamped from above at ``limit`` (transformers' ``GptOssExperts._apply_gate``)."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def expert_kind(w: torch.Tensor | QuantWeight) -> str:
    return w.kind if isinstance(w, QuantWeight) else "bf16"


def expert_addresses(w: torch.Tensor | QuantWeight) -> tuple[int, int, int]:
    if isinstance(w, QuantWeight):
        return w.addresses
    return (w.data_ptr(), 0, 0)


def _expert_bytes(linear: StackedLinear) -> int:
    """Bytes of one expert's rows of ``linear``."""
    return linear.weight.nbytes // linear.experts


def kernel_rows(linear: StackedLinear) -> int:
    """The most rows of one expert for which its projection in ``linear`` takes the Rust
    GEMV (what the grouped path runs for it too), at least :data:`DECODE_MAX_ROWS`."""
    w = linear.weight
    if isinstance(w, QuantWeight):
        if w.kind == "mxfp4":
            return DECODE_MAX_ROWS
        return max(DECODE_MAX_ROWS, w.gemv_rows(linear.gemv_rows))
    return max(DECODE_MAX_ROWS, linear.dense_gemv_rows) if linear.gemv else DECODE_MAX_ROWS


def _decodable(gate_up: StackedLinear, down: StackedLinear) -> bool:
    """Whether the decode kernel reads these weights (for bf16 activations): quantized, or
    dense bf16, contiguous, on the CPU."""
    return all(
        isinstance(w, QuantWeight)
        or (w.device.type == "cpu" and w.is_contiguous() and w.dtype == torch.bfloat16)
        for w in (gate_up.weight, down.weight))
