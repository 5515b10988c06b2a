//! `cargo bench -p iron-batch-kernels --bench decode_attention`: paged decode attention, one
//! layer, at batch 1 and 64 with 208-token contexts, bf16, for SmolLM2's attention shape
//! (9 query heads over 3 kv heads of 64) and Qwen2.5-0.5B's (14 over 2 of 64).

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use iron_batch_kernels::{paged_decode_attention, Bf16, DecodeShape, Element, ScopedThreads};

/// Shape, q, K cache, V cache, block tables, lengths.
type Inputs = (
    DecodeShape,
    Vec<Bf16>,
    Vec<Bf16>,
    Vec<Bf16>,
    Vec<i32>,
    Vec<i32>,
);

fn inputs(seqs: usize, ctx: usize, heads: usize, kv_heads: usize) -> Inputs {
    let (block_size, head_dim) = (16, 64);
    let max_blocks = ctx.div_ceil(block_size);
    let num_blocks = seqs * max_blocks;
    let shape = DecodeShape {
        num_seqs: seqs,
        num_heads: heads,
        num_kv_heads: kv_heads,
        head_dim,
        block_size,
        max_blocks,
        num_blocks,
        sliding_window: 0,
    };
    let cache = |m: usize| -> Vec<Bf16> {
        (0..num_blocks * block_size * kv_heads * head_dim)
            .map(|i| Bf16::from_f32(((i % m) as f32 - (m / 2) as f32) / 64.0))
            .collect()
    };
    let q = (0..seqs * heads * head_dim)
        .map(|i| Bf16::from_f32(((i % 13) as f32 - 6.0) / 8.0))
        .collect();
    // Interleave the sequences' blocks, as a busy pool does.
    let tables = (0..seqs * max_blocks)
        .map(|i| ((i % max_blocks) * seqs + i / max_blocks) as i32)
        .collect();
    (
        shape,
        q,
        cache(97),
        cache(89),
        tables,
        vec![ctx as i32; seqs],
    )
}

fn bench(c: &mut Criterion) {
    for (name, heads, kv_heads) in [("smollm2", 9, 3), ("qwen05", 14, 2)] {
        let mut group = c.benchmark_group(format!("paged_decode_attention_bf16_{name}"));
        for (seqs, threads) in [(1, 1), (64, 1), (64, 2)] {
            let (shape, q, k, v, tables, lens) = inputs(seqs, 208, heads, kv_heads);
            let mut out = vec![Bf16::default(); q.len()];
            let id = BenchmarkId::new(format!("seqs{seqs}"), format!("threads{threads}"));
            group.bench_function(id, |b| {
                b.iter(|| {
                    paged_decode_attention(
                        &mut out,
                        &q,
                        &k,
                        &v,
                        &tables,
                        &lens,
                        &shape,
                        0.125,
                        0.0,
                        threads,
                        &ScopedThreads,
                    )
                    .unwrap()
                })
            });
        }
        group.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
