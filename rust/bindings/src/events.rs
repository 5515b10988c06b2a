//! A commit's events as numpy columns. The vectors built in Rust become the arrays'
//! buffers (no copy), and no Python object is made per event unless `request_ids` is read.

use iron_batch_core as core;
use numpy::{IntoPyArray, PyArray1, PyArrayMethods};
use pyo3::prelude::*;
use pyo3::types::{PyList, PyString};

#[pyclass(module = "iron_batch._core", frozen)]
pub struct StepEvents {
    ids: Vec<Py<PyString>>,
    handles: Py<PyArray1<i64>>,
    token_ids: Py<PyArray1<i64>>,
    finish_reasons: Py<PyArray1<u8>>,
    num_finished: usize,
}

impl StepEvents {
    /// `ids[i]` is the Python request id of event `i`.
    pub fn new(py: Python<'_>, cols: core::StepEvents, ids: Vec<Py<PyString>>) -> Self {
        StepEvents {
            ids,
            handles: cols.slots.into_pyarray(py).unbind(),
            token_ids: cols.token_ids.into_pyarray(py).unbind(),
            finish_reasons: cols.finish_reasons.into_pyarray(py).unbind(),
            num_finished: cols.num_finished,
        }
    }
}

#[pymethods]
impl StepEvents {
    #[getter]
    fn handles(&self, py: Python<'_>) -> Py<PyArray1<i64>> {
        self.handles.clone_ref(py)
    }
    #[getter]
    fn token_ids(&self, py: Python<'_>) -> Py<PyArray1<i64>> {
        self.token_ids.clone_ref(py)
    }
    #[getter]
    fn finish_reasons(&self, py: Python<'_>) -> Py<PyArray1<u8>> {
        self.finish_reasons.clone_ref(py)
    }
    /// A new bool array: `finish_reasons != 0`.
    #[getter]
    fn finished<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<bool>> {
        let codes = self.finish_reasons.bind(py).readonly();
        let flags: Vec<bool> = codes
            .as_slice()
            .expect("built contiguous")
            .iter()
            .map(|&c| c != core::StepEvents::NOT_FINISHED)
            .collect();
        flags.into_pyarray(py)
    }
    #[getter]
    fn num_finished(&self) -> usize {
        self.num_finished
    }
    #[getter]
    fn request_ids<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, self.ids.iter().map(|s| s.bind(py)))
    }

    fn __len__(&self) -> usize {
        self.ids.len()
    }

    fn __repr__(&self) -> String {
        format!(
            "StepEvents(len={}, num_finished={})",
            self.ids.len(),
            self.num_finished
        )
    }
}
