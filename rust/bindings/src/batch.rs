//! The per-step batch as numpy arrays. The vectors built in Rust become the arrays'
//! buffers (no copy); the entries stay behind for `commit`.

use iron_batch_core as core;
use numpy::{IntoPyArray, PyArray1, PyArray2, PyArrayMethods, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::{PyList, PyString};

#[pyclass(module = "iron_batch._core", frozen)]
pub struct Batch {
    pub(crate) core: core::Batch,
    pub(crate) owner: usize,
    ids: Vec<Py<PyString>>,
    input_ids: Py<PyArray1<i64>>,
    positions: Py<PyArray1<i64>>,
    slot_mapping: Py<PyArray1<i64>>,
    query_start_loc: Py<PyArray1<i32>>,
    seq_lens: Py<PyArray1<i32>>,
    num_computed_before: Py<PyArray1<i32>>,
    block_tables: Py<PyArray2<i32>>,
    sample_indices: Py<PyArray1<i64>>,
    sample_seq_indices: Py<PyArray1<i64>>,
    sample_max_steps: Py<PyArray1<i32>>,
    pending_token_indices: Py<PyArray1<i64>>,
    pending_sample_rows: Py<PyArray1<i64>>,
    group_slot_mapping: Py<PyArray2<i64>>,
    group_block_tables: Py<PyArray2<i32>>,
    block_table_offsets: Py<PyArray2<i32>>,
    state_slots: Py<PyArray1<i32>>,
    state_fresh: Py<PyArray1<i32>>,
    state_restore: Py<PyArray1<i32>>,
    state_save: Py<PyArray1<i32>>,
}

impl Batch {
    /// `ids[i]` is the Python request id of row `i` (interned once per request).
    pub fn new(
        py: Python<'_>,
        mut b: core::Batch,
        ids: Vec<Py<PyString>>,
        owner: usize,
    ) -> PyResult<Self> {
        let rows = b.entries.len();
        let width = b.max_blocks;
        let tables = std::mem::take(&mut b.block_tables)
            .into_pyarray(py)
            .reshape([rows, width])?;
        let groups = b.num_attention_groups.max(1);
        let tokens = b.input_ids.len();
        let group_slots = std::mem::take(&mut b.group_slot_mapping)
            .into_pyarray(py)
            .reshape([groups - 1, tokens])?;
        let group_tables = std::mem::take(&mut b.group_block_tables)
            .into_pyarray(py)
            .reshape([(groups - 1) * rows, b.group_max_blocks])?;
        let mut offsets = std::mem::take(&mut b.block_table_offsets);
        offsets.resize(groups * rows, 0);
        let offsets = offsets.into_pyarray(py).reshape([groups, rows])?;
        Ok(Batch {
            group_slot_mapping: group_slots.unbind(),
            group_block_tables: group_tables.unbind(),
            block_table_offsets: offsets.unbind(),
            state_slots: std::mem::take(&mut b.state_slots).into_pyarray(py).unbind(),
            state_fresh: std::mem::take(&mut b.state_fresh).into_pyarray(py).unbind(),
            state_restore: std::mem::take(&mut b.state_restore)
                .into_pyarray(py)
                .unbind(),
            state_save: std::mem::take(&mut b.state_save).into_pyarray(py).unbind(),
            input_ids: std::mem::take(&mut b.input_ids).into_pyarray(py).unbind(),
            positions: std::mem::take(&mut b.positions).into_pyarray(py).unbind(),
            slot_mapping: std::mem::take(&mut b.slot_mapping)
                .into_pyarray(py)
                .unbind(),
            query_start_loc: std::mem::take(&mut b.query_start_loc)
                .into_pyarray(py)
                .unbind(),
            seq_lens: std::mem::take(&mut b.seq_lens).into_pyarray(py).unbind(),
            num_computed_before: std::mem::take(&mut b.num_computed_before)
                .into_pyarray(py)
                .unbind(),
            block_tables: tables.unbind(),
            sample_indices: std::mem::take(&mut b.sample_indices)
                .into_pyarray(py)
                .unbind(),
            sample_seq_indices: std::mem::take(&mut b.sample_seq_indices)
                .into_pyarray(py)
                .unbind(),
            sample_max_steps: std::mem::take(&mut b.sample_max_steps)
                .into_pyarray(py)
                .unbind(),
            pending_token_indices: std::mem::take(&mut b.pending_token_indices)
                .into_pyarray(py)
                .unbind(),
            pending_sample_rows: std::mem::take(&mut b.pending_sample_rows)
                .into_pyarray(py)
                .unbind(),
            core: b,
            owner,
            ids,
        })
    }
}

#[pymethods]
impl Batch {
    #[getter]
    fn num_seqs(&self) -> usize {
        self.core.entries.len()
    }
    #[getter]
    fn num_tokens(&self, py: Python<'_>) -> usize {
        self.input_ids.bind(py).len()
    }
    #[getter]
    fn num_samples(&self) -> usize {
        self.core.num_samples()
    }
    #[getter]
    fn step(&self) -> u64 {
        self.core.step
    }
    #[getter]
    fn input_ids(&self, py: Python<'_>) -> Py<PyArray1<i64>> {
        self.input_ids.clone_ref(py)
    }
    #[getter]
    fn positions(&self, py: Python<'_>) -> Py<PyArray1<i64>> {
        self.positions.clone_ref(py)
    }
    #[getter]
    fn slot_mapping(&self, py: Python<'_>) -> Py<PyArray1<i64>> {
        self.slot_mapping.clone_ref(py)
    }
    #[getter]
    fn query_start_loc(&self, py: Python<'_>) -> Py<PyArray1<i32>> {
        self.query_start_loc.clone_ref(py)
    }
    #[getter]
    fn seq_lens(&self, py: Python<'_>) -> Py<PyArray1<i32>> {
        self.seq_lens.clone_ref(py)
    }
    #[getter]
    fn num_computed_before(&self, py: Python<'_>) -> Py<PyArray1<i32>> {
        self.num_computed_before.clone_ref(py)
    }
    #[getter]
    fn block_tables(&self, py: Python<'_>) -> Py<PyArray2<i32>> {
        self.block_tables.clone_ref(py)
    }
    #[getter]
    fn sample_indices(&self, py: Python<'_>) -> Py<PyArray1<i64>> {
        self.sample_indices.clone_ref(py)
    }
    #[getter]
    fn sample_seq_indices(&self, py: Python<'_>) -> Py<PyArray1<i64>> {
        self.sample_seq_indices.clone_ref(py)
    }
    #[getter]
    fn sample_max_steps(&self, py: Python<'_>) -> Py<PyArray1<i32>> {
        self.sample_max_steps.clone_ref(py)
    }
    #[getter]
    fn pending_token_indices(&self, py: Python<'_>) -> Py<PyArray1<i64>> {
        self.pending_token_indices.clone_ref(py)
    }
    #[getter]
    fn pending_sample_rows(&self, py: Python<'_>) -> Py<PyArray1<i64>> {
        self.pending_sample_rows.clone_ref(py)
    }
    /// `[attention groups - 1, num_tokens]`: the cache slots of the groups after the first.
    #[getter]
    fn group_slot_mapping(&self, py: Python<'_>) -> Py<PyArray2<i64>> {
        self.group_slot_mapping.clone_ref(py)
    }
    /// `[(attention groups - 1) * num_seqs, width]`: group g's table is rows
    /// `(g - 1) * num_seqs` to `g * num_seqs`.
    #[getter]
    fn group_block_tables(&self, py: Python<'_>) -> Py<PyArray2<i32>> {
        self.group_block_tables.clone_ref(py)
    }
    /// `[attention groups, num_seqs]`: the logical block of each table row's first column.
    #[getter]
    fn block_table_offsets(&self, py: Python<'_>) -> Py<PyArray2<i32>> {
        self.block_table_offsets.clone_ref(py)
    }
    #[getter]
    fn state_slots(&self, py: Python<'_>) -> Py<PyArray1<i32>> {
        self.state_slots.clone_ref(py)
    }
    #[getter]
    fn state_fresh(&self, py: Python<'_>) -> Py<PyArray1<i32>> {
        self.state_fresh.clone_ref(py)
    }
    #[getter]
    fn state_restore(&self, py: Python<'_>) -> Py<PyArray1<i32>> {
        self.state_restore.clone_ref(py)
    }
    #[getter]
    fn state_save(&self, py: Python<'_>) -> Py<PyArray1<i32>> {
        self.state_save.clone_ref(py)
    }
    #[getter]
    fn request_ids<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, self.ids.iter().map(|s| s.bind(py)))
    }
    #[getter]
    fn sample_request_ids<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let rows = self
            .core
            .entries
            .iter()
            .zip(&self.ids)
            .filter(|(e, _)| e.steps > 0)
            .map(|(_, s)| s.bind(py));
        PyList::new(py, rows)
    }

    fn __len__(&self) -> usize {
        self.core.entries.len()
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "Batch(step={}, num_seqs={}, num_tokens={}, num_samples={})",
            self.core.step,
            self.core.entries.len(),
            self.input_ids.bind(py).len(),
            self.core.num_samples()
        )
    }
}
