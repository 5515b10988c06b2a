//! The flat description of one forward pass that the backend consumes.

use crate::allocator::BlockId;
use crate::sequence::Sequence;

/// One sequence's share of a step, kept for `commit`.
#[derive(Debug, Clone)]
pub struct BatchEntry {
    pub slot: usize,
    pub uid: u64,
    pub num_tokens: usize,
    /// Tokens to sample for this sequence (0: mid-prefill; above 1: lookahead steps).
    pub steps: usize,
    /// Proposed tokens among its `num_tokens` (its last ones): the step verifies them.
    pub proposed: usize,
}

/// What a step does with one sequence's recurrent state (with a state group).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct StateOps {
    pub slot: BlockId,
    /// The step begins a fresh (zero) state in `slot`.
    pub fresh: bool,
    /// Copy this checkpoint into `slot` before the step.
    pub restore: Option<BlockId>,
    /// Copy `slot` into this checkpoint after the step.
    pub save: Option<BlockId>,
}

/// Arrays in the dtypes the backend wants: int64 where torch indexes with them
/// (embedding lookup, cache writes), int32 for lengths and block tables.
///
/// Cache groups: `slot_mapping` and `block_tables` are those of the first attention group;
/// the other attention groups' are in `group_slot_mapping` and `group_block_tables`.
/// A sliding group's table row starts at logical block `block_table_offsets[g][row]` (the
/// blocks before it are released); a full group's offsets are 0.
#[derive(Debug, Clone, Default)]
pub struct Batch {
    pub step: u64,
    pub input_ids: Vec<i64>,
    pub positions: Vec<i64>,
    pub slot_mapping: Vec<i64>,
    pub query_start_loc: Vec<i32>,
    pub seq_lens: Vec<i32>,
    pub num_computed_before: Vec<i32>,
    /// Row-major `[num_seqs, max_blocks]`, padded with 0.
    pub block_tables: Vec<i32>,
    pub max_blocks: usize,
    /// Row-major `[attention groups - 1, num_tokens]`: the slots of the other groups.
    pub group_slot_mapping: Vec<i64>,
    /// Row-major `[(attention groups - 1) * num_seqs, group_max_blocks]`: group `g`'s table
    /// (g >= 1) is rows `(g - 1) * num_seqs..g * num_seqs`, padded with 0.
    pub group_block_tables: Vec<i32>,
    pub group_max_blocks: usize,
    /// Row-major `[attention groups, num_seqs]`.
    pub block_table_offsets: Vec<i32>,
    /// With a state group, per sequence (empty without): its state slot; 1 where the step
    /// begins a fresh state there; the checkpoint slot to copy into it before the step, or
    /// -1; the checkpoint slot to copy it into after the step, or -1.
    pub state_slots: Vec<i32>,
    pub state_fresh: Vec<i32>,
    pub state_restore: Vec<i32>,
    pub state_save: Vec<i32>,
    pub sample_indices: Vec<i64>,
    pub sample_seq_indices: Vec<i64>,
    /// Per sample row: how many tokens may be sampled (1 unless scheduled with lookahead).
    pub sample_max_steps: Vec<i32>,
    /// Per sample row: tokens proposed for verification (speculative decoding). A row with
    /// `k` proposals ends its sequence's query rows: `input_ids[s - k + 1..=s]` (with
    /// `s = sample_indices[row]`) are the proposals, and the logits of rows `s - k..=s`
    /// verify them and give one more token; `commit_accepted` takes 1 to `k + 1` tokens.
    pub num_proposed: Vec<i32>,
    /// Placeholders (overlapped scheduling): `input_ids[pending_token_indices[i]]` is not
    /// known yet (it holds 0); it is the token the previous step samples in its sample row
    /// `pending_sample_rows[i]`. The backend fills it in from that step's output, on its side.
    pub pending_token_indices: Vec<i64>,
    pub pending_sample_rows: Vec<i64>,
    pub entries: Vec<BatchEntry>,
    pub num_attention_groups: usize,
    /// While building: the slots of groups 1.. and every group's offsets, one vector each.
    extra_slots: Vec<Vec<i64>>,
    offsets: Vec<Vec<i32>>,
}

impl Batch {
    /// Capacity for the common case (every sequence decodes one token) is taken up front:
    /// growing ten vectors by doubling costs more than the whole decode bookkeeping.
    pub(crate) fn new(step: u64, capacity_seqs: usize, attention_groups: usize) -> Self {
        let mut query_start_loc = Vec::with_capacity(capacity_seqs + 1);
        query_start_loc.push(0);
        Batch {
            step,
            input_ids: Vec::with_capacity(capacity_seqs),
            positions: Vec::with_capacity(capacity_seqs),
            slot_mapping: Vec::with_capacity(capacity_seqs),
            query_start_loc,
            seq_lens: Vec::with_capacity(capacity_seqs),
            num_computed_before: Vec::with_capacity(capacity_seqs),
            block_tables: Vec::new(),
            max_blocks: 0,
            group_slot_mapping: Vec::new(),
            group_block_tables: Vec::new(),
            group_max_blocks: 0,
            block_table_offsets: Vec::new(),
            state_slots: Vec::new(),
            state_fresh: Vec::new(),
            state_restore: Vec::new(),
            state_save: Vec::new(),
            sample_indices: Vec::with_capacity(capacity_seqs),
            sample_seq_indices: Vec::with_capacity(capacity_seqs),
            sample_max_steps: Vec::with_capacity(capacity_seqs),
            num_proposed: Vec::with_capacity(capacity_seqs),
            pending_token_indices: Vec::new(),
            pending_sample_rows: Vec::new(),
            entries: Vec::with_capacity(capacity_seqs),
            num_attention_groups: attention_groups,
            extra_slots: (1..attention_groups)
                .map(|_| Vec::with_capacity(capacity_seqs))
                .collect(),
            offsets: (0..attention_groups)
                .map(|_| Vec::with_capacity(capacity_seqs))
                .collect(),
        }
    }

    pub fn num_seqs(&self) -> usize {
        self.entries.len()
    }
    pub fn num_tokens(&self) -> usize {
        self.input_ids.len()
    }
    /// Rows to sample; counted from the entries so it survives moving the arrays out.
    pub fn num_samples(&self) -> usize {
        self.entries.iter().filter(|e| e.steps > 0).count()
    }
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Group `g`'s table row for sequence row `row`, without padding trimmed (for tests).
    pub fn group_table(&self, g: usize, row: usize) -> &[i32] {
        if g == 0 {
            &self.block_tables[row * self.max_blocks..(row + 1) * self.max_blocks]
        } else {
            let r = (g - 1) * self.entries.len() + row;
            let w = self.group_max_blocks;
            &self.group_block_tables[r * w..(r + 1) * w]
        }
    }

    /// Group `g`'s slot of token row `t`.
    pub fn group_slot(&self, g: usize, t: usize) -> i64 {
        if g == 0 {
            self.slot_mapping[t]
        } else {
            self.group_slot_mapping[(g - 1) * self.input_ids.len() + t]
        }
    }

    /// Add `n` tokens of `seq` starting at position `start` (its first token whose KV is
    /// neither computed nor in flight). A position past the committed tokens is a
    /// placeholder for the token sampled in the previous step's row `seq.last_sample_row`,
    /// unless `draft` (proposed tokens, the last ones of the `n`) covers it.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn push(
        &mut self,
        slot: usize,
        seq: &Sequence,
        start: usize,
        n: usize,
        steps: usize,
        block_size: usize,
        state: Option<StateOps>,
        draft: &[u32],
    ) {
        let end = start + n;
        let known = seq.tokens.len();
        let first = &seq.tables[0];
        for p in start..end {
            if p < known {
                self.input_ids.push(i64::from(seq.tokens[p]));
            } else if p - known < draft.len() {
                self.input_ids.push(i64::from(draft[p - known]));
            } else {
                self.pending_token_indices.push(self.input_ids.len() as i64);
                self.pending_sample_rows.push(seq.last_sample_row as i64);
                self.input_ids.push(0);
            }
            self.positions.push(p as i64);
            // The logical block and the place in it are the same in every group: one
            // division per token whatever the number of groups.
            let (logical, within) = (p / block_size, p % block_size);
            self.slot_mapping
                .push(first.slot_of(logical, within, block_size));
            for (dst, table) in self.extra_slots.iter_mut().zip(seq.tables.rest()) {
                dst.push(table.slot_of(logical, within, block_size));
            }
        }
        debug_assert_eq!(steps > 0, end == seq.scheduled_len() + draft.len());
        if steps > 0 {
            self.sample_indices.push(self.input_ids.len() as i64 - 1);
            self.sample_seq_indices.push(self.entries.len() as i64);
            self.sample_max_steps.push(steps as i32);
            self.num_proposed.push(draft.len() as i32);
        }
        self.query_start_loc.push(self.input_ids.len() as i32);
        self.seq_lens.push(end as i32);
        self.num_computed_before.push(start as i32);
        self.max_blocks = self.max_blocks.max(first.blocks.len());
        for (dst, table) in self.offsets.iter_mut().zip(seq.tables.iter()) {
            dst.push(table.offset as i32);
        }
        for table in seq.tables.rest() {
            self.group_max_blocks = self.group_max_blocks.max(table.blocks.len());
        }
        if let Some(st) = state {
            let slot_or_none = |s: Option<BlockId>| s.map_or(-1, |s| s as i32);
            self.state_slots.push(st.slot as i32);
            self.state_fresh.push(i32::from(st.fresh));
            self.state_restore.push(slot_or_none(st.restore));
            self.state_save.push(slot_or_none(st.save));
        }
        self.entries.push(BatchEntry {
            slot,
            uid: seq.uid,
            num_tokens: n,
            steps,
            proposed: draft.len(),
        });
    }

    /// Fill the padded block tables once every sequence is in.
    pub(crate) fn finish_block_tables(&mut self, seqs: &[Option<Sequence>]) {
        let width = self.max_blocks;
        let rows = self.entries.len();
        self.block_tables.clear();
        self.block_tables.resize(rows * width, 0);
        let extra = self.extra_slots.len();
        let gw = self.group_max_blocks;
        self.group_block_tables.clear();
        self.group_block_tables.resize(extra * rows * gw, 0);
        for (row, e) in self.entries.iter().enumerate() {
            let tables = &seqs[e.slot]
                .as_ref()
                .expect("batched sequence is live")
                .tables;
            let blocks = &tables[0].blocks;
            let dst = &mut self.block_tables[row * width..row * width + blocks.len()];
            for (d, &b) in dst.iter_mut().zip(blocks) {
                *d = b as i32;
            }
            for (g, table) in tables.rest().enumerate() {
                let at = (g * rows + row) * gw;
                let dst = &mut self.group_block_tables[at..at + table.blocks.len()];
                for (d, &b) in dst.iter_mut().zip(&table.blocks) {
                    *d = b as i32;
                }
            }
        }
        self.group_slot_mapping = if self.extra_slots.len() == 1 {
            std::mem::take(&mut self.extra_slots[0])
        } else {
            self.extra_slots.concat()
        };
        self.block_table_offsets = if self.offsets.len() == 1 {
            std::mem::take(&mut self.offsets[0])
        } else {
            self.offsets.concat()
        };
    }
}
