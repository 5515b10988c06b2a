"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a flattened, paged batch.

Weights are plain tensors (no nn.Module): q/k/v and gate/up projections are fused into one
matrix each so a layer runs four GEMMs. One forward serves any mix of prefill chunks and
decodes; only the rows that will be sampled reach the final norm and the LM head.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from iron_batch.models import (
    cpu_attention,
    cpu_decoder,
    cpu_fused,
    cpu_malloc,
    huge_pages,
    quant,
)
from iron_batch.models.config import ModelConfig
from iron_batch.models.paged_attention import AttentionPlan, paged_attention, write_kv
from iron_batch.models.quant import QuantWeight
from iron_batch.models.rope import apply_rope, rope_cos_sin, rope_inv_freq

#: A projection matrix: dense, or quantized (``--quantization``, see ``models/quant.py``).
Weight = torch.Tensor | QuantWeight


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Weight  # [(heads + 2 * kv_heads) * head_dim, hidden]
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: Weight
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: Weight  # [2 * intermediate, hidden]
    gate_up_bias: torch.Tensor | None
    down: Weight
    down_bias: torch.Tensor | None
    # oneDNN-packed copies of qkv, o, gate_up, down (CPU bf16; see cpu_fused.prepack).
    packed: dict[str, torch.Tensor] | None = None


_PROJECTIONS = ("qkv", "o", "gate_up", "down")

#: Returns the named checkpoint tensor (HF names), or None when absent.
TensorSource = Callable[[str], "torch.Tensor | None"]
#: Returns the named tensor still quantized as the checkpoint stores it (GGUF blocks), or
#: None when it is absent or not in a layout the kernels read.
QuantSource = Callable[[str], "QuantWeight | None"]


class Shard(Protocol):
    """This process's part of a tensor-parallel model (``iron_batch.parallel``): how many
    query and KV heads it holds, its vocabulary rows, and the collectives that join the
    parts. The checkpoint source given with it is already narrowed to those slices."""

    @property
    def num_heads(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def vocab_start(self) -> int: ...
    @property
    def vocab_rows(self) -> int: ...

    def all_reduce(self, t: torch.Tensor) -> None:
        """Sum ``t`` over the ranks, in place."""
        ...

    def gather_logits(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0: the vocabulary shards joined along the last dimension; others: ``t``."""
        ...


class LlamaModel:
    def __init__(
        self,
        config: ModelConfig,
        get: TensorSource,
        *,
        device: torch.device,
        dtype: torch.dtype,
        quantization: str | None = None,
        get_quantized: QuantSource | None = None,
        shard: Shard | None = None,
    ) -> None:
        """``shard``: this rank's part of a tensor-parallel model (``get`` then returns its
        slices); None for the whole model."""
        quant.check_mode(quantization, device, dtype)
        if quantization == "gguf" and get_quantized is None:
            raise quant.QuantizationError("--quantization gguf needs a .gguf checkpoint")
        self.config = config
        self.device = device
        self.dtype = dtype
        self.quantization = quantization
        self.shard = shard
        #: Query and KV heads this process holds (all of them without tensor parallelism).
        self.num_heads = config.num_heads if shard is None else shard.num_heads
        self.num_kv_heads = config.num_kv_heads if shard is None else shard.num_kv_heads
        #: Checkpoint tensors that --quantization gguf had to dequantize (unsupported types).
        self.dequantized: list[str] = []
        c = config

        def need(name: str) -> torch.Tensor:
            t = get(name)
            if t is None:
                raise ValueError(f"checkpoint is missing tensor {name!r}")
            return t.to(device=device, dtype=dtype)

        def opt(name: str, wanted: bool) -> torch.Tensor | None:
            return need(name) if wanted else None

        def proj(names: list[str], head: bool = False) -> Weight:
            """The row-wise concatenation of these matrices, quantized as asked."""
            if quantization == "gguf":
                assert get_quantized is not None
                parts = [get_quantized(n) for n in names]
                if all(p is not None for p in parts):
                    joined = quant.concat(parts)  # type: ignore[arg-type]
                    if joined is not None:
                        return joined
                self.dequantized.extend(n for n, p in zip(names, parts, strict=True) if p is None)
            if quantization in ("int8", "int4"):
                dense = torch.cat([_require(get, n) for n in names])
                if quantization == "int4" and not head and dense.shape[1] % 64 == 0:
                    return quant.quantize_int4(dense)
                return quant.quantize_int8(dense)
            return torch.cat([need(n) for n in names]) if len(names) > 1 else need(names[0])

        self.norm = need("model.norm.weight")
        head_name = "model.embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight"
        self.lm_head: Weight = proj([head_name], head=True)
        # The embedding lookup reads the GGUF blocks when the tied head kept them; else a
        # dense table (--quantization int8/int4 quantize only the projections and the head).
        self.embed: Weight
        if c.tie_word_embeddings and quantization in (None, "gguf"):
            self.embed = self.lm_head
        elif quantization == "gguf":
            self.embed = proj(["model.embed_tokens.weight"])
        else:
            self.embed = need("model.embed_tokens.weight")
        self.layers: list[LayerWeights] = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            m = p + "mlp."
            qkv_bias = None
            if c.qkv_bias:
                qkv_bias = torch.cat([need(a + f"{n}_proj.bias") for n in "qkv"])
            gate_up_bias = None
            if c.mlp_bias:
                gate_up_bias = torch.cat([need(m + "gate_proj.bias"), need(m + "up_proj.bias")])
            self.layers.append(
                LayerWeights(
                    input_norm=need(p + "input_layernorm.weight"),
                    qkv=proj([a + f"{n}_proj.weight" for n in "qkv"]),
                    qkv_bias=qkv_bias,
                    q_norm=opt(a + "q_norm.weight", c.qk_norm),
                    k_norm=opt(a + "k_norm.weight", c.qk_norm),
                    o=proj([a + "o_proj.weight"]),
                    o_bias=opt(a + "o_proj.bias", c.o_bias),
                    post_norm=need(p + "post_attention_layernorm.weight"),
                    gate_up=proj([m + "gate_proj.weight", m + "up_proj.weight"]),
                    gate_up_bias=gate_up_bias,
                    down=proj([m + "down_proj.weight"]),
                    down_bias=opt(m + "down_proj.bias", c.mlp_bias),
                )
            )
        #: The most rows the MLP takes at once (CPU; None: any number), so that its widest
        #: activation stays a heap block (see ``_mlp``).
        self.mlp_rows: int | None = None
        if device.type == "cpu":
            cpu_malloc.keep_freed_memory()
            # This process's gate/up rows (a tensor-parallel rank holds a slice of them).
            width = self.layers[0].gate_up.shape[0] * dtype.itemsize
            self.mlp_rows = max(64, cpu_malloc.HEAP_BLOCK // width // 64 * 64)
        if huge_pages.enabled(device):
            self._weights_to_huge_pages()
        # Which CPU kernels this model uses, decided once (the environment switches are
        # read at load, not per step).
        self.cpu_attention_kernel = cpu_attention.kernel_enabled(device, dtype)
        self.cpu_fused = cpu_fused.fused_enabled(device, dtype)
        self.cpu_gemv = cpu_fused.gemv_enabled(device, dtype, 1)
        self.lm_head_packed: torch.Tensor | None = None
        if cpu_fused.prepack_enabled(device, dtype) and quantization is None:
            for layer in self.layers:
                packed = {n: cpu_fused.prepack(getattr(layer, n)) for n in _PROJECTIONS}
                if all(p is not None for p in packed.values()):
                    layer.packed = packed  # type: ignore[assignment]
            assert isinstance(self.lm_head, torch.Tensor)
            self.lm_head_packed = cpu_fused.prepack(self.lm_head)
        # Decode steps with few rows: every layer in one Rust call (see cpu_decoder).
        self.decoder: cpu_decoder.DecoderStack | None = None
        if shard is None and cpu_decoder.enabled(device, dtype):
            self.decoder = cpu_decoder.DecoderStack(
                self.layers, hidden=c.hidden_size, heads=self.num_heads,
                kv_heads=self.num_kv_heads, head_dim=c.head_dim, eps=c.rms_norm_eps,
            )
        self.inv_freq = rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling).to(device)
        self.scale = c.head_dim**-0.5
        self.q_size = self.num_heads * c.head_dim
        self.kv_size = self.num_kv_heads * c.head_dim
        self.kv_caches: list[torch.Tensor] = []
        self.block_size = 0
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None

    def _weights_to_huge_pages(self) -> None:
        """The projections and the LM head, which a decode step streams from memory, moved
        into one allocation on 2 MiB pages (see ``huge_pages``): the same values. Each
        weight is replaced as soon as it is copied, so nothing here keeps its original."""
        slots = [(layer, n) for layer in self.layers for n in _PROJECTIONS]
        arena = huge_pages.Arena(sum(
            huge_pages.Arena.size_of(t)
            for w in [*(getattr(layer, n) for layer, n in slots), self.lm_head]
            for t in _tensors_of(w)
        ))

        def moved(w: Weight) -> Weight:
            return _with_tensors(w, [arena.place(t.contiguous()) for t in _tensors_of(w)])

        for layer, n in slots:
            setattr(layer, n, moved(getattr(layer, n)))
        tied = self.embed is self.lm_head
        self.lm_head = moved(self.lm_head)
        if tied:
            self.embed = self.lm_head

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        c = self.config
        shape = (2, num_blocks, block_size, self.num_kv_heads, c.head_dim)
        huge = huge_pages.enabled(self.device)
        self.kv_caches = [
            huge_pages.zeros(shape, self.dtype) if huge
            else torch.zeros(shape, dtype=self.dtype, device=self.device)
            for _ in range(c.num_layers)
        ]
        self.block_size = block_size
        if self.decoder is not None:
            self.decoder.set_caches(self.kv_caches, block_size)

    def _cos_sin(
        self, pos: torch.Tensor, positions: np.ndarray
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary cos/sin rows of these positions from a table computed once (grown by
        doubling): the same values rope_cos_sin gives, without a sin and a cos per step."""
        need = int(positions.max()) + 1 if len(positions) else 1
        if self._rope_table is None or self._rope_table[0].shape[0] < need:
            size = max(need, 256, 2 * (0 if self._rope_table is None else len(self._rope_table[0])))
            every = torch.arange(size, device=self.device)
            self._rope_table = rope_cos_sin(every, self.inv_freq, self.dtype)
        cos, sin = self._rope_table
        return cos[pos], sin[pos]

    def kv_bytes_per_block(self, block_size: int) -> int:
        c = self.config
        per_token = 2 * self.num_kv_heads * c.head_dim * c.num_layers
        return per_token * block_size * torch.empty((), dtype=self.dtype).element_size()

    @torch.inference_mode()
    def forward(self, **batch: np.ndarray | torch.Tensor) -> torch.Tensor:
        """Float32 logits [len(sample_indices), vocab] for one flattened batch."""
        # oneDNN's bf16/fp16 kernels win from a few rows up, but for one or two rows (batch-1
        # decode, a pure GEMV over weights that do not fit in cache) ATen's own kernel
        # streams the weights about 25% faster on CPU.
        gemv = (
            self.device.type == "cpu"
            and self.dtype != torch.float32
            and len(batch["input_ids"]) <= 2
        )
        if not gemv or not torch.backends.mkldnn.enabled:
            return self._forward(**batch)
        # The attribute, not mkldnn.flags(): that one also resets oneDNN's TF32 switch and
        # warns about Intel GPUs on every call.
        torch.backends.mkldnn.enabled = False
        try:
            return self._forward(**batch)
        finally:
            torch.backends.mkldnn.enabled = True

    @torch.inference_mode()
    def forward_with_hidden(
        self, hidden_rows: np.ndarray, **batch: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward``'s logits, and the final-normed hidden states (float32,
        ``[len(hidden_rows), hidden]``) of the token rows ``hidden_rows`` (embeddings)."""
        sample_indices = batch.pop("sample_indices")
        h = self._hidden_states(**batch)
        rows = torch.from_numpy(np.ascontiguousarray(hidden_rows, dtype=np.int64))
        hidden = _rms_norm(h[rows.to(self.device)], self.norm, self.config.rms_norm_eps)
        return self._logits(h, sample_indices), hidden.float()

    def _forward(self, *, sample_indices: np.ndarray, **batch: Any) -> torch.Tensor:
        return self._logits(self._hidden_states(**batch), sample_indices)

    def _hidden_states(
        self,
        *,
        input_ids: np.ndarray | torch.Tensor,
        positions: np.ndarray,
        slot_mapping: np.ndarray,
        query_start_loc: np.ndarray,
        seq_lens: np.ndarray,
        num_computed_before: np.ndarray,
        block_tables: np.ndarray,
    ) -> torch.Tensor:
        """The residual stream after the last layer (before the final norm), every row."""
        c = self.config
        dev = self.device
        shard = self.shard
        num_heads, num_kv_heads = self.num_heads, self.num_kv_heads
        if isinstance(input_ids, torch.Tensor):  # placeholders filled in on the device
            ids = input_ids.to(dev)
        else:
            ids = torch.from_numpy(np.ascontiguousarray(input_ids, dtype=np.int64)).to(dev)
        pos = torch.from_numpy(np.ascontiguousarray(positions, dtype=np.int64)).to(dev)
        n = ids.shape[0]
        decoder = self.decoder
        if decoder is not None and 0 < n <= decoder.max_rows and len(query_start_loc) == n + 1:
            if np.all(np.diff(query_start_loc) == 1):  # every row decodes
                lens = np.asarray(seq_lens, dtype=np.int32)
                width = -(-int(lens.max()) // self.block_size)
                h = self._embed(ids).contiguous()
                cos, sin = self._cos_sin(pos, positions)
                decoder.decode(h, cos, sin, slot_mapping, np.asarray(block_tables)[:, :width],
                               lens, scale=self.scale, sliding_window=c.sliding_window)
                return h
        slots = torch.from_numpy(np.ascontiguousarray(slot_mapping, dtype=np.int64)).to(dev)
        plan = AttentionPlan(
            query_start_loc=np.asarray(query_start_loc),
            seq_lens=np.asarray(seq_lens),
            num_computed_before=np.asarray(num_computed_before),
            block_tables=np.asarray(block_tables),
            slot_mapping=slots,
            block_size=self.block_size,
            group=num_heads // num_kv_heads,
            sliding_window=c.sliding_window,
            device=dev,
            dtype=self.dtype,
            use_cpu_kernel=self.cpu_attention_kernel,
        )
        cos, sin = self._cos_sin(pos, positions)
        eps = c.rms_norm_eps
        # CPU: RMSNorm (+ the residual add before it) as one Rust call, and for decode-only
        # steps rotary + KV store too (prefill paths also need k/v as tensors).
        fused = self.cpu_fused
        fused_rope = fused and plan.decodes is not None and plan.decodes.all_rows
        gemv = self.cpu_gemv and n <= 2

        def lin(x: torch.Tensor, layer: LayerWeights, name: str) -> torch.Tensor:
            weight, bias = getattr(layer, name), getattr(layer, name + "_bias")
            if isinstance(weight, QuantWeight):
                return weight.linear(x, bias)
            if gemv:
                return cpu_fused.linear(x, weight, bias)
            if layer.packed is not None:
                return cpu_fused.packed_linear(x, layer.packed[name], bias)
            return F.linear(x, weight, bias)

        h = self._embed(ids)
        layers = self.layers
        x = cpu_fused.add_rms_norm_(h, None, layers[0].input_norm, eps) if fused else None
        for i, (layer, cache) in enumerate(zip(layers, self.kv_caches, strict=True)):
            if not fused:
                x = _rms_norm(h, layer.input_norm, eps)
            assert x is not None
            qkv = lin(x, layer, "qkv")
            k = v = None
            if fused_rope and layer.q_norm is None:
                q = cpu_fused.rope_store_kv(
                    qkv, cos, sin, slot_mapping, cache, num_heads, num_kv_heads, c.head_dim
                )
            else:
                v = qkv[:, self.q_size + self.kv_size :].view(n, num_kv_heads, c.head_dim)
                if layer.q_norm is not None and layer.k_norm is not None:
                    q = qkv[:, : self.q_size].view(n, num_heads, c.head_dim)
                    k = qkv[:, self.q_size : self.q_size + self.kv_size].view(
                        n, num_kv_heads, -1
                    )
                    if fused:  # the kernel the one-call decode uses (cpu_decoder)
                        q = _head_norm(q, layer.q_norm, eps)
                        k = _head_norm(k, layer.k_norm, eps)
                    else:
                        q, k = _rms_norm(q, layer.q_norm, eps), _rms_norm(k, layer.k_norm, eps)
                    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
                else:
                    # One rotation over q and k heads together: half the elementwise calls,
                    # which on a small CPU cost more in dispatch than in arithmetic.
                    qk = qkv[:, : self.q_size + self.kv_size].view(n, -1, c.head_dim)
                    qk = apply_rope(qk, cos, sin)
                    q, k = qk[:, :num_heads], qk[:, num_heads:]
                write_kv(cache, plan, k, v)
            attn = paged_attention(q, k, v, cache, plan, self.scale)
            o = lin(attn, layer, "o")
            if shard is not None:
                shard.all_reduce(o)  # row-parallel: the ranks' partial sums
            if fused:
                x = cpu_fused.add_rms_norm_(h, o, layer.post_norm, eps)  # h += o
            else:
                h = h + o
                x = _rms_norm(h, layer.post_norm, eps)
            mlp = self._mlp(x, layer, lin)
            if shard is not None:
                shard.all_reduce(mlp)
            if fused and i + 1 < len(layers):
                x = cpu_fused.add_rms_norm_(h, mlp, layers[i + 1].input_norm, eps)  # h += mlp
            else:
                h = h + mlp
        return h

    def _mlp(
        self, x: torch.Tensor, layer: LayerWeights,
        lin: Callable[[torch.Tensor, LayerWeights, str], torch.Tensor],
    ) -> torch.Tensor:
        """The gated MLP, on CPU in runs of at most ``mlp_rows`` rows: a long prompt
        step's gate/up output would be one block above glibc's 32 MiB limit for heap
        allocations (8192 x 9728 bf16 is 160 MB), mapped fresh from the kernel, faulted in
        and zeroed in every layer of every such step (see ``cpu_malloc``)."""
        rows = self.mlp_rows
        if rows is None or x.shape[0] <= rows:
            gate, up = lin(x, layer, "gate_up").chunk(2, dim=-1)
            return lin(F.silu(gate) * up, layer, "down")
        return torch.cat([self._mlp(x[i : i + rows], layer, lin)
                          for i in range(0, x.shape[0], rows)])

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.shard is not None:
            return _vocab_parallel_embedding(ids, self.embed, self.shard)  # type: ignore[arg-type]
        if isinstance(self.embed, QuantWeight):
            return self.embed.rows(ids)
        return F.embedding(ids, self.embed)

    def _logits(self, h: torch.Tensor, sample_indices: np.ndarray) -> torch.Tensor:
        """Final norm and LM head over the rows of ``h`` to sample (and to score)."""
        rows = torch.from_numpy(np.ascontiguousarray(sample_indices, dtype=np.int64))
        last = _rms_norm(h[rows.to(self.device)], self.norm, self.config.rms_norm_eps)
        logits = self._lm_head(last)
        if self.shard is not None:
            # This rank's vocabulary columns: rank 0 joins them and drops the padding.
            return self.shard.gather_logits(logits)[:, : self.config.vocab_size]
        return logits

    def _lm_head(self, last: torch.Tensor) -> torch.Tensor:
        # One or two rows: the Rust GEMV, which streams the head one row at a time and
        # beat oneDNN's packed layout on it (Qwen2.5-0.5B's 272 MB head: 3.8-4.0 against
        # 4.0-4.1 ms; SmolLM2's: 0.74-0.86 against 1.0-1.4 ms, builds alternating).
        if isinstance(self.lm_head, QuantWeight):
            return self.lm_head.linear(last).float()
        if self.cpu_gemv and last.shape[0] <= 2:
            return cpu_fused.linear(last, self.lm_head, None).float()
        if self.lm_head_packed is not None:
            return cpu_fused.packed_linear(last, self.lm_head_packed, None).float()
        return F.linear(last, self.lm_head).float()


def _vocab_parallel_embedding(
    ids: torch.Tensor, table: torch.Tensor, shard: Shard
) -> torch.Tensor:
    """Rows of this rank's vocabulary shard, zeros for ids outside it, summed over ranks."""
    local = ids - shard.vocab_start
    outside = (local < 0) | (local >= shard.vocab_rows)
    h = F.embedding(local.masked_fill(outside, 0), table)
    h.masked_fill_(outside.unsqueeze(-1), 0)
    shard.all_reduce(h)
    return h


def _tensors_of(w: Weight) -> list[torch.Tensor]:
    """The tensors that hold a weight's values."""
    if isinstance(w, QuantWeight):
        return [w.quants, w.scale] + ([w.min] if w.min is not None else [])
    return [w]


def _with_tensors(w: Weight, tensors: list[torch.Tensor]) -> Weight:
    """``w`` over ``tensors`` (copies of :func:`_tensors_of`'s, in its order)."""
    if isinstance(w, QuantWeight):
        low = tensors[2] if w.min is not None else None
        return replace(w, quants=tensors[0], scale=tensors[1], min=low)
    return tensors[0]


def _require(get: TensorSource, name: str) -> torch.Tensor:
    """A checkpoint tensor as float32 (the source precision for quantizing it)."""
    t = get(name)
    if t is None:
        raise ValueError(f"checkpoint is missing tensor {name!r}")
    return t.float()


def _head_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3's per-head RMSNorm of ``x`` [T, heads, hd] by the fused CPU kernel."""
    t, heads, hd = x.shape
    return cpu_fused.add_rms_norm_(x.reshape(t * heads, hd).contiguous(), None, weight,
                                   eps).view(t, heads, hd)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Statistics in float32 like the reference implementation, whatever the compute dtype.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)
