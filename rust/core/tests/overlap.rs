//! Overlapped scheduling: the next step is scheduled while earlier ones are still open
//! (executed on the device, not committed). Tokens must equal a sequential run's under
//! preemption, chunked prefill, prefix hits and random stop tokens; every invariant holds
//! after every operation; no block leaks.

mod common;

use std::collections::{HashMap, HashSet, VecDeque};

use common::{record, run_overlapped, run_to_completion, FakeModel, Outputs, VOCAB};
use iron_batch_core::{FinishReason, RequestOptions, Scheduler, SchedulerConfig, SchedulerError};
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

/// (prompt, max_new_tokens) per request, and the stop token ids every request shares.
type Workload = (Vec<(Vec<u32>, usize)>, Vec<u32>);

fn run(w: &Workload, c: SchedulerConfig, depth: Option<usize>) -> (Outputs, u64) {
    let mut s = Scheduler::new(c.clone()).unwrap();
    for (i, (p, n)) in w.0.iter().enumerate() {
        s.add_request(&format!("r{i}"), p, *n, &w.1).unwrap();
    }
    let mut model = FakeModel::default();
    let out = match depth {
        None => run_to_completion(&mut s, &mut model),
        Some(d) => run_overlapped(&mut s, &mut model, d),
    };
    assert_eq!(s.allocator().num_free(), c.total_kv_blocks, "blocks leaked");
    s.check_invariants().unwrap();
    (out, s.stats().preemptions)
}

fn workload() -> impl Strategy<Value = Workload> {
    (
        prop::collection::vec(0u32..50, 0..10),
        prop::collection::vec((prop::collection::vec(0u32..50, 1..10), 1usize..14), 1..10),
        // About 0 to 10% of the vocabulary stops a request.
        prop::collection::vec(0u32..VOCAB, 0..100),
    )
        .prop_map(|(shared, reqs, stops)| {
            let reqs = reqs
                .into_iter()
                .map(|(own, n)| (shared.iter().chain(&own).copied().collect(), n))
                .collect();
            (reqs, stops)
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    #[test]
    fn overlapped_output_equals_sequential_output(w in workload()) {
        let (reference, _) = run(&w, cfg(4096, 2, 4096, 64), None);
        for depth in [1, 2] {
            for c in [cfg(4096, 2, 4096, 64), cfg(17, 2, 3, 64), cfg(20, 2, 64, 3),
                      cfg(4096, 2, 5, 64)] {
                let (got, _) = run(&w, c.clone(), Some(depth));
                prop_assert_eq!(&got, &reference, "depth {} config {:?}", depth, c);
            }
        }
    }
}

/// Request options: a priority, a cache salt out of two, and no prefix-cache lookup.
fn options() -> impl Strategy<Value = RequestOptions> {
    (-2i64..3, prop::option::of(0u8..2), any::<bool>()).prop_map(|(priority, salt, skip)| {
        RequestOptions {
            priority,
            cache_salt: salt.map(|k| vec![k]),
            skip_prefix_cache: skip,
            ..Default::default()
        }
    })
}

fn run_with(
    w: &Workload,
    opts: &[RequestOptions],
    c: SchedulerConfig,
    depth: Option<usize>,
) -> Outputs {
    let mut s = Scheduler::new(c.clone()).unwrap();
    for (i, ((p, n), o)) in w.0.iter().zip(opts.iter().cycle()).enumerate() {
        s.add_request_with(&format!("r{i}"), p, *n, &w.1, o)
            .unwrap();
    }
    let mut model = FakeModel::default();
    let out = match depth {
        None => run_to_completion(&mut s, &mut model),
        Some(d) => run_overlapped(&mut s, &mut model, d),
    };
    assert_eq!(s.allocator().num_free(), c.total_kv_blocks, "blocks leaked");
    s.check_invariants().unwrap();
    out
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    /// Priorities (queue and running order, preemption victim), salts and skipped lookups
    /// change which sequence runs when, never a token: overlapped equals sequential.
    #[test]
    fn overlapped_output_equals_sequential_output_with_request_options(
        w in workload(), opts in prop::collection::vec(options(), 1..10),
    ) {
        let reference = run_with(&w, &opts, cfg(4096, 2, 4096, 64), None);
        for depth in [1, 2] {
            for c in [cfg(17, 2, 3, 64), cfg(20, 2, 64, 3), cfg(4096, 2, 5, 64)] {
                let got = run_with(&w, &opts, c.clone(), Some(depth));
                prop_assert_eq!(&got, &reference, "depth {} config {:?}", depth, c);
            }
        }
    }
}

#[test]
fn a_tiny_pool_preempts_with_tokens_in_flight_and_still_matches() {
    let reqs: Vec<(Vec<u32>, usize)> = (0..10u32)
        .map(|i| {
            (
                (0..(2 + i % 4)).map(|t| t * 7 + i).collect(),
                6 + i as usize % 5,
            )
        })
        .collect();
    let w: Workload = (reqs, vec![]);
    let (reference, _) = run(&w, cfg(4096, 2, 4096, 64), None);
    for depth in [1, 2, 3] {
        let (got, pre) = run(&w, cfg(12, 2, 64, 64), Some(depth));
        assert!(pre > 0, "depth {depth}: the pool should preempt");
        assert_eq!(got, reference, "depth {depth}");
    }
}

/// Blocks of 4; "a" has 3 prompt tokens and may generate 3.
fn one_request(max_new: usize, stops: &[u32]) -> Scheduler {
    let mut s = Scheduler::new(cfg(8, 4, 64, 8)).unwrap();
    s.add_request("a", &[1, 2, 3], max_new, stops).unwrap();
    s
}

#[test]
fn the_next_step_feeds_a_placeholder_for_the_pending_token() {
    let mut s = one_request(3, &[]);
    s.add_request("b", &[4, 5], 3, &[]).unwrap();
    let b1 = s.schedule_overlapped(0).unwrap();
    assert!(b1.pending_token_indices.is_empty());
    assert_eq!(b1.sample_indices, vec![2, 4]);
    // Step 1 is open: both sequences decode their unknown sampled token.
    let b2 = s.schedule_overlapped(0).unwrap();
    assert_eq!(b2.input_ids, vec![0, 0]);
    assert_eq!(b2.positions, vec![3, 2]);
    assert_eq!(b2.pending_token_indices, vec![0, 1]);
    assert_eq!(b2.pending_sample_rows, vec![0, 1]);
    assert_eq!(b2.seq_lens, vec![4, 3]);
    assert_eq!(b2.num_computed_before, vec![3, 2]);
    assert_eq!(s.num_open_steps(), 2);
    s.check_invariants().unwrap();
    // Commits come oldest first.
    assert!(matches!(
        s.commit(&b2, &[7, 8]),
        Err(SchedulerError::BatchMismatch(_))
    ));
    let ev = s.commit(&b1, &[10, 11]).unwrap();
    assert_eq!(
        ev.iter().map(|e| e.token).collect::<Vec<_>>(),
        [Some(10), Some(11)]
    );
    // Step 3 reads step 2's rows; the committed token 10 is an ordinary input now.
    let b3 = s.schedule_overlapped(0).unwrap();
    assert_eq!(b3.positions, vec![4, 3]);
    assert_eq!(b3.pending_sample_rows, vec![0, 1]);
    s.commit(&b2, &[12, 13]).unwrap();
    let ev = s.commit(&b3, &[14, 15]).unwrap();
    assert!(ev.iter().all(|e| e.finish == Some(FinishReason::Length)));
    assert_eq!(s.allocator().num_free(), 8);
    s.check_invariants().unwrap();
}

#[test]
fn a_sequence_whose_pending_token_reaches_its_length_is_not_scheduled_again() {
    let mut s = one_request(1, &[]);
    let b1 = s.schedule_overlapped(0).unwrap();
    let b2 = s.schedule_overlapped(0).unwrap();
    assert!(b2.is_empty(), "no slot is wasted on a known finish");
    let ev = s.commit(&b1, &[9]).unwrap();
    assert_eq!(ev[0].finish, Some(FinishReason::Length));
    s.commit(&b2, &[]).unwrap();
    assert_eq!(s.allocator().num_free(), 8);
    assert!(!s.has_work());
}

#[test]
fn a_stop_token_wastes_one_row_and_nothing_of_it_leaks() {
    let mut s = one_request(5, &[9]);
    let b1 = s.schedule_overlapped(0).unwrap();
    let b2 = s.schedule_overlapped(0).unwrap();
    assert_eq!(b2.num_seqs(), 1);
    let ev = s.commit(&b1, &[9]).unwrap();
    assert_eq!(ev.len(), 1);
    assert_eq!(ev[0].finish, Some(FinishReason::Stop));
    assert!(!s.is_live("a"));
    assert_eq!(
        s.allocator().num_free(),
        8,
        "freed at the commit that stopped it"
    );
    assert!(
        s.commit(&b2, &[4]).unwrap().is_empty(),
        "the wasted row emits nothing"
    );
    assert_eq!(s.num_open_steps(), 0);
    s.check_invariants().unwrap();
}

#[test]
fn a_sequence_preempted_with_a_pending_token_keeps_it_and_resumes_after_its_commits() {
    // Two blocks of 2: "a" and "b" each hold one block after their prompts; the next
    // step needs a second block for each, so "b" (admitted last) is preempted.
    let mut s = Scheduler::new(cfg(2, 2, 64, 8)).unwrap();
    s.add_request("a", &[1], 3, &[]).unwrap();
    s.add_request("b", &[2], 3, &[]).unwrap();
    let b1 = s.schedule_overlapped(0).unwrap();
    let b2 = s.schedule_overlapped(0).unwrap();
    assert_eq!(b2.num_seqs(), 2, "position 1 still fits the first block");
    let b3 = s.schedule_overlapped(0).unwrap();
    assert_eq!(s.stats().preemptions, 1);
    assert_eq!(b3.num_seqs(), 1);
    assert_eq!(s.num_waiting(), 1);
    s.check_invariants().unwrap();
    // "b" waits with two pending tokens: it is not re-admitted before they are committed.
    let b4 = s.schedule_overlapped(0).unwrap();
    assert_eq!(s.num_waiting(), 1);
    s.check_invariants().unwrap();
    let ev = s.commit(&b1, &[5, 6]).unwrap();
    assert_eq!(ev.len(), 2);
    let ev = s.commit(&b2, &[7, 8]).unwrap();
    assert_eq!(
        ev.len(),
        2,
        "the preempted sequence keeps the token sampled for it"
    );
    assert_eq!(s.sequence("b").unwrap().output(), [6, 8]);
    assert_eq!(s.sequence("b").unwrap().num_computed, 0);
    s.commit(&b3, &[9]).unwrap();
    s.commit(&b4, &[]).unwrap();
    assert!(!s.is_live("a"));
    // Now "b" resumes over prompt + both tokens and samples its last one.
    let b5 = s.schedule_overlapped(0).unwrap();
    assert_eq!(b5.input_ids, vec![2, 6, 8]);
    let ev = s.commit(&b5, &[3]).unwrap();
    assert_eq!(ev[0].finish, Some(FinishReason::Length));
    assert_eq!(s.allocator().num_free(), 2);
    s.check_invariants().unwrap();
}

#[test]
fn lookahead_does_not_overlap_an_open_step() {
    let mut s = one_request(5, &[]);
    let b1 = s.schedule_overlapped(2).unwrap();
    assert!(matches!(
        s.schedule_overlapped(0),
        Err(SchedulerError::BatchMismatch(_))
    ));
    s.commit_steps(&b1, &[4, 5, 6], 3).unwrap();
    let b2 = s.schedule_overlapped(0).unwrap();
    assert!(matches!(
        s.schedule_overlapped(1),
        Err(SchedulerError::BatchMismatch(_))
    ));
    s.commit(&b2, &[7]).unwrap();
    assert_eq!(s.sequence("a").unwrap().output(), [4, 5, 6, 7]);
}

#[test]
fn a_plain_schedule_discards_open_steps_and_computes_their_tokens_again() {
    let mut s = one_request(3, &[]);
    let b1 = s.schedule_overlapped(0).unwrap();
    let _b2 = s.schedule_overlapped(0).unwrap();
    let b3 = s.schedule();
    assert_eq!(
        b3.input_ids,
        vec![1, 2, 3],
        "the prompt again, no placeholder"
    );
    assert!(b3.pending_token_indices.is_empty());
    assert!(matches!(
        s.commit(&b1, &[4]),
        Err(SchedulerError::BatchMismatch(_))
    ));
    s.commit(&b3, &[4]).unwrap();
    s.check_invariants().unwrap();
    assert_eq!(s.sequence("a").unwrap().output(), [4]);
}

#[derive(Debug, Clone)]
enum Op {
    Add {
        prompt: Vec<u32>,
        max_new: usize,
        stops: Vec<u32>,
        opts: RequestOptions,
    },
    /// Schedule (overlapped) and run one more step.
    Schedule,
    /// Commit the oldest open step.
    Commit,
    Abort(usize),
    /// End a live request from outside, as a stop string does.
    Finish(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (prop::collection::vec(0u32..4, 1..14), 0usize..8,
              prop::collection::vec(0u32..VOCAB, 0..150), options())
            .prop_map(|(prompt, max_new, stops, opts)| Op::Add { prompt, max_new, stops, opts }),
        5 => Just(Op::Schedule),
        4 => Just(Op::Commit),
        1 => (0usize..64).prop_map(Op::Abort),
        1 => (0usize..64).prop_map(Op::Finish),
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

    /// Random adds, overlapped schedules (any number of open steps), commits, aborts and
    /// outside finishes, with random stop tokens: invariants after every operation, each
    /// request ends exactly once, no event after its end, and every block is free at the end.
    #[test]
    fn random_overlapped_operations_keep_invariants(
        cfg in config(), ops in prop::collection::vec(op(), 1..150),
    ) {
        let bs = cfg.kv_block_size;
        let total = cfg.total_kv_blocks;
        let mut s = Scheduler::new(cfg).unwrap();
        let mut model = FakeModel::default();
        let mut open = VecDeque::new();
        let mut out = HashMap::new();
        let mut added: Vec<String> = Vec::new();
        let mut ended_outside = HashSet::new();
        for (i, op) in ops.into_iter().enumerate() {
            match op {
                Op::Add { prompt, max_new, stops, opts } => {
                    let id = format!("r{i}");
                    if s.add_request_with(&id, &prompt, max_new, &stops, &opts).is_ok() {
                        added.push(id);
                    }
                }
                Op::Schedule => {
                    let b = s.schedule_overlapped(0).unwrap();
                    let sampled = model.execute(&b, bs);
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
                        let ended = if matches!(op, Op::Abort(_)) { s.abort(id) } else { s.finish(id) };
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
                let sampled = model.execute(&b, bs);
                open.push_back((b, sampled));
            }
            if open.len() > 1 || !s.has_work() {
                let (b, sampled) = open.pop_front().unwrap();
                let ev = s.commit(&b, &sampled).unwrap();
                record(&s, &mut out, &ev);
            }
            s.check_invariants().unwrap();
            steps += 1;
            prop_assert!(steps < 10_000, "scheduler made no progress");
        }
        prop_assert_eq!(s.allocator().num_free(), total);
        for id in &added {
            let finished = out.get(id).map(|(_, r)| !r.is_empty()).unwrap_or(false);
            prop_assert!(finished != ended_outside.contains(id), "{} finished {}", id, finished);
        }
    }
}
