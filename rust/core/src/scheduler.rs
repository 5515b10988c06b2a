//! Continuous batching: admission under token, sequence and block budgets, chunked
//! prefill, preemption with exact resume, and the commit of sampled tokens.
//!
//! Memory comes in cache groups (`SchedulerConfig::cache_groups`): each attention group
//! (full or sliding window) has its own block pool and block table per sequence, and a
//! recurrent-state group has a pool of state slots, one per running sequence, which also
//! holds the state checkpoints that prefix hits resume from. Every budget, admission,
//! preemption and never-fits decision accounts for every group.

use std::collections::{HashMap, VecDeque};

use crate::allocator::{BlockAllocator, BlockId};
use crate::batch::{Batch, StateOps};
use crate::block_hash::{hash_block, hash_salt, BlockHash, BlockHasher};
use crate::config::SpeculativeMethod;
use crate::config::{CacheGroup, CacheKind, SchedulerConfig};
use crate::error::{AllocError, SchedulerError};
pub use crate::events::StepEvent;
use crate::proposer::{accepts, DraftModelProposer, NgramProposer, Proposer, SequenceProposer};
use crate::sequence::{FinishReason, GroupTables, RequestOptions, SeqState, Sequence};

/// How a commit's tokens are laid out: `[rows, steps]` (lookahead), or a variable count
/// per row (speculation).
#[derive(Debug, Clone, Copy)]
enum Layout<'a> {
    Steps(usize),
    Accepted(&'a [usize]),
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SchedulerStats {
    pub preemptions: u64,
    /// Admissions that looked up the prefix cache, and the prompt tokens they looked up.
    pub prefix_cache_queries: u64,
    pub prefix_cache_query_tokens: u64,
    /// Tokens served from the prefix cache.
    pub prefix_cache_hit_tokens: u64,
    pub requests_added: u64,
    pub requests_finished: u64,
    pub requests_aborted: u64,
    /// Blocks of sliding groups released as their sequences moved past them.
    pub sliding_blocks_released: u64,
    /// State checkpoints saved, and admissions that resumed from one.
    pub state_checkpoints_saved: u64,
    pub state_checkpoint_hits: u64,
    /// Speculative decoding: verified rows that carried proposals, the tokens proposed in
    /// them, and those the target model accepted.
    pub spec_rows: u64,
    pub spec_drafted_tokens: u64,
    pub spec_accepted_tokens: u64,
}

/// One cache group's pool as `/metrics` shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupUsage {
    pub group: CacheGroup,
    /// Blocks or slots: in the pool, held by some sequence (or checkpoint in flight), free.
    pub total: usize,
    pub used: usize,
    pub free: usize,
    /// Free blocks (or slots) whose content the prefix cache can still serve.
    pub cached: usize,
}

#[derive(Debug)]
pub struct Scheduler {
    cfg: SchedulerConfig,
    /// The attention groups, in config order, and one allocator for each.
    groups: Vec<CacheGroup>,
    allocs: Vec<BlockAllocator>,
    /// The state group's slot pool (block size `kv_block_size`, so that a checkpoint is
    /// published under its block's hash), if there is one.
    state: Option<BlockAllocator>,
    /// Any sliding group (else no release work per step).
    sliding: bool,
    /// Per attention group: blocks a sequence needs this step (scratch, no allocation).
    need: Vec<usize>,
    /// Prefix matching scratch: chained hashes of the prompt, and per group whether block
    /// `j` is cached.
    match_hashes: Vec<BlockHash>,
    match_hits: Vec<Vec<Option<BlockId>>>,
    /// Proposals of the sequence being scheduled (scratch).
    draft: Vec<u32>,
    seqs: Vec<Option<Sequence>>,
    ids: Vec<String>,
    free_slots: Vec<usize>,
    /// Slots ended since the last `schedule`: their ids stay readable for that step's
    /// batch and events, so they join `free_slots` only at the next `schedule`.
    retired_slots: Vec<usize>,
    by_id: HashMap<String, usize>,
    /// Sorted by `Sequence::order_key` (priority, then arrival): scheduled front first;
    /// the back is the first to preempt.
    running: Vec<usize>,
    /// Sorted by `Sequence::order_key`: admitted front first.
    waiting: VecDeque<usize>,
    /// Events of requests that ended without model work (max_new_tokens == 0).
    pending: Vec<StepEvent>,
    step: u64,
    /// Steps scheduled and not yet committed, oldest first, each with its lookahead. More
    /// than one only with `schedule_overlapped`; commits come in this order.
    open: VecDeque<(u64, usize)>,
    last_committed: u64,
    next_uid: u64,
    stats: SchedulerStats,
}

impl Scheduler {
    pub fn new(cfg: SchedulerConfig) -> Result<Self, SchedulerError> {
        Self::with_hasher(cfg, hash_block)
    }

    /// As `new`, with another block hash function for the prefix cache (for tests; see
    /// `BlockAllocator::with_hasher`).
    pub fn with_hasher(cfg: SchedulerConfig, hasher: BlockHasher) -> Result<Self, SchedulerError> {
        cfg.validate().map_err(SchedulerError::Rejected)?;
        let all = cfg.groups();
        let groups: Vec<CacheGroup> = all.iter().copied().filter(|g| g.is_attention()).collect();
        let allocs = groups
            .iter()
            .map(|g| {
                BlockAllocator::with_hasher(
                    g.size,
                    cfg.kv_block_size,
                    cfg.enable_prefix_caching,
                    hasher,
                )
            })
            .collect();
        let state = all.iter().find(|g| !g.is_attention()).map(|g| {
            BlockAllocator::with_hasher(
                g.size,
                cfg.kv_block_size,
                cfg.enable_prefix_caching,
                hasher,
            )
        });
        Ok(Scheduler {
            sliding: groups.iter().any(|g| g.window().is_some()),
            need: vec![0; groups.len()],
            match_hashes: Vec::new(),
            match_hits: vec![Vec::new(); groups.len()],
            draft: Vec::new(),
            groups,
            allocs,
            state,
            cfg,
            seqs: Vec::new(),
            ids: Vec::new(),
            free_slots: Vec::new(),
            retired_slots: Vec::new(),
            by_id: HashMap::new(),
            running: Vec::new(),
            waiting: VecDeque::new(),
            pending: Vec::new(),
            step: 0,
            open: VecDeque::new(),
            last_committed: 0,
            next_uid: 0,
            stats: SchedulerStats::default(),
        })
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }
    /// The first attention group's allocator (the only one without cache groups).
    pub fn allocator(&self) -> &BlockAllocator {
        &self.allocs[0]
    }
    /// Attention group `g`'s allocator (groups in config order, the state group left out).
    pub fn group_allocator(&self, g: usize) -> &BlockAllocator {
        &self.allocs[g]
    }
    /// The state group's slot pool, if there is one.
    pub fn state_allocator(&self) -> Option<&BlockAllocator> {
        self.state.as_ref()
    }
    /// Usage of every cache group, in config order.
    pub fn group_usage(&self) -> Vec<GroupUsage> {
        let mut attn = self.groups.iter().zip(&self.allocs);
        self.cfg
            .groups()
            .iter()
            .map(|g| {
                let a = if g.is_attention() {
                    attn.next().expect("one allocator per attention group").1
                } else {
                    self.state.as_ref().expect("a state group has a pool")
                };
                GroupUsage {
                    group: *g,
                    total: a.total(),
                    used: a.num_used(),
                    free: a.num_free(),
                    cached: a.num_cached(),
                }
            })
            .collect()
    }
    pub fn stats(&self) -> &SchedulerStats {
        &self.stats
    }
    pub fn num_running(&self) -> usize {
        self.running.len()
    }
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }
    /// Steps scheduled and not committed yet.
    pub fn num_open_steps(&self) -> usize {
        self.open.len()
    }
    pub fn has_work(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty() || !self.pending.is_empty()
    }
    pub fn is_live(&self, request_id: &str) -> bool {
        self.by_id.contains_key(request_id)
    }
    /// The request id in `slot` (of a batch row or an event), valid until the next
    /// `schedule`.
    pub fn request_id(&self, slot: usize) -> &str {
        &self.ids[slot]
    }
    pub fn sequence(&self, request_id: &str) -> Option<&Sequence> {
        let slot = *self.by_id.get(request_id)?;
        self.seqs[slot].as_ref()
    }

    /// Tokens a request can hold at most: the smallest full group's pool (sliding and
    /// state groups hold a bounded amount whatever the length), and the model's context if
    /// bounded.
    pub fn max_sequence_tokens(&self) -> usize {
        let pool = self
            .groups
            .iter()
            .filter(|g| g.kind == CacheKind::Full)
            .map(|g| g.size * self.cfg.kv_block_size)
            .min()
            .unwrap_or(usize::MAX);
        self.cfg.max_model_len.map_or(pool, |m| m.min(pool))
    }

    /// Queue a request; returns its slot. Rejects, changing nothing, a request that could
    /// never be served, so it cannot block the head of the queue forever.
    pub fn add_request(
        &mut self,
        request_id: &str,
        prompt: &[u32],
        max_new_tokens: usize,
        stop_token_ids: &[u32],
    ) -> Result<usize, SchedulerError> {
        self.add_request_with(
            request_id,
            prompt,
            max_new_tokens,
            stop_token_ids,
            &RequestOptions::default(),
        )
    }

    /// Why a request of `need` tokens could never run alone, if it could not: per group,
    /// the most blocks it holds at once against the group's pool.
    fn never_fits(&self, prompt_len: usize, max_new_tokens: usize) -> Option<String> {
        let need = prompt_len.saturating_add(max_new_tokens);
        let bs = self.cfg.kv_block_size;
        let single = self.cfg.cache_groups.is_empty();
        for (g, group) in self.groups.iter().enumerate() {
            let pool = group.size * bs;
            match group.kind {
                CacheKind::Full if need > pool => {
                    let what = if single {
                        String::new()
                    } else {
                        format!(" of cache group {g}")
                    };
                    return Some(format!(
                        "prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) = \
                         {need} tokens exceeds the KV pool{what} of {pool} tokens"
                    ));
                }
                CacheKind::Sliding { window } => {
                    let chunk = self.cfg.max_batch_tokens.min(need);
                    let peak =
                        CacheGroup::sliding_peak_blocks(window, chunk, bs).min(need.div_ceil(bs));
                    if peak > group.size {
                        return Some(format!(
                            "prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) \
                             needs up to {peak} blocks at once in cache group {g} (sliding \
                             window of {window} tokens), which has {} blocks",
                            group.size
                        ));
                    }
                }
                _ => {}
            }
        }
        None
    }

    /// `add_request` with a priority, a cache salt or no prefix-cache lookup.
    pub fn add_request_with(
        &mut self,
        request_id: &str,
        prompt: &[u32],
        max_new_tokens: usize,
        stop_token_ids: &[u32],
        opts: &RequestOptions,
    ) -> Result<usize, SchedulerError> {
        if self.by_id.contains_key(request_id) {
            return Err(SchedulerError::DuplicateRequest(request_id.to_string()));
        }
        if prompt.is_empty() {
            return Err(SchedulerError::Rejected(
                "the prompt must have at least one token".into(),
            ));
        }
        if let Some(why) = self.never_fits(prompt.len(), max_new_tokens) {
            return Err(SchedulerError::Rejected(why));
        }
        let need = prompt.len().saturating_add(max_new_tokens);
        if let Some(limit) = self.cfg.max_model_len {
            if need > limit {
                return Err(SchedulerError::Rejected(format!(
                    "prompt ({} tokens) + max_new_tokens ({max_new_tokens}) = {need} tokens \
                     exceeds the model context of {limit} tokens",
                    prompt.len()
                )));
            }
        }
        self.stats.requests_added += 1;
        let slot = self.free_slots.pop().unwrap_or_else(|| {
            self.seqs.push(None);
            self.ids.push(String::new());
            self.seqs.len() - 1
        });
        self.ids[slot].clear();
        self.ids[slot].push_str(request_id);
        if max_new_tokens == 0 {
            // The slot retires when its event is handed out, in `commit`.
            self.stats.requests_finished += 1;
            self.pending.push(StepEvent {
                slot,
                token: None,
                finish: Some(FinishReason::Length),
            });
            return Ok(slot);
        }
        let uid = self.next_uid;
        self.next_uid += 1;
        let mut tokens = Vec::with_capacity(prompt.len() + max_new_tokens);
        tokens.extend_from_slice(prompt);
        self.seqs[slot] = Some(Sequence {
            request_id: request_id.to_string(),
            uid,
            tokens,
            prompt_len: prompt.len(),
            max_new_tokens,
            stop_token_ids: stop_token_ids.to_vec(),
            tables: GroupTables::new(self.groups.len()),
            block_hashes: Vec::new(),
            num_computed: 0,
            state: SeqState::Waiting,
            num_cached_prompt: None,
            num_preemptions: 0,
            priority: opts.priority,
            cache_salt: opts.cache_salt.as_deref().map(hash_salt),
            skip_prefix_cache: opts.skip_prefix_cache,
            num_pending: 0,
            num_inflight: 0,
            num_open_entries: 0,
            last_sample_step: 0,
            last_sample_row: 0,
            state_slot: None,
            restore_from: None,
            pending_save: None,
            proposer: (self.cfg.num_speculative_tokens > 0 && !opts.no_speculation).then(|| {
                match self.cfg.speculative_method {
                    SpeculativeMethod::Ngram => SequenceProposer::Ngram(NgramProposer::new(
                        self.cfg.speculative_ngram_min,
                        self.cfg.speculative_ngram_max,
                    )),
                    SpeculativeMethod::DraftModel => {
                        SequenceProposer::DraftModel(DraftModelProposer)
                    }
                }
            }),
            num_proposed: 0,
            draft: Vec::new(),
            spec_k: self.cfg.num_speculative_tokens,
        });
        self.by_id.insert(request_id.to_string(), slot);
        self.enqueue_waiting(slot);
        Ok(slot)
    }

    fn key(&self, slot: usize) -> (i64, u64) {
        self.seqs[slot]
            .as_ref()
            .expect("queued slot is live")
            .order_key()
    }

    /// Into the waiting queue behind every sequence that orders before it (O(1) for the
    /// common case, an arrival of the lowest priority present).
    fn enqueue_waiting(&mut self, slot: usize) {
        let key = self.key(slot);
        let at = self.waiting.partition_point(|&s| self.key(s) < key);
        self.waiting.insert(at, slot);
    }

    /// Into the running list, which stays in `order_key` order.
    fn insert_running(&mut self, slot: usize) {
        let key = self.key(slot);
        let at = self.running.partition_point(|&s| self.key(s) < key);
        self.running.insert(at, slot);
    }

    /// Free everything a sequence holds: its blocks in every group (tail first, so
    /// eviction takes a prompt's end before its shared beginning), its state slot, and
    /// the checkpoints it restores from or saves into.
    fn release_all(
        allocs: &mut [BlockAllocator],
        state: &mut Option<BlockAllocator>,
        seq: &mut Sequence,
    ) {
        for (table, alloc) in seq.tables.iter_mut().zip(allocs.iter_mut()) {
            for &b in table.blocks.iter().rev() {
                alloc.release(b);
            }
            table.blocks.clear();
            table.offset = 0;
        }
        if let Some(pool) = state.as_mut() {
            let held = [
                seq.state_slot.take(),
                seq.restore_from.take(),
                seq.pending_save.take().map(|(s, _, _)| s),
            ];
            for slot in held.into_iter().flatten() {
                pool.release_uncached_first(slot);
            }
        }
        seq.block_hashes.clear();
        seq.num_computed = 0;
    }

    /// Release the blocks of sliding groups that lie wholly before the window of the first
    /// position still to compute (`num_computed`: positions in flight still read theirs).
    /// Oldest first, so the prefix cache evicts a sequence's earliest window first.
    fn release_out_of_window(
        groups: &[CacheGroup],
        allocs: &mut [BlockAllocator],
        seq: &mut Sequence,
        bs: usize,
        stats: &mut SchedulerStats,
    ) {
        for ((group, table), alloc) in groups.iter().zip(seq.tables.iter_mut()).zip(allocs) {
            let Some(window) = group.window() else {
                continue;
            };
            // Nothing to release until the window starts past the table's first block
            // (`keep_from > offset`, checked without dividing: most steps release nothing).
            if seq.num_computed + 1 < window + (table.offset + 1) * bs {
                continue;
            }
            let keep_from = (seq.num_computed + 1 - window) / bs;
            let k = (keep_from - table.offset).min(table.blocks.len());
            for &b in &table.blocks[..k] {
                alloc.release(b);
            }
            table.blocks.drain(..k);
            table.offset += k;
            stats.sliding_blocks_released += k as u64;
        }
    }

    /// Preempt the running sequence that orders last (lowest priority, latest arrival);
    /// returns its slot. It waits again in its place by the same order.
    fn preempt_last(&mut self) -> usize {
        let slot = self.running.pop().expect("preempt with nothing running");
        self.requeue(slot);
        slot
    }

    /// Preempt the running sequence in `slot`.
    fn preempt_slot(&mut self, slot: usize) {
        let pos = self.running.iter().position(|&s| s == slot);
        self.running
            .remove(pos.expect("preempting a running sequence"));
        self.requeue(slot);
    }

    /// Free what a sequence just taken off the running list holds and queue it again.
    fn requeue(&mut self, slot: usize) {
        let seq = self.seqs[slot].as_mut().expect("running slot is live");
        Self::release_all(&mut self.allocs, &mut self.state, seq);
        // Its pending tokens, if any, still arrive with their commits; it is re-admitted
        // only after them (see `num_open_entries`).
        seq.num_inflight = 0;
        seq.state = SeqState::Waiting;
        seq.num_preemptions += 1;
        self.enqueue_waiting(slot);
        self.stats.preemptions += 1;
    }

    /// Plan the next step. An empty batch means nothing to compute now (there may still be
    /// events to collect with `commit`).
    pub fn schedule(&mut self) -> Batch {
        self.schedule_lookahead(0)
    }

    /// Tokens a sequence may take this step if its prompt ends at `end`: 1, plus up to
    /// `lookahead` more decode steps that a remote worker runs on its own, bounded by the
    /// tokens it may still generate so no slot is reserved for a token that can never exist.
    /// (`add_request` admits only prompt + max_new_tokens within `max_sequence_tokens`, so
    /// max_new_tokens is also the bound that the model context and the pool set.)
    fn sample_steps(seq: &Sequence, end: usize, lookahead: usize) -> usize {
        if end != seq.scheduled_len() {
            return 0;
        }
        // Lookahead never meets a pending token (`schedule_overlapped` refuses it), and
        // with lookahead 0 every sampled sequence takes one step: no pending term needed.
        let left = seq.max_new_tokens - seq.num_output();
        left.clamp(1, 1 + lookahead)
    }

    /// Book one batch entry: its KV positions are in flight, and a sampled token is pending
    /// (the next step's placeholder for it reads this step's sample row).
    fn note_scheduled(seq: &mut Sequence, n: usize, steps: usize, step: u64, batch: &Batch) {
        seq.num_inflight += n;
        seq.num_open_entries += 1;
        seq.num_proposed = batch.entries.last().map_or(0, |e| e.proposed);
        if steps > 0 {
            seq.num_pending += 1;
            seq.last_sample_step = step;
            seq.last_sample_row = batch.sample_indices.len() - 1;
        }
    }

    /// Proposals for a sequence that decodes one token from `start` (its last token's
    /// position) and nothing in flight: up to its adaptive count, the tokens it may still
    /// generate after the one the step samples anyway, the step's token budget left and
    /// the query rows left for proposals.
    fn propose(
        seq: &mut Sequence,
        start: usize,
        n: usize,
        budget_left: usize,
        rows_left: usize,
        draft: &mut Vec<u32>,
    ) {
        // A pending token is not in `tokens` yet: its placeholder's position is
        // `tokens.len()`, so `start + 1 != tokens.len()` keeps such a sequence out too.
        if n != 1 || start + 1 != seq.tokens.len() || seq.num_inflight > 0 {
            return;
        }
        let left = seq.max_new_tokens - seq.num_output();
        let Some(proposer) = seq.proposer.as_mut() else {
            return;
        };
        let k = seq.spec_k.min(left - 1).min(budget_left).min(rows_left);
        proposer.propose(&seq.tokens, k, draft);
    }

    /// Forget every open step (a plain `schedule` over an uncommitted one): their batches
    /// can no longer be committed, and their tokens are computed again.
    fn discard_open_steps(&mut self) {
        if self.open.is_empty() {
            return;
        }
        self.open.clear();
        if self.state.is_some() {
            // A discarded step may have run and folded its tokens into the state: unlike KV,
            // that cannot be written again, so such a sequence starts over from the cache.
            let touched: Vec<usize> = self
                .running
                .iter()
                .copied()
                .filter(|&s| {
                    self.seqs[s]
                        .as_ref()
                        .is_some_and(|q| q.num_open_entries > 0)
                })
                .collect();
            for slot in touched {
                self.preempt_slot(slot);
            }
        }
        for seq in self.seqs.iter_mut().flatten() {
            seq.num_pending = 0;
            seq.num_inflight = 0;
            seq.num_open_entries = 0;
            seq.num_proposed = 0;
            seq.draft.clear();
            // A checkpoint an open step was to save is never committed now.
            if let (Some((slot, _, _)), Some(pool)) = (seq.pending_save.take(), self.state.as_mut())
            {
                pool.release_uncached_first(slot);
            }
        }
    }

    /// Plan the next step while the previous ones are still running (not committed):
    /// each running sequence is assumed to have one more token per open step that sampled
    /// it. A decode whose input token is still pending gets a placeholder in the batch
    /// (`pending_token_indices`, `pending_sample_rows`) that the backend fills in from the
    /// previous step's output. Sequences whose pending tokens reach their length limit are
    /// left out (they finish at commit); one that stops on a sampled stop token costs at
    /// most one wasted row per open step, and `commit` drops what comes after the stop.
    /// Lookahead cannot be combined with an open step (its token count is not known).
    pub fn schedule_overlapped(&mut self, lookahead: usize) -> Result<Batch, SchedulerError> {
        if let Some(&(step, la)) = self.open.back() {
            if lookahead > 0 || la > 0 {
                return Err(SchedulerError::BatchMismatch(format!(
                    "cannot schedule with lookahead over the open step {step}: commit it first"
                )));
            }
        }
        Ok(self.schedule_open(lookahead))
    }

    /// Blocks a sequence still needs in each attention group (into `need`) to compute up
    /// to `end` and then run `steps` tokens: every token but the last sampled one gets its
    /// KV written. True if every group has them free.
    fn blocks_needed(
        need: &mut [usize],
        allocs: &[BlockAllocator],
        seq: &Sequence,
        end: usize,
        steps: usize,
        bs: usize,
    ) -> bool {
        let blocks = (end + steps.saturating_sub(1)).div_ceil(bs);
        let mut fits = true;
        for ((n, table), alloc) in need.iter_mut().zip(seq.tables.iter()).zip(allocs) {
            *n = blocks.saturating_sub(table.end());
            fits &= alloc.num_free() >= *n;
        }
        fits
    }

    /// Allocate what `blocks_needed` found, in every group (free blocks checked).
    fn allocate_needed(need: &[usize], allocs: &mut [BlockAllocator], seq: &mut Sequence) {
        for ((&n, table), alloc) in need.iter().zip(seq.tables.iter_mut()).zip(allocs) {
            // Most steps of a decoding sequence need no new block in any group.
            if n != 0 {
                alloc
                    .allocate_into(n, &mut table.blocks)
                    .expect("free blocks checked");
            }
        }
    }

    /// The first block-aligned position after `start` and at most `end` where a state
    /// checkpoint is due: the last one within the prompt, and every
    /// `state_checkpoint_interval` blocks.
    fn checkpoint_in(&self, seq: &Sequence, start: usize, end: usize) -> Option<usize> {
        let bs = self.cfg.kv_block_size;
        let prompt_end = seq.prompt_len / bs * bs;
        let mut best = (start < prompt_end && prompt_end <= end).then_some(prompt_end);
        if self.cfg.state_checkpoint_interval > 0 {
            let every = self.cfg.state_checkpoint_interval * bs;
            let next = (start / every + 1) * every;
            if next <= end {
                best = Some(best.map_or(next, |b| b.min(next)));
            }
        }
        best
    }

    /// With a state group and the prefix cache on: where this step's chunk of `seq` from
    /// `start` should end to save a checkpoint (the chunk is cut there), and a slot for it.
    /// None when no checkpoint is due, one is already in flight, or no slot is free.
    fn plan_checkpoint(
        &mut self,
        seq_slot: usize,
        start: usize,
        n: usize,
    ) -> Option<(usize, BlockId)> {
        let seq = self.seqs[seq_slot].as_ref().expect("live");
        let pool = self.state.as_ref()?;
        if !pool.caching_enabled() || seq.pending_save.is_some() || pool.num_free() == 0 {
            return None;
        }
        let at = self.checkpoint_in(seq, start, start + n)?;
        let pool = self.state.as_mut().expect("checked above");
        let slot = pool.allocate(1).expect("a free slot checked")[0];
        Some((at, slot))
    }

    /// `schedule`, reserving KV slots so that each sampled sequence can run `lookahead`
    /// more decode steps before the next commit (see `commit_steps`).
    pub fn schedule_lookahead(&mut self, lookahead: usize) -> Batch {
        self.discard_open_steps();
        self.schedule_open(lookahead)
    }

    /// Schedule one more step on top of the open ones.
    fn schedule_open(&mut self, lookahead: usize) -> Batch {
        self.free_slots.append(&mut self.retired_slots);
        self.step += 1;
        let step = self.step;
        self.open.push_back((step, lookahead));
        let bs = self.cfg.kv_block_size;
        let max_len = self.max_sequence_tokens();
        let mut batch = Batch::new(
            self.step,
            (self.running.len() + 1).min(self.cfg.max_running_seqs),
            self.groups.len(),
        );
        let mut budget = self.cfg.max_batch_tokens;
        let mut preempted = false;
        let mut need = std::mem::take(&mut self.need);
        let mut draft = std::mem::take(&mut self.draft);
        // Query rows proposals may still take this step (only sequences that hold a
        // proposer propose: none where speculation is off).
        let mut spec_rows = if lookahead == 0 {
            self.cfg
                .speculative_max_rows
                .saturating_sub(self.running.len())
        } else {
            0
        };

        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let slot = self.running[i];
            let seq = self.seqs[slot].as_mut().expect("running slot is live");
            if self.sliding {
                Self::release_out_of_window(
                    &self.groups,
                    &mut self.allocs,
                    seq,
                    bs,
                    &mut self.stats,
                );
            }
            if seq.num_proposed > 0 {
                // Its open step verifies proposals: how many tokens it gets is known only
                // at that commit, so no placeholder can follow it.
                i += 1;
                continue;
            }
            if seq.num_pending > 0
                && (seq.last_sample_step + 1 != step
                    || seq.num_output() + seq.num_pending >= seq.max_new_tokens
                    || seq.scheduled_len() >= max_len)
            {
                // Its pending token ends it at commit (length), or was sampled by an older
                // open step than the last (no placeholder can name it): wait for commits.
                i += 1;
                continue;
            }
            let start = seq.num_computed + seq.num_inflight;
            let mut n = (seq.scheduled_len() - start).min(budget);
            let save = self.plan_checkpoint(slot, start, n);
            if let Some((at, _)) = save {
                n = at - start;
            }
            let seq = self.seqs[slot].as_mut().expect("running slot is live");
            let steps = Self::sample_steps(seq, start + n, lookahead);
            draft.clear();
            // A chunk cut at a checkpoint never proposes: only recurrent-state models save
            // checkpoints, and they have no proposers (`Scheduler::new` refuses both).
            Self::propose(seq, start, n, budget - n, spec_rows, &mut draft);
            if !draft.is_empty()
                && !Self::blocks_needed(
                    &mut need,
                    &self.allocs,
                    seq,
                    start + n + draft.len(),
                    steps,
                    bs,
                )
            {
                // Speculation never takes a block that would cost a preemption.
                draft.clear();
            }
            n += draft.len();
            spec_rows -= draft.len();
            let mut self_preempted = false;
            let mut wait = false;
            while !Self::blocks_needed(
                &mut need,
                &self.allocs,
                self.seqs[slot].as_ref().expect("live"),
                start + n,
                steps,
                bs,
            ) {
                if self.sliding && self.running.last() == Some(&slot) {
                    let inflight = self.seqs[slot].as_ref().expect("live").num_inflight;
                    if inflight > 0 {
                        // Its open steps' commits release sliding blocks: wait for them
                        // rather than start over (which would only repeat the same).
                        wait = true;
                        break;
                    }
                }
                preempted = true;
                if self.preempt_last() == slot {
                    self_preempted = true;
                    break;
                }
            }
            if wait {
                if let (Some((_, ck)), Some(pool)) = (save, self.state.as_mut()) {
                    pool.release_uncached_first(ck);
                }
                i += 1;
                continue;
            }
            if self_preempted {
                if let (Some((_, ck)), Some(pool)) = (save, self.state.as_mut()) {
                    pool.release_uncached_first(ck);
                }
                break;
            }
            let seq = self.seqs[slot].as_mut().expect("running slot is live");
            Self::allocate_needed(&need, &mut self.allocs, seq);
            if let Some((at, ck)) = save {
                seq.pending_save = Some((ck, step, at));
            }
            let ops = seq.state_slot.map(|own| StateOps {
                slot: own,
                fresh: start == 0,
                restore: None,
                save: save.map(|(_, ck)| ck),
            });
            batch.push(slot, seq, start, n, steps, bs, ops, &draft);
            Self::note_scheduled(seq, n, steps, step, &batch);
            seq.draft.clone_from(&draft);
            budget -= n;
            i += 1;
        }
        draft.clear();
        self.draft = draft;

        // A step that preempted admits nobody: admitting would only start the thrash.
        while !preempted && budget > 0 && self.running.len() < self.cfg.max_running_seqs {
            let Some(&slot) = self.waiting.front() else {
                break;
            };
            let seq = self.seqs[slot].as_ref().expect("waiting slot is live");
            if seq.num_open_entries > 0 {
                // Preempted while open steps still compute for it: its pending tokens come
                // with their commits, and it resumes after them.
                break;
            }
            debug_assert!(seq.tables.iter().all(|t| t.blocks.is_empty()) && seq.num_computed == 0);
            debug_assert!(seq.num_pending == 0 && seq.num_inflight == 0);
            let lookup = self.allocs[0].caching_enabled() && !seq.skip_prefix_cache;
            let computed = if lookup { self.match_prefix(slot) } else { 0 };
            let seq = self.seqs[slot].as_ref().expect("waiting slot is live");
            let mut n = (seq.tokens.len() - computed).min(budget);
            let wants_slot = self.state.is_some();
            let slot_free = self.state.as_ref().is_none_or(|p| p.num_free() > 0);
            let steps = Self::sample_steps(seq, computed + n, lookahead);
            let fits = Self::blocks_needed(&mut need, &self.allocs, seq, computed + n, steps, bs);
            if !fits || !slot_free {
                // Head of line waits for blocks; give back what the cache lookup took.
                let seq = self.seqs[slot].as_mut().expect("waiting slot is live");
                Self::release_all(&mut self.allocs, &mut self.state, seq);
                break;
            }
            if lookup {
                self.stats.prefix_cache_queries += 1;
                self.stats.prefix_cache_query_tokens += seq.tokens.len() as u64;
                self.stats.prefix_cache_hit_tokens += computed as u64;
            }
            if wants_slot {
                let own = self
                    .state
                    .as_mut()
                    .expect("state group")
                    .allocate(1)
                    .expect("a free slot checked")[0];
                self.seqs[slot].as_mut().expect("live").state_slot = Some(own);
            }
            // A checkpoint due inside the chunk cuts it (fewer blocks, so they still fit).
            let save = self.plan_checkpoint(slot, computed, n);
            let mut steps = steps;
            if let Some((at, _)) = save {
                n = at - computed;
                let seq = self.seqs[slot].as_ref().expect("live");
                steps = Self::sample_steps(seq, computed + n, lookahead);
                Self::blocks_needed(&mut need, &self.allocs, seq, computed + n, steps, bs);
            }
            let seq = self.seqs[slot].as_mut().expect("live");
            Self::allocate_needed(&need, &mut self.allocs, seq);
            seq.num_computed = computed;
            if seq.num_cached_prompt.is_none() {
                seq.num_cached_prompt = Some(computed.min(seq.prompt_len));
            }
            seq.state = SeqState::Running;
            if let Some((at, ck)) = save {
                seq.pending_save = Some((ck, step, at));
            }
            if seq.restore_from.is_some() {
                self.stats.state_checkpoint_hits += 1;
            }
            let restore = seq.restore_from;
            let ops = seq.state_slot.map(|own| StateOps {
                slot: own,
                fresh: computed == 0,
                restore,
                save: save.map(|(_, ck)| ck),
            });
            self.waiting.pop_front();
            self.insert_running(slot);
            let seq = self.seqs[slot].as_mut().expect("live");
            batch.push(slot, seq, computed, n, steps, bs, ops, &[]);
            Self::note_scheduled(seq, n, steps, step, &batch);
            budget -= n;
        }

        self.need = need;
        batch.finish_block_tables(&self.seqs);
        batch
    }

    /// Look the waiting sequence in `slot` up in the prefix cache: the longest block-aligned
    /// prefix at which every group can resume (a full group holds all its blocks, a sliding
    /// group the blocks of the window before it, a state group a checkpoint there). Takes
    /// references on what it uses, fills the sequence's tables (and `restore_from`) and
    /// returns the tokens it covers (never the last token: its logits are needed).
    fn match_prefix(&mut self, slot: usize) -> usize {
        let bs = self.cfg.kv_block_size;
        let seq = self.seqs[slot].as_mut().expect("waiting slot is live");
        if seq.tokens.is_empty() {
            return 0;
        }
        let full_blocks = (seq.tokens.len() - 1) / bs;
        self.match_hashes.clear();
        for hits in &mut self.match_hits {
            hits.clear();
        }
        let mut parent = seq.cache_salt;
        // Walk the chain while some k past it could still be served: a full group stops
        // it at its first miss; sliding and state groups alone walk the whole prompt.
        for j in 0..full_blocks {
            let chunk = &seq.tokens[j * bs..(j + 1) * bs];
            let hash = self.allocs[0].hash(parent, chunk);
            let mut full_miss = false;
            for ((g, alloc), hits) in self
                .groups
                .iter()
                .zip(&self.allocs)
                .zip(&mut self.match_hits)
            {
                let hit = alloc.lookup(hash, parent, chunk);
                full_miss |= g.kind == CacheKind::Full && hit.is_none();
                hits.push(hit);
            }
            if full_miss {
                for hits in &mut self.match_hits {
                    hits.pop();
                }
                break;
            }
            self.match_hashes.push(hash);
            parent = Some(hash);
        }
        // The longest k whose window (sliding) and checkpoint (state) are all there.
        let mut k = self.match_hashes.len();
        let checkpoint = |k: usize, seq: &Sequence| -> Option<BlockId> {
            let pool = self.state.as_ref()?;
            let parent = if k >= 2 {
                Some(self.match_hashes[k - 2])
            } else {
                seq.cache_salt
            };
            pool.lookup(
                self.match_hashes[k - 1],
                parent,
                &seq.tokens[(k - 1) * bs..k * bs],
            )
        };
        let mut restore = None;
        while k > 0 {
            let c = k * bs;
            let windows_ok =
                self.groups
                    .iter()
                    .zip(&self.match_hits)
                    .all(|(g, hits)| match g.window() {
                        Some(w) => hits[(c + 1).saturating_sub(w) / bs..k]
                            .iter()
                            .all(Option::is_some),
                        None => true,
                    });
            if windows_ok {
                if self.state.is_none() {
                    break;
                }
                if let Some(ck) = checkpoint(k, seq) {
                    restore = Some(ck);
                    break;
                }
            }
            k -= 1;
        }
        let c = k * bs;
        for (((g, alloc), hits), table) in self
            .groups
            .iter()
            .zip(&mut self.allocs)
            .zip(&self.match_hits)
            .zip(seq.tables.iter_mut())
        {
            let from = g
                .window()
                .map_or(0, |w| (c + 1).saturating_sub(w) / bs)
                .min(k);
            table.offset = from;
            for hit in &hits[from..k] {
                let id = hit.expect("checked present");
                alloc.acquire(id);
                table.blocks.push(id);
            }
        }
        if let (Some(ck), Some(pool)) = (restore, self.state.as_mut()) {
            pool.acquire(ck);
            seq.restore_from = Some(ck);
        }
        seq.block_hashes.extend_from_slice(&self.match_hashes[..k]);
        c
    }

    /// Apply the step's sampled tokens (one per sample row of `batch`) and return its
    /// events. Sequences aborted since `schedule` are skipped.
    pub fn commit(
        &mut self,
        batch: &Batch,
        sampled: &[u32],
    ) -> Result<Vec<StepEvent>, SchedulerError> {
        self.commit_steps(batch, sampled, 1)
    }

    /// An error unless `batch` is the next open step.
    fn check_next(&self, batch: &Batch) -> Result<(), SchedulerError> {
        let next = self.open.front().map(|&(step, _)| step);
        if next != Some(batch.step) {
            return Err(SchedulerError::BatchMismatch(format!(
                "batch of step {} is not the next open step ({}){}",
                batch.step,
                next.map_or_else(|| "none".to_string(), |n| n.to_string()),
                if batch.step <= self.last_committed {
                    " (already committed)"
                } else {
                    ""
                }
            )));
        }
        Ok(())
    }

    /// Commit a step that verified proposals (`batch.num_proposed`): row `r` accepted
    /// `counts[r]` tokens, the next ones of `tokens` (rows in order): between 1 and its
    /// proposals + 1 (exactly 1 for a row without proposals), of which all but the last
    /// must be its proposals, in order (the target model agreed with them; the last is
    /// its own). The KV of the rejected proposals is rolled back: their slots count as not
    /// computed, and blocks taken only for them are freed; only accepted tokens' blocks are
    /// ever published to the prefix cache. A stop token or the length limit inside the
    /// accepted run ends the request there. Nothing changes if the arguments are wrong.
    pub fn commit_accepted(
        &mut self,
        batch: &Batch,
        tokens: &[u32],
        counts: &[usize],
    ) -> Result<Vec<StepEvent>, SchedulerError> {
        self.check_next(batch)?;
        let rows = batch.num_samples();
        if counts.len() != rows || counts.iter().sum::<usize>() != tokens.len() {
            return Err(SchedulerError::BatchMismatch(format!(
                "expected {rows} accepted counts summing to the {} tokens, got {} counts \
                 summing to {}",
                tokens.len(),
                counts.len(),
                counts.iter().sum::<usize>()
            )));
        }
        let mut at = 0;
        for (r, e) in batch.entries.iter().filter(|e| e.steps > 0).enumerate() {
            let count = counts[r];
            let k = e.proposed;
            let ok = if k == 0 {
                count == e.steps
            } else {
                // The proposals, unless the request is gone (then its row is ignored).
                let draft = self.seqs[e.slot]
                    .as_ref()
                    .filter(|q| q.uid == e.uid)
                    .map(|q| &q.draft[..]);
                (1..=k + 1).contains(&count)
                    && draft.is_none_or(|d| {
                        d[..count - 1]
                            .iter()
                            .zip(&tokens[at..])
                            .all(|(&p, &t)| accepts(p, t))
                    })
            };
            if !ok {
                return Err(SchedulerError::BatchMismatch(format!(
                    "sample row {r} ({k} proposed) cannot accept {:?}",
                    &tokens[at..at + count]
                )));
            }
            at += count;
        }
        self.commit_layout(batch, tokens, Layout::Accepted(counts))
    }

    /// Commit a batch scheduled with lookahead: `sampled` is row-major
    /// `[num_samples, steps]`, row `r` holding the tokens of `steps` consecutive decode
    /// steps, of which the first `batch.sample_max_steps[r]` are real. Tokens after a stop
    /// condition are discarded. One event per accepted token.
    ///
    /// With several open steps (`schedule_overlapped`) batches are committed oldest first.
    /// Commit reconciles what the later steps assumed: a sequence that ends here (stop
    /// token, length) is freed, and its rows in later batches are ignored when they are
    /// committed; a sequence preempted after this batch was scheduled still gets its token
    /// (it was sampled from the right context) and resumes over it.
    pub fn commit_steps(
        &mut self,
        batch: &Batch,
        sampled: &[u32],
        steps: usize,
    ) -> Result<Vec<StepEvent>, SchedulerError> {
        self.check_next(batch)?;
        let rows = batch.num_samples();
        if steps == 0 || sampled.len() != rows * steps {
            return Err(SchedulerError::BatchMismatch(format!(
                "expected {rows} x {steps} sampled tokens, got {}",
                sampled.len()
            )));
        }
        if let Some(e) = batch.entries.iter().find(|e| e.steps > steps) {
            return Err(SchedulerError::BatchMismatch(format!(
                "the batch reserved {} steps for request {:?}, commit got {steps}",
                e.steps, self.ids[e.slot]
            )));
        }
        if let Some(e) = batch.entries.iter().find(|e| e.proposed > 0) {
            return Err(SchedulerError::BatchMismatch(format!(
                "the batch verifies {} proposed tokens for request {:?}: commit it with \
                 commit_accepted",
                e.proposed, self.ids[e.slot]
            )));
        }
        self.commit_layout(batch, sampled, Layout::Steps(steps))
    }

    fn commit_layout(
        &mut self,
        batch: &Batch,
        sampled: &[u32],
        layout: Layout<'_>,
    ) -> Result<Vec<StepEvent>, SchedulerError> {
        let rows = batch.num_samples();
        self.open.pop_front();
        self.last_committed = batch.step;
        let bs = self.cfg.kv_block_size;
        let max_len = self.max_sequence_tokens();
        let mut events = std::mem::take(&mut self.pending);
        self.retired_slots.extend(events.iter().map(|e| e.slot));
        events.reserve(rows);
        let mut finished = false;
        let mut row = 0;
        let mut at = 0;
        for entry in &batch.entries {
            let toks = if entry.steps > 0 {
                let (from, len) = match layout {
                    Layout::Steps(steps) => (row * steps, entry.steps),
                    Layout::Accepted(counts) => (at, counts[row]),
                };
                row += 1;
                at += len;
                &sampled[from..from + len]
            } else {
                &[][..]
            };
            let Some(seq) = self.seqs[entry.slot].as_mut() else {
                continue;
            };
            if seq.uid != entry.uid {
                continue;
            }
            seq.num_open_entries -= 1;
            if entry.steps > 0 {
                seq.num_pending -= 1;
            }
            // A sequence preempted since this batch was scheduled (waiting now) holds no KV:
            // only its token is kept.
            let running = seq.state == SeqState::Running;
            if running {
                seq.num_computed += entry.num_tokens;
                seq.num_inflight -= entry.num_tokens;
            }
            if entry.proposed > 0 {
                seq.num_proposed = 0;
                seq.draft.clear();
                let accepted = toks.len() - 1;
                self.stats.spec_rows += 1;
                self.stats.spec_drafted_tokens += entry.proposed as u64;
                self.stats.spec_accepted_tokens += accepted as u64;
                let max = self.cfg.num_speculative_tokens;
                seq.spec_k = if accepted == entry.proposed {
                    (seq.spec_k * 2).clamp(1, max)
                } else {
                    accepted + 1
                };
            }
            for &tok in toks {
                seq.tokens.push(tok);
                let finish = if seq.stop_token_ids.contains(&tok) {
                    Some(FinishReason::Stop)
                } else if seq.num_output() >= seq.max_new_tokens || seq.tokens.len() >= max_len {
                    Some(FinishReason::Length)
                } else {
                    None
                };
                events.push(StepEvent {
                    slot: entry.slot,
                    token: Some(tok),
                    finish,
                });
                if finish.is_some() {
                    finished = true;
                    break;
                }
            }
            if running {
                // An entry that sampled leaves every known token but the last with its KV:
                // the worker wrote the KV of each token it sampled before the last (steps
                // run ahead), while the KV of rejected proposals, and of tokens after a
                // stop inside the run, is garbage and counts as not computed again.
                seq.num_computed = if toks.is_empty() {
                    seq.num_computed
                } else {
                    seq.tokens.len() - 1
                };
            }
            let full = if running { seq.num_computed / bs } else { 0 };
            while seq.block_hashes.len() < full {
                let j = seq.block_hashes.len();
                let parent = match j.checked_sub(1) {
                    Some(p) => Some(seq.block_hashes[p]),
                    None => seq.cache_salt,
                };
                let chunk = &seq.tokens[j * bs..(j + 1) * bs];
                let hash = self.allocs[0].hash(parent, chunk);
                for (table, alloc) in seq.tables.iter().zip(&mut self.allocs) {
                    // A sliding group publishes before it releases: a block before its
                    // table's offset is published already.
                    if j >= table.offset {
                        alloc.publish_hashed(
                            table.blocks[j - table.offset],
                            hash,
                            parent,
                            chunk,
                        )?;
                    }
                }
                seq.block_hashes.push(hash);
            }
            if running && entry.proposed > 0 {
                // Blocks taken only for rejected proposals go back (tail first).
                let keep = seq.num_computed.div_ceil(bs);
                for (table, alloc) in seq.tables.iter_mut().zip(&mut self.allocs) {
                    let keep = keep.saturating_sub(table.offset);
                    while table.blocks.len() > keep {
                        alloc.release(table.blocks.pop().expect("longer than keep"));
                    }
                }
            }
            if let Some(pool) = self.state.as_mut() {
                // The checkpoint this step restored from has been copied: let it go.
                if let Some(ck) = seq.restore_from.take() {
                    pool.release_uncached_first(ck);
                }
                // The checkpoint it saved is complete: publish it under its block's hash
                // and leave it to the cache (least recently used goes first).
                if let Some((ck, at_step, at)) = seq.pending_save {
                    if at_step == batch.step {
                        seq.pending_save = None;
                        // `at` is a block boundary after the first block, and the commit
                        // above hashed every block up to `num_computed >= at`: block `k - 1`
                        // is hashed. (A sequence preempted since holds no hashes to use.)
                        let k = at / bs;
                        if running {
                            let parent = if k >= 2 {
                                Some(seq.block_hashes[k - 2])
                            } else {
                                seq.cache_salt
                            };
                            pool.publish_hashed(
                                ck,
                                seq.block_hashes[k - 1],
                                parent,
                                &seq.tokens[(k - 1) * bs..k * bs],
                            )?;
                            self.stats.state_checkpoints_saved += 1;
                        }
                        pool.release_uncached_first(ck);
                    }
                }
            }
        }
        if finished {
            for e in &events {
                if e.finish.is_some() && e.token.is_some() {
                    self.end(e.slot);
                    self.stats.requests_finished += 1;
                }
            }
        }
        Ok(events)
    }

    /// Remove a live sequence and free everything it holds.
    fn end(&mut self, slot: usize) {
        let mut seq = self.seqs[slot].take().expect("ending a live sequence");
        Self::release_all(&mut self.allocs, &mut self.state, &mut seq);
        match seq.state {
            SeqState::Running => {
                let pos = self.running.iter().rposition(|&s| s == slot);
                self.running
                    .remove(pos.expect("running sequence is in the running list"));
            }
            SeqState::Waiting => {
                let pos = self.waiting.iter().position(|&s| s == slot);
                self.waiting
                    .remove(pos.expect("waiting sequence is in the waiting queue"));
            }
        }
        self.by_id.remove(seq.request_id.as_str());
        self.retired_slots.push(slot);
    }

    /// Drop a request in any state, freeing everything it holds. False if not live.
    pub fn abort(&mut self, request_id: &str) -> bool {
        let Some(&slot) = self.by_id.get(request_id) else {
            return false;
        };
        self.end(slot);
        self.stats.requests_aborted += 1;
        true
    }

    /// End a live request from outside (a stop string matched); frees its blocks.
    pub fn finish(&mut self, request_id: &str) -> bool {
        let Some(&slot) = self.by_id.get(request_id) else {
            return false;
        };
        self.end(slot);
        self.stats.requests_finished += 1;
        true
    }

    /// Check allocator and queue invariants against the sequences' block tables and state
    /// slots, in every cache group.
    pub fn check_invariants(&self) -> Result<(), AllocError> {
        let bad = |m: String| Err(AllocError::Invariant(m));
        let mut refs: Vec<Vec<u32>> = self.allocs.iter().map(|a| vec![0u32; a.total()]).collect();
        let mut state_refs = vec![0u32; self.state.as_ref().map_or(0, |p| p.total())];
        let bs = self.cfg.kv_block_size;
        let mut live = 0;
        for (slot, seq) in self.seqs.iter().enumerate() {
            let Some(seq) = seq else { continue };
            live += 1;
            for (table, group_refs) in seq.tables.iter().zip(&mut refs) {
                for &b in &table.blocks {
                    group_refs[b as usize] += 1;
                }
            }
            let own = seq.state_slot;
            for s in [own, seq.restore_from, seq.pending_save.map(|(s, _, _)| s)]
                .into_iter()
                .flatten()
            {
                state_refs[s as usize] += 1;
            }
            if let Some(s) = own {
                // No state slot is shared: it is its sequence's alone (nothing else refers
                // to it, not even a checkpoint).
                if state_refs[s as usize] > 1 {
                    return bad(format!("state slot {s} is shared by two holders"));
                }
            }
            if self.by_id.get(seq.request_id.as_str()) != Some(&slot) {
                return bad(format!(
                    "request {} missing from the id map",
                    seq.request_id
                ));
            }
            let holds_blocks = seq.tables.iter().any(|t| !t.blocks.is_empty());
            match seq.state {
                SeqState::Waiting if holds_blocks => {
                    return bad(format!("waiting request {} holds blocks", seq.request_id));
                }
                SeqState::Waiting
                    if own.is_some()
                        || seq.restore_from.is_some()
                        || seq.pending_save.is_some() =>
                {
                    return bad(format!(
                        "waiting request {} holds state slots",
                        seq.request_id
                    ));
                }
                SeqState::Waiting if seq.num_inflight > 0 => {
                    return bad(format!(
                        "waiting request {} has KV in flight",
                        seq.request_id
                    ));
                }
                SeqState::Running
                    if seq
                        .tables
                        .iter()
                        .any(|t| t.end() * bs < seq.num_computed + seq.num_inflight) =>
                {
                    return bad(format!("request {} under-allocated", seq.request_id));
                }
                SeqState::Running if self.state.is_some() && own.is_none() => {
                    return bad(format!(
                        "running request {} has no state slot",
                        seq.request_id
                    ));
                }
                _ => {}
            }
            if seq.num_open_entries > self.open.len() || seq.num_pending > seq.num_open_entries {
                return bad(format!(
                    "request {} has more pending tokens or open entries than open steps",
                    seq.request_id
                ));
            }
            if seq.num_output() + seq.num_pending + seq.num_proposed > seq.max_new_tokens {
                return bad(format!(
                    "request {} is scheduled past max_new_tokens",
                    seq.request_id
                ));
            }
        }
        if live != self.running.len() + self.waiting.len() || live != self.by_id.len() {
            return bad("queues disagree with live sequences".into());
        }
        if self.running.len() > self.cfg.max_running_seqs {
            return bad("more running sequences than max_running_seqs".into());
        }
        // Keys are unique (uids are), so sorted means strictly increasing.
        if !self.running.iter().map(|&k| self.key(k)).is_sorted() {
            return bad("running sequences out of (priority, arrival) order".into());
        }
        if !self.waiting.iter().map(|&k| self.key(k)).is_sorted() {
            return bad("waiting queue out of (priority, arrival) order".into());
        }
        for (g, (alloc, group_refs)) in self.allocs.iter().zip(&refs).enumerate() {
            alloc
                .check_invariants(Some(group_refs))
                .map_err(|e| match e {
                    AllocError::Invariant(m) if g > 0 => {
                        AllocError::Invariant(format!("cache group {g}: {m}"))
                    }
                    e => e,
                })?;
        }
        if let Some(pool) = &self.state {
            pool.check_invariants(Some(&state_refs))
                .map_err(|e| match e {
                    AllocError::Invariant(m) => AllocError::Invariant(format!("state slots: {m}")),
                    e => e,
                })?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    //! Each queue and block-table invariant broken on purpose: `check_invariants` must name
    //! it.

    use super::*;

    fn broken(s: &Scheduler) -> String {
        match s.check_invariants() {
            Err(AllocError::Invariant(m)) => m,
            other => panic!("expected a broken invariant, got {other:?}"),
        }
    }

    fn slot(s: &Scheduler, id: &str) -> usize {
        s.by_id[id]
    }

    /// Blocks of 4. "a" (5 prompt tokens) and "b" (2) run after one step, "c" waits: at
    /// most two sequences run.
    fn healthy() -> Scheduler {
        started(SchedulerConfig {
            total_kv_blocks: 16,
            kv_block_size: 4,
            max_batch_tokens: 100,
            max_running_seqs: 2,
            enable_prefix_caching: true,
            max_model_len: None,
            ..Default::default()
        })
    }

    /// "a", "b" and "c" added and one step run and committed under `cfg`.
    fn started(cfg: SchedulerConfig) -> Scheduler {
        let mut s = Scheduler::new(cfg).unwrap();
        s.add_request("a", &[1, 2, 3, 4, 5], 4, &[]).unwrap();
        s.add_request("b", &[6, 7], 4, &[]).unwrap();
        s.add_request("c", &[8], 4, &[]).unwrap();
        let b = s.schedule();
        s.commit(&b, &[9, 9]).unwrap();
        assert_eq!((s.num_running(), s.num_waiting()), (2, 1));
        s.check_invariants().unwrap();
        s
    }

    fn seq_mut<'a>(s: &'a mut Scheduler, id: &str) -> &'a mut Sequence {
        let k = slot(s, id);
        s.seqs[k].as_mut().unwrap()
    }

    /// `healthy` with cache groups: a full group, a sliding one (window 8) and a state
    /// group; "a" and "b" run (each with a state slot), "c" waits.
    fn hybrid() -> Scheduler {
        started(SchedulerConfig {
            kv_block_size: 4,
            max_batch_tokens: 100,
            max_running_seqs: 2,
            // No checkpoints: they would cut "a"'s prompt at 4, so that it samples nothing.
            enable_prefix_caching: false,
            cache_groups: vec![
                crate::CacheGroup::full(16),
                crate::CacheGroup::sliding(8, 16),
                crate::CacheGroup::state(6),
            ],
            ..Default::default()
        })
    }

    fn free_state_slot(s: &mut Scheduler) -> BlockId {
        s.state.as_mut().unwrap().allocate(1).unwrap()[0]
    }

    #[test]
    fn a_state_slot_held_twice_is_reported() {
        let mut s = hybrid();
        let own = seq_mut(&mut s, "a").state_slot;
        seq_mut(&mut s, "c").state_slot = own;
        assert_eq!(
            broken(&s),
            format!("state slot {} is shared by two holders", own.unwrap())
        );
    }

    #[test]
    fn a_waiting_request_that_holds_any_state_slot_is_reported() {
        for which in 0..3 {
            let mut s = hybrid();
            let free = free_state_slot(&mut s);
            let c = seq_mut(&mut s, "c");
            match which {
                0 => c.state_slot = Some(free),
                1 => c.restore_from = Some(free),
                _ => c.pending_save = Some((free, 1, 4)),
            }
            assert_eq!(broken(&s), "waiting request c holds state slots", "{which}");
        }
    }

    #[test]
    fn a_running_request_without_its_state_slot_is_reported() {
        let mut s = hybrid();
        let own = seq_mut(&mut s, "a").state_slot.take().unwrap();
        s.state.as_mut().unwrap().release(own);
        assert_eq!(broken(&s), "running request a has no state slot");
    }

    #[test]
    fn a_broken_table_of_a_later_cache_group_is_reported_with_its_group() {
        let mut s = hybrid();
        // A block of the sliding group that its allocator has free.
        let free = s.allocs[1].total() as BlockId - 1;
        seq_mut(&mut s, "a").tables[1].blocks.push(free);
        let m = broken(&s);
        assert!(m.starts_with("cache group 1: "), "{m}");
        let mut s = hybrid();
        let free = s.allocs[0].total() as BlockId - 1;
        seq_mut(&mut s, "a").tables[0].blocks.push(free);
        let m = broken(&s);
        assert!(!m.starts_with("cache group"), "{m}");
    }

    #[test]
    fn a_live_request_missing_from_the_id_map_is_reported() {
        let mut s = healthy();
        s.by_id.remove("b");
        assert_eq!(broken(&s), "request b missing from the id map");
    }

    #[test]
    fn a_waiting_request_that_holds_blocks_is_reported() {
        let mut s = healthy();
        let free = s.allocs[0].allocate(1).unwrap();
        seq_mut(&mut s, "c").tables[0].blocks.extend(free);
        assert_eq!(broken(&s), "waiting request c holds blocks");
    }

    #[test]
    fn a_running_request_with_kv_beyond_its_blocks_is_reported() {
        let mut s = healthy();
        // "a" holds two blocks of 4: eight computed tokens fill them exactly, nine do not fit.
        assert_eq!(seq_mut(&mut s, "a").tables[0].blocks.len(), 2);
        seq_mut(&mut s, "a").num_computed = 8;
        s.check_invariants().unwrap();
        seq_mut(&mut s, "a").num_computed = 9;
        assert_eq!(broken(&s), "request a under-allocated");
    }

    #[test]
    fn kv_in_flight_is_counted_against_the_blocks_and_never_held_while_waiting() {
        let mut s = healthy();
        seq_mut(&mut s, "a").num_inflight = 3;
        s.check_invariants().unwrap();
        seq_mut(&mut s, "a").num_inflight = 4;
        assert_eq!(broken(&s), "request a under-allocated");

        let mut s = healthy();
        seq_mut(&mut s, "c").num_inflight = 1;
        assert_eq!(broken(&s), "waiting request c has KV in flight");
    }

    #[test]
    fn pending_tokens_beyond_the_open_steps_are_reported() {
        let msg = "request a has more pending tokens or open entries than open steps";
        let mut s = healthy();
        seq_mut(&mut s, "a").num_open_entries = 1;
        assert_eq!(broken(&s), msg);

        let mut s = healthy();
        let _open = s.schedule_overlapped(0).unwrap();
        s.check_invariants().unwrap();
        seq_mut(&mut s, "a").num_pending = 2;
        assert_eq!(broken(&s), msg);
    }

    #[test]
    fn a_request_scheduled_past_its_max_new_tokens_is_reported() {
        let mut s = healthy();
        // "a" has 1 output token and none pending: a limit of 1 holds, 0 does not.
        seq_mut(&mut s, "a").max_new_tokens = 1;
        s.check_invariants().unwrap();
        seq_mut(&mut s, "a").max_new_tokens = 0;
        assert_eq!(broken(&s), "request a is scheduled past max_new_tokens");

        // Pending tokens count: with one in flight, 2 holds and 1 does not.
        let mut s = healthy();
        let _open = s.schedule_overlapped(0).unwrap();
        assert_eq!(seq_mut(&mut s, "a").num_pending, 1);
        seq_mut(&mut s, "a").max_new_tokens = 2;
        s.check_invariants().unwrap();
        seq_mut(&mut s, "a").max_new_tokens = 1;
        assert_eq!(broken(&s), "request a is scheduled past max_new_tokens");
    }

    #[test]
    fn queues_that_disagree_with_the_live_requests_are_reported() {
        let mut s = healthy();
        s.waiting.clear();
        assert_eq!(broken(&s), "queues disagree with live sequences");

        let mut s = healthy();
        s.by_id.insert("ghost".into(), 0);
        assert_eq!(broken(&s), "queues disagree with live sequences");
    }

    #[test]
    fn queues_out_of_priority_order_are_reported() {
        let mut s = healthy();
        s.add_request("d", &[8], 4, &[]).unwrap();
        s.check_invariants().unwrap();
        s.waiting.swap(0, 1);
        assert_eq!(broken(&s), "waiting queue out of (priority, arrival) order");

        let mut s = healthy();
        s.running.swap(0, 1);
        assert_eq!(
            broken(&s),
            "running sequences out of (priority, arrival) order"
        );
    }

    #[test]
    fn more_running_requests_than_allowed_is_reported() {
        let mut s = healthy();
        s.cfg.max_running_seqs = 1;
        assert_eq!(broken(&s), "more running sequences than max_running_seqs");
    }

    #[test]
    fn a_stale_batch_entry_never_reaches_a_request_that_reuses_its_slot() {
        // Slots are recycled only at the next `schedule`, after which an old batch is
        // refused by its step number. Recycle one early and run the newcomer at once, as a
        // future change might: the sequence's uid still tells it from the request the batch
        // was built for.
        let mut s = healthy();
        let b = s.schedule();
        let old = slot(&s, "b");
        assert!(s.abort("b"));
        s.free_slots.append(&mut s.retired_slots);
        assert_eq!(s.add_request("new", &[1, 2], 4, &[]).unwrap(), old);
        s.waiting.retain(|&k| k != old);
        s.running.push(old);
        seq_mut(&mut s, "new").state = SeqState::Running;
        let ev = s.commit(&b, &[7, 7]).unwrap();
        assert!(ev.iter().all(|e| e.slot != old), "{ev:?}");
        assert_eq!(s.sequence("new").unwrap().tokens, [1, 2]);
        s.check_invariants().unwrap();
    }

    #[test]
    fn a_block_table_entry_the_allocator_does_not_count_is_reported() {
        let mut s = healthy();
        let unheld = s.allocs[0].free_queue()[0];
        seq_mut(&mut s, "b").tables[0].blocks.push(unheld);
        assert_eq!(
            broken(&s),
            format!("block {unheld} has ref count 0, 1 holders")
        );
    }
}
