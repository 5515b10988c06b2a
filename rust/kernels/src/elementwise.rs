//! Fused elementwise steps of a decoder layer. Each replaces a chain of small torch ops
//! (which on a CPU cost more in dispatch than in arithmetic at decode batch sizes) and
//! rounds exactly where that torch chain rounds, so bf16 results match it bit for bit.

use crate::attention::{KernelError, Parallel};
use crate::element::Element;

/// Defines `$name`, which runs `$body` (a plain-Rust function marked `#[inline(always)]`)
/// compiled for AVX-512 when the CPU has it, so that its plain loops vectorize 16 wide,
/// and as built for the baseline target otherwise.
macro_rules! simd_dispatch {
    ($name:ident, $body:ident, ($($arg:ident: $ty:ty),*)) => {
        #[allow(clippy::too_many_arguments)]
        fn $name<T: Element>($($arg: $ty),*) {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
                #[allow(clippy::too_many_arguments)]
                unsafe fn wide<T: Element>($($arg: $ty),*) {
                    $body::<T>($($arg),*)
                }
                if std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx512bw")
                    && std::arch::is_x86_feature_detected!("avx512vl")
                {
                    // SAFETY: the CPU has the features `wide` is compiled for.
                    unsafe { wide::<T>($($arg),*) };
                    return;
                }
            }
            $body::<T>($($arg),*)
        }
    };
}

simd_dispatch!(norm_rows_dispatch, norm_rows, (
    out: &mut [T], res: &mut [T], delta: Option<&[T]>, weight: &[T], eps: f32
));
simd_dispatch!(norm_rows_once_dispatch, norm_rows_once, (
    out: &mut [T], res: &mut [T], delta: Option<&[T]>, weight: &[T], eps: f32
));

/// Rows per part below which splitting a call across threads costs more than it saves.
const MIN_ELEMENTS_PER_PART: usize = 32 * 1024;

pub(crate) fn split_rows(rows: usize, dim: usize, threads: usize) -> usize {
    (rows * dim / MIN_ELEMENTS_PER_PART)
        .clamp(1, threads.max(1))
        .min(rows.max(1))
}

/// Run `f(first_row, last_row)` over `rows` split into `parts` contiguous ranges.
pub(crate) fn for_row_ranges(
    rows: usize,
    parts: usize,
    parallel: &dyn Parallel,
    f: &(dyn Fn(usize, usize) + Sync),
) {
    if parts <= 1 {
        f(0, rows);
        return;
    }
    parallel.run(parts, &|p| f(rows * p / parts, rows * (p + 1) / parts));
}

/// `residual += delta` (when given), then `out = weight * rms_norm(residual)`.
///
/// In torch terms (x of dtype T): `x = x + delta`; `y = x.float()`;
/// `y = y * rsqrt(mean(y * y) + eps)`; `out = weight * y.to(T)`: the sum and the
/// normalized value are rounded to T, the statistics are f32.
#[allow(clippy::too_many_arguments)]
pub fn add_rms_norm<T: Element>(
    out: &mut [T],
    residual: &mut [T],
    delta: Option<&[T]>,
    weight: &[T],
    rows: usize,
    eps: f32,
    threads: usize,
    parallel: &dyn Parallel,
) -> Result<(), KernelError> {
    add_rms_norm_with(
        out, residual, delta, weight, rows, eps, false, threads, parallel,
    )
}

/// [`add_rms_norm`] rounded once, as Gemma 4's norm is: `y = x.float()`;
/// `out = (y * rsqrt(mean(y * y) + eps) * weight.float()).to(T)`: the sum is rounded to T,
/// the normalized value is not (the weight product is f32 too).
#[allow(clippy::too_many_arguments)]
pub fn add_rms_norm_once<T: Element>(
    out: &mut [T],
    residual: &mut [T],
    delta: Option<&[T]>,
    weight: &[T],
    rows: usize,
    eps: f32,
    threads: usize,
    parallel: &dyn Parallel,
) -> Result<(), KernelError> {
    add_rms_norm_with(
        out, residual, delta, weight, rows, eps, true, threads, parallel,
    )
}

/// [`add_rms_norm`] (`once` false) or [`add_rms_norm_once`] (`once` true).
#[allow(clippy::too_many_arguments)]
pub fn add_rms_norm_with<T: Element>(
    out: &mut [T],
    residual: &mut [T],
    delta: Option<&[T]>,
    weight: &[T],
    rows: usize,
    eps: f32,
    once: bool,
    threads: usize,
    parallel: &dyn Parallel,
) -> Result<(), KernelError> {
    let dim = weight.len();
    if dim == 0 || out.len() != rows * dim || residual.len() != rows * dim {
        return Err(KernelError(format!(
            "rms_norm: out {} / input {} elements for {rows} rows of {dim}",
            out.len(),
            residual.len()
        )));
    }
    if delta.is_some_and(|d| d.len() != rows * dim) {
        return Err(KernelError("rms_norm: delta must match the input".into()));
    }
    let out_addr = out.as_mut_ptr() as usize;
    let res_addr = residual.as_mut_ptr() as usize;
    let parts = split_rows(rows, dim, threads);
    for_row_ranges(rows, parts, parallel, &|lo, hi| {
        // SAFETY: row ranges are disjoint, so these sub-slices are too.
        let (out, res) = unsafe {
            (
                std::slice::from_raw_parts_mut((out_addr as *mut T).add(lo * dim), (hi - lo) * dim),
                std::slice::from_raw_parts_mut((res_addr as *mut T).add(lo * dim), (hi - lo) * dim),
            )
        };
        let delta = delta.map(|d| &d[lo * dim..hi * dim]);
        if once {
            norm_rows_once_dispatch(out, res, delta, weight, eps);
        } else {
            norm_rows_dispatch(out, res, delta, weight, eps);
        }
    });
    Ok(())
}

#[inline(always)]
fn norm_rows<T: Element>(
    out: &mut [T],
    res: &mut [T],
    delta: Option<&[T]>,
    weight: &[T],
    eps: f32,
) {
    norm_rows_as::<T, false>(out, res, delta, weight, eps)
}

#[inline(always)]
fn norm_rows_once<T: Element>(
    out: &mut [T],
    res: &mut [T],
    delta: Option<&[T]>,
    weight: &[T],
    eps: f32,
) {
    norm_rows_as::<T, true>(out, res, delta, weight, eps)
}

/// The rows of [`add_rms_norm`] (`ONCE` false) or of [`add_rms_norm_once`].
#[inline(always)]
fn norm_rows_as<T: Element, const ONCE: bool>(
    out: &mut [T],
    res: &mut [T],
    delta: Option<&[T]>,
    weight: &[T],
    eps: f32,
) {
    let dim = weight.len();
    let mut row = vec![0f32; dim];
    for (r, (o, x)) in out
        .chunks_exact_mut(dim)
        .zip(res.chunks_exact_mut(dim))
        .enumerate()
    {
        match delta {
            Some(d) => {
                for ((v, x), d) in row
                    .iter_mut()
                    .zip(x.iter_mut())
                    .zip(&d[r * dim..(r + 1) * dim])
                {
                    *x = T::from_f32(x.to_f32() + d.to_f32());
                    *v = x.to_f32();
                }
            }
            None => {
                for (v, x) in row.iter_mut().zip(x.iter()) {
                    *v = x.to_f32();
                }
            }
        }
        let mut lanes = [0f32; 16];
        let whole = dim / 16 * 16;
        for chunk in row[..whole].chunks_exact(16) {
            for i in 0..16 {
                lanes[i] += chunk[i] * chunk[i];
            }
        }
        let mut sum: f32 = lanes.iter().sum();
        for v in &row[whole..] {
            sum += v * v;
        }
        let inv = 1.0 / (sum / dim as f32 + eps).sqrt();
        if ONCE {
            for ((o, v), w) in o.iter_mut().zip(&row).zip(weight) {
                *o = T::from_f32(v * inv * w.to_f32());
            }
        } else {
            for ((o, v), w) in o.iter_mut().zip(&row).zip(weight) {
                let normed = T::from_f32(v * inv).to_f32();
                *o = T::from_f32(w.to_f32() * normed);
            }
        }
    }
}

/// One head's half-split rotation over its first `rd` dims (see [`rope_store_kv`]).
#[inline(always)]
fn rotate_head<T: Element>(dst: &mut [T], x: &[T], c: &[T], s: &[T], rd: usize) {
    let half = rd / 2;
    // Straight loops over the two halves (no per-element branch), so they vectorize:
    // first half x1 * cos - x2 * sin, second half x2 * cos + x1 * sin; then the dims past
    // `rotary_dim` (none unless partial) as they are.
    let round = |v: f32| T::from_f32(v).to_f32();
    let (x, pass) = x.split_at(rd);
    let (dst, dst_pass) = dst.split_at_mut(rd);
    dst_pass.copy_from_slice(pass);
    let (x1, x2) = x.split_at(half);
    let (c1, c2) = c.split_at(half);
    let (s1, s2) = s.split_at(half);
    let (d1, d2) = dst.split_at_mut(half);
    for i in 0..half {
        let a = round(x1[i].to_f32() * c1[i].to_f32());
        let b = round(-x2[i].to_f32() * s1[i].to_f32());
        d1[i] = T::from_f32(a + b);
    }
    for i in 0..half {
        let a = round(x2[i].to_f32() * c2[i].to_f32());
        let b = round(x1[i].to_f32() * s2[i].to_f32());
        d2[i] = T::from_f32(a + b);
    }
}

/// The query half of [`rope_store_kv`] alone: `q` `[tokens, heads * head_dim]` rotated into
/// `q_out` (a layer that reads another layer's K/V stores none of its own).
#[allow(clippy::too_many_arguments)]
pub fn rope_q<T: Element>(
    q_out: &mut [T],
    q: &[T],
    cos: &[T],
    sin: &[T],
    tokens: usize,
    heads: usize,
    head_dim: usize,
    rotary_dim: usize,
) -> Result<(), KernelError> {
    let width = heads * head_dim;
    let ok = head_dim > 0
        && rotary_dim.is_multiple_of(2)
        && rotary_dim <= head_dim
        && q.len() == tokens * width
        && q_out.len() == tokens * width
        && cos.len() == tokens * rotary_dim
        && sin.len() == tokens * rotary_dim;
    if !ok {
        return Err(KernelError("rope_q: inconsistent sizes".into()));
    }
    rope_q_dispatch(q_out, q, cos, sin, tokens, width, head_dim, rotary_dim);
    Ok(())
}

simd_dispatch!(rope_q_dispatch, rope_q_rows, (
    q_out: &mut [T], q: &[T], cos: &[T], sin: &[T], tokens: usize, width: usize,
    head_dim: usize, rotary_dim: usize
));

#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn rope_q_rows<T: Element>(
    q_out: &mut [T],
    q: &[T],
    cos: &[T],
    sin: &[T],
    tokens: usize,
    width: usize,
    head_dim: usize,
    rotary_dim: usize,
) {
    let rd = rotary_dim;
    for t in 0..tokens {
        let c = &cos[t * rd..(t + 1) * rd];
        let s = &sin[t * rd..(t + 1) * rd];
        for (dst, x) in q_out[t * width..(t + 1) * width]
            .chunks_exact_mut(head_dim)
            .zip(q[t * width..(t + 1) * width].chunks_exact(head_dim))
        {
            rotate_head(dst, x, c, s, rd);
        }
    }
}

/// Rotary embedding of q and k, and the step's K/V stored at their cache slots.
///
/// `qkv` is the fused projection `[tokens, (heads + 2 * kv_heads) * head_dim]`; `cos`/`sin`
/// are `[tokens, rotary_dim]` in T (torch's `rope_cos_sin`). Writes the rotated queries to
/// `q_out` `[tokens, heads * head_dim]`, and the rotated keys and the values to row
/// `slots[t]` of `k_cache` / `v_cache` (`[slots, kv_heads * head_dim]`). Half-split
/// layout over the first `rotary_dim` dims of each head: `x * cos + cat(-x2, x1) * sin`,
/// each product and the sum rounded to T; the other dims pass through (partial rotary, as
/// Phi-3's; `rotary_dim == head_dim`: all of them; 0: none, and `cos`/`sin` are empty).
#[allow(clippy::too_many_arguments)]
pub fn rope_store_kv<T: Element>(
    q_out: &mut [T],
    k_cache: &mut [T],
    v_cache: &mut [T],
    qkv: &[T],
    cos: &[T],
    sin: &[T],
    slots: &[i64],
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    rotary_dim: usize,
) -> Result<(), KernelError> {
    let tokens = slots.len();
    let width = (heads + 2 * kv_heads) * head_dim;
    let kv_row = kv_heads * head_dim;
    let ok = rotary_dim.is_multiple_of(2)
        && rotary_dim <= head_dim
        && qkv.len() == tokens * width
        && q_out.len() == tokens * heads * head_dim
        && cos.len() == tokens * rotary_dim
        && sin.len() == tokens * rotary_dim
        && k_cache.len() == v_cache.len()
        && k_cache.len().is_multiple_of(kv_row.max(1));
    if !ok {
        return Err(KernelError("rope_store_kv: inconsistent sizes".into()));
    }
    let num_slots = k_cache.len() / kv_row.max(1);
    if let Some(bad) = slots.iter().find(|&&s| s < 0 || s as usize >= num_slots) {
        return Err(KernelError(format!(
            "rope_store_kv: slot {bad} outside 0..{num_slots}"
        )));
    }
    rope_tokens_dispatch(
        q_out, k_cache, v_cache, qkv, cos, sin, slots, heads, kv_heads, head_dim, rotary_dim,
    );
    Ok(())
}

simd_dispatch!(rope_tokens_dispatch, rope_tokens, (
    q_out: &mut [T], k_cache: &mut [T], v_cache: &mut [T], qkv: &[T], cos: &[T], sin: &[T],
    slots: &[i64], heads: usize, kv_heads: usize, head_dim: usize, rotary_dim: usize
));

#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn rope_tokens<T: Element>(
    q_out: &mut [T],
    k_cache: &mut [T],
    v_cache: &mut [T],
    qkv: &[T],
    cos: &[T],
    sin: &[T],
    slots: &[i64],
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    rotary_dim: usize,
) {
    let tokens = slots.len();
    let width = (heads + 2 * kv_heads) * head_dim;
    let kv_row = kv_heads * head_dim;
    let rd = rotary_dim;
    let rotate = |dst: &mut [T], x: &[T], c: &[T], s: &[T]| rotate_head(dst, x, c, s, rd);
    for t in 0..tokens {
        let row = &qkv[t * width..(t + 1) * width];
        let c = &cos[t * rd..(t + 1) * rd];
        let s = &sin[t * rd..(t + 1) * rd];
        let q_row = &mut q_out[t * heads * head_dim..(t + 1) * heads * head_dim];
        for h in 0..heads {
            let x = &row[h * head_dim..(h + 1) * head_dim];
            rotate(&mut q_row[h * head_dim..(h + 1) * head_dim], x, c, s);
        }
        let slot = slots[t] as usize;
        let k_dst = &mut k_cache[slot * kv_row..(slot + 1) * kv_row];
        for h in 0..kv_heads {
            let x = &row[(heads + h) * head_dim..(heads + h + 1) * head_dim];
            rotate(&mut k_dst[h * head_dim..(h + 1) * head_dim], x, c, s);
        }
        let v_src = &row[(heads + kv_heads) * head_dim..];
        v_cache[slot * kv_row..(slot + 1) * kv_row].copy_from_slice(v_src);
    }
}
