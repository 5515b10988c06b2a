//! A fake model with cache groups: full-attention groups read every position, sliding
//! groups the last `window`, and a recurrent group folds every token into a per-slot state.
//! It reads a sequence's context only through the batch's per-group tables, offsets and
//! slots and its state slot (fresh, restored from a checkpoint, or carried on), so a
//! released block still in use, a wrong offset or a state restored at the wrong position
//! changes the output. `next_token` is the same function of the plain token list.

use std::collections::HashMap;

use iron_batch_core::{Batch, CacheGroup, CacheKind};

use super::VOCAB;

const SEED: u64 = 1469598103934665603;

fn fold(h: u64, tok: u64) -> u64 {
    (h ^ tok).wrapping_mul(1099511628211)
}

/// Combine the groups' readings into a token.
fn combine(parts: &[u64]) -> u32 {
    let mut h = SEED;
    for (g, &p) in parts.iter().enumerate() {
        h = fold(h, p.rotate_left(g as u32 * 7 + 1));
    }
    (h % u64::from(VOCAB)) as u32
}

/// The token after `ctx`, computed from the context itself.
pub fn next_token(groups: &[CacheGroup], ctx: &[u32]) -> u32 {
    let parts: Vec<u64> = groups
        .iter()
        .map(|g| {
            let from = match g.kind {
                CacheKind::Sliding { window } => ctx.len().saturating_sub(window),
                _ => 0,
            };
            let seed = if g.kind == CacheKind::State {
                !SEED
            } else {
                SEED
            };
            ctx[from..].iter().fold(seed, |h, &t| fold(h, u64::from(t)))
        })
        .collect();
    combine(&parts)
}

pub struct HybridModel {
    groups: Vec<CacheGroup>,
    bs: usize,
    /// Per attention group: slot -> (token, position).
    kv: Vec<HashMap<i64, (u32, usize)>>,
    /// State slot -> (folded state, tokens folded in).
    states: HashMap<i32, (u64, usize)>,
    last: Vec<u32>,
}

impl HybridModel {
    pub fn new(groups: &[CacheGroup], bs: usize) -> Self {
        let attention = groups.iter().filter(|g| g.is_attention()).count();
        HybridModel {
            groups: groups.to_vec(),
            bs,
            kv: vec![HashMap::new(); attention],
            states: HashMap::new(),
            last: Vec::new(),
        }
    }

    fn table<'a>(&self, b: &'a Batch, g: usize, row: usize) -> (&'a [i32], usize) {
        let off = b.block_table_offsets[g * b.num_seqs() + row] as usize;
        (b.group_table(g, row), off)
    }

    fn slot_of(&self, b: &Batch, g: usize, row: usize, p: usize) -> i64 {
        let (table, off) = self.table(b, g, row);
        assert!(
            p / self.bs >= off,
            "group {g} reads position {p} before its offset {off}"
        );
        let block = table[p / self.bs - off];
        i64::from(block) * self.bs as i64 + (p % self.bs) as i64
    }

    /// Write token `tok` at position `p` of row `row` in every group (KV and state).
    fn feed(&mut self, b: &Batch, row: usize, p: usize, tok: u32, kv_slots: Option<usize>) {
        for g in 0..self.kv.len() {
            let slot = match kv_slots {
                Some(t) => {
                    let s = b.group_slot(g, t);
                    assert_eq!(s, self.slot_of(b, g, row, p), "slot mapping off its table");
                    s
                }
                None => self.slot_of(b, g, row, p),
            };
            self.kv[g].insert(slot, (tok, p));
        }
        if !b.state_slots.is_empty() {
            let st = self
                .states
                .get_mut(&b.state_slots[row])
                .expect("state set up");
            assert_eq!(
                st.1, p,
                "state of row {row} covers {} tokens, feeding position {p}",
                st.1
            );
            *st = (fold(st.0, u64::from(tok)), st.1 + 1);
        }
    }

    /// The next token of row `row` whose context is `len` tokens.
    fn read(&self, b: &Batch, row: usize, len: usize) -> u32 {
        let mut parts = Vec::new();
        let mut attn = 0;
        for g in &self.groups {
            if g.kind == CacheKind::State {
                let st = self.states[&b.state_slots[row]];
                assert_eq!(st.1, len);
                parts.push(st.0);
                continue;
            }
            let from = match g.kind {
                CacheKind::Sliding { window } => len.saturating_sub(window),
                _ => 0,
            };
            let mut h = SEED;
            for p in from..len {
                let slot = self.slot_of(b, attn, row, p);
                let (tok, pos) = self.kv[attn][&slot];
                assert_eq!(
                    pos, p,
                    "group {attn}: KV slot {slot} holds position {pos}, wanted {p}"
                );
                h = fold(h, u64::from(tok));
            }
            parts.push(h);
            attn += 1;
        }
        combine(&parts)
    }

    /// One step; returns `[num_samples, k]` row-major as `FakeModel::execute_steps`.
    pub fn execute_steps(&mut self, b: &Batch, k: usize) -> Vec<u32> {
        let mut ids: Vec<i64> = b.input_ids.clone();
        for (&t, &r) in b.pending_token_indices.iter().zip(&b.pending_sample_rows) {
            ids[t as usize] = i64::from(self.last[r as usize]);
        }
        for row in 0..b.num_seqs() {
            if !b.state_slots.is_empty() {
                let slot = b.state_slots[row];
                let before = b.num_computed_before[row] as usize;
                if b.state_fresh[row] == 1 {
                    assert_eq!(before, 0, "a fresh state mid-sequence");
                    self.states.insert(slot, (!SEED, 0));
                }
                if b.state_restore[row] >= 0 {
                    let ck = self.states[&b.state_restore[row]];
                    self.states.insert(slot, ck);
                }
                let st = self.states.get(&slot).expect("a state slot never set up");
                assert_eq!(
                    st.1, before,
                    "row {row}'s state does not cover its computed tokens"
                );
            }
            let rows = b.query_start_loc[row] as usize..b.query_start_loc[row + 1] as usize;
            for (t, (&id, &p)) in ids
                .iter()
                .zip(&b.positions)
                .enumerate()
                .take(rows.end)
                .skip(rows.start)
            {
                self.feed(b, row, p as usize, id as u32, Some(t));
            }
        }
        // Checkpoints are of the state after the step's own tokens, before any lookahead.
        for row in 0..b.state_save.len() {
            if b.state_save[row] >= 0 {
                let st = self.states[&b.state_slots[row]];
                self.states.insert(b.state_save[row], st);
            }
        }
        let mut first = Vec::new();
        let mut out = vec![u32::MAX - 1; b.sample_indices.len() * k];
        for (r, &row) in b.sample_seq_indices.iter().enumerate() {
            let row = row as usize;
            let len = b.seq_lens[row] as usize;
            let mut prev = self.read(b, row, len);
            first.push(prev);
            out[r * k] = prev;
            for j in 1..b.sample_max_steps[r] as usize {
                let pos = len + j - 1;
                self.feed(b, row, pos, prev, None);
                prev = self.read(b, row, pos + 1);
                out[r * k + j] = prev;
            }
        }
        self.last = first;
        out
    }

    pub fn execute(&mut self, b: &Batch) -> Vec<u32> {
        self.execute_steps(b, 1)
    }
}
