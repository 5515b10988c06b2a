//! Scheduler limits.

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// KV pool size in blocks.
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
        }
    }
}

impl SchedulerConfig {
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
        Ok(())
    }
}
