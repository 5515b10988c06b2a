"""The one-call decode stack (``layers/decoder_stack.py``) on the layer shapes of the newer
families, against a plain torch reference written out here (float32 math from the same
bf16 weights): attention soft-capping, GELU-tanh, norms after each sublayer (OLMo 2),
sandwich norms (Gemma), whole-projection q/k norms, partial and no rotary, two rotary
tables, a residual multiplier, two cache groups with their own blocks and a window on
one. Each feature must also move the result by more than the tolerance, so a stack that
ignored it would fail. And the attention kernel's soft cap on its own, the GELU kernel
against torch's, and bad sizes refused before anything is written."""

from __future__ import annotations

import math
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


LLAMA = Spec()


def _bf16(g: torch.Generator, *shape: int, scale: float = 1.0, offset: float = 0.0):
    return (torch.randn(*shape, generator=g) * scale + offset).to(torch.bfloat16)


def _linear(g: torch.Generator, n: int, k: int, bias: bool = False) -> SimpleNamespace:
    return SimpleNamespace(weight=_bf16(g, n, k, scale=k**-0.5),
                           bias=_bf16(g, n, scale=0.3) if bias else None)


def _norm(g: torch.Generator, width: int) -> SimpleNamespace:
    return SimpleNamespace(weight=_bf16(g, width, scale=0.2, offset=1.0), eps=EPS)


def _layer(g: torch.Generator, spec: Spec) -> SimpleNamespace:
    """A layer object with the attributes the stack reads (a spec's defaults left unset,
    as today's model layers leave them)."""
    names = ("input_norm", "attn_out_norm", "post_norm", "mlp_out_norm")
    attrs = {name: _norm(g, HIDDEN) if on else None for name, on in zip(names, spec.norms,
                                                                          strict=True)}
    q_len, k_len = (HEADS * HD, KV_HEADS * HD) if spec.qk_norm == "whole" else (HD, HD)
    attrs["q_norm"] = _norm(g, q_len) if spec.qk_norm else None
    attrs["k_norm"] = _norm(g, k_len) if spec.qk_norm else None
    attrs["qkv"] = _linear(g, (HEADS + 2 * KV_HEADS) * HD, HIDDEN, spec.bias)
    attrs["o"] = _linear(g, HIDDEN, HEADS * HD)
    attrs["mlp"] = SimpleNamespace(gate_up=_linear(g, 2 * INTER, HIDDEN),
                                   down=_linear(g, HIDDEN, INTER),
                                   activation_name=spec.activation)
    attrs["sliding_window"] = spec.window
    for name, default in [("rotary_dim", HD), ("rope_table", 0), ("scale", None),
                          ("softcap", None), ("residual_scale", 1.0), ("cache_group", 0)]:
        if getattr(spec, name) != default:
            attrs[name] = getattr(spec, name)
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
    # differ); table 2: a partial rotary's width, if any.
    ropes = [_rope(pos, HD, 10_000.0), _rope(pos, HD, 100.0)]
    partial = sorted(d for d in rotary_dims if 0 < d < HD)
    assert len(partial) <= 1
    if partial:
        ropes.append(_rope(pos, partial[0], 10_000.0))
    return Step(lens, groups, ropes)


@dataclass
class Case:
    specs: list[Spec]
    layers: list[SimpleNamespace]
    step: Step
    h0: torch.Tensor
    caches: list[torch.Tensor]


def _case(seed: int, specs: list[Spec]) -> Case:
    g = torch.Generator().manual_seed(seed)
    layers = [_layer(g, s) for s in specs]
    step = _step({s.rotary_dim for s in specs})
    caches = [_bf16(g, 2, GROUP_BLOCKS[s.cache_group], BLOCK, KV_HEADS, HD) for s in specs]
    return Case(specs, layers, step, _bf16(g, 2, HIDDEN), caches)


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
    caches = [t.float().clone() for t in c.caches]
    for spec, layer, cache in zip(c.specs, c.layers, caches, strict=True):
        slots, tables, lens = c.step.groups[spec.cache_group]
        x = _rms(h, layer.input_norm) if layer.input_norm is not None else h
        qkv = x @ layer.qkv.weight.float().T
        if layer.qkv.bias is not None:
            qkv = qkv + layer.qkv.bias.float()
        q, k, v = qkv.split([HEADS * HD, KV_ROW, KV_ROW], -1)
        if spec.qk_norm == "whole":
            q, k = _rms(q, layer.q_norm), _rms(k, layer.k_norm)
        q, k, v = q.reshape(2, HEADS, HD), k.reshape(2, KV_HEADS, HD), v.reshape(2, KV_HEADS, HD)
        if spec.qk_norm == "head":
            q, k = _rms(q, layer.q_norm), _rms(k, layer.k_norm)
        if spec.rotary_dim:
            cos, sin = (t.float()[:, None, :] for t in c.step.ropes[spec.rope_table])
            assert cos.shape[-1] == spec.rotary_dim
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        flat = cache.reshape(2, -1, KV_HEADS, HD)
        flat[0][torch.from_numpy(slots)] = k
        flat[1][torch.from_numpy(slots)] = v
        s = spec.scale if spec.scale is not None else scale
        attn = torch.empty(2, HEADS, HD)
        for r in range(2):
            n = int(lens[r])
            pos = np.arange(n)
            at = torch.from_numpy(tables[r][pos // BLOCK].astype(np.int64) * BLOCK + pos % BLOCK)
            start = max(0, n - spec.window) if spec.window else 0
            keys, values = flat[0][at][start:], flat[1][at][start:]
            for hq in range(HEADS):
                scores = keys[:, hq // (HEADS // KV_HEADS)] @ q[r, hq] * s
                if spec.softcap:
                    scores = spec.softcap * torch.tanh(scores / spec.softcap)
                attn[r, hq] = torch.softmax(scores, 0) @ values[:, hq // (HEADS // KV_HEADS)]
        d = attn.reshape(2, HEADS * HD) @ layer.o.weight.float().T
        if layer.attn_out_norm is not None:
            d = _rms(d, layer.attn_out_norm)
        h = h + spec.residual_scale * d
        m = _rms(h, layer.post_norm) if layer.post_norm is not None else h
        gate, up = (m @ layer.mlp.gate_up.weight.float().T).split(INTER, -1)
        act = F.silu(gate) if spec.activation == "silu" else F.gelu(gate, approximate="tanh")
        d = (act * up) @ layer.mlp.down.weight.float().T
        if layer.mlp_out_norm is not None:
            d = _rms(d, layer.mlp_out_norm)
        h = h + spec.residual_scale * d
    return h, caches


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
                     groups=s.groups)
    return h, c.caches


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Within bf16's rounding of the step's values (as the Rust tests allow): a wiring
    mistake (a wrong half, slot, sign or head) moves values by their own size instead."""
    err = (got.float() - want).abs().max().item()
    top = want.abs().max().item()
    assert err <= 0.02 * top, f"{what}: error {err} against values up to {top}"


def _check(seed: int, specs: list[Spec], without: list[Spec], what: str) -> None:
    """The stack against the reference, and the reference without the feature (the same
    weights where the specs allow) at least 5% away, so the feature is exercised."""
    c = _case(seed, specs)
    want_h, want_caches = _reference(c, HD**-0.5)
    got_h, got_caches = _run(c)
    _close(got_h, want_h, what)
    for i, (got, want) in enumerate(zip(got_caches, want_caches, strict=True)):
        _close(got, want, f"{what}: layer {i}'s cache")
    plain, _ = _reference(_case(seed, without), HD**-0.5)
    moved = (want_h - plain).abs().max().item()
    assert moved > 0.05 * want_h.abs().max().item(), f"{what}: the feature changes nothing"


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
