"""Attention over a paged KV cache for one flattened batch of mixed prefills and decodes.

The cache of each layer is one tensor ``[2, num_blocks, block_size, kv_heads, head_dim]``
(int8 rows of ``head_dim + 4`` bytes with ``--kv-cache-dtype int8``: ``attention/kv_int8.py``;
the torch routes here dequantize the rows they gather).
Everything that depends only on the batch layout (gather indices, masks) is computed once
per forward in :class:`AttentionPlan` and reused by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from iron_batch.attention import cpu_kernel, kv_int8


@dataclass
class _Prefill:
    rows: slice  # token rows of this sequence in the batch
    gather: torch.Tensor | None  # [ctx] cache slots of its context; None = all tokens are new
    mask: torch.Tensor | None  # [q_len * group, ctx] bool, True = attend; None = plain causal


@dataclass
class _FreshPrefills:
    """Prompts that start at position 0 this step (no cached context), run as one padded
    causal SDPA: one call per layer instead of one per sequence. Right padding is harmless
    under a causal mask, since a real query never attends to a later (padded) key."""

    pad_rows: torch.Tensor  # [S, L] token row of each padded position (row 0 for padding)
    valid: torch.Tensor  # [n] flat positions (s * L + t) that hold real tokens
    out_rows: torch.Tensor  # [n] the token row each valid position writes
    all_rows: bool  # out_rows == arange(num_tokens): outputs need no scatter


@dataclass
class _Decodes:
    rows: torch.Tensor  # [S] token row of each decode
    all_rows: bool  # rows == arange(num_tokens): outputs need no scatter
    # Torch route (gather whole blocks, batched matmuls):
    block_rows: torch.Tensor | None  # [S * nblk] block ids of every decode's table, padded
    num_blocks: int  # nblk: table width read per decode
    mask: torch.Tensor | None  # [S, 1, 1, nblk * block_size] additive float32 mask (0 or -inf)
    # Rust kernel route (reads the cache in place; see attention/cpu_kernel.py):
    tables: np.ndarray | None = None  # int32 [S, nblk]
    lens: np.ndarray | None = None  # int32 [S]
    sliding_window: int | None = None


@dataclass
class _EveryRow:
    """Every token row as its own query for the Rust kernel (bf16 on CPU): row t attends
    its sequence's first ``lens[t]`` positions, read in place from the cache, so prompt
    chunks (fresh, or behind cached context) and decodes take one call per layer."""

    tables: np.ndarray  # int32 [T, width]: the block table of each row's sequence
    lens: np.ndarray  # int32 [T]: positions each row attends (its own included)
    sliding_window: int | None


#: Most block-table entries (rows x width) an :class:`_EveryRow` plan may hold; longer
#: chunks keep SDPA (their per-row tables would take more memory than the step's K/V).
_EVERY_ROW_MAX_ENTRIES = 1 << 22


class AttentionPlan:
    """Per-forward batch layout, shared by all layers."""

    def __init__(
        self,
        *,
        query_start_loc: np.ndarray,
        seq_lens: np.ndarray,
        num_computed_before: np.ndarray,
        block_tables: np.ndarray,
        slot_mapping: torch.Tensor,
        block_size: int,
        group: int,
        sliding_window: int | None,
        device: torch.device,
        dtype: torch.dtype = torch.float32,
        use_cpu_kernel: bool = False,
        prefill_kernel: bool = False,
        host_slot_mapping: np.ndarray | None = None,
    ) -> None:
        """``use_cpu_kernel``: decodes read the cache in place through the Rust kernel;
        ``prefill_kernel``: prompt rows too, each a query over its own prefix."""
        self.slot_mapping = slot_mapping
        #: The same slots on the host, for kernels that take them as an array.
        self.host_slots = host_slot_mapping
        self.num_tokens = int(query_start_loc[-1])
        self.prefills: list[_Prefill] = []
        self.fresh: _FreshPrefills | None = None
        self.decodes: _Decodes | None = None
        self.every_row: _EveryRow | None = None
        q_lens = np.diff(query_start_loc)
        if use_cpu_kernel and prefill_kernel and (q_lens > 1).any():
            every = _every_row(query_start_loc, q_lens, seq_lens, num_computed_before,
                               block_tables, block_size, sliding_window)
            if every is not None:
                self.every_row = every
                return
        tables = torch.from_numpy(block_tables.astype(np.int64))
        offsets = torch.arange(block_size, dtype=torch.int64)
        decode_seqs = np.nonzero(q_lens == 1)[0]
        if len(decode_seqs) and use_cpu_kernel:
            lens_np = seq_lens[decode_seqs]
            nblk = -(-int(lens_np.max()) // block_size)
            rows = query_start_loc[decode_seqs].astype(np.int64)
            self.decodes = _Decodes(
                rows=torch.from_numpy(rows).to(device),
                all_rows=len(rows) == self.num_tokens,
                block_rows=None,
                num_blocks=nblk,
                mask=None,
                tables=np.ascontiguousarray(block_tables[decode_seqs, :nblk], dtype=np.int32),
                lens=np.ascontiguousarray(lens_np, dtype=np.int32),
                sliding_window=sliding_window,
            )
        elif len(decode_seqs):
            lens = torch.from_numpy(seq_lens[decode_seqs].astype(np.int64))
            nblk = -(-int(lens.max()) // block_size)
            # Whole blocks are gathered (contiguous rows of block_size * kv_heads * head_dim
            # values, twice as fast as gathering slot by slot); the mask hides the padding.
            key_pos = torch.arange(nblk * block_size)
            mask = key_pos[None, :] < lens[:, None]
            if sliding_window is not None:
                mask &= key_pos[None, :] > (lens[:, None] - 1 - sliding_window)
            rows = query_start_loc[decode_seqs].astype(np.int64)
            additive = torch.zeros(mask.shape).masked_fill_(~mask, float("-inf"))
            self.decodes = _Decodes(
                rows=torch.from_numpy(rows).to(device),
                all_rows=len(rows) == self.num_tokens,
                block_rows=tables[decode_seqs, :nblk].reshape(-1).to(device),
                num_blocks=nblk,
                mask=additive[:, None, None, :].to(device),
            )
        multi = np.nonzero(q_lens > 1)[0]
        if sliding_window is None:
            # Fresh prompts of similar length share one padded call; a much shorter one
            # would mostly compute padding, so it keeps its own call below.
            fresh = multi[num_computed_before[multi] == 0]
            if len(fresh) > 1:
                longest = int(q_lens[fresh].max())
                fresh = fresh[q_lens[fresh] * 2 >= longest]
            if len(fresh) > 1:
                self.fresh = _fresh_layout(query_start_loc, q_lens, fresh, self.num_tokens,
                                           device)
                multi = np.setdiff1d(multi, fresh)
        for i in multi:
            start, end = int(query_start_loc[i]), int(query_start_loc[i + 1])
            _q_len, ctx, before = end - start, int(seq_lens[i]), int(num_computed_before[i])
            gather = None
            if before > 0:
                nblk = -(-ctx // block_size)
                gather = (tables[i, :nblk, None] * block_size + offsets).reshape(-1)[:ctx]
                gather = gather.to(device)
            mask = None
            if before > 0 or group > 1 or sliding_window is not None:
                q_pos = torch.arange(before, ctx)[:, None]
                k_pos = torch.arange(ctx)[None, :]
                allowed = k_pos <= q_pos
                if sliding_window is not None:
                    allowed &= k_pos > q_pos - sliding_window
                # Query rows are laid out (q_len, group) per kv head: see _prefill_attention.
                allowed = allowed.repeat_interleave(group, dim=0)
                mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(
                    ~allowed, float("-inf")).to(device)
            self.prefills.append(_Prefill(slice(start, end), gather, mask))


def _every_row(
    query_start_loc: np.ndarray,
    q_lens: np.ndarray,
    seq_lens: np.ndarray,
    num_computed_before: np.ndarray,
    block_tables: np.ndarray,
    block_size: int,
    sliding_window: int | None,
) -> _EveryRow | None:
    num_tokens = int(query_start_loc[-1])
    width = -(-int(seq_lens.max()) // block_size)
    if num_tokens * width > _EVERY_ROW_MAX_ENTRIES:
        return None
    seq_of = np.repeat(np.arange(len(q_lens)), q_lens)
    offset = np.arange(num_tokens) - np.repeat(query_start_loc[:-1], q_lens)
    return _EveryRow(
        tables=np.ascontiguousarray(block_tables[seq_of, :width], dtype=np.int32),
        lens=(num_computed_before[seq_of] + offset + 1).astype(np.int32),
        sliding_window=sliding_window,
    )


def _fresh_layout(
    query_start_loc: np.ndarray,
    q_lens: np.ndarray,
    seqs: np.ndarray,
    num_tokens: int,
    device: torch.device,
) -> _FreshPrefills:
    longest = int(q_lens[seqs].max())
    offsets = np.arange(longest)
    starts = query_start_loc[seqs].astype(np.int64)
    lens = q_lens[seqs].astype(np.int64)
    real = offsets[None, :] < lens[:, None]  # [S, L]
    rows = np.where(real, starts[:, None] + offsets[None, :], 0)
    valid = np.flatnonzero(real)
    out_rows = rows.reshape(-1)[valid]
    return _FreshPrefills(
        pad_rows=torch.from_numpy(rows).to(device),
        valid=torch.from_numpy(valid).to(device),
        out_rows=torch.from_numpy(out_rows).to(device),
        all_rows=len(out_rows) == num_tokens and bool((np.diff(out_rows) == 1).all()),
    )


def write_kv(
    cache: torch.Tensor, plan: AttentionPlan, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Store this step's K and V [num_tokens, kv_heads, head_dim] at their slots; returns
    them as the cache holds them: an int8 cache's rows dequantized, so that a prompt's
    attention sees the keys and values its later chunks and decodes will read."""
    flat = cache.view(2, -1, cache.shape[-2], cache.shape[-1])
    if kv_int8.is_int8(cache):
        k8, v8 = kv_int8.quantize(k), kv_int8.quantize(v)
        flat[0].index_copy_(0, plan.slot_mapping, k8)
        flat[1].index_copy_(0, plan.slot_mapping, v8)
        return kv_int8.dequantize(k8, k.dtype), kv_int8.dequantize(v8, v.dtype)
    flat[0].index_copy_(0, plan.slot_mapping, k)
    flat[1].index_copy_(0, plan.slot_mapping, v)
    return k, v


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    cache: torch.Tensor,
    plan: AttentionPlan,
    scale: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, heads, hd], new k/v [T, kv_heads, hd] (already in the cache) -> [T, heads * hd].
    k and v may be None for a decode-only step: decodes read everything from the cache.
    ``softcap``: scores become ``softcap * tanh(score / softcap)`` before the softmax.
    ``sinks`` (float32 [heads], gpt-oss): each head's learned logit joins its softmax's
    denominator (a key no query attends with a value of zero), in sliding layers too."""
    num_tokens, num_heads, head_dim = q.shape
    kv_heads = cache.shape[-2]
    group = num_heads // kv_heads
    flat = cache.view(2, -1, kv_heads, cache.shape[-1])
    if plan.every_row is not None:
        e = plan.every_row
        return cpu_kernel.paged_decode_attention(q, cache, e.tables, e.lens, scale,
                                                    e.sliding_window, softcap=softcap,
                                                    sinks=sinks)
    d = plan.decodes
    fresh = plan.fresh
    if d is not None and d.all_rows and not plan.prefills and fresh is None:
        return _decode_attention(q, cache, d, scale, group, softcap, sinks)
    if k is None or v is None:
        raise ValueError("prefill attention needs this step's k and v")
    if fresh is not None and fresh.all_rows and not plan.prefills and d is None:
        return _fresh_attention(q, k, v, fresh, scale, softcap, sinks)
    out = q.new_empty(num_tokens, num_heads * head_dim)
    if d is not None:
        out.index_copy_(0, d.rows,
                        _decode_attention(q[d.rows], cache, d, scale, group, softcap, sinks))
    if fresh is not None:
        out.index_copy_(0, fresh.out_rows,
                        _fresh_attention(q, k, v, fresh, scale, softcap, sinks))
    for p in plan.prefills:
        out[p.rows] = _prefill_attention(q[p.rows], k[p.rows], v[p.rows], flat, p, scale, group,
                                         softcap, sinks)
    return out


def _decode_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    d: _Decodes,
    scale: float,
    group: int,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Every single-token query at once: in bf16/fp16 two batched matmuls around a float32
    softmax, in float32 one SDPA call.

    The query heads that share a kv head sit on the "query length" axis, so GQA needs no
    copy of K/V per query head. Plain matmuls beat SDPA here: CPU SDPA kernels are tuned
    for long queries and spend most of their time on per-(batch, head) setup for q_len 1.
    """
    if d.tables is not None and d.lens is not None:
        return cpu_kernel.paged_decode_attention(
            q, cache, d.tables, d.lens, scale, d.sliding_window, softcap=softcap, sinks=sinks
        )
    assert d.block_rows is not None and d.mask is not None
    s, num_heads, head_dim = q.shape
    kv_heads = num_heads // group
    num_blocks, block_size = cache.shape[1], cache.shape[2]
    length = d.num_blocks * block_size
    keys = torch.index_select(cache[0].view(num_blocks, -1), 0, d.block_rows)
    values = torch.index_select(cache[1].view(num_blocks, -1), 0, d.block_rows)
    if kv_int8.is_int8(cache):
        row = kv_int8.row_bytes(head_dim)
        keys = kv_int8.dequantize(keys.view(-1, row), q.dtype)
        values = kv_int8.dequantize(values.view(-1, row), q.dtype)
    keys = keys.view(s, length, kv_heads, head_dim).transpose(1, 2)  # [S, kvh, L, hd]
    values = values.view(s, length, kv_heads, head_dim).transpose(1, 2)
    qg = q.reshape(s, kv_heads, group, head_dim)
    if q.dtype == torch.float32 and softcap is None and sinks is None:
        # In float32 the CPU SDPA kernel reads the strided K/V in place and wins (measured
        # 1.7 vs 2.5 ms per layer at 64 x 208 tokens); in bf16 the matmuls below win.
        out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=d.mask, scale=scale)
        return out.reshape(s, num_heads * head_dim)
    scores = torch.matmul(qg, keys.transpose(-1, -2)).float()  # [S, kvh, group, L]
    scores = scores.mul_(scale)
    if softcap is not None:
        scores = _softcap(scores, softcap)
    scores = scores.add_(d.mask)
    if sinks is not None:
        probs = _softmax_with_sinks(scores, sinks.view(kv_heads, group, 1)).to(q.dtype)
        return torch.matmul(probs, values).reshape(s, num_heads * head_dim)
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    return torch.matmul(probs, values).reshape(s, num_heads * head_dim)


def _fresh_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    f: _FreshPrefills,
    scale: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """[n_valid, heads * hd] outputs of the fresh prompts, in ``f.out_rows`` order."""
    s, length = f.pad_rows.shape
    num_heads, head_dim = q.shape[1], q.shape[2]
    qp = q[f.pad_rows].transpose(1, 2)  # [S, heads, L, hd]
    kp = k[f.pad_rows].transpose(1, 2)  # [S, kvh, L, hd]
    vp = v[f.pad_rows].transpose(1, 2)
    out = _sdpa(qp, kp, vp, None, True, scale, softcap,
                None if sinks is None else sinks.view(num_heads, 1, 1))
    out = out.transpose(1, 2).reshape(s * length, num_heads * head_dim)
    return out if f.all_rows and s * length == len(f.valid) else out[f.valid]


def _prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    flat: torch.Tensor,
    p: _Prefill,
    scale: float,
    group: int,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    q_len, num_heads, head_dim = q.shape
    kv_heads = num_heads // group
    if p.gather is None:
        keys, values = k, v
    else:
        keys, values = flat[0][p.gather], flat[1][p.gather]
        if kv_int8.is_int8(flat):
            keys, values = kv_int8.dequantize(keys, q.dtype), kv_int8.dequantize(values, q.dtype)
    # [kvh, q_len * group, hd]: row r is query token r // group, head (kv_head, r % group).
    qg = q.view(q_len, kv_heads, group, head_dim).permute(1, 0, 2, 3)
    qg = qg.reshape(kv_heads, q_len * group, head_dim)
    row_sinks = None
    if sinks is not None:  # row r of kv head h is query head h * group + r % group
        row_sinks = sinks.view(kv_heads, 1, group).expand(kv_heads, q_len, group).reshape(
            kv_heads, q_len * group, 1)
    out = _sdpa(qg, keys.transpose(0, 1), values.transpose(0, 1), p.mask, p.mask is None,
                scale, softcap, row_sinks)
    out = out.view(kv_heads, q_len, group, head_dim).permute(1, 0, 2, 3)
    return out.reshape(q_len, num_heads * head_dim)


def _softcap(scores: torch.Tensor, cap: float) -> torch.Tensor:
    return torch.tanh(scores / cap) * cap


def _softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """The softmax of float32 ``scores`` [..., keys] with each row's sink logit (``sinks``
    broadcast to [..., 1]) in the denominator, as transformers' gpt-oss computes it: the
    sink joins the row, the row's maximum is subtracted, the sink's share dropped."""
    sink = sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)
    combined = torch.cat([scores, sink], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    return torch.softmax(combined, dim=-1)[..., :-1]


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """SDPA over [..., heads, L, hd] queries and [..., kv_heads, S, hd] keys (the heads
    that share a kv head consecutive); ``mask`` additive, or ``causal`` (top-left aligned).
    SDPA has no soft-capping and no sinks: with ``softcap`` or ``sinks`` (broadcast to the
    scores' [..., heads, L, 1]) the scores are computed here, in float32."""
    gqa = k.shape[-3] != q.shape[-3]
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                              scale=scale, enable_gqa=gqa)
    if gqa:
        rep = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if softcap is not None:
        scores = _softcap(scores, softcap)
    if causal:
        length, keys = scores.shape[-2:]
        allowed = torch.ones(length, keys, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~allowed, float("-inf"))
    elif mask is not None:
        scores = scores + mask.float()
    if sinks is not None:
        return torch.matmul(_softmax_with_sinks(scores, sinks).to(q.dtype), v)
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    return torch.matmul(probs, v)
