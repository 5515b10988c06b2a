//! Speculative decoding in the scheduler: prompt-lookup proposals (or rows reserved for the
//! backend's draft model) become extra query rows, `commit_accepted` takes a variable
//! number of tokens per row and rolls the rest back.
//! Under any acceptance pattern the outputs equal a run without speculation, every
//! invariant holds after every operation, and every block is free at the end.

use std::collections::{HashMap, VecDeque};

use iron_batch_core::{
    Batch, RequestOptions, Scheduler, SchedulerConfig, SchedulerError, SchedulerStats,
    SpeculativeMethod, StepEvent, DRAFTED_BY_BACKEND,
};
use proptest::prelude::*;

/// A fake model over a small vocabulary (so prompt lookup finds matches and proposals are
/// sometimes right): its next token hashes the whole context, read back through the block
/// tables from the KV it was given, so a rolled-back slot that is read as computed, or a
/// position computed twice or never, changes the output.
struct Verifier {
    vocab: u32,
    kv: HashMap<i64, (i64, i64)>,
    /// Accepts at most this many proposals in row `r` of step `s`: `cut(s, r)` (a random
    /// acceptance pattern on top of the model's own verdict, as sampling gives).
    cut: Box<dyn Fn(u64, usize) -> usize>,
    /// Fills a row reserved for the backend's draft model (input token
    /// `DRAFTED_BY_BACKEND`) with the true next token where `draft_right(step, row)`, else
    /// with a wrong one: a draft model that is right now and then.
    draft_right: Box<dyn Fn(u64, usize) -> bool>,
    last: Vec<u32>,
}

impl Verifier {
    fn new(vocab: u32, cut: impl Fn(u64, usize) -> usize + 'static) -> Self {
        Verifier {
            vocab,
            kv: HashMap::new(),
            cut: Box::new(cut),
            draft_right: Box::new(|_, _| true),
            last: Vec::new(),
        }
    }

    fn with_draft(mut self, right: impl Fn(u64, usize) -> bool + 'static) -> Self {
        self.draft_right = Box::new(right);
        self
    }

    fn token(&self, table: &[i32], len: usize, bs: usize) -> u32 {
        let mut h: u64 = 1469598103934665603;
        for p in 0..len {
            let slot = i64::from(table[p / bs]) * bs as i64 + (p % bs) as i64;
            let (tok, pos) = self.kv[&slot];
            assert_eq!(
                pos, p as i64,
                "KV slot {slot} holds position {pos}, wanted {p}"
            );
            h = (h ^ tok as u64).wrapping_mul(1099511628211);
        }
        (h % u64::from(self.vocab)) as u32
    }

    /// The step's accepted tokens (rows in order) and their count per row.
    fn execute(&mut self, b: &Batch, bs: usize) -> (Vec<u32>, Vec<usize>) {
        let mut ids = b.input_ids.clone();
        for (&t, &r) in b.pending_token_indices.iter().zip(&b.pending_sample_rows) {
            ids[t as usize] = i64::from(self.last[r as usize]);
        }
        let mut seq = 0;
        // Row by row: a draft row reads the KV of the rows before it.
        #[allow(clippy::needless_range_loop)]
        for t in 0..ids.len() {
            while b.query_start_loc[seq + 1] as usize <= t {
                seq += 1;
            }
            if ids[t] == i64::from(DRAFTED_BY_BACKEND) {
                // The draft's pick after the rows before it (their KV is written).
                let table = &b.block_tables[seq * b.max_blocks..(seq + 1) * b.max_blocks];
                let truth = self.token(table, b.positions[t] as usize, bs);
                let pick = if (self.draft_right)(b.step, t) {
                    truth
                } else {
                    (truth + 1) % self.vocab
                };
                ids[t] = i64::from(pick);
            }
            self.kv.insert(b.slot_mapping[t], (ids[t], b.positions[t]));
        }
        let (mut out, mut counts) = (Vec::new(), Vec::new());
        self.last.clear();
        for (r, &last) in b.sample_indices.iter().enumerate() {
            let seq = b.sample_seq_indices[r] as usize;
            let k = b.num_proposed[r] as usize;
            let len = b.seq_lens[seq] as usize;
            let table = &b.block_tables[seq * b.max_blocks..(seq + 1) * b.max_blocks];
            let limit = (self.cut)(b.step, r).min(k);
            let last = last as usize;
            let mut n = 0;
            loop {
                let t = self.token(table, len - k + n, bs);
                out.push(t);
                n += 1;
                let proposal = ids.get(last + 1 - k + n - 1).copied();
                if n > limit || n > k || proposal != Some(i64::from(t)) {
                    break;
                }
            }
            counts.push(n);
            self.last.push(*out.last().unwrap());
        }
        (out, counts)
    }
}

type Outputs = HashMap<String, (Vec<u32>, String)>;

fn record(s: &Scheduler, out: &mut Outputs, events: &[StepEvent]) {
    for e in events {
        let id = s.request_id(e.slot);
        let entry = out.entry(id.to_string()).or_default();
        assert!(entry.1.is_empty(), "event after finish for {id}");
        if let Some(t) = e.token {
            entry.0.push(t);
        }
        if let Some(r) = e.finish {
            entry.1 = r.as_str().to_string();
        }
    }
}

#[derive(Debug, Clone)]
struct Req {
    prompt: Vec<u32>,
    max_new: usize,
    stop: Vec<u32>,
    priority: i64,
    salt: Option<u8>,
    no_spec: bool,
}

fn add_all(s: &mut Scheduler, w: &[Req]) {
    for (i, r) in w.iter().enumerate() {
        let opts = RequestOptions {
            priority: r.priority,
            cache_salt: r.salt.map(|b| vec![b]),
            no_speculation: r.no_spec,
            ..Default::default()
        };
        s.add_request_with(&format!("r{i}"), &r.prompt, r.max_new, &r.stop, &opts)
            .unwrap();
    }
}

/// Run to the end, `depth` steps kept open (0: each committed before the next).
fn run(cfg: &SchedulerConfig, w: &[Req], model: &mut Verifier, depth: usize) -> Outputs {
    run_stats(cfg, w, model, depth).0
}

fn run_stats(
    cfg: &SchedulerConfig,
    w: &[Req],
    model: &mut Verifier,
    depth: usize,
) -> (Outputs, SchedulerStats) {
    let mut s = Scheduler::new(cfg.clone()).unwrap();
    add_all(&mut s, w);
    let bs = cfg.kv_block_size;
    let mut out = Outputs::new();
    let mut open = VecDeque::new();
    let mut steps = 0;
    while s.has_work() || !open.is_empty() {
        if s.has_work() {
            let b = if depth == 0 {
                s.schedule()
            } else {
                s.schedule_overlapped(0).unwrap()
            };
            let (toks, counts) = model.execute(&b, bs);
            open.push_back((b, toks, counts));
            s.check_invariants().unwrap();
        }
        if open.len() > depth || !s.has_work() {
            let (b, toks, counts) = open.pop_front().unwrap();
            let events = s.commit_accepted(&b, &toks, &counts).unwrap();
            record(&s, &mut out, &events);
            s.check_invariants().unwrap();
        }
        steps += 1;
        assert!(steps < 20_000, "no progress");
    }
    for g in 0..1 {
        let a = s.group_allocator(g);
        assert_eq!(a.num_free(), a.total(), "blocks left held");
    }
    (out, s.stats().clone())
}

fn cfg(blocks: usize, bs: usize, tokens: usize, spec: usize) -> SchedulerConfig {
    SchedulerConfig {
        total_kv_blocks: blocks,
        kv_block_size: bs,
        max_batch_tokens: tokens,
        max_running_seqs: 8,
        enable_prefix_caching: true,
        num_speculative_tokens: spec,
        speculative_max_rows: 64,
        speculative_ngram_min: 1,
        speculative_ngram_max: 3,
        ..Default::default()
    }
}

fn reference(w: &[Req], vocab: u32) -> Outputs {
    run(
        &cfg(4096, 4, 4096, 0),
        w,
        &mut Verifier::new(vocab, |_, _| 0),
        0,
    )
}

fn workload() -> impl Strategy<Value = Vec<Req>> {
    let shared = prop::collection::vec(0u32..4, 0..10);
    let reqs = prop::collection::vec(
        (
            prop::collection::vec(0u32..4, 1..12),
            1usize..24,
            prop::collection::vec(0u32..6, 0..2),
            0i64..3,
            prop::option::of(0u8..2),
            prop::bool::weighted(0.2),
        ),
        1..7,
    );
    (shared, reqs).prop_map(|(shared, reqs)| {
        reqs.into_iter()
            .map(|(own, max_new, stop, priority, salt, no_spec)| Req {
                prompt: shared.iter().chain(&own).copied().collect(),
                max_new,
                // Stop ids 4 and 5 are outside the model's vocabulary: never sampled.
                stop,
                priority,
                salt,
                no_spec,
            })
            .collect()
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 150, ..ProptestConfig::default() })]

    #[test]
    fn outputs_equal_a_run_without_speculation_under_any_acceptance(
        w in workload(),
        salt in any::<u64>(),
        vocab in 2u32..6,
    ) {
        let want = reference(&w, vocab);
        // Random cuts: the verifier accepts at most `cut` proposals of what the model
        // agrees with, from 0 (everything rejected) to all of them.
        let cut = move |step: u64, row: usize| -> usize {
            let h = (salt ^ step.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ row as u64)
                .wrapping_mul(0xBF58_476D_1CE4_E5B9);
            (h >> 60) as usize % 6
        };
        for (c, depth) in [
            (cfg(4096, 4, 4096, 4), 0),
            // Tiny pool and budget: preemption, chunked prefill, proposals cut by budget.
            (cfg(24, 2, 5, 3), 0),
            (cfg(30, 4, 16, 8), 0),
            // Steps in flight: speculating sequences wait for their commit.
            (cfg(4096, 4, 4096, 4), 1),
            (cfg(24, 2, 6, 3), 2),
        ] {
            let got = run(&c, &w, &mut Verifier::new(vocab, cut), depth);
            prop_assert_eq!(&got, &want);
        }
        // The model's own verdict alone (greedy acceptance).
        let got = run(&cfg(4096, 4, 4096, 5), &w, &mut Verifier::new(vocab, |_, _| 99), 0);
        prop_assert_eq!(&got, &want);
    }

    #[test]
    fn a_draft_model_gives_the_outputs_of_a_run_without_speculation(
        w in workload(),
        salt in any::<u64>(),
        vocab in 2u32..6,
    ) {
        let want = reference(&w, vocab);
        // The draft is right about a random share of its picks.
        let right = move |step: u64, row: usize| -> bool {
            let h = (salt ^ step.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ row as u64)
                .wrapping_mul(0xBF58_476D_1CE4_E5B9);
            (h >> 61) != 0
        };
        for (c, depth) in [
            (draft_cfg(cfg(4096, 4, 4096, 4)), 0),
            (draft_cfg(cfg(24, 2, 5, 3)), 0),
            (draft_cfg(cfg(30, 4, 16, 8)), 0),
            (draft_cfg(cfg(24, 2, 6, 3)), 2),
        ] {
            let mut model = Verifier::new(vocab, |_, _| 99).with_draft(right);
            let (got, stats) = run_stats(&c, &w, &mut model, depth);
            prop_assert_eq!(&got, &want);
            prop_assert!(stats.spec_accepted_tokens <= stats.spec_drafted_tokens);
        }
    }
}

fn draft_cfg(c: SchedulerConfig) -> SchedulerConfig {
    SchedulerConfig {
        speculative_method: SpeculativeMethod::DraftModel,
        ..c
    }
}

#[test]
fn a_draft_model_gets_rows_to_fill_and_its_picks_are_accepted_as_verified() {
    let mut s = Scheduler::new(draft_cfg(cfg(64, 4, 64, 3))).unwrap();
    // Nothing to copy from in the prompt: prompt lookup would propose nothing.
    s.add_request("a", &[0, 1, 2, 3, 4], 10, &[]).unwrap();
    let b = s.schedule();
    assert_eq!(b.num_proposed, [0], "no proposals during prefill");
    s.commit(&b, &[9]).unwrap();
    let b = s.schedule();
    let d = i64::from(DRAFTED_BY_BACKEND);
    assert_eq!(b.num_proposed, [3]);
    assert_eq!(b.input_ids, [9, d, d, d]);
    assert_eq!(b.positions, [5, 6, 7, 8]);
    assert_eq!(b.seq_lens, [9]);
    // The draft proposed 7 7 8; the model agreed with 7 7 and then picked 6.
    let ev = s.commit_accepted(&b, &[7, 7, 6], &[3]).unwrap();
    assert_eq!(
        ev.iter().map(|e| e.token.unwrap()).collect::<Vec<_>>(),
        [7, 7, 6]
    );
    let seq = s.sequence("a").unwrap();
    assert_eq!(seq.output(), [9, 7, 7, 6]);
    assert_eq!(seq.num_computed, 8);
    assert_eq!(s.stats().spec_drafted_tokens, 3);
    assert_eq!(s.stats().spec_accepted_tokens, 2);
    s.check_invariants().unwrap();
    // Rejected at the first: the next step proposes fewer (accepted + 1).
    let b = s.schedule();
    assert_eq!(b.num_proposed, [3]);
    s.commit_accepted(&b, &[5], &[1]).unwrap();
    let b = s.schedule();
    assert_eq!(b.num_proposed, [1]);
    s.check_invariants().unwrap();
    s.abort("a");
    assert_eq!(s.group_allocator(0).num_free(), 64);
}

#[test]
fn a_workload_with_matches_accepts_some_proposals_and_rejects_others() {
    let w: Vec<Req> = (0..6u32)
        .map(|i| Req {
            prompt: (0..10 + i).map(|t| t % 2).collect(),
            max_new: 40,
            stop: vec![],
            priority: 0,
            salt: None,
            no_spec: false,
        })
        .collect();
    let want = reference(&w, 2);
    for c in [cfg(4096, 4, 4096, 4), cfg(40, 2, 7, 3)] {
        let (got, stats) = run_stats(&c, &w, &mut Verifier::new(2, |_, _| 99), 0);
        assert_eq!(got, want);
        assert!(stats.spec_accepted_tokens > 20, "{stats:?}");
        assert!(
            stats.spec_drafted_tokens > stats.spec_accepted_tokens,
            "{stats:?}"
        );
    }
}

fn repeating(n: usize) -> Vec<u32> {
    (0..n).map(|i| (i % 3) as u32).collect()
}

#[test]
fn proposals_are_query_rows_after_the_last_token() {
    let mut s = Scheduler::new(cfg(64, 4, 64, 3)).unwrap();
    s.add_request("a", &repeating(7), 10, &[]).unwrap();
    let b = s.schedule();
    assert_eq!(b.num_proposed, [0], "no proposals during prefill");
    s.commit(&b, &[0]).unwrap();
    // Tokens 0 1 2 0 1 2 0 | 0: neither "2 0 0" nor "0 0" occurred before; the latest
    // earlier "0" (position 6) was followed by the sampled 0: propose 0.
    let b = s.schedule();
    assert_eq!(b.num_proposed, [1]);
    assert_eq!(b.input_ids, [0, 0]);
    assert_eq!(b.positions, [7, 8]);
    assert_eq!(b.sample_indices, [1]);
    assert_eq!(b.seq_lens, [9]);
    // Row 0 verified the proposal (0); the row after it gave 1.
    let ev = s.commit_accepted(&b, &[0, 1], &[2]).unwrap();
    assert_eq!(
        ev.iter().map(|e| e.token.unwrap()).collect::<Vec<_>>(),
        [0, 1]
    );
    let seq = s.sequence("a").unwrap();
    assert_eq!(seq.output(), [0, 0, 1]);
    assert_eq!(seq.num_computed, 9);
    assert_eq!(s.stats().spec_drafted_tokens, 1);
    assert_eq!(s.stats().spec_accepted_tokens, 1);
    s.check_invariants().unwrap();
}

#[test]
fn a_sequence_whose_open_step_verifies_proposals_waits_for_its_commit() {
    // Overlapped steps (`schedule_overlapped(0)`): a sequence proposes when nothing of it is
    // in flight, and the step after that one cannot name its next token (how many of the
    // proposals are accepted is known only at the commit), so that step leaves it out.
    let mut s = Scheduler::new(cfg(64, 4, 64, 3)).unwrap();
    s.add_request("a", &repeating(7), 10, &[]).unwrap();
    let b1 = s.schedule_overlapped(0).unwrap();
    s.commit(&b1, &[0]).unwrap();
    let b2 = s.schedule_overlapped(0).unwrap();
    assert_eq!(b2.num_proposed, [1], "tokens 0 1 2 0 1 2 0 | 0 propose 0");
    let b3 = s.schedule_overlapped(0).unwrap();
    assert!(
        b3.is_empty(),
        "a step over open proposals scheduled {:?}",
        b3.entries
    );
    s.check_invariants().unwrap();
    // Once they are committed, it decodes again from the accepted tokens.
    s.commit_accepted(&b2, &[0, 1], &[2]).unwrap();
    s.commit(&b3, &[]).unwrap();
    let b4 = s.schedule_overlapped(0).unwrap();
    assert_eq!(b4.num_seqs(), 1);
    assert_eq!(
        b4.positions[0], 9,
        "after the prompt, its first token and two accepted"
    );
    s.check_invariants().unwrap();
}

#[test]
fn the_proposal_count_follows_the_last_acceptance() {
    // Up to 8 proposals, over a prompt that repeats 15 distinct tokens: the last three
    // tokens always recur a period back, with 15 tokens after them to propose. After a
    // run with rejections the count is one more than what was accepted; after a run
    // accepted whole it doubles (up to the setting).
    let period = |p: usize| (p % 15) as u32;
    let mut s = Scheduler::new(cfg(256, 4, 256, 8)).unwrap();
    s.add_request("a", &(0..30).map(period).collect::<Vec<_>>(), 60, &[])
        .unwrap();
    let b = s.schedule();
    s.commit(&b, &[period(30)]).unwrap();
    let mut proposed = Vec::new();
    // Accept none, then all, then all, then one of four, then all.
    for accept in [Some(0), None, None, Some(1), None] {
        let b = s.schedule();
        let k = b.num_proposed[0] as usize;
        proposed.push(k);
        // The target agrees with the first `n` proposals and then samples the token the
        // period has next (the model chose to stop there, as sampling may).
        let n = accept.unwrap_or(k);
        let start = b.positions[0] as usize;
        let toks: Vec<u32> = (1..=n + 1).map(|i| period(start + i)).collect();
        s.commit_accepted(&b, &toks, &[toks.len()]).unwrap();
        s.check_invariants().unwrap();
    }
    assert_eq!(proposed, [8, 1, 2, 4, 2]);
    let st = s.stats();
    assert_eq!(st.spec_rows, 5, "every verifying row counted");
    assert_eq!(st.spec_drafted_tokens, 17);
    assert_eq!(st.spec_accepted_tokens, 6);
}

#[test]
fn a_lookahead_step_carries_no_proposals() {
    // With lookahead each sampled row runs several decode steps before the next commit;
    // proposals would need their verdict first, so such a step proposes nothing, where the
    // same state without lookahead proposes.
    let mut s = Scheduler::new(cfg(64, 4, 64, 3)).unwrap();
    s.add_request("a", &repeating(7), 10, &[]).unwrap();
    let b = s.schedule();
    s.commit(&b, &[0]).unwrap();
    let b = s.schedule_lookahead(2);
    assert_eq!(b.num_proposed, [0]);
    assert_eq!(
        (b.positions.clone(), b.sample_max_steps.clone()),
        (vec![7], vec![3])
    );
    let b = s.schedule();
    assert_eq!(b.num_proposed, [1], "the same state, without lookahead");
    s.check_invariants().unwrap();
}

#[test]
fn rejected_proposals_give_back_the_blocks_taken_for_them() {
    // Blocks of 2; prompt of 7 + 1 sampled = 8 tokens, 4 blocks of KV for 7 computed.
    let mut s = Scheduler::new(cfg(64, 2, 64, 6)).unwrap();
    let prompt = [5, 6, 7, 8, 9, 1, 5];
    s.add_request("a", &prompt, 20, &[]).unwrap();
    let b = s.schedule();
    s.commit(&b, &[6]).unwrap();
    let free = s.allocator().num_free();
    // "5 6" occurred at 0: propose 7 8 9 1 5 6 (6 tokens); rows at positions 7..=13 need
    // blocks 3..=6: three new ones.
    let b = s.schedule();
    assert_eq!(b.num_proposed, [6]);
    assert_eq!(b.input_ids, [6, 7, 8, 9, 1, 5, 6]);
    assert_eq!(s.allocator().num_free(), free - 3);
    // Only "7" accepted, then the model said 3: 8 + 2 = 10 tokens, 9 computed (5 blocks).
    s.commit_accepted(&b, &[7, 3], &[2]).unwrap();
    assert_eq!(s.allocator().num_free(), free - 1);
    let seq = s.sequence("a").unwrap();
    assert_eq!(seq.num_computed, 9);
    assert_eq!(seq.tables[0].blocks.len(), 5);
    assert_eq!(
        seq.spec_k, 2,
        "the next proposal is one longer than what was accepted"
    );
    // Only blocks wholly of accepted tokens are published: 0..=3 (tokens 0..8).
    assert_eq!(seq.block_hashes.len(), 4);
    s.check_invariants().unwrap();
    assert!(s.abort("a"));
    assert_eq!(s.allocator().num_free(), 64);
}

#[test]
fn a_stop_token_or_the_length_limit_inside_an_accepted_run_ends_the_request_there() {
    for (stop, max_new, want, reason) in [
        (vec![8u32], 20, vec![6, 7, 8], "stop"),
        (vec![], 3, vec![6, 7, 0], "length"),
    ] {
        let mut s = Scheduler::new(cfg(64, 2, 64, 6)).unwrap();
        s.add_request("a", &[5, 6, 7, 8, 9, 1, 5], max_new, &stop)
            .unwrap();
        let b = s.schedule();
        let mut out = Outputs::new();
        let ev = s.commit(&b, &[6]).unwrap();
        record(&s, &mut out, &ev);
        let b = s.schedule();
        // Never more proposals than tokens left after the sampled one.
        let k = b.num_proposed[0] as usize;
        assert_eq!(k, (max_new - 2).min(6));
        let accepted: Vec<u32> = b.input_ids[1..].iter().map(|&t| t as u32).collect();
        let mut toks = accepted[..k].to_vec();
        toks.push(0);
        let ev = s.commit_accepted(&b, &toks, &[k + 1]).unwrap();
        record(&s, &mut out, &ev);
        assert_eq!(out["a"], (want.clone(), reason.to_string()));
        assert!(!s.is_live("a"));
        assert_eq!(s.allocator().num_free(), 64);
        s.check_invariants().unwrap();
    }
}

#[test]
fn a_commit_that_accepts_what_was_not_proposed_is_refused_and_changes_nothing() {
    let mut s = Scheduler::new(cfg(64, 2, 64, 4)).unwrap();
    s.add_request("a", &[5, 6, 7, 8, 9, 1, 5], 20, &[]).unwrap();
    let b = s.schedule();
    s.commit(&b, &[6]).unwrap();
    let b = s.schedule();
    assert_eq!(b.num_proposed, [4]); // 7 8 9 1
    let bad: [(&[u32], &[usize]); 5] = [
        (&[7, 9, 2], &[3]),          // 9 was not proposed second
        (&[], &[0]),                 // at least the model's own token
        (&[7, 8, 9, 1, 2, 3], &[6]), // more than proposals + 1
        (&[7, 8], &[1]),             // counts disagree with the tokens
        (&[7], &[1, 0]),             // one count per row
    ];
    for (toks, counts) in bad {
        assert!(
            matches!(
                s.commit_accepted(&b, toks, counts),
                Err(SchedulerError::BatchMismatch(_))
            ),
            "{toks:?} {counts:?}"
        );
    }
    assert!(matches!(
        s.commit(&b, &[7]),
        Err(SchedulerError::BatchMismatch(_))
    ));
    s.check_invariants().unwrap();
    // Still open: the right commit goes through.
    s.commit_accepted(&b, &[7, 8, 0], &[3]).unwrap();
    assert_eq!(s.sequence("a").unwrap().output(), [6, 7, 8, 0]);
    s.check_invariants().unwrap();
}

#[test]
fn opted_out_requests_and_full_steps_get_no_proposals() {
    let mut c = cfg(256, 4, 512, 4);
    c.speculative_max_rows = 5;
    let mut s = Scheduler::new(c).unwrap();
    for i in 0..3 {
        s.add_request(&format!("r{i}"), &repeating(9), 30, &[])
            .unwrap();
    }
    let opts = RequestOptions {
        no_speculation: true,
        ..Default::default()
    };
    s.add_request_with("off", &repeating(9), 30, &[], &opts)
        .unwrap();
    let b = s.schedule();
    s.commit(&b, &[0, 0, 0, 0]).unwrap();
    let b = s.schedule();
    // 4 running rows leave 1 row of 5 for proposals: the first sequence takes it.
    assert_eq!(b.num_proposed, [1, 0, 0, 0]);

    let mut s = Scheduler::new(cfg(256, 4, 512, 4)).unwrap();
    s.add_request_with("off", &repeating(9), 30, &[], &opts)
        .unwrap();
    let b = s.schedule();
    s.commit(&b, &[0]).unwrap();
    let b = s.schedule();
    assert_eq!(b.num_proposed, [0]);
}

#[test]
fn speculation_never_preempts_for_its_proposals() {
    // 8 blocks of 2, two prompts of 7 tokens: after their prefill every block is held.
    // "a" would propose 7 at position 8, which needs a fifth block: it decodes without.
    let mut s = Scheduler::new(cfg(8, 2, 64, 4)).unwrap();
    s.add_request("a", &[5, 6, 7, 5, 6, 7, 5], 3, &[]).unwrap();
    s.add_request("b", &[10, 11, 12, 13, 14, 15, 16], 3, &[])
        .unwrap();
    let b = s.schedule();
    s.commit(&b, &[6, 0]).unwrap();
    assert_eq!(s.allocator().num_free(), 0);
    let b = s.schedule();
    assert_eq!(b.num_proposed, [0, 0]);
    assert_eq!(s.stats().preemptions, 0);
    assert_eq!(s.num_running(), 2);
    // With a free block the same proposal goes out.
    let mut s = Scheduler::new(cfg(9, 2, 64, 4)).unwrap();
    s.add_request("a", &[5, 6, 7, 5, 6, 7, 5], 3, &[]).unwrap();
    s.add_request("b", &[10, 11, 12, 13, 14, 15, 16], 3, &[])
        .unwrap();
    let b = s.schedule();
    s.commit(&b, &[6, 0]).unwrap();
    let b = s.schedule();
    assert_eq!(b.num_proposed, [1, 0]);
    assert_eq!(b.input_ids, [6, 7, 0]);
}

#[test]
fn speculation_is_refused_for_recurrent_state_models() {
    let c = SchedulerConfig {
        cache_groups: vec![
            iron_batch_core::CacheGroup::full(16),
            iron_batch_core::CacheGroup::state(4),
        ],
        num_speculative_tokens: 2,
        ..Default::default()
    };
    let err = Scheduler::new(c).unwrap_err();
    assert!(err.to_string().contains("recurrent-state"), "{err}");
}
