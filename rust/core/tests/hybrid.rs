//! Cache groups: sliding windows release what no position still to compute can read, state
//! slots follow their sequences, checkpoints serve prefix hits, and every pool is whole
//! again after every workload.

mod common;

use std::collections::{HashMap, VecDeque};

use common::hybrid::{next_token, HybridModel};
use common::{record, Outputs};
use iron_batch_core::{Batch, CacheGroup, Scheduler, SchedulerConfig, SchedulerError};

fn cfg(groups: Vec<CacheGroup>, bs: usize, tokens: usize, seqs: usize) -> SchedulerConfig {
    SchedulerConfig {
        kv_block_size: bs,
        max_batch_tokens: tokens,
        max_running_seqs: seqs,
        cache_groups: groups,
        ..Default::default()
    }
}

/// Row 0's table in group `g` and its offset.
fn table(b: &Batch, g: usize, row: usize) -> (Vec<i32>, i32) {
    let off = b.block_table_offsets[g * b.num_seqs() + row];
    let t = b.group_table(g, row);
    let width = if g == 0 {
        b.max_blocks
    } else {
        b.group_max_blocks
    };
    (t[..width].to_vec(), off)
}

fn step(s: &mut Scheduler, m: &mut HybridModel, out: &mut Outputs) -> Batch {
    let b = s.schedule();
    let sampled = m.execute(&b);
    let ev = s.commit(&b, &sampled).unwrap();
    record(s, out, &ev);
    s.check_invariants().unwrap();
    b
}

/// Every request's output is what the context alone gives, token by token.
fn assert_exact(groups: &[CacheGroup], prompts: &HashMap<String, Vec<u32>>, out: &Outputs) {
    for (id, prompt) in prompts {
        let (got, _) = &out[id];
        let mut ctx = prompt.clone();
        for (i, &t) in got.iter().enumerate() {
            assert_eq!(t, next_token(groups, &ctx), "{id}: token {i}");
            ctx.push(t);
        }
    }
}

/// Steps until nothing is left to do.
fn drain(s: &mut Scheduler, m: &mut HybridModel, out: &mut Outputs) {
    while s.has_work() {
        step(s, m, out);
    }
}

fn assert_all_free(s: &Scheduler) {
    let usage = s.group_usage();
    assert_eq!(
        usage.len(),
        s.config().groups().len(),
        "one usage entry per group"
    );
    for u in usage {
        assert_eq!((u.used, u.free), (0, u.total), "{u:?}");
    }
}

#[test]
fn a_sliding_group_peaks_at_its_window_and_chunk_over_misaligned_blocks() {
    // Window 16 and one new token, blocks of 16: the 16 positions read may straddle two
    // blocks; 17 of them (a chunk of 2) still fit two, 18 need three.
    assert_eq!(CacheGroup::sliding_peak_blocks(16, 1, 16), 2);
    assert_eq!(CacheGroup::sliding_peak_blocks(16, 2, 16), 3);
    assert_eq!(CacheGroup::sliding_peak_blocks(1, 1, 4), 2);
    assert_eq!(CacheGroup::sliding_peak_blocks(6, 8, 4), 5);
}

#[test]
fn usage_reports_every_group_with_what_it_holds() {
    let groups = vec![CacheGroup::full(16), CacheGroup::sliding(6, 12)];
    let mut s = Scheduler::new(cfg(groups, 4, 8, 4)).unwrap();
    s.add_request("a", &(100..110).collect::<Vec<u32>>(), 4, &[])
        .unwrap();
    let _batch = s.schedule();
    let usage = s.group_usage();
    assert_eq!(
        usage.iter().map(|u| u.total).collect::<Vec<_>>(),
        vec![16, 12]
    );
    // The first chunk of 8 tokens holds two blocks in each group.
    assert_eq!(usage.iter().map(|u| u.used).collect::<Vec<_>>(), vec![2, 2]);
    assert!(usage.iter().all(|u| u.used + u.free == u.total));
}

#[test]
fn a_sliding_group_releases_exactly_the_blocks_before_every_window_still_to_compute() {
    // Blocks of 4, window 6, chunks of 8 tokens: a 14-token prompt and 6 new tokens.
    let groups = vec![CacheGroup::full(16), CacheGroup::sliding(6, 16)];
    let mut s = Scheduler::new(cfg(groups.clone(), 4, 8, 4)).unwrap();
    let mut m = HybridModel::new(&groups, 4);
    let mut out = Outputs::new();
    let prompt: Vec<u32> = (100..114).collect();
    s.add_request("a", &prompt, 6, &[]).unwrap();

    // Chunk 0..8: two blocks in each group.
    let b = step(&mut s, &mut m, &mut out);
    assert_eq!(table(&b, 0, 0), (vec![0, 1], 0));
    assert_eq!(table(&b, 1, 0), (vec![0, 1], 0));
    // Chunk 8..14: position 8 still reads from 3 on, so nothing is released yet.
    let b = step(&mut s, &mut m, &mut out);
    assert_eq!(table(&b, 1, 0), (vec![0, 1, 2, 3], 0));
    assert_eq!(
        b.group_slot_mapping,
        (8..14).map(|p| p as i64).collect::<Vec<_>>()
    );
    // Decode of position 14 reads 9..=14: blocks 0 and 1 (tokens 0..8) go, oldest first
    // to the back of the free queue.
    let b = step(&mut s, &mut m, &mut out);
    assert_eq!(table(&b, 1, 0), (vec![2, 3], 2));
    assert_eq!(
        table(&b, 0, 0),
        (vec![0, 1, 2, 3], 0),
        "the full group keeps all"
    );
    let q = s.group_allocator(1).free_queue();
    assert_eq!(&q[q.len() - 2..], [0, 1]);
    // Position 15 reads 10..=15, still from block 2.
    let b = step(&mut s, &mut m, &mut out);
    assert_eq!(table(&b, 1, 0), (vec![2, 3], 2));
    // Position 16 needs a fifth logical block: the front of the free queue, block 4.
    let b = step(&mut s, &mut m, &mut out);
    assert_eq!(table(&b, 1, 0), (vec![2, 3, 4], 2));
    assert_eq!(b.group_slot_mapping, [16]);
    // Position 17 reads 12..=17: block 2 (tokens 8..12) goes.
    let b = step(&mut s, &mut m, &mut out);
    assert_eq!(table(&b, 1, 0), (vec![3, 4], 3));
    assert_eq!(table(&b, 0, 0).0, [0, 1, 2, 3, 4]);
    // Position 18 reads 13..=18: still from block 3.
    let b = step(&mut s, &mut m, &mut out);
    assert_eq!(table(&b, 1, 0), (vec![3, 4], 3));
    assert_eq!(s.stats().sliding_blocks_released, 3);
    assert!(!s.has_work());
    assert_eq!(out["a"].0.len(), 6);
    assert_exact(&groups, &HashMap::from([("a".to_string(), prompt)]), &out);
    assert_all_free(&s);
}

#[test]
fn a_sliding_group_releases_during_chunked_prefill_and_stays_bounded() {
    // Window 4, chunks of 4 over a 40-token prompt: at most the window before a chunk and
    // the chunk itself are held, never the whole prompt.
    // (The never-fits bound allows for unaligned chunks: 5 blocks.)
    let groups = vec![CacheGroup::sliding(4, 5)];
    let mut s = Scheduler::new(cfg(groups.clone(), 2, 4, 1)).unwrap();
    let mut m = HybridModel::new(&groups, 2);
    let mut out = Outputs::new();
    let prompt: Vec<u32> = (0..40).collect();
    s.add_request("a", &prompt, 3, &[]).unwrap();
    let mut offsets = Vec::new();
    while s.has_work() {
        let b = step(&mut s, &mut m, &mut out);
        let (t, off) = table(&b, 0, 0);
        assert!(t.len() <= 4, "{t:?}");
        offsets.push(off);
    }
    // A chunk from position p reads from p - 3: offset (p - 3) / 2 blocks of 2; then the
    // decodes of positions 40 and 41.
    assert_eq!(offsets, [0, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 19]);
    assert_exact(&groups, &HashMap::from([("a".to_string(), prompt)]), &out);
    assert_all_free(&s);
}

#[test]
fn a_cached_prefix_serves_a_sliding_group_only_with_the_blocks_of_its_last_window() {
    let groups = vec![CacheGroup::full(32), CacheGroup::sliding(6, 8)];
    let mut s = Scheduler::new(cfg(groups.clone(), 4, 64, 4)).unwrap();
    let mut m = HybridModel::new(&groups, 4);
    let mut out = Outputs::new();
    let a: Vec<u32> = (1..=14).collect();
    s.add_request("a", &a, 4, &[]).unwrap();
    while s.has_work() {
        step(&mut s, &mut m, &mut out);
    }
    // "b" extends a's prompt: three full blocks match (12 tokens); resuming at 12 reads
    // from 7, so the sliding group needs logical blocks 1 and 2, still cached.
    let mut b_prompt = a.clone();
    b_prompt.extend([50, 51]);
    s.add_request("b", &b_prompt, 2, &[]).unwrap();
    let b = step(&mut s, &mut m, &mut out);
    // a held five full blocks (0..=4, freed tail first after the free ones 5..): b's new
    // one is 5. In the sliding group a's logical blocks 0 and 1 were released, 2..=4 held
    // at its end; b revives 1 and 2 and takes 5, the front of the free queue.
    assert_eq!(b.num_computed_before, [12]);
    assert_eq!(table(&b, 0, 0).0, [0, 1, 2, 5]);
    assert_eq!(table(&b, 1, 0), (vec![1, 2, 5], 1));
    while s.has_work() {
        step(&mut s, &mut m, &mut out);
    }
    // Fill the sliding pool with other content so that a's early window is evicted: the
    // full blocks are still cached, but no window is, and "c" computes from the start.
    s.add_request("fill", &[9; 30], 2, &[]).unwrap();
    while s.has_work() {
        step(&mut s, &mut m, &mut out);
    }
    let mut c_prompt = a.clone();
    c_prompt.extend([60, 61]);
    s.add_request("c", &c_prompt, 2, &[]).unwrap();
    let b = step(&mut s, &mut m, &mut out);
    assert_eq!(b.num_computed_before, [0]);
    while s.has_work() {
        step(&mut s, &mut m, &mut out);
    }
    let prompts = HashMap::from([
        ("a".to_string(), a),
        ("b".to_string(), b_prompt),
        ("c".to_string(), c_prompt),
        ("fill".to_string(), vec![9; 30]),
    ]);
    assert_exact(&groups, &prompts, &out);
    assert_all_free(&s);
}

#[test]
fn a_prefix_hit_needs_the_window_of_its_first_position_to_compute_and_no_more() {
    // Window 5, blocks of 4: resuming at 12, the first position to compute (12) reads 8..12,
    // so the sliding group needs logical block 2 only, not block 1 (4..7), which lies one
    // position outside that window.
    let groups = vec![CacheGroup::full(32), CacheGroup::sliding(5, 6)];
    let mut s = Scheduler::new(cfg(groups.clone(), 4, 64, 4)).unwrap();
    let mut m = HybridModel::new(&groups, 4);
    let mut out = Outputs::new();
    let a: Vec<u32> = (1..=13).collect();
    s.add_request("a", &a, 3, &[]).unwrap();
    drain(&mut s, &mut m, &mut out);
    // "a" released its sliding blocks 0 and 1 as it decoded, then 3 and 2 at its end. A
    // 13-token prompt of other tokens takes four sliding blocks at once: the two never
    // used and, least recently released first, a's blocks 0 and 1.
    let fill: Vec<u32> = (100..113).collect();
    s.add_request("fill", &fill, 1, &[]).unwrap();
    drain(&mut s, &mut m, &mut out);
    let mut b_prompt = a.clone();
    b_prompt.extend([50, 51]);
    s.add_request("b", &b_prompt, 2, &[]).unwrap();
    let b = step(&mut s, &mut m, &mut out);
    assert_eq!(
        b.num_computed_before,
        [12],
        "a's first three blocks serve b"
    );
    drain(&mut s, &mut m, &mut out);
    let prompts = HashMap::from([
        ("a".to_string(), a),
        ("fill".to_string(), fill),
        ("b".to_string(), b_prompt),
    ]);
    assert_exact(&groups, &prompts, &out);
    assert_all_free(&s);
}

#[test]
fn a_state_slot_follows_its_sequence_through_preemption_and_resume() {
    // 6 full blocks of 2: two sequences of 4 + 4 tokens cannot both finish; the later one
    // is preempted, gives its slot back, and resumes from its prompt-end checkpoint.
    let groups = vec![CacheGroup::full(6), CacheGroup::state(4)];
    let mut s = Scheduler::new(cfg(groups.clone(), 2, 64, 4)).unwrap();
    let mut m = HybridModel::new(&groups, 2);
    let mut out = Outputs::new();
    s.add_request("a", &[1, 2, 3, 4], 4, &[]).unwrap();
    s.add_request("b", &[5, 6, 7, 8], 4, &[]).unwrap();
    let b = step(&mut s, &mut m, &mut out);
    // Each takes a fresh slot and one for the checkpoint of its prompt's end (position 4).
    assert_eq!(b.state_slots, [0, 2]);
    assert_eq!(b.state_fresh, [1, 1]);
    assert_eq!(b.state_restore, [-1, -1]);
    assert_eq!(b.state_save, [1, 3]);
    assert_eq!(s.stats().state_checkpoints_saved, 2);
    let b = step(&mut s, &mut m, &mut out);
    assert_eq!(
        (b.state_slots.clone(), b.state_fresh.clone()),
        (vec![0, 2], vec![0, 0])
    );
    assert_eq!(b.state_save, [-1, -1]);
    // Position 5 fits the third blocks; position 6 needs a fourth block for each: none is
    // free, "b" is preempted and its slot (2) is free again.
    step(&mut s, &mut m, &mut out);
    assert_eq!(s.stats().preemptions, 0);
    let b = step(&mut s, &mut m, &mut out);
    assert_eq!(s.stats().preemptions, 1);
    assert_eq!(b.state_slots, [0]);
    // "a" finished in that step: no slot is held, "b" waits with none.
    assert_eq!(s.state_allocator().unwrap().num_used(), 0);
    assert_eq!(s.num_waiting(), 1);
    // "b" resumes over its 4 prompt + 3 generated tokens from the checkpoint at 4 (slot 3),
    // not from its cached attention blocks up to 6: recomputing 4..7 in a slot of its own.
    let b = step(&mut s, &mut m, &mut out);
    assert_eq!(b.num_computed_before, [4]);
    assert_eq!(b.state_restore, [3]);
    assert_eq!(b.state_fresh, [0]);
    assert_ne!(b.state_slots[0], 3, "a checkpoint is copied, never run in");
    assert_eq!(s.stats().state_checkpoint_hits, 1);
    while s.has_work() {
        step(&mut s, &mut m, &mut out);
    }
    let prompts = HashMap::from([
        ("a".to_string(), vec![1, 2, 3, 4]),
        ("b".to_string(), vec![5, 6, 7, 8]),
    ]);
    assert_eq!(out["b"].0.len(), 4);
    assert_exact(&groups, &prompts, &out);
    assert_all_free(&s);
}

#[test]
fn a_prefix_match_never_resumes_a_state_group_without_a_checkpoint_there() {
    let groups = vec![CacheGroup::full(32), CacheGroup::state(4)];
    let mut s = Scheduler::new(cfg(groups.clone(), 4, 64, 4)).unwrap();
    let mut m = HybridModel::new(&groups, 4);
    let mut out = Outputs::new();
    // Prompt of 5: a checkpoint at 4 only (no interval). "a" then generates 10 tokens, so
    // its first three blocks are cached in the attention group.
    s.add_request("a", &[1, 2, 3, 4, 5], 10, &[]).unwrap();
    while s.has_work() {
        step(&mut s, &mut m, &mut out);
    }
    assert_eq!(s.allocator().num_cached(), 3);
    let mut ctx = vec![1, 2, 3, 4, 5];
    ctx.extend(&out["a"].0);
    ctx.push(77);
    // Attention could resume at 12; the state only at 4.
    s.add_request("b", &ctx, 1, &[]).unwrap();
    let b = step(&mut s, &mut m, &mut out);
    assert_eq!(b.num_computed_before, [4]);
    assert!(b.state_restore[0] >= 0);
    assert_exact(
        &groups,
        &HashMap::from([("b".to_string(), ctx.clone())]),
        &out,
    );

    // One state slot: never a free one for a checkpoint, so nothing can resume but 0.
    let mut out = Outputs::new();
    let groups = vec![CacheGroup::full(32), CacheGroup::state(1)];
    let mut s = Scheduler::new(cfg(groups.clone(), 4, 64, 4)).unwrap();
    let mut m = HybridModel::new(&groups, 4);
    s.add_request("a", &[1, 2, 3, 4, 5], 10, &[]).unwrap();
    while s.has_work() {
        step(&mut s, &mut m, &mut out);
    }
    assert_eq!(s.stats().state_checkpoints_saved, 0);
    s.add_request("b2", &ctx, 1, &[]).unwrap();
    let b = step(&mut s, &mut m, &mut out);
    assert_eq!(b.num_computed_before, [0]);
    assert_eq!((b.state_fresh[0], b.state_restore[0]), (1, -1));
    assert_eq!(s.stats().prefix_cache_hit_tokens, 0);
    assert_all_free(&s);
}

#[test]
fn checkpoints_every_interval_cut_chunks_there_and_are_evicted_least_recent_first() {
    let groups = vec![CacheGroup::full(64), CacheGroup::state(3)];
    let mut s = Scheduler::new(SchedulerConfig {
        state_checkpoint_interval: 2,
        ..cfg(groups.clone(), 2, 64, 1)
    })
    .unwrap();
    let mut m = HybridModel::new(&groups, 2);
    let mut out = Outputs::new();
    // Prompt of 9, blocks of 2, a checkpoint every 2 blocks (4 tokens) and at 8 (prompt
    // end): the prefill is cut at 4 and at 8.
    let prompt: Vec<u32> = (10..19).collect();
    s.add_request("a", &prompt, 1, &[]).unwrap();
    let mut chunks = Vec::new();
    while s.has_work() {
        let b = step(&mut s, &mut m, &mut out);
        chunks.push((b.num_computed_before[0], b.seq_lens[0], b.state_save[0]));
    }
    // Slot 0 runs; checkpoints go to 1, then 2.
    assert_eq!(chunks, [(0, 4, 1), (4, 8, 2), (8, 9, -1)]);
    // A second request runs in a's slot 0 (freed first: it holds no checkpoint) and saves
    // its checkpoint at 4 into the least recently used one (1, a's at 4); a's checkpoint
    // at 8 survives and still serves "a2".
    s.add_request("x", &[1, 2, 3, 4, 5], 1, &[]).unwrap();
    let b = step(&mut s, &mut m, &mut out);
    assert_eq!((b.state_slots[0], b.state_save[0]), (0, 1));
    while s.has_work() {
        step(&mut s, &mut m, &mut out);
    }
    let mut longer = prompt.clone();
    longer.extend([40, 41, 42]);
    s.add_request("a2", &longer, 1, &[]).unwrap();
    let b = step(&mut s, &mut m, &mut out);
    assert_eq!((b.num_computed_before[0], b.state_restore[0]), (8, 2));
    while s.has_work() {
        step(&mut s, &mut m, &mut out);
    }
    let prompts = HashMap::from([
        ("a".to_string(), prompt),
        ("x".to_string(), vec![1, 2, 3, 4, 5]),
        ("a2".to_string(), longer),
    ]);
    assert_exact(&groups, &prompts, &out);
    assert_all_free(&s);
}

#[test]
fn requests_that_could_never_fit_a_group_are_rejected_at_add() {
    // Sliding window 8 in blocks of 4 with chunks of 8: up to (7 + 8) / 4 + 1 = 5 blocks at
    // once, in a group of 4.
    let groups = vec![CacheGroup::full(100), CacheGroup::sliding(8, 4)];
    let mut s = Scheduler::new(cfg(groups, 4, 8, 4)).unwrap();
    let err = s.add_request("a", &[1; 20], 4, &[]).unwrap_err();
    assert_eq!(
        err,
        SchedulerError::Rejected(
            "prompt (20 tokens) + max_new_tokens (4) needs up to 5 blocks at once in cache \
             group 1 (sliding window of 8 tokens), which has 4 blocks"
                .into()
        )
    );
    // Short enough to hold all of it (3 blocks): fits.
    s.add_request("b", &[1; 10], 2, &[]).unwrap();
    // The full group's bound is its own pool.
    let groups = vec![CacheGroup::sliding(4, 100), CacheGroup::full(3)];
    let mut s = Scheduler::new(cfg(groups, 4, 8, 4)).unwrap();
    let err = s.add_request("a", &[1; 10], 3, &[]).unwrap_err();
    assert!(
        err.to_string()
            .contains("exceeds the KV pool of cache group 1 of 12 tokens"),
        "{err}"
    );
    assert_eq!(s.max_sequence_tokens(), 12);
    // A sliding group alone bounds nothing but what it holds at once.
    let s = Scheduler::new(cfg(vec![CacheGroup::sliding(4, 3)], 4, 4, 4)).unwrap();
    assert_eq!(s.max_sequence_tokens(), usize::MAX);
}

/// Run a workload to completion with up to `depth` steps open (0: plain schedule/commit).
pub fn run(s: &mut Scheduler, m: &mut HybridModel, depth: usize) -> Outputs {
    let mut out = Outputs::new();
    let mut open = VecDeque::new();
    let mut steps = 0;
    while s.has_work() || !open.is_empty() {
        if depth == 0 {
            step(s, m, &mut out);
        } else {
            if s.has_work() {
                let b = s.schedule_overlapped(0).unwrap();
                let sampled = m.execute(&b);
                open.push_back((b, sampled));
                s.check_invariants().unwrap();
            }
            if open.len() > depth || !s.has_work() {
                let (b, sampled) = open.pop_front().unwrap();
                let ev = s.commit(&b, &sampled).unwrap();
                record(s, &mut out, &ev);
                s.check_invariants().unwrap();
            }
        }
        steps += 1;
        assert!(steps < 20_000, "no progress");
    }
    out
}

#[test]
fn a_hybrid_model_is_exact_under_pools_that_force_preemption() {
    // Shared prefixes, tiny pools in every group, plain and overlapped schedules.
    let groups = vec![
        CacheGroup::sliding(5, 10),
        CacheGroup::full(14),
        CacheGroup::state(6),
    ];
    let mut prompts = HashMap::new();
    for i in 0..8u32 {
        let mut p: Vec<u32> = (0..6 + i % 4).collect();
        p.push(100 + i);
        prompts.insert(format!("r{i}"), p);
    }
    for depth in [0, 1, 2] {
        let mut s = Scheduler::new(SchedulerConfig {
            state_checkpoint_interval: 1,
            ..cfg(groups.clone(), 2, 6, 3)
        })
        .unwrap();
        let mut m = HybridModel::new(&groups, 2);
        let mut ids: Vec<_> = prompts.keys().cloned().collect();
        ids.sort();
        for id in &ids {
            s.add_request(id, &prompts[id], 8, &[]).unwrap();
        }
        let out = run(&mut s, &mut m, depth);
        assert!(s.stats().preemptions > 0, "depth {depth}: no preemption");
        assert!(
            s.stats().prefix_cache_hit_tokens > 0,
            "depth {depth}: no prefix hit"
        );
        for id in &ids {
            assert_eq!(out[id].0.len(), 8, "{id}");
        }
        assert_exact(&groups, &prompts, &out);
        assert_all_free(&s);
    }
}

#[test]
fn a_chunk_cut_at_a_checkpoint_leaves_the_rest_to_the_next_step() {
    // Two running sequences mid-prefill with budget to spare: each chunk ends at its
    // checkpoint (every 2 blocks of 2), and no sequence appears twice in a step, even though
    // the budget would cover the rest of its prompt.
    let groups = vec![CacheGroup::full(64), CacheGroup::state(8)];
    let mut s = Scheduler::new(SchedulerConfig {
        state_checkpoint_interval: 2,
        ..cfg(groups.clone(), 2, 64, 2)
    })
    .unwrap();
    let mut m = HybridModel::new(&groups, 2);
    let mut out = Outputs::new();
    let (a, b): (Vec<u32>, Vec<u32>) = ((1..=13).collect(), (20..=29).collect());
    s.add_request("a", &a, 2, &[]).unwrap();
    s.add_request("b", &b, 2, &[]).unwrap();
    let mut steps = Vec::new();
    while s.has_work() {
        let batch = step(&mut s, &mut m, &mut out);
        let mut uids: Vec<u64> = batch.entries.iter().map(|e| e.uid).collect();
        uids.dedup();
        assert_eq!(uids.len(), batch.num_seqs(), "a sequence twice in one step");
        steps.push((batch.num_computed_before.clone(), batch.seq_lens.clone()));
    }
    // a: 0..4, 4..8, 8..12 (12 is also its prompt's end), 12..13; b: 0..4, 4..8, 8..10.
    assert_eq!(
        steps[..4],
        [
            (vec![0, 0], vec![4, 4]),
            (vec![4, 4], vec![8, 8]),
            (vec![8, 8], vec![12, 10]),
            (vec![12, 10], vec![13, 11]),
        ]
    );
    let prompts = HashMap::from([("a".to_string(), a), ("b".to_string(), b)]);
    assert_exact(&groups, &prompts, &out);
    assert_all_free(&s);
}

#[test]
fn a_discarded_step_that_ran_starts_its_sequences_state_over() {
    // A step left open and executed has folded its token into the state; a plain schedule
    // then forgets it. KV can be written again, a state cannot, so the sequence must start
    // over (here from its prompt-end checkpoint) rather than fold that token a second time.
    let groups = vec![CacheGroup::full(32), CacheGroup::state(4)];
    let mut s = Scheduler::new(cfg(groups.clone(), 2, 64, 4)).unwrap();
    let mut m = HybridModel::new(&groups, 2);
    let mut out = Outputs::new();
    let prompt = vec![1, 2, 3, 4, 5, 6];
    s.add_request("a", &prompt, 6, &[]).unwrap();
    step(&mut s, &mut m, &mut out);
    step(&mut s, &mut m, &mut out);
    let open = s.schedule_overlapped(0).unwrap();
    m.execute(&open);
    let b = step(&mut s, &mut m, &mut out);
    assert_eq!(
        s.stats().preemptions,
        1,
        "the discarded step's sequence starts over"
    );
    assert_eq!(b.state_restore.len(), 1);
    assert_ne!(b.state_restore[0], -1, "it resumes from its checkpoint");
    assert_eq!(b.num_computed_before, [6]);
    while s.has_work() {
        step(&mut s, &mut m, &mut out);
    }
    assert_eq!(out["a"].0.len(), 6);
    assert_exact(&groups, &HashMap::from([("a".to_string(), prompt)]), &out);
    assert_all_free(&s);
}
