//! `cargo bench -p iron-batch-kernels --bench instruction_rates`: how long one of the GEMVs'
//! multiply instructions takes on this core, by itself: `vdpbf16ps` (32 bf16 products),
//! an f32 FMA (16 products) and `vpdpbusd` (64 byte products), each on 512-bit registers.
//!
//! Each is timed in chains that depend on themselves only: with 16 chains side by side the
//! core issues them as fast as it can (the time per instruction is its issue rate), with
//! 2 chains each instruction waits on the one before it (twice the time per instruction
//! is its latency). Every chain starts from a different value and ends in `black_box`, so
//! the compiler can neither merge the chains nor drop them. Needs AVX-512 BF16 and VNNI;
//! elsewhere it says so and stops.

#[cfg(target_arch = "x86_64")]
mod rates {
    use std::arch::x86_64::*;
    use std::hint::black_box;
    use std::time::Instant;

    const INSTRUCTIONS: usize = 1 << 27;

    /// Nanoseconds per instruction of `step` over `CHAINS` independent chains.
    #[inline(always)]
    unsafe fn time<T: Copy, const CHAINS: usize>(
        start: impl Fn(usize) -> T,
        step: impl Fn(T) -> T,
    ) -> f64 {
        let mut chains: [T; CHAINS] = std::array::from_fn(|c| black_box(start(c)));
        let rounds = INSTRUCTIONS / CHAINS;
        let t = Instant::now();
        for _ in 0..rounds {
            for c in chains.iter_mut() {
                *c = step(*c);
            }
        }
        let elapsed = t.elapsed().as_secs_f64();
        black_box(chains);
        elapsed * 1e9 / (rounds * CHAINS) as f64
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512bf16,avx512vnni")]
    unsafe fn measure<const CHAINS: usize>() -> [f64; 3] {
        let a: __m512bh = std::mem::transmute(_mm512_set1_epi16(0x3f80));
        let b: __m512bh = std::mem::transmute(_mm512_set1_epi16(0x3f81));
        let (x, y) = (_mm512_set1_ps(1.0001), _mm512_set1_ps(0.9999));
        let (u, v) = (_mm512_set1_epi8(3), _mm512_set1_epi8(5));
        [
            time::<_, CHAINS>(
                |c| _mm512_set1_ps(c as f32),
                |acc| _mm512_dpbf16_ps(acc, a, b),
            ),
            time::<_, CHAINS>(
                |c| _mm512_set1_ps(c as f32),
                |acc| _mm512_fmadd_ps(acc, x, y),
            ),
            time::<_, CHAINS>(
                |c| _mm512_set1_epi32(c as i32),
                |acc| _mm512_dpbusd_epi32(acc, u, v),
            ),
        ]
    }

    pub fn main() {
        let has = is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512bf16")
            && is_x86_feature_detected!("avx512vnni");
        if !has {
            println!("this CPU lacks AVX-512 BF16 or VNNI: nothing to time");
            return;
        }
        // SAFETY: the features were detected above.
        let (wide, narrow) = unsafe {
            measure::<16>(); // warm-up: the core at its working clock
            (measure::<16>(), measure::<2>())
        };
        println!("| instruction (512-bit) | products | ns each, 16 chains (issue) | ns each, 2 chains x 2 (latency) |");
        println!("|---|---|---|---|");
        for (i, (name, products)) in [("vdpbf16ps", 32), ("vfmadd231ps", 16), ("vpdpbusd", 64)]
            .iter()
            .enumerate()
        {
            println!(
                "| {name} | {products} | {:.3} | {:.3} |",
                wide[i],
                2.0 * narrow[i]
            );
        }
    }
}

fn main() {
    #[cfg(target_arch = "x86_64")]
    rates::main();
}
