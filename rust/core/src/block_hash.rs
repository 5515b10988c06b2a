//! Chained content hash of a full KV block: hash(parent hash, the block's token ids).
//! Deterministic across runs (no random seed) so tests can reason about it; the allocator
//! keeps the token ids and the parent hash beside the hash, so two blocks whose hashes
//! collide cost a cache miss, never wrong KV. Not covered: a cached block published after a
//! parent whose own hash collided with another parent's could be chained onto the wrong
//! prefix once that other parent is cached; that needs a 64-bit collision first.

pub type BlockHash = u64;

/// A block hash function: `hash_block`, or a stand-in with collisions in tests.
pub type BlockHasher = fn(Option<BlockHash>, &[u32]) -> BlockHash;

/// The `BuildHasher` of maps keyed by block hashes: the key, already a full-avalanche
/// 64-bit hash, is its own hash (a second SipHash over it is most of a lookup's cost).
pub type HashIsKey = std::hash::BuildHasherDefault<KeyHasher>;

/// See `HashIsKey`. Only `u64` keys: a `HashMap<BlockHash, _>` hashes with `write_u64`.
#[derive(Debug, Default, Clone, Copy)]
pub struct KeyHasher(u64);

impl std::hash::Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, _bytes: &[u8]) {
        unreachable!("maps with HashIsKey are keyed by u64 block hashes");
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
}

const SEED: u64 = 0x9E37_79B9_7F4A_7C15;
/// Fractional bits of sqrt(3): any constant other than `SEED` would do.
const SALT_SEED: u64 = 0xBB67_AE85_84CA_A73B;

#[inline]
fn mix(mut z: u64) -> u64 {
    // splitmix64 finaliser: cheap and with full avalanche.
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The value a cache salt contributes to its request's chain: it stands in for the parent
/// hash of the first block, so two requests with different salts never compute the same
/// block hash for the same tokens, and a salted chain never matches an unsalted one. The
/// byte string is hashed in a domain of its own (a seed of its own, and the length), so
/// choosing a salt whose hash equals some cached block's would take a 64-bit preimage.
pub fn hash_salt(salt: &[u8]) -> BlockHash {
    let mut h = mix(SALT_SEED);
    for chunk in salt.chunks(8) {
        let mut word = [0u8; 8];
        word[..chunk.len()].copy_from_slice(chunk);
        h = mix(h ^ u64::from_le_bytes(word).wrapping_add(SEED));
    }
    mix(h ^ (salt.len() as u64).rotate_left(7))
}

pub fn hash_block(parent: Option<BlockHash>, tokens: &[u32]) -> BlockHash {
    let mut h = mix(parent.map_or(SEED, |p| p ^ SEED.rotate_left(17)));
    for &t in tokens {
        h = mix(h ^ u64::from(t).wrapping_add(SEED));
    }
    mix(h ^ tokens.len() as u64)
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;
    use std::hash::BuildHasher;

    use super::*;

    #[test]
    fn a_block_hash_is_its_own_map_hash() {
        let h = HashIsKey::default();
        for v in [0u64, 1, 0xDEAD_BEEF, hash_block(None, &[1, 2, 3])] {
            assert_eq!(h.hash_one(v), v);
        }
    }

    #[test]
    fn salts_differ_from_each_other_and_change_the_first_block() {
        let tokens = [5u32, 6, 7, 8];
        let plain = hash_block(None, &tokens);
        let mut seen = HashSet::new();
        for salt in [
            "",
            "a",
            "b",
            "ab",
            "tenant-1",
            "tenant-2",
            "12345678",
            "123456789",
        ] {
            let s = hash_salt(salt.as_bytes());
            assert!(seen.insert(s), "salt {salt:?} collides");
            assert_ne!(hash_block(Some(s), &tokens), plain, "salt {salt:?}");
        }
        // Trailing zero bytes are not padding: the length is hashed too.
        assert_ne!(hash_salt(b"a"), hash_salt(b"a\0"));
        // That equal salts hash alike is what lets two requests share blocks; the
        // scheduler test the_same_salt_shares_prefix_blocks_... checks it end to end.
    }

    #[test]
    fn every_bit_and_the_length_of_a_salt_change_its_hash() {
        let salt = *b"tenant:0123456789abcdef";
        let base = hash_salt(&salt);
        for pos in 0..salt.len() {
            for bit in 0..8 {
                let mut s = salt;
                s[pos] ^= 1 << bit;
                assert_ne!(base, hash_salt(&s), "byte {pos} bit {bit}");
            }
        }
        let mut seen = HashSet::new();
        for len in 0..=salt.len() {
            assert!(seen.insert(hash_salt(&vec![0u8; len])), "{len} zero bytes");
        }
    }

    #[test]
    fn mix_is_the_splitmix64_finaliser() {
        // The published splitmix64 stream for seed 1234567: the state advances by the
        // golden-ratio gamma and each output is the finaliser applied to the state.
        let want: [u64; 3] = [
            0x599E_D017_FB08_FC85,
            0x2C73_F084_5854_0FA5,
            0x883E_BCE5_A3F2_7C77,
        ];
        let mut state: u64 = 1_234_567;
        for w in want {
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            assert_eq!(mix(state), w);
        }
    }

    #[test]
    fn every_bit_of_the_parent_and_of_every_token_changes_the_hash() {
        let tokens = [3u32, 141, 59, 26];
        let parent = 0x0123_4567_89AB_CDEF_u64;
        let base = hash_block(Some(parent), &tokens);
        assert_ne!(base, hash_block(None, &tokens));
        for bit in 0..64 {
            assert_ne!(
                base,
                hash_block(Some(parent ^ 1 << bit), &tokens),
                "parent bit {bit}"
            );
        }
        for pos in 0..tokens.len() {
            for bit in 0..32 {
                let mut t = tokens;
                t[pos] ^= 1 << bit;
                assert_ne!(base, hash_block(Some(parent), &t), "token {pos} bit {bit}");
            }
        }
    }

    #[test]
    fn order_length_and_chain_position_change_the_hash() {
        let h = hash_block(None, &[1, 2]);
        assert_ne!(h, hash_block(None, &[2, 1]));
        assert_ne!(h, hash_block(None, &[1, 2, 0]));
        assert_ne!(h, hash_block(None, &[1]));
        assert_ne!(hash_block(Some(h), &[1, 2]), h);
        assert_eq!(h, hash_block(None, &[1, 2]), "deterministic");
    }

    #[test]
    fn no_collisions_among_small_blocks() {
        // Every two-token block over 64 ids, as a first block and after two parents.
        let mut seen = HashSet::new();
        for parent in [None, Some(0), Some(hash_block(None, &[0, 0]))] {
            for a in 0..64 {
                for b in 0..64 {
                    assert!(
                        seen.insert(hash_block(parent, &[a, b])),
                        "{parent:?} {a} {b}"
                    );
                }
            }
        }
        for a in 0..4096 {
            assert!(seen.insert(hash_block(None, &[a])), "[{a}]");
        }
    }

    #[test]
    fn flipping_one_input_bit_flips_about_half_the_output_bits() {
        let mut x: u64 = 7;
        let mut next = || {
            x = x
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            x >> 32
        };
        let (mut flipped, mut per_bit) = (0u32, [0u32; 64]);
        let trials = 4000;
        for _ in 0..trials {
            let mut tokens = [next() as u32, next() as u32, next() as u32, next() as u32];
            let a = hash_block(None, &tokens);
            let pos = next() as usize % 4;
            tokens[pos] ^= 1 << (next() % 32);
            let diff = a ^ hash_block(None, &tokens);
            flipped += diff.count_ones();
            for (bit, n) in per_bit.iter_mut().enumerate() {
                *n += (diff >> bit & 1) as u32;
            }
        }
        let mean = f64::from(flipped) / f64::from(trials);
        assert!((31.0..33.0).contains(&mean), "mean {mean} bits flipped");
        for (bit, &n) in per_bit.iter().enumerate() {
            let p = f64::from(n) / f64::from(trials);
            assert!(
                (0.44..0.56).contains(&p),
                "output bit {bit} flips with p={p}"
            );
        }
    }
}
