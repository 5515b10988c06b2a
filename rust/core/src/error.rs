//! Typed errors of the core. Messages are stable: the bindings and the server show them.

use thiserror::Error;

/// Misuse of the block allocator. These are bugs in the caller, never silent corruption.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum AllocError {
    #[error("out of KV blocks: requested {requested}, free {free}")]
    OutOfBlocks { requested: usize, free: usize },
    #[error("double free of KV block {0}")]
    DoubleFree(u32),
    #[error("unknown KV block id {0} (pool has {1} blocks)")]
    UnknownBlock(u32, usize),
    #[error("invariant broken: {0}")]
    Invariant(String),
}

/// Why the scheduler refused a call.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum SchedulerError {
    #[error("request {0:?} already exists")]
    DuplicateRequest(String),
    #[error("unknown request {0:?}")]
    UnknownRequest(String),
    #[error("request rejected: {0}")]
    Rejected(String),
    #[error("commit mismatch: {0}")]
    BatchMismatch(String),
    #[error(transparent)]
    Alloc(#[from] AllocError),
}
