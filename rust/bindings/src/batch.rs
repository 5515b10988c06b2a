//! The per-step batch as numpy arrays. The vectors built in Rust become the arrays'
//! buffers (no copy); the entries stay behind for `commit`.

use iron_batch_core as core;
use numpy::{IntoPyArray, PyArray1, PyArray2, PyArrayMethods, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
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
    num_proposed: Py<PyArray1<i32>>,
    pending_token_indices: Py<PyArray1<i64>>,
    pending_sample_rows: Py<PyArray1<i64>>,
    // The cache-group arrays are made on first access (copied from `core`): a model
    // without cache groups never pays for them.
    group_slot_mapping: PyOnceLock<Py<PyArray2<i64>>>,
    group_block_tables: PyOnceLock<Py<PyArray2<i32>>>,
    block_table_offsets: PyOnceLock<Py<PyArray2<i32>>>,
    state_arrays: [PyOnceLock<Py<PyArray1<i32>>>; 4],
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
        Ok(Batch {
            group_slot_mapping: PyOnceLock::new(),
            group_block_tables: PyOnceLock::new(),
            block_table_offsets: PyOnceLock::new(),
            state_arrays: [const { PyOnceLock::new() }; 4],
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
            num_proposed: PyArray1::from_slice(py, &b.num_proposed).unbind(),
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

impl Batch {
    fn groups(&self) -> usize {
        self.core.num_attention_groups.max(1)
    }

    fn state_array(&self, py: Python<'_>, i: usize, values: &[i32]) -> Py<PyArray1<i32>> {
        self.state_arrays[i]
            .get_or_init(py, || PyArray1::from_slice(py, values).unbind())
            .clone_ref(py)
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
    /// Per sample row: proposed tokens the step verifies (0 without speculation).
    #[getter]
    fn num_proposed(&self, py: Python<'_>) -> Py<PyArray1<i32>> {
        self.num_proposed.clone_ref(py)
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
    fn group_slot_mapping(&self, py: Python<'_>) -> PyResult<Py<PyArray2<i64>>> {
        let cell = self.group_slot_mapping.get_or_try_init(py, || {
            let tokens = self.input_ids.bind(py).len();
            PyArray1::from_slice(py, &self.core.group_slot_mapping)
                .reshape([self.groups() - 1, tokens])
                .map(Bound::unbind)
        })?;
        Ok(cell.clone_ref(py))
    }
    /// `[(attention groups - 1) * num_seqs, width]`: group g's table is rows
    /// `(g - 1) * num_seqs` to `g * num_seqs`.
    #[getter]
    fn group_block_tables(&self, py: Python<'_>) -> PyResult<Py<PyArray2<i32>>> {
        let cell = self.group_block_tables.get_or_try_init(py, || {
            let rows = (self.groups() - 1) * self.core.entries.len();
            PyArray1::from_slice(py, &self.core.group_block_tables)
                .reshape([rows, self.core.group_max_blocks])
                .map(Bound::unbind)
        })?;
        Ok(cell.clone_ref(py))
    }
    /// `[attention groups, num_seqs]`: the logical block of each table row's first column.
    #[getter]
    fn block_table_offsets(&self, py: Python<'_>) -> PyResult<Py<PyArray2<i32>>> {
        let cell = self.block_table_offsets.get_or_try_init(py, || {
            let rows = self.core.entries.len();
            let mut offsets = self.core.block_table_offsets.clone();
            offsets.resize(self.groups() * rows, 0);
            PyArray1::from_vec(py, offsets)
                .reshape([self.groups(), rows])
                .map(Bound::unbind)
        })?;
        Ok(cell.clone_ref(py))
    }
    #[getter]
    fn state_slots(&self, py: Python<'_>) -> Py<PyArray1<i32>> {
        self.state_array(py, 0, &self.core.state_slots)
    }
    #[getter]
    fn state_fresh(&self, py: Python<'_>) -> Py<PyArray1<i32>> {
        self.state_array(py, 1, &self.core.state_fresh)
    }
    #[getter]
    fn state_restore(&self, py: Python<'_>) -> Py<PyArray1<i32>> {
        self.state_array(py, 2, &self.core.state_restore)
    }
    #[getter]
    fn state_save(&self, py: Python<'_>) -> Py<PyArray1<i32>> {
        self.state_array(py, 3, &self.core.state_save)
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
