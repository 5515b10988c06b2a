"""Rotary position embedding: inverse frequencies per scaling type, and applying them."""

from __future__ import annotations

import math
from typing import Any

import torch


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies after the checkpoint's rope scaling."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if rope_type == "longrope":
        return _longrope_inv_freq(head_dim, theta, scaling["short_factor"])
    if rope_type == "freq_factors":  # a divisor per frequency, as GGUF files carry them
        factors = torch.tensor(scaling["factors"], dtype=torch.float32)
        if factors.shape != inv_freq.shape:
            raise ValueError(f"{len(factors)} rope frequency factors for {len(inv_freq)} "
                             "frequencies")
        return inv_freq / factors
    if rope_type == "proportional":
        return _proportional_inv_freq(inv_freq, head_dim, scaling)
    if rope_type == "yarn":
        return _yarn(head_dim, theta, scaling)[0]
    raise ValueError(f"unsupported rope scaling type {rope_type!r} "
                     f"(supported: {', '.join(ROPE_TYPES)})")


#: Rope scaling types :func:`rope_inv_freq` implements.
ROPE_TYPES = ("default", "linear", "llama3", "longrope", "freq_factors", "proportional", "yarn")


def _yarn(head_dim: int, theta: float, scaling: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """YaRN (gpt-oss): each frequency between its extrapolated (the base one) and its
    interpolated (divided by ``factor``) value by a linear ramp over the dimensions whose
    rotations at the original context lie between ``beta_slow`` and ``beta_fast``; cos and
    sin scaled by the attention factor (``0.1 ln(factor) + 1`` unless given). As
    transformers' ``_compute_yarn_parameters`` computes it, in float32."""
    missing = [k for k in ("factor", "original_max_position_embeddings") if k not in scaling]
    if missing:
        raise ValueError(f"yarn rope scaling without {' and '.join(missing)}")
    factor = float(scaling["factor"])
    original = float(scaling["original_max_position_embeddings"])
    for key in ("mscale", "mscale_all_dim"):
        if scaling.get(key):
            raise ValueError(f"unsupported yarn setting {key} (DeepSeek's attention factor)")
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0
    fast = float(scaling.get("beta_fast") or 32)
    slow = float(scaling.get("beta_slow") or 1)

    def correction(rotations: float) -> float:
        return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction(fast), correction(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    return interpolated * (1 - keep) + extrapolated * keep, float(attention)


def _proportional_inv_freq(
    inv_freq: torch.Tensor, head_dim: int, scaling: dict[str, Any]
) -> torch.Tensor:
    # Gemma 4's global layers: the first `partial_rotary_factor` of the frequency pairs
    # keep the whole head's exponents (spaced by 2 / head_dim, not by 2 / rotated dims);
    # the other pairs get frequency 0, so cos is 1, sin 0 and those dimensions pass
    # through. The tables stay as wide as the head, in the half-split layout.
    rotated = int(float(scaling.get("partial_rotary_factor", 1.0)) * head_dim // 2)
    out = inv_freq.clone()
    out[rotated:] = 0.0
    return out / float(scaling.get("factor", 1.0))


def _longrope_inv_freq(head_dim: int, theta: float, factors: list[float]) -> torch.Tensor:
    ext = torch.tensor(factors, dtype=torch.float32)
    if ext.shape != (head_dim // 2,):
        raise ValueError(f"longrope: {len(factors)} factors for {head_dim // 2} frequencies")
    shape = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (ext * theta**shape)


def _longrope(
    head_dim: int, theta: float, scaling: dict[str, Any]
) -> tuple[torch.Tensor, int, float]:
    """LongRoPE (Phi-3): the long factors' inverse frequencies, the position from which
    they apply, and the factor both sets scale cos and sin by."""
    original = int(scaling["original_max_position_embeddings"])
    long = _longrope_inv_freq(head_dim, theta, scaling["long_factor"])
    attention = scaling.get("attention_factor")
    if attention is None:
        factor = scaling.get("factor")
        if factor is None:
            factor = float(scaling.get("max_position_embeddings") or original) / original
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return long, original, float(attention)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, and the band
    # between low_freq_factor and high_freq_factor interpolated smoothly.
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling.get("original_max_position_embeddings", 8192))
    low_wavelen = old_len / low
    high_wavelen = old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each [num_tokens, 1, head_dim], computed in float32 then cast."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [num_tokens, heads, head_dim] in the half-split layout HF checkpoints use;
    with tables narrower than the head (partial rotary) only its leading dimensions, the
    rest passed through."""
    dim = cos.shape[-1]
    if dim != x.shape[-1]:
        return torch.cat((apply_rope(x[..., :dim], cos, sin), x[..., dim:]), dim=-1)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin


class RotaryEmbedding:
    """cos/sin rows by position from a table computed once and grown by doubling: the
    values :func:`rope_cos_sin` gives, without a sin and a cos per step."""

    def __init__(
        self,
        head_dim: int,
        theta: float,
        scaling: dict[str, Any],
        *,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        """``head_dim``: the rotated dimensions of each head (fewer than the head's with
        partial rotary)."""
        self.inv_freq = rope_inv_freq(head_dim, theta, scaling).to(device)
        self.device = device
        self.dtype = dtype
        self._table: tuple[torch.Tensor, torch.Tensor] | None = None
        # LongRoPE: positions from `_long_from` on rotate by the long factors (per token,
        # so a sequence's rotation never depends on what else is in the batch), and every
        # table is scaled by the attention factor.
        self._long: torch.Tensor | None = None
        self._long_from = 0
        self._factor = 1.0
        if scaling.get("rope_type") == "longrope":
            long, self._long_from, self._factor = _longrope(head_dim, theta, scaling)
            self._long = long.to(device)
        elif scaling.get("rope_type") == "yarn":
            self._factor = _yarn(head_dim, theta, scaling)[1]

    def cos_sin(
        self, pos: torch.Tensor, largest: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of positions ``pos`` (a device tensor whose largest value is ``largest``)."""
        need = largest + 1
        if self._table is None or self._table[0].shape[0] < need:
            size = max(need, 256, 2 * (0 if self._table is None else len(self._table[0])))
            every = torch.arange(size, device=self.device)
            if self._long is None and self._factor == 1.0:
                self._table = rope_cos_sin(every, self.inv_freq, self.dtype)
            elif self._long is None:  # YaRN: the attention factor, applied in float32
                cos, sin = rope_cos_sin(every, self.inv_freq, torch.float32)
                self._table = (cos * self._factor).to(self.dtype), (sin * self._factor).to(
                    self.dtype)
            else:
                self._table = self._longrope_table(every)
        cos, sin = self._table
        return cos[pos], sin[pos]

    def _longrope_table(self, every: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        assert self._long is not None
        use_long = (every >= self._long_from)[:, None]
        inv = torch.where(use_long, self._long[None, :], self.inv_freq[None, :])
        freqs = every.to(torch.float32)[:, None] * inv
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        f = self._factor
        return (emb.cos() * f).to(self.dtype), (emb.sin() * f).to(self.dtype)
