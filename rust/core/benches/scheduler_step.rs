//! Scheduler cost per engine step (schedule + commit), no model and no Python.
//! Steady state: every sequence decodes; a finished one is replaced by a new request, so
//! the cost of finishing and admitting is included at its natural rate.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use iron_batch_core::{CacheGroup, Scheduler, SchedulerConfig};

struct Steady {
    s: Scheduler,
    next_id: usize,
    prompt: Vec<u32>,
    sampled: Vec<u32>,
    /// Prompt tokens of one new request added each step (0: decode only).
    prefill_per_step: usize,
}

impl Steady {
    fn new(running: usize, prefill_per_step: usize) -> Self {
        Self::with_groups(running, prefill_per_step, Vec::new())
    }

    /// As `new` with these cache groups (their sizes set to the one-group pool).
    fn with_groups(running: usize, prefill_per_step: usize, mut groups: Vec<CacheGroup>) -> Self {
        for g in &mut groups {
            g.size = running * 20 + 256;
        }
        let cfg = SchedulerConfig {
            cache_groups: groups,
            total_kv_blocks: running * 20 + 256,
            kv_block_size: 16,
            max_batch_tokens: 8192,
            max_running_seqs: running + 1,
            enable_prefix_caching: true,
            max_model_len: None,
            ..Default::default()
        };
        let mut w = Steady {
            s: Scheduler::new(cfg).unwrap(),
            next_id: 0,
            prompt: (0..16).collect(),
            sampled: Vec::new(),
            prefill_per_step,
        };
        for i in 0..running {
            // Staggered lengths so finishes spread evenly over steps.
            w.add(64 + (i * 7) % 192);
        }
        for _ in 0..300 {
            w.step();
        }
        w
    }

    fn add(&mut self, max_new: usize) {
        let id = format!("req-{}", self.next_id);
        self.next_id += 1;
        self.prompt[0] = self.next_id as u32; // distinct prompts: no accidental cache hits
        self.s.add_request(&id, &self.prompt, max_new, &[]).unwrap();
    }

    fn step(&mut self) {
        if self.prefill_per_step > 0 {
            let p: Vec<u32> = (0..self.prefill_per_step as u32)
                .map(|t| t ^ self.next_id as u32)
                .collect();
            let id = format!("pre-{}", self.next_id);
            self.next_id += 1;
            self.s.add_request(&id, &p, 1, &[]).unwrap();
        }
        let b = self.s.schedule();
        self.sampled.clear();
        self.sampled.resize(b.num_samples(), 7);
        let events = self.s.commit(&b, &self.sampled).unwrap();
        let done = events
            .iter()
            .filter(|e| e.finish.is_some() && self.s.request_id(e.slot).starts_with("req"))
            .count();
        for _ in 0..done {
            self.add(192);
        }
    }
}

fn scheduler_step(c: &mut Criterion) {
    let mut g = c.benchmark_group("scheduler_step");
    for running in [16usize, 256, 1024] {
        let mut w = Steady::new(running, 0);
        g.throughput(Throughput::Elements(running as u64));
        g.bench_with_input(BenchmarkId::new("decode", running), &running, |b, _| {
            b.iter(|| w.step())
        });
    }
    // Two groups: a sliding window of 64 tokens (so blocks are released as sequences pass
    // it: sequences reach 16 + 192 tokens) beside a full group; the same workload.
    let two = || vec![CacheGroup::sliding(64, 0), CacheGroup::full(0)];
    let mut w = Steady::with_groups(256, 0, two());
    g.throughput(Throughput::Elements(256));
    g.bench_function("decode_two_groups/256", |b| b.iter(|| w.step()));
    let mut w = Steady::new(256, 512);
    g.throughput(Throughput::Elements(257));
    g.bench_function("mixed_256_decode_plus_512_prefill", |b| b.iter(|| w.step()));
    g.finish();
}

criterion_group!(benches, scheduler_step);
criterion_main!(benches);
