//! A mixture-of-experts MLP over a step's rows, grouped by expert: only the experts the
//! router selected are read, each once per GEMV pass for all the rows that chose it (a
//! decode step's few rows, or the gathered rows of a larger step).
//!
//! The experts' weights are stacked, one matrix per projection for the whole layer:
//! expert `e`'s gate rows then up rows are rows `e * 2I .. (e + 1) * 2I` of `gate_up`
//! (`[E * 2I, H]`), its down rows `e * H .. (e + 1) * H` of `down` (`[E * H, I]`). Either
//! is bf16 or quantized ([`QMatrix`]); a quantized expert's rows are its own blocks, so a
//! step reads the selected experts' bytes and no others. Each selected expert runs the
//! GEMVs of the dense layers ([`gemv_bf16`], [`gemv_quant`]) on its gathered rows (all the
//! experts' pieces of one projection in one job of the thread team), its
//! gated activation rounded as torch rounds it, and its output joins each row's f32 sum
//! scaled by that row's routing weight; the sums are rounded to bf16 once.
//!
//! gpt-oss's experts ([`moe_experts_with`]): MXFP4 weights ([`Mxfp4`], the checkpoint's
//! bytes), a bias per expert on both projections, and the clamped SwiGLU
//! ([`ExpertActivation::ClampedSwiglu`]).

use crate::attention::{KernelError, Parallel};
use crate::decoder::{exp, Activation, Projection};
use crate::element::{Bf16, Element};
use crate::gemv::gemv_bf16;
use crate::mxfp4::{gemv_mxfp4, Mxfp4, MXFP4_BLOCK};
use crate::quant::{gemv_quant, QMatrix, Q4, Q8, QBLOCK};
use crate::router::{route, Routing};

/// One stacked projection of every expert.
#[derive(Clone, Copy)]
pub enum Experts<'a> {
    Bf16(&'a [Bf16]),
    Quant(QMatrix<'a>),
    Mxfp4(Mxfp4<'a>),
}

impl<'a> Experts<'a> {
    /// Rows `lo..hi` of the stacked rows of `k` values.
    fn rows(&self, lo: usize, hi: usize, k: usize) -> Experts<'a> {
        let blocks = k / QBLOCK;
        match *self {
            Experts::Bf16(w) => Experts::Bf16(&w[lo * k..hi * k]),
            Experts::Quant(QMatrix::Q4(m)) => Experts::Quant(QMatrix::Q4(Q4 {
                packed: &m.packed[lo * k / 2..hi * k / 2],
                scale: &m.scale[lo * blocks..hi * blocks],
                min: &m.min[lo * blocks..hi * blocks],
            })),
            Experts::Quant(QMatrix::Q8(m)) => Experts::Quant(QMatrix::Q8(Q8 {
                quants: &m.quants[lo * k..hi * k],
                scale: &m.scale[lo * blocks..hi * blocks],
            })),
            // `holds` admits one-format block matrices only, so the range exists.
            Experts::Quant(QMatrix::Blocks(m)) => Experts::Quant(QMatrix::Blocks(
                m.row_range(lo, hi, k).expect("a one-format block matrix"),
            )),
            Experts::Mxfp4(m) => Experts::Mxfp4(m.rows(lo, hi, k)),
        }
    }

    fn holds(&self, n: usize, k: usize) -> bool {
        match self {
            Experts::Bf16(w) => w.len() == n * k,
            Experts::Quant(QMatrix::Q4(m)) => {
                k.is_multiple_of(2 * QBLOCK) && m.packed.len() == n * k / 2
            }
            Experts::Quant(QMatrix::Q8(m)) => k.is_multiple_of(QBLOCK) && m.quants.len() == n * k,
            Experts::Quant(QMatrix::Blocks(m)) => m.segments().len() == 1 && m.fits(n, k),
            Experts::Mxfp4(m) => k.is_multiple_of(MXFP4_BLOCK) && m.fits(n, k),
        }
    }

    /// `out = x W^T (+ bias)` for `rows` rows (bf16 in and out, f32 sums).
    #[allow(clippy::too_many_arguments)]
    fn gemv(
        &self,
        out: &mut [Bf16],
        x: &[Bf16],
        bias: Option<&[Bf16]>,
        rows: usize,
        n: usize,
        k: usize,
        threads: usize,
        parallel: &dyn Parallel,
    ) -> Result<(), KernelError> {
        match self {
            Experts::Quant(m) => gemv_quant(out, x, *m, bias, rows, n, k, threads, parallel),
            Experts::Mxfp4(m) => gemv_mxfp4(out, x, *m, bias, rows, n, k, threads, parallel),
            Experts::Bf16(w) => gemv_bf16(out, x, w, bias, rows, n, k, threads, parallel),
        }
    }
}

/// The shape of one call: `rows` activation rows of `hidden`, each routed to `top_k` of
/// `experts` experts of `inter` intermediate rows.
#[derive(Clone, Copy, Debug)]
pub struct MoeShape {
    pub rows: usize,
    pub top_k: usize,
    pub experts: usize,
    pub hidden: usize,
    pub inter: usize,
}

/// The experts' gated activation of `[rows, 2 * inter]` (the gate first).
#[derive(Clone, Copy, Debug)]
pub enum ExpertActivation {
    /// `act(gate) * up`, as the dense layers' MLP computes it.
    Gated(Activation),
    /// gpt-oss's: `(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)` with
    /// `g = min(gate, limit)`, each step rounded to bf16 as torch's bf16 ops round it.
    ClampedSwiglu { alpha: f32, limit: f32 },
}

impl ExpertActivation {
    fn apply(self, out: &mut [Bf16], gate_up: &[Bf16], inter: usize) {
        match self {
            Self::Gated(a) => a.apply(out, gate_up, inter),
            Self::ClampedSwiglu { alpha, limit } => {
                let r = |v: f32| Bf16::from_f32(v).to_f32();
                for (o, gu) in out
                    .chunks_exact_mut(inter)
                    .zip(gate_up.chunks_exact(2 * inter))
                {
                    let (gate, up) = gu.split_at(inter);
                    for ((o, g), u) in o.iter_mut().zip(gate).zip(up) {
                        let g = g.to_f32().min(limit);
                        let u = u.to_f32().clamp(-limit, limit);
                        let sig = r(1.0 / (1.0 + (-r(g * alpha)).exp()));
                        *o = Bf16::from_f32(r(u + 1.0) * r(g * sig));
                    }
                }
            }
        }
    }
}

/// What an expert adds to [`moe_experts`]: its activation and its projections' biases
/// (`gate_up_bias` `[experts * 2 * inter]`, `down_bias` `[experts * hidden]`, each expert's
/// rows in the stacked order; None: none).
#[derive(Clone, Copy)]
pub struct ExpertExtras<'a> {
    pub activation: ExpertActivation,
    pub gate_up_bias: Option<&'a [Bf16]>,
    pub down_bias: Option<&'a [Bf16]>,
}

/// `out[r] = sum_j weights[r][j] * expert_{ids[r][j]}(x[r])` where
/// `expert_e(x) = down_e(act(gate_e x) * up_e x)`.
///
/// `x` and `out` are `[rows, hidden]` bf16, `ids` `[rows, top_k]` expert indices,
/// `weights` `[rows, top_k]` f32. The rows are gathered by expert (experts in index order,
/// each one's rows in row order); all the chosen experts' gate/up projections run as one
/// job of at most `threads` parts on `parallel` (the caller's OpenMP team), their output
/// rows laid end to end and cut evenly, and their down projections as a second such job:
/// two hand-offs to the team a layer, where one GEMV per expert and projection took
/// `2 x k` at batch 1. Each output value is the same GEMV's whatever the cut.
#[allow(clippy::too_many_arguments)]
pub fn moe_experts(
    out: &mut [Bf16],
    x: &[Bf16],
    ids: &[i32],
    weights: &[f32],
    gate_up: Experts<'_>,
    down: Experts<'_>,
    activation: Activation,
    shape: MoeShape,
    threads: usize,
    parallel: &dyn Parallel,
) -> Result<(), KernelError> {
    let extras = ExpertExtras {
        activation: ExpertActivation::Gated(activation),
        gate_up_bias: None,
        down_bias: None,
    };
    moe_experts_with(
        out, x, ids, weights, gate_up, down, extras, shape, threads, parallel,
    )
}

/// [`moe_experts`] with biased experts and another activation (gpt-oss's): `expert_e(x) =
/// down_e(act(gate_e x + bg_e, up_e x + bu_e)) + bd_e`.
#[allow(clippy::too_many_arguments)]
pub fn moe_experts_with(
    out: &mut [Bf16],
    x: &[Bf16],
    ids: &[i32],
    weights: &[f32],
    gate_up: Experts<'_>,
    down: Experts<'_>,
    extras: ExpertExtras<'_>,
    shape: MoeShape,
    threads: usize,
    parallel: &dyn Parallel,
) -> Result<(), KernelError> {
    let MoeShape {
        rows,
        top_k,
        experts,
        hidden,
        inter,
    } = shape;
    let sizes_ok = rows > 0
        && top_k > 0
        && hidden > 0
        && inter > 0
        && x.len() == rows * hidden
        && out.len() == rows * hidden
        && ids.len() == rows * top_k
        && weights.len() == rows * top_k
        && gate_up.holds(experts * 2 * inter, hidden)
        && down.holds(experts * hidden, inter)
        && extras
            .gate_up_bias
            .is_none_or(|b| b.len() == experts * 2 * inter)
        && extras.down_bias.is_none_or(|b| b.len() == experts * hidden);
    if !sizes_ok {
        return Err(KernelError(format!(
            "moe_experts: buffers do not fit {shape:?}"
        )));
    }
    if let Some(bad) = ids.iter().find(|&&e| e < 0 || e as usize >= experts) {
        return Err(KernelError(format!(
            "moe_experts: expert {bad} of {experts}"
        )));
    }
    // Each expert's (row, weight) pairs, in row order.
    let mut chosen: Vec<Vec<(usize, f32)>> = vec![Vec::new(); experts];
    for r in 0..rows {
        for j in 0..top_k {
            chosen[ids[r * top_k + j] as usize].push((r, weights[r * top_k + j]));
        }
    }
    // The chosen experts, each with where its rows start in the gathered buffers.
    let mut used: Vec<(usize, usize)> = Vec::new(); // (expert, first gathered row)
    let mut gathered = 0;
    for (e, picks) in chosen.iter().enumerate() {
        if !picks.is_empty() {
            used.push((e, gathered));
            gathered += picks.len();
        }
    }
    let mut xs = vec![Bf16::from_f32(0.0); gathered * hidden];
    for &(e, first) in &used {
        for (i, &(r, _)) in chosen[e].iter().enumerate() {
            xs[(first + i) * hidden..(first + i + 1) * hidden]
                .copy_from_slice(&x[r * hidden..(r + 1) * hidden]);
        }
    }
    let mut gu = vec![Bf16::from_f32(0.0); gathered * 2 * inter];
    let mut act = vec![Bf16::from_f32(0.0); gathered * inter];
    let mut h = vec![Bf16::from_f32(0.0); gathered * hidden];
    // Every chosen expert's gate/up in one pass of the team, then every down projection in
    // another (two hand-offs a layer, not two an expert).
    let project = |out: &mut [Bf16],
                   input: &[Bf16],
                   weights: Experts<'_>,
                   bias: Option<&[Bf16]>,
                   n: usize,
                   k: usize|
     -> Result<(), KernelError> {
        let segments: Vec<Segment> = used
            .iter()
            .map(|&(e, first)| Segment {
                expert: e,
                first,
                rows: chosen[e].len(),
            })
            .collect();
        experts_pass(
            out, input, weights, bias, &segments, n, k, threads, parallel,
        )
    };
    project(
        &mut gu,
        &xs,
        gate_up,
        extras.gate_up_bias,
        2 * inter,
        hidden,
    )?;
    extras.activation.apply(&mut act, &gu, inter);
    project(&mut h, &act, down, extras.down_bias, hidden, inter)?;
    let mut sums = vec![0f32; rows * hidden];
    for &(e, first) in &used {
        for (i, &(r, w)) in chosen[e].iter().enumerate() {
            let acc = &mut sums[r * hidden..(r + 1) * hidden];
            let row = &h[(first + i) * hidden..(first + i + 1) * hidden];
            for (s, v) in acc.iter_mut().zip(row) {
                *s += w * v.to_f32();
            }
        }
    }
    for (o, s) in out.iter_mut().zip(&sums) {
        *o = Bf16::from_f32(*s);
    }
    Ok(())
}

/// An expert's gathered activation rows: `rows` of them from row `first` of the gathered
/// buffers.
struct Segment {
    expert: usize,
    first: usize,
    rows: usize,
}

/// `out[first + i] = input[first + i] W_e^T (+ b_e)` for every segment's expert `e` (each
/// `n` x `k` in the stacked `weights`), as one job of `threads` parts: the experts' output
/// rows laid end to end and cut evenly, each part running the GEMV of its pieces on its
/// own thread. Each output value is the GEMV's for that row, whatever the cut.
#[allow(clippy::too_many_arguments)]
fn experts_pass(
    out: &mut [Bf16],
    input: &[Bf16],
    weights: Experts<'_>,
    bias: Option<&[Bf16]>,
    segments: &[Segment],
    n: usize,
    k: usize,
    threads: usize,
    parallel: &dyn Parallel,
) -> Result<(), KernelError> {
    let total = segments.len() * n;
    let parts = threads.clamp(1, total.max(1));
    let out_addr = out.as_mut_ptr() as usize;
    let out_len = out.len();
    let failed = std::sync::Mutex::new(None);
    let part = |p: usize| {
        let (lo, hi) = (total * p / parts, total * (p + 1) / parts);
        let mut scratch: Vec<Bf16> = Vec::new();
        let mut at = lo;
        while at < hi {
            let (s, from) = (at / n, at % n);
            let to = n.min(from + hi - at);
            let seg = &segments[s];
            let m = seg.rows;
            let rows_of = weights.rows(seg.expert * n + from, seg.expert * n + to, k);
            let b = bias.map(|b| &b[seg.expert * n + from..seg.expert * n + to]);
            let x = &input[seg.first * k..(seg.first + m) * k];
            let width = to - from;
            scratch.clear();
            scratch.resize(m * width, Bf16::from_f32(0.0));
            let one = crate::attention::ScopedThreads;
            if let Err(e) = rows_of.gemv(&mut scratch, x, b, m, width, k, 1, &one) {
                *failed.lock().unwrap_or_else(|e| e.into_inner()) = Some(e);
                return;
            }
            for i in 0..m {
                let start = (seg.first + i) * n + from;
                debug_assert!(start + width <= out_len);
                // SAFETY: parts cover disjoint (segment, column) ranges of `out`, which
                // outlives the job; `start + width <= out.len()`.
                let dst = unsafe {
                    std::slice::from_raw_parts_mut((out_addr as *mut Bf16).add(start), width)
                };
                dst.copy_from_slice(&scratch[i * width..(i + 1) * width]);
            }
            at += to - from;
        }
    };
    if parts == 1 {
        part(0);
    } else {
        parallel.run(parts, &part);
    }
    match failed.into_inner().unwrap_or_else(|e| e.into_inner()) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// A sparse MLP as a decoder layer runs it: the router, the chosen experts, and a shared
/// expert every row runs (Qwen2-MoE's), scaled by `sigmoid(shared_gate x)` where there is
/// a gate. Each step rounds to bf16 where torch's bf16 ops round:
///
/// ```text
/// ids, w = route(router(x))                   // see crate::router
/// out = sum_j w_j * expert_{ids_j}(x)          // f32 sums, rounded once (moe_experts)
/// s = shared.down(act(shared.gate_up(x)))
/// s = sigmoid(shared_gate(x)) * s             // the sigmoid rounded, then the product
/// out = out + s
/// ```
#[derive(Clone, Copy)]
pub struct SparseMlp<'a> {
    /// `[experts, hidden]`, no bias.
    pub router: Projection<'a>,
    pub routing: Routing,
    pub gate_up: Experts<'a>,
    pub down: Experts<'a>,
    pub experts: usize,
    /// Rows of each expert's gate (and of its up) projection.
    pub inter: usize,
    pub shared: Option<SharedExpert<'a>>,
}

/// A dense expert every row runs beside the routed ones.
#[derive(Clone, Copy)]
pub struct SharedExpert<'a> {
    pub gate_up: Projection<'a>,
    pub down: Projection<'a>,
    /// `[1, hidden]`: the output is scaled by the sigmoid of this projection (None: not).
    pub gate: Option<Projection<'a>>,
}

impl SparseMlp<'_> {
    /// Whether the sizes fit `hidden`-wide rows, `rows` of them a step.
    pub fn fits(&self, hidden: usize, rows: usize) -> bool {
        let (e, i) = (self.experts, self.inter);
        let proj_fits =
            |p: &Projection<'_>, n: usize, k: usize| (p.n, p.k) == (n, k) && rows <= p.max_rows();
        let shared_fits = self.shared.is_none_or(|s| {
            let si = s.gate_up.n / 2;
            si > 0
                && proj_fits(&s.gate_up, 2 * si, hidden)
                && proj_fits(&s.down, hidden, si)
                && s.gate.is_none_or(|g| proj_fits(&g, 1, hidden))
        });
        e > 0
            && i > 0
            && self.routing.supports(e)
            && proj_fits(&self.router, e, hidden)
            && self.gate_up.holds(e * 2 * i, hidden)
            && self.down.holds(e * hidden, i)
            && shared_fits
    }

    /// `out = mlp(x)` for `rows` rows of `x` (`[rows, hidden]` bf16) with `activation`.
    #[allow(clippy::too_many_arguments)]
    pub fn apply(
        &self,
        out: &mut [Bf16],
        x: &[Bf16],
        rows: usize,
        hidden: usize,
        activation: Activation,
        threads: usize,
        parallel: &dyn Parallel,
    ) -> Result<(), KernelError> {
        let (e, k) = (self.experts, self.routing.top_k);
        let mut logits = vec![Bf16(0); rows * e];
        self.router.apply(&mut logits, x, rows, threads, parallel)?;
        let (mut ids, mut weights) = (vec![0i32; rows * k], vec![0f32; rows * k]);
        route(&mut ids, &mut weights, &logits, rows, e, self.routing)?;
        let shape = MoeShape {
            rows,
            top_k: k,
            experts: e,
            hidden,
            inter: self.inter,
        };
        moe_experts(
            out,
            x,
            &ids,
            &weights,
            self.gate_up,
            self.down,
            activation,
            shape,
            threads,
            parallel,
        )?;
        let Some(s) = self.shared else {
            return Ok(());
        };
        let si = s.gate_up.n / 2;
        let mut gu = vec![Bf16(0); rows * 2 * si];
        s.gate_up.apply(&mut gu, x, rows, threads, parallel)?;
        let mut act = vec![Bf16(0); rows * si];
        activation.apply(&mut act, &gu, si);
        let mut shared = vec![Bf16(0); rows * hidden];
        s.down.apply(&mut shared, &act, rows, threads, parallel)?;
        if let Some(g) = s.gate {
            let mut gate = vec![Bf16(0); rows];
            g.apply(&mut gate, x, rows, threads, parallel)?;
            for (row, g) in shared.chunks_exact_mut(hidden).zip(&gate) {
                let sig = Bf16::from_f32(1.0 / (1.0 + exp(-g.to_f32()))).to_f32();
                for v in row.iter_mut() {
                    *v = Bf16::from_f32(sig * v.to_f32());
                }
            }
        }
        for (o, s) in out.iter_mut().zip(&shared) {
            *o = Bf16::from_f32(o.to_f32() + s.to_f32());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attention::ScopedThreads;
    use crate::element::F16;

    fn rng(seed: u64) -> impl FnMut() -> f32 {
        let mut s = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        move || {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        }
    }

    fn bf16s(v: &[f32]) -> Vec<Bf16> {
        v.iter().map(|&x| Bf16::from_f32(x)).collect()
    }

    fn silu(x: f64) -> f64 {
        x / (1.0 + (-x).exp())
    }

    /// The float64 reference: every weight as the kernels read it (`w(e, row, j)`).
    #[allow(clippy::too_many_arguments)]
    fn reference(
        x: &[f32],
        ids: &[i32],
        weights: &[f32],
        gu: impl Fn(usize, usize) -> f64,
        dn: impl Fn(usize, usize) -> f64,
        s: MoeShape,
    ) -> Vec<f64> {
        let (h, i_) = (s.hidden, s.inter);
        let mut out = vec![0f64; s.rows * h];
        for r in 0..s.rows {
            for j in 0..s.top_k {
                let e = ids[r * s.top_k + j] as usize;
                let w = f64::from(weights[r * s.top_k + j]);
                let mut act = vec![0f64; i_];
                for (c, a) in act.iter_mut().enumerate() {
                    let dot = |row: usize| -> f64 {
                        (0..h)
                            .map(|k| f64::from(x[r * h + k]) * gu(e * 2 * i_ + row, k))
                            .sum()
                    };
                    *a = silu(dot(c)) * dot(i_ + c);
                }
                for o in 0..h {
                    let d: f64 = (0..i_).map(|c| act[c] * dn(e * h + o, c)).sum();
                    out[r * h + o] += w * d;
                }
            }
        }
        out
    }

    fn shape(rows: usize) -> MoeShape {
        MoeShape {
            rows,
            top_k: 2,
            experts: 6,
            hidden: 64,
            inter: 96,
        }
    }

    fn inputs(s: MoeShape, seed: u64) -> (Vec<f32>, Vec<i32>, Vec<f32>) {
        let mut r = rng(seed);
        let x: Vec<f32> = (0..s.rows * s.hidden)
            .map(|_| Bf16::from_f32(r()).to_f32())
            .collect();
        // Expert 5 chosen by no row; expert 0 by every row.
        let ids: Vec<i32> = (0..s.rows).flat_map(|i| [0, 1 + (i % 4) as i32]).collect();
        let weights: Vec<f32> = (0..s.rows * s.top_k).map(|_| 0.5 + r().abs()).collect();
        (x, ids, weights)
    }

    fn close(got: &[Bf16], want: &[f64], tol: f64) {
        for (g, w) in got.iter().zip(want) {
            let g = f64::from(g.to_f32());
            assert!((g - w).abs() <= tol * (1.0 + w.abs()), "{g} vs {w}");
        }
    }

    #[test]
    fn bf16_experts_match_the_float64_reference() {
        // 37 rows: expert 0 takes every row, more than one GEMV pass over its weights.
        for rows in [1, 2, 3, 8, 37] {
            let s = shape(rows);
            let mut r = rng(7);
            let gu: Vec<f32> = (0..s.experts * 2 * s.inter * s.hidden)
                .map(|_| Bf16::from_f32(r() * 0.3).to_f32())
                .collect();
            let dn: Vec<f32> = (0..s.experts * s.hidden * s.inter)
                .map(|_| Bf16::from_f32(r() * 0.3).to_f32())
                .collect();
            let (x, ids, w) = inputs(s, rows as u64);
            let (gu16, dn16) = (bf16s(&gu), bf16s(&dn));
            let mut out = vec![Bf16::from_f32(0.0); rows * s.hidden];
            for threads in [1, 3] {
                moe_experts(
                    &mut out,
                    &bf16s(&x),
                    &ids,
                    &w,
                    Experts::Bf16(&gu16),
                    Experts::Bf16(&dn16),
                    Activation::SiluMul,
                    s,
                    threads,
                    &ScopedThreads,
                )
                .unwrap();
                let want = reference(
                    &x,
                    &ids,
                    &w,
                    |row, k| f64::from(gu[row * s.hidden + k]),
                    |row, c| f64::from(dn[row * s.inter + c]),
                    s,
                );
                // bf16 rounding of the gate/up outputs and of the activation.
                close(&out, &want, 0.03);
            }
        }
    }

    #[test]
    fn q8_experts_read_their_own_blocks() {
        let s = shape(3);
        let mut r = rng(11);
        let q8 = |n: usize, k: usize, r: &mut dyn FnMut() -> f32| {
            let quants: Vec<i8> = (0..n * k).map(|_| (r() * 127.0) as i8).collect();
            let scale: Vec<F16> = (0..n * k / QBLOCK)
                .map(|_| F16::from_f32(0.002 + 0.002 * r().abs()))
                .collect();
            (quants, scale)
        };
        let (gq, gs) = q8(s.experts * 2 * s.inter, s.hidden, &mut r);
        let (dq, ds) = q8(s.experts * s.hidden, s.inter, &mut r);
        let gm = QMatrix::Q8(Q8 {
            quants: &gq,
            scale: &gs,
        });
        let dm = QMatrix::Q8(Q8 {
            quants: &dq,
            scale: &ds,
        });
        let (x, ids, w) = inputs(s, 5);
        let mut out = vec![Bf16::from_f32(0.0); s.rows * s.hidden];
        moe_experts(
            &mut out,
            &bf16s(&x),
            &ids,
            &w,
            Experts::Quant(gm),
            Experts::Quant(dm),
            Activation::SiluMul,
            s,
            2,
            &ScopedThreads,
        )
        .unwrap();
        let want = reference(
            &x,
            &ids,
            &w,
            |row, k| f64::from(gm.weight(row, k, s.hidden)),
            |row, c| f64::from(dm.weight(row, c, s.inter)),
            s,
        );
        close(&out, &want, 0.03);
    }

    #[test]
    fn gguf_block_experts_are_sliced_by_expert() {
        // The same Q8 weights as GGUF Q8_0 blocks (f16 scale, then 32 i8 quants), stacked
        // for all experts as one tensor of one format.
        let s = shape(3);
        let mut r = rng(13);
        let gguf = |n: usize, k: usize, r: &mut dyn FnMut() -> f32| {
            let quants: Vec<i8> = (0..n * k).map(|_| (r() * 127.0) as i8).collect();
            let scale: Vec<F16> = (0..n * k / QBLOCK)
                .map(|_| F16::from_f32(0.002 + 0.002 * r().abs()))
                .collect();
            let mut bytes = Vec::with_capacity(n * k / QBLOCK * 34);
            for (b, d) in scale.iter().enumerate() {
                bytes.extend_from_slice(&d.0.to_le_bytes());
                bytes.extend(
                    quants[b * QBLOCK..(b + 1) * QBLOCK]
                        .iter()
                        .map(|&q| q as u8),
                );
            }
            (quants, scale, bytes)
        };
        let (gq, gs, gb) = gguf(s.experts * 2 * s.inter, s.hidden, &mut r);
        let (dq, ds, db) = gguf(s.experts * s.hidden, s.inter, &mut r);
        fn blocks(rows: usize, bytes: &[u8]) -> Experts<'_> {
            Experts::Quant(QMatrix::Blocks(crate::kquant::Blocks::new(
                crate::kquant::BlockFormat::Q8_0,
                rows,
                bytes,
            )))
        }
        let (x, ids, w) = inputs(s, 9);
        let mut out = vec![Bf16::from_f32(0.0); s.rows * s.hidden];
        moe_experts(
            &mut out,
            &bf16s(&x),
            &ids,
            &w,
            blocks(s.experts * 2 * s.inter, &gb),
            blocks(s.experts * s.hidden, &db),
            Activation::SiluMul,
            s,
            2,
            &ScopedThreads,
        )
        .unwrap();
        let (gm, dm) = (
            QMatrix::Q8(Q8 {
                quants: &gq,
                scale: &gs,
            }),
            QMatrix::Q8(Q8 {
                quants: &dq,
                scale: &ds,
            }),
        );
        let want = reference(
            &x,
            &ids,
            &w,
            |row, k| f64::from(gm.weight(row, k, s.hidden)),
            |row, c| f64::from(dm.weight(row, c, s.inter)),
            s,
        );
        close(&out, &want, 0.03);
        // A matrix of two formats is not one expert tensor: refused.
        fn seg(rows: usize, data: &[u8]) -> crate::kquant::Segment<'_> {
            crate::kquant::Segment {
                format: crate::kquant::BlockFormat::Q8_0,
                rows,
                data,
            }
        }
        let rows = s.experts * 2 * s.inter;
        let bytes_per_row = s.hidden / QBLOCK * 34;
        let two = crate::kquant::Blocks::stacked(&[
            seg(rows / 2, &gb[..rows / 2 * bytes_per_row]),
            seg(rows / 2, &gb[rows / 2 * bytes_per_row..]),
        ])
        .unwrap();
        let refused = moe_experts(
            &mut out,
            &bf16s(&x),
            &ids,
            &w,
            Experts::Quant(QMatrix::Blocks(two)),
            blocks(s.experts * s.hidden, &db),
            Activation::SiluMul,
            s,
            2,
            &ScopedThreads,
        );
        assert!(refused.is_err());
    }

    #[test]
    fn q4_experts_read_their_own_blocks() {
        let s = MoeShape {
            inter: 128,
            ..shape(2)
        };
        let mut r = rng(13);
        let q4 = |n: usize, k: usize, r: &mut dyn FnMut() -> f32| {
            let packed: Vec<u8> = (0..n * k / 2).map(|_| (r().abs() * 255.0) as u8).collect();
            let blocks = n * k / QBLOCK;
            let scale: Vec<F16> = (0..blocks)
                .map(|_| F16::from_f32(0.002 + 0.002 * r().abs()))
                .collect();
            let min: Vec<F16> = (0..blocks).map(|_| F16::from_f32(-0.015)).collect();
            (packed, scale, min)
        };
        let (gp, gs, gm) = q4(s.experts * 2 * s.inter, s.hidden, &mut r);
        let (dp, ds, dm) = q4(s.experts * s.hidden, s.inter, &mut r);
        let gu = QMatrix::Q4(Q4 {
            packed: &gp,
            scale: &gs,
            min: &gm,
        });
        let dn = QMatrix::Q4(Q4 {
            packed: &dp,
            scale: &ds,
            min: &dm,
        });
        let (x, ids, w) = inputs(s, 9);
        let mut out = vec![Bf16::from_f32(0.0); s.rows * s.hidden];
        moe_experts(
            &mut out,
            &bf16s(&x),
            &ids,
            &w,
            Experts::Quant(gu),
            Experts::Quant(dn),
            Activation::SiluMul,
            s,
            2,
            &ScopedThreads,
        )
        .unwrap();
        let want = reference(
            &x,
            &ids,
            &w,
            |row, k| f64::from(gu.weight(row, k, s.hidden)),
            |row, c| f64::from(dn.weight(row, c, s.inter)),
            s,
        );
        close(&out, &want, 0.03);
    }

    #[test]
    fn mxfp4_experts_with_biases_and_the_clamped_swiglu_match_the_float64_reference() {
        let s = shape(3);
        let (alpha, limit) = (1.702f32, 1.5f32);
        let mut r = rng(17);
        // Codes of every value; exponents 2^-6 .. 2^-4, so that some gate/up outputs are
        // clamped and some not.
        let mx = |n: usize, k: usize, r: &mut dyn FnMut() -> f32| {
            let packed: Vec<u8> = (0..n * k / 2).map(|_| (r().abs() * 255.0) as u8).collect();
            let scale: Vec<u8> = (0..n * k / 32)
                .map(|_| 121 + (r().abs() * 2.9) as u8)
                .collect();
            (packed, scale)
        };
        let (gp, gs) = mx(s.experts * 2 * s.inter, s.hidden, &mut r);
        let (dp, ds) = mx(s.experts * s.hidden, s.inter, &mut r);
        let (gm, dm) = (
            Mxfp4 {
                packed: &gp,
                scale: &gs,
            },
            Mxfp4 {
                packed: &dp,
                scale: &ds,
            },
        );
        let gb: Vec<Bf16> = (0..s.experts * 2 * s.inter)
            .map(|_| Bf16::from_f32(r()))
            .collect();
        let db: Vec<Bf16> = (0..s.experts * s.hidden)
            .map(|_| Bf16::from_f32(r()))
            .collect();
        let (x, ids, w) = inputs(s, 21);
        let mut out = vec![Bf16::from_f32(0.0); s.rows * s.hidden];
        let extras = ExpertExtras {
            activation: ExpertActivation::ClampedSwiglu { alpha, limit },
            gate_up_bias: Some(&gb),
            down_bias: Some(&db),
        };
        moe_experts_with(
            &mut out,
            &bf16s(&x),
            &ids,
            &w,
            Experts::Mxfp4(gm),
            Experts::Mxfp4(dm),
            extras,
            s,
            2,
            &ScopedThreads,
        )
        .unwrap();
        let (h, i_) = (s.hidden, s.inter);
        let mut want = vec![0f64; s.rows * h];
        for row in 0..s.rows {
            for j in 0..s.top_k {
                let e = ids[row * s.top_k + j] as usize;
                let gu = |c: usize| -> f64 {
                    let n = e * 2 * i_ + c;
                    (0..h)
                        .map(|k| f64::from(x[row * h + k]) * f64::from(gm.weight(n, k, h)))
                        .sum::<f64>()
                        + f64::from(gb[n].to_f32())
                };
                let act: Vec<f64> = (0..i_)
                    .map(|c| {
                        let g = gu(c).min(f64::from(limit));
                        let u = gu(i_ + c).clamp(-f64::from(limit), f64::from(limit));
                        (u + 1.0) * g / (1.0 + (-f64::from(alpha) * g).exp())
                    })
                    .collect();
                for o in 0..h {
                    let d: f64 = (0..i_)
                        .map(|c| act[c] * f64::from(dm.weight(e * h + o, c, i_)))
                        .sum::<f64>()
                        + f64::from(db[e * h + o].to_f32());
                    want[row * h + o] += f64::from(w[row * s.top_k + j]) * d;
                }
            }
        }
        // bf16 rounding of the gate/up outputs and of each step of the activation.
        close(&out, &want, 0.05);
    }

    #[test]
    fn bad_expert_ids_and_shapes_are_errors() {
        let s = shape(1);
        let gu = vec![Bf16::from_f32(0.0); s.experts * 2 * s.inter * s.hidden];
        let dn = vec![Bf16::from_f32(0.0); s.experts * s.hidden * s.inter];
        let x = vec![Bf16::from_f32(0.0); s.hidden];
        let mut out = x.clone();
        let run = |ids: &[i32], out: &mut [Bf16], sh: MoeShape| {
            moe_experts(
                out,
                &x,
                ids,
                &[0.5, 0.5],
                Experts::Bf16(&gu),
                Experts::Bf16(&dn),
                Activation::SiluMul,
                sh,
                1,
                &ScopedThreads,
            )
        };
        assert!(run(&[0, 6], &mut out, s).is_err());
        assert!(run(&[0, -1], &mut out, s).is_err());
        // Buffers of one row called for two, or for none.
        assert!(run(&[0, 1], &mut out, MoeShape { rows: 2, ..s }).is_err());
        assert!(run(&[], &mut out, MoeShape { rows: 0, ..s }).is_err());
        assert!(run(&[0, 1], &mut out, s).is_ok());
    }
}
