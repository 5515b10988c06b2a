//! One request's state as the scheduler sees it.

use crate::allocator::BlockId;
use crate::block_hash::BlockHash;
use crate::proposer::SequenceProposer;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqState {
    Waiting,
    Running,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// max_new_tokens reached (or the model context is full).
    Length,
    /// A stop token id was sampled, or the caller ended it (stop string).
    Stop,
    Abort,
}

impl FinishReason {
    /// Every reason, in the order of their codes (1, 2, 3).
    pub const ALL: [FinishReason; 3] = [
        FinishReason::Length,
        FinishReason::Stop,
        FinishReason::Abort,
    ];

    /// The reason's code in `StepEvents::finish_reasons`: 1 length, 2 stop, 3 abort (0 is
    /// an event whose request goes on).
    pub fn code(self) -> u8 {
        match self {
            FinishReason::Length => 1,
            FinishReason::Stop => 2,
            FinishReason::Abort => 3,
        }
    }

    /// The reason of a code; None for 0 (not finished) or an unknown code.
    pub fn from_code(code: u8) -> Option<Self> {
        Self::ALL.get(usize::from(code).checked_sub(1)?).copied()
    }

    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Length => "length",
            FinishReason::Stop => "stop",
            FinishReason::Abort => "abort",
        }
    }
}

#[derive(Debug, Clone)]
pub struct Sequence {
    pub request_id: String,
    /// Unique for the scheduler's lifetime, so a stale batch never touches a reused slot.
    pub uid: u64,
    /// Prompt followed by the generated tokens.
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    pub max_new_tokens: usize,
    pub stop_token_ids: Vec<u32>,
    /// One block table per attention group (`SchedulerConfig::groups` order, state group
    /// left out).
    pub tables: GroupTables,
    /// Chained hash of logical block `i` for every full block whose KV has been computed
    /// (the same in every group).
    pub block_hashes: Vec<BlockHash>,
    /// Tokens whose KV is in the cache.
    pub num_computed: usize,
    pub state: SeqState,
    /// Prompt tokens served by the prefix cache at first admission.
    pub num_cached_prompt: Option<usize>,
    pub num_preemptions: u32,
    /// Lower runs first: the waiting queue and the choice of preemption victim order
    /// sequences by `(priority, uid)`.
    pub priority: i64,
    /// `hash_salt` of the request's cache salt: the parent of its first block's hash.
    pub cache_salt: Option<BlockHash>,
    /// Never look up the prefix cache (its blocks are still published once computed): for
    /// requests that need the logits of every prompt position, which a cached block lacks.
    pub skip_prefix_cache: bool,
    /// Tokens sampled for this sequence by open (scheduled, not yet committed) steps: they
    /// sit, unknown, after `tokens` (overlapped scheduling; see `Scheduler::schedule_overlapped`).
    pub num_pending: usize,
    /// KV positions after `num_computed` that open steps compute (0 while waiting).
    pub num_inflight: usize,
    /// Entries of open steps that name this sequence: a preempted sequence is not
    /// re-admitted before they are all committed.
    pub num_open_entries: usize,
    /// Step and sample row of its latest sampled token, for the placeholder that stands for
    /// that token in the next step.
    pub last_sample_step: u64,
    pub last_sample_row: usize,
    /// Its slot in the state pool (with a state group, while running).
    pub state_slot: Option<BlockId>,
    /// A state checkpoint its admission restores from: held until that step is committed.
    pub restore_from: Option<BlockId>,
    /// A slot that an open step saves a checkpoint of its state into, the step, and the
    /// position the checkpoint is of (the end of that step's chunk).
    pub pending_save: Option<(BlockId, u64, usize)>,
    /// Its proposer (a prompt-lookup index, or the backend's draft model), if it
    /// speculates (speculation on, not opted out).
    pub proposer: Option<SequenceProposer>,
    /// Tokens proposed in its open step (after `tokens`, in the batch's input ids): the
    /// step's commit accepts a prefix of them. While nonzero it is not scheduled again.
    pub num_proposed: usize,
    /// Those tokens (kept to check what a commit accepts).
    pub draft: Vec<u32>,
    /// Tokens it proposes next time (adapts to how many were accepted lately).
    pub spec_k: usize,
}

/// A sequence's blocks in one attention group. A sliding group releases blocks from the
/// front: `blocks[i]` holds logical block `offset + i` (tokens `(offset + i) * block_size..`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GroupTable {
    pub blocks: Vec<BlockId>,
    pub offset: usize,
}

impl GroupTable {
    /// Logical blocks covered, released ones included.
    pub fn end(&self) -> usize {
        self.offset + self.blocks.len()
    }
    /// The cache slot of the token at place `within` of logical block `logical` (which
    /// must not be released).
    #[inline]
    pub(crate) fn slot_of(&self, logical: usize, within: usize, block_size: usize) -> i64 {
        (self.blocks[logical - self.offset] as usize * block_size + within) as i64
    }
}

/// Per-request scheduling options beyond the prompt and the limits.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RequestOptions {
    /// Lower runs first (as in vLLM); 0 by default.
    pub priority: i64,
    /// Requests with different salts never share prefix-cache blocks.
    pub cache_salt: Option<Vec<u8>>,
    /// Compute every prompt token (no prefix-cache lookup).
    pub skip_prefix_cache: bool,
    /// Never speculate for this request (even with speculation on).
    pub no_speculation: bool,
}

impl Sequence {
    /// The order of the waiting queue and of preemption: priority, then arrival.
    pub fn order_key(&self) -> (i64, u64) {
        (self.priority, self.uid)
    }

    pub fn num_output(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }
    pub fn output(&self) -> &[u32] {
        &self.tokens[self.prompt_len..]
    }
    /// Length once every open step is committed: committed tokens plus pending ones.
    pub fn scheduled_len(&self) -> usize {
        self.tokens.len() + self.num_pending
    }
}

/// A sequence's tables, one per attention group. The first two are kept inline: the
/// scheduler touches every group's table for every sequence every step, and one or two
/// groups (full, or sliding beside full) are the common cases, so reaching them costs no
/// pointer chase to a separate allocation.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GroupTables {
    head: [GroupTable; 2],
    /// Groups in `head` (1 or 2); tables past the second are in `more`.
    inline: usize,
    more: Vec<GroupTable>,
}

impl GroupTables {
    pub fn new(groups: usize) -> Self {
        GroupTables {
            head: Default::default(),
            inline: groups.clamp(1, 2),
            more: vec![GroupTable::default(); groups.saturating_sub(2)],
        }
    }
    /// The tables after the first.
    pub fn rest(&self) -> impl Iterator<Item = &GroupTable> {
        self.head[1..self.inline].iter().chain(&self.more)
    }
    pub fn iter(&self) -> impl Iterator<Item = &GroupTable> {
        self.head[..self.inline].iter().chain(&self.more)
    }
    pub fn iter_mut(&mut self) -> impl Iterator<Item = &mut GroupTable> {
        self.head[..self.inline].iter_mut().chain(&mut self.more)
    }
}

impl std::ops::Index<usize> for GroupTables {
    type Output = GroupTable;
    #[inline]
    fn index(&self, g: usize) -> &GroupTable {
        self.iter().nth(g).expect("no such cache group")
    }
}

impl std::ops::IndexMut<usize> for GroupTables {
    #[inline]
    fn index_mut(&mut self, g: usize) -> &mut GroupTable {
        self.iter_mut().nth(g).expect("no such cache group")
    }
}
