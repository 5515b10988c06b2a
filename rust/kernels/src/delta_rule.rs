//! The gated delta rule of Gated DeltaNet linear attention (Qwen3.5's linear layers) and
//! its short causal convolution, over states kept per sequence in state slots: the delta
//! matrices in f32 or bf16 (the caller's [`Element`]; arithmetic is f32 either way, a bf16
//! state is rounded once per token in decode and once per block in a chunk), the
//! convolution windows in f32.
//!
//! Per value head, with the state `S` a `[dk, dv]` matrix, one token does
//! `S <- exp(g) S`, `u = beta (v - S^T k)`, `S <- S + k u^T`, `o = S^T q`.
//!
//! - [`delta_rule_decode`]: one token for each of a batch of sequences, each head's state
//!   updated in place in its slot. The state is read once for `S^T k` and `S^T q` together
//!   (`o = exp(g) S^T q + (k . q) u` needs no second read), then written once.
//! - [`delta_rule_chunk`]: the tokens of one sequence's prompt chunk, in blocks: per block
//!   the state is read once (`S^T k_t`, `S^T q_t` for every token of the block), the block's
//!   `u` come from a forward substitution over its `[n, n]` key products (the WY form), and
//!   the state is written once, so the work on the state is per block, not per token.
//! - [`causal_conv_decode`] / [`causal_conv_chunk`]: the depthwise convolution over each
//!   channel's last `K` inputs (the `K - 1` before the step kept in the sequence's window),
//!   followed by SiLU, rounded where torch's conv1d and silu round.
//!
//! Heads (decode: sequence x head pairs) are split across the caller's threads; which thread
//! takes which head never changes a value. Each kernel's loops are compiled three times: for
//! AVX-512, for AVX2 with FMA, and for the baseline target, the widest the CPU has chosen at
//! run time.

use crate::attention::{KernelError, Parallel};
use crate::element::Element;

/// Tokens per block of [`delta_rule_chunk`].
pub const DELTA_CHUNK: usize = 64;

/// Shapes of a delta-rule call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeltaShape {
    /// Value heads (q and k already repeated to one per value head).
    pub heads: usize,
    pub key_dim: usize,
    pub value_dim: usize,
}

impl DeltaShape {
    fn state(&self) -> usize {
        self.key_dim * self.value_dim
    }
}

macro_rules! dispatch {
    ($name:ident<$g:ident>, $body:ident, ($($arg:ident: $ty:ty),*)) => {
        #[allow(clippy::too_many_arguments)]
        fn $name<$g: Element>($($arg: $ty),*) {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
                #[allow(clippy::too_many_arguments)]
                unsafe fn wide<$g: Element>($($arg: $ty),*) {
                    $body::<$g>($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                #[allow(clippy::too_many_arguments)]
                unsafe fn avx2<$g: Element>($($arg: $ty),*) {
                    $body::<$g>($($arg),*)
                }
                if std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx512bw")
                    && std::arch::is_x86_feature_detected!("avx512vl")
                {
                    // SAFETY: the CPU has the features `wide` is compiled for.
                    unsafe { wide::<$g>($($arg),*) };
                    return;
                }
                if std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                {
                    // SAFETY: as above, for `avx2`.
                    unsafe { avx2::<$g>($($arg),*) };
                    return;
                }
            }
            $body::<$g>($($arg),*)
        }
    };
}

dispatch!(decode_head<S>, decode_head_body, (
    s: &mut [S], q: &[f32], k: &[f32], v: &[f32], g: f32, beta: f32, out: &mut [f32],
    scratch: &mut [f32]
));

dispatch!(chunk_head<S>, chunk_head_body, (
    s: &mut [S], q: &[f32], k: &[f32], v: &[f32], g: &[f32], beta: &[f32],
    out: &mut [f32], t_len: usize, shape: DeltaShape
));

/// Parts of a call over `items` units: at most `threads`, at least one.
fn parts(items: usize, threads: usize) -> usize {
    threads.max(1).min(items.max(1))
}

/// One token of each of `slots.len()` sequences: `q`, `k` `[B, H, dk]`, `v` `[B, H, dv]`,
/// `g`, `beta` `[B, H]`; `states` is the pool `[slots, H, dk, dv]`, sequence `b`'s state at
/// slot `slots[b]` (distinct), updated in place; `out` `[B, H, dv]`.
#[allow(clippy::too_many_arguments)]
pub fn delta_rule_decode<S: Element>(
    states: &mut [S],
    slots: &[i64],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    out: &mut [f32],
    shape: DeltaShape,
    threads: usize,
    parallel: &dyn Parallel,
) -> Result<(), KernelError> {
    let DeltaShape {
        heads,
        key_dim: dk,
        value_dim: dv,
    } = shape;
    let b = slots.len();
    let per = shape.state() * heads;
    if per == 0 || !states.len().is_multiple_of(per) {
        return Err(KernelError(
            "delta_rule_decode: the state pool is not whole slots".into(),
        ));
    }
    let total = states.len() / per;
    if q.len() != b * heads * dk
        || k.len() != q.len()
        || v.len() != b * heads * dv
        || out.len() != v.len()
        || g.len() != b * heads
        || beta.len() != g.len()
    {
        return Err(KernelError(
            "delta_rule_decode: inputs do not match [B, H, d]".into(),
        ));
    }
    let mut seen = vec![false; total];
    for &slot in slots {
        if slot < 0 || slot as usize >= total || std::mem::replace(&mut seen[slot as usize], true) {
            return Err(KernelError(format!(
                "delta_rule_decode: slot {slot} is outside the {total} slots or repeated"
            )));
        }
    }
    let items = b * heads;
    let n_parts = parts(items, threads);
    let states_addr = states.as_mut_ptr() as usize;
    let out_addr = out.as_mut_ptr() as usize;
    parallel.run(n_parts, &|p| {
        let mut scratch = vec![0.0f32; 2 * dv];
        for item in items * p / n_parts..items * (p + 1) / n_parts {
            let (seq, h) = (item / heads, item % heads);
            let base = (slots[seq] as usize * heads + h) * dk * dv;
            // SAFETY: slots are distinct and items disjoint: each state and output head is
            // written by one part only.
            let (s, o) = unsafe {
                (
                    std::slice::from_raw_parts_mut((states_addr as *mut S).add(base), dk * dv),
                    std::slice::from_raw_parts_mut((out_addr as *mut f32).add(item * dv), dv),
                )
            };
            let kv = item * dk;
            decode_head(
                s,
                &q[kv..kv + dk],
                &k[kv..kv + dk],
                &v[item * dv..(item + 1) * dv],
                g[item],
                beta[item],
                o,
                &mut scratch,
            );
        }
    });
    Ok(())
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn decode_head_body<S: Element>(
    s: &mut [S],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: f32,
    beta: f32,
    out: &mut [f32],
    scratch: &mut [f32],
) {
    let dv = v.len();
    let (sk, sq) = scratch.split_at_mut(dv);
    sk.fill(0.0);
    sq.fill(0.0);
    // One read of the state: S^T k and S^T q.
    for (i, row) in s.chunks_exact(dv).enumerate() {
        let (ki, qi) = (k[i], q[i]);
        for j in 0..dv {
            let x = row[j].to_f32();
            sk[j] += x * ki;
            sq[j] += x * qi;
        }
    }
    let decay = g.exp();
    let kq: f32 = k.iter().zip(q).map(|(a, b)| a * b).sum();
    // u = beta (v - decay S^T k); o = decay S^T q + (k . q) u. `sk` becomes u.
    for j in 0..dv {
        let u = beta * (v[j] - decay * sk[j]);
        sk[j] = u;
        out[j] = decay * sq[j] + kq * u;
    }
    // One write: S = decay S + k u^T.
    for (i, row) in s.chunks_exact_mut(dv).enumerate() {
        let ki = k[i];
        for j in 0..dv {
            row[j] = S::from_f32(decay * row[j].to_f32() + ki * sk[j]);
        }
    }
}

/// The `T` tokens of one sequence: `q`, `k` `[T, H, dk]`, `v` `[T, H, dv]`, `g`, `beta`
/// `[T, H]`; `state` `[H, dk, dv]` holds the state before the first token and is left
/// holding the state after the last; `out` `[T, H, dv]`.
#[allow(clippy::too_many_arguments)]
pub fn delta_rule_chunk<S: Element>(
    state: &mut [S],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    out: &mut [f32],
    shape: DeltaShape,
    threads: usize,
    parallel: &dyn Parallel,
) -> Result<(), KernelError> {
    let DeltaShape {
        heads,
        key_dim: dk,
        value_dim: dv,
    } = shape;
    if heads == 0 || !g.len().is_multiple_of(heads) {
        return Err(KernelError("delta_rule_chunk: g is not [T, heads]".into()));
    }
    let t = g.len() / heads;
    if state.len() != heads * dk * dv
        || q.len() != t * heads * dk
        || k.len() != q.len()
        || v.len() != t * heads * dv
        || out.len() != v.len()
        || beta.len() != g.len()
    {
        return Err(KernelError(
            "delta_rule_chunk: inputs do not match [T, H, d] and the state [H, dk, dv]".into(),
        ));
    }
    if t == 0 {
        return Ok(());
    }
    let n_parts = parts(heads, threads);
    let state_addr = state.as_mut_ptr() as usize;
    let out_addr = out.as_mut_ptr() as usize;
    parallel.run(n_parts, &|p| {
        let mut local = vec![0.0f32; t * dv];
        for h in heads * p / n_parts..heads * (p + 1) / n_parts {
            // SAFETY: each head's state is touched by one part only.
            let s = unsafe {
                std::slice::from_raw_parts_mut((state_addr as *mut S).add(h * dk * dv), dk * dv)
            };
            chunk_head(
                s,
                &q[h * dk..],
                &k[h * dk..],
                &v[h * dv..],
                &g[h..],
                &beta[h..],
                &mut local,
                t,
                shape,
            );
            for (i, row) in local.chunks_exact(dv).enumerate() {
                // SAFETY: row `i` of head `h` is `dv` elements inside `out`, written by
                // this part only.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        row.as_ptr(),
                        (out_addr as *mut f32).add((i * heads + h) * dv),
                        dv,
                    );
                }
            }
        }
    });
    Ok(())
}

/// One head over every block of the chunk. Token `t`'s vectors are at `t * heads * d`
/// from the head's first element; its output goes to row `t` of `out` `[t_len, dv]`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn chunk_head_body<S: Element>(
    s: &mut [S],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    out: &mut [f32],
    t_len: usize,
    shape: DeltaShape,
) {
    let DeltaShape {
        heads,
        key_dim: dk,
        value_dim: dv,
    } = shape;
    let c = DELTA_CHUNK;
    let mut cum = vec![0.0f32; c];
    let mut kk = vec![0.0f32; c * c];
    let mut qk = vec![0.0f32; c * c];
    let mut sk = vec![0.0f32; c * dv];
    let mut sq = vec![0.0f32; c * dv];
    let mut u = vec![0.0f32; c * dv];
    let mut row_sum = vec![0.0f32; dv];
    let key = |t: usize| &k[t * heads * dk..t * heads * dk + dk];
    let query = |t: usize| &q[t * heads * dk..t * heads * dk + dk];
    let mut start = 0;
    while start < t_len {
        let n = c.min(t_len - start);
        // Cumulative log decay within the block.
        let mut acc = 0.0f32;
        for i in 0..n {
            acc += g[(start + i) * heads];
            cum[i] = acc;
        }
        // One read of the state for the whole block: S^T k_t and S^T q_t.
        sk[..n * dv].fill(0.0);
        sq[..n * dv].fill(0.0);
        for (r, row) in s.chunks_exact(dv).enumerate() {
            for i in 0..n {
                let (kr, qr) = (key(start + i)[r], query(start + i)[r]);
                let (a, b) = (&mut sk[i * dv..(i + 1) * dv], &mut sq[i * dv..(i + 1) * dv]);
                for j in 0..dv {
                    let x = row[j].to_f32();
                    a[j] += x * kr;
                    b[j] += x * qr;
                }
            }
        }
        // Key-key and query-key products within the block (i <= t).
        for t in 0..n {
            let (kt, qt) = (key(start + t), query(start + t));
            for i in 0..=t {
                let ki = key(start + i);
                let mut a = 0.0f32;
                let mut b = 0.0f32;
                for d in 0..dk {
                    a += kt[d] * ki[d];
                    b += qt[d] * ki[d];
                }
                kk[t * c + i] = a;
                qk[t * c + i] = b;
            }
        }
        // Forward substitution: u_t = beta_t (v_t - e^{G_t} S^T k_t
        //   - sum_{i<t} e^{G_t - G_i} (k_t . k_i) u_i); then the outputs.
        for t in 0..n {
            let bt = beta[(start + t) * heads];
            let et = cum[t].exp();
            let vt = &v[(start + t) * heads * dv..(start + t) * heads * dv + dv];
            let (done, rest) = u.split_at_mut(t * dv);
            let ut = &mut rest[..dv];
            for j in 0..dv {
                ut[j] = vt[j] - et * sk[t * dv + j];
            }
            for i in 0..t {
                let w = (cum[t] - cum[i]).exp() * kk[t * c + i];
                let ui = &done[i * dv..(i + 1) * dv];
                for j in 0..dv {
                    ut[j] -= w * ui[j];
                }
            }
            for x in ut.iter_mut() {
                *x *= bt;
            }
            let ot = &mut out[(start + t) * dv..(start + t + 1) * dv];
            for j in 0..dv {
                ot[j] = et * sq[t * dv + j];
            }
            for i in 0..=t {
                let w = (cum[t] - cum[i]).exp() * qk[t * c + i];
                let ui = if i < t {
                    &done[i * dv..(i + 1) * dv]
                } else {
                    &*ut
                };
                for j in 0..dv {
                    ot[j] += w * ui[j];
                }
            }
        }
        // One write of the state: S = e^{G_n} S + sum_i e^{G_n - G_i} k_i u_i^T.
        let last = cum[n - 1];
        let total = last.exp();
        // Each row is summed in f32 and stored once (a bf16 state rounds once per block).
        for (r, row) in s.chunks_exact_mut(dv).enumerate() {
            for (a, x) in row_sum.iter_mut().zip(row.iter()) {
                *a = x.to_f32() * total;
            }
            for i in 0..n {
                let w = (last - cum[i]).exp() * key(start + i)[r];
                let ui = &u[i * dv..(i + 1) * dv];
                for j in 0..dv {
                    row_sum[j] += w * ui[j];
                }
            }
            for (x, a) in row.iter_mut().zip(&row_sum) {
                *x = S::from_f32(*a);
            }
        }
        start += n;
    }
}

/// SiLU, rounded to `T` after the convolution's rounding (as torch's conv1d then silu).
#[inline(always)]
fn conv_out<T: Element>(sum: f32) -> T {
    let x = T::from_f32(sum).to_f32();
    T::from_f32(x / (1.0 + (-x).exp()))
}

/// One new input per sequence: `x` `[B, C]`; `windows` the pool `[slots, C, K - 1]` of
/// float32 windows, sequence `b`'s at `slots[b]` (distinct), shifted by the new input in
/// place; `weight` `[C, K]`; `out` `[B, C]` = silu(conv).
#[allow(clippy::too_many_arguments)]
pub fn causal_conv_decode<T: Element>(
    x: &[T],
    windows: &mut [f32],
    slots: &[i64],
    weight: &[T],
    kernel: usize,
    out: &mut [T],
    threads: usize,
    parallel: &dyn Parallel,
) -> Result<(), KernelError> {
    let b = slots.len();
    if kernel < 2 || !weight.len().is_multiple_of(kernel) {
        return Err(KernelError(
            "causal_conv: weight is not [C, K] with K >= 2".into(),
        ));
    }
    let ch = weight.len() / kernel;
    let w = kernel - 1;
    if x.len() != b * ch || out.len() != x.len() || !windows.len().is_multiple_of(ch * w) {
        return Err(KernelError(
            "causal_conv_decode: x, out or windows mis-shaped".into(),
        ));
    }
    let total = windows.len() / (ch * w);
    let mut seen = vec![false; total];
    for &slot in slots {
        if slot < 0 || slot as usize >= total || std::mem::replace(&mut seen[slot as usize], true) {
            return Err(KernelError(format!(
                "causal_conv_decode: slot {slot} is outside the {total} slots or repeated"
            )));
        }
    }
    let n_parts = parts(b, threads);
    let win_addr = windows.as_mut_ptr() as usize;
    let out_addr = out.as_mut_ptr() as usize;
    parallel.run(n_parts, &|p| {
        for seq in b * p / n_parts..b * (p + 1) / n_parts {
            // SAFETY: distinct slots and sequences: one part per window and output row.
            let (win, o) = unsafe {
                (
                    std::slice::from_raw_parts_mut(
                        (win_addr as *mut f32).add(slots[seq] as usize * ch * w),
                        ch * w,
                    ),
                    std::slice::from_raw_parts_mut((out_addr as *mut T).add(seq * ch), ch),
                )
            };
            for c in 0..ch {
                let wc = &mut win[c * w..(c + 1) * w];
                let kc = &weight[c * kernel..(c + 1) * kernel];
                let xn = x[seq * ch + c].to_f32();
                let mut sum = 0.0f32;
                for j in 0..w {
                    sum += wc[j] * kc[j].to_f32();
                }
                sum += xn * kc[w].to_f32();
                o[c] = conv_out::<T>(sum);
                wc.copy_within(1.., 0);
                wc[w - 1] = xn;
            }
        }
    });
    Ok(())
}

/// `T` new inputs of one sequence: `x` `[T, C]`, `window` `[C, K - 1]` (the inputs before
/// them; left holding the last `K - 1` inputs), `weight` `[C, K]`, `out` `[T, C]`.
#[allow(clippy::too_many_arguments)]
pub fn causal_conv_chunk<T: Element>(
    x: &[T],
    window: &mut [f32],
    weight: &[T],
    kernel: usize,
    out: &mut [T],
    threads: usize,
    parallel: &dyn Parallel,
) -> Result<(), KernelError> {
    if kernel < 2 || !weight.len().is_multiple_of(kernel) {
        return Err(KernelError(
            "causal_conv: weight is not [C, K] with K >= 2".into(),
        ));
    }
    let ch = weight.len() / kernel;
    let w = kernel - 1;
    if ch == 0 || !x.len().is_multiple_of(ch) || out.len() != x.len() || window.len() != ch * w {
        return Err(KernelError(
            "causal_conv_chunk: x, out or window mis-shaped".into(),
        ));
    }
    let t_len = x.len() / ch;
    let n_parts = parts(ch / 64 + 1, threads);
    let win_addr = window.as_mut_ptr() as usize;
    let out_addr = out.as_mut_ptr() as usize;
    parallel.run(n_parts, &|p| {
        let mut hist = vec![0.0f32; w + t_len];
        for c in ch * p / n_parts..ch * (p + 1) / n_parts {
            // SAFETY: channel ranges are disjoint: each window row is touched by one part.
            let wc =
                unsafe { std::slice::from_raw_parts_mut((win_addr as *mut f32).add(c * w), w) };
            hist[..w].copy_from_slice(wc);
            for t in 0..t_len {
                hist[w + t] = x[t * ch + c].to_f32();
            }
            let kc = &weight[c * kernel..(c + 1) * kernel];
            for t in 0..t_len {
                let mut sum = 0.0f32;
                for j in 0..kernel {
                    sum += hist[t + j] * kc[j].to_f32();
                }
                // SAFETY: element (t, c) is inside `out`, and channel c is this part's.
                unsafe { *(out_addr as *mut T).add(t * ch + c) = conv_out::<T>(sum) };
            }
            wc.copy_from_slice(&hist[t_len..t_len + w]);
        }
    });
    Ok(())
}
