//! iron-batch core: the paged KV block allocator, the continuous-batching scheduler and
//! the flat per-step batch. Pure Rust; the Python bindings live in `rust/bindings`.

pub mod allocator;
pub mod batch;
pub mod block_hash;
pub mod config;
pub mod error;
pub mod events;
mod free_list;
pub mod proposer;
pub mod scheduler;
pub mod sequence;

pub use allocator::{BlockAllocator, BlockId};
pub use batch::{Batch, BatchEntry};
pub use block_hash::{hash_block, hash_salt, BlockHash, BlockHasher};
pub use config::{
    split_pool, CacheGroup, CacheKind, GroupSpec, SchedulerConfig, SpeculativeMethod,
};
pub use error::{AllocError, SchedulerError};
pub use events::{StepEvent, StepEvents};
pub use proposer::{
    DraftModelProposer, NgramProposer, Proposer, SequenceProposer, DRAFTED_BY_BACKEND,
};
pub use scheduler::{GroupUsage, Scheduler, SchedulerStats};
pub use sequence::{FinishReason, GroupTable, GroupTables, RequestOptions, SeqState, Sequence};
