//! The core's integration tests, as one test binary: one link per build instead of one
//! per file, which is most of the build time of each variant a mutation run tries.

mod common;

mod allocator;
mod exactness;
mod hybrid;
mod hybrid_invariants;
mod invariants;
mod overlap;
mod request_options;
mod scheduler;
mod speculative;
