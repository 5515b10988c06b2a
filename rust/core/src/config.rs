//! Scheduler limits and the model's cache groups.

/// How a group of layers keeps its cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheKind {
    /// K and V of every token, in paged blocks.
    Full,
    /// K and V of the last `window` tokens: position `p` attends to `p - window + 1 ..= p`,
    /// so blocks wholly before that are released as the sequence advances.
    Sliding { window: usize },
    /// One fixed-size state per sequence (linear attention, Mamba), whatever its length,
    /// in a pool of slots; checkpoints of it at block-aligned positions serve prefix hits.
    State,
}

/// Layers with the same cache spec, and their share of the pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheGroup {
    pub kind: CacheKind,
    /// Pool size: blocks of `kv_block_size` tokens (attention groups) or state slots.
    pub size: usize,
    /// Bytes of one block (all the group's layers) or of one state slot: what the pool is
    /// split by (`split_pool`) and what the usage figures are reported in. 0 if unknown.
    pub unit_bytes: usize,
}

impl CacheGroup {
    pub fn full(blocks: usize) -> Self {
        CacheGroup {
            kind: CacheKind::Full,
            size: blocks,
            unit_bytes: 0,
        }
    }
    pub fn sliding(window: usize, blocks: usize) -> Self {
        CacheGroup {
            kind: CacheKind::Sliding { window },
            size: blocks,
            unit_bytes: 0,
        }
    }
    pub fn state(slots: usize) -> Self {
        CacheGroup {
            kind: CacheKind::State,
            size: slots,
            unit_bytes: 0,
        }
    }
    pub fn is_attention(&self) -> bool {
        !matches!(self.kind, CacheKind::State)
    }
    /// The window of a sliding group.
    pub fn window(&self) -> Option<usize> {
        match self.kind {
            CacheKind::Sliding { window } => Some(window),
            _ => None,
        }
    }
    /// Most blocks a sliding group holds for one sequence at once: the window before the
    /// first position a step computes, and the step's chunk (up to `chunk` tokens).
    pub fn sliding_peak_blocks(window: usize, chunk: usize, block_size: usize) -> usize {
        (window - 1 + chunk).div_ceil(block_size) + 1
    }
}

/// Where speculative proposals come from (`SchedulerConfig::speculative_method`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SpeculativeMethod {
    /// Prompt lookup (`NgramProposer`), in the core.
    #[default]
    Ngram,
    /// The backend's draft model: the core reserves the proposal rows
    /// (`DraftModelProposer`), the backend fills their tokens before the forward.
    DraftModel,
}

impl SpeculativeMethod {
    /// From its flag name: "ngram" or "draft".
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "ngram" => Some(SpeculativeMethod::Ngram),
            "draft" => Some(SpeculativeMethod::DraftModel),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            SpeculativeMethod::Ngram => "ngram",
            SpeculativeMethod::DraftModel => "draft",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// KV pool size in blocks (the one full-attention group when `cache_groups` is empty).
    pub total_kv_blocks: usize,
    /// Token slots per block.
    pub kv_block_size: usize,
    /// Tokens computed per step (prefill chunks plus decodes).
    pub max_batch_tokens: usize,
    /// Sequences in one step.
    pub max_running_seqs: usize,
    pub enable_prefix_caching: bool,
    /// Longest context the model accepts (prompt + output), if bounded.
    pub max_model_len: Option<usize>,
    /// The model's cache groups, each with its own pool. Empty: one full-attention group of
    /// `total_kv_blocks` blocks (and `total_kv_blocks` is otherwise unused).
    pub cache_groups: Vec<CacheGroup>,
    /// With a state group: besides the end of each prompt, save a state checkpoint every
    /// this many blocks (0: only at the end of prompts).
    pub state_checkpoint_interval: usize,
    /// Speculative decoding: the most tokens proposed (prompt lookup) and verified per
    /// decoding sequence per step (0: off). Each sequence adapts its own count below this.
    pub num_speculative_tokens: usize,
    /// Proposals are added to a step only while its query rows (one per running sequence
    /// plus the proposals so far) stay within this: past it the step is bound by compute,
    /// not by the weights read once per step, and an extra row costs about a token's time.
    /// The default, 8, is the most rows the CPU GEMVs read the weights once for, and the
    /// most a one-call decode step takes: there a verification row computes exactly what a
    /// one-row decode step computes, so greedy output does not change.
    pub speculative_max_rows: usize,
    /// Where proposals come from: prompt lookup in the core, or the backend's draft model
    /// (the core reserves the rows, the backend fills their tokens).
    pub speculative_method: SpeculativeMethod,
    /// The n-gram lengths prompt lookup matches, longest first.
    pub speculative_ngram_min: usize,
    pub speculative_ngram_max: usize,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            total_kv_blocks: 4096,
            kv_block_size: 16,
            max_batch_tokens: 8192,
            max_running_seqs: 256,
            enable_prefix_caching: true,
            max_model_len: None,
            cache_groups: Vec::new(),
            state_checkpoint_interval: 0,
            num_speculative_tokens: 0,
            speculative_max_rows: 8,
            speculative_method: SpeculativeMethod::Ngram,
            speculative_ngram_min: 2,
            speculative_ngram_max: 4,
        }
    }
}

impl SchedulerConfig {
    /// The cache groups in effect: `cache_groups`, or the one full group.
    pub fn groups(&self) -> Vec<CacheGroup> {
        if self.cache_groups.is_empty() {
            vec![CacheGroup::full(self.total_kv_blocks)]
        } else {
            self.cache_groups.clone()
        }
    }

    /// Describe the first unusable field.
    pub fn validate(&self) -> Result<(), String> {
        if self.total_kv_blocks == 0 {
            return Err("total_kv_blocks must be at least 1".into());
        }
        if self.total_kv_blocks >= u32::MAX as usize {
            return Err("total_kv_blocks must be below 2^32 - 1".into());
        }
        if self.kv_block_size == 0 || self.kv_block_size > 4096 {
            return Err("kv_block_size must be between 1 and 4096".into());
        }
        if self.max_batch_tokens == 0 {
            return Err("max_batch_tokens must be at least 1".into());
        }
        if self.max_running_seqs == 0 {
            return Err("max_running_seqs must be at least 1".into());
        }
        if self.max_model_len == Some(0) {
            return Err("max_model_len must be at least 1".into());
        }
        if self.num_speculative_tokens > 0 {
            if self.num_speculative_tokens > 64 {
                return Err("num_speculative_tokens must be at most 64".into());
            }
            if self.speculative_ngram_min == 0
                || self.speculative_ngram_min > self.speculative_ngram_max
            {
                return Err(
                    "speculative n-gram lengths need 1 <= speculative_ngram_min <= \
                     speculative_ngram_max"
                        .into(),
                );
            }
            if self.cache_groups.iter().any(|g| !g.is_attention()) {
                return Err("speculative decoding is not supported for models with a \
                            recurrent-state cache group (its state cannot be rolled back \
                            past rejected tokens)"
                    .into());
            }
        }
        let mut states = 0;
        for (g, group) in self.cache_groups.iter().enumerate() {
            if group.size == 0 || group.size >= u32::MAX as usize {
                return Err(format!(
                    "cache group {g}: size must be between 1 and 2^32 - 2"
                ));
            }
            match group.kind {
                CacheKind::Sliding { window: 0 } => {
                    return Err(format!(
                        "cache group {g}: sliding window must be at least 1"
                    ));
                }
                CacheKind::State => states += 1,
                _ => {}
            }
        }
        if states > 1 {
            return Err("at most one recurrent-state cache group".into());
        }
        if !self.cache_groups.is_empty() && self.cache_groups.iter().all(|g| !g.is_attention()) {
            return Err("the cache groups need at least one attention group".into());
        }
        Ok(())
    }
}

/// A group of layers before the pool is split: its kind and the bytes one token (attention)
/// or one sequence's state (recurrent) takes over all its layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupSpec {
    pub kind: CacheKind,
    pub bytes: usize,
}

/// Split a pool of `pool_bytes` between groups by bytes: a state group gets one slot per
/// running sequence plus as many again for checkpoints; the attention groups share the
/// rest in proportion to what one sequence of `context` tokens takes in each (all of it in
/// a full group, the window and a chunk of `chunk` tokens in a sliding one), so every group
/// runs out at about the same number of such sequences.
pub fn split_pool(
    pool_bytes: usize,
    specs: &[GroupSpec],
    block_size: usize,
    max_running_seqs: usize,
    context: usize,
    chunk: usize,
) -> Vec<CacheGroup> {
    let slots = 2 * max_running_seqs;
    let state_bytes: usize = specs
        .iter()
        .filter(|s| s.kind == CacheKind::State)
        .map(|s| s.bytes * slots)
        .sum();
    let rest = pool_bytes.saturating_sub(state_bytes) as f64;
    let blocks_per_seq = |k: CacheKind| -> usize {
        let all = context.div_ceil(block_size).max(1);
        match k {
            CacheKind::Full => all,
            CacheKind::Sliding { window } => {
                CacheGroup::sliding_peak_blocks(window, chunk.min(context).max(1), block_size)
                    .min(all)
            }
            CacheKind::State => 0,
        }
    };
    let per_seq: f64 = specs
        .iter()
        .map(|s| (s.bytes * block_size * blocks_per_seq(s.kind)) as f64)
        .sum();
    let seqs = if per_seq > 0.0 { rest / per_seq } else { 0.0 };
    specs
        .iter()
        .map(|s| CacheGroup {
            kind: s.kind,
            size: match s.kind {
                CacheKind::State => slots,
                k => ((seqs * blocks_per_seq(k) as f64) as usize).max(1),
            },
            unit_bytes: match s.kind {
                CacheKind::State => s.bytes,
                _ => s.bytes * block_size,
            },
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn speculation_settings_are_checked_at_their_bounds() {
        let check = |k: usize, lo: usize, hi: usize| {
            SchedulerConfig {
                num_speculative_tokens: k,
                speculative_ngram_min: lo,
                speculative_ngram_max: hi,
                ..Default::default()
            }
            .validate()
        };
        assert_eq!(check(64, 1, 3), Ok(()));
        assert!(check(65, 1, 3).unwrap_err().contains("at most 64"));
        assert_eq!(check(4, 2, 2), Ok(()));
        assert!(check(4, 0, 3).unwrap_err().contains("n-gram"));
        assert!(check(4, 3, 2).unwrap_err().contains("n-gram"));
        // Without speculation the n-gram lengths are not read.
        assert_eq!(check(0, 0, 0), Ok(()));
    }

    #[test]
    fn speculation_is_refused_only_beside_a_recurrent_state_group() {
        let with = |groups: Vec<CacheGroup>| {
            SchedulerConfig {
                num_speculative_tokens: 4,
                cache_groups: groups,
                ..Default::default()
            }
            .validate()
        };
        assert_eq!(with(vec![]), Ok(()));
        assert_eq!(
            with(vec![CacheGroup::sliding(64, 100), CacheGroup::full(100)]),
            Ok(())
        );
        let err = with(vec![CacheGroup::full(100), CacheGroup::state(8)]).unwrap_err();
        assert!(err.contains("recurrent-state"), "{err}");
    }

    #[test]
    fn speculative_methods_parse_from_their_flag_names_and_nothing_else() {
        assert_eq!(
            SpeculativeMethod::parse("ngram"),
            Some(SpeculativeMethod::Ngram)
        );
        assert_eq!(
            SpeculativeMethod::parse("draft"),
            Some(SpeculativeMethod::DraftModel)
        );
        for bad in ["", "Ngram", "draft-model", "eagle"] {
            assert_eq!(SpeculativeMethod::parse(bad), None, "{bad:?}");
        }
        for m in [SpeculativeMethod::Ngram, SpeculativeMethod::DraftModel] {
            assert_eq!(SpeculativeMethod::parse(m.name()), Some(m));
        }
    }

    #[test]
    fn the_pool_is_split_so_each_group_serves_the_same_sequences() {
        // Gemma-3-like: 5 sliding layers (window 1024) per global one, 8k context, blocks
        // of 16 tokens, one byte per token per layer.
        let specs = [
            GroupSpec {
                kind: CacheKind::Sliding { window: 1024 },
                bytes: 5,
            },
            GroupSpec {
                kind: CacheKind::Full,
                bytes: 1,
            },
        ];
        let pool = 6 * 8192 * 100; // 100 sequences at 8k if every layer were full
        let g = split_pool(pool, &specs, 16, 256, 8192, 512);
        // Per sequence: 512 full blocks of 16 B, and (1023 + 512) / 16 + 1 = 97 sliding
        // blocks of 80 B: 8192 + 7760 = 15952 B, so 308 sequences of each.
        assert_eq!((g[0].size / 97, g[1].size / 512), (308, 308));
        assert_eq!((g[0].size, g[1].size), (29888, 157759));
        assert_eq!((g[0].unit_bytes, g[1].unit_bytes), (80, 16));
        let used = g[0].size * 80 + g[1].size * 16;
        assert!(used <= pool && used + 80 + 16 > pool - pool / 1000);
    }

    #[test]
    fn a_state_group_takes_two_slots_per_running_sequence_first() {
        let specs = [
            GroupSpec {
                kind: CacheKind::State,
                bytes: 1000,
            },
            GroupSpec {
                kind: CacheKind::Full,
                bytes: 1,
            },
        ];
        let g = split_pool(8 * 1000 + 64 * 4, &specs, 4, 4, 16, 16);
        assert_eq!(
            g[0],
            CacheGroup {
                kind: CacheKind::State,
                size: 8,
                unit_bytes: 1000
            }
        );
        assert_eq!(g[1].size, 64);
    }

    #[test]
    fn groups_are_validated() {
        let mut c = SchedulerConfig::default();
        assert_eq!(c.groups(), [CacheGroup::full(4096)]);
        c.cache_groups = vec![CacheGroup::state(4)];
        assert_eq!(
            c.validate().unwrap_err(),
            "the cache groups need at least one attention group"
        );
        c.cache_groups = vec![
            CacheGroup::full(4),
            CacheGroup::state(4),
            CacheGroup::state(4),
        ];
        assert_eq!(
            c.validate().unwrap_err(),
            "at most one recurrent-state cache group"
        );
        c.cache_groups = vec![CacheGroup::full(4), CacheGroup::sliding(0, 4)];
        assert_eq!(
            c.validate().unwrap_err(),
            "cache group 1: sliding window must be at least 1"
        );
        c.cache_groups = vec![CacheGroup::full(0)];
        assert_eq!(
            c.validate().unwrap_err(),
            "cache group 0: size must be between 1 and 2^32 - 2"
        );
        c.cache_groups = vec![CacheGroup::sliding(8, 4), CacheGroup::state(2)];
        assert_eq!(c.validate(), Ok(()));
    }
}
