//! Decode attention straight from the paged KV cache.
//!
//! One query token per sequence attends to its whole context. The keys and values are read
//! in place from the cache blocks its block table names: no gathered copy, no transpose, no
//! mask. For each (sequence, kv head) pair the query heads of its group are scored against
//! each key once, the scores go through an f32 softmax, and the values are summed in f32.
//!
//! Layouts (row-major): `q`, `out` `[seqs, heads, head_dim]`; each cache
//! `[num_blocks, block_size, kv_heads, head_dim]`; `block_tables` `[seqs, max_blocks]`.

use std::fmt;

use crate::element::Element;

/// Sizes of one call. `sliding_window == 0` means every context token is attended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecodeShape {
    pub num_seqs: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    /// Width of a block-table row.
    pub max_blocks: usize,
    /// Blocks in each cache tensor.
    pub num_blocks: usize,
    pub sliding_window: usize,
}

/// Inputs that do not describe a valid call; nothing was written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelError(pub String);

impl fmt::Display for KernelError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for KernelError {}

fn check(ok: bool, what: impl FnOnce() -> String) -> Result<(), KernelError> {
    if ok {
        Ok(())
    } else {
        Err(KernelError(what()))
    }
}

/// Attention output of every sequence's single query token into `out`.
///
/// Each score is `scale * q.k`; with `softcap > 0` it becomes `softcap * tanh(score /
/// softcap)` before the softmax (Gemma 2's attention logit soft-capping; 0 is off).
///
/// The work is split into at most `threads` parts (fewer for small calls, which run on the
/// caller's thread) and the parts are run by `parallel`.
#[allow(clippy::too_many_arguments)]
pub fn paged_decode_attention<T: Element>(
    out: &mut [T],
    q: &[T],
    k_cache: &[T],
    v_cache: &[T],
    block_tables: &[i32],
    seq_lens: &[i32],
    shape: &DecodeShape,
    scale: f32,
    softcap: f32,
    threads: usize,
    parallel: &dyn Parallel,
) -> Result<(), KernelError> {
    paged_decode_attention_on(
        AttentionPath::Auto,
        out,
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        shape,
        scale,
        softcap,
        threads,
        parallel,
    )
}

/// The implementations of [`paged_decode_attention`]; `Auto` picks the fastest one the CPU
/// and the call allow. The others are there so that the tests can check each of them.
#[doc(hidden)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttentionPath {
    Auto,
    /// Plain Rust, built for baseline x86-64 (or whatever the target is).
    Portable,
    /// The plain Rust built with AVX2 and FMA.
    Avx2,
    /// f32 vectors per 16 elements of a row, one horizontal sum per score.
    Avx512,
    /// bf16 only: `vdpbf16ps` dot products over tiles of 16 keys, an online softmax.
    Avx512Bf16,
}

impl AttentionPath {
    /// Whether this CPU can run the path for elements `T` and rows of `head_dim`.
    pub fn available<T: Element>(self, head_dim: usize) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            let avx512 = has!("avx512f") && has!("avx512bw");
            match self {
                AttentionPath::Auto | AttentionPath::Portable => true,
                AttentionPath::Avx2 => has!("avx2") && has!("fma"),
                AttentionPath::Avx512 => {
                    avx512 && head_dim.is_multiple_of(16) && head_dim <= 16 * avx512::MAX_CHUNKS
                }
                AttentionPath::Avx512Bf16 => {
                    T::BF16
                        && avx512
                        && has!("avx512bf16")
                        && head_dim.is_multiple_of(32)
                        && head_dim <= 32 * avx512_bf16::MAX_CHUNKS
                }
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = head_dim;
            matches!(self, AttentionPath::Auto | AttentionPath::Portable)
        }
    }

    /// The path `Auto` stands for.
    fn resolve<T: Element>(self, head_dim: usize) -> AttentionPath {
        if self != AttentionPath::Auto {
            return self;
        }
        [
            AttentionPath::Avx512Bf16,
            AttentionPath::Avx512,
            AttentionPath::Avx2,
        ]
        .into_iter()
        .find(|p| p.available::<T>(head_dim))
        .unwrap_or(AttentionPath::Portable)
    }
}

/// [`paged_decode_attention`] on a given path; an error if this CPU cannot run it.
#[doc(hidden)]
#[allow(clippy::too_many_arguments)]
pub fn paged_decode_attention_on<T: Element>(
    path: AttentionPath,
    out: &mut [T],
    q: &[T],
    k_cache: &[T],
    v_cache: &[T],
    block_tables: &[i32],
    seq_lens: &[i32],
    shape: &DecodeShape,
    scale: f32,
    softcap: f32,
    threads: usize,
    parallel: &dyn Parallel,
) -> Result<(), KernelError> {
    paged_decode_attention_sinks_on(
        path,
        out,
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        shape,
        scale,
        softcap,
        None,
        threads,
        parallel,
    )
}

/// [`paged_decode_attention`] with attention sinks (gpt-oss): `sinks[h]`, one f32 logit
/// per query head, joins head `h`'s softmax denominator as a key of value zero, so
/// `out = sum_j e^(s_j - m) v_j / (sum_j e^(s_j - m) + e^(sinks[h] - m))` with `m` the
/// maximum of the scores and the sink (in sliding-window layers too: the sink is not a
/// position). `None` is the plain softmax. Calls with sinks run the portable or AVX2
/// path (the AVX-512 ones take none: `path` must not name them).
#[doc(hidden)]
#[allow(clippy::too_many_arguments)]
pub fn paged_decode_attention_sinks_on<T: Element>(
    path: AttentionPath,
    out: &mut [T],
    q: &[T],
    k_cache: &[T],
    v_cache: &[T],
    block_tables: &[i32],
    seq_lens: &[i32],
    shape: &DecodeShape,
    scale: f32,
    softcap: f32,
    sinks: Option<&[f32]>,
    threads: usize,
    parallel: &dyn Parallel,
) -> Result<(), KernelError> {
    let s = *shape;
    check(softcap.is_finite() && softcap >= 0.0, || {
        format!("softcap {softcap} must be 0 (off) or positive")
    })?;
    check(path.available::<T>(s.head_dim), || {
        format!("{path:?} cannot run here (head_dim {})", s.head_dim)
    })?;
    if let Some(sinks) = sinks {
        check(
            sinks.len() == s.num_heads && sinks.iter().all(|x| x.is_finite()),
            || format!("sinks must be {} finite logits, one per head", s.num_heads),
        )?;
        check(
            !matches!(path, AttentionPath::Avx512 | AttentionPath::Avx512Bf16),
            || format!("{path:?} takes no attention sinks"),
        )?;
    }
    check(
        s.num_kv_heads > 0 && s.head_dim > 0 && s.block_size > 0,
        || "kv heads, head_dim and block_size must be positive".into(),
    )?;
    check(
        s.num_heads.is_multiple_of(s.num_kv_heads) && s.num_heads > 0,
        || {
            format!(
                "{} heads are not a multiple of {} kv heads",
                s.num_heads, s.num_kv_heads
            )
        },
    )?;
    let q_len = s.num_seqs * s.num_heads * s.head_dim;
    check(q.len() == q_len && out.len() == q_len, || {
        format!(
            "q has {} and out {} elements, expected {q_len}",
            q.len(),
            out.len()
        )
    })?;
    let cache_len = s.num_blocks * s.block_size * s.num_kv_heads * s.head_dim;
    check(
        k_cache.len() == cache_len && v_cache.len() == cache_len,
        || {
            format!(
                "caches have {} / {} elements, expected {cache_len}",
                k_cache.len(),
                v_cache.len()
            )
        },
    )?;
    check(
        block_tables.len() == s.num_seqs * s.max_blocks && seq_lens.len() == s.num_seqs,
        || "block_tables must be [seqs, max_blocks] and seq_lens [seqs]".into(),
    )?;
    for (i, &len) in seq_lens.iter().enumerate() {
        check(
            len > 0 && len as usize <= s.max_blocks * s.block_size,
            || {
                format!(
                    "sequence {i}: length {len} outside 1..={}",
                    s.max_blocks * s.block_size
                )
            },
        )?;
        let used = (len as usize).div_ceil(s.block_size);
        let row = &block_tables[i * s.max_blocks..i * s.max_blocks + used];
        if let Some(&bad) = row.iter().find(|&&b| b < 0 || b as usize >= s.num_blocks) {
            return Err(KernelError(format!(
                "sequence {i}: block id {bad} outside the cache's {} blocks",
                s.num_blocks
            )));
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
        sinks,
        path: match (path, sinks) {
            (AttentionPath::Auto, Some(_)) if AttentionPath::Avx2.available::<T>(s.head_dim) => {
                AttentionPath::Avx2
            }
            (AttentionPath::Auto, Some(_)) => AttentionPath::Portable,
            _ => path.resolve::<T>(s.head_dim),
        },
    };
    let group = s.num_heads / s.num_kv_heads;
    let per_item = group * s.head_dim;
    let items = s.num_seqs * s.num_kv_heads;
    let cost = |item: usize| job.span(item / s.num_kv_heads).1 as u64 + 8;
    let total: u64 = (0..items).map(cost).sum();
    // Below ~32k (key, query head) scores a call is done in microseconds: waking a thread
    // would cost more. A team already spinning in its region (`Parallel::waiting`) takes a
    // part in well under a microsecond, so there a few hundred scores are worth a part.
    // (Each key row read is scored against the `group` query heads of its kv head; `total`
    // already counts every kv head's rows.)
    let per_part = if parallel.waiting() { 512 } else { 32_768 };
    let wanted = ((total * group as u64) / per_part).max(1) as usize;
    let parts = threads.clamp(1, items).min(wanted);
    if parts == 1 {
        run_items(&job, 0, out);
        return Ok(());
    }
    // Contiguous runs of items of about equal cost; item i writes out[i * per_item..].
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

/// Runs a kernel's parts: `task(p)` once for each `p` in `0..parts`, possibly at the same
/// time on several threads, returning when all are done.
pub trait Parallel: Sync {
    fn run(&self, parts: usize, task: &(dyn Fn(usize) + Sync));

    /// Whether the threads are already running and waiting for parts, so that a part is
    /// handed over in well under a microsecond (kernels then split smaller calls).
    fn waiting(&self) -> bool {
        false
    }
}

/// One scoped OS thread per part but the first, which runs on the caller's thread.
pub struct ScopedThreads;

impl Parallel for ScopedThreads {
    fn run(&self, parts: usize, task: &(dyn Fn(usize) + Sync)) {
        std::thread::scope(|scope| {
            for part in 1..parts {
                scope.spawn(move || task(part));
            }
            task(0);
        });
    }
}

struct Job<'a, T> {
    q: &'a [T],
    k_cache: &'a [T],
    v_cache: &'a [T],
    block_tables: &'a [i32],
    seq_lens: &'a [i32],
    shape: DecodeShape,
    scale: f32,
    /// 0: off; else scores become `softcap * tanh(score / softcap)`.
    softcap: f32,
    /// Per query head, a logit in the softmax's denominator (portable and AVX2 paths).
    sinks: Option<&'a [f32]>,
    /// Never `Auto`.
    path: AttentionPath,
}

impl<T: Element> Job<'_, T> {
    /// (first attended position, number of attended positions) of sequence `seq`.
    fn span(&self, seq: usize) -> (usize, usize) {
        let len = self.seq_lens[seq] as usize;
        let w = self.shape.sliding_window;
        let start = if w > 0 && len > w { len - w } else { 0 };
        (start, len - start)
    }

    /// The attended positions of `seq` for kv head `head`: their number, and per cache
    /// block they lie in, (offset of the first one's row, positions in the block). Whole
    /// runs, so the position loops do no division.
    fn runs(
        &self,
        seq: usize,
        head: usize,
    ) -> (usize, impl Iterator<Item = (usize, usize)> + Clone + '_) {
        let s = self.shape;
        let (start, n) = self.span(seq);
        let table = &self.block_tables[seq * s.max_blocks..(seq + 1) * s.max_blocks];
        let blocks = start / s.block_size..(start + n).div_ceil(s.block_size);
        let runs = blocks.map(move |b| {
            let lo = start.max(b * s.block_size);
            let hi = (start + n).min((b + 1) * s.block_size);
            let block = table[b] as usize;
            let at = (block * s.block_size + lo - b * s.block_size) * s.num_kv_heads + head;
            (at * s.head_dim, hi - lo)
        });
        (n, runs)
    }
}

/// Items `first..` (one (sequence, kv head) each) into `out`, on the job's path.
fn run_items<T: Element>(job: &Job<'_, T>, first: usize, out: &mut [T]) {
    match job.path {
        // SAFETY (all three): `available` checked the CPU features and the row width the
        // functions are compiled for before the job was made.
        #[cfg(target_arch = "x86_64")]
        AttentionPath::Avx512Bf16 => unsafe { avx512_bf16::run_items(job, first, out) },
        #[cfg(target_arch = "x86_64")]
        AttentionPath::Avx512 => unsafe { avx512::run_items(job, first, out) },
        #[cfg(target_arch = "x86_64")]
        AttentionPath::Avx2 => unsafe { run_items_avx2(job, first, out) },
        _ => run_items_generic::<T, false>(job, first, out),
    }
}

/// The same computation in AVX-512 registers: a 16-wide f32 vector per 16 elements of a
/// row, bf16 widened by a shift on load, one horizontal sum per score.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::{exp_nonpositive, soft_cap, Job};
    use crate::element::Element;

    /// Rows up to 16 vectors (head_dim 256).
    pub(super) const MAX_CHUNKS: usize = 16;
    /// How many positions ahead the score pass prefetches K and V rows.
    const PREFETCH_ROWS: usize = 8;

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn load16<T: Element>(p: *const T) -> __m512 {
        if T::BF16 {
            let raw = _mm256_loadu_si256(p as *const __m256i);
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(raw)))
        } else {
            _mm512_loadu_ps(p as *const f32)
        }
    }

    /// SAFETY: AVX-512 F and BW are present; `head_dim` is a multiple of 16 and at most
    /// `16 * MAX_CHUNKS`; the job was validated by `paged_decode_attention`.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn run_items<T: Element>(job: &Job<'_, T>, first: usize, out: &mut [T]) {
        let s = job.shape;
        let hd = s.head_dim;
        let chunks = hd / 16;
        let group = s.num_heads / s.num_kv_heads;
        let stride = s.num_kv_heads * hd;
        let scale = _mm512_set1_ps(job.scale);
        let mut query = vec![_mm512_setzero_ps(); group * chunks];
        let mut acc = vec![_mm512_setzero_ps(); group * chunks];
        let mut row = [_mm512_setzero_ps(); MAX_CHUNKS];
        let mut scores: Vec<f32> = Vec::new();
        let mut result = vec![0f32; group * hd];
        let mut offsets: Vec<usize> = Vec::new();
        let (kp, vp) = (job.k_cache.as_ptr(), job.v_cache.as_ptr());
        for (k, item_out) in out.chunks_exact_mut(group * hd).enumerate() {
            let item = first + k;
            let (seq, head) = (item / s.num_kv_heads, item % s.num_kv_heads);
            let (n, runs) = job.runs(seq, head);
            // Every attended row's offset, so that rows a few positions ahead (across block
            // boundaries too) can be prefetched: one kv head's rows are strided, and at
            // batch 1 they come from DRAM after the layer's weights went through the caches.
            offsets.clear();
            for (at, count) in runs.clone() {
                offsets.extend((0..count).map(|i| at + i * stride));
            }
            let qp = job.q.as_ptr().add((seq * s.num_heads + head * group) * hd);
            for (i, q) in query.iter_mut().enumerate() {
                *q = _mm512_mul_ps(load16(qp.add(i * 16)), scale);
            }
            scores.clear();
            scores.resize(group * n, 0.0);
            let row_bytes = hd * std::mem::size_of::<T>();
            for (j, &off) in offsets.iter().enumerate() {
                if let Some(&ahead) = offsets.get(j + PREFETCH_ROWS) {
                    // The V rows too: the value pass reads them right after this one.
                    for line in (0..row_bytes).step_by(64) {
                        _mm_prefetch::<_MM_HINT_T0>((kp.add(ahead) as *const i8).add(line));
                        _mm_prefetch::<_MM_HINT_T0>((vp.add(ahead) as *const i8).add(line));
                    }
                }
                let p = kp.add(off);
                for (c, r) in row[..chunks].iter_mut().enumerate() {
                    *r = load16(p.add(c * 16));
                }
                for (g, q) in query.chunks_exact(chunks).enumerate() {
                    let mut sum = _mm512_mul_ps(q[0], row[0]);
                    for c in 1..chunks {
                        sum = _mm512_fmadd_ps(q[c], row[c], sum);
                    }
                    *scores.get_unchecked_mut(g * n + j) = _mm512_reduce_add_ps(sum);
                }
            }
            if job.softcap > 0.0 {
                soft_cap(&mut scores, job.softcap);
            }
            let mut inv_sum = [0f32; 64];
            for (g, sc) in scores.chunks_exact_mut(n).enumerate() {
                let max = sc.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                for x in sc.iter_mut() {
                    *x = exp_nonpositive(*x - max);
                }
                inv_sum[g % 64] = 1.0 / sc.iter().sum::<f32>();
            }
            acc.fill(_mm512_setzero_ps());
            for (j, &off) in offsets.iter().enumerate() {
                let p = vp.add(off);
                for (c, r) in row[..chunks].iter_mut().enumerate() {
                    *r = load16(p.add(c * 16));
                }
                for (g, a) in acc.chunks_exact_mut(chunks).enumerate() {
                    let w = _mm512_set1_ps(*scores.get_unchecked(g * n + j));
                    for c in 0..chunks {
                        a[c] = _mm512_fmadd_ps(w, row[c], a[c]);
                    }
                }
            }
            for (g, a) in acc.chunks_exact(chunks).enumerate() {
                let inv = _mm512_set1_ps(inv_sum[g % 64]);
                for (c, v) in a.iter().enumerate() {
                    _mm512_storeu_ps(
                        result.as_mut_ptr().add(g * hd + c * 16),
                        _mm512_mul_ps(*v, inv),
                    );
                }
            }
            for (o, &r) in item_out.iter_mut().zip(&result) {
                *o = T::from_f32(r);
            }
        }
    }
}

/// bf16 with AVX-512 BF16, in three steps per (sequence, kv head):
///
/// 1. Scores, by tiles of 16 keys (any 16 attended rows in order, across block boundaries).
///    For each query head of the group, `vdpbf16ps` takes the bf16 query against each of
///    the tile's key rows into one f32 vector per key (bf16 products are exact in f32: only
///    the order of the sums differs from the other paths), and one transpose-reduce folds
///    the 16 vectors into the tile's 16 scores: 45 shuffles and adds where 16 horizontal
///    sums would take 128. The tiles and heads are independent of each other, so the
///    out-of-order core overlaps them; the maximum is kept lane-wise.
/// 2. The softmax in f32, 16 scores at a time.
/// 3. The values, summed with f32 FMAs in one sweep over the rows per 4 heads (or fewer),
///    the sums in registers throughout: a 64-byte load of 32 bf16 gives the even elements
///    by a shift and the odd ones by a mask, so the sums are kept as (even, odd) pairs and
///    put back in order only when rounded to bf16.
#[cfg(target_arch = "x86_64")]
mod avx512_bf16 {
    use std::arch::x86_64::*;
    use std::mem::transmute;

    use super::{soft_cap, Job, EXP_C, LN2_HI, LN2_LO, LOG2E};
    use crate::element::Element;

    /// Keys per tile: one score per f32 lane.
    const TILE: usize = 16;
    /// Rows up to 8 vectors of 32 bf16 (head_dim 256).
    pub(super) const MAX_CHUNKS: usize = 8;
    /// The bf16 half of an f32's bits.
    const HIGH: i32 = 0xffff_0000_u32 as i32;

    /// SAFETY: AVX-512 F, BW and BF16 are present; `T` is bf16; `head_dim` is a multiple
    /// of 32 and at most `32 * MAX_CHUNKS`; the job was validated by
    /// `paged_decode_attention_on`.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) unsafe fn run_items<T: Element>(job: &Job<'_, T>, first: usize, out: &mut [T]) {
        debug_assert!(T::BF16);
        let s = job.shape;
        let hd = s.head_dim;
        let chunks = hd / 32;
        let group = s.num_heads / s.num_kv_heads;
        let stride = s.num_kv_heads * hd;
        let kp = job.k_cache.as_ptr() as *const u16;
        let vp = job.v_cache.as_ptr() as *const u16;
        let scale = _mm512_set1_ps(job.scale);
        let mut query = vec![_mm512_setzero_si512(); group * chunks];
        let mut top = vec![_mm512_setzero_ps(); group];
        let mut inv_sum = vec![0f32; group];
        // Per head, the scores of the padded context, then their exponentials.
        let mut probs: Vec<f32> = Vec::new();
        // The rows of this item and of the next one (whose first tile is fetched early).
        let mut offsets: Vec<usize> = Vec::new();
        let mut upcoming: Vec<usize> = Vec::new();
        let items = out.len() / (group * hd);
        if items == 0 {
            return;
        }
        let lines = (hd * 2).div_ceil(64);
        // Item `item`'s attended rows, the last tile filled up with copies of the last row
        // (scored, then masked out); the number of real ones.
        let rows_of = |item: usize, rows: &mut Vec<usize>| {
            let (seq, head) = (item / s.num_kv_heads, item % s.num_kv_heads);
            let (n, runs) = job.runs(seq, head);
            rows.clear();
            for (at, count) in runs {
                rows.extend((0..count).map(|i| at + i * stride));
            }
            rows.resize(n.next_multiple_of(TILE), rows[n - 1]);
            n
        };
        // Lines to fetch per row: an item of kv head 0 fetches whole positions (the rows of
        // every kv head, contiguous in the cache), so that its sequence's other items find
        // them in the caches. From DRAM, where a call's cache is after the other layers',
        // that was 5-12% faster than each item fetching its own rows.
        let reach = |item: usize| {
            if item.is_multiple_of(s.num_kv_heads) {
                lines * s.num_kv_heads
            } else {
                lines
            }
        };
        let mut upcoming_n = rows_of(first, &mut upcoming);
        prefetch(kp, vp, &upcoming[..TILE], reach(first));
        for (k, item_out) in out.chunks_exact_mut(group * hd).enumerate() {
            let item = first + k;
            let (seq, head) = (item / s.num_kv_heads, item % s.num_kv_heads);
            std::mem::swap(&mut offsets, &mut upcoming);
            let n = upcoming_n;
            let padded = offsets.len();
            if k + 1 < items {
                upcoming_n = rows_of(item + 1, &mut upcoming);
            } else {
                upcoming.clear();
            }
            let qp = job.q.as_ptr().add((seq * s.num_heads + head * group) * hd) as *const u16;
            for (i, q) in query.iter_mut().enumerate() {
                *q = _mm512_loadu_si512(qp.add(i * 32) as *const _);
            }
            probs.clear();
            probs.resize(group * padded, 0.0);
            let pp = probs.as_mut_ptr();
            top.fill(_mm512_set1_ps(f32::NEG_INFINITY));
            for (t, rows) in offsets.chunks_exact(TILE).enumerate() {
                // One kv head's rows are strided and the blocks scattered: fetch the next
                // tile's K and V rows while this one is scored (after the last tile, the
                // next item's first).
                match offsets.get((t + 1) * TILE..(t + 2) * TILE) {
                    Some(next) => prefetch(kp, vp, next, reach(item)),
                    None => {
                        let next = upcoming.get(..TILE).unwrap_or(&[]);
                        prefetch(kp, vp, next, reach(item + 1))
                    }
                }
                let valid = (n - t * TILE).min(TILE);
                let live: __mmask16 = if valid == TILE {
                    0xffff
                } else {
                    (1 << valid) - 1
                };
                let rows: &[usize; TILE] = rows.try_into().unwrap();
                for (g, top) in top.iter_mut().enumerate() {
                    let q = &query[g * chunks..(g + 1) * chunks];
                    let scores = _mm512_mul_ps(tile_scores(q, kp, rows), scale);
                    let scores =
                        _mm512_mask_mov_ps(_mm512_set1_ps(f32::NEG_INFINITY), live, scores);
                    *top = _mm512_max_ps(*top, scores);
                    _mm512_storeu_ps(pp.add(g * padded + t * TILE), scores);
                }
            }
            if job.softcap > 0.0 {
                // The real scores only: the padding stays at -inf.
                for (g, top) in top.iter_mut().enumerate() {
                    let sc = std::slice::from_raw_parts_mut(pp.add(g * padded), n);
                    soft_cap(sc, job.softcap);
                    *top = _mm512_set1_ps(sc.iter().copied().fold(f32::NEG_INFINITY, f32::max));
                }
            }
            for (g, (top, inv)) in top.iter().zip(inv_sum.iter_mut()).enumerate() {
                let max = _mm512_set1_ps(_mm512_reduce_max_ps(*top));
                let mut sum = _mm512_setzero_ps();
                for t in 0..padded / TILE {
                    let at = pp.add(g * padded + t * TILE);
                    let p = exp(_mm512_sub_ps(_mm512_loadu_ps(at), max));
                    sum = _mm512_add_ps(sum, p);
                    _mm512_storeu_ps(at, p);
                }
                *inv = 1.0 / _mm512_reduce_add_ps(sum);
            }
            let rows = &offsets[..n];
            let op = item_out.as_mut_ptr() as *mut u16;
            let mut h0 = 0;
            while h0 < group {
                // Up to 4 heads per sweep over the rows.
                let heads = (group - h0).min(4);
                let sweep = Sweep {
                    probs: pp.add(h0 * padded),
                    padded,
                    inv_sum: &inv_sum[h0..],
                    vp,
                    rows,
                    out: op.add(h0 * hd),
                    hd,
                };
                match heads {
                    1 => sweep.run::<1>(),
                    2 => sweep.run::<2>(),
                    3 => sweep.run::<3>(),
                    _ => sweep.run::<4>(),
                }
                h0 += heads;
            }
        }
    }

    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn prefetch(kp: *const u16, vp: *const u16, rows: &[usize], lines: usize) {
        for &row in rows {
            for line in 0..lines {
                _mm_prefetch::<_MM_HINT_T0>((kp.add(row) as *const i8).add(line * 64));
                _mm_prefetch::<_MM_HINT_T0>((vp.add(row) as *const i8).add(line * 64));
            }
        }
    }

    /// The dot products of one head's query (`chunks` vectors of 32 bf16) with the 16 key
    /// rows at `rows`, unscaled.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    unsafe fn tile_scores(q: &[__m512i], kp: *const u16, rows: &[usize; TILE]) -> __m512 {
        let mut dots = [_mm512_setzero_ps(); TILE];
        for (c, &qc) in q.iter().enumerate() {
            let qc: __m512bh = transmute(qc);
            for (d, &row) in dots.iter_mut().zip(rows) {
                let k: __m512bh = transmute(_mm512_loadu_si512(kp.add(row + c * 32) as *const _));
                *d = _mm512_dpbf16_ps(*d, qc, k);
            }
        }
        transpose_sum(&dots)
    }

    /// Lane `i` of the result is the sum of the 16 lanes of `v[i]`.
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn transpose_sum(v: &[__m512; TILE]) -> __m512 {
        // Within each 128-bit lane: pairs (a, b) to [a, b, a, b] partial sums...
        let mut two = [_mm512_setzero_ps(); 8];
        for (i, t) in two.iter_mut().enumerate() {
            let (a, b) = (v[2 * i], v[2 * i + 1]);
            *t = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
        }
        // ...then to four whole sums of that 128-bit lane, for keys 4i..4i + 4.
        let mut four = [_mm512_setzero_ps(); 4];
        for (i, f) in four.iter_mut().enumerate() {
            let a = _mm512_castps_pd(two[2 * i]);
            let b = _mm512_castps_pd(two[2 * i + 1]);
            *f = _mm512_add_ps(
                _mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)),
            );
        }
        // Across the 128-bit lanes: lanes (0, 2) plus (1, 3), twice.
        let fold = |a, b| {
            _mm512_add_ps(
                _mm512_shuffle_f32x4::<0b10_00_10_00>(a, b),
                _mm512_shuffle_f32x4::<0b11_01_11_01>(a, b),
            )
        };
        fold(fold(four[0], four[1]), fold(four[2], four[3]))
    }

    /// e^x lane by lane for x <= 0: `exp_nonpositive`'s reduction and polynomial, with FMAs.
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn exp(x: __m512) -> __m512 {
        let floor = _mm512_set1_ps(-87.0);
        let small = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, floor);
        let x = _mm512_max_ps(x, floor);
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm512_mul_ps(x, _mm512_set1_ps(LOG2E)),
        );
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x);
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
        let mut p = _mm512_set1_ps(EXP_C[0]);
        for c in &EXP_C[1..] {
            p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(*c));
        }
        _mm512_maskz_mov_ps(!small, _mm512_scalef_ps(p, n))
    }

    /// `Bf16::from_f32` lane by lane, the bf16 in the upper half of each lane.
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn round_bf16(x: __m512) -> __m512i {
        let bits = _mm512_castps_si512(x);
        let lsb = _mm512_and_si512(_mm512_srli_epi32::<16>(bits), _mm512_set1_epi32(1));
        let rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
        let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x);
        let quiet = _mm512_or_si512(bits, _mm512_set1_epi32(0x0040_0000));
        _mm512_mask_mov_epi32(rounded, nan, quiet)
    }

    /// The value sums of one item from the first heads of `probs` on.
    struct Sweep<'a> {
        /// Per head `padded` weights (exponentials), heads one after another.
        probs: *const f32,
        padded: usize,
        /// Per head, 1 / the sum of its weights.
        inv_sum: &'a [f32],
        vp: *const u16,
        rows: &'a [usize],
        /// The first head's output row; the others follow every `hd` elements.
        out: *mut u16,
        hd: usize,
    }

    impl Sweep<'_> {
        /// Heads `0..H`: their weighted sums of the value rows, into `out`. Two chunks
        /// of the row at a time where there are two: `4 * H` independent sums (up to 16 in
        /// registers), to hide the FMAs' latency.
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw")]
        unsafe fn run<const H: usize>(&self) {
            let chunks = self.hd / 32;
            let mut c = 0;
            while c + 2 <= chunks {
                self.chunks::<H, 2>(c);
                c += 2;
            }
            if c < chunks {
                self.chunks::<H, 1>(c);
            }
        }

        /// Heads `0..H`, chunks `c0..c0 + C` of the row: all rows in one sweep, the
        /// `2 * H * C` sums in registers.
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw")]
        unsafe fn chunks<const H: usize, const C: usize>(&self, c0: usize) {
            let high = _mm512_set1_epi32(HIGH);
            let mut even = [[_mm512_setzero_ps(); C]; H];
            let mut odd = [[_mm512_setzero_ps(); C]; H];
            let vp = self.vp.add(c0 * 32);
            for (j, &row) in self.rows.iter().enumerate() {
                let mut ve = [_mm512_setzero_ps(); C];
                let mut vo = [_mm512_setzero_ps(); C];
                for c in 0..C {
                    let v = _mm512_loadu_si512(vp.add(row + c * 32) as *const _);
                    ve[c] = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(v));
                    vo[c] = _mm512_castsi512_ps(_mm512_and_si512(v, high));
                }
                for h in 0..H {
                    let w = _mm512_set1_ps(*self.probs.add(h * self.padded + j));
                    for c in 0..C {
                        even[h][c] = _mm512_fmadd_ps(w, ve[c], even[h][c]);
                        odd[h][c] = _mm512_fmadd_ps(w, vo[c], odd[h][c]);
                    }
                }
            }
            for h in 0..H {
                let inv = _mm512_set1_ps(self.inv_sum[h]);
                for c in 0..C {
                    let e = round_bf16(_mm512_mul_ps(even[h][c], inv));
                    let o = round_bf16(_mm512_mul_ps(odd[h][c], inv));
                    let packed =
                        _mm512_or_si512(_mm512_and_si512(o, high), _mm512_srli_epi32::<16>(e));
                    let at = self.out.add(h * self.hd + (c0 + c) * 32);
                    _mm512_storeu_si512(at as *mut _, packed);
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn run_items_avx2<T: Element>(job: &Job<'_, T>, first: usize, out: &mut [T]) {
    run_items_generic::<T, true>(job, first, out);
}

#[inline(always)]
fn run_items_generic<T: Element, const FMA: bool>(job: &Job<'_, T>, first: usize, out: &mut [T]) {
    let s = job.shape;
    let hd = s.head_dim;
    let group = s.num_heads / s.num_kv_heads;
    let mut query = vec![0f32; group * hd];
    let mut row = vec![0f32; hd];
    let mut acc = vec![0f32; group * hd];
    let mut scores: Vec<f32> = Vec::new();
    let mut inv_sum = vec![0f32; group];
    let stride = s.num_kv_heads * hd; // from one position to the next within a block
    for (k, item_out) in out.chunks_exact_mut(group * hd).enumerate() {
        let item = first + k;
        let (seq, head) = (item / s.num_kv_heads, item % s.num_kv_heads);
        let (n, runs) = job.runs(seq, head);
        let q_base = (seq * s.num_heads + head * group) * hd;
        load(&mut query, &job.q[q_base..q_base + group * hd]);
        for x in query.iter_mut() {
            *x *= job.scale;
        }
        scores.clear();
        scores.resize(group * n, 0.0);
        let mut j = 0;
        for (at, count) in runs.clone() {
            for i in 0..count {
                let at = at + i * stride;
                load(&mut row, &job.k_cache[at..at + hd]);
                for (g, q) in query.chunks_exact(hd).enumerate() {
                    scores[g * n + j] = dot::<FMA>(q, &row);
                }
                j += 1;
            }
        }
        if job.softcap > 0.0 {
            soft_cap(&mut scores, job.softcap);
        }
        for (g, sc) in scores.chunks_exact_mut(n).enumerate() {
            let sink = job.sinks.map(|sinks| sinks[head * group + g]);
            let mut max = sc.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            if let Some(sink) = sink {
                max = max.max(sink);
            }
            let mut sum = 0.0f32;
            for x in sc.iter_mut() {
                *x = exp_nonpositive(*x - max);
            }
            for x in sc.iter() {
                sum += *x;
            }
            if let Some(sink) = sink {
                sum += exp_nonpositive(sink - max);
            }
            inv_sum[g] = 1.0 / sum;
        }
        acc.fill(0.0);
        let mut j = 0;
        for (at, count) in runs {
            for i in 0..count {
                let at = at + i * stride;
                load(&mut row, &job.v_cache[at..at + hd]);
                for (g, a) in acc.chunks_exact_mut(hd).enumerate() {
                    axpy::<FMA>(a, scores[g * n + j], &row);
                }
                j += 1;
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

/// Scores to `cap * tanh(score / cap)`, in f32 (std's `tanh`: only soft-capped models pay).
#[inline]
pub(crate) fn soft_cap(scores: &mut [f32], cap: f32) {
    let inv = 1.0 / cap;
    for x in scores {
        *x = cap * (*x * inv).tanh();
    }
}

#[inline(always)]
fn load<T: Element>(dst: &mut [f32], src: &[T]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = s.to_f32();
    }
}

/// Sum of products with 16 independent lanes, so the compiler can keep it in vectors
/// (a single running sum would pin the order of additions).
#[inline(always)]
pub(crate) fn dot<const FMA: bool>(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0f32; 16];
    let whole = a.len() / 16 * 16;
    for (x, y) in a[..whole].chunks_exact(16).zip(b[..whole].chunks_exact(16)) {
        for i in 0..16 {
            lanes[i] = if FMA {
                x[i].mul_add(y[i], lanes[i])
            } else {
                lanes[i] + x[i] * y[i]
            };
        }
    }
    // Pairwise, so the lanes fold in vector registers (a running sum would be 15 dependent
    // scalar additions per call).
    for width in [8, 4, 2, 1] {
        for i in 0..width {
            lanes[i] += lanes[i + width];
        }
    }
    let mut sum = lanes[0];
    for i in whole..a.len() {
        sum += a[i] * b[i];
    }
    sum
}

#[inline(always)]
pub(crate) fn axpy<const FMA: bool>(acc: &mut [f32], p: f32, x: &[f32]) {
    for (a, &v) in acc.iter_mut().zip(x) {
        *a = if FMA { p.mul_add(v, *a) } else { *a + p * v };
    }
}

const LOG2E: f32 = std::f32::consts::LOG2_E;
/// ln 2 in two parts: `n * LN2_HI` is exact for the `n` an f32 exponent can take.
const LN2_HI: f32 = 0.693_145_75;
const LN2_LO: f32 = 1.428_606_8e-6;
/// e^r = 1 + r + r^2 / 2 + ... + r^7 / 7!, highest power first (Horner).
const EXP_C: [f32; 8] = [
    1.0 / 5040.0,
    1.0 / 720.0,
    1.0 / 120.0,
    1.0 / 24.0,
    1.0 / 6.0,
    0.5,
    1.0,
    1.0,
];

/// e^x for x <= 0 (softmax after subtracting the maximum), within 2 ulp, branch-free so it
/// vectorizes: x = n ln2 + r with |r| <= ln2 / 2, e^r by its degree-7 Taylor polynomial,
/// 2^n through the exponent bits. Below -87 (where e^x leaves the normal range) it is 0.
#[inline(always)]
pub(crate) fn exp_nonpositive(x: f32) -> f32 {
    const ROUND: f32 = 12_582_912.0; // 1.5 * 2^23: adding it rounds to an integer
    let small = x < -87.0;
    let x = x.max(-87.0);
    let n = (x * LOG2E + ROUND) - ROUND;
    let r = x - n * LN2_HI - n * LN2_LO;
    let mut p = EXP_C[0];
    for c in &EXP_C[1..] {
        p = p * r + c;
    }
    let scale = f32::from_bits(((n as i32 + 127) as u32) << 23);
    if small {
        0.0
    } else {
        p * scale
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_matches_std_within_two_ulp() {
        let mut x = -87.0f32;
        while x <= 0.0 {
            let (got, want) = (exp_nonpositive(x), x.exp());
            let ulps = (got.to_bits() as i64 - want.to_bits() as i64).abs();
            assert!(ulps <= 2, "exp({x}) = {got}, std says {want} ({ulps} ulp)");
            x += 0.0137;
        }
        assert_eq!(exp_nonpositive(0.0), 1.0);
        assert_eq!(exp_nonpositive(-100.0), 0.0);
        assert_eq!(exp_nonpositive(f32::NEG_INFINITY), 0.0);
    }

    #[cfg(target_arch = "x86_64")]
    fn has_avx512() -> bool {
        std::arch::is_x86_feature_detected!("avx512f")
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn vector_exp_matches_std_within_two_ulp() {
        use std::arch::x86_64::*;
        if !has_avx512() {
            return;
        }
        let mut xs: Vec<f32> = (0..6400).map(|i| -87.5 + i as f32 * 0.0137).collect();
        xs.extend([0.0, -0.0, -86.99, -87.0, -87.01, -100.0, f32::NEG_INFINITY]);
        xs.resize(xs.len().next_multiple_of(16), 0.0);
        for x in xs.chunks_exact(16) {
            let mut got = [0f32; 16];
            // SAFETY: AVX-512 F is present.
            unsafe {
                _mm512_storeu_ps(
                    got.as_mut_ptr(),
                    avx512_bf16::exp(_mm512_loadu_ps(x.as_ptr())),
                )
            };
            for (&x, &got) in x.iter().zip(&got) {
                let want = if x < -87.0 { 0.0 } else { x.exp() };
                let ulps = (got.to_bits() as i64 - want.to_bits() as i64).abs();
                assert!(ulps <= 2, "exp({x}) = {got}, std says {want} ({ulps} ulp)");
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn vector_bf16_rounding_is_the_scalar_one() {
        use std::arch::x86_64::*;
        if !has_avx512() {
            return;
        }
        let mut xs = vec![
            0.0f32,
            -0.0,
            1.0 + 1.0 / 256.0,
            1.0 + 3.0 / 256.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -f32::NAN,
            f32::from_bits(0x7f80_0001), // signalling NaN
            f32::MAX,
            f32::from_bits(1),
        ];
        let mut bits = 0x1234_5678u32;
        while xs.len() < 4096 {
            bits ^= bits << 13;
            bits ^= bits >> 17;
            bits ^= bits << 5;
            xs.push(f32::from_bits(bits));
        }
        for x in xs.chunks_exact(16) {
            let mut got = [0u32; 16];
            // SAFETY: AVX-512 F is present.
            unsafe {
                _mm512_storeu_si512(
                    got.as_mut_ptr() as *mut _,
                    avx512_bf16::round_bf16(_mm512_loadu_ps(x.as_ptr())),
                )
            };
            for (&x, &got) in x.iter().zip(&got) {
                let want = crate::element::Bf16::from_f32(x).0;
                assert_eq!((got >> 16) as u16, want, "{x:e} ({:#x})", x.to_bits());
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn transpose_sum_adds_up_each_vector() {
        use std::arch::x86_64::*;
        if !has_avx512() {
            return;
        }
        // Small integers: every order of the additions gives the same sums.
        let rows: Vec<[f32; 16]> = (0..16)
            .map(|i| {
                std::array::from_fn(|l| (i * 16 + l) as f32 * if l % 3 == 0 { -1.0 } else { 1.0 })
            })
            .collect();
        let mut got = [0f32; 16];
        // SAFETY: AVX-512 F is present.
        unsafe {
            let v: [__m512; 16] = std::array::from_fn(|i| _mm512_loadu_ps(rows[i].as_ptr()));
            _mm512_storeu_ps(got.as_mut_ptr(), avx512_bf16::transpose_sum(&v));
        }
        for (i, row) in rows.iter().enumerate() {
            assert_eq!(got[i], row.iter().sum::<f32>(), "vector {i}");
        }
    }

    #[test]
    fn dot_sums_every_element_including_the_tail() {
        let a: Vec<f32> = (0..37).map(|i| i as f32).collect();
        let b = vec![2.0f32; 37];
        let want: f32 = (0..37).map(|i| 2.0 * i as f32).sum();
        assert_eq!(dot::<false>(&a, &b), want);
        assert_eq!(dot::<true>(&a, &b), want);
    }
}
