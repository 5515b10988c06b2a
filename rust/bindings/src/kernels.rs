//! CPU kernels over torch tensor memory. `iron_batch.attention.cpu_kernel` and
//! `iron_batch.layers.cpu_kernels` are the only callers: they check device, dtype, contiguity and shapes of every tensor
//! before passing its address here, because a raw address carries none of that.

use std::ffi::{c_int, c_uint, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};

use iron_batch_kernels::{
    add_rms_norm_with, dequantize_bf16, dequantize_mxfp4, gemv_bf16, gemv_mxfp4, gemv_quant,
    moe_experts_with, paged_decode_attention_sinks_on, parse_layout, q4_nibble, rope_store_kv,
    route, Activation, AttentionPath, Bf16, Blocks, DecodeShape, Element, ExpertActivation,
    ExpertExtras, Experts, KernelError, MoeShape, Mxfp4, Parallel, QMatrix, Routing, ScopedThreads,
    Segment, F16, MXFP4_BLOCK, Q4, Q8, QBLOCK,
};
use numpy::{IntoPyArray, PyArray1, PyReadonlyArray1, PyReadonlyArray2, PyUntypedArrayMethods};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

type GompParallel = unsafe extern "C" fn(extern "C" fn(*mut c_void), *mut c_void, c_uint, c_uint);
type OmpInt = unsafe extern "C" fn() -> c_int;

/// Runs a kernel's parts on the calling thread's OpenMP team, the one torch's own ops
/// use: its workers are already awake (spinning) after the previous op, where fresh OS
/// threads would have to share the cores with them.
struct OpenMp {
    parallel: GompParallel,
    thread_num: OmpInt,
    num_threads: OmpInt,
    panicked: AtomicBool,
}

struct Region<'a> {
    omp: &'a OpenMp,
    parts: usize,
    task: &'a (dyn Fn(usize) + Sync),
}

extern "C" fn region_body(data: *mut c_void) {
    // SAFETY: `data` is the `Region` that `OpenMp::run` keeps alive until GOMP_parallel
    // returns, after every team member has left this function.
    let region = unsafe { &*(data as *const Region<'_>) };
    // SAFETY: called inside a parallel region, where both functions are defined.
    let (me, team) = unsafe { ((region.omp.thread_num)(), (region.omp.num_threads)()) };
    let (me, team) = (me.max(0) as usize, team.max(1) as usize);
    // A team smaller than asked for still runs every part.
    let ran = catch_unwind(AssertUnwindSafe(|| {
        let mut part = me;
        while part < region.parts {
            (region.task)(part);
            part += team;
        }
    }));
    if ran.is_err() {
        region.omp.panicked.store(true, Ordering::Relaxed);
    }
}

impl Parallel for OpenMp {
    fn run(&self, parts: usize, task: &(dyn Fn(usize) + Sync)) {
        let region = Region {
            omp: self,
            parts,
            task,
        };
        // SAFETY: the addresses come from the OpenMP runtime torch loaded (see
        // iron_batch.attention.cpu_kernel); `region` outlives the call.
        unsafe {
            (self.parallel)(
                region_body,
                &region as *const Region<'_> as *mut c_void,
                parts as c_uint,
                0,
            )
        };
    }
}

/// The caller's OpenMP team from the three entry points' addresses, if given.
fn openmp_runner(openmp: Option<(usize, usize, usize)>) -> Option<OpenMp> {
    match openmp {
        Some((parallel, thread_num, num_threads))
            if parallel != 0 && thread_num != 0 && num_threads != 0 =>
        {
            // SAFETY: the caller passes these functions' addresses, taken from the loaded
            // OpenMP runtime by name.
            unsafe {
                Some(OpenMp {
                    parallel: std::mem::transmute::<usize, GompParallel>(parallel),
                    thread_num: std::mem::transmute::<usize, OmpInt>(thread_num),
                    num_threads: std::mem::transmute::<usize, OmpInt>(num_threads),
                    panicked: AtomicBool::new(false),
                })
            }
        }
        _ => None,
    }
}

/// Runs a kernel without the GIL, its parts on the caller's OpenMP team when the team's
/// entry points are given (OS threads otherwise). A kernel error becomes ValueError; a
/// panic on a team thread (caught there) becomes RuntimeError.
pub(crate) fn run_kernel(
    py: Python<'_>,
    openmp: Option<(usize, usize, usize)>,
    kernel: impl FnOnce(&dyn Parallel) -> Result<(), KernelError> + Send,
) -> PyResult<()> {
    let omp = openmp_runner(openmp);
    let result = py.detach(|| match &omp {
        Some(team) => kernel(team),
        None => kernel(&ScopedThreads),
    });
    if omp.is_some_and(|o| o.panicked.load(Ordering::Relaxed)) {
        return Err(PyRuntimeError::new_err(
            "a CPU kernel panicked on an OpenMP thread",
        ));
    }
    result.map_err(|e| PyValueError::new_err(e.0))
}

/// SAFETY (for every function below, upheld by `iron_batch.attention.cpu_kernel` and
/// `iron_batch.layers.cpu_kernels`, which check device, dtype, contiguity and shapes first): each address points
/// at a live contiguous CPU tensor of the element type `bf16` names, with the element count
/// the other arguments imply; outputs alias no input.
pub(crate) unsafe fn slice<'a, T>(addr: usize, len: usize) -> &'a [T] {
    std::slice::from_raw_parts(addr as *const T, len)
}

pub(crate) unsafe fn slice_mut<'a, T>(addr: usize, len: usize) -> &'a mut [T] {
    std::slice::from_raw_parts_mut(addr as *mut T, len)
}

/// Decode attention read in place from a paged KV cache (see the kernels crate); `softcap`
/// 0 is off, else each score becomes `softcap * tanh(score / softcap)`; `sinks` 0 is none,
/// else the address of `num_heads` f32 sink logits (gpt-oss).
///
/// `openmp`: addresses of `GOMP_parallel`, `omp_get_thread_num` and `omp_get_num_threads`
/// in the loaded OpenMP runtime, to run on the caller's team; without them, OS threads.
#[pyfunction]
#[pyo3(signature = (
    out, q, k_cache, v_cache, block_tables, seq_lens, *, num_heads, num_kv_heads, head_dim,
    block_size, num_blocks, sliding_window, scale, bf16, threads, openmp=None, softcap=0.0,
    sinks=0
))]
#[allow(clippy::too_many_arguments)]
pub fn _paged_decode_attention(
    py: Python<'_>,
    out: usize,
    q: usize,
    k_cache: usize,
    v_cache: usize,
    block_tables: PyReadonlyArray2<'_, i32>,
    seq_lens: PyReadonlyArray1<'_, i32>,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    block_size: usize,
    num_blocks: usize,
    sliding_window: usize,
    scale: f32,
    bf16: bool,
    threads: usize,
    openmp: Option<(usize, usize, usize)>,
    softcap: f32,
    sinks: usize,
) -> PyResult<()> {
    let dims = block_tables.shape();
    let shape = DecodeShape {
        num_seqs: dims[0],
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        max_blocks: dims[1],
        num_blocks,
        sliding_window,
    };
    let (tables, lens) = (block_tables.as_slice()?, seq_lens.as_slice()?);
    fn go<T: Element>(
        addrs: [usize; 5],
        tables: &[i32],
        lens: &[i32],
        shape: &DecodeShape,
        (scale, softcap): (f32, f32),
        threads: usize,
        parallel: &dyn Parallel,
    ) -> Result<(), KernelError> {
        let n = shape.num_seqs * shape.num_heads * shape.head_dim;
        let cache = shape.num_blocks * shape.block_size * shape.num_kv_heads * shape.head_dim;
        // SAFETY: see `slice`.
        let (out, q, k, v, sinks) = unsafe {
            (
                slice_mut::<T>(addrs[0], n),
                slice::<T>(addrs[1], n),
                slice::<T>(addrs[2], cache),
                slice::<T>(addrs[3], cache),
                (addrs[4] != 0).then(|| slice::<f32>(addrs[4], shape.num_heads)),
            )
        };
        paged_decode_attention_sinks_on(
            AttentionPath::Auto,
            out,
            q,
            k,
            v,
            tables,
            lens,
            shape,
            scale,
            softcap,
            sinks,
            threads,
            parallel,
        )
    }
    let addrs = [out, q, k_cache, v_cache, sinks];
    let scores = (scale, softcap);
    run_kernel(py, openmp, |parallel| {
        if bf16 {
            go::<Bf16>(addrs, tables, lens, &shape, scores, threads, parallel)
        } else {
            go::<f32>(addrs, tables, lens, &shape, scores, threads, parallel)
        }
    })
}

/// `residual += delta` (delta 0: none), then `out = weight * rms_norm(residual)`;
/// `round_once`: as the kernels' `add_rms_norm_once` (Gemma 4's rounding).
#[pyfunction]
#[pyo3(signature = (
    out, residual, delta, weight, *, rows, dim, eps, bf16, threads, openmp=None, round_once=false
))]
#[allow(clippy::too_many_arguments)]
pub fn _add_rms_norm(
    py: Python<'_>,
    out: usize,
    residual: usize,
    delta: usize,
    weight: usize,
    rows: usize,
    dim: usize,
    eps: f32,
    bf16: bool,
    threads: usize,
    openmp: Option<(usize, usize, usize)>,
    round_once: bool,
) -> PyResult<()> {
    #[allow(clippy::too_many_arguments)]
    fn go<T: Element>(
        addrs: [usize; 4],
        rows: usize,
        dim: usize,
        eps: f32,
        once: bool,
        threads: usize,
        parallel: &dyn Parallel,
    ) -> Result<(), KernelError> {
        let n = rows * dim;
        // SAFETY: see `slice`.
        let (out, res, delta, weight) = unsafe {
            (
                slice_mut::<T>(addrs[0], n),
                slice_mut::<T>(addrs[1], n),
                (addrs[2] != 0).then(|| slice::<T>(addrs[2], n)),
                slice::<T>(addrs[3], dim),
            )
        };
        add_rms_norm_with(out, res, delta, weight, rows, eps, once, threads, parallel)
    }
    let addrs = [out, residual, delta, weight];
    run_kernel(py, openmp, |parallel| {
        if bf16 {
            go::<Bf16>(addrs, rows, dim, eps, round_once, threads, parallel)
        } else {
            go::<f32>(addrs, rows, dim, eps, round_once, threads, parallel)
        }
    })
}

/// Rotary embedding of q and k from the fused qkv rows; K and V stored at their slots.
/// `cos`/`sin` are `[tokens, rotary_dim]` (None: `head_dim`, every dim rotated).
#[pyfunction]
#[pyo3(signature = (
    q_out, k_cache, v_cache, qkv, cos, sin, slots, *, heads, kv_heads, head_dim, num_slots, bf16,
    rotary_dim=None
))]
#[allow(clippy::too_many_arguments)]
pub fn _rope_store_kv(
    py: Python<'_>,
    q_out: usize,
    k_cache: usize,
    v_cache: usize,
    qkv: usize,
    cos: usize,
    sin: usize,
    slots: PyReadonlyArray1<'_, i64>,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    num_slots: usize,
    bf16: bool,
    rotary_dim: Option<usize>,
) -> PyResult<()> {
    fn go<T: Element>(
        addrs: [usize; 6],
        slots: &[i64],
        (heads, kv_heads, head_dim, rd): (usize, usize, usize, usize),
        num_slots: usize,
    ) -> Result<(), KernelError> {
        let tokens = slots.len();
        let cache = num_slots * kv_heads * head_dim;
        // SAFETY: see `slice`.
        unsafe {
            rope_store_kv(
                slice_mut::<T>(addrs[0], tokens * heads * head_dim),
                slice_mut::<T>(addrs[1], cache),
                slice_mut::<T>(addrs[2], cache),
                slice::<T>(addrs[3], tokens * (heads + 2 * kv_heads) * head_dim),
                slice::<T>(addrs[4], tokens * rd),
                slice::<T>(addrs[5], tokens * rd),
                slots,
                heads,
                kv_heads,
                head_dim,
                rd,
            )
        }
    }
    let slots = slots.as_slice()?;
    let addrs = [q_out, k_cache, v_cache, qkv, cos, sin];
    let dims = (heads, kv_heads, head_dim, rotary_dim.unwrap_or(head_dim));
    // One thread: a decode step's rows are too few to split.
    run_kernel(py, None, |_| {
        if bf16 {
            go::<Bf16>(addrs, slots, dims, num_slots)
        } else {
            go::<f32>(addrs, slots, dims, num_slots)
        }
    })
}

/// `out = act(gate) * up` for bf16 `gate_up` rows `[rows, 2 * inter]` (gate first) into
/// `out` `[rows, inter]`; `activation` as a checkpoint's `hidden_act` names it ("silu",
/// "gelu_pytorch_tanh"), the decode stack's own kernels, over row ranges on up to `threads`
/// threads (the OpenMP team's with `openmp`).
#[pyfunction]
#[pyo3(signature = (out, gate_up, *, rows, inter, activation, threads=1, openmp=None))]
#[allow(clippy::too_many_arguments)]
pub fn _gated_activation(
    py: Python<'_>,
    out: usize,
    gate_up: usize,
    rows: usize,
    inter: usize,
    activation: &str,
    threads: usize,
    openmp: Option<(usize, usize, usize)>,
) -> PyResult<()> {
    let act = Activation::from_name(activation)
        .ok_or_else(|| PyValueError::new_err(format!("no gated activation {activation:?}")))?;
    run_kernel(py, openmp, |parallel| {
        // SAFETY: see `slice`.
        let (out, gate_up) = unsafe {
            (
                slice_mut::<Bf16>(out, rows * inter),
                slice::<Bf16>(gate_up, rows * 2 * inter),
            )
        };
        act.apply_rows(out, gate_up, inter, threads, parallel)
    })
}

/// `out = x @ weight.T (+ bias)` for any number of bf16 rows (bias 0: none).
#[pyfunction]
#[pyo3(signature = (out, x, weight, bias, *, rows, n, k, threads, openmp=None))]
#[allow(clippy::too_many_arguments)]
pub fn _gemv_bf16(
    py: Python<'_>,
    out: usize,
    x: usize,
    weight: usize,
    bias: usize,
    rows: usize,
    n: usize,
    k: usize,
    threads: usize,
    openmp: Option<(usize, usize, usize)>,
) -> PyResult<()> {
    run_kernel(py, openmp, |parallel| {
        // SAFETY: see `slice`.
        let (out, x, weight, bias) = unsafe {
            (
                slice_mut::<Bf16>(out, rows * n),
                slice::<Bf16>(x, rows * k),
                slice::<Bf16>(weight, n * k),
                (bias != 0).then(|| slice::<Bf16>(bias, n)),
            )
        };
        gemv_bf16(out, x, weight, bias, rows, n, k, threads, parallel)
    })
}

/// The quantized matrix at these addresses: `kind` "q4" (packed nibbles, scale, min),
/// "q8" (i8 quants, scale; `min` unused), or GGUF blocks as the file has them: a block
/// format ("q4_k", "q5_k", "q6_k", "q5_0", "q5_1", "q4_1", "q8_0") or row ranges of several
/// ("q5_0*576+q8_0*192", see `parse_layout`), their bytes back to back at `quants`;
/// `scale` and `min` unused.
///
/// SAFETY: as for `slice`, with the element counts of an `n` x `k` matrix of that kind.
pub(crate) unsafe fn qmatrix<'a>(
    kind: &str,
    quants: usize,
    scale: usize,
    min: usize,
    n: usize,
    k: usize,
) -> Result<QMatrix<'a>, KernelError> {
    if let Some(layout) = parse_layout(kind, n) {
        if let Some((f, _)) = layout.iter().find(|(f, _)| !k.is_multiple_of(f.values())) {
            return Err(KernelError(format!(
                "k must be a multiple of {} for {}, not {k}",
                f.values(),
                f.name()
            )));
        }
        if layout.iter().map(|(_, rows)| rows).sum::<usize>() != n {
            return Err(KernelError(format!(
                "layout {kind:?} does not have {n} rows"
            )));
        }
        let total: usize = layout.iter().map(|(f, rows)| rows * f.row_bytes(k)).sum();
        let mut data = slice::<u8>(quants, total);
        let mut segments = Vec::with_capacity(layout.len());
        for (format, rows) in layout {
            let (this, rest) = data.split_at(rows * format.row_bytes(k));
            segments.push(Segment {
                format,
                rows,
                data: this,
            });
            data = rest;
        }
        return Blocks::stacked(&segments)
            .map(QMatrix::Blocks)
            .ok_or_else(|| KernelError(format!("layout {kind:?} has too many row ranges")));
    }
    if !k.is_multiple_of(QBLOCK) {
        return Err(KernelError(format!(
            "k must be a multiple of {QBLOCK}, not {k}"
        )));
    }
    let blocks = n * (k / QBLOCK);
    match kind {
        "q4" => Ok(QMatrix::Q4(Q4 {
            packed: slice::<u8>(quants, n * k / 2),
            scale: slice::<F16>(scale, blocks),
            min: slice::<F16>(min, blocks),
        })),
        "q8" => Ok(QMatrix::Q8(Q8 {
            quants: slice::<i8>(quants, n * k),
            scale: slice::<F16>(scale, blocks),
        })),
        other => Err(KernelError(format!("unknown quantized layout {other:?}"))),
    }
}

/// `out = x @ W.T (+ bias)` for bf16 rows against a quantized `n` x `k` matrix (bias 0:
/// none); see `iron_batch.layers.quant`.
#[pyfunction]
#[pyo3(signature = (out, x, kind, quants, scale, min, bias, *, rows, n, k, threads, openmp=None))]
#[allow(clippy::too_many_arguments)]
pub fn _gemv_quant(
    py: Python<'_>,
    out: usize,
    x: usize,
    kind: &str,
    quants: usize,
    scale: usize,
    min: usize,
    bias: usize,
    rows: usize,
    n: usize,
    k: usize,
    threads: usize,
    openmp: Option<(usize, usize, usize)>,
) -> PyResult<()> {
    let kind = kind.to_owned();
    run_kernel(py, openmp, move |parallel| {
        if kind == "mxfp4" {
            // SAFETY: see `slice` and `mxfp4_at`.
            let (weight, out, x, bias) = unsafe {
                (
                    mxfp4_at(quants, scale, n, k)?,
                    slice_mut::<Bf16>(out, rows * n),
                    slice::<Bf16>(x, rows * k),
                    (bias != 0).then(|| slice::<Bf16>(bias, n)),
                )
            };
            return gemv_mxfp4(out, x, weight, bias, rows, n, k, threads, parallel);
        }
        // SAFETY: see `slice` and `qmatrix` (which checks the shape before any slice).
        let weight = unsafe { qmatrix(&kind, quants, scale, min, n, k)? };
        // SAFETY: see `slice`.
        let (out, x, bias) = unsafe {
            (
                slice_mut::<Bf16>(out, rows * n),
                slice::<Bf16>(x, rows * k),
                (bias != 0).then(|| slice::<Bf16>(bias, n)),
            )
        };
        gemv_quant(out, x, weight, bias, rows, n, k, threads, parallel)
    })
}

/// An MXFP4 `n` x `k` matrix: `quants` its `[n, k / 2]` code bytes, `scale` its
/// `[n, k / 32]` exponents.
///
/// SAFETY: as for `slice`, with those element counts.
unsafe fn mxfp4_at<'a>(
    quants: usize,
    scale: usize,
    n: usize,
    k: usize,
) -> Result<Mxfp4<'a>, KernelError> {
    if !k.is_multiple_of(MXFP4_BLOCK) {
        return Err(KernelError(format!(
            "k must be a multiple of {MXFP4_BLOCK} for mxfp4, not {k}"
        )));
    }
    Ok(Mxfp4 {
        packed: slice::<u8>(quants, n * k / 2),
        scale: slice::<u8>(scale, n * (k / MXFP4_BLOCK)),
    })
}

/// One stacked expert projection at these addresses: `kind` "bf16" (`quants` is the
/// weight), "mxfp4" (see `mxfp4_at`) or a quantized layout (see `qmatrix`).
///
/// SAFETY: as for `qmatrix`.
pub(crate) unsafe fn experts_at<'a>(
    kind: &str,
    (quants, scale, min): (usize, usize, usize),
    n: usize,
    k: usize,
) -> Result<Experts<'a>, KernelError> {
    if kind == "bf16" {
        return Ok(Experts::Bf16(slice::<Bf16>(quants, n * k)));
    }
    if kind == "mxfp4" {
        return Ok(Experts::Mxfp4(mxfp4_at(quants, scale, n, k)?));
    }
    Ok(Experts::Quant(qmatrix(kind, quants, scale, min, n, k)?))
}

/// The selected experts of a decode step's bf16 rows (see `iron_batch.layers.moe`): `ids`
/// i32 and `weights` f32 `[rows, top_k]`; `gate_up` `[experts * 2 * inter, hidden]` and
/// `down` `[experts * hidden, inter]`, each bf16, MXFP4 or quantized; `gu_bias` and
/// `dn_bias` (0: none) the stacked bf16 biases; `activation` "clamped_swiglu" takes
/// `swiglu` (alpha, limit).
#[pyfunction]
#[pyo3(signature = (out, x, ids, weights, gate_up_kind, gu_quants, gu_scale, gu_min,
                    down_kind, dn_quants, dn_scale, dn_min, *, rows, top_k, experts, hidden,
                    inter, activation, bf16, threads, openmp=None, gu_bias=0, dn_bias=0,
                    swiglu=None))]
#[allow(clippy::too_many_arguments)]
pub fn _moe_experts(
    py: Python<'_>,
    out: usize,
    x: usize,
    ids: usize,
    weights: usize,
    gate_up_kind: &str,
    gu_quants: usize,
    gu_scale: usize,
    gu_min: usize,
    down_kind: &str,
    dn_quants: usize,
    dn_scale: usize,
    dn_min: usize,
    rows: usize,
    top_k: usize,
    experts: usize,
    hidden: usize,
    inter: usize,
    activation: &str,
    bf16: bool,
    threads: usize,
    openmp: Option<(usize, usize, usize)>,
    gu_bias: usize,
    dn_bias: usize,
    swiglu: Option<(f32, f32)>,
) -> PyResult<()> {
    if !bf16 {
        return Err(PyValueError::new_err("moe_experts: bf16 activations only"));
    }
    let act = match (activation, swiglu) {
        ("clamped_swiglu", Some((alpha, limit))) => {
            ExpertActivation::ClampedSwiglu { alpha, limit }
        }
        (name, None) => {
            ExpertActivation::Gated(Activation::from_name(name).ok_or_else(|| {
                PyValueError::new_err(format!("no gated activation {activation:?}"))
            })?)
        }
        _ => {
            return Err(PyValueError::new_err(format!(
                "activation {activation:?} with swiglu limits {swiglu:?}"
            )))
        }
    };
    let (gk, dk) = (gate_up_kind.to_owned(), down_kind.to_owned());
    let shape = MoeShape {
        rows,
        top_k,
        experts,
        hidden,
        inter,
    };
    run_kernel(py, openmp, move |parallel| {
        // SAFETY: see `slice` and `qmatrix`; the caller sized every buffer by `shape`.
        let (gate_up, down, out, x, ids, weights, gate_up_bias, down_bias) = unsafe {
            (
                experts_at(
                    &gk,
                    (gu_quants, gu_scale, gu_min),
                    experts * 2 * inter,
                    hidden,
                )?,
                experts_at(&dk, (dn_quants, dn_scale, dn_min), experts * hidden, inter)?,
                slice_mut::<Bf16>(out, rows * hidden),
                slice::<Bf16>(x, rows * hidden),
                slice::<i32>(ids, rows * top_k),
                slice::<f32>(weights, rows * top_k),
                (gu_bias != 0).then(|| slice::<Bf16>(gu_bias, experts * 2 * inter)),
                (dn_bias != 0).then(|| slice::<Bf16>(dn_bias, experts * hidden)),
            )
        };
        let extras = ExpertExtras {
            activation: act,
            gate_up_bias,
            down_bias,
        };
        moe_experts_with(
            out, x, ids, weights, gate_up, down, extras, shape, threads, parallel,
        )
    })
}

/// A router's choice for `rows` rows of bf16 `logits` `[rows, experts]` (see the kernels'
/// `route`): expert ids (i32) and weights (f32) `[rows, top_k]`.
#[pyfunction]
#[pyo3(signature = (ids, weights, logits, *, rows, experts, top_k, renormalize, weights_in_float))]
#[allow(clippy::too_many_arguments)]
pub fn _moe_route(
    ids: usize,
    weights: usize,
    logits: usize,
    rows: usize,
    experts: usize,
    top_k: usize,
    renormalize: bool,
    weights_in_float: bool,
) -> PyResult<()> {
    let routing = Routing {
        top_k,
        renormalize,
        weights_in_float,
    };
    // SAFETY: the caller sized every buffer by `rows`, `experts` and `top_k`.
    let (ids, weights, logits) = unsafe {
        (
            slice_mut::<i32>(ids, rows * top_k),
            slice_mut::<f32>(weights, rows * top_k),
            slice::<Bf16>(logits, rows * experts),
        )
    };
    route(ids, weights, logits, rows, experts, routing).map_err(|e| PyValueError::new_err(e.0))
}

/// The quantized `n` x `k` matrix as bf16 into `out`.
#[pyfunction]
#[pyo3(signature = (out, kind, quants, scale, min, *, n, k, threads, openmp=None))]
#[allow(clippy::too_many_arguments)]
pub fn _dequantize_bf16(
    py: Python<'_>,
    out: usize,
    kind: &str,
    quants: usize,
    scale: usize,
    min: usize,
    n: usize,
    k: usize,
    threads: usize,
    openmp: Option<(usize, usize, usize)>,
) -> PyResult<()> {
    let kind = kind.to_owned();
    run_kernel(py, openmp, move |parallel| {
        if kind == "mxfp4" {
            // SAFETY: see `slice` and `mxfp4_at`.
            let (weight, out) = unsafe {
                (
                    mxfp4_at(quants, scale, n, k)?,
                    slice_mut::<Bf16>(out, n * k),
                )
            };
            return dequantize_mxfp4(out, weight, n, k, threads, parallel);
        }
        // SAFETY: see `slice` and `qmatrix` (which checks the shape before any slice).
        let weight = unsafe { qmatrix(&kind, quants, scale, min, n, k)? };
        // SAFETY: see `slice`.
        let out = unsafe { slice_mut::<Bf16>(out, n * k) };
        dequantize_bf16(out, weight, n, k, threads, parallel)
    })
}

/// The MXFP4 `n` x `k` matrix (`quants` its code bytes, `scale` its exponents) as f32
/// into `out`: the exact weights (float32 models, and the tests' reference).
#[pyfunction]
#[pyo3(signature = (out, quants, scale, *, n, k, threads, openmp=None))]
#[allow(clippy::too_many_arguments)]
pub fn _dequantize_mxfp4_f32(
    py: Python<'_>,
    out: usize,
    quants: usize,
    scale: usize,
    n: usize,
    k: usize,
    threads: usize,
    openmp: Option<(usize, usize, usize)>,
) -> PyResult<()> {
    run_kernel(py, openmp, move |parallel| {
        // SAFETY: see `slice` and `mxfp4_at`.
        let (weight, out) =
            unsafe { (mxfp4_at(quants, scale, n, k)?, slice_mut::<f32>(out, n * k)) };
        dequantize_mxfp4(out, weight, n, k, threads, parallel)
    })
}

/// (byte index, high nibble?) arrays, one entry per weight of a row.
type Q4Layout<'py> = (Bound<'py, PyArray1<i64>>, Bound<'py, PyArray1<bool>>);

/// Where each weight of a `k`-wide Q4 row lives: (byte index, high nibble?) arrays of `k`.
#[pyfunction]
pub fn _q4_layout(py: Python<'_>, k: usize) -> PyResult<Q4Layout<'_>> {
    if k == 0 || !k.is_multiple_of(2 * QBLOCK) {
        return Err(PyValueError::new_err("k must be a positive multiple of 64"));
    }
    let (bytes, high): (Vec<i64>, Vec<bool>) = (0..k)
        .map(|j| {
            let (at, high) = q4_nibble(j, k);
            (at as i64, high)
        })
        .unzip();
    Ok((bytes.into_pyarray(py), high.into_pyarray(py)))
}
