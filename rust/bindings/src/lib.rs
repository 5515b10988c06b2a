//! `iron_batch._core`: thin PyO3 bindings over the pure-Rust `iron-batch-core` crate.

mod allocator;
mod batch;
mod convert;
mod decoder;
mod delta_rule;
mod errors;
mod events;
mod hybrid_decoder;
mod kernels;
mod kv_int8;
mod scheduler;

use pyo3::prelude::*;

/// `FINISH_REASONS[code]`: the name of each `StepEvents.finish_reasons` code (None for 0).
fn finish_reasons() -> Vec<Option<&'static str>> {
    std::iter::once(None)
        .chain(
            iron_batch_core::FinishReason::ALL
                .iter()
                .map(|r| Some(r.as_str())),
        )
        .collect()
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    errors::register(m)?;
    m.add_class::<scheduler::SchedulerConfig>()?;
    m.add_class::<scheduler::CacheGroup>()?;
    m.add_function(wrap_pyfunction!(scheduler::split_pool, m)?)?;
    m.add_class::<scheduler::Scheduler>()?;
    m.add_class::<batch::Batch>()?;
    m.add_class::<events::StepEvents>()?;
    m.add(
        "FINISH_REASONS",
        pyo3::types::PyTuple::new(m.py(), finish_reasons())?,
    )?;
    // The input id of a proposal row that the backend's draft model fills in.
    m.add("DRAFTED_BY_BACKEND", iron_batch_core::DRAFTED_BY_BACKEND)?;
    m.add_class::<allocator::BlockAllocator>()?;
    m.add_class::<decoder::DecoderStack>()?;
    m.add_class::<hybrid_decoder::HybridStack>()?;
    m.add_function(wrap_pyfunction!(kernels::_paged_decode_attention, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::_dequantize_mxfp4_f32, m)?)?;
    m.add_function(wrap_pyfunction!(delta_rule::_delta_rule_decode, m)?)?;
    m.add_function(wrap_pyfunction!(delta_rule::_delta_rule_chunk, m)?)?;
    m.add_function(wrap_pyfunction!(delta_rule::_causal_conv, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::_add_rms_norm, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::_rope_store_kv, m)?)?;
    m.add_function(wrap_pyfunction!(kv_int8::_paged_decode_attention_int8, m)?)?;
    m.add_function(wrap_pyfunction!(kv_int8::_rope_store_kv_int8, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::_gated_activation, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::_gemv_bf16, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::_gemv_quant, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::_moe_experts, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::_moe_route, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::_dequantize_bf16, m)?)?;
    m.add_function(wrap_pyfunction!(kernels::_q4_layout, m)?)?;
    Ok(())
}
