//! Exactness: with a fake model whose next token depends on the whole context (read back
//! through the block tables), every request's output is identical whether the pool is tiny
//! (many preemptions, chunked prefill) or huge, and with the prefix cache on or off.

mod common;

use common::{run_lookahead, run_to_completion, FakeModel, Outputs};
use iron_batch_core::{BlockHash, Scheduler, SchedulerConfig};
use proptest::prelude::*;

type Workload = Vec<(Vec<u32>, usize)>;

fn run(w: &Workload, cfg: SchedulerConfig) -> (Outputs, u64, u64) {
    let mut s = Scheduler::new(cfg.clone()).unwrap();
    for (i, (p, n)) in w.iter().enumerate() {
        s.add_request(&format!("r{i}"), p, *n, &[]).unwrap();
    }
    let out = run_to_completion(&mut s, &mut FakeModel::default());
    assert_eq!(s.allocator().num_free(), cfg.total_kv_blocks);
    (
        out,
        s.stats().preemptions,
        s.stats().prefix_cache_hit_tokens,
    )
}

fn workload() -> impl Strategy<Value = Workload> {
    // Prompts share a common start so the prefix cache has something to serve.
    (
        prop::collection::vec(0u32..50, 0..12),
        prop::collection::vec((prop::collection::vec(0u32..50, 1..10), 1usize..12), 1..12),
    )
        .prop_map(|(shared, reqs)| {
            reqs.into_iter()
                .map(|(own, n)| (shared.iter().chain(&own).copied().collect(), n))
                .collect()
        })
}

fn cfg(blocks: usize, tokens: usize, caching: bool) -> SchedulerConfig {
    SchedulerConfig {
        total_kv_blocks: blocks,
        kv_block_size: 2,
        max_batch_tokens: tokens,
        max_running_seqs: 64,
        enable_prefix_caching: caching,
        max_model_len: None,
        ..Default::default()
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    #[test]
    fn output_is_identical_with_and_without_preemption(w in workload()) {
        let (reference, pre, _) = run(&w, cfg(4096, 4096, false));
        prop_assert_eq!(pre, 0);
        // 17 blocks of 2 hold the longest request (at most 33 tokens) but not many together.
        for c in [cfg(17, 3, true), cfg(17, 3, false), cfg(20, 64, true), cfg(4096, 5, true)] {
            let (got, _, _) = run(&w, c);
            prop_assert_eq!(&got, &reference);
        }
    }
}

#[test]
fn tiny_pool_preempts_often_and_still_matches() {
    let w: Workload = (0..16u32)
        .map(|i| {
            (
                (0..(5 + i % 7)).map(|t| t * 3 + i).collect(),
                8 + (i as usize % 5),
            )
        })
        .collect();
    let (reference, _, _) = run(&w, cfg(4096, 4096, true));
    let (got, preemptions, _) = run(&w, cfg(14, 8, true));
    assert!(preemptions >= 10, "only {preemptions} preemptions");
    assert_eq!(got, reference);
    let (got, _, _) = run(&w, cfg(14, 8, false));
    assert_eq!(got, reference);
}

#[test]
fn shared_prefix_hits_the_cache_and_matches() {
    let shared: Vec<u32> = (100..140).collect();
    let w: Workload = (0..8u32)
        .map(|i| (shared.iter().copied().chain([i, i + 1]).collect(), 6))
        .collect();
    let (reference, _, no_hits) = run(&w, cfg(4096, 4096, false));
    assert_eq!(no_hits, 0);
    // A budget of 42 tokens admits the first prompt alone; once its prefill is committed
    // the other seven each find the 20 shared blocks (40 tokens) in the cache.
    let (got, _, hits) = run(&w, cfg(4096, 42, true));
    assert_eq!(got, reference);
    assert_eq!(hits, 7 * 40);
}

#[test]
fn lookahead_steps_give_the_same_tokens_and_honour_stops() {
    let w: Workload = (0..12u32)
        .map(|i| {
            (
                (0..(3 + i % 5)).map(|t| t + i).collect(),
                5 + (i as usize % 9),
            )
        })
        .collect();
    let run_k = |cfg: SchedulerConfig, k: usize, stop: &[u32]| {
        let mut s = Scheduler::new(cfg.clone()).unwrap();
        for (i, (p, n)) in w.iter().enumerate() {
            s.add_request(&format!("r{i}"), p, *n, stop).unwrap();
        }
        let out = run_lookahead(&mut s, &mut FakeModel::default(), k);
        assert_eq!(s.allocator().num_free(), cfg.total_kv_blocks);
        (out, s.stats().preemptions)
    };
    let (reference, _) = run_k(cfg(4096, 4096, true), 1, &[]);
    for k in [2, 4, 8] {
        assert_eq!(run_k(cfg(4096, 4096, true), k, &[]).0, reference, "k={k}");
        let (small, pre) = run_k(cfg(16, 6, true), k, &[]);
        assert!(pre > 0, "k={k}: the small pool should preempt");
        assert_eq!(small, reference, "k={k} under preemption");
    }
    // A stop token met mid-way ends the request there; the surplus is discarded.
    let stop = reference["r3"].0[2];
    let (with_stop, _) = run_k(cfg(4096, 4096, true), 4, &[stop]);
    let (want, _) = run_k(cfg(4096, 4096, true), 1, &[stop]);
    assert_eq!(with_stop, want);
    assert_eq!(with_stop["r3"].1, "stop");
    assert!(with_stop["r3"].0.len() <= 3);
}

/// Every block gets the same hash, so every cache lookup meets a collision unless the
/// content is the one block the cache holds.
fn all_collide(_parent: Option<BlockHash>, _tokens: &[u32]) -> BlockHash {
    7
}

#[test]
fn colliding_block_hashes_cost_misses_never_wrong_tokens() {
    // Prompts that share their first blocks, and prompts that differ from the first token.
    let shared: Vec<u32> = (100..108).collect();
    let w: Workload = (0..10u32)
        .map(|i| {
            let start: Vec<u32> = if i % 2 == 0 {
                shared.clone()
            } else {
                vec![i; 5]
            };
            (start.into_iter().chain([i, i + 1, i + 2]).collect(), 4)
        })
        .collect();
    let (reference, _, _) = run(&w, cfg(4096, 4096, false));
    for c in [cfg(4096, 12, true), cfg(24, 12, true), cfg(12, 5, true)] {
        let mut s = Scheduler::with_hasher(c.clone(), all_collide).unwrap();
        for (i, (p, n)) in w.iter().enumerate() {
            s.add_request(&format!("r{i}"), p, *n, &[]).unwrap();
        }
        let got = run_to_completion(&mut s, &mut FakeModel::default());
        assert_eq!(got, reference, "{c:?}");
        assert_eq!(s.allocator().num_free(), c.total_kv_blocks);
        // The cache holds one block at a time: whatever hit was that one first block.
        assert!(s.stats().prefix_cache_hit_tokens <= 2 * w.len() as u64);
    }
}

#[test]
fn a_prompt_whose_first_block_collides_gets_nothing_from_the_cache() {
    let c = cfg(64, 64, true);
    let mut s = Scheduler::with_hasher(c, all_collide).unwrap();
    let mut model = FakeModel::default();
    s.add_request("first", &[1, 2, 3, 4, 5], 2, &[]).unwrap();
    let first = run_to_completion(&mut s, &mut model);
    assert_eq!(s.allocator().num_cached(), 1);
    s.add_request("other", &[6, 7, 3, 4, 5], 2, &[]).unwrap();
    s.add_request("same", &[1, 2, 3, 4, 5], 2, &[]).unwrap();
    let b = s.schedule();
    assert_eq!(s.sequence("other").unwrap().num_cached_prompt, Some(0));
    // Only the block the cache holds is served: [1, 2] without a parent.
    assert_eq!(s.sequence("same").unwrap().num_cached_prompt, Some(2));
    let sampled = model.execute(&b, 2);
    s.commit(&b, &sampled).unwrap();
    assert_eq!(
        sampled[1], first["first"].0[0],
        "same prompt, same first token"
    );
    let (reference, _, _) = run(
        &vec![(vec![6, 7, 3, 4, 5], 2), (vec![1, 2, 3, 4, 5], 2)],
        cfg(4096, 4096, false),
    );
    assert_eq!(sampled[0], reference["r0"].0[0]);
}
