//! Software prefetch for the GEMV kernels' weight streams.
//!
//! At batch 1 a GEMV reads each weight once, straight from memory. Interleaved with the
//! arithmetic, one thread's loads alone kept about half of the bandwidth a plain streaming
//! read gets (a 30-layer pass of SmolLM2's Q4 projections: 12.5 against 25 GB/s on one
//! thread); asking for the rows a fixed distance ahead closed part of that gap (5.8 ->
//! 4.9 ms for that pass, one thread).

/// How far ahead of what a kernel reads now its weights are requested (bytes).
pub(crate) const AHEAD: usize = 8 * 1024;

/// Asks the caches for the 64-byte line [`AHEAD`] bytes after `at`: called once per line
/// a kernel reads, it keeps the requests spread evenly through the loop.
#[inline(always)]
pub(crate) fn prefetch_line_ahead(at: *const u8) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        // SAFETY: a prefetch is a hint; it does not access memory architecturally.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(AHEAD) as *const i8) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = at;
}

/// As [`prefetch_line_ahead`], but into L2 only (`prefetcht1`). A request into L1 holds
/// one of the core's few L1 miss buffers until its line arrives, which caps the reads in
/// flight; L2 tracks more. Where memory answers slowly this keeps more of it busy: the bf16
/// GEMV at one row over a Qwen3.5-4B shape's MLP matrices read 26 against 22 GB/s (a
/// 2-vCPU Xeon whose copy bandwidth read 26 GB/s), and the first loop iterations that touch the line find it
/// in L2 a few cycles away.
#[inline(always)]
pub(crate) fn prefetch_line_ahead_l2(at: *const u8) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
        // SAFETY: a prefetch is a hint; it does not access memory architecturally.
        unsafe { _mm_prefetch::<_MM_HINT_T1>(at.wrapping_add(AHEAD) as *const i8) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = at;
}

/// Asks the caches for the `len` bytes that start [`AHEAD`] bytes after `at`, one line
/// after another. A hint: addresses past the end of the matrix are never read and cannot
/// fault.
#[inline(always)]
pub(crate) fn prefetch_ahead(at: *const u8, len: usize) {
    for offset in (0..len).step_by(64) {
        prefetch_line_ahead(at.wrapping_add(offset));
    }
}
