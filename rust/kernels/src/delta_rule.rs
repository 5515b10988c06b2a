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

/// The value-head width [`delta_rule_decode`] has an unrolled path for (every Qwen3.5).
const DECODE_DV: usize = 128;

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

dispatch!(conv_chunk_part<T>, conv_chunk_part_body, (
    x: &[T], window: &mut [f32], weight: &[T], kernel: usize, out_addr: usize, ch: usize,
    lo: usize, hi: usize, t_len: usize
));

dispatch!(conv_decode_seq<T>, conv_decode_seq_body, (
    x: &[T], window: &mut [f32], weight: &[T], kernel: usize, out: &mut [T], sums: &mut [f32]
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
    let sq = &mut sq[..dv];
    // One read of the state: S^T k and S^T q.
    if dv == DECODE_DV {
        // Qwen3.5's value heads: sums of a fixed size, which the compiler can keep in
        // registers across the rows.
        let mut a = [0.0f32; DECODE_DV];
        let mut b = [0.0f32; DECODE_DV];
        for ((row, &ki), &qi) in s.chunks_exact(DECODE_DV).zip(k).zip(q) {
            for j in 0..DECODE_DV {
                let x = row[j].to_f32();
                a[j] += x * ki;
                b[j] += x * qi;
            }
        }
        sk.copy_from_slice(&a);
        sq.copy_from_slice(&b);
    } else {
        sk.fill(0.0);
        sq.fill(0.0);
        // Zipped slices of one length: vector code without bounds checks.
        for ((row, &ki), &qi) in s.chunks_exact(dv).zip(k).zip(q) {
            for ((x, a), b) in row.iter().zip(sk.iter_mut()).zip(sq.iter_mut()) {
                let x = x.to_f32();
                *a += x * ki;
                *b += x * qi;
            }
        }
    }
    let decay = g.exp();
    let kq: f32 = k.iter().zip(q).map(|(a, b)| a * b).sum();
    // u = beta (v - decay S^T k); o = decay S^T q + (k . q) u. `sk` becomes u.
    for ((u, o), (&vj, &qj)) in sk
        .iter_mut()
        .zip(out.iter_mut())
        .zip(v.iter().zip(sq.iter()))
    {
        let uj = beta * (vj - decay * *u);
        *u = uj;
        *o = decay * qj + kq * uj;
    }
    // One write: S = decay S + k u^T.
    for (row, &ki) in s.chunks_exact_mut(dv).zip(k) {
        for (x, &u) in row.iter_mut().zip(sk.iter()) {
            *x = S::from_f32(decay * x.to_f32() + ki * u);
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

/// Tokens (state read) or state rows (state write) per register tile of a chunk.
const TILE_ROWS: usize = 4;
/// Value columns per register tile of a chunk (two AVX-512 vectors).
const TILE_COLS: usize = 32;

/// One head over every block of the chunk. Token `t`'s vectors are at `t * heads * d`
/// from the head's first element; its output goes to row `t` of `out` `[t_len, dv]`.
///
/// Every sum adds its terms in the order of the plain loops (over the key dimension, or
/// over the block's tokens, from the first), so tiling changes no value.
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
    // Within-block decays exp(G_t - G_i), and exp(G_last - G_i).
    let mut decay = vec![0.0f32; c * c];
    let mut to_last = vec![0.0f32; c];
    let mut kk = vec![0.0f32; c * c];
    let mut qk = vec![0.0f32; c * c];
    // The block's keys and queries, token-major and (keys) key-dimension-major.
    let mut kb = vec![0.0f32; c * dk];
    let mut qb = vec![0.0f32; c * dk];
    let mut kt = vec![0.0f32; dk * c];
    let mut sk = vec![0.0f32; c * dv];
    let mut sq = vec![0.0f32; c * dv];
    let mut u = vec![0.0f32; c * dv];
    // The state in f32 while a block works on it (read widened, stored rounded at its end).
    let mut wide = vec![0.0f32; dk * dv];
    let mut start = 0;
    while start < t_len {
        let n = c.min(t_len - start);
        for (a, e) in wide.iter_mut().zip(s.iter()) {
            *a = e.to_f32();
        }
        // Cumulative log decay within the block.
        let mut acc = 0.0f32;
        for i in 0..n {
            acc += g[(start + i) * heads];
            cum[i] = acc;
        }
        for t in 0..n {
            for i in 0..=t {
                decay[t * c + i] = (cum[t] - cum[i]).exp();
            }
        }
        let last = cum[n - 1];
        for i in 0..n {
            to_last[i] = (last - cum[i]).exp();
        }
        for i in 0..n {
            let at = (start + i) * heads * dk;
            kb[i * dk..(i + 1) * dk].copy_from_slice(&k[at..at + dk]);
            qb[i * dk..(i + 1) * dk].copy_from_slice(&q[at..at + dk]);
            for d in 0..dk {
                kt[d * c + i] = k[at + d];
            }
        }
        // One read of the state for the whole block: S^T k_t and S^T q_t.
        read_state(&wide, &kb, &qb, n, dk, dv, &mut sk, &mut sq);
        key_products(&kb, &qb, &kt, n, dk, &mut kk, &mut qk);
        // Forward substitution: u_t = beta_t (v_t - e^{G_t} S^T k_t
        //   - sum_{i<t} e^{G_t - G_i} (k_t . k_i) u_i); then the outputs.
        for t in 0..n {
            let bt = beta[(start + t) * heads];
            let et = cum[t].exp();
            let vt = &v[(start + t) * heads * dv..(start + t) * heads * dv + dv];
            let (done, rest) = u.split_at_mut(t * dv);
            let ut = &mut rest[..dv];
            for ((x, &vj), &sj) in ut.iter_mut().zip(vt).zip(&sk[t * dv..(t + 1) * dv]) {
                *x = vj - et * sj;
            }
            // `x - w e` is `x + (-w) e` exactly.
            add_weighted_rows(ut, done, |i| -(decay[t * c + i] * kk[t * c + i]));
            for x in ut.iter_mut() {
                *x *= bt;
            }
            let ot = &mut out[(start + t) * dv..(start + t + 1) * dv];
            for (o, &sj) in ot.iter_mut().zip(&sq[t * dv..(t + 1) * dv]) {
                *o = et * sj;
            }
            add_weighted_rows(ot, &u[..(t + 1) * dv], |i| decay[t * c + i] * qk[t * c + i]);
        }
        // One write of the state: S = e^{G_n} S + sum_i e^{G_n - G_i} k_i u_i^T, each
        // element summed in f32 and stored once (a bf16 state rounds once per block).
        write_state(&mut wide, &kb, &u, &to_last[..n], last.exp(), dk, dv);
        for (e, &a) in s.iter_mut().zip(wide.iter()) {
            *e = S::from_f32(a);
        }
        start += n;
    }
}

/// `acc += w(i) * rows[i]` for each row `i` of `rows` (rows of `acc.len()` values end to
/// end), the terms added in order of `i`. Rows of 128 (Qwen3.5's value heads) keep `acc` in
/// registers across the rows instead of loading and storing it for each.
#[inline(always)]
fn add_weighted_rows(acc: &mut [f32], rows: &[f32], w: impl Fn(usize) -> f32) {
    if let Ok(a) = <&mut [f32; 128]>::try_from(&mut *acc) {
        let mut r = *a;
        for (i, row) in rows.chunks_exact(128).enumerate() {
            let wi = w(i);
            let row: &[f32; 128] = row.try_into().unwrap();
            for j in 0..128 {
                r[j] += wi * row[j];
            }
        }
        *a = r;
        return;
    }
    let d = acc.len();
    for (i, row) in rows.chunks_exact(d).enumerate() {
        let wi = w(i);
        for (x, &e) in acc.iter_mut().zip(row) {
            *x += wi * e;
        }
    }
}

/// Keys per register tile of the key-key and query-key products.
const TILE_KEYS: usize = 16;

/// The key-key and query-key products within a block, `kk[t * c + i] = k_t . k_i` and
/// `qk[t * c + i] = q_t . k_i` for `i <= t < n`, in register tiles of [`TILE_ROWS`] tokens
/// `t` by [`TILE_KEYS`] keys `i`; `kt` holds the block's keys key-dimension-major
/// (`[dk, c]`). Each product sums over the key dimension from the first term, as the
/// plain loop does. Tile rows past `n` and columns past `t` are computed on whatever the
/// buffers hold and not stored.
#[inline(always)]
fn key_products(
    kb: &[f32],
    qb: &[f32],
    kt: &[f32],
    n: usize,
    dk: usize,
    kk: &mut [f32],
    qk: &mut [f32],
) {
    let c = DELTA_CHUNK;
    let mut t0 = 0;
    while t0 < n {
        // `t0` is a multiple of TILE_ROWS below `c`: the tile's rows are inside the buffers.
        let rows = TILE_ROWS.min(n - t0);
        let mut i0 = 0;
        while i0 < t0 + rows {
            let mut ka = [[0.0f32; TILE_KEYS]; TILE_ROWS];
            let mut qa = [[0.0f32; TILE_KEYS]; TILE_ROWS];
            for d in 0..dk {
                let col: &[f32; TILE_KEYS] =
                    kt[d * c + i0..d * c + i0 + TILE_KEYS].try_into().unwrap();
                for r in 0..TILE_ROWS {
                    let kd = kb[(t0 + r) * dk + d];
                    let qd = qb[(t0 + r) * dk + d];
                    for j in 0..TILE_KEYS {
                        ka[r][j] += kd * col[j];
                        qa[r][j] += qd * col[j];
                    }
                }
            }
            for r in 0..rows {
                let t = t0 + r;
                for j in 0..TILE_KEYS.min(t + 1 - i0.min(t + 1)) {
                    kk[t * c + i0 + j] = ka[r][j];
                    qk[t * c + i0 + j] = qa[r][j];
                }
            }
            i0 += TILE_KEYS;
        }
        t0 += rows;
    }
}

/// `sk[i] = S^T k_i`, `sq[i] = S^T q_i` for the block's `n` tokens (`kb`, `qb` `[n, dk]`),
/// in register tiles of [`TILE_ROWS`] tokens by [`TILE_COLS`] columns: each state element
/// read from cache once per tile of tokens, not once per token.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn read_state(
    s: &[f32],
    kb: &[f32],
    qb: &[f32],
    n: usize,
    dk: usize,
    dv: usize,
    sk: &mut [f32],
    sq: &mut [f32],
) {
    const R: usize = TILE_ROWS;
    const C: usize = TILE_COLS;
    for i0 in (0..n).step_by(R) {
        for j0 in (0..dv).step_by(C) {
            if i0 + R <= n && j0 + C <= dv {
                #[cfg(target_arch = "x86_64")]
                if std::arch::is_x86_feature_detected!("avx512f") {
                    // SAFETY: the CPU has AVX-512F; the tile's rows and columns are inside
                    // `s`, `kb`, `qb`, `sk` and `sq` (checked just above).
                    unsafe { avx512::read_tile(s, kb, qb, dk, dv, i0, j0, sk, sq) };
                    continue;
                }
                let mut ak = [[0.0f32; C]; R];
                let mut aq = [[0.0f32; C]; R];
                for r in 0..dk {
                    let mut x = [0.0f32; C];
                    for (xj, e) in x.iter_mut().zip(&s[r * dv + j0..r * dv + j0 + C]) {
                        *xj = *e;
                    }
                    for t in 0..R {
                        let (kr, qr) = (kb[(i0 + t) * dk + r], qb[(i0 + t) * dk + r]);
                        for j in 0..C {
                            ak[t][j] += x[j] * kr;
                            aq[t][j] += x[j] * qr;
                        }
                    }
                }
                for t in 0..R {
                    let at = (i0 + t) * dv + j0;
                    sk[at..at + C].copy_from_slice(&ak[t]);
                    sq[at..at + C].copy_from_slice(&aq[t]);
                }
            } else {
                let (ti, tj) = (R.min(n - i0), C.min(dv - j0));
                for t in i0..i0 + ti {
                    let (a, b) = (&mut sk[t * dv + j0..], &mut sq[t * dv + j0..]);
                    a[..tj].fill(0.0);
                    b[..tj].fill(0.0);
                    for r in 0..dk {
                        let (kr, qr) = (kb[t * dk + r], qb[t * dk + r]);
                        for j in 0..tj {
                            let x = s[r * dv + j0 + j];
                            a[j] += x * kr;
                            b[j] += x * qr;
                        }
                    }
                }
            }
        }
    }
}

/// `S[r] = total S[r] + sum_i (to_last[i] k_i[r]) u_i` over the block's tokens in order,
/// in register tiles of [`TILE_ROWS`] state rows by [`TILE_COLS`] columns.
#[inline(always)]
fn write_state(
    s: &mut [f32],
    kb: &[f32],
    u: &[f32],
    to_last: &[f32],
    total: f32,
    dk: usize,
    dv: usize,
) {
    const R: usize = TILE_ROWS;
    const C: usize = TILE_COLS;
    let n = to_last.len();
    for r0 in (0..dk).step_by(R) {
        for j0 in (0..dv).step_by(C) {
            if r0 + R <= dk && j0 + C <= dv {
                #[cfg(target_arch = "x86_64")]
                if std::arch::is_x86_feature_detected!("avx512f") {
                    // SAFETY: as in `read_state`, for `s`, `kb` and `u`.
                    unsafe { avx512::write_tile(s, kb, u, to_last, total, dk, dv, r0, j0) };
                    continue;
                }
                let mut acc = [[0.0f32; C]; R];
                for (t, row) in acc.iter_mut().enumerate() {
                    let at = (r0 + t) * dv + j0;
                    for (a, e) in row.iter_mut().zip(&s[at..at + C]) {
                        *a = e * total;
                    }
                }
                for i in 0..n {
                    let ui = &u[i * dv + j0..i * dv + j0 + C];
                    for (t, row) in acc.iter_mut().enumerate() {
                        let w = to_last[i] * kb[i * dk + r0 + t];
                        for (a, &e) in row.iter_mut().zip(ui) {
                            *a += w * e;
                        }
                    }
                }
                for (t, row) in acc.iter().enumerate() {
                    let at = (r0 + t) * dv + j0;
                    for (x, &a) in s[at..at + C].iter_mut().zip(row) {
                        *x = a;
                    }
                }
            } else {
                let tj = C.min(dv - j0);
                for r in r0..(r0 + R).min(dk) {
                    let mut acc = [0.0f32; C];
                    for (a, e) in acc.iter_mut().zip(&s[r * dv + j0..r * dv + j0 + tj]) {
                        *a = e * total;
                    }
                    for i in 0..n {
                        let w = to_last[i] * kb[i * dk + r];
                        for (a, &e) in acc.iter_mut().zip(&u[i * dv + j0..i * dv + j0 + tj]) {
                            *a += w * e;
                        }
                    }
                    for (x, &a) in s[r * dv + j0..r * dv + j0 + tj].iter_mut().zip(&acc) {
                        *x = a;
                    }
                }
            }
        }
    }
}

/// SiLU, rounded to `T` after the convolution's rounding (as torch's conv1d then silu).
/// The exponential is the decoder's branchless one (about 2 ulp), so that the loops over
/// a row's channels vectorise: with the C library's `expf`, a call per channel, a
/// Qwen3.5-0.8B prompt step of 2048 rows spent 236-294 ms in the convolution, now 78-109.
#[inline(always)]
fn conv_out<T: Element>(sum: f32) -> T {
    let x = T::from_f32(sum).to_f32();
    T::from_f32(x / (1.0 + crate::decoder::exp(-x)))
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
        let mut sums = vec![0.0f32; ch];
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
            conv_decode_seq(
                &x[seq * ch..(seq + 1) * ch],
                win,
                weight,
                kernel,
                o,
                &mut sums,
            );
        }
    });
    Ok(())
}

/// One sequence's step of [`causal_conv_decode`]: every channel's sum (oldest input
/// first, the new one last), its window shifted, then the SiLUs over the whole row.
#[inline(always)]
fn conv_decode_seq_body<T: Element>(
    x: &[T],
    window: &mut [f32],
    weight: &[T],
    kernel: usize,
    out: &mut [T],
    sums: &mut [f32],
) {
    let w = kernel - 1;
    let rows = x
        .iter()
        .zip(window.chunks_exact_mut(w))
        .zip(weight.chunks_exact(kernel))
        .zip(sums.iter_mut());
    if w == 3 {
        // Qwen3.5's kernel of 4, unrolled: no call to shift three values.
        for (((xc, wc), kc), sum) in rows {
            let xn = xc.to_f32();
            let (w0, w1, w2) = (wc[0], wc[1], wc[2]);
            *sum = 0.0
                + w0 * kc[0].to_f32()
                + w1 * kc[1].to_f32()
                + w2 * kc[2].to_f32()
                + xn * kc[3].to_f32();
            wc[0] = w1;
            wc[1] = w2;
            wc[2] = xn;
        }
    } else {
        for (((xc, wc), kc), sum) in rows {
            let xn = xc.to_f32();
            let mut acc = 0.0f32;
            for (a, b) in wc.iter().zip(kc) {
                acc += a * b.to_f32();
            }
            *sum = acc + xn * kc[w].to_f32();
            for j in 1..w {
                wc[j - 1] = wc[j];
            }
            wc[w - 1] = xn;
        }
    }
    for (o, &sum) in out.iter_mut().zip(sums.iter()) {
        *o = conv_out::<T>(sum);
    }
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
        let (lo, hi) = (ch * p / n_parts, ch * (p + 1) / n_parts);
        // SAFETY: channel ranges are disjoint: each part touches its own window rows and
        // its own columns of `out`.
        let win = unsafe {
            std::slice::from_raw_parts_mut((win_addr as *mut f32).add(lo * w), (hi - lo) * w)
        };
        conv_chunk_part(x, win, weight, kernel, out_addr, ch, lo, hi, t_len);
    });
    Ok(())
}

/// Channels per block of [`conv_chunk_part_body`]: a block's weights, window and sums stay
/// in L1 while its tokens pass.
const CONV_BLOCK: usize = 256;

/// Channels `lo..hi` of [`causal_conv_chunk`] (`window` holds their windows), token by
/// token over contiguous runs of channels so that the loops are vector code: each sum
/// adds the products oldest input first, as the per-channel form does.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn conv_chunk_part_body<T: Element>(
    x: &[T],
    window: &mut [f32],
    weight: &[T],
    kernel: usize,
    out_addr: usize,
    ch: usize,
    lo: usize,
    hi: usize,
    t_len: usize,
) {
    let w = kernel - 1;
    let mut taps = vec![0.0f32; kernel * CONV_BLOCK];
    let mut before = vec![0.0f32; w * CONV_BLOCK];
    let mut sums = vec![0.0f32; CONV_BLOCK];
    for b0 in (lo..hi).step_by(CONV_BLOCK) {
        let nb = CONV_BLOCK.min(hi - b0);
        // The block's taps and window, one row per tap / per earlier input.
        for c in 0..nb {
            for j in 0..kernel {
                taps[j * CONV_BLOCK + c] = weight[(b0 + c) * kernel + j].to_f32();
            }
            for j in 0..w {
                before[j * CONV_BLOCK + c] = window[(b0 - lo + c) * w + j];
            }
        }
        for t in 0..t_len {
            let sums = &mut sums[..nb];
            sums.fill(0.0);
            for j in 0..kernel {
                let tap = &taps[j * CONV_BLOCK..j * CONV_BLOCK + nb];
                // The input at time t + j - w: an earlier one from the window, else x's.
                if t + j < w {
                    let row = &before[(t + j) * CONV_BLOCK..(t + j) * CONV_BLOCK + nb];
                    for ((s, &a), &b) in sums.iter_mut().zip(row).zip(tap) {
                        *s += a * b;
                    }
                } else {
                    let at = (t + j - w) * ch + b0;
                    for ((s, a), &b) in sums.iter_mut().zip(&x[at..at + nb]).zip(tap) {
                        *s += a.to_f32() * b;
                    }
                }
            }
            // SAFETY: row t's columns b0..b0 + nb are inside `out` and this part's.
            let o = unsafe {
                std::slice::from_raw_parts_mut((out_addr as *mut T).add(t * ch + b0), nb)
            };
            for (o, &sum) in o.iter_mut().zip(sums.iter()) {
                *o = conv_out::<T>(sum);
            }
        }
        // The new window: the last w inputs, from x where the chunk reaches back that far.
        for c in 0..nb {
            for j in 0..w {
                let value = if t_len + j >= w {
                    x[(t_len + j - w) * ch + b0 + c].to_f32()
                } else {
                    before[(t_len + j) * CONV_BLOCK + c]
                };
                window[(b0 - lo + c) * w + j] = value;
            }
        }
    }
}

/// The full register tiles of a chunk's state read and write in AVX-512 (the plain loops
/// are left to the compiler, which does not always keep their tiles in registers): the
/// same products and sums in the same order, a multiply then an add as the plain loops
/// do, so the values are the same.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{TILE_COLS, TILE_ROWS};
    use std::arch::x86_64::*;

    const _: () = assert!(TILE_ROWS == 4 && TILE_COLS == 32);

    /// Tokens `i0..i0 + 4` by columns `j0..j0 + 32` of `sk = S^T k`, `sq = S^T q`.
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn read_tile(
        s: &[f32],
        kb: &[f32],
        qb: &[f32],
        dk: usize,
        dv: usize,
        i0: usize,
        j0: usize,
        sk: &mut [f32],
        sq: &mut [f32],
    ) {
        debug_assert!(s.len() >= dk * dv && j0 + 32 <= dv);
        debug_assert!(kb.len() >= (i0 + 4) * dk && qb.len() >= (i0 + 4) * dk);
        let (sp, kp, qp) = (s.as_ptr(), kb.as_ptr(), qb.as_ptr());
        let mut ak = [_mm512_setzero_ps(); 8];
        let mut aq = [_mm512_setzero_ps(); 8];
        for r in 0..dk {
            let x0 = _mm512_loadu_ps(sp.add(r * dv + j0));
            let x1 = _mm512_loadu_ps(sp.add(r * dv + j0 + 16));
            for t in 0..4 {
                let kr = _mm512_set1_ps(*kp.add((i0 + t) * dk + r));
                let qr = _mm512_set1_ps(*qp.add((i0 + t) * dk + r));
                ak[2 * t] = _mm512_add_ps(ak[2 * t], _mm512_mul_ps(x0, kr));
                ak[2 * t + 1] = _mm512_add_ps(ak[2 * t + 1], _mm512_mul_ps(x1, kr));
                aq[2 * t] = _mm512_add_ps(aq[2 * t], _mm512_mul_ps(x0, qr));
                aq[2 * t + 1] = _mm512_add_ps(aq[2 * t + 1], _mm512_mul_ps(x1, qr));
            }
        }
        for t in 0..4 {
            let at = (i0 + t) * dv + j0;
            debug_assert!(at + 32 <= sk.len() && at + 32 <= sq.len());
            _mm512_storeu_ps(sk.as_mut_ptr().add(at), ak[2 * t]);
            _mm512_storeu_ps(sk.as_mut_ptr().add(at + 16), ak[2 * t + 1]);
            _mm512_storeu_ps(sq.as_mut_ptr().add(at), aq[2 * t]);
            _mm512_storeu_ps(sq.as_mut_ptr().add(at + 16), aq[2 * t + 1]);
        }
    }

    /// State rows `r0..r0 + 4` by columns `j0..j0 + 32` of
    /// `S = total S + sum_i (to_last[i] k_i) u_i`.
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn write_tile(
        s: &mut [f32],
        kb: &[f32],
        u: &[f32],
        to_last: &[f32],
        total: f32,
        dk: usize,
        dv: usize,
        r0: usize,
        j0: usize,
    ) {
        let n = to_last.len();
        debug_assert!(s.len() >= (r0 + 4) * dv && j0 + 32 <= dv);
        debug_assert!(kb.len() >= n * dk && u.len() >= n * dv && r0 + 4 <= dk);
        let (sp, kp, up) = (s.as_mut_ptr(), kb.as_ptr(), u.as_ptr());
        let tot = _mm512_set1_ps(total);
        let mut acc = [_mm512_setzero_ps(); 8];
        for t in 0..4 {
            let at = (r0 + t) * dv + j0;
            acc[2 * t] = _mm512_mul_ps(_mm512_loadu_ps(sp.add(at)), tot);
            acc[2 * t + 1] = _mm512_mul_ps(_mm512_loadu_ps(sp.add(at + 16)), tot);
        }
        for (i, &e) in to_last.iter().enumerate() {
            let u0 = _mm512_loadu_ps(up.add(i * dv + j0));
            let u1 = _mm512_loadu_ps(up.add(i * dv + j0 + 16));
            for t in 0..4 {
                let w = _mm512_set1_ps(e * *kp.add(i * dk + r0 + t));
                acc[2 * t] = _mm512_add_ps(acc[2 * t], _mm512_mul_ps(w, u0));
                acc[2 * t + 1] = _mm512_add_ps(acc[2 * t + 1], _mm512_mul_ps(w, u1));
            }
        }
        for t in 0..4 {
            let at = (r0 + t) * dv + j0;
            _mm512_storeu_ps(sp.add(at), acc[2 * t]);
            _mm512_storeu_ps(sp.add(at + 16), acc[2 * t + 1]);
        }
    }
}
