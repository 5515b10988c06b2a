//! `iron_batch._core`: thin PyO3 bindings over the pure-Rust `iron-batch-core` crate.

mod allocator;
mod batch;
mod convert;
mod decoder;
mod errors;
mod kernels;
mod scheduler;

use pyo3::prelude::*;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    errors::register(m)?;
    m.add_class::<scheduler::SchedulerConfig>()?;
    m.add_class::<scheduler::Scheduler>()?;
    m.add_class::<batch::Batch>()?;
    m.add_class::<allocator::BlockAllocator>()?;
    m.add_class::<decoder::DecoderStack>()?;
    m.add_function(wrap_pyfunction!(kernels::_paged_decode_attention, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::_add_rms_norm, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::_rope_store_kv, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::_gemv_bf16, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::_gemv_quant, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::_dequantize_bf16, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::_q4_layout, m)?)?;
    Ok(())
}
