//! A mixture-of-experts router's choice for each row: the softmax of the row's router
//! logits in f32, the `top_k` experts picked as `torch.topk` picks them on the CPU, and
//! their weights (renormalised over the chosen ones where the family says so).
//!
//! Which experts tie at the k-th place is decided by where `torch.topk` puts them, since
//! transformers' MoE blocks call it: bf16 router logits tie often (eight bits of
//! mantissa), so a lowest-index rule would route rows elsewhere than transformers does.
//! torch's CPU top-k (`TopKImpl.h`) fills a queue of (value, index) pairs in index order
//! and, where `k * 64 > experts`, runs libstdc++'s `std::nth_element` over it with a
//! comparator on the values alone (NaN first); the chosen experts are the queue's first
//! `k` after it. [`select_top_k`] runs the same introselect (median-of-three pivot,
//! unguarded Hoare partition, insertion sort below four elements), so equal values end in
//! the same places. Where its depth limit runs out (a pattern that needs adversarial
//! input), libstdc++ switches to a heap select, which this kernel does not reproduce: it
//! then picks the `k` largest with the lowest index first among equals. Routers with
//! `k * 64 <= experts` (torch's partial-sort branch) are refused by [`route`].
//!
//! The chosen experts are listed in descending weight (equal ones in the queue's order,
//! as torch's insertion sort of the first `k - 1` leaves them); the experts kernel sums
//! them in expert order, so only the set and the weights matter downstream.

use crate::attention::KernelError;
use crate::decoder::exp;
use crate::element::{Bf16, Element};

/// How a layer's router turns logits into expert weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Routing {
    pub top_k: usize,
    /// The chosen weights are divided by their sum (`norm_topk_prob`).
    pub renormalize: bool,
    /// The weights stay f32 (Mixtral's); else they are rounded to bf16 (the Qwen MoEs').
    pub weights_in_float: bool,
}

impl Routing {
    /// Whether [`route`] reproduces torch's choice for `experts` experts.
    pub fn supports(&self, experts: usize) -> bool {
        self.top_k > 0 && self.top_k <= experts && self.top_k * 64 > experts
    }
}

/// torch's comparator for the largest values: NaN before any number, then `>`.
fn before(a: f32, b: f32) -> bool {
    (a.is_nan() && !b.is_nan()) || a > b
}

type Entry = (f32, i32);

fn less(a: &Entry, b: &Entry) -> bool {
    before(a.0, b.0)
}

/// Moves the median of `q[a]`, `q[b]`, `q[c]` (under [`less`]) to `q[result]`.
fn move_median_to_first(q: &mut [Entry], result: usize, a: usize, b: usize, c: usize) {
    let pick = if less(&q[a], &q[b]) {
        if less(&q[b], &q[c]) {
            b
        } else if less(&q[a], &q[c]) {
            c
        } else {
            a
        }
    } else if less(&q[a], &q[c]) {
        a
    } else if less(&q[b], &q[c]) {
        c
    } else {
        b
    };
    q.swap(result, pick);
}

/// Hoare partition of `q[first..last]` around the pivot at `q[pivot]` (outside the
/// range), without bounds checks in the scans: the pivot's neighbours stop them.
fn unguarded_partition(q: &mut [Entry], mut first: usize, mut last: usize, pivot: usize) -> usize {
    loop {
        while less(&q[first], &q[pivot]) {
            first += 1;
        }
        last -= 1;
        while less(&q[pivot], &q[last]) {
            last -= 1;
        }
        if first >= last {
            return first;
        }
        q.swap(first, last);
        first += 1;
    }
}

fn insertion_sort(q: &mut [Entry]) {
    for i in 1..q.len() {
        let v = q[i];
        if less(&v, &q[0]) {
            q.copy_within(0..i, 1);
            q[0] = v;
        } else {
            let mut j = i;
            while less(&v, &q[j - 1]) {
                q[j] = q[j - 1];
                j -= 1;
            }
            q[j] = v;
        }
    }
}

/// Reorders `q` so that its first `k` entries are the `k` first under [`less`], placed
/// where libstdc++'s `nth_element(q, q + k - 1, ..)` places them (see the module docs);
/// then sorts the first `k - 1` as torch does. Returns false where the depth limit ran
/// out and the lowest-index rule chose instead.
pub fn select_top_k(q: &mut [Entry], k: usize) -> bool {
    let n = q.len();
    if k == 0 || n == 0 || k > n {
        return true;
    }
    let nth = k - 1;
    let (mut first, mut last) = (0usize, n);
    let mut depth = 2 * (usize::BITS - 1 - n.leading_zeros()) as usize;
    let mut exact = true;
    while last - first > 3 {
        if depth == 0 {
            // libstdc++ would heap-select here: take the lowest-index rule instead.
            q[first..last].sort_by(|a, b| {
                if less(a, b) {
                    std::cmp::Ordering::Less
                } else if less(b, a) {
                    std::cmp::Ordering::Greater
                } else {
                    a.1.cmp(&b.1)
                }
            });
            exact = false;
            break;
        }
        depth -= 1;
        let mid = first + (last - first) / 2;
        move_median_to_first(q, first, first + 1, mid, last - 1);
        let cut = unguarded_partition(q, first + 1, last, first);
        if cut <= nth {
            first = cut;
        } else {
            last = cut;
        }
    }
    if exact {
        insertion_sort(&mut q[first..last]);
    }
    insertion_sort(&mut q[..nth]);
    exact
}

/// Routes each of `rows` rows: `logits` `[rows, experts]` bf16 in, `ids` (i32) and
/// `weights` (f32; bf16 values unless `routing.weights_in_float`) `[rows, top_k]` out.
pub fn route(
    ids: &mut [i32],
    weights: &mut [f32],
    logits: &[Bf16],
    rows: usize,
    experts: usize,
    routing: Routing,
) -> Result<(), KernelError> {
    let k = routing.top_k;
    if !routing.supports(experts) {
        return Err(KernelError(format!(
            "route: top {k} of {experts} experts (torch sorts k * 64 <= experts another way)"
        )));
    }
    if logits.len() != rows * experts || ids.len() != rows * k || weights.len() != rows * k {
        return Err(KernelError(format!(
            "route: buffers do not fit {rows} rows of {experts} experts, top {k}"
        )));
    }
    let mut queue: Vec<Entry> = Vec::with_capacity(experts);
    for ((row, ids), weights) in logits
        .chunks_exact(experts)
        .zip(ids.chunks_exact_mut(k))
        .zip(weights.chunks_exact_mut(k))
    {
        let max = row
            .iter()
            .map(|v| v.to_f32())
            .fold(f32::NEG_INFINITY, f32::max);
        queue.clear();
        let mut sum = 0f32;
        for (e, v) in row.iter().enumerate() {
            let p = exp(v.to_f32() - max);
            sum += p;
            queue.push((p, e as i32));
        }
        for entry in queue.iter_mut() {
            entry.0 /= sum;
        }
        select_top_k(&mut queue, k);
        let chosen = &queue[..k];
        let total: f32 = chosen.iter().map(|e| e.0).sum();
        for ((id, w), &(p, e)) in ids.iter_mut().zip(weights.iter_mut()).zip(chosen) {
            *id = e;
            let v = if routing.renormalize { p / total } else { p };
            *w = if routing.weights_in_float {
                v
            } else {
                Bf16::from_f32(v).to_f32()
            };
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn queue(values: &[f32]) -> Vec<Entry> {
        values
            .iter()
            .enumerate()
            .map(|(i, &v)| (v, i as i32))
            .collect()
    }

    #[test]
    fn picks_the_largest_values_first() {
        let mut q = queue(&[0.1, 0.7, 0.3, 0.9, 0.2, 0.5, 0.4, 0.8]);
        assert!(select_top_k(&mut q, 3));
        let ids: Vec<i32> = q[..3].iter().map(|e| e.1).collect();
        assert_eq!(ids, vec![3, 7, 1]);
    }

    #[test]
    fn every_k_selects_a_valid_top_set_on_ties() {
        // Values from three levels over many experts: whatever the tie order, the chosen
        // values are the k largest.
        for n in [4usize, 8, 60, 64, 128, 256] {
            for k in 1..=8.min(n) {
                let values: Vec<f32> = (0..n).map(|i| ((i * 7919) % 3) as f32).collect();
                let mut q = queue(&values);
                select_top_k(&mut q, k);
                let mut sorted = values.clone();
                sorted.sort_by(|a, b| b.partial_cmp(a).unwrap());
                let mut got: Vec<f32> = q[..k].iter().map(|e| e.0).collect();
                got.sort_by(|a, b| b.partial_cmp(a).unwrap());
                assert_eq!(got, sorted[..k].to_vec(), "n {n} k {k}");
                let mut ids: Vec<i32> = q.iter().map(|e| e.1).collect();
                ids.sort();
                assert_eq!(ids, (0..n as i32).collect::<Vec<_>>());
            }
        }
    }

    #[test]
    fn weights_are_the_renormalised_softmax() {
        let logits: Vec<Bf16> = [1.0f32, 3.0, 2.0, 0.0]
            .iter()
            .map(|&v| Bf16::from_f32(v))
            .collect();
        let (mut ids, mut w) = (vec![0; 2], vec![0.0; 2]);
        let routing = Routing {
            top_k: 2,
            renormalize: true,
            weights_in_float: true,
        };
        route(&mut ids, &mut w, &logits, 1, 4, routing).unwrap();
        assert_eq!(ids, vec![1, 2]);
        let e = 1f32.exp();
        assert!((w[0] - e / (e + 1.0)).abs() < 1e-6);
        assert!((w[1] - 1.0 / (e + 1.0)).abs() < 1e-6);
    }

    #[test]
    fn refuses_what_torch_sorts_another_way() {
        let logits = vec![Bf16::from_f32(0.0); 64];
        let routing = Routing {
            top_k: 1,
            renormalize: false,
            weights_in_float: false,
        };
        let err = route(&mut [0], &mut [0.0], &logits, 1, 64, routing);
        assert!(err.is_err());
    }
}
