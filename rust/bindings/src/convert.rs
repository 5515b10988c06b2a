//! Python inputs to owned Rust data: token id lists from numpy arrays or sequences.

use numpy::{PyReadonlyArray1, PyUntypedArrayMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

fn check(v: i64, what: &str) -> PyResult<u32> {
    u32::try_from(v)
        .ok()
        .filter(|&t| t != u32::MAX)
        .ok_or_else(|| PyValueError::new_err(format!("{what}: token id {v} is out of range")))
}

/// Token ids from an int numpy array (any integer width) or any sequence of ints.
pub fn token_ids(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<u32>> {
    if let Ok(a) = obj.extract::<PyReadonlyArray1<'_, i64>>() {
        return a.as_slice()?.iter().map(|&v| check(v, what)).collect();
    }
    if let Ok(a) = obj.extract::<PyReadonlyArray1<'_, i32>>() {
        return a
            .as_slice()?
            .iter()
            .map(|&v| check(i64::from(v), what))
            .collect();
    }
    if let Ok(a) = obj.cast::<numpy::PyUntypedArray>() {
        if a.ndim() != 1 {
            return Err(PyValueError::new_err(format!(
                "{what}: expected a 1-D array"
            )));
        }
        let as_i64 = a.call_method1("astype", ("int64",))?;
        return token_ids(&as_i64, what);
    }
    if obj.is_instance_of::<pyo3::types::PyString>() {
        return Err(PyValueError::new_err(format!(
            "{what}: expected a list of token ids, got a string"
        )));
    }
    let vals: Vec<i64> = obj
        .extract()
        .map_err(|_| PyValueError::new_err(format!("{what}: expected a list of integers")))?;
    vals.into_iter().map(|v| check(v, what)).collect()
}

/// Sampled tokens as a flat row-major vector and the number of columns: a 1-D input is one
/// token per row; a 2-D `[rows, steps]` array carries lookahead steps.
pub fn token_matrix(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<(Vec<u32>, usize)> {
    if let Ok(a) = obj.cast::<numpy::PyUntypedArray>() {
        if a.ndim() == 2 {
            let steps = a.shape()[1];
            let flat = a.call_method1("reshape", (-1,))?;
            return Ok((token_ids(&flat, what)?, steps));
        }
    }
    Ok((token_ids(obj, what)?, 1))
}
