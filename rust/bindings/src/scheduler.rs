//! `Scheduler` and `SchedulerConfig` for Python: a thin, thread-safe wrapper over the core.
//!
//! The core sits behind a mutex so the engine thread and, say, a metrics handler on the
//! server's thread can both use one scheduler. The lock is only ever held for pure Rust
//! work or with the GIL already held, never while waiting for the GIL, so it cannot
//! deadlock against it.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};

use iron_batch_core as core;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyString};

use crate::batch::Batch;
use crate::convert::token_ids;
use crate::errors::{alloc_err, new_err, sched_err, Kind};
use crate::events::StepEvents;

/// One cache group: `kind` is "full", "sliding" (with `window`) or "state"; `size` is its
/// pool in blocks (attention) or state slots; `unit_bytes` the bytes of one block or slot.
#[pyclass(module = "iron_batch._core", get_all, eq, frozen, from_py_object)]
#[derive(Clone, PartialEq)]
pub struct CacheGroup {
    pub kind: String,
    pub size: usize,
    pub window: Option<usize>,
    pub unit_bytes: usize,
}

#[pymethods]
impl CacheGroup {
    #[new]
    #[pyo3(signature = (kind, size, window = None, unit_bytes = 0))]
    fn new(kind: &str, size: usize, window: Option<usize>, unit_bytes: usize) -> PyResult<Self> {
        let g = CacheGroup {
            kind: kind.to_string(),
            size,
            window,
            unit_bytes,
        };
        g.to_core()?;
        Ok(g)
    }

    fn __repr__(&self) -> String {
        let window = self
            .window
            .map_or_else(String::new, |w| format!(", window={w}"));
        format!(
            "CacheGroup({:?}, size={}{window}, unit_bytes={})",
            self.kind, self.size, self.unit_bytes
        )
    }
}

impl CacheGroup {
    fn to_core(&self) -> PyResult<core::CacheGroup> {
        let kind = match (self.kind.as_str(), self.window) {
            ("full", None) => core::CacheKind::Full,
            ("sliding", Some(window)) => core::CacheKind::Sliding { window },
            ("state", None) => core::CacheKind::State,
            ("sliding", None) => {
                return Err(pyo3::exceptions::PyValueError::new_err(
                    "a sliding cache group needs a window",
                ))
            }
            ("full" | "state", Some(_)) => {
                return Err(pyo3::exceptions::PyValueError::new_err(format!(
                    "a {} cache group has no window",
                    self.kind
                )))
            }
            (other, _) => {
                return Err(pyo3::exceptions::PyValueError::new_err(format!(
                    "unknown cache group kind {other:?} (full, sliding or state)"
                )))
            }
        };
        Ok(core::CacheGroup {
            kind,
            size: self.size,
            unit_bytes: self.unit_bytes,
        })
    }

    pub fn from_core(g: &core::CacheGroup) -> Self {
        let (kind, window) = match g.kind {
            core::CacheKind::Full => ("full", None),
            core::CacheKind::Sliding { window } => ("sliding", Some(window)),
            core::CacheKind::State => ("state", None),
        };
        CacheGroup {
            kind: kind.to_string(),
            size: g.size,
            window,
            unit_bytes: g.unit_bytes,
        }
    }
}

/// Split `pool_bytes` between groups described by (kind, window or None, bytes per token
/// or per state slot), as the core's `split_pool` does.
#[pyfunction]
#[pyo3(signature = (pool_bytes, groups, kv_block_size, max_running_seqs, context, chunk))]
pub fn split_pool(
    pool_bytes: usize,
    groups: Vec<(String, Option<usize>, usize)>,
    kv_block_size: usize,
    max_running_seqs: usize,
    context: usize,
    chunk: usize,
) -> PyResult<Vec<CacheGroup>> {
    let specs = groups
        .iter()
        .map(|(kind, window, bytes)| {
            let g = CacheGroup {
                kind: kind.clone(),
                size: 1,
                window: *window,
                unit_bytes: 0,
            };
            Ok(core::GroupSpec {
                kind: g.to_core()?.kind,
                bytes: *bytes,
            })
        })
        .collect::<PyResult<Vec<_>>>()?;
    if kv_block_size == 0 {
        return Err(pyo3::exceptions::PyValueError::new_err(
            "kv_block_size must be at least 1",
        ));
    }
    Ok(core::split_pool(
        pool_bytes,
        &specs,
        kv_block_size,
        max_running_seqs,
        context,
        chunk,
    )
    .iter()
    .map(CacheGroup::from_core)
    .collect())
}

#[pyclass(module = "iron_batch._core", get_all, set_all, eq, from_py_object)]
#[derive(Clone, PartialEq)]
pub struct SchedulerConfig {
    pub total_kv_blocks: usize,
    pub kv_block_size: usize,
    pub max_batch_tokens: usize,
    pub max_running_seqs: usize,
    pub enable_prefix_caching: bool,
    pub max_model_len: Option<usize>,
    pub cache_groups: Vec<CacheGroup>,
    pub state_checkpoint_interval: usize,
    pub num_speculative_tokens: usize,
    pub speculative_max_rows: usize,
    pub speculative_method: String,
    pub speculative_ngram_min: usize,
    pub speculative_ngram_max: usize,
}

#[pymethods]
impl SchedulerConfig {
    #[new]
    #[pyo3(signature = (total_kv_blocks = 4096, kv_block_size = 16, max_batch_tokens = 8192,
                        max_running_seqs = 256, enable_prefix_caching = true,
                        max_model_len = None, cache_groups = Vec::new(),
                        state_checkpoint_interval = 0, *, num_speculative_tokens = 0,
                        speculative_max_rows = 8, speculative_ngram_min = 2,
                        speculative_ngram_max = 4, speculative_method = "ngram".to_string()))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        total_kv_blocks: usize,
        kv_block_size: usize,
        max_batch_tokens: usize,
        max_running_seqs: usize,
        enable_prefix_caching: bool,
        max_model_len: Option<usize>,
        cache_groups: Vec<CacheGroup>,
        state_checkpoint_interval: usize,
        num_speculative_tokens: usize,
        speculative_max_rows: usize,
        speculative_ngram_min: usize,
        speculative_ngram_max: usize,
        speculative_method: String,
    ) -> Self {
        SchedulerConfig {
            total_kv_blocks,
            kv_block_size,
            max_batch_tokens,
            max_running_seqs,
            enable_prefix_caching,
            max_model_len,
            cache_groups,
            state_checkpoint_interval,
            num_speculative_tokens,
            speculative_max_rows,
            speculative_method,
            speculative_ngram_min,
            speculative_ngram_max,
        }
    }

    fn __repr__(&self) -> String {
        let groups = if self.cache_groups.is_empty() {
            String::new()
        } else {
            let each: Vec<String> = self.cache_groups.iter().map(CacheGroup::__repr__).collect();
            format!(
                ", cache_groups=[{}], state_checkpoint_interval={}",
                each.join(", "),
                self.state_checkpoint_interval
            )
        };
        format!(
            "SchedulerConfig(total_kv_blocks={}, kv_block_size={}, max_batch_tokens={}, \
             max_running_seqs={}, enable_prefix_caching={}, max_model_len={}{groups})",
            self.total_kv_blocks,
            self.kv_block_size,
            self.max_batch_tokens,
            self.max_running_seqs,
            if self.enable_prefix_caching {
                "True"
            } else {
                "False"
            },
            self.max_model_len
                .map_or_else(|| "None".to_string(), |m| m.to_string())
        )
    }
}

impl SchedulerConfig {
    fn to_core(&self) -> PyResult<core::SchedulerConfig> {
        Ok(core::SchedulerConfig {
            total_kv_blocks: self.total_kv_blocks,
            kv_block_size: self.kv_block_size,
            max_batch_tokens: self.max_batch_tokens,
            max_running_seqs: self.max_running_seqs,
            enable_prefix_caching: self.enable_prefix_caching,
            max_model_len: self.max_model_len,
            cache_groups: self
                .cache_groups
                .iter()
                .map(CacheGroup::to_core)
                .collect::<PyResult<_>>()?,
            state_checkpoint_interval: self.state_checkpoint_interval,
            num_speculative_tokens: self.num_speculative_tokens,
            speculative_max_rows: self.speculative_max_rows,
            speculative_method: core::SpeculativeMethod::parse(&self.speculative_method)
                .ok_or_else(|| {
                    pyo3::exceptions::PyValueError::new_err(format!(
                        "speculative_method must be \"ngram\" or \"draft\", got {:?}",
                        self.speculative_method
                    ))
                })?,
            speculative_ngram_min: self.speculative_ngram_min,
            speculative_ngram_max: self.speculative_ngram_max,
        })
    }
}

struct Inner {
    core: core::Scheduler,
    /// Python id of the request in each core slot, made once at `add_request`. The core
    /// reuses a slot only from the `schedule` after its request ended, so this names every
    /// row of the latest batch and every event of its commit.
    py_ids: Vec<Option<Py<PyString>>>,
}

static NEXT_OWNER: AtomicUsize = AtomicUsize::new(1);

#[pyclass(module = "iron_batch._core", frozen)]
pub struct Scheduler {
    inner: Mutex<Inner>,
    config: SchedulerConfig,
    owner: usize,
}

impl Scheduler {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

fn lookup_id(py: Python<'_>, inner: &Inner, slot: usize) -> Py<PyString> {
    match inner.py_ids.get(slot) {
        Some(Some(s)) => s.clone_ref(py),
        _ => PyString::new(py, inner.core.request_id(slot)).unbind(),
    }
}

#[pymethods]
impl Scheduler {
    #[new]
    fn new(config: SchedulerConfig) -> PyResult<Self> {
        let core = core::Scheduler::new(config.to_core()?).map_err(|e| {
            pyo3::exceptions::PyValueError::new_err(e.to_string().replace("request rejected: ", ""))
        })?;
        Ok(Scheduler {
            inner: Mutex::new(Inner {
                core,
                py_ids: Vec::new(),
            }),
            config,
            owner: NEXT_OWNER.fetch_add(1, Ordering::Relaxed),
        })
    }

    #[getter]
    fn config(&self) -> SchedulerConfig {
        self.config.clone()
    }

    #[pyo3(signature = (request_id, prompt_token_ids, max_new_tokens, stop_token_ids = None,
                        *, priority = 0, cache_salt = None, skip_prefix_cache = false,
                        speculate = true))]
    #[allow(clippy::too_many_arguments)]
    fn add_request(
        &self,
        request_id: &Bound<'_, PyString>,
        prompt_token_ids: &Bound<'_, PyAny>,
        max_new_tokens: i64,
        stop_token_ids: Option<&Bound<'_, PyAny>>,
        priority: i64,
        cache_salt: Option<&str>,
        skip_prefix_cache: bool,
        speculate: bool,
    ) -> PyResult<usize> {
        let prompt = token_ids(prompt_token_ids, "prompt_token_ids")?;
        let stops = match stop_token_ids {
            Some(s) => token_ids(s, "stop_token_ids")?,
            None => Vec::new(),
        };
        let max_new = usize::try_from(max_new_tokens).map_err(|_| {
            new_err(
                Kind::Rejected,
                "max_new_tokens must be non-negative".to_string(),
            )
        })?;
        let id = request_id.to_str()?;
        let mut inner = self.lock();
        let slot = inner
            .core
            .add_request_with(
                id,
                &prompt,
                max_new,
                &stops,
                &core::RequestOptions {
                    priority,
                    cache_salt: cache_salt.map(|c| c.as_bytes().to_vec()),
                    skip_prefix_cache,
                    no_speculation: !speculate,
                },
            )
            .map_err(sched_err)?;
        if inner.py_ids.len() <= slot {
            inner.py_ids.resize_with(slot + 1, || None);
        }
        inner.py_ids[slot] = Some(request_id.clone().unbind());
        Ok(slot)
    }

    /// Plan the next step. The core work runs without the GIL. With `overlap`, steps
    /// scheduled before and not yet committed stay open (see the core's
    /// `schedule_overlapped`); without it they are discarded.
    #[pyo3(signature = (lookahead = 0, *, overlap = false))]
    fn schedule(&self, py: Python<'_>, lookahead: usize, overlap: bool) -> PyResult<Batch> {
        let batch = py.detach(|| {
            let core = &mut self.lock().core;
            if overlap {
                core.schedule_overlapped(lookahead)
            } else {
                Ok(core.schedule_lookahead(lookahead))
            }
        });
        let batch = batch.map_err(sched_err)?;
        let ids = {
            let inner = self.lock();
            batch
                .entries
                .iter()
                .map(|e| lookup_id(py, &inner, e.slot))
                .collect()
        };
        Batch::new(py, batch, ids, self.owner)
    }

    /// Apply one sampled token per sample row; returns the step's events as columns
    /// (`StepEvents`: handles, token ids, finish-reason codes). With `num_accepted` (one
    /// count per sample row), `sampled` is the accepted tokens of every row in turn (see
    /// the core's `commit_accepted`).
    #[pyo3(signature = (batch, sampled, num_accepted = None))]
    fn commit(
        &self,
        py: Python<'_>,
        batch: &Batch,
        sampled: &Bound<'_, PyAny>,
        num_accepted: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<StepEvents> {
        if batch.owner != self.owner {
            return Err(new_err(
                Kind::BatchMismatch,
                "the batch was scheduled by another Scheduler".to_string(),
            ));
        }
        let inner = &mut *self.lock();
        let events = if let Some(counts) = num_accepted {
            let counts: Vec<usize> = token_ids(counts, "num_accepted")?
                .into_iter()
                .map(|c| c as usize)
                .collect();
            let tokens = token_ids(sampled, "sampled")?;
            inner.core.commit_accepted(&batch.core, &tokens, &counts)
        } else {
            let (sampled, steps) = crate::convert::token_matrix(sampled, "sampled")?;
            inner.core.commit_steps(&batch.core, &sampled, steps)
        }
        .map_err(sched_err)?;
        let ids = events
            .iter()
            .map(|e| lookup_id(py, inner, e.slot))
            .collect();
        Ok(StepEvents::new(
            py,
            core::StepEvents::from(&events[..]),
            ids,
        ))
    }

    fn abort(&self, request_id: &str) -> bool {
        self.lock().core.abort(request_id)
    }

    /// End a live request now (its caller reports why, e.g. a stop string matched):
    /// its blocks are freed and no event is emitted for it.
    fn finish(&self, request_id: &str) -> bool {
        self.lock().core.finish(request_id)
    }

    fn has_work(&self) -> bool {
        self.lock().core.has_work()
    }

    fn is_live(&self, request_id: &str) -> bool {
        self.lock().core.is_live(request_id)
    }

    fn output_token_ids(&self, request_id: &str) -> PyResult<Vec<u32>> {
        match self.lock().core.sequence(request_id) {
            Some(seq) => Ok(seq.output().to_vec()),
            None => Err(new_err(
                Kind::Unknown,
                format!("unknown request {request_id:?}"),
            )),
        }
    }

    fn num_cached_prompt_tokens(&self, request_id: &str) -> PyResult<usize> {
        match self.lock().core.sequence(request_id) {
            Some(seq) => Ok(seq.num_cached_prompt.unwrap_or(0)),
            None => Err(new_err(
                Kind::Unknown,
                format!("unknown request {request_id:?}"),
            )),
        }
    }

    #[getter]
    fn num_running(&self) -> usize {
        self.lock().core.num_running()
    }

    #[getter]
    fn num_waiting(&self) -> usize {
        self.lock().core.num_waiting()
    }

    /// Steps scheduled and not committed yet.
    #[getter]
    fn num_open_steps(&self) -> usize {
        self.lock().core.num_open_steps()
    }

    #[getter]
    fn num_free_blocks(&self) -> usize {
        self.lock().core.allocator().num_free()
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let inner = self.lock();
        let a = inner.core.allocator();
        let s = inner.core.stats();
        let d = PyDict::new(py);
        d.set_item("total_blocks", a.total())?;
        d.set_item("free_blocks", a.num_free())?;
        d.set_item("used_blocks", a.num_used())?;
        d.set_item("cached_blocks", a.num_cached())?;
        d.set_item("running", inner.core.num_running())?;
        d.set_item("waiting", inner.core.num_waiting())?;
        d.set_item("preemptions", s.preemptions)?;
        d.set_item("prefix_cache_queries", s.prefix_cache_queries)?;
        d.set_item("prefix_cache_query_tokens", s.prefix_cache_query_tokens)?;
        d.set_item("prefix_cache_hit_tokens", s.prefix_cache_hit_tokens)?;
        d.set_item("requests_added", s.requests_added)?;
        d.set_item("requests_finished", s.requests_finished)?;
        d.set_item("requests_aborted", s.requests_aborted)?;
        d.set_item("sliding_blocks_released", s.sliding_blocks_released)?;
        d.set_item("state_checkpoints_saved", s.state_checkpoints_saved)?;
        d.set_item("state_checkpoint_hits", s.state_checkpoint_hits)?;
        d.set_item("spec_rows", s.spec_rows)?;
        d.set_item("spec_drafted_tokens", s.spec_drafted_tokens)?;
        d.set_item("spec_accepted_tokens", s.spec_accepted_tokens)?;
        Ok(d)
    }

    /// Each cache group's pool: kind, window, total, used, free, cached (blocks or state
    /// slots) and unit_bytes, in config order (one full group without cache groups).
    fn group_stats<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let inner = self.lock();
        inner
            .core
            .group_usage()
            .iter()
            .map(|u| {
                let g = CacheGroup::from_core(&u.group);
                let d = PyDict::new(py);
                d.set_item("kind", g.kind)?;
                d.set_item("window", g.window)?;
                d.set_item("total", u.total)?;
                d.set_item("used", u.used)?;
                d.set_item("free", u.free)?;
                d.set_item("cached", u.cached)?;
                d.set_item("unit_bytes", g.unit_bytes)?;
                Ok(d)
            })
            .collect()
    }

    fn check_invariants(&self) -> PyResult<()> {
        self.lock().core.check_invariants().map_err(alloc_err)
    }

    fn __repr__(&self) -> String {
        let inner = self.lock();
        format!(
            "Scheduler(running={}, waiting={}, free_blocks={}/{})",
            inner.core.num_running(),
            inner.core.num_waiting(),
            inner.core.allocator().num_free(),
            inner.core.allocator().total()
        )
    }
}
