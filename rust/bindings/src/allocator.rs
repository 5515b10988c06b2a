//! Direct access to a block allocator, for people who manage KV memory themselves.

use std::sync::Mutex;

use iron_batch_core as core;
use pyo3::prelude::*;

use crate::convert::token_ids;
use crate::errors::alloc_err;

#[pyclass(module = "iron_batch._core", name = "BlockAllocator", frozen)]
pub struct BlockAllocator {
    inner: Mutex<core::BlockAllocator>,
}

impl BlockAllocator {
    fn lock(&self) -> std::sync::MutexGuard<'_, core::BlockAllocator> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[pymethods]
impl BlockAllocator {
    #[new]
    #[pyo3(signature = (total_blocks, block_size, enable_prefix_caching = true))]
    fn new(total_blocks: usize, block_size: usize, enable_prefix_caching: bool) -> PyResult<Self> {
        if block_size == 0 || total_blocks >= u32::MAX as usize {
            return Err(pyo3::exceptions::PyValueError::new_err(
                "block_size must be positive and total_blocks below 2^32 - 1",
            ));
        }
        Ok(BlockAllocator {
            inner: Mutex::new(core::BlockAllocator::new(
                total_blocks,
                block_size,
                enable_prefix_caching,
            )),
        })
    }

    fn allocate(&self, n: usize) -> PyResult<Vec<u32>> {
        self.lock().allocate(n).map_err(alloc_err)
    }

    fn free(&self, blocks: Vec<u32>) -> PyResult<()> {
        self.lock().free(&blocks).map_err(alloc_err)
    }

    fn ref_count(&self, block: u32) -> PyResult<u32> {
        self.lock().ref_count(block).map_err(alloc_err)
    }

    #[getter]
    fn num_free(&self) -> usize {
        self.lock().num_free()
    }

    #[getter]
    fn num_cached(&self) -> usize {
        self.lock().num_cached()
    }

    #[getter]
    fn total_blocks(&self) -> usize {
        self.lock().total()
    }

    /// Free blocks in reuse order, next to be taken first.
    fn free_queue(&self) -> Vec<u32> {
        self.lock().free_queue()
    }

    #[pyo3(signature = (block, parent_hash, token_ids))]
    fn publish(
        &self,
        block: u32,
        parent_hash: Option<u64>,
        token_ids: &Bound<'_, PyAny>,
    ) -> PyResult<u64> {
        let tokens = crate::convert::token_ids(token_ids, "token_ids")?;
        self.lock()
            .publish(block, parent_hash, &tokens)
            .map_err(alloc_err)
    }

    fn match_prefix(&self, tokens: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
        let tokens = token_ids(tokens, "token_ids")?;
        let mut hashes = Vec::new();
        Ok(self.lock().match_prefix(&tokens, &mut hashes))
    }

    fn check_invariants(&self) -> PyResult<()> {
        self.lock().check_invariants(None).map_err(alloc_err)
    }
}
