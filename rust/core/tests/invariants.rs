//! Property tests: random add/schedule/commit/abort sequences under tiny KV pools keep every
//! invariant after every operation, finish every request exactly once and leak no block.

mod common;

use std::collections::{HashMap, HashSet};

use common::{record, FakeModel};
use iron_batch_core::{Scheduler, SchedulerConfig};
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    Add {
        prompt: Vec<u32>,
        max_new: usize,
        stop: Option<u32>,
    },
    /// One step with `k` tokens per sampled sequence (k - 1 lookahead steps).
    Step(usize),
    Abort(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (prop::collection::vec(0u32..4, 1..14), 0usize..8, prop::option::of(0u32..1000))
            .prop_map(|(prompt, max_new, stop)| Op::Add { prompt, max_new, stop }),
        6 => prop_oneof![4 => Just(1usize), 1 => 2usize..5].prop_map(Op::Step),
        1 => (0usize..64).prop_map(Op::Abort),
    ]
}

/// `PROPTEST_CASES` from the environment (for long soak runs), else `default`.
fn cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn config() -> impl Strategy<Value = SchedulerConfig> {
    (3usize..12, 1usize..5, 1usize..20, 1usize..5, any::<bool>()).prop_map(
        |(blocks, bs, tokens, seqs, caching)| SchedulerConfig {
            total_kv_blocks: blocks,
            kv_block_size: bs,
            max_batch_tokens: tokens,
            max_running_seqs: seqs,
            enable_prefix_caching: caching,
            max_model_len: None,
            ..Default::default()
        },
    )
}

proptest! {
    // A long run: PROPTEST_CASES=200000 cargo test --release -p iron-batch-core --test invariants
    #![proptest_config(ProptestConfig { cases: cases(1000), ..ProptestConfig::default() })]

    #[test]
    fn random_operations_keep_invariants(cfg in config(), ops in prop::collection::vec(op(), 1..120)) {
        let bs = cfg.kv_block_size;
        let total = cfg.total_kv_blocks;
        let mut s = Scheduler::new(cfg).unwrap();
        let mut model = FakeModel::default();
        let mut out = HashMap::new();
        let mut added: Vec<String> = Vec::new();
        let mut aborted = HashSet::new();
        for (i, op) in ops.into_iter().enumerate() {
            match op {
                Op::Add { prompt, max_new, stop } => {
                    let id = format!("r{i}");
                    let stops: Vec<u32> = stop.into_iter().collect();
                    if s.add_request(&id, &prompt, max_new, &stops).is_ok() {
                        added.push(id);
                    } else {
                        prop_assert!(prompt.len() + max_new > total * bs);
                    }
                }
                Op::Step(k) => {
                    let b = s.schedule_lookahead(k - 1);
                    let sampled = model.execute_steps(&b, bs, k);
                    let ev = s.commit_steps(&b, &sampled, k).unwrap();
                    record(&s, &mut out, &ev);
                }
                Op::Abort(k) => {
                    if let Some(id) = added.get(k % added.len().max(1)) {
                        if s.abort(id) {
                            aborted.insert(id.clone());
                        }
                    }
                }
            }
            s.check_invariants().unwrap();
        }
        let mut steps = 0;
        while s.has_work() {
            let b = s.schedule();
            let sampled = model.execute(&b, bs);
            let ev = s.commit(&b, &sampled).unwrap();
            record(&s, &mut out, &ev);
            s.check_invariants().unwrap();
            steps += 1;
            prop_assert!(steps < 10_000, "scheduler made no progress");
        }
        prop_assert_eq!(s.allocator().num_free(), total);
        for id in &added {
            let finished = out.get(id).map(|(_, r)| !r.is_empty()).unwrap_or(false);
            prop_assert!(finished != aborted.contains(id), "{} finished {} aborted {}", id, finished, aborted.contains(id));
        }
    }
}
