//! The flat description of one forward pass that the backend consumes.

use crate::sequence::Sequence;

/// One sequence's share of a step, kept for `commit`.
#[derive(Debug, Clone)]
pub struct BatchEntry {
    pub slot: usize,
    pub uid: u64,
    pub num_tokens: usize,
    /// Tokens to sample for this sequence (0: mid-prefill; above 1: lookahead steps).
    pub steps: usize,
}

/// Arrays in the dtypes the backend wants: int64 where torch indexes with them
/// (embedding lookup, cache writes), int32 for lengths and block tables.
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
    pub sample_indices: Vec<i64>,
    pub sample_seq_indices: Vec<i64>,
    /// Per sample row: how many tokens may be sampled (1 unless scheduled with lookahead).
    pub sample_max_steps: Vec<i32>,
    /// Placeholders (overlapped scheduling): `input_ids[pending_token_indices[i]]` is not
    /// known yet (it holds 0); it is the token the previous step samples in its sample row
    /// `pending_sample_rows[i]`. The backend fills it in from that step's output, on its side.
    pub pending_token_indices: Vec<i64>,
    pub pending_sample_rows: Vec<i64>,
    pub entries: Vec<BatchEntry>,
}

impl Batch {
    /// Capacity for the common case (every sequence decodes one token) is taken up front:
    /// growing ten vectors by doubling costs more than the whole decode bookkeeping.
    pub(crate) fn new(step: u64, capacity_seqs: usize) -> Self {
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
            sample_indices: Vec::with_capacity(capacity_seqs),
            sample_seq_indices: Vec::with_capacity(capacity_seqs),
            sample_max_steps: Vec::with_capacity(capacity_seqs),
            pending_token_indices: Vec::new(),
            pending_sample_rows: Vec::new(),
            entries: Vec::with_capacity(capacity_seqs),
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

    /// Add `n` tokens of `seq` starting at position `start` (its first token whose KV is
    /// neither computed nor in flight). A position past the committed tokens is a
    /// placeholder for the token sampled in the previous step's row `seq.last_sample_row`.
    pub(crate) fn push(
        &mut self,
        slot: usize,
        seq: &Sequence,
        start: usize,
        n: usize,
        steps: usize,
        block_size: usize,
    ) {
        let end = start + n;
        let known = seq.tokens.len();
        for p in start..end {
            if p < known {
                self.input_ids.push(i64::from(seq.tokens[p]));
            } else {
                self.pending_token_indices.push(self.input_ids.len() as i64);
                self.pending_sample_rows.push(seq.last_sample_row as i64);
                self.input_ids.push(0);
            }
            self.positions.push(p as i64);
            let block = seq.blocks[p / block_size] as i64;
            self.slot_mapping
                .push(block * block_size as i64 + (p % block_size) as i64);
        }
        debug_assert_eq!(steps > 0, end == seq.scheduled_len());
        if steps > 0 {
            self.sample_indices.push(self.input_ids.len() as i64 - 1);
            self.sample_seq_indices.push(self.entries.len() as i64);
            self.sample_max_steps.push(steps as i32);
        }
        self.query_start_loc.push(self.input_ids.len() as i32);
        self.seq_lens.push(end as i32);
        self.num_computed_before.push(start as i32);
        self.max_blocks = self.max_blocks.max(seq.blocks.len());
        self.entries.push(BatchEntry {
            slot,
            uid: seq.uid,
            num_tokens: n,
            steps,
        });
    }

    /// Fill the padded block table once every sequence is in.
    pub(crate) fn finish_block_tables(&mut self, seqs: &[Option<Sequence>]) {
        let width = self.max_blocks;
        self.block_tables.clear();
        self.block_tables.resize(self.entries.len() * width, 0);
        for (row, e) in self.entries.iter().enumerate() {
            let seq_blocks = &seqs[e.slot]
                .as_ref()
                .expect("batched sequence is live")
                .blocks;
            let dst = &mut self.block_tables[row * width..row * width + seq_blocks.len()];
            for (d, &b) in dst.iter_mut().zip(seq_blocks) {
                *d = b as i32;
            }
        }
    }
}
