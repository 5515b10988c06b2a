use iron_batch_core::{AllocError, BlockAllocator, BlockHash};

#[test]
fn allocates_lowest_ids_first_and_reuses_least_recently_freed() {
    let mut a = BlockAllocator::new(6, 4, true);
    assert_eq!(a.allocate(3).unwrap(), vec![0, 1, 2]);
    assert_eq!(a.allocate(1).unwrap(), vec![3]);
    a.free(&[1]).unwrap();
    a.free(&[3, 0]).unwrap();
    // Never-used 4 and 5 were freed "first" (at construction), then 1, 3, 0.
    assert_eq!(a.free_queue(), vec![4, 5, 1, 3, 0]);
    assert_eq!(a.allocate(4).unwrap(), vec![4, 5, 1, 3]);
    assert_eq!(a.num_free(), 1);
}

#[test]
fn failed_allocation_takes_nothing() {
    let mut a = BlockAllocator::new(4, 4, true);
    a.allocate(3).unwrap();
    let before = a.free_queue();
    assert_eq!(
        a.allocate(2),
        Err(AllocError::OutOfBlocks {
            requested: 2,
            free: 1
        })
    );
    assert_eq!(a.free_queue(), before);
    a.check_invariants(None).unwrap();
}

#[test]
fn double_free_and_unknown_ids_are_errors_that_change_nothing() {
    let mut a = BlockAllocator::new(4, 4, true);
    let b = a.allocate(2).unwrap();
    a.free(&b[..1]).unwrap();
    assert_eq!(a.free(&[b[0]]), Err(AllocError::DoubleFree(b[0])));
    // A list that frees the same block twice fails whole: block 1 keeps its reference.
    assert_eq!(a.free(&[b[1], b[1]]), Err(AllocError::DoubleFree(b[1])));
    assert_eq!(a.ref_count(b[1]).unwrap(), 1);
    assert_eq!(a.free(&[9]), Err(AllocError::UnknownBlock(9, 4)));
    assert_eq!(a.ref_count(9), Err(AllocError::UnknownBlock(9, 4)));
    a.check_invariants(None).unwrap();
}

#[test]
fn prefix_match_shares_published_blocks_and_never_covers_last_token() {
    let mut a = BlockAllocator::new(8, 2, true);
    let tokens = [1, 2, 3, 4, 5, 6];
    let blocks = a.allocate(3).unwrap();
    let h0 = a.publish(blocks[0], None, &tokens[0..2]).unwrap();
    let h1 = a.publish(blocks[1], Some(h0), &tokens[2..4]).unwrap();
    a.publish(blocks[2], Some(h1), &tokens[4..6]).unwrap();
    assert_eq!(a.num_cached(), 3);
    assert_eq!(a.block_hash(blocks[1]), Some(h1));
    // Nothing to match in no tokens.
    assert!(a.match_prefix(&[], &mut Vec::new()).is_empty());

    // Same six tokens: only two blocks match, the last token's block must be computed.
    let mut hashes = Vec::new();
    let m = a.match_prefix(&tokens, &mut hashes);
    assert_eq!(m, vec![blocks[0], blocks[1]]);
    assert_eq!(hashes, vec![h0, h1]);
    assert_eq!(a.ref_count(blocks[0]).unwrap(), 2);
    assert_eq!(a.ref_count(blocks[2]).unwrap(), 1);

    // Seven tokens: all three full blocks match.
    let mut hashes = Vec::new();
    let m = a.match_prefix(&[1, 2, 3, 4, 5, 6, 7], &mut hashes);
    assert_eq!(m.len(), 3);

    // A different second block stops the chain after the first.
    let m = a.match_prefix(&[1, 2, 9, 9, 5, 6, 7], &mut Vec::new());
    assert_eq!(m, vec![blocks[0]]);
    // Same tokens in block 2 but a different parent never match (chained hash).
    let m = a.match_prefix(&[9, 9, 3, 4, 1], &mut Vec::new());
    assert!(m.is_empty());
}

#[test]
fn freed_cached_blocks_are_revived_until_evicted_by_reuse() {
    let mut a = BlockAllocator::new(3, 2, true);
    let b = a.allocate(2).unwrap();
    let h0 = a.publish(b[0], None, &[1, 2]).unwrap();
    a.publish(b[1], Some(h0), &[3, 4]).unwrap();
    // Freed tail first: block 1 is evicted before block 0.
    a.free(&[b[1], b[0]]).unwrap();
    assert_eq!(a.free_queue(), vec![2, b[1], b[0]]);
    assert_eq!(a.num_cached(), 2);

    // Revive block 0 from the middle of the free queue.
    let m = a.match_prefix(&[1, 2, 3], &mut Vec::new());
    assert_eq!(m, vec![b[0]]);
    assert_eq!(a.free_queue(), vec![2, b[1]]);

    // Allocating two takes 2 then block 1, whose cached content is evicted.
    assert_eq!(a.allocate(2).unwrap(), vec![2, b[1]]);
    assert_eq!(a.num_cached(), 1);
    assert!(a.match_prefix(&[1, 2, 3, 4, 5], &mut Vec::new()).len() == 1);
    a.check_invariants(None).unwrap();
}

#[test]
fn duplicate_content_keeps_the_first_cached_block() {
    let mut a = BlockAllocator::new(4, 2, true);
    let b = a.allocate(2).unwrap();
    let h_first = a.publish(b[0], None, &[7, 7]).unwrap();
    let h_second = a.publish(b[1], None, &[7, 7]).unwrap();
    assert_eq!(h_first, h_second);
    assert_eq!(a.num_cached(), 1);
    assert_eq!(a.block_hash(b[1]), None);
    assert_eq!(a.match_prefix(&[7, 7, 1], &mut Vec::new()), vec![b[0]]);
}

#[test]
fn caching_off_publishes_and_matches_nothing() {
    let mut a = BlockAllocator::new(4, 2, false);
    let b = a.allocate(1).unwrap();
    a.publish(b[0], None, &[1, 2]).unwrap();
    assert_eq!(a.num_cached(), 0);
    assert!(a.match_prefix(&[1, 2, 3], &mut Vec::new()).is_empty());
}

#[test]
fn publishing_a_partial_block_is_an_error() {
    let mut a = BlockAllocator::new(4, 4, true);
    let b = a.allocate(1).unwrap();
    assert!(matches!(
        a.publish(b[0], None, &[1, 2]),
        Err(AllocError::Invariant(_))
    ));
}

#[test]
fn seeded_long_random_run_keeps_invariants() {
    // 100k operations of a cheap LCG-driven mix: allocate, free, publish, match.
    let mut a = BlockAllocator::new(64, 4, true);
    let mut held: Vec<Vec<u32>> = Vec::new();
    let mut x: u64 = 42;
    let mut next = |m: u64| {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (x >> 33) % m
    };
    for i in 0..100_000 {
        match next(4) {
            0 => {
                if let Ok(b) = a.allocate(next(6) as usize + 1) {
                    held.push(b);
                }
            }
            1 if !held.is_empty() => {
                let k = next(held.len() as u64) as usize;
                let b = held.swap_remove(k);
                a.free(&b).unwrap();
            }
            2 if !held.is_empty() => {
                let k = next(held.len() as u64) as usize;
                let mut parent = None;
                for &blk in &held[k] {
                    let t = next(3) as u32;
                    parent = Some(a.publish(blk, parent, &[t, t, t, t]).unwrap());
                }
            }
            _ => {
                let toks: Vec<u32> = (0..next(12) + 1).map(|_| next(3) as u32).collect();
                let m = a.match_prefix(&toks, &mut Vec::new());
                if !m.is_empty() {
                    held.push(m);
                }
            }
        }
        if i % 1000 == 0 {
            let mut refs = vec![0u32; 64];
            for b in held.iter().flatten() {
                refs[*b as usize] += 1;
            }
            a.check_invariants(Some(&refs)).unwrap();
        }
    }
    for b in held.drain(..) {
        a.free(&b).unwrap();
    }
    assert_eq!(a.num_free(), 64);
    a.check_invariants(None).unwrap();
}

/// Every block gets the same hash: each lookup meets a collision unless the content is the
/// one block the cache holds.
fn all_collide(_parent: Option<BlockHash>, _tokens: &[u32]) -> BlockHash {
    7
}

#[test]
fn a_collision_with_other_tokens_is_a_miss() {
    let mut a = BlockAllocator::with_hasher(4, 2, true, all_collide);
    let b = a.allocate(1).unwrap();
    a.publish(b[0], None, &[1, 2]).unwrap();
    let mut hashes = Vec::new();
    assert!(a.match_prefix(&[3, 4, 5], &mut hashes).is_empty());
    assert!(hashes.is_empty());
    assert_eq!(a.ref_count(b[0]).unwrap(), 1, "a miss takes no reference");
    // The block's own content still hits.
    assert_eq!(a.match_prefix(&[1, 2, 5], &mut hashes), [b[0]]);
    assert_eq!(a.ref_count(b[0]).unwrap(), 2);
    a.check_invariants(Some(&[2, 0, 0, 0])).unwrap();
}

#[test]
fn a_collision_with_the_same_tokens_after_another_parent_is_a_miss() {
    // [1, 2] twice: the second block has the tokens of the cached one and its hash, but a
    // parent, so its KV would differ.
    let mut a = BlockAllocator::with_hasher(4, 2, true, all_collide);
    let b = a.allocate(1).unwrap();
    a.publish(b[0], None, &[1, 2]).unwrap();
    let mut hashes = Vec::new();
    assert_eq!(a.match_prefix(&[1, 2, 1, 2, 9], &mut hashes), [b[0]]);
    assert_eq!(hashes.len(), 1);
    assert_eq!(a.ref_count(b[0]).unwrap(), 2);
}

#[test]
fn publishing_under_a_taken_hash_leaves_the_block_uncached() {
    let mut a = BlockAllocator::with_hasher(4, 2, true, all_collide);
    let b = a.allocate(2).unwrap();
    a.publish(b[0], None, &[1, 2]).unwrap();
    a.publish(b[1], None, &[3, 4]).unwrap();
    assert_eq!(a.num_cached(), 1);
    assert_eq!(a.block_hash(b[1]), None);
    assert!(a.match_prefix(&[3, 4, 5], &mut Vec::new()).is_empty());
}

#[test]
fn a_block_nobody_holds_is_not_published() {
    let mut a = BlockAllocator::new(4, 2, true);
    let b = a.allocate(2).unwrap();
    a.free(&b[..1]).unwrap();
    // Still one holder: published. None: its content may be overwritten, so not cached.
    a.publish(b[1], None, &[5, 6]).unwrap();
    a.publish(b[0], None, &[1, 2]).unwrap();
    assert_eq!(a.num_cached(), 1);
    assert_eq!(a.block_hash(b[0]), None);
    assert!(a.match_prefix(&[1, 2, 3], &mut Vec::new()).is_empty());
    assert_eq!(a.match_prefix(&[5, 6, 3], &mut Vec::new()), [b[1]]);
    a.check_invariants(Some(&[0, 2, 0, 0])).unwrap();
}

#[test]
fn num_used_counts_every_block_out_of_the_free_queue() {
    let mut a = BlockAllocator::new(5, 2, true);
    assert_eq!((a.num_used(), a.num_free(), a.total()), (0, 5, 5));
    let b = a.allocate(3).unwrap();
    assert_eq!((a.num_used(), a.num_free()), (3, 2));
    // A second holder of a block uses no other block.
    a.publish(b[0], None, &[4, 4]).unwrap();
    assert_eq!(a.match_prefix(&[4, 4, 1], &mut Vec::new()), [b[0]]);
    assert_eq!(a.num_used(), 3);
    a.free(&[b[0], b[1]]).unwrap();
    assert_eq!((a.num_used(), a.num_free()), (2, 3));
}
