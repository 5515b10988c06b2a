"""Gated DeltaNet linear attention (Qwen3.5's linear-attention layers), by torch ops.

Each sequence keeps, per layer, a fixed-size state in its state slot: the last
``kernel - 1`` inputs of the short causal convolution (its window) and one
``[key_dim, value_dim]`` matrix per value head. For one token the gated delta rule is

    S <- exp(g) * S                      (decay)
    u  = beta * (v - S^T k)              (the part of v the state does not predict yet)
    S <- S + k u^T                       (delta update)
    o  = S^T q

A prompt chunk takes the same recurrence in blocks of ``CHUNK`` tokens (the WY form: one
triangular solve per block gives every ``u`` of the block at once), the state carried from
block to block and from step to step. Decoding rows of a step update their states together.

The convolution windows are float32; the delta matrices float32 (the default) or bf16
(``--recurrent-state-dtype``), in either case read into and computed in float32 and
stored back rounded. Inputs and outputs are in the compute dtype, rounded where
transformers' reference rounds.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from iron_batch.layers import delta_kernels
from iron_batch.layers.linear import Linear

#: Tokens per block of the chunked form.
CHUNK = 64


@dataclass
class StepRows:
    """How a step's token rows group into sequences, for the recurrent layers: the
    decoding sequences (one row each) and the prompt chunks (several rows)."""

    #: Token row and state slot of each decoding sequence.
    decode_rows: torch.Tensor
    decode_slots: torch.Tensor
    #: (first row, end row, state slot) of each sequence with more than one row.
    chunks: list[tuple[int, int, int]]

    @classmethod
    def of(cls, query_start_loc: np.ndarray, state_slots: np.ndarray,
           device: torch.device) -> StepRows:
        qsl = np.asarray(query_start_loc, dtype=np.int64)
        slots = np.asarray(state_slots, dtype=np.int64)
        lens = np.diff(qsl)
        one = lens == 1
        decode_rows = torch.from_numpy(qsl[:-1][one]).to(device)
        decode_slots = torch.from_numpy(slots[one]).to(device)
        chunks = [(int(qsl[i]), int(qsl[i + 1]), int(slots[i]))
                  for i in np.flatnonzero(lens > 1)]
        return cls(decode_rows, decode_slots, chunks)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dimension."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def delta_rule_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of B sequences: q, k [B, H, dk], v [B, H, dv], g, beta [B, H],
    state [B, H, dk, dv] (float32). Returns (o [B, H, dv], the new state)."""
    s = state * g.exp()[..., None, None]
    predicted = torch.einsum("bhkv,bhk->bhv", s, k)
    u = (v - predicted) * beta[..., None]
    s = s + k[..., :, None] * u[..., None, :]
    return torch.einsum("bhkv,bhk->bhv", s, q), s


def delta_rule_chunked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """T tokens of one sequence: q, k [T, H, dk], v [T, H, dv], g, beta [T, H], state
    [H, dk, dv] before the first token (float32). Returns (o [T, H, dv], the state after
    the last token).

    Within a block, with G the cumulative log decay and D[t, i] = exp(G_t - G_i) (i <= t):
    u_t = beta_t (v_t - exp(G_t) S0^T k_t - sum_{i<t} D[t, i] (k_t . k_i) u_i), a unit
    lower-triangular system in the block's u; then o_t = exp(G_t) S0^T q_t +
    sum_{i<=t} D[t, i] (q_t . k_i) u_i and S = exp(G_last) S0 + sum_i D[last, i] k_i u_i^T.
    """
    t_len, heads, _ = q.shape
    out = q.new_empty(t_len, heads, v.shape[-1])
    s = state
    for start in range(0, t_len, chunk):
        end = min(t_len, start + chunk)
        n = end - start
        qc, kc, vc = (x[start:end].transpose(0, 1) for x in (q, k, v))  # [H, n, d]
        cum = g[start:end].t().cumsum(-1)  # [H, n]
        bc = beta[start:end].t()
        lower = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        decay = (cum[:, :, None] - cum[:, None, :]).masked_fill(~lower, float("-inf")).exp()
        kk = kc @ kc.transpose(-1, -2)
        system = (kk * decay * bc[:, :, None]).tril(-1) + torch.eye(n, device=q.device)
        rhs = torch.cat([vc * bc[..., None], kc * (bc * cum.exp())[..., None]], dim=-1)
        solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        dv = vc.shape[-1]
        u = solved[..., :dv] - solved[..., dv:] @ s  # [H, n, dv]
        o = (qc * cum.exp()[..., None]) @ s + ((qc @ kc.transpose(-1, -2)) * decay) @ u
        last = cum[:, -1:]
        s = s * last.exp()[..., None] + (kc * (last - cum).exp()[..., None]).transpose(-1, -2) @ u
        out[start:end] = o.transpose(0, 1)
    return out, s


def conv_step(x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise convolution of one new input per sequence: x [B, C], window
    [B, C, K - 1] (the previous inputs, float32), weight [C, K]. Returns (silu of the
    outputs [B, C] in x's dtype, the new window)."""
    full = torch.cat([window.to(x.dtype), x[:, :, None]], dim=-1)  # [B, C, K]
    # Products summed in float32 and rounded once, as a convolution kernel does.
    out = (full.float() * weight.float()).sum(-1).to(x.dtype)
    return F.silu(out), full[:, :, 1:].float()


def conv_chunk(x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The same over T new inputs of one sequence: x [T, C], window [C, K - 1]."""
    channels, kernel = weight.shape
    full = torch.cat([window.to(x.dtype), x.t()], dim=-1)  # [C, K - 1 + T]
    out = F.conv1d(full[None], weight[:, None, :], groups=channels)[0].t()  # [T, C]
    return F.silu(out), full[:, full.shape[1] - (kernel - 1):].float()


class GatedDeltaNet:
    """The linear-attention mixer of one layer: a fused input projection (conv channels
    q/k/v, the output gate z, beta's and the decay's logits), the causal convolution, the
    gated delta rule per value head, a gated RMSNorm per head and the output projection."""

    def __init__(
        self,
        *,
        in_proj: Linear,
        conv_weight: torch.Tensor,
        neg_a: torch.Tensor,
        dt_bias: torch.Tensor,
        norm_weight: torch.Tensor,
        out_proj: Linear,
        key_heads: int,
        value_heads: int,
        key_dim: int,
        value_dim: int,
        eps: float,
        kernels: bool = False,
    ) -> None:
        """``kernels``: run the convolution and the delta rule by the Rust CPU kernels
        (``layers/delta_kernels.py``) instead of torch ops."""
        self.kernels = kernels and delta_kernels.available()
        self.in_proj = in_proj
        self.conv_weight = conv_weight  # [C, K], compute dtype
        #: The decay rate -exp(A_log) per value head, float32.
        self.neg_a = neg_a.float()
        self.dt_bias = dt_bias.float()
        self.norm_weight = norm_weight
        self.out_proj = out_proj
        self.key_heads, self.value_heads = key_heads, value_heads
        self.key_dim, self.value_dim = key_dim, value_dim
        self.eps = eps
        self.conv_channels = 2 * key_heads * key_dim + value_heads * value_dim

    @property
    def kernel(self) -> int:
        return int(self.conv_weight.shape[1])

    def linears(self) -> list[Linear]:
        return [self.in_proj, self.out_proj]

    def __call__(self, x: torch.Tensor, conv_state: torch.Tensor, state: torch.Tensor,
                 rows: StepRows) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; ``conv_state`` [slots, C, K - 1] and ``state``
        [slots, Hv, dk, dv] are this layer's pools, read and written at ``rows``' slots."""
        n = x.shape[0]
        hv, dk, dv = self.value_heads, self.key_dim, self.value_dim
        c = self.conv_channels
        proj = self.in_proj(x)
        mixed, z = proj[:, :c], proj[:, c : c + hv * dv]
        b, a = proj[:, c + hv * dv : c + hv * dv + hv], proj[:, c + hv * dv + hv :]
        conv = torch.empty_like(mixed)
        kernels = self.kernels
        if len(rows.decode_rows):
            r, slots = rows.decode_rows, rows.decode_slots
            if kernels:
                conv[r] = delta_kernels.causal_conv(mixed[r].contiguous(), conv_state,
                                                    self.conv_weight, slots)
            else:
                out, window = conv_step(mixed[r], conv_state[slots], self.conv_weight)
                conv[r] = out
                conv_state[slots] = window
        for start, end, slot in rows.chunks:
            if kernels:
                conv[start:end] = delta_kernels.causal_conv(
                    mixed[start:end].contiguous(), conv_state[slot], self.conv_weight, None)
                continue
            out, window = conv_chunk(mixed[start:end], conv_state[slot], self.conv_weight)
            conv[start:end] = out
            conv_state[slot] = window
        hk = self.key_heads
        q = conv[:, : hk * dk].float().view(n, hk, dk)
        k = conv[:, hk * dk : 2 * hk * dk].float().view(n, hk, dk)
        v = conv[:, 2 * hk * dk :].float().view(n, hv, dv)
        q = l2_normalize(q) * dk**-0.5
        k = l2_normalize(k)
        if hv != hk:  # each key head serves hv / hk consecutive value heads
            q = q.repeat_interleave(hv // hk, dim=1)
            k = k.repeat_interleave(hv // hk, dim=1)
        beta = b.sigmoid().float()
        g = self.neg_a * F.softplus(a.float() + self.dt_bias)
        core = torch.empty(n, hv, dv, dtype=torch.float32, device=x.device)
        if kernels:
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
            g, beta = g.contiguous(), beta.contiguous()
        if len(rows.decode_rows):
            r, slots = rows.decode_rows, rows.decode_slots
            if kernels:
                core[r] = delta_kernels.delta_rule_decode(q[r], k[r], v[r], g[r], beta[r],
                                                          state, slots)
            else:
                o, s = delta_rule_step(q[r], k[r], v[r], g[r], beta[r],
                                       state[slots].float())
                core[r] = o
                state[slots] = s.to(state.dtype)
        for start, end, slot in rows.chunks:
            span = slice(start, end)
            if kernels:
                core[span] = delta_kernels.delta_rule_chunk(q[span], k[span], v[span],
                                                            g[span], beta[span], state[slot])
                continue
            o, s = delta_rule_chunked(q[span], k[span], v[span], g[span], beta[span],
                                      state[slot].float())
            core[span] = o
            state[slot] = s.to(state.dtype)
        return self.out_proj(self._gated_norm(core.to(x.dtype), z.view(n, hv, dv)))

    def _gated_norm(self, core: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """RMSNorm of each head's output, times silu of the gate z: [T, Hv * dv]."""
        dtype = core.dtype
        cf = core.float()
        cf = cf * torch.rsqrt(cf.pow(2).mean(-1, keepdim=True) + self.eps)
        out = (self.norm_weight * cf.to(dtype)) * F.silu(z.float())
        return out.to(dtype).reshape(core.shape[0], -1)
