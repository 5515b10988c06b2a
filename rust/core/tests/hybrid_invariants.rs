//! Property tests with mixed cache groups (full, sliding, recurrent state): random adds with
//! shared prefixes, steps (with lookahead, or overlapped with commits lagging), aborts and
//! outside finishes under tiny pools. After every operation the invariants hold in every
//! group (free + referenced = total, no state slot shared by two holders); every token is
//! what the context alone gives; every request ends once; every block and slot is free at
//! the end.

mod common;

use std::collections::{HashMap, HashSet, VecDeque};

use common::hybrid::{next_token, HybridModel};
use common::{record, Outputs};
use iron_batch_core::{CacheGroup, Scheduler, SchedulerConfig};
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    Add {
        prompt: Vec<u32>,
        max_new: usize,
        stop: Option<u32>,
    },
    /// Plain mode: one step with `k` tokens per sampled sequence. Overlapped mode: schedule
    /// one more open step.
    Step(usize),
    /// Overlapped mode: commit the oldest open step.
    Commit,
    Abort(usize),
    Finish(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (prop::collection::vec(0u32..3, 1..16), 0usize..8, prop::option::of(0u32..1000))
            .prop_map(|(prompt, max_new, stop)| Op::Add { prompt, max_new, stop }),
        5 => prop_oneof![4 => Just(1usize), 1 => 2usize..4].prop_map(Op::Step),
        3 => Just(Op::Commit),
        1 => (0usize..64).prop_map(Op::Abort),
        1 => (0usize..64).prop_map(Op::Finish),
    ]
}

fn group() -> impl Strategy<Value = CacheGroup> {
    prop_oneof![
        (3usize..16).prop_map(CacheGroup::full),
        (1usize..9, 2usize..16).prop_map(|(w, n)| CacheGroup::sliding(w, n)),
    ]
}

fn config() -> impl Strategy<Value = SchedulerConfig> {
    (
        prop::collection::vec(group(), 1..4),
        prop::option::of(1usize..7),
        (1usize..5, 1usize..20, 1usize..5, any::<bool>(), 0usize..3),
    )
        .prop_map(
            |(mut groups, state, (bs, tokens, seqs, caching, interval))| {
                if let Some(slots) = state {
                    groups.insert(groups.len() / 2, CacheGroup::state(slots));
                }
                SchedulerConfig {
                    kv_block_size: bs,
                    max_batch_tokens: tokens,
                    max_running_seqs: seqs,
                    enable_prefix_caching: caching,
                    cache_groups: groups,
                    state_checkpoint_interval: interval,
                    ..Default::default()
                }
            },
        )
}

fn cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn run(cfg: SchedulerConfig, ops: Vec<Op>, overlapped: bool) -> Result<(), TestCaseError> {
    let groups = cfg.cache_groups.clone();
    let mut s = Scheduler::new(cfg).unwrap();
    let mut m = HybridModel::new(&groups, s.config().kv_block_size);
    let mut out = Outputs::new();
    let mut open = VecDeque::new();
    let mut prompts = HashMap::new();
    let mut added: Vec<String> = Vec::new();
    let mut ended_outside = HashSet::new();
    for (i, op) in ops.into_iter().enumerate() {
        match op {
            Op::Add {
                prompt,
                max_new,
                stop,
            } => {
                let id = format!("r{i}");
                let stops: Vec<u32> = stop.into_iter().collect();
                if s.add_request(&id, &prompt, max_new, &stops).is_ok() {
                    prompts.insert(id.clone(), (prompt, stops));
                    added.push(id);
                }
            }
            Op::Step(k) if !overlapped => {
                let b = s.schedule_lookahead(k - 1);
                let sampled = m.execute_steps(&b, k);
                let ev = s.commit_steps(&b, &sampled, k).unwrap();
                record(&s, &mut out, &ev);
            }
            Op::Step(_) => {
                let b = s.schedule_overlapped(0).unwrap();
                let sampled = m.execute(&b);
                open.push_back((b, sampled));
            }
            Op::Commit => {
                if let Some((b, sampled)) = open.pop_front() {
                    let ev = s.commit(&b, &sampled).unwrap();
                    record(&s, &mut out, &ev);
                }
            }
            Op::Abort(k) | Op::Finish(k) => {
                if let Some(id) = added.get(k % added.len().max(1)) {
                    let ended = if matches!(op, Op::Abort(_)) {
                        s.abort(id)
                    } else {
                        s.finish(id)
                    };
                    if ended {
                        ended_outside.insert(id.clone());
                    }
                }
            }
        }
        prop_assert_eq!(s.num_open_steps(), open.len());
        s.check_invariants().unwrap();
    }
    let mut steps = 0;
    while s.has_work() || !open.is_empty() {
        if s.has_work() {
            let b = s.schedule_overlapped(0).unwrap();
            let sampled = m.execute(&b);
            open.push_back((b, sampled));
        }
        // Drain to at most one open step (the engine's depth): a pipeline left many steps
        // ahead of its commits holds every in-flight position's window.
        while open.len() > usize::from(overlapped) || (!s.has_work() && !open.is_empty()) {
            let (b, sampled) = open.pop_front().unwrap();
            let ev = s.commit(&b, &sampled).unwrap();
            record(&s, &mut out, &ev);
        }
        s.check_invariants().unwrap();
        steps += 1;
        prop_assert!(steps < 10_000, "scheduler made no progress");
    }
    for u in s.group_usage() {
        prop_assert_eq!((u.used, u.free), (0, u.total), "{:?}", u);
    }
    for id in &added {
        let (got, reason) = out.get(id).cloned().unwrap_or_default();
        prop_assert!(
            reason.is_empty() == ended_outside.contains(id),
            "{} ended {:?}",
            id,
            reason
        );
        let (prompt, stops) = &prompts[id];
        let mut ctx = prompt.clone();
        for (j, &t) in got.iter().enumerate() {
            prop_assert_eq!(t, next_token(&groups, &ctx), "{} token {}", id, j);
            prop_assert!(
                !stops.contains(&t) || j + 1 == got.len(),
                "token after a stop"
            );
            ctx.push(t);
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(600), ..ProptestConfig::default() })]

    #[test]
    fn random_operations_with_mixed_groups_keep_invariants_and_exact_tokens(
        cfg in config(), ops in prop::collection::vec(op(), 1..120),
    ) {
        run(cfg, ops, false)?;
    }

    #[test]
    fn random_overlapped_operations_with_mixed_groups_keep_invariants_and_exact_tokens(
        cfg in config(), ops in prop::collection::vec(op(), 1..120),
    ) {
        run(cfg, ops, true)?;
    }
}
