"""The one-call decode stack (``layers/decoder_stack.py``) on the layer shapes of the newer
families, against a plain torch reference written out here (float32 math from the same
bf16 weights): attention soft-capping, GELU-tanh, norms after each sublayer (OLMo 2),
sandwich norms (Gemma), whole-projection q/k norms, partial and no rotary, two rotary
tables, a residual multiplier, two cache groups with their own blocks and a window on
one, and Gemma 4's layers (per-layer head shapes, a weightless v norm, values from the k
projection, K/V shared from an earlier layer, per-layer embeddings, a layer scalar, norms
that round once). Each feature must also move the result by more than the tolerance, so a
stack that ignored it would fail. And the attention kernel's soft cap on its own, the GELU
kernel against torch's, and bad sizes refused before anything is written."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch  # these tests must fail, not skip, without torch
import torch.nn.functional as F
from iron_batch.attention import cpu_kernel as cpu_attention
from iron_batch.layers import cpu_kernels
from iron_batch.layers.decoder_stack import DecoderStack

HIDDEN, HEADS, KV_HEADS, HD, INTER = 64, 4, 2, 16, 96
BLOCK, EPS = 4, 1e-5
#: Width of the per-layer-embedding vectors; the rotary table of heads twice as wide.
PLE, WIDE_TABLE = 8, 3
KV_ROW = KV_HEADS * HD
#: Blocks of each cache group's caches: the sliding group's pool is smaller.
GROUP_BLOCKS = (10, 6)


@dataclass(frozen=True)
class Spec:
    """One test layer; the defaults are a Llama layer."""

    #: input, attention-output, pre-MLP and MLP-output norms
    norms: tuple[bool, bool, bool, bool] = (True, False, True, False)
    qk_norm: str | None = None  # None, "head", "whole"
    activation: str = "silu"
    window: int | None = None
    rotary_dim: int = HD
    rope_table: int = 0
    scale: float | None = None
    softcap: float | None = None
    residual_scale: float = 1.0
    cache_group: int = 0
    bias: bool = False
    # Gemma 4's
    head_dim: int = HD
    kv_heads: int = KV_HEADS
    v_norm: bool = False
    v_from_k: bool = False
    kv_source: int | None = None
    ple: bool = False
    layer_scalar: float | None = None
    #: Norms that round once (their weights handed over in float32, as Gemma4Norm's).
    round_once: bool = False

    def kv_parts(self) -> int:
        return 0 if self.kv_source is not None else 1 if self.v_from_k else 2


LLAMA = Spec()


def _bf16(g: torch.Generator, *shape: int, scale: float = 1.0, offset: float = 0.0):
    return (torch.randn(*shape, generator=g) * scale + offset).to(torch.bfloat16)


def _linear(g: torch.Generator, n: int, k: int, bias: bool = False) -> SimpleNamespace:
    return SimpleNamespace(weight=_bf16(g, n, k, scale=k**-0.5),
                           bias=_bf16(g, n, scale=0.3) if bias else None)


def _norm(g: torch.Generator, width: int, once: bool = False) -> SimpleNamespace:
    w = _bf16(g, width, scale=0.2, offset=1.0)
    if once:
        return SimpleNamespace(weight=w.float(), eps=EPS, rounds_once=True)
    return SimpleNamespace(weight=w, eps=EPS)


def _layer(g: torch.Generator, spec: Spec) -> SimpleNamespace:
    """A layer object with the attributes the stack reads (a spec's defaults left unset,
    as today's model layers leave them)."""
    names = ("input_norm", "attn_out_norm", "post_norm", "mlp_out_norm")
    once = spec.round_once
    attrs = {name: _norm(g, HIDDEN, once) if on else None
             for name, on in zip(names, spec.norms, strict=True)}
    hd, kvh = spec.head_dim, spec.kv_heads
    q_len, k_len = (HEADS * hd, kvh * hd) if spec.qk_norm == "whole" else (hd, hd)
    attrs["q_norm"] = _norm(g, q_len, once) if spec.qk_norm else None
    attrs["k_norm"] = _norm(g, k_len, once) if spec.qk_norm and spec.kv_source is None else None
    attrs["qkv"] = _linear(g, (HEADS + spec.kv_parts() * kvh) * hd, HIDDEN, spec.bias)
    attrs["o"] = _linear(g, HIDDEN, HEADS * hd)
    attrs["mlp"] = SimpleNamespace(gate_up=_linear(g, 2 * INTER, HIDDEN),
                                   down=_linear(g, HIDDEN, INTER),
                                   activation_name=spec.activation)
    attrs["sliding_window"] = spec.window
    for name, default in [("rotary_dim", HD), ("rope_table", 0), ("scale", None),
                          ("softcap", None), ("residual_scale", 1.0), ("cache_group", 0),
                          ("kv_source", None), ("v_from_k", False)]:
        if getattr(spec, name) != default:
            attrs[name] = getattr(spec, name)
    if (hd, kvh) != (HD, KV_HEADS):
        attrs["head_dim"], attrs["kv_heads"] = hd, kvh
    if spec.v_norm and spec.kv_source is None:
        ones = torch.ones(hd)
        attrs["v_norm"] = (SimpleNamespace(weight=ones, eps=EPS, rounds_once=True) if once
                           else SimpleNamespace(weight=ones.to(torch.bfloat16), eps=EPS))
    if spec.ple:
        attrs["ple_gate"] = _linear(g, PLE, HIDDEN)
        attrs["ple_proj"] = _linear(g, HIDDEN, PLE)
        attrs["ple_norm"] = _norm(g, HIDDEN, once)
    if spec.layer_scalar is not None:
        attrs["layer_scalar"] = torch.tensor(spec.layer_scalar, dtype=torch.bfloat16)
    return SimpleNamespace(**attrs)


def _rope(pos: np.ndarray, dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    freqs = torch.from_numpy(pos).float()[:, None] * inv[None]
    emb = torch.cat([freqs, freqs], -1)
    return emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16)


@dataclass
class Step:
    """Two decoding rows: 7 and 10 tokens, in each group's own blocks."""

    lens: np.ndarray
    groups: list[tuple[np.ndarray, np.ndarray, np.ndarray]]
    ropes: list[tuple[torch.Tensor, torch.Tensor]]


def _step(rotary_dims: set[int]) -> Step:
    lens = np.array([7, 10], np.int32)
    tables = [np.array([[3, 5, 0], [1, 6, 2]], np.int32),  # group 0 (10 blocks)
              np.array([[4, 0, -1], [2, 3, 5]], np.int32)]  # group 1 (6 blocks)
    groups = []
    for t in tables:
        pos = lens - 1
        slots = (t[np.arange(2), pos // BLOCK].astype(np.int64) * BLOCK + pos % BLOCK)
        groups.append((slots, t, lens))
    pos = (lens - 1).astype(np.int64)
    # Table 0: every dim, base 10000; table 1: base 100 (Gemma 3's local and global bases
    # differ); table 2: a partial rotary's width, if any; table 3 (WIDE_TABLE): heads twice
    # as wide, if any.
    ropes = [_rope(pos, HD, 10_000.0), _rope(pos, HD, 100.0)]
    partial = sorted(d for d in rotary_dims if 0 < d < HD)
    assert len(partial) <= 1
    wide = 2 * HD in rotary_dims
    if partial or wide:
        ropes.append(_rope(pos, partial[0] if partial else HD // 2, 10_000.0))
    if wide:
        ropes.append(_rope(pos, 2 * HD, 10_000.0))
    return Step(lens, groups, ropes)


@dataclass
class Case:
    specs: list[Spec]
    layers: list[SimpleNamespace]
    step: Step
    h0: torch.Tensor
    caches: list[torch.Tensor]
    #: [rows, layers, PLE]: the per-layer-embedding vectors (None: no layer has a block).
    per_layer: torch.Tensor | None = None


def _case(seed: int, specs: list[Spec]) -> Case:
    g = torch.Generator().manual_seed(seed)
    layers = [_layer(g, s) for s in specs]
    step = _step({s.rotary_dim for s in specs})
    caches: list[torch.Tensor] = []
    for s in specs:  # a layer that shares K/V is handed its source's tensor
        caches.append(caches[s.kv_source] if s.kv_source is not None else
                      _bf16(g, 2, GROUP_BLOCKS[s.cache_group], BLOCK, s.kv_heads, s.head_dim))
    h0 = _bf16(g, 2, HIDDEN)
    per_layer = _bf16(g, 2, len(specs), PLE) if any(s.ple for s in specs) else None
    return Case(specs, layers, step, h0, caches, per_layer)


def _rms(x: torch.Tensor, norm: SimpleNamespace) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * norm.weight.float()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """rotate_half over the first ``cos.shape[-1]`` dims of each head; the rest as they are."""
    rd = cos.shape[-1]
    if rd == 0:
        return x
    rot, rest = x[..., :rd], x[..., rd:]
    x1, x2 = rot[..., : rd // 2], rot[..., rd // 2:]
    return torch.cat([rot * cos + torch.cat([-x2, x1], -1) * sin, rest], -1)


def _reference(c: Case, scale: float) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The step in float32 from the bf16 weights and caches: (h, caches)."""
    h = c.h0.float()
    caches: list[torch.Tensor] = []
    for t, spec in zip(c.caches, c.specs, strict=True):
        caches.append(caches[spec.kv_source] if spec.kv_source is not None
                      else t.float().clone())
    for i, (spec, layer, cache) in enumerate(zip(c.specs, c.layers, caches, strict=True)):
        slots, tables, lens = c.step.groups[spec.cache_group]
        hd, kvh = spec.head_dim, spec.kv_heads
        x = _rms(h, layer.input_norm) if layer.input_norm is not None else h
        qkv = x @ layer.qkv.weight.float().T
        if layer.qkv.bias is not None:
            qkv = qkv + layer.qkv.bias.float()
        q, k, v = qkv.split([HEADS * hd] + [kvh * hd] * spec.kv_parts(), -1) + (
            (None,) * (2 - spec.kv_parts()))
        if spec.v_from_k:
            v = k  # the raw keys, before their norm
        if spec.qk_norm == "whole":
            q = _rms(q, layer.q_norm)
            k = _rms(k, layer.k_norm) if k is not None else None
        q = q.reshape(2, HEADS, hd)
        if spec.qk_norm == "head":
            q = _rms(q, layer.q_norm)
        if spec.kv_source is None:
            k, v = k.reshape(2, kvh, hd), v.reshape(2, kvh, hd)
            if spec.qk_norm == "head":
                k = _rms(k, layer.k_norm)
            if spec.v_norm:
                v = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + EPS)
        if spec.rotary_dim:
            cos, sin = (t.float()[:, None, :] for t in c.step.ropes[spec.rope_table])
            assert cos.shape[-1] == spec.rotary_dim
            q = _rotate(q, cos, sin)
            k = _rotate(k, cos, sin) if k is not None else None
        flat = cache.reshape(2, -1, kvh, hd)
        if spec.kv_source is None:
            flat[0][torch.from_numpy(slots)] = k
            flat[1][torch.from_numpy(slots)] = v
        s = spec.scale if spec.scale is not None else scale
        attn = torch.empty(2, HEADS, hd)
        for r in range(2):
            n = int(lens[r])
            pos = np.arange(n)
            at = torch.from_numpy(tables[r][pos // BLOCK].astype(np.int64) * BLOCK + pos % BLOCK)
            start = max(0, n - spec.window) if spec.window else 0
            keys, values = flat[0][at][start:], flat[1][at][start:]
            for hq in range(HEADS):
                scores = keys[:, hq // (HEADS // kvh)] @ q[r, hq] * s
                if spec.softcap:
                    scores = spec.softcap * torch.tanh(scores / spec.softcap)
                attn[r, hq] = torch.softmax(scores, 0) @ values[:, hq // (HEADS // kvh)]
        d = attn.reshape(2, HEADS * hd) @ layer.o.weight.float().T
        if layer.attn_out_norm is not None:
            d = _rms(d, layer.attn_out_norm)
        h = h + spec.residual_scale * d
        m = _rms(h, layer.post_norm) if layer.post_norm is not None else h
        gate, up = (m @ layer.mlp.gate_up.weight.float().T).split(INTER, -1)
        d = (_act(spec, gate) * up) @ layer.mlp.down.weight.float().T
        if layer.mlp_out_norm is not None:
            d = _rms(d, layer.mlp_out_norm)
        h = h + spec.residual_scale * d
        if spec.ple:
            assert c.per_layer is not None
            gated = _act(spec, h @ layer.ple_gate.weight.float().T) * c.per_layer[:, i].float()
            h = h + _rms(gated @ layer.ple_proj.weight.float().T, layer.ple_norm)
        if spec.layer_scalar is not None:
            h = h * spec.layer_scalar
    return h, caches


def _act(spec: Spec, x: torch.Tensor) -> torch.Tensor:
    return F.silu(x) if spec.activation == "silu" else F.gelu(x, approximate="tanh")


def _stack(c: Case) -> DecoderStack:
    stack = DecoderStack(c.layers, hidden=HIDDEN, heads=HEADS, kv_heads=KV_HEADS, head_dim=HD,
                         eps=EPS)
    stack.set_caches(c.caches, BLOCK)
    return stack


def _run(c: Case, scale: float = HD**-0.5) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The stack's step over copies of the case's residual and caches."""
    c = replace(c, caches=[t.clone() for t in c.caches])
    h = c.h0.clone()
    s = c.step
    _stack(c).decode(h, None, None, None, None, None, scale=scale, ropes=s.ropes,
                     groups=s.groups, per_layer=c.per_layer)
    return h, c.caches


def _close(got: torch.Tensor, want: torch.Tensor, what: str, tol: float = 0.02) -> None:
    """Within bf16's rounding of the step's values (as the Rust tests allow): a wiring
    mistake (a wrong half, slot, sign or head) moves values by their own size instead."""
    err = (got.float() - want).abs().max().item()
    top = want.abs().max().item()
    assert err <= tol * top, f"{what}: error {err} against values up to {top}"


def _check(seed: int, specs: list[Spec], without: list[Spec], what: str,
           tweak: Callable[[Case], None] | None = None, tol: float = 0.02) -> None:
    """The stack against the reference (within ``tol`` of its largest value), and the
    reference without the feature (the same weights where the specs allow) at least
    2.5 ``tol`` away, so the feature is exercised. ``tweak`` changes both cases' weights
    first."""
    c = _case(seed, specs)
    if tweak is not None:
        tweak(c)
    want_h, want_caches = _reference(c, HD**-0.5)
    got_h, got_caches = _run(c)
    _close(got_h, want_h, what, tol)
    for i, (got, want) in enumerate(zip(got_caches, want_caches, strict=True)):
        if c.specs[i].kv_source is None:
            _close(got, want, f"{what}: layer {i}'s cache", tol)
        else:  # its own copy of its source's tensor: untouched
            assert torch.equal(got, c.caches[i]), f"{what}: layer {i} wrote K/V"
    other = _case(seed, without)
    if tweak is not None:
        tweak(other)
    plain, _ = _reference(other, HD**-0.5)
    moved = (want_h - plain).abs().max().item()
    assert moved > 2.5 * tol * want_h.abs().max().item(), f"{what}: the feature changes nothing"


def test_llama_layers_through_the_general_form_match_the_reference() -> None:
    c = _case(1, [LLAMA, replace(LLAMA, qk_norm="head", bias=True, window=5)])
    want, _ = _reference(c, HD**-0.5)
    got, _ = _run(c)
    _close(got, want, "llama")
    # The positional form (one table, one group) gives the same bits.
    h = c.h0.clone()
    caches = [t.clone() for t in c.caches]
    stack = DecoderStack(c.layers, hidden=HIDDEN, heads=HEADS, kv_heads=KV_HEADS,
                         head_dim=HD, eps=EPS)
    stack.set_caches(caches, BLOCK)
    cos, sin = c.step.ropes[0]
    stack.decode(h, cos, sin, *c.step.groups[0], scale=HD**-0.5)
    assert torch.equal(h, got)


def test_soft_capped_attention() -> None:
    capped = replace(LLAMA, scale=1.0, softcap=2.0)
    _check(2, [capped, capped], [replace(capped, softcap=None)] * 2, "softcap")


def test_gelu_tanh_mlp() -> None:
    gelu = replace(LLAMA, activation="gelu_pytorch_tanh")
    _check(3, [gelu, gelu], [LLAMA, LLAMA], "gelu")
    _check(3, [replace(gelu, activation="gelu_tanh")] * 2, [LLAMA, LLAMA], "gelu_tanh")


def test_norms_after_each_sublayer_olmo2() -> None:
    olmo = replace(LLAMA, norms=(False, True, False, True), qk_norm="whole")
    _check(4, [olmo, olmo], [replace(olmo, norms=(True, False, True, False))] * 2, "olmo2")


def test_sandwich_norms_gemma() -> None:
    local = replace(LLAMA, norms=(True,) * 4, qk_norm="head", activation="gelu_pytorch_tanh",
                    window=4, scale=0.5, softcap=3.0)
    glob = replace(local, window=None, rope_table=1)
    pre = (True, False, True, False)
    _check(5, [local, glob], [replace(local, norms=pre), replace(glob, norms=pre)], "gemma")


def test_whole_projection_q_k_norms() -> None:
    whole = replace(LLAMA, qk_norm="whole")
    _check(6, [whole, whole], [LLAMA, LLAMA], "whole q/k norm")


@pytest.mark.parametrize("rotary_dim", [HD // 2, HD * 3 // 4, 0])
def test_partial_and_no_rotary(rotary_dim: int) -> None:
    table = 2 if rotary_dim else 0
    spec = replace(LLAMA, rotary_dim=rotary_dim, rope_table=table)
    _check(7 + rotary_dim, [spec, spec], [LLAMA, LLAMA], f"rotary_dim {rotary_dim}")


def test_two_rope_tables() -> None:
    local = replace(LLAMA, window=4)
    glob = replace(LLAMA, rope_table=1)
    _check(30, [local, glob, glob], [local, local, replace(glob, rope_table=0)], "two tables")


def test_residual_multiplier() -> None:
    granite = replace(LLAMA, residual_scale=0.25)
    _check(31, [granite, granite], [LLAMA, LLAMA], "residual_scale")
    # With output norms: the norm first, then the multiplier.
    both = replace(LLAMA, norms=(True,) * 4, residual_scale=0.5)
    _check(32, [both, both], [replace(both, residual_scale=1.0)] * 2, "norms and scale")


def test_two_cache_groups_with_their_own_blocks_and_a_window() -> None:
    sliding = replace(LLAMA, cache_group=1, window=4)
    c = _case(33, [sliding, LLAMA, sliding])
    assert c.caches[0].shape[1] != c.caches[1].shape[1]
    _check(33, [sliding, LLAMA, sliding], [LLAMA] * 3, "cache groups")
    # Each layer wrote its two new rows into its own group's blocks and nothing else.
    _, caches = _run(c)
    for spec, before, after in zip(c.specs, c.caches, caches, strict=True):
        slots = c.step.groups[spec.cache_group][0]
        changed = (before != after).reshape(2, -1, KV_ROW).any(-1).any(0)
        assert set(np.flatnonzero(changed.numpy())) == set(slots.tolist())


#: A Gemma 4 sliding layer: per-head q/k norms, the v norm, GELU, scale 1 (pre-norm only:
#: the sandwich norms are Gemma 3's test's, and each norm of a small output adds to bf16's
#: error).
GEMMA4 = replace(LLAMA, qk_norm="head", activation="gelu_pytorch_tanh", scale=1.0, window=4,
                 v_norm=True)
#: bf16's error over a few such layers against the float32 reference: the head norms and
#: the per-layer-embedding norm rescale small values (up to 2-4% of the largest in 15 seeds).
G4_TOL = 0.04
#: A Gemma 4 global layer: heads twice as wide and one K/V head, its own rotary table.
GEMMA4_GLOBAL = replace(GEMMA4, window=None, head_dim=2 * HD, kv_heads=1,
                        rotary_dim=2 * HD, rope_table=WIDE_TABLE)


def test_per_layer_head_shapes() -> None:
    _check(60, [GEMMA4, GEMMA4_GLOBAL, GEMMA4],
           [GEMMA4, replace(GEMMA4, window=None), GEMMA4], "head shapes", tol=G4_TOL)
    c = _case(60, [GEMMA4, GEMMA4_GLOBAL])
    assert c.caches[1].shape[-2:] == (1, 2 * HD)


def test_weightless_v_norm() -> None:
    # Values four times the size the norm brings them back to.
    v_norm = GEMMA4

    def large_values(c: Case) -> None:
        for layer in c.layers:
            w = layer.qkv.weight.clone()
            w[(HEADS + KV_HEADS) * HD:] *= 4
            layer.qkv.weight = w

    _check(61, [v_norm, v_norm], [replace(v_norm, v_norm=False)] * 2, "v norm", large_values,
           G4_TOL)


def test_values_from_the_k_projection() -> None:
    k_eq_v = replace(GEMMA4_GLOBAL, v_from_k=True)
    _check(62, [GEMMA4, k_eq_v], [GEMMA4, GEMMA4_GLOBAL], "v from k", tol=G4_TOL)
    # The stored values are the raw keys under the weightless norm: unrotated, so the
    # keys and values of a head differ (the keys are normed by k_norm and rotated).
    c = _case(62, [GEMMA4, k_eq_v])
    _, caches = _run(c)
    slots = c.step.groups[0][0]
    k, v = (caches[1][i].reshape(-1, 2 * HD)[torch.from_numpy(slots)] for i in (0, 1))
    assert not torch.equal(k, v)
    torch.testing.assert_close(v.float().pow(2).mean(-1), torch.ones(2), atol=0.02, rtol=0)


def test_shared_k_v_read_the_source_layers_cache_and_write_nothing() -> None:
    shared = replace(GEMMA4, kv_source=0)
    wide_shared = replace(GEMMA4_GLOBAL, kv_source=1)
    specs = [GEMMA4, GEMMA4_GLOBAL, shared, wide_shared]
    _check(63, specs, [GEMMA4, GEMMA4_GLOBAL, GEMMA4, GEMMA4_GLOBAL], "shared K/V", tol=G4_TOL)
    # The source layers stored this step's rows once, in their own slots only.
    c = _case(63, specs)
    before = [t.clone() for t in c.caches]
    _, after = _run(c)
    slots = set(c.step.groups[0][0].tolist())
    for i in (0, 1):
        rows = (before[i] != after[i]).reshape(2, -1, before[i].shape[-2:].numel()).any(-1)
        assert set(np.flatnonzero(rows.any(0).numpy())) == slots
    # A source that is not an earlier storing layer of the same shape and group is
    # refused (itself, a wider layer, a layer that shares too, another group), and nothing
    # is written.
    for bad in [replace(shared, kv_source=3), replace(shared, kv_source=1),
                replace(shared, kv_source=2), replace(shared, kv_source=0, cache_group=1)]:
        case = _case(64, [GEMMA4, GEMMA4_GLOBAL, shared, GEMMA4])
        layers = [*case.layers[:3], _layer(torch.Generator().manual_seed(1), bad)]
        caches = [t.clone() for t in case.caches]
        caches[3] = caches[bad.kv_source] if bad.kv_source < 3 else caches[3]
        kept = [t.clone() for t in caches]
        h = case.h0.clone()
        stack = DecoderStack(layers, hidden=HIDDEN, heads=HEADS, kv_heads=KV_HEADS,
                             head_dim=HD, eps=EPS)
        try:
            stack.set_caches(caches, BLOCK)
        except ValueError:
            continue  # refused even earlier
        with pytest.raises(ValueError):
            stack.decode(h, None, None, None, None, None, scale=1.0, ropes=case.step.ropes,
                         groups=case.step.groups)
        assert torch.equal(h, case.h0)
        assert all(torch.equal(a, b) for a, b in zip(caches, kept, strict=True))


def test_per_layer_embeddings() -> None:
    ple = replace(GEMMA4, ple=True)
    _check(65, [ple, replace(ple, activation="silu")], [GEMMA4, replace(GEMMA4,
                                                                        activation="silu")],
           "per-layer embeddings", tol=G4_TOL)
    # Without the step's vectors, or with the wrong shape, the step is refused.
    c = _case(65, [ple, ple])
    stack = _stack(c)
    for bad in (None, c.per_layer[:, :1].contiguous(), c.per_layer.float()):
        h = c.h0.clone()
        with pytest.raises(ValueError, match="per_layer"):
            stack.decode(h, None, None, None, None, None, scale=1.0, ropes=c.step.ropes,
                         groups=c.step.groups, per_layer=bad)
        assert torch.equal(h, c.h0)


def test_layer_scalar() -> None:
    scaled = replace(GEMMA4, layer_scalar=0.375)
    _check(66, [scaled, replace(scaled, layer_scalar=1.5)], [GEMMA4, GEMMA4], "layer scalar",
           tol=G4_TOL)
    # With a per-layer-embedding block: the block joins first, then the scalar.
    both = replace(scaled, ple=True)
    _check(67, [both, both], [replace(both, layer_scalar=None)] * 2, "scalar after the block",
           tol=G4_TOL)


def test_a_gemma4_stack_with_every_feature() -> None:
    local = replace(GEMMA4, ple=True, layer_scalar=0.75, round_once=True)
    glob = replace(GEMMA4_GLOBAL, ple=True, layer_scalar=1.25, round_once=True,
                   v_from_k=True, cache_group=1)
    specs = [local, glob, replace(local, kv_source=0), replace(glob, kv_source=1,
                                                                v_from_k=False)]
    _check(68, specs, [replace(s, ple=False, layer_scalar=None) for s in specs], "gemma4", tol=0.06)


def test_norms_that_round_once() -> None:
    # The kernel against Gemma 4's norm in torch: float32 statistics and weight product,
    # one rounding. Bit for bit but where the two sums' orders move a value across a bf16
    # rounding boundary (1 of these 16384; the shared norm's rounding moves a quarter).
    g = torch.Generator().manual_seed(69)
    x = _bf16(g, 64, 256, scale=3.0)
    w = _bf16(g, 256, scale=0.5, offset=1.0)
    xf = x.float()
    want = (xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + EPS, -0.5) * w.float()).to(
        torch.bfloat16)
    got = cpu_kernels.add_rms_norm_(x.clone(), None, w, EPS, round_once=True)
    assert (got != want).sum().item() <= 8
    torch.testing.assert_close(got, want, rtol=1 / 128, atol=0)
    shared = cpu_kernels.add_rms_norm_(x.clone(), None, w, EPS)
    assert (shared != want).sum().item() > 1000
    # In the stack: a layer's norms round once when they say so, and all of a layer's
    # norms must say the same.
    once = replace(GEMMA4, round_once=True)
    c = _case(70, [once, once])
    got_h, _ = _run(c)
    want_h, _ = _reference(c, HD**-0.5)
    _close(got_h, want_h, "round once", G4_TOL)
    plain = replace(c, layers=[SimpleNamespace(**{
        **vars(layer),
        **{name: SimpleNamespace(weight=n.weight.to(torch.bfloat16), eps=EPS)
           for name, n in vars(layer).items() if getattr(n, "rounds_once", False)}})
        for layer in c.layers])
    assert not torch.equal(_run(plain)[0], got_h)
    mixed = SimpleNamespace(**{**vars(c.layers[0]), "post_norm": plain.layers[0].post_norm})
    with pytest.raises(ValueError, match="round"):
        DecoderStack([mixed], hidden=HIDDEN, heads=HEADS, kv_heads=KV_HEADS, head_dim=HD,
                     eps=EPS)


def test_paged_attention_soft_cap_matches_torch() -> None:
    g = torch.Generator().manual_seed(40)
    heads, kv_heads, hd, block, width, seqs = 8, 2, 64, 16, 4, 3
    cache = torch.randn(2, seqs * width, block, kv_heads, hd, generator=g).to(torch.bfloat16)
    tables = torch.randperm(seqs * width, generator=g).numpy().astype(np.int32).reshape(seqs, -1)
    lens = np.array([1, 23, 64], np.int32)
    q = torch.randn(seqs, heads, hd, generator=g).to(torch.bfloat16)
    scale, cap = 0.5, 5.0
    got = cpu_attention.paged_decode_attention(q, cache, tables, lens, scale, None, softcap=cap)
    plain = cpu_attention.paged_decode_attention(q, cache, tables, lens, scale, None)
    off = cpu_attention.paged_decode_attention(q, cache, tables, lens, scale, None, softcap=None)
    assert torch.equal(plain, off)
    flat = cache.double().reshape(2, -1, kv_heads, hd)
    want = torch.empty(seqs, heads, hd, dtype=torch.float64)
    for s in range(seqs):
        n = int(lens[s])
        pos = np.arange(n)
        at = torch.from_numpy(tables[s][pos // block].astype(np.int64) * block + pos % block)
        for h in range(heads):
            scores = flat[0][at][:, h // 4] @ q[s, h].double() * scale
            scores = cap * torch.tanh(scores / cap)
            want[s, h] = torch.softmax(scores, 0) @ flat[1][at][:, h // 4]
    want = want.reshape(seqs, -1)
    torch.testing.assert_close(got.double(), want, atol=1e-2, rtol=1e-2)
    # Scores of up to ~20 against a cap of 5: the cap matters.
    assert (plain.double() - want).abs().max() > 0.1
    with pytest.raises(ValueError, match="softcap"):
        cpu_attention.paged_decode_attention(q, cache, tables, lens, scale, None, softcap=-1.0)


def test_gelu_tanh_kernel_rounds_like_torch() -> None:
    # Every finite bf16 gate value, against up values of one sign and of both.
    bits = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16)
    gate = bits.view(torch.bfloat16)
    gate = gate[torch.isfinite(gate)]
    for up in (torch.ones_like(gate), torch.linspace(-3, 3, gate.numel()).to(torch.bfloat16)):
        gate_up = torch.cat([gate, up]).reshape(1, -1)
        got = cpu_kernels.gelu_tanh_mul(gate_up)
        want = F.gelu(gate, approximate="tanh") * up
        differ = (got[0].view(torch.int16) != want.view(torch.int16)).sum().item()
        # torch's vectorized tanh (Sleef's) and the kernel's are each within an ulp or two
        # in f32: near tanh = -1 (gates around -5) the last bit decides whether the GELU
        # is -0 or -3e-7. Two of the 65280 values here; anything else is a real error.
        assert differ <= 8, f"{differ} of {gate.numel()} differ"
        torch.testing.assert_close(got[0].float(), want.float(), rtol=1 / 128, atol=1e-6)
    silu = cpu_kernels.silu_mul(torch.cat([gate[:1000], gate[1000:2000]]).reshape(1, -1))
    torch.testing.assert_close(silu[0].float(), (F.silu(gate[:1000]) * gate[1000:2000]).float(),
                               rtol=1 / 128, atol=1e-6)


def test_gated_activation_of_many_rows_splits_over_threads_and_keeps_each_row() -> None:
    """A prompt step's GeGLU (hundreds of rows) runs on the thread team in row ranges:
    each row equals that row alone, and torch's chain within its last bit near zero."""
    torch.manual_seed(3)
    gate_up = (torch.randn(300, 2 * 1536) * 3).to(torch.bfloat16)
    for act in ("gelu_pytorch_tanh", "silu"):
        got = cpu_kernels.gated_activation(gate_up, act)
        alone = torch.cat([cpu_kernels.gated_activation(gate_up[r : r + 1], act)
                           for r in range(0, 300, 37)])
        assert torch.equal(got[::37], alone)
        gate, up = gate_up.chunk(2, dim=-1)
        want = (F.gelu(gate, approximate="tanh") if act != "silu" else F.silu(gate)) * up
        torch.testing.assert_close(got.float(), want.float(), rtol=1 / 128, atol=1e-5)


def test_a_bf16_gemma_mlp_takes_the_fused_geglu() -> None:
    """With the CPU's fused kernels, a GeGLU MLP of bf16 rows runs the Rust pass (a
    SwiGLU one keeps torch's chain), and gives what the torch route gives."""
    from iron_batch.layers.linear import Linear
    from iron_batch.layers.mlp import GatedMLP
    from iron_batch.platform.cpu import CpuKernels

    torch.manual_seed(4)
    plain_kernels = CpuKernels()
    gate_up = Linear((torch.randn(2 * 96, 64) / 8).to(torch.bfloat16), kernels=plain_kernels)
    down = Linear((torch.randn(64, 96) / 8).to(torch.bfloat16), kernels=plain_kernels)
    x = torch.randn(40, 64).to(torch.bfloat16)
    fused = GatedMLP(gate_up, down, "gelu_pytorch_tanh", fused=True)
    plain = GatedMLP(gate_up, down, "gelu_pytorch_tanh")
    assert fused.activation != plain.activation
    assert GatedMLP(gate_up, down, "silu", fused=True).activation is GatedMLP(
        gate_up, down, "silu").activation
    torch.testing.assert_close(fused(x).float(), plain(x).float(), rtol=1 / 64, atol=1e-4)


def test_bad_sizes_are_refused_before_anything_is_written() -> None:
    c = _case(50, [LLAMA, LLAMA])
    s = c.step
    bad_layers = [
        # a q norm neither per head nor over the whole projection
        {"q_norm": SimpleNamespace(weight=torch.ones(2 * HD, dtype=torch.bfloat16))},
        # a k norm of the q projection's width
        {"k_norm": SimpleNamespace(weight=torch.ones(HEADS * HD, dtype=torch.bfloat16))},
        # a partial rotary whose table (0) is the full width
        {"rotary_dim": HD // 2},
        # a rope table the step does not have
        {"rope_table": 7},
        # a cache group the step does not have
        {"cache_group": 3},
        # a negative softcap
        {"softcap": -1.0},
    ]
    for i, bad in enumerate(bad_layers):
        layers = [c.layers[0], SimpleNamespace(**{**vars(c.layers[1]), **bad})]
        h = c.h0.clone()
        caches = [t.clone() for t in c.caches]
        stack = DecoderStack(layers, hidden=HIDDEN, heads=HEADS, kv_heads=KV_HEADS,
                             head_dim=HD, eps=EPS)
        try:
            stack.set_caches(caches, BLOCK)
        except ValueError:
            continue  # refused even earlier
        with pytest.raises(ValueError):
            stack.decode(h, None, None, None, None, None, scale=0.25, ropes=s.ropes,
                         groups=s.groups)
        assert torch.equal(h, c.h0), f"case {i}: h written"
        for got, want in zip(caches, c.caches, strict=True):
            assert torch.equal(got, want), f"case {i}: a cache written"
    # Caches of one group with different block counts are refused.
    stack = _stack(c)
    with pytest.raises(ValueError, match="group 0"):
        stack.set_caches([c.caches[0], c.caches[0][:, :3].contiguous()], BLOCK)
    # A norm weight of the wrong width is refused when the stack is built.
    wide = SimpleNamespace(**{**vars(c.layers[0]),
                              "attn_out_norm": SimpleNamespace(weight=torch.ones(HIDDEN + 1,
                                                               dtype=torch.bfloat16),
                                                               eps=EPS)})
    with pytest.raises(ValueError):
        DecoderStack([wide], hidden=HIDDEN, heads=HEADS, kv_heads=KV_HEADS, head_dim=HD, eps=EPS)
    # And a good step after all that runs.
    h = c.h0.clone()
    stack.decode(h, None, None, None, None, None, scale=0.25, ropes=s.ropes, groups=s.groups)
    assert not torch.equal(h, c.h0)
    assert math.isfinite(h.float().abs().max().item())
