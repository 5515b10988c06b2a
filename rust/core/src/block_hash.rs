//! Chained content hash of a full KV block: hash(parent hash, the block's token ids).
//! Deterministic across runs (no random seed) so tests can reason about it; the allocator
//! keeps the token ids beside the hash, so a collision costs a cache miss, never wrong KV.

pub type BlockHash = u64;

/// A block hash function: `hash_block`, or a stand-in with collisions in tests.
pub type BlockHasher = fn(Option<BlockHash>, &[u32]) -> BlockHash;

const SEED: u64 = 0x9E37_79B9_7F4A_7C15;

#[inline]
fn mix(mut z: u64) -> u64 {
    // splitmix64 finaliser: cheap and with full avalanche.
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

pub fn hash_block(parent: Option<BlockHash>, tokens: &[u32]) -> BlockHash {
    let mut h = mix(parent.map_or(SEED, |p| p ^ SEED.rotate_left(17)));
    for &t in tokens {
        h = mix(h ^ u64::from(t).wrapping_add(SEED));
    }
    mix(h ^ tokens.len() as u64)
}
