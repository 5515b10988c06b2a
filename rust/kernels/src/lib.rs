//! CPU kernels for iron-batch's torch backend, in plain Rust (no PyO3: `cargo test` and
//! `cargo bench` run without Python). The bindings hand them raw tensor memory.

mod attention;
mod decoder;
mod delta_rule;
mod element;
mod elementwise;
mod gemv;
mod hybrid_decoder;
mod kquant;
mod kv_int8;
mod moe;
mod mxfp4;
mod prefetch;
mod quant;
mod router;
mod team;

pub use attention::{
    paged_decode_attention, paged_decode_attention_on, paged_decode_attention_sinks_on,
    AttentionPath, DecodeShape, KernelError, Parallel, ScopedThreads,
};
pub use decoder::{
    decode_layers, exp, gelu_tanh_mul, silu_mul, tanh, Activation, CacheGroup, DecodeInputs,
    DecoderLayer, Int8LayerCache, LayerCache, LayerExtras, LayerKv, Matrix, PerLayerInput,
    Projection, RopeTable,
};
pub use delta_rule::{
    causal_conv_chunk, causal_conv_decode, delta_rule_chunk, delta_rule_decode, DeltaShape,
    DELTA_CHUNK,
};
pub use element::{Bf16, Element, F16};
pub use elementwise::{add_rms_norm, add_rms_norm_once, add_rms_norm_with, rope_q, rope_store_kv};
pub use gemv::{gemv_bf16, GEMV_MAX_ROWS};
pub use hybrid_decoder::{
    decode_hybrid_layers, GatedAttention, GatedDelta, HybridInputs, HybridLayer, HybridShape,
    LayerState, Mixer,
};
pub use kquant::{parse_layout, BlockFormat, Blocks, Segment, MAX_SEGMENTS};
pub use kv_int8::{
    dequantize_int8_row, int8_row_len, int8_row_scale, paged_decode_attention_int8,
    quantize_int8_row, rope_store_kv_int8, store_kv_int8, INT8_SCALE_BYTES,
};
pub use moe::{
    moe_experts, moe_experts_with, ExpertActivation, ExpertExtras, Experts, MoeShape, SharedExpert,
    SparseMlp,
};
pub use mxfp4::{
    dequantize_mxfp4, gemv_mxfp4, gemv_mxfp4_on, Mxfp4, Mxfp4Path, MXFP4_BLOCK, MXFP4_MAX_ROWS,
};
pub use quant::{dequantize_bf16, gemv_quant, q4_nibble, QMatrix, MAX_ROWS, Q4, Q8, QBLOCK};
pub use router::{route, select_top_k, Routing};
pub use team::run_in_team;
