//! Per-request options: priority (queue and preemption order), cache salt (no prefix
//! sharing across salts) and skipping the prefix-cache lookup (prompt logprobs).

mod common;

use std::collections::HashMap;

use common::{record, run_to_completion, FakeModel, Outputs};
use iron_batch_core::{RequestOptions, Scheduler, SchedulerConfig, SeqState};
use proptest::prelude::*;

fn cfg(blocks: usize, bs: usize, tokens: usize, seqs: usize) -> SchedulerConfig {
    SchedulerConfig {
        total_kv_blocks: blocks,
        kv_block_size: bs,
        max_batch_tokens: tokens,
        max_running_seqs: seqs,
        enable_prefix_caching: true,
        max_model_len: None,
        ..Default::default()
    }
}

fn prio(p: i64) -> RequestOptions {
    RequestOptions {
        priority: p,
        ..RequestOptions::default()
    }
}

fn salted(salt: &str) -> RequestOptions {
    RequestOptions {
        cache_salt: Some(salt.as_bytes().to_vec()),
        ..RequestOptions::default()
    }
}

fn step(s: &mut Scheduler, model: &mut FakeModel, out: &mut Outputs) -> Vec<String> {
    let bs = s.config().kv_block_size;
    let b = s.schedule();
    let ids = b
        .entries
        .iter()
        .map(|e| s.request_id(e.slot).to_string())
        .collect();
    let sampled = model.execute(&b, bs);
    let ev = s.commit(&b, &sampled).unwrap();
    record(s, out, &ev);
    s.check_invariants().unwrap();
    ids
}

#[test]
fn waiting_requests_are_admitted_by_priority_then_arrival() {
    // One sequence runs at a time: the admission order is the queue order.
    let mut s = Scheduler::new(cfg(16, 4, 64, 1)).unwrap();
    let (mut model, mut out) = (FakeModel::default(), Outputs::new());
    s.add_request_with("late-low", &[1], 1, &[], &prio(5))
        .unwrap();
    s.add_request_with("mid-a", &[2], 1, &[], &prio(0)).unwrap();
    s.add_request_with("high", &[3], 1, &[], &prio(-3)).unwrap();
    s.add_request_with("mid-b", &[4], 1, &[], &prio(0)).unwrap();
    let mut order = Vec::new();
    while s.has_work() {
        order.extend(step(&mut s, &mut model, &mut out));
    }
    assert_eq!(order, ["high", "mid-a", "mid-b", "late-low"]);
}

#[test]
fn preemption_takes_the_lowest_priority_first_and_it_resumes_after_the_higher() {
    // 4 blocks of 2. "low" arrives first and "high" second; both fill 2 blocks, then one
    // decode needs a third block: the victim is "low" although it arrived first.
    let mut s = Scheduler::new(cfg(4, 2, 100, 8)).unwrap();
    let (mut model, mut out) = (FakeModel::default(), Outputs::new());
    s.add_request_with("low", &[1, 2, 3], 4, &[], &prio(1))
        .unwrap();
    s.add_request_with("high", &[4, 5, 6], 4, &[], &prio(0))
        .unwrap();
    assert_eq!(step(&mut s, &mut model, &mut out), ["high", "low"]);
    assert_eq!(step(&mut s, &mut model, &mut out), ["high", "low"]);
    assert_eq!(step(&mut s, &mut model, &mut out), ["high"]);
    assert_eq!(s.stats().preemptions, 1);
    assert_eq!(s.sequence("low").unwrap().state, SeqState::Waiting);
    assert_eq!(s.sequence("low").unwrap().num_preemptions, 1);
    let rest = run_to_completion(&mut s, &mut model);
    assert_eq!(rest["high"].1, "length");
    assert_eq!(rest["low"].1, "length");
    assert_eq!(s.allocator().num_free(), 4);
}

#[test]
fn equal_priorities_keep_arrival_order_for_preemption() {
    let mut s = Scheduler::new(cfg(4, 2, 100, 8)).unwrap();
    let (mut model, mut out) = (FakeModel::default(), Outputs::new());
    s.add_request("a", &[1, 2, 3], 4, &[]).unwrap();
    s.add_request("b", &[4, 5, 6], 4, &[]).unwrap();
    step(&mut s, &mut model, &mut out);
    step(&mut s, &mut model, &mut out);
    assert_eq!(step(&mut s, &mut model, &mut out), ["a"]);
    assert_eq!(s.sequence("b").unwrap().num_preemptions, 1);
}

#[test]
fn the_same_salt_shares_prefix_blocks_and_another_salt_or_none_does_not() {
    let prompt: Vec<u32> = (10..20).collect(); // two full blocks of 4 before the last token
    let run = |first: RequestOptions, second: RequestOptions| -> usize {
        let mut s = Scheduler::new(cfg(32, 4, 64, 8)).unwrap();
        let mut model = FakeModel::default();
        s.add_request_with("a", &prompt, 2, &[], &first).unwrap();
        run_to_completion(&mut s, &mut model);
        s.add_request_with("b", &prompt, 2, &[], &second).unwrap();
        let b = s.schedule();
        let hit = s.sequence("b").unwrap().num_cached_prompt.unwrap();
        s.commit(&b, &model.execute(&b, 4)).unwrap();
        run_to_completion(&mut s, &mut model);
        s.check_invariants().unwrap();
        assert_eq!(s.allocator().num_free(), 32);
        hit
    };
    assert_eq!(run(salted("t1"), salted("t1")), 8);
    assert_eq!(run(RequestOptions::default(), RequestOptions::default()), 8);
    assert_eq!(run(salted("t1"), salted("t2")), 0);
    assert_eq!(run(salted("t1"), RequestOptions::default()), 0);
    assert_eq!(run(RequestOptions::default(), salted("t1")), 0);
    assert_eq!(run(salted(""), RequestOptions::default()), 0);
}

#[test]
fn skipping_the_prefix_cache_computes_every_prompt_token_and_still_publishes() {
    let prompt: Vec<u32> = (10..20).collect();
    let mut s = Scheduler::new(cfg(32, 4, 64, 8)).unwrap();
    let mut model = FakeModel::default();
    s.add_request("warm", &prompt, 1, &[]).unwrap();
    run_to_completion(&mut s, &mut model);
    let skip = RequestOptions {
        skip_prefix_cache: true,
        ..RequestOptions::default()
    };
    s.add_request_with("scored", &prompt, 1, &[], &skip)
        .unwrap();
    let b = s.schedule();
    assert_eq!(
        b.num_tokens(),
        prompt.len(),
        "every prompt token is computed"
    );
    assert_eq!(b.num_computed_before, [0]);
    assert_eq!(s.sequence("scored").unwrap().num_cached_prompt, Some(0));
    let queries = s.stats().prefix_cache_queries;
    s.commit(&b, &model.execute(&b, 4)).unwrap();
    run_to_completion(&mut s, &mut model);
    // A later plain request still finds the prompt's blocks.
    s.add_request("plain", &prompt, 1, &[]).unwrap();
    let b = s.schedule();
    assert_eq!(b.num_computed_before, [8]);
    assert_eq!(s.stats().prefix_cache_queries, queries + 1);
    s.commit(&b, &model.execute(&b, 4)).unwrap();
    assert_eq!(s.allocator().num_free(), 32);
}

#[derive(Debug, Clone)]
enum Op {
    Add {
        prompt: Vec<u32>,
        max_new: usize,
        priority: i64,
        salt: Option<u8>,
    },
    Step,
    Abort(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (prop::collection::vec(0u32..4, 1..14), 1usize..8, 0i64..3,
              prop::option::of(0u8..2))
            .prop_map(|(prompt, max_new, priority, salt)| Op::Add { prompt, max_new, priority, salt }),
        6 => Just(Op::Step),
        1 => (0usize..64).prop_map(Op::Abort),
    ]
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

fn cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(1000), ..ProptestConfig::default() })]

    /// A higher-priority request is never starved by lower ones: in no step is a request
    /// admitted while one of higher priority still waits, and no request is preempted while
    /// one of lower priority keeps running. Salts change nothing about this, every request
    /// still ends, and every block is free at the end.
    #[test]
    fn higher_priority_is_never_overtaken_by_lower(cfg in config(),
                                                   ops in prop::collection::vec(op(), 1..120)) {
        let bs = cfg.kv_block_size;
        let total = cfg.total_kv_blocks;
        let mut s = Scheduler::new(cfg).unwrap();
        let mut model = FakeModel::default();
        let mut out = Outputs::new();
        let mut live: Vec<(String, i64)> = Vec::new();
        let mut finished_or_aborted = 0usize;
        let mut added = 0usize;
        let mut run_step = |s: &mut Scheduler, live: &mut Vec<(String, i64)>| -> Result<(), TestCaseError> {
            let before: HashMap<String, (SeqState, u32)> = live.iter()
                .filter_map(|(id, _)| s.sequence(id).map(|q| (id.clone(), (q.state, q.num_preemptions))))
                .collect();
            let b = s.schedule();
            let mut admitted = Vec::new();
            let mut preempted = Vec::new();
            let (mut waiting_best, mut running_worst) = (i64::MAX, i64::MIN);
            for (id, p) in live.iter() {
                let Some(q) = s.sequence(id) else { continue };
                let (state0, pre0) = before[id];
                if state0 == SeqState::Waiting && q.state == SeqState::Running {
                    admitted.push(*p);
                }
                if q.num_preemptions > pre0 {
                    preempted.push(*p);
                }
                match q.state {
                    SeqState::Waiting => waiting_best = waiting_best.min(*p),
                    SeqState::Running => running_worst = running_worst.max(*p),
                }
            }
            for p in admitted {
                prop_assert!(p <= waiting_best, "priority {} admitted while {} waits", p, waiting_best);
            }
            for p in preempted {
                prop_assert!(p >= running_worst, "priority {} preempted while {} runs", p, running_worst);
            }
            let sampled = model.execute(&b, bs);
            let ev = s.commit(&b, &sampled).unwrap();
            record(s, &mut out, &ev);
            live.retain(|(id, _)| s.is_live(id));
            Ok(())
        };
        for (i, op) in ops.into_iter().enumerate() {
            match op {
                Op::Add { prompt, max_new, priority, salt } => {
                    let id = format!("r{i}");
                    let opts = RequestOptions {
                        priority,
                        cache_salt: salt.map(|x| vec![x]),
                        skip_prefix_cache: false,
                        ..Default::default()
                    };
                    if s.add_request_with(&id, &prompt, max_new, &[], &opts).is_ok() {
                        live.push((id, priority));
                        added += 1;
                    }
                }
                Op::Step => run_step(&mut s, &mut live)?,
                Op::Abort(k) => {
                    if !live.is_empty() {
                        let (id, _) = live.remove(k % live.len());
                        prop_assert!(s.abort(&id));
                        finished_or_aborted += 1;
                    }
                }
            }
            s.check_invariants().unwrap();
        }
        let mut steps = 0;
        while s.has_work() {
            run_step(&mut s, &mut live)?;
            s.check_invariants().unwrap();
            steps += 1;
            prop_assert!(steps < 10_000, "scheduler made no progress");
        }
        finished_or_aborted += out.values().filter(|(_, r)| !r.is_empty()).count();
        prop_assert_eq!(finished_or_aborted, added);
        prop_assert_eq!(s.allocator().num_free(), total);
    }
}
