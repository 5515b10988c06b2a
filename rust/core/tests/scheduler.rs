mod common;

use common::{run_to_completion, FakeModel};
use iron_batch_core::{FinishReason, Scheduler, SchedulerConfig, SchedulerError};

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

#[test]
fn first_step_prefills_and_samples_then_decodes_one_token_each() {
    let mut s = Scheduler::new(cfg(16, 4, 64, 8)).unwrap();
    s.add_request("a", &[1, 2, 3, 4, 5], 3, &[]).unwrap();
    s.add_request("b", &[6, 7], 3, &[]).unwrap();
    let b = s.schedule();
    assert!(!b.is_empty());
    assert_eq!(b.input_ids, vec![1, 2, 3, 4, 5, 6, 7]);
    assert_eq!(b.positions, vec![0, 1, 2, 3, 4, 0, 1]);
    assert_eq!(b.query_start_loc, vec![0, 5, 7]);
    assert_eq!(b.seq_lens, vec![5, 2]);
    // a got blocks 0,1; b got block 2.
    assert_eq!(b.block_tables, vec![0, 1, 2, 0]);
    assert_eq!(b.slot_mapping, vec![0, 1, 2, 3, 4, 8, 9]);
    assert_eq!(b.sample_indices, vec![4, 6]);
    let ev = s.commit(&b, &[10, 11]).unwrap();
    assert_eq!(ev.len(), 2);
    assert_eq!(ev[0].token, Some(10));

    let b = s.schedule();
    assert_eq!(b.input_ids, vec![10, 11]);
    assert_eq!(b.positions, vec![5, 2]);
    assert_eq!(b.slot_mapping, vec![5, 10]);
    assert_eq!(b.num_computed_before, vec![5, 2]);
}

#[test]
fn long_prompt_is_chunked_across_steps_under_the_token_budget() {
    let mut s = Scheduler::new(cfg(16, 4, 4, 8)).unwrap();
    let prompt: Vec<u32> = (1..=10).collect();
    s.add_request("a", &prompt, 1, &[]).unwrap();
    let b = s.schedule();
    assert_eq!(b.input_ids, vec![1, 2, 3, 4]);
    assert!(b.sample_indices.is_empty());
    assert!(s.commit(&b, &[]).unwrap().is_empty());
    let b = s.schedule();
    assert_eq!(b.input_ids, vec![5, 6, 7, 8]);
    s.commit(&b, &[]).unwrap();
    let b = s.schedule();
    assert_eq!(b.input_ids, vec![9, 10]);
    assert_eq!(b.sample_indices, vec![1]);
    let ev = s.commit(&b, &[42]).unwrap();
    assert_eq!(ev[0].finish, Some(FinishReason::Length));
    assert_eq!(s.allocator().num_free(), 16);
}

#[test]
fn decodes_and_a_prefill_chunk_share_one_step() {
    let mut s = Scheduler::new(cfg(32, 4, 5, 8)).unwrap();
    s.add_request("a", &[1, 2], 5, &[]).unwrap();
    let b = s.schedule();
    s.commit(&b, &[3]).unwrap();
    s.add_request("b", &(10..20).collect::<Vec<_>>(), 2, &[])
        .unwrap();
    let b = s.schedule();
    // One decode for a, then four prompt tokens of b within the budget of five.
    assert_eq!(b.input_ids, vec![3, 10, 11, 12, 13]);
    assert_eq!(b.sample_indices, vec![0]);
}

#[test]
fn max_running_seqs_limits_admission() {
    let mut s = Scheduler::new(cfg(32, 4, 100, 2)).unwrap();
    for id in ["a", "b", "c"] {
        s.add_request(id, &[1, 2], 4, &[]).unwrap();
    }
    let b = s.schedule();
    assert_eq!(b.num_seqs(), 2);
    assert_eq!(s.num_waiting(), 1);
}

#[test]
fn out_of_blocks_preempts_the_most_recent_and_admits_nobody_that_step() {
    // 4 blocks of 2: a and b each take 2 blocks for 3 prompt tokens + first output.
    let mut s = Scheduler::new(cfg(4, 2, 100, 8)).unwrap();
    let mut model = FakeModel::default();
    s.add_request("a", &[1, 2, 3], 4, &[]).unwrap();
    s.add_request("b", &[4, 5, 6], 4, &[]).unwrap();
    let b = s.schedule();
    assert_eq!(b.num_seqs(), 2);
    let first = model.execute(&b, 2);
    s.commit(&b, &first).unwrap();
    let b = s.schedule(); // decodes at position 3 still fit in each second block
    assert_eq!(b.num_seqs(), 2);
    let second = model.execute(&b, 2);
    s.commit(&b, &second).unwrap();
    s.add_request("c", &[9], 1, &[]).unwrap();
    // a's next decode at position 4 needs a third block: none is free.
    let b = s.schedule();
    assert_eq!(s.stats().preemptions, 1);
    assert_eq!(b.num_seqs(), 1, "b was preempted, c not admitted");
    assert_eq!(b.input_ids, vec![i64::from(second[0])]);
    assert_eq!(s.num_waiting(), 2);
    s.check_invariants().unwrap();
    let third = model.execute(&b, 2);
    s.commit(&b, &third).unwrap();
    // b resumes before c, re-prefilling prompt + its generated tokens.
    let out = run_to_completion(&mut s, &mut model);
    assert_eq!(
        out["b"].0.len(),
        2,
        "b's last two of four tokens come after resume"
    );
    assert_eq!(out["c"].1, "length");
    assert_eq!(s.allocator().num_free(), 4);
}

#[test]
fn stop_token_finishes_with_stop_and_frees_blocks_tail_first() {
    let mut s = Scheduler::new(cfg(8, 2, 100, 8)).unwrap();
    s.add_request("a", &[1, 2, 3, 4, 5], 10, &[99]).unwrap();
    let b = s.schedule();
    let blocks: Vec<i32> = b.block_tables.clone();
    let ev = s.commit(&b, &[99]).unwrap();
    assert_eq!(ev[0].finish, Some(FinishReason::Stop));
    assert!(!s.has_work());
    let q = s.allocator().free_queue();
    let n = q.len();
    let tail: Vec<u32> = blocks.iter().rev().map(|&b| b as u32).collect();
    assert_eq!(&q[n - 3..], &tail[..], "tail block freed first");
}

#[test]
fn requests_that_can_never_fit_are_rejected_at_add() {
    let mut s = Scheduler::new(SchedulerConfig {
        max_model_len: Some(20),
        ..cfg(4, 4, 100, 8)
    })
    .unwrap();
    assert!(matches!(
        s.add_request("a", &[1; 10], 7, &[]),
        Err(SchedulerError::Rejected(m)) if m.contains("KV pool of 16 tokens")
    ));
    assert!(matches!(
        s.add_request("a", &[], 1, &[]),
        Err(SchedulerError::Rejected(_))
    ));
    s.add_request("a", &[1; 10], 6, &[]).unwrap();
    assert_eq!(
        s.add_request("a", &[1], 1, &[]),
        Err(SchedulerError::DuplicateRequest("a".into()))
    );
    let mut s2 = Scheduler::new(SchedulerConfig {
        max_model_len: Some(8),
        ..cfg(64, 4, 100, 8)
    })
    .unwrap();
    assert!(matches!(
        s2.add_request("x", &[1; 6], 3, &[]),
        Err(SchedulerError::Rejected(m)) if m.contains("model context of 8")
    ));
    assert_eq!(s2.stats().requests_added, 0);
}

#[test]
fn zero_new_tokens_finishes_without_model_work() {
    let mut s = Scheduler::new(cfg(8, 4, 100, 8)).unwrap();
    s.add_request("z", &[1, 2, 3], 0, &[]).unwrap();
    assert!(s.has_work());
    let b = s.schedule();
    assert!(b.is_empty());
    let ev = s.commit(&b, &[]).unwrap();
    assert_eq!(ev.len(), 1);
    assert_eq!(ev[0].token, None);
    assert_eq!(ev[0].finish, Some(FinishReason::Length));
    assert!(!s.has_work());
    // The id can be used again once it ended.
    s.add_request("z", &[1], 1, &[]).unwrap();
}

#[test]
fn abort_in_any_state_frees_everything() {
    let mut s = Scheduler::new(cfg(8, 2, 3, 1)).unwrap();
    s.add_request("run", &[1, 2, 3, 4, 5], 4, &[]).unwrap();
    s.add_request("wait", &[1, 2], 4, &[]).unwrap();
    let b = s.schedule(); // run is mid-prefill, wait is waiting
    assert!(s.abort("wait"));
    assert!(s.abort("run"));
    assert!(!s.abort("run"));
    // Committing the stale batch skips the aborted sequence.
    assert!(s.commit(&b, &[]).unwrap().is_empty());
    assert_eq!(s.allocator().num_free(), 8);
    assert!(!s.has_work());
    s.check_invariants().unwrap();
    assert_eq!(s.stats().requests_aborted, 2);
}

#[test]
fn commit_rejects_stale_batches_and_wrong_sample_counts() {
    let mut s = Scheduler::new(cfg(8, 2, 100, 8)).unwrap();
    s.add_request("a", &[1, 2], 4, &[]).unwrap();
    let old = s.schedule();
    let new = s.schedule();
    assert!(matches!(
        s.commit(&old, &[1]),
        Err(SchedulerError::BatchMismatch(_))
    ));
    assert!(matches!(
        s.commit(&new, &[1, 2]),
        Err(SchedulerError::BatchMismatch(_))
    ));
    s.commit(&new, &[1]).unwrap();
    match s.commit(&new, &[1]) {
        Err(SchedulerError::BatchMismatch(m)) => {
            assert_eq!(
                m,
                "batch of step 2 is not the next open step (none) (already committed)"
            );
        }
        other => panic!("expected a mismatch, got {other:?}"),
    }
    // A discarded step was never committed: the message does not say it was.
    let stale = s.schedule();
    let fresh = s.schedule();
    match s.commit(&stale, &[]) {
        Err(SchedulerError::BatchMismatch(m)) => {
            assert_eq!(m, "batch of step 3 is not the next open step (4)");
        }
        other => panic!("expected a mismatch, got {other:?}"),
    }
    s.commit(&fresh, &[1]).unwrap();
}

#[test]
fn prefix_cache_serves_a_shared_prompt_and_counts_hits() {
    let mut s = Scheduler::new(cfg(16, 4, 100, 8)).unwrap();
    let prompt: Vec<u32> = (1..=10).collect();
    s.add_request("a", &prompt, 1, &[]).unwrap();
    let mut model = FakeModel::default();
    let first = run_to_completion(&mut s, &mut model);
    s.add_request("b", &prompt, 1, &[]).unwrap();
    let b = s.schedule();
    // Two full blocks (8 tokens) come from the cache; only 2 tokens are computed.
    assert_eq!(b.input_ids, vec![9, 10]);
    assert_eq!(s.sequence("b").unwrap().num_cached_prompt, Some(8));
    let sampled = model.execute(&b, 4);
    s.commit(&b, &sampled).unwrap();
    assert_eq!(sampled, first["a"].0, "same context, same token");
    assert_eq!(s.stats().prefix_cache_hit_tokens, 8);
    assert_eq!(s.stats().prefix_cache_query_tokens, 20);
}

#[test]
fn output_blocks_are_published_so_a_follow_up_turn_reuses_them() {
    let mut s = Scheduler::new(cfg(16, 4, 100, 8)).unwrap();
    s.add_request("turn1", &[1, 2, 3], 6, &[]).unwrap();
    let mut model = FakeModel::default();
    let out = run_to_completion(&mut s, &mut model);
    // prompt 3 + 6 outputs: 8 tokens had KV computed (the last sampled one did not).
    let mut next: Vec<u32> = vec![1, 2, 3];
    next.extend(&out["turn1"].0);
    next.extend([500, 501]);
    s.add_request("turn2", &next, 1, &[]).unwrap();
    let b = s.schedule();
    assert_eq!(b.num_computed_before, vec![8]);
}

#[test]
fn a_request_that_exactly_fills_the_pool_or_the_context_is_accepted() {
    // Pool of 4 blocks of 4 = 16 tokens: 16 fit, 17 never do.
    let mut s = Scheduler::new(cfg(4, 4, 100, 8)).unwrap();
    assert_eq!(s.max_sequence_tokens(), 16);
    s.add_request("fits", &[1; 12], 4, &[]).unwrap();
    assert!(matches!(
        s.add_request("over", &[1; 12], 5, &[]),
        Err(SchedulerError::Rejected(_))
    ));
    // It runs to its last token in the pool it fills.
    let out = run_to_completion(&mut s, &mut FakeModel::default());
    assert_eq!(out["fits"].0.len(), 4);
    assert_eq!(out["fits"].1, "length");

    // Context of 10 tokens in a larger pool: 10 fit, 11 never do.
    let mut s = Scheduler::new(SchedulerConfig {
        max_model_len: Some(10),
        ..cfg(64, 4, 100, 8)
    })
    .unwrap();
    assert_eq!(s.max_sequence_tokens(), 10);
    s.add_request("fits", &[1; 7], 3, &[]).unwrap();
    assert!(matches!(
        s.add_request("over", &[1; 7], 4, &[]),
        Err(SchedulerError::Rejected(m)) if m.contains("model context of 10")
    ));
    assert_eq!(s.stats().requests_added, 1);
}

#[test]
fn config_validation_names_each_unusable_field_at_its_edge() {
    let ok = cfg(16, 4, 64, 8);
    assert_eq!(ok.validate(), Ok(()));
    assert_eq!(SchedulerConfig::default().validate(), Ok(()));
    let edges_ok = [
        SchedulerConfig {
            kv_block_size: 4096,
            ..ok.clone()
        },
        SchedulerConfig {
            kv_block_size: 1,
            max_batch_tokens: 1,
            max_running_seqs: 1,
            total_kv_blocks: 1,
            max_model_len: Some(1),
            ..ok.clone()
        },
        SchedulerConfig {
            total_kv_blocks: u32::MAX as usize - 1,
            ..ok.clone()
        },
    ];
    for c in edges_ok {
        assert_eq!(c.validate(), Ok(()), "{c:?}");
    }
    let bad = [
        (
            SchedulerConfig {
                total_kv_blocks: 0,
                ..ok.clone()
            },
            "total_kv_blocks",
        ),
        (
            SchedulerConfig {
                total_kv_blocks: u32::MAX as usize,
                ..ok.clone()
            },
            "total_kv_blocks",
        ),
        (
            SchedulerConfig {
                kv_block_size: 0,
                ..ok.clone()
            },
            "kv_block_size",
        ),
        (
            SchedulerConfig {
                kv_block_size: 4097,
                ..ok.clone()
            },
            "kv_block_size",
        ),
        (
            SchedulerConfig {
                max_batch_tokens: 0,
                ..ok.clone()
            },
            "max_batch_tokens",
        ),
        (
            SchedulerConfig {
                max_running_seqs: 0,
                ..ok.clone()
            },
            "max_running_seqs",
        ),
        (
            SchedulerConfig {
                max_model_len: Some(0),
                ..ok.clone()
            },
            "max_model_len",
        ),
    ];
    for (c, field) in bad {
        let err = c.validate().unwrap_err();
        assert!(err.starts_with(field), "{c:?}: {err}");
        // The scheduler refuses it with the same message.
        assert_eq!(
            Scheduler::new(c).unwrap_err(),
            SchedulerError::Rejected(err)
        );
    }
}

#[test]
fn lookahead_reserves_one_step_per_token_the_request_may_still_take() {
    // Blocks of 4; "a" may generate 3 tokens, "b" 10. Lookahead 5 asks for up to 6 steps.
    let mut s = Scheduler::new(cfg(32, 4, 100, 8)).unwrap();
    s.add_request("a", &[1, 2, 3], 3, &[]).unwrap();
    s.add_request("b", &[4, 5, 6], 10, &[]).unwrap();
    let b = s.schedule_lookahead(5);
    assert_eq!(b.sample_max_steps, vec![3, 6]);
    // a writes KV for positions 0..=4 (its last sampled token gets none): 2 blocks. b
    // writes 0..=7: 2 blocks. Nothing more is taken.
    assert_eq!(b.block_tables.len(), 2 * b.max_blocks);
    assert_eq!(b.max_blocks, 2);
    assert_eq!(s.allocator().num_free(), 28);
    let sampled = [10, 11, 12, 0, 0, 0, 20, 21, 22, 23, 24, 25];
    let ev = s.commit_steps(&b, &sampled, 6).unwrap();
    assert_eq!(ev.len(), 3 + 6);
    assert_eq!(ev[2].finish, Some(FinishReason::Length));
    assert!(ev[3..].iter().all(|e| e.finish.is_none()));
    s.check_invariants().unwrap();

    // b has 4 tokens left: lookahead 5 now asks for 4; lookahead 1 for 2; none for 1.
    let b1 = s.schedule_lookahead(1);
    assert_eq!(b1.sample_max_steps, vec![2]);
    let b2 = s.schedule_lookahead(5);
    assert_eq!(b2.sample_max_steps, vec![4]);
    // b holds 9 tokens of KV after this step plus 3 more: 12 slots in 3 blocks.
    assert_eq!(b2.max_blocks, 3);
    let b3 = s.schedule();
    assert_eq!(b3.sample_max_steps, vec![1]);
}

#[test]
fn a_step_whose_token_budget_runs_out_takes_nobody_else() {
    // Budget 4: "a"'s 4 prompt tokens use it whole; "b" waits with no empty entry.
    let mut s = Scheduler::new(cfg(16, 4, 4, 8)).unwrap();
    s.add_request("a", &[1, 2, 3, 4], 4, &[]).unwrap();
    s.add_request("b", &[5, 6], 4, &[]).unwrap();
    let b = s.schedule();
    assert_eq!(b.num_seqs(), 1);
    assert_eq!(b.num_tokens(), 4);
    assert_eq!((s.num_running(), s.num_waiting()), (1, 1));
}

#[test]
fn live_requests_and_the_running_count_follow_each_state() {
    let mut s = Scheduler::new(cfg(16, 4, 100, 1)).unwrap();
    assert!(!s.is_live("a"));
    s.add_request("a", &[1, 2], 2, &[]).unwrap();
    s.add_request("b", &[3], 2, &[]).unwrap();
    assert!(s.is_live("a") && s.is_live("b"));
    assert_eq!((s.num_running(), s.num_waiting()), (0, 2));
    let b = s.schedule();
    assert_eq!((s.num_running(), s.num_waiting()), (1, 1));
    s.commit(&b, &[5]).unwrap();
    assert_eq!(s.sequence("a").unwrap().output(), [5]);
    assert_eq!(s.sequence("a").unwrap().num_output(), 1);
    assert!(s.finish("a"));
    assert!(!s.is_live("a"));
    assert!(!s.finish("a"));
    assert_eq!((s.num_running(), s.num_waiting()), (0, 1));
    assert!(s.abort("b"));
    assert!(!s.is_live("b"));
    assert!(!s.has_work());
}

#[test]
fn stats_count_every_request_outcome_and_cache_lookup() {
    let mut s = Scheduler::new(cfg(16, 4, 100, 8)).unwrap();
    let mut model = FakeModel::default();
    let prompt: Vec<u32> = (1..=9).collect();
    // Finishes by length.
    s.add_request("len", &prompt, 2, &[]).unwrap();
    run_to_completion(&mut s, &mut model);
    // No tokens to generate: finished without model work.
    s.add_request("zero", &[1], 0, &[]).unwrap();
    // Stopped from outside, and aborted, after the first step; both share len's prompt.
    s.add_request("stopped", &prompt, 5, &[]).unwrap();
    s.add_request("aborted", &prompt, 5, &[]).unwrap();
    let b = s.schedule();
    let sampled = model.execute(&b, 4);
    s.commit(&b, &sampled).unwrap();
    assert!(s.finish("stopped"));
    assert!(s.abort("aborted"));
    // A request the pool can never hold is not counted.
    assert!(s.add_request("huge", &[1; 65], 1, &[]).is_err());
    let st = s.stats();
    assert_eq!(st.requests_added, 4);
    assert_eq!(st.requests_finished, 3);
    assert_eq!(st.requests_aborted, 1);
    // Three admissions looked up 9 tokens each; the last two found len's two full blocks.
    assert_eq!(st.prefix_cache_queries, 3);
    assert_eq!(st.prefix_cache_query_tokens, 27);
    assert_eq!(st.prefix_cache_hit_tokens, 16);
    assert_eq!(st.preemptions, 0);
}

#[test]
fn with_caching_off_no_lookup_is_counted() {
    let mut s = Scheduler::new(SchedulerConfig {
        enable_prefix_caching: false,
        ..cfg(16, 4, 100, 8)
    })
    .unwrap();
    let prompt: Vec<u32> = (1..=9).collect();
    for id in ["a", "b"] {
        s.add_request(id, &prompt, 1, &[]).unwrap();
        run_to_completion(&mut s, &mut FakeModel::default());
    }
    assert_eq!(s.stats().prefix_cache_queries, 0);
    assert_eq!(s.stats().prefix_cache_query_tokens, 0);
    assert_eq!(s.stats().prefix_cache_hit_tokens, 0);
    assert_eq!(s.allocator().num_cached(), 0);
}

#[test]
fn preemptions_are_counted_per_request_and_in_total() {
    // Three blocks of 2 tokens: "a" and "b" start, then a's growth pushes b out.
    let mut s = Scheduler::new(cfg(3, 2, 100, 8)).unwrap();
    let mut model = FakeModel::default();
    s.add_request("a", &[1, 2], 3, &[]).unwrap();
    s.add_request("b", &[3], 3, &[]).unwrap();
    let mut per_request = 0;
    while s.has_work() {
        let b = s.schedule();
        let sampled = model.execute(&b, 2);
        per_request = s
            .sequence("b")
            .map_or(per_request, |q| u64::from(q.num_preemptions));
        s.commit(&b, &sampled).unwrap();
        s.check_invariants().unwrap();
    }
    assert!(per_request >= 1, "b was never preempted");
    assert_eq!(s.stats().preemptions, per_request);
}
