//! Python exception classes of the core, and the mapping from core errors to them.
//!
//! Each class derives from `IronBatchError` and from its conventional builtin (ValueError,
//! KeyError, RuntimeError), so callers that catch builtins keep working. `create_exception!`
//! allows one base only, so the classes are made with `type()` when the module loads.

use std::sync::OnceLock;

use iron_batch_core::{AllocError, SchedulerError};
use pyo3::exceptions::{PyException, PyKeyError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple, PyType};

#[derive(Clone, Copy)]
pub enum Kind {
    Rejected = 0,
    Duplicate,
    Unknown,
    Allocator,
    OutOfBlocks,
    BatchMismatch,
}

const CLASSES: [(&str, &str); 6] = [
    (
        "RequestRejected",
        "The request can never be served (too long for the KV pool or the model context).",
    ),
    (
        "DuplicateRequest",
        "A request with this id is already known to the scheduler.",
    ),
    ("UnknownRequest", "No live request has this id."),
    (
        "AllocatorError",
        "Misuse of the block allocator: double free, unknown block id, broken invariant.",
    ),
    (
        "OutOfBlocks",
        "Not enough free KV blocks for an allocation (nothing was taken).",
    ),
    (
        "BatchMismatch",
        "commit() got a batch that is not the open step, or the wrong number of tokens.",
    ),
];

static TYPES: OnceLock<Vec<Py<PyType>>> = OnceLock::new();

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    let builtins = py.import("builtins")?;
    let type_fn = builtins.getattr("type")?;
    let base_ns = PyDict::new(py);
    base_ns.set_item(
        "__doc__",
        "Base class of every error raised by the Rust core.",
    )?;
    base_ns.set_item("__module__", "iron_batch._core")?;
    let base = type_fn.call1(("IronBatchError", (py.get_type::<PyException>(),), base_ns))?;
    m.add("IronBatchError", &base)?;
    let builtin_bases = [
        py.get_type::<PyValueError>(),
        py.get_type::<PyValueError>(),
        py.get_type::<PyKeyError>(),
        py.get_type::<PyRuntimeError>(),
        py.get_type::<PyRuntimeError>(),
        py.get_type::<PyValueError>(),
    ];
    let mut made = Vec::new();
    for ((name, doc), builtin) in CLASSES.iter().zip(builtin_bases) {
        let ns = PyDict::new(py);
        ns.set_item("__doc__", *doc)?;
        ns.set_item("__module__", "iron_batch._core")?;
        let bases = PyTuple::new(py, [base.clone(), builtin.into_any()])?;
        let cls = type_fn.call1((*name, bases, ns))?;
        m.add(*name, &cls)?;
        made.push(cls.cast_into::<PyType>()?.unbind());
    }
    let _ = TYPES.set(made);
    Ok(())
}

pub fn new_err(kind: Kind, msg: String) -> PyErr {
    Python::attach(|py| match TYPES.get() {
        Some(types) => PyErr::from_type(types[kind as usize].bind(py).clone(), msg),
        None => PyRuntimeError::new_err(msg),
    })
}

pub fn alloc_err(e: AllocError) -> PyErr {
    let kind = match e {
        AllocError::OutOfBlocks { .. } => Kind::OutOfBlocks,
        _ => Kind::Allocator,
    };
    new_err(kind, e.to_string())
}

pub fn sched_err(e: SchedulerError) -> PyErr {
    let msg = e.to_string();
    match e {
        SchedulerError::DuplicateRequest(_) => new_err(Kind::Duplicate, msg),
        SchedulerError::UnknownRequest(_) => new_err(Kind::Unknown, msg),
        SchedulerError::Rejected(_) => new_err(Kind::Rejected, msg),
        SchedulerError::BatchMismatch(_) => new_err(Kind::BatchMismatch, msg),
        SchedulerError::Alloc(a) => alloc_err(a),
    }
}
