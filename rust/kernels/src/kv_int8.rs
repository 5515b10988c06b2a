//! The int8 KV cache: each (token, kv head) row of K or V stored as `head_dim` int8 values
//! and the f32 scale they are multiplied by, so a token takes about half the bytes of bf16.
//!
//! A cache is `[num_blocks, block_size, kv_heads, head_dim + 4]` bytes: the row's values,
//! then its scale's four bytes (little-endian). Keeping the scale beside its values leaves
//! one tensor per layer, as the float caches are, and a row is read in one pass.
//!
//! Quantization is symmetric, per row: `scale = max|x| / 127`, `q = round(x / scale)`
//! (ties to even), in f32: the torch route (`attention/paged.py`) computes the same
//! bytes. The attention kernel reads the rows in place: each score is `k_scale * (q . k)`
//! and each value row joins the sum as `p * v_scale * v`, in f32.

use crate::attention::{axpy, dot, exp_nonpositive, soft_cap, DecodeShape, KernelError, Parallel};
use crate::element::Element;
use crate::elementwise::rope_store_kv;

/// Bytes after a row's values: its f32 scale.
pub const INT8_SCALE_BYTES: usize = 4;

/// Bytes of one quantized row of `head_dim` values.
pub const fn int8_row_len(head_dim: usize) -> usize {
    head_dim + INT8_SCALE_BYTES
}

fn err(what: String) -> KernelError {
    KernelError(what)
}

/// `x` quantized into `row` (`x.len() + 4` bytes: the values, then the scale).
#[inline]
pub fn quantize_int8_row(row: &mut [i8], x: &[f32]) {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let scale = amax / 127.0;
    // A zero row (scale 0) divides by the smallest normal: every value stays 0.
    let d = scale.max(f32::MIN_POSITIVE);
    let (values, tail) = row.split_at_mut(x.len());
    for (q, &v) in values.iter_mut().zip(x) {
        *q = (v / d).round_ties_even().clamp(-127.0, 127.0) as i8;
    }
    for (b, s) in tail.iter_mut().zip(scale.to_le_bytes()) {
        *b = s as i8;
    }
}

/// The scale of a quantized row.
#[inline(always)]
pub fn int8_row_scale(row: &[i8]) -> f32 {
    let hd = row.len() - INT8_SCALE_BYTES;
    let b = |i: usize| row[hd + i] as u8;
    f32::from_le_bytes([b(0), b(1), b(2), b(3)])
}

/// A quantized row back to f32 values (`dst.len() + 4 == row.len()`).
pub fn dequantize_int8_row(dst: &mut [f32], row: &[i8]) {
    let scale = int8_row_scale(row);
    for (d, &q) in dst.iter_mut().zip(row) {
        *d = f32::from(q) * scale;
    }
}

/// Stores `k` and `v` (`[tokens, kv_heads * head_dim]`) at row `slots[t]` of the int8
/// caches (`[slots, kv_heads, head_dim + 4]` bytes each).
pub fn store_kv_int8<T: Element>(
    k_cache: &mut [i8],
    v_cache: &mut [i8],
    k: &[T],
    v: &[T],
    slots: &[i64],
    kv_heads: usize,
    head_dim: usize,
) -> Result<(), KernelError> {
    let kv_row = kv_heads * head_dim;
    let q_row = kv_heads * int8_row_len(head_dim);
    let tokens = slots.len();
    if kv_row == 0
        || k.len() != tokens * kv_row
        || v.len() != tokens * kv_row
        || k_cache.len() != v_cache.len()
        || !k_cache.len().is_multiple_of(q_row)
    {
        return Err(err("store_kv_int8: inconsistent sizes".into()));
    }
    let num_slots = k_cache.len() / q_row;
    if let Some(bad) = slots.iter().find(|&&s| s < 0 || s as usize >= num_slots) {
        return Err(err(format!(
            "store_kv_int8: slot {bad} outside 0..{num_slots}"
        )));
    }
    let mut row = vec![0f32; head_dim];
    for (t, &slot) in slots.iter().enumerate() {
        let slot = slot as usize;
        for (src, cache) in [(k, &mut *k_cache), (v, &mut *v_cache)] {
            let dst = &mut cache[slot * q_row..(slot + 1) * q_row];
            let src = &src[t * kv_row..(t + 1) * kv_row];
            for (d, s) in dst
                .chunks_exact_mut(int8_row_len(head_dim))
                .zip(src.chunks_exact(head_dim))
            {
                for (r, x) in row.iter_mut().zip(s) {
                    *r = x.to_f32();
                }
                quantize_int8_row(d, &row);
            }
        }
    }
    Ok(())
}

/// [`rope_store_kv`] into int8 caches: the rotated keys are rounded to `T` as the float
/// cache would hold them, then quantized; the values likewise.
#[allow(clippy::too_many_arguments)]
pub fn rope_store_kv_int8<T: Element>(
    q_out: &mut [T],
    k_cache: &mut [i8],
    v_cache: &mut [i8],
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
    let kv_row = kv_heads * head_dim;
    let mut k = vec![T::from_f32(0.0); tokens * kv_row];
    let mut v = vec![T::from_f32(0.0); tokens * kv_row];
    let rows: Vec<i64> = (0..tokens as i64).collect();
    rope_store_kv(
        q_out, &mut k, &mut v, qkv, cos, sin, &rows, heads, kv_heads, head_dim, rotary_dim,
    )?;
    store_kv_int8(k_cache, v_cache, &k, &v, slots, kv_heads, head_dim)
}

/// [`crate::paged_decode_attention`] over int8 caches (`[num_blocks, block_size, kv_heads,
/// head_dim + 4]` bytes each); `q` and `out` as there.
#[allow(clippy::too_many_arguments)]
pub fn paged_decode_attention_int8<T: Element>(
    out: &mut [T],
    q: &[T],
    k_cache: &[i8],
    v_cache: &[i8],
    block_tables: &[i32],
    seq_lens: &[i32],
    shape: &DecodeShape,
    scale: f32,
    softcap: f32,
    threads: usize,
    parallel: &dyn Parallel,
) -> Result<(), KernelError> {
    let s = *shape;
    let fail = |what: String| Err(err(format!("paged_decode_attention_int8: {what}")));
    if !(softcap.is_finite() && softcap >= 0.0) {
        return fail(format!("softcap {softcap} must be 0 (off) or positive"));
    }
    if s.num_kv_heads == 0 || s.head_dim == 0 || s.block_size == 0 || s.num_heads == 0 {
        return fail("heads, kv heads, head_dim and block_size must be positive".into());
    }
    if !s.num_heads.is_multiple_of(s.num_kv_heads) {
        return fail(format!(
            "{} heads are not a multiple of {} kv heads",
            s.num_heads, s.num_kv_heads
        ));
    }
    let q_len = s.num_seqs * s.num_heads * s.head_dim;
    if q.len() != q_len || out.len() != q_len {
        return fail(format!("q / out must have {q_len} elements"));
    }
    let cache_len = s.num_blocks * s.block_size * s.num_kv_heads * int8_row_len(s.head_dim);
    if k_cache.len() != cache_len || v_cache.len() != cache_len {
        return fail(format!("caches must have {cache_len} bytes"));
    }
    if block_tables.len() != s.num_seqs * s.max_blocks || seq_lens.len() != s.num_seqs {
        return fail("block_tables must be [seqs, max_blocks] and seq_lens [seqs]".into());
    }
    for (i, &len) in seq_lens.iter().enumerate() {
        if len <= 0 || len as usize > s.max_blocks * s.block_size {
            return fail(format!("sequence {i}: length {len} out of range"));
        }
        let used = (len as usize).div_ceil(s.block_size);
        let row = &block_tables[i * s.max_blocks..i * s.max_blocks + used];
        if let Some(&bad) = row.iter().find(|&&b| b < 0 || b as usize >= s.num_blocks) {
            return fail(format!(
                "sequence {i}: block id {bad} outside the cache's {} blocks",
                s.num_blocks
            ));
        }
    }
    if s.num_seqs == 0 {
        return Ok(());
    }
    let job = Job {
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        shape: s,
        scale,
        softcap,
    };
    let group = s.num_heads / s.num_kv_heads;
    let per_item = group * s.head_dim;
    let items = s.num_seqs * s.num_kv_heads;
    let cost = |item: usize| job.span(item / s.num_kv_heads).1 as u64 + 8;
    let total: u64 = (0..items).map(cost).sum();
    // As the float kernel: a part is worth a thread from ~32k scores (512 with a team
    // already spinning).
    let per_part = if parallel.waiting() { 512 } else { 32_768 };
    let wanted = ((total * group as u64) / per_part).max(1) as usize;
    let parts = threads.clamp(1, items).min(wanted);
    if parts == 1 {
        run_items(&job, 0, out);
        return Ok(());
    }
    let mut bounds = vec![0usize];
    let mut acc = 0u64;
    for item in 0..items {
        acc += cost(item);
        if acc * parts as u64 >= total * bounds.len() as u64 && bounds.len() < parts {
            bounds.push(item + 1);
        }
    }
    bounds.push(items);
    bounds.dedup();
    let out_addr = out.as_mut_ptr() as usize;
    let task = |part: usize| {
        let (lo, hi) = (bounds[part], bounds[part + 1]);
        // SAFETY: parts cover disjoint item ranges, so their output ranges are disjoint
        // sub-slices of `out`, which outlives the call.
        let mine = unsafe {
            std::slice::from_raw_parts_mut(
                (out_addr as *mut T).add(lo * per_item),
                (hi - lo) * per_item,
            )
        };
        run_items(&job, lo, mine);
    };
    parallel.run(bounds.len() - 1, &task);
    Ok(())
}

struct Job<'a, T> {
    q: &'a [T],
    k_cache: &'a [i8],
    v_cache: &'a [i8],
    block_tables: &'a [i32],
    seq_lens: &'a [i32],
    shape: DecodeShape,
    scale: f32,
    softcap: f32,
}

impl<T> Job<'_, T> {
    /// (first attended position, number of attended positions) of sequence `seq`.
    fn span(&self, seq: usize) -> (usize, usize) {
        let len = self.seq_lens[seq] as usize;
        let w = self.shape.sliding_window;
        let start = if w > 0 && len > w { len - w } else { 0 };
        (start, len - start)
    }

    /// Byte offset of the row of each attended position of `seq` for kv head `head`.
    fn rows(&self, seq: usize, head: usize) -> impl Iterator<Item = usize> + '_ {
        let s = self.shape;
        let (start, n) = self.span(seq);
        let table = &self.block_tables[seq * s.max_blocks..(seq + 1) * s.max_blocks];
        (start..start + n).map(move |p| {
            let block = table[p / s.block_size] as usize;
            ((block * s.block_size + p % s.block_size) * s.num_kv_heads + head)
                * int8_row_len(s.head_dim)
        })
    }
}

fn run_items<T: Element>(job: &Job<'_, T>, first: usize, out: &mut [T]) {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx2,fma")]
        unsafe fn wide<T: Element>(job: &Job<'_, T>, first: usize, out: &mut [T]) {
            run_items_generic::<T, true>(job, first, out)
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            // SAFETY: the CPU has the features `wide` is compiled for.
            unsafe { wide(job, first, out) };
            return;
        }
    }
    run_items_generic::<T, false>(job, first, out)
}

#[inline(always)]
fn widen(dst: &mut [f32], src: &[i8]) {
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = f32::from(s);
    }
}

#[inline(always)]
fn run_items_generic<T: Element, const FMA: bool>(job: &Job<'_, T>, first: usize, out: &mut [T]) {
    let s = job.shape;
    let hd = s.head_dim;
    let rl = int8_row_len(hd);
    let group = s.num_heads / s.num_kv_heads;
    let mut query = vec![0f32; group * hd];
    let mut row = vec![0f32; hd];
    let mut acc = vec![0f32; group * hd];
    let mut scores: Vec<f32> = Vec::new();
    let mut inv_sum = vec![0f32; group];
    for (k, item_out) in out.chunks_exact_mut(group * hd).enumerate() {
        let item = first + k;
        let (seq, head) = (item / s.num_kv_heads, item % s.num_kv_heads);
        let n = job.span(seq).1;
        let q_base = (seq * s.num_heads + head * group) * hd;
        for (d, x) in query.iter_mut().zip(&job.q[q_base..q_base + group * hd]) {
            *d = x.to_f32() * job.scale;
        }
        scores.clear();
        scores.resize(group * n, 0.0);
        for (j, at) in job.rows(seq, head).enumerate() {
            let r = &job.k_cache[at..at + rl];
            widen(&mut row, &r[..hd]);
            let ks = int8_row_scale(r);
            for (g, q) in query.chunks_exact(hd).enumerate() {
                scores[g * n + j] = ks * dot::<FMA>(q, &row);
            }
        }
        if job.softcap > 0.0 {
            soft_cap(&mut scores, job.softcap);
        }
        for (g, sc) in scores.chunks_exact_mut(n).enumerate() {
            let max = sc.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0.0f32;
            for x in sc.iter_mut() {
                *x = exp_nonpositive(*x - max);
                sum += *x;
            }
            inv_sum[g] = 1.0 / sum;
        }
        acc.fill(0.0);
        for (j, at) in job.rows(seq, head).enumerate() {
            let r = &job.v_cache[at..at + rl];
            widen(&mut row, &r[..hd]);
            let vs = int8_row_scale(r);
            for (g, a) in acc.chunks_exact_mut(hd).enumerate() {
                axpy::<FMA>(a, scores[g * n + j] * vs, &row);
            }
        }
        for (g, (o, a)) in item_out
            .chunks_exact_mut(hd)
            .zip(acc.chunks_exact(hd))
            .enumerate()
        {
            let inv = inv_sum[g];
            for (o, &a) in o.iter_mut().zip(a) {
                *o = T::from_f32(a * inv);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_row_round_trips_within_half_a_step() {
        let x: Vec<f32> = (0..64)
            .map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.13)
            .collect();
        let mut row = vec![0i8; int8_row_len(64)];
        quantize_int8_row(&mut row, &x);
        let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        assert_eq!(int8_row_scale(&row), amax / 127.0);
        let mut back = vec![0f32; 64];
        dequantize_int8_row(&mut back, &row);
        for (a, b) in x.iter().zip(&back) {
            assert!((a - b).abs() <= amax / 127.0 / 2.0 * 1.0001, "{a} vs {b}");
        }
        // The largest magnitude maps to +-127 exactly.
        assert!(row[..64].iter().any(|&q| q == 127 || q == -127));
    }

    #[test]
    fn a_zero_row_stays_zero() {
        let mut row = vec![5i8; int8_row_len(8)];
        quantize_int8_row(&mut row, &[0.0; 8]);
        assert!(row[..8].iter().all(|&q| q == 0));
        assert_eq!(int8_row_scale(&row), 0.0);
    }
}
