//! A deterministic fake model for scheduler tests: its next token is a function of the whole
//! context, read from the scheduler's own batch (input ids per position, remembered per
//! KV slot), so a scheduler that loses, repeats or misplaces a token changes the output.

#![allow(dead_code)]

pub mod hybrid;

use std::collections::{HashMap, VecDeque};

use iron_batch_core::{Batch, Scheduler, StepEvent};

pub const VOCAB: u32 = 1000;

/// Simulated KV cache: slot -> (token, position). Reads go through the block table, so a
/// wrong slot mapping or a stale prefix-cache block gives a different token.
#[derive(Default)]
pub struct FakeModel {
    kv: HashMap<i64, (i64, i64)>,
    /// The previous batch's sampled tokens (first step of each row): what placeholders of
    /// an overlapped batch resolve to, as a backend does on its side.
    last: Vec<u32>,
}

impl FakeModel {
    pub fn execute(&mut self, b: &Batch, block_size: usize) -> Vec<u32> {
        let mut input_ids = b.input_ids.clone();
        for (&t, &r) in b.pending_token_indices.iter().zip(&b.pending_sample_rows) {
            assert_eq!(input_ids[t as usize], 0, "a placeholder holds 0");
            input_ids[t as usize] = i64::from(self.last[r as usize]);
        }
        for ((&slot, &tok), &pos) in b.slot_mapping.iter().zip(&input_ids).zip(&b.positions) {
            self.kv.insert(slot, (tok, pos));
        }
        let mut out = Vec::new();
        for (k, &row) in b.sample_indices.iter().enumerate() {
            let seq = b.sample_seq_indices[k] as usize;
            let len = b.seq_lens[seq] as usize;
            let table = &b.block_tables[seq * b.max_blocks..(seq + 1) * b.max_blocks];
            let mut h: u64 = 1469598103934665603;
            for p in 0..len {
                let slot =
                    table[p / block_size] as i64 * block_size as i64 + (p % block_size) as i64;
                let (tok, pos) = self.kv[&slot];
                assert_eq!(
                    pos, p as i64,
                    "KV slot {slot} holds position {pos}, wanted {p}"
                );
                h = (h ^ tok as u64).wrapping_mul(1099511628211);
            }
            assert_eq!(b.positions[row as usize] as usize, len - 1);
            out.push((h % u64::from(VOCAB)) as u32);
        }
        self.last.clone_from(&out);
        out
    }
}

impl FakeModel {
    /// What a remote worker does with a lookahead batch: the step as given, then up to
    /// `sample_max_steps[r] - 1` more decode steps per sampled row, writing each fed token's
    /// KV into the slots the scheduler reserved. Returns `[num_samples, k]` row-major,
    /// padded with an arbitrary token past each row's limit.
    pub fn execute_steps(&mut self, b: &Batch, block_size: usize, k: usize) -> Vec<u32> {
        let first = self.execute(b, block_size);
        let mut out = vec![u32::MAX - 1; first.len() * k];
        for (r, &tok) in first.iter().enumerate() {
            out[r * k] = tok;
            let seq = b.sample_seq_indices[r] as usize;
            let table = &b.block_tables[seq * b.max_blocks..(seq + 1) * b.max_blocks];
            let start = b.seq_lens[seq] as usize;
            let mut prev = tok;
            for j in 1..b.sample_max_steps[r] as usize {
                let pos = start + j - 1;
                let slot =
                    table[pos / block_size] as i64 * block_size as i64 + (pos % block_size) as i64;
                self.kv.insert(slot, (i64::from(prev), pos as i64));
                let len = pos + 1;
                let mut h: u64 = 1469598103934665603;
                for p in 0..len {
                    let s =
                        table[p / block_size] as i64 * block_size as i64 + (p % block_size) as i64;
                    h = (h ^ self.kv[&s].0 as u64).wrapping_mul(1099511628211);
                }
                prev = (h % u64::from(VOCAB)) as u32;
                out[r * k + j] = prev;
            }
        }
        out
    }
}

/// Each request's generated tokens and finish reason ("" while unfinished).
pub type Outputs = HashMap<String, (Vec<u32>, String)>;

/// Run until idle; returns every request's generated tokens and finish reason.
pub fn run_to_completion(s: &mut Scheduler, model: &mut FakeModel) -> Outputs {
    run_lookahead(s, model, 1)
}

/// As `run_to_completion`, with `k` tokens per sequence per step (k - 1 lookahead steps).
pub fn run_lookahead(s: &mut Scheduler, model: &mut FakeModel, k: usize) -> Outputs {
    let bs = s.config().kv_block_size;
    let mut out = Outputs::new();
    let mut steps = 0;
    while s.has_work() {
        let b = s.schedule_lookahead(k - 1);
        let sampled = model.execute_steps(&b, bs, k);
        let events = s.commit_steps(&b, &sampled, k).unwrap();
        record(s, &mut out, &events);
        s.check_invariants().unwrap();
        steps += 1;
        assert!(steps < 10_000, "no progress");
    }
    out
}

/// Run until idle with overlapped scheduling: up to `depth` steps stay open (executed,
/// not committed) while the next one is scheduled, as the engine does with a device that
/// runs ahead. Each batch runs at once (the device runs steps in order); commits lag.
pub fn run_overlapped(s: &mut Scheduler, model: &mut FakeModel, depth: usize) -> Outputs {
    let bs = s.config().kv_block_size;
    let mut out = Outputs::new();
    let mut open = VecDeque::new();
    let mut steps = 0;
    while s.has_work() || !open.is_empty() {
        if s.has_work() {
            let b = s.schedule_overlapped(0).unwrap();
            let sampled = model.execute(&b, bs);
            open.push_back((b, sampled));
            s.check_invariants().unwrap();
        }
        if open.len() > depth || !s.has_work() {
            let (b, sampled) = open.pop_front().unwrap();
            let events = s.commit(&b, &sampled).unwrap();
            record(s, &mut out, &events);
            s.check_invariants().unwrap();
        }
        steps += 1;
        assert!(steps < 20_000, "no progress");
    }
    assert_eq!(s.num_open_steps(), 0);
    out
}

pub fn record(s: &Scheduler, out: &mut Outputs, events: &[StepEvent]) {
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
