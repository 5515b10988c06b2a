"""Fused RMSNorm and rotary/KV-store kernels against the torch op chains they replace."""

from __future__ import annotations

import numpy as np
import pytest
import torch  # these tests must fail, not skip, without torch
from iron_batch.attention.paged import write_kv
from iron_batch.layers import cpu_kernels as cpu_fused
from iron_batch.layers.norm import rms_norm as _rms_norm
from iron_batch.layers.rotary import apply_rope, rope_cos_sin, rope_inv_freq
from iron_batch.platform import cpu, switches

F = torch.nn.functional

DTYPES = [torch.float32, torch.bfloat16]


def _exact_or_close(got: torch.Tensor, want: torch.Tensor) -> None:
    if got.dtype == torch.bfloat16:
        assert torch.equal(got, want), (got.float() - want.float()).abs().max()
    else:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 300])
def test_add_rms_norm_matches_the_torch_chain(dtype: torch.dtype, rows: int) -> None:
    if not cpu.select(torch.device("cpu"), dtype, switches.read()).fused:
        pytest.fail("the fused CPU kernels are not available in this build")
    g = torch.Generator().manual_seed(rows)
    h = (torch.randn(rows, 576, generator=g) * 3).to(dtype)
    delta = torch.randn(rows, 576, generator=g).to(dtype)
    weight = torch.randn(576, generator=g).to(dtype)
    want_h = h + delta
    want = _rms_norm(want_h, weight, 1e-5)
    got_h = h.clone()
    got = cpu_fused.add_rms_norm_(got_h, delta, weight, 1e-5)
    _exact_or_close(got_h, want_h)
    _exact_or_close(got, want)
    # Without a delta the input is left as it is.
    plain = h.clone()
    _exact_or_close(cpu_fused.add_rms_norm_(plain, None, weight, 1e-5), _rms_norm(h, weight, 1e-5))
    assert torch.equal(plain, h)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_store_kv_matches_rope_then_write_kv(dtype: torch.dtype) -> None:
    heads, kv_heads, hd, tokens = 9, 3, 64, 37
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * hd, generator=g).to(dtype)
    positions = torch.randint(0, 4000, (tokens,), generator=g)
    cos, sin = rope_cos_sin(positions, rope_inv_freq(hd, 100000.0, {}), dtype)
    slots = torch.randperm(20 * 16, generator=g)[:tokens]
    want_cache = torch.zeros(2, 20, 16, kv_heads, hd, dtype=dtype)
    qk = apply_rope(qkv[:, : (heads + kv_heads) * hd].view(tokens, -1, hd), cos, sin)
    v = qkv[:, (heads + kv_heads) * hd :].view(tokens, kv_heads, hd)

    class Plan:
        slot_mapping = slots

    write_kv(want_cache, Plan(), qk[:, heads:], v)  # type: ignore[arg-type]
    got_cache = torch.zeros_like(want_cache)
    q = cpu_fused.rope_store_kv(qkv, cos, sin, slots.numpy(), got_cache, heads, kv_heads, hd)
    _exact_or_close(q, qk[:, :heads])
    _exact_or_close(got_cache, want_cache)


def test_rope_store_kv_refuses_slots_outside_the_cache() -> None:
    cache = torch.zeros(2, 2, 16, 1, 8)
    qkv = torch.zeros(1, 3 * 8)
    cos = sin = torch.zeros(1, 8)
    with pytest.raises(ValueError, match="slot 32"):
        cpu_fused.rope_store_kv(qkv, cos, sin, np.array([32]), cache, 1, 1, 8)
    assert not cache.any()


@pytest.mark.parametrize("rows", [1, 2, 9, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_linear_matches_f_linear_to_one_rounding(rows: int, bias: bool) -> None:
    if not cpu.select(torch.device("cpu"), torch.bfloat16, switches.read()).gemv:
        pytest.fail("the Rust GEMV is not available in this build")
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=g).bfloat16()
    w = torch.randn(1531, 576, generator=g).bfloat16()
    b = torch.randn(1531, generator=g).bfloat16() if bias else None
    got = cpu_fused.linear(x, w, b)
    want = x.double() @ w.double().T + (b.double() if b is not None else 0)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 1531)
    # f32 sums, then one rounding to bf16 (relative 2^-8).
    torch.testing.assert_close(got.double(), want, rtol=2**-8, atol=1e-2)
    # float32 rows go to F.linear unchanged.
    x32 = torch.randn(3, 576, generator=g)
    assert torch.equal(cpu_fused.linear(x32, w.float(), None), F.linear(x32, w.float()))


@pytest.mark.parametrize("gemm", ["auto", "bf16", "f32"])
@pytest.mark.parametrize("gemv_rows", [0, 8, 192])
@pytest.mark.parametrize("prepacked", [False, True])
def test_a_bf16_projection_of_many_rows_is_exact_to_one_rounding(
    gemv_rows: int, gemm: str, prepacked: bool
) -> None:
    """A model's projection at every row count a step may have: the GEMV in passes (each
    row then the value it gets alone, as a one-row decode step), and above the GEMV's rows
    torch's GEMM, in bf16 or in f32 over a widened weight (kept from load when prepacked)
    as ``IRON_BATCH_CPU_GEMM`` says; ``auto`` is f32 where the CPU has no bf16 arithmetic
    (unless ``IRON_BATCH_CPU_GEMV_ROWS`` is 0) or its bf16 dot products are no faster than
    its f32 FMAs."""
    from iron_batch.layers.linear import Linear

    kernels = cpu.select(torch.device("cpu"), torch.bfloat16, switches.read(
        {"IRON_BATCH_CPU_GEMV_ROWS": str(gemv_rows), "IRON_BATCH_CPU_GEMM": gemm}))
    if not kernels.gemv:
        pytest.fail("the Rust GEMV is not available in this build")
    native = cpu.bf16_gemm_is_native()
    f32 = {"bf16": False, "f32": True}.get(
        gemm, cpu.bf16_dot_is_no_faster() if native else gemv_rows > 0)
    assert kernels.f32_gemm == f32
    if not native:
        assert kernels.wide_gemv_rows == gemv_rows
    else:
        assert kernels.wide_gemv_rows == (cpu.F32_GEMM_GEMV_ROWS if f32 else 0)
    g = torch.Generator().manual_seed(gemv_rows)
    w = torch.randn(700, 320, generator=g).bfloat16()
    b = torch.randn(700, generator=g).bfloat16()
    proj = Linear(w, b, kernels=kernels)
    if prepacked:
        proj.prepack()
        # An f32 copy where many rows multiply in f32, else (where oneDNN packs) none.
        assert (proj.wide is not None) == f32
        if f32:
            assert proj.wide.dtype == torch.float32 and torch.equal(proj.wide, w.float())
    x = torch.randn(260, 320, generator=g).bfloat16()
    alone = torch.cat([proj(x[r:r + 1]) for r in range(x.shape[0])])
    gemv_max = max(kernels.wide_gemv_rows, 8)
    for rows in (1, 8, 9, 32, 33, 192, 193, 260):
        got = proj(x[:rows])
        want = x[:rows].double() @ w.double().T + b.double()
        torch.testing.assert_close(got.double(), want, rtol=2**-8, atol=2e-2)
        if rows <= gemv_max:
            assert torch.equal(got, alone[:rows]), f"{rows} rows: a row differs from itself alone"
        elif f32:
            # f32 products of the bf16 values, summed in f32, rounded once to bf16.
            wide = torch.nn.functional.linear(x[:rows].float(), w.float(), b.float())
            torch.testing.assert_close(got, wide.bfloat16(), rtol=2**-7, atol=0)


def test_prepacked_linear_equals_f_linear() -> None:
    g = torch.Generator().manual_seed(5)
    w = torch.randn(1728, 576, generator=g).bfloat16()
    b = torch.randn(1728, generator=g).bfloat16()
    packed = cpu_fused.prepack(w)
    if not _onednn_packs_bf16():
        # oneDNN refuses the reorder on such CPUs; the model then keeps plain weights.
        assert packed is None
        pytest.skip("this CPU has neither AVX-512 (bw, vl, dq) nor AVX-NE-CONVERT, which "
                    "oneDNN's packed bf16 layout needs")
    assert packed is not None
    for rows in (3, 64, 700):
        x = torch.randn(rows, 576, generator=g).bfloat16()
        assert torch.equal(cpu_fused.packed_linear(x, packed, b), F.linear(x, w, b))



def _onednn_packs_bf16() -> bool:
    """Whether this CPU has what oneDNN's bf16 weight reorder asks for (read from
    /proc/cpuinfo, not from torch)."""
    info = cpu.cpu_info()
    if info is None:
        return True
    flags = info[1]
    return {"avx512bw", "avx512vl", "avx512dq"} <= flags or "avx_ne_convert" in flags


@pytest.mark.parametrize("gemm", ["bf16", "f32"])
def test_a_large_head_packed_in_parts_gives_its_logits_step_after_step(gemm: str) -> None:
    """A head of a large vocabulary (packed in parts, the last one short) gives the logits
    of its whole matrix at every row count: the GEMV's rows, steps whose logits go to a
    fresh block, steps that reuse the head's buffer (again and again, fewer rows after
    more), and a prompt scored at every position (more rows than the buffer keeps). Where
    this torch cannot pack the head, it is the whole matrix's logits as they were."""
    from iron_batch.layers import embedding
    from iron_batch.layers.linear import Linear

    kernels = cpu.select(torch.device("cpu"), torch.bfloat16,
                         switches.read({"IRON_BATCH_CPU_GEMM": gemm}))
    g = torch.Generator().manual_seed(11)
    vocab = embedding.SLABBED_VOCAB + 4000
    w = torch.randn(vocab, 64, generator=g).bfloat16()
    head = embedding.LMHead(Linear(w, None, kernels=kernels), vocab)
    head.prepack()
    # oneDNN packs bf16 weights where the CPU computes in bf16; where many rows multiply
    # in f32 the parts are f32 copies.
    if cpu.bf16_gemm_is_native() or kernels.f32_gemm:
        assert len(head.slabs) == -(-vocab // embedding.SLAB_ROWS)
        assert all(p.dtype == (torch.float32 if kernels.f32_gemm else torch.bfloat16)
                   for _, p in head.slabs)
    buffered = []
    for rows in (1, 8, 9, 40, 200, 120, 200, embedding.BUFFER_MAX_ROWS + 1):
        x = torch.randn(rows, 64, generator=g).bfloat16()
        got = head(x)
        assert got.dtype == torch.float32 and got.shape == (rows, vocab)
        torch.testing.assert_close(got, F.linear(x, w).float(), rtol=2**-7, atol=1e-2)
        # Logits of HEAP_BLOCK bytes or more, up to BUFFER_MAX_ROWS rows, share one buffer.
        if rows * vocab * 4 >= embedding.HEAP_BLOCK and rows <= embedding.BUFFER_MAX_ROWS:
            buffered.append(got.data_ptr())
    if head.slabs:
        assert len(buffered) == 3 and len(set(buffered)) == 1
