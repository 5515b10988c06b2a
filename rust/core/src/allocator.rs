//! Paged KV block allocator: ids only (the backend maps an id to real storage), reference
//! counts for prefix sharing, and a prefix cache of full computed blocks with lazy eviction.

use std::collections::hash_map::Entry;
use std::collections::HashMap;

use crate::block_hash::{hash_block, BlockHash, BlockHasher, HashIsKey};
use crate::error::AllocError;
use crate::free_list::FreeList;

pub type BlockId = u32;

/// What the prefix cache remembers of one published block (its tokens are in
/// `BlockAllocator::tokens`, at the block's own place).
#[derive(Debug, Clone, Copy)]
struct CachedContent {
    hash: BlockHash,
    parent: Option<BlockHash>,
}

#[derive(Debug, Clone)]
pub struct BlockAllocator {
    block_size: usize,
    ref_counts: Vec<u32>,
    /// Blocks with no reference, least recently freed first. Cached blocks stay here (and
    /// keep their content) until reused: that is the lazy eviction.
    free: FreeList,
    content: Vec<Option<CachedContent>>,
    /// The token ids of each published block, `block_size` per block id (empty without
    /// caching): kept in one allocation so that publishing and evicting allocate nothing.
    tokens: Vec<u32>,
    /// Keyed by block hashes, which are already well mixed: no second hash over them.
    cache: HashMap<BlockHash, BlockId, HashIsKey>,
    caching: bool,
    /// `hash_block` except in tests that need collisions on demand.
    hasher: BlockHasher,
}

impl BlockAllocator {
    pub fn new(total_blocks: usize, block_size: usize, enable_prefix_caching: bool) -> Self {
        Self::with_hasher(total_blocks, block_size, enable_prefix_caching, hash_block)
    }

    /// As `new`, with another block hash function. For tests: a deliberately colliding
    /// hash shows that a collision costs a cache miss and never serves another block's KV.
    pub fn with_hasher(
        total_blocks: usize,
        block_size: usize,
        enable_prefix_caching: bool,
        hasher: BlockHasher,
    ) -> Self {
        assert!(block_size > 0, "block_size must be positive");
        BlockAllocator {
            block_size,
            ref_counts: vec![0; total_blocks],
            free: FreeList::full(total_blocks),
            content: vec![None; total_blocks],
            tokens: if enable_prefix_caching {
                vec![0; total_blocks * block_size]
            } else {
                Vec::new()
            },
            cache: HashMap::default(),
            caching: enable_prefix_caching,
            hasher,
        }
    }

    pub fn total(&self) -> usize {
        self.ref_counts.len()
    }
    pub fn num_free(&self) -> usize {
        self.free.len()
    }
    pub fn num_used(&self) -> usize {
        self.total() - self.free.len()
    }
    /// Blocks whose content the prefix cache can serve (in use or free-but-not-evicted).
    pub fn num_cached(&self) -> usize {
        self.cache.len()
    }
    pub fn caching_enabled(&self) -> bool {
        self.caching
    }

    fn check_id(&self, id: BlockId) -> Result<usize, AllocError> {
        let i = id as usize;
        if i >= self.ref_counts.len() {
            return Err(AllocError::UnknownBlock(id, self.ref_counts.len()));
        }
        Ok(i)
    }

    pub fn ref_count(&self, id: BlockId) -> Result<u32, AllocError> {
        Ok(self.ref_counts[self.check_id(id)?])
    }

    /// The token ids a published block was stored with.
    fn tokens_of(&self, id: BlockId) -> &[u32] {
        let i = id as usize;
        &self.tokens[i * self.block_size..(i + 1) * self.block_size]
    }

    /// The cached hash of a block, if it was published and not evicted since.
    pub fn block_hash(&self, id: BlockId) -> Option<BlockHash> {
        self.content.get(id as usize)?.as_ref().map(|c| c.hash)
    }

    /// Take `n` blocks, least recently freed first, evicting their cached content.
    /// Fails whole: on error nothing is taken.
    pub fn allocate(&mut self, n: usize) -> Result<Vec<BlockId>, AllocError> {
        let mut out = Vec::with_capacity(n);
        self.allocate_into(n, &mut out)?;
        Ok(out)
    }

    /// As `allocate`, appending to `out` (no temporary vector on the scheduler's hot path).
    pub fn allocate_into(&mut self, n: usize, out: &mut Vec<BlockId>) -> Result<(), AllocError> {
        if n > self.free.len() {
            return Err(AllocError::OutOfBlocks {
                requested: n,
                free: self.free.len(),
            });
        }
        out.reserve(n);
        for _ in 0..n {
            let id = self.free.pop_front().expect("length checked above");
            self.evict(id);
            self.ref_counts[id as usize] = 1;
            out.push(id);
        }
        Ok(())
    }

    fn evict(&mut self, id: BlockId) {
        if let Some(c) = self.content[id as usize].take() {
            // One hash lookup: the entry, removed if it is this block's.
            if let Entry::Occupied(e) = self.cache.entry(c.hash) {
                if *e.get() == id {
                    e.remove();
                }
            }
        }
    }

    /// Drop one reference on each block, in the order given. A block whose count reaches
    /// zero joins the back of the free queue and keeps its cached content. Every id is
    /// checked before anything changes, so an error leaves the allocator as it was.
    pub fn free(&mut self, blocks: &[BlockId]) -> Result<(), AllocError> {
        for (k, &id) in blocks.iter().enumerate() {
            let i = self.check_id(id)?;
            let repeats = blocks[..k].iter().filter(|&&b| b == id).count() as u32;
            if self.ref_counts[i] <= repeats {
                return Err(AllocError::DoubleFree(id));
            }
        }
        for &id in blocks {
            self.release(id);
        }
        Ok(())
    }

    /// Drop one reference without validation; the scheduler only frees what it holds.
    pub(crate) fn release(&mut self, id: BlockId) {
        let i = id as usize;
        debug_assert!(self.ref_counts[i] > 0);
        self.ref_counts[i] -= 1;
        if self.ref_counts[i] == 0 {
            self.free.push_back(id);
        }
    }

    /// Drop one reference; a block whose count reaches zero and that has no cached content
    /// goes to the front of the free queue, to be reused before any cached block is
    /// evicted (the state pool: a finished sequence's slot before a checkpoint).
    pub(crate) fn release_uncached_first(&mut self, id: BlockId) {
        let i = id as usize;
        debug_assert!(self.ref_counts[i] > 0);
        self.ref_counts[i] -= 1;
        if self.ref_counts[i] == 0 {
            if self.content[i].is_some() {
                self.free.push_back(id);
            } else {
                self.free.push_front(id);
            }
        }
    }

    /// Publish a full block whose KV has been computed. Returns its chained hash, which the
    /// caller keeps as the parent of its next block. If identical content is already
    /// cached in another block this one stays unpublished (the cache keeps the first).
    pub fn publish(
        &mut self,
        id: BlockId,
        parent: Option<BlockHash>,
        tokens: &[u32],
    ) -> Result<BlockHash, AllocError> {
        let hash = (self.hasher)(parent, tokens);
        self.publish_hashed(id, hash, parent, tokens)
    }

    /// As `publish`, with the hash already computed (`hash` of the same parent and tokens):
    /// the scheduler hashes a block once for all its groups.
    pub fn publish_hashed(
        &mut self,
        id: BlockId,
        hash: BlockHash,
        parent: Option<BlockHash>,
        tokens: &[u32],
    ) -> Result<BlockHash, AllocError> {
        let i = self.check_id(id)?;
        if tokens.len() != self.block_size {
            return Err(AllocError::Invariant(format!(
                "publish of block {id} with {} tokens, block size is {}",
                tokens.len(),
                self.block_size
            )));
        }
        if let Some(c) = &self.content[i] {
            return Ok(c.hash);
        }
        if self.caching && self.ref_counts[i] > 0 {
            if let Entry::Vacant(v) = self.cache.entry(hash) {
                v.insert(id);
                self.content[i] = Some(CachedContent { hash, parent });
                self.tokens[i * self.block_size..(i + 1) * self.block_size].copy_from_slice(tokens);
            }
        }
        Ok(hash)
    }

    /// The chained hash of a block of `tokens` after `parent`.
    pub fn hash(&self, parent: Option<BlockHash>, tokens: &[u32]) -> BlockHash {
        (self.hasher)(parent, tokens)
    }

    /// The cached block with this content (`hash` of `parent` and `tokens`), if any; takes
    /// no reference (see `acquire`).
    pub fn lookup(
        &self,
        hash: BlockHash,
        parent: Option<BlockHash>,
        tokens: &[u32],
    ) -> Option<BlockId> {
        let &id = self.cache.get(&hash)?;
        let c = self.content[id as usize]
            .as_ref()
            .expect("cache map points at a block with content");
        // A hash collision is a miss rather than wrong KV.
        (c.parent == parent && self.tokens_of(id) == tokens).then_some(id)
    }

    /// Take a reference on a block `lookup` returned, reviving it from the free queue.
    pub fn acquire(&mut self, id: BlockId) {
        if self.ref_counts[id as usize] == 0 {
            self.free.remove(id);
        }
        self.ref_counts[id as usize] += 1;
    }

    /// Longest chain of cached full blocks that starts `tokens`, never covering the last
    /// token (its logits must be computed). Takes a reference on each block returned;
    /// `hashes` receives each block's chained hash.
    pub fn match_prefix(&mut self, tokens: &[u32], hashes: &mut Vec<BlockHash>) -> Vec<BlockId> {
        self.match_prefix_salted(tokens, None, hashes)
    }

    /// As `match_prefix` for a chain whose first block has `salt` (see
    /// `block_hash::hash_salt`) as its parent hash: blocks published under another salt,
    /// or none, never match.
    pub fn match_prefix_salted(
        &mut self,
        tokens: &[u32],
        salt: Option<BlockHash>,
        hashes: &mut Vec<BlockHash>,
    ) -> Vec<BlockId> {
        let mut out = Vec::new();
        if !self.caching || tokens.is_empty() {
            return out;
        }
        let full = (tokens.len() - 1) / self.block_size;
        let mut parent = salt;
        for b in 0..full {
            let chunk = &tokens[b * self.block_size..(b + 1) * self.block_size];
            let hash = (self.hasher)(parent, chunk);
            let Some(&id) = self.cache.get(&hash) else {
                break;
            };
            let c = self.content[id as usize]
                .as_ref()
                .expect("cache map points at a block with content");
            if c.parent != parent || self.tokens_of(id) != chunk {
                break; // a hash collision: miss rather than serve wrong KV
            }
            if self.ref_counts[id as usize] == 0 {
                self.free.remove(id);
            }
            self.ref_counts[id as usize] += 1;
            out.push(id);
            hashes.push(hash);
            parent = Some(hash);
        }
        out
    }

    /// Free blocks in reuse order (front first). For tests and debugging.
    pub fn free_queue(&self) -> Vec<BlockId> {
        self.free.iter().collect()
    }

    /// Check every structural invariant; `expected_refs` (if given) is the number of
    /// holders of each block according to the caller.
    pub fn check_invariants(&self, expected_refs: Option<&[u32]>) -> Result<(), AllocError> {
        let bad = |m: String| Err(AllocError::Invariant(m));
        let mut seen = vec![false; self.total()];
        let mut n = 0;
        for id in self.free.iter() {
            if seen[id as usize] {
                return bad(format!("block {id} twice in the free queue"));
            }
            seen[id as usize] = true;
            if self.ref_counts[id as usize] != 0 {
                return bad(format!("referenced block {id} is in the free queue"));
            }
            n += 1;
        }
        if n != self.free.len() {
            return bad("free queue length disagrees with its walk".into());
        }
        let referenced = self.ref_counts.iter().filter(|&&r| r > 0).count();
        if referenced + n != self.total() {
            return bad(format!(
                "free {n} + referenced {referenced} != total {}",
                self.total()
            ));
        }
        for (&hash, &id) in &self.cache {
            match &self.content[id as usize] {
                Some(c) if c.hash == hash => {}
                _ => return bad(format!("cache entry for block {id} lost its content")),
            }
        }
        if let Some(expected) = expected_refs {
            for (id, (&have, &want)) in self.ref_counts.iter().zip(expected).enumerate() {
                if have != want {
                    return bad(format!("block {id} has ref count {have}, {want} holders"));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    //! Each structural invariant broken on purpose: `check_invariants` must name it.

    use super::*;

    fn broken(a: &BlockAllocator, refs: Option<&[u32]>) -> String {
        match a.check_invariants(refs) {
            Err(AllocError::Invariant(m)) => m,
            other => panic!("expected a broken invariant, got {other:?}"),
        }
    }

    /// Blocks 0 and 1 held (0 published and cached), 2 and 3 free, in that order.
    fn healthy() -> BlockAllocator {
        let mut a = BlockAllocator::new(4, 2, true);
        assert_eq!(a.allocate(2).unwrap(), [0, 1]);
        a.publish(0, None, &[1, 2]).unwrap();
        assert_eq!(a.free_queue(), [2, 3]);
        a.check_invariants(Some(&[1, 1, 0, 0])).unwrap();
        a
    }

    #[test]
    fn a_cycle_in_the_free_queue_is_a_block_listed_twice() {
        let mut a = healthy();
        a.free.corrupt_next(3, 2);
        assert_eq!(broken(&a, None), "block 2 twice in the free queue");
    }

    #[test]
    fn a_referenced_block_in_the_free_queue_is_reported() {
        let mut a = healthy();
        a.ref_counts[3] = 1;
        assert_eq!(broken(&a, None), "referenced block 3 is in the free queue");
    }

    #[test]
    fn a_free_queue_length_that_disagrees_with_its_links_is_reported() {
        let mut a = healthy();
        a.free.corrupt_len(3);
        assert_eq!(
            broken(&a, None),
            "free queue length disagrees with its walk"
        );
    }

    #[test]
    fn a_leaked_block_is_reported() {
        // Out of the free queue but referenced by nobody.
        let mut a = healthy();
        a.free.remove(3);
        assert_eq!(broken(&a, None), "free 1 + referenced 2 != total 4");
    }

    #[test]
    fn a_cache_entry_without_matching_content_is_reported() {
        let mut a = healthy();
        a.content[0] = None;
        assert_eq!(broken(&a, None), "cache entry for block 0 lost its content");

        let mut a = healthy();
        a.content[0].as_mut().unwrap().hash ^= 1;
        assert_eq!(broken(&a, None), "cache entry for block 0 lost its content");
    }

    #[test]
    fn a_ref_count_other_than_the_callers_holders_is_reported() {
        let a = healthy();
        assert_eq!(
            broken(&a, Some(&[1, 2, 0, 0])),
            "block 1 has ref count 1, 2 holders"
        );
        assert_eq!(
            broken(&a, Some(&[0, 1, 0, 0])),
            "block 0 has ref count 1, 0 holders"
        );
    }
}
