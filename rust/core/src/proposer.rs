//! Proposers for speculative decoding: guesses of the tokens that follow a sequence, which
//! the target model then verifies in one forward (see `Scheduler::commit_accepted`). A
//! wrong guess costs a query row, never a wrong token.

use std::collections::HashMap;

/// Something that guesses a sequence's next tokens from its tokens so far. One per
/// sequence, asked with all of its tokens each time.
pub trait Proposer {
    /// Append to `out` up to `k` tokens that may follow `tokens` (prompt and output so
    /// far; none when it has no guess). A proposer that indexes the sequence keeps a
    /// cursor, so each token is looked at once however often it is asked.
    fn propose(&mut self, tokens: &[u32], k: usize, out: &mut Vec<u32>);
}

/// A proposal row whose token the backend fills in (`Batch::input_ids`) before the
/// verification forward: its draft model's greedy pick there. A commit accepts any token
/// in such a row that the target model agreed with.
pub const DRAFTED_BY_BACKEND: u32 = u32::MAX;

/// A draft model run by the backend: reserves `k` proposal rows of placeholders
/// (`DRAFTED_BY_BACKEND`) that the backend fills by running its draft model `k` times
/// greedily before the verification forward. Nothing to index: the draft model's own KV
/// (the same block tables and slots as the target's, a separate tensor) is its state, and
/// the KV of a rejected proposal is overwritten later, as the target's is.
#[derive(Debug, Clone, Copy, Default)]
pub struct DraftModelProposer;

impl Proposer for DraftModelProposer {
    fn propose(&mut self, _tokens: &[u32], k: usize, out: &mut Vec<u32>) {
        out.extend(std::iter::repeat_n(DRAFTED_BY_BACKEND, k));
    }
}

/// The proposer a speculating sequence holds: one of the methods above.
#[derive(Debug, Clone)]
pub enum SequenceProposer {
    Ngram(NgramProposer),
    DraftModel(DraftModelProposer),
}

impl Proposer for SequenceProposer {
    fn propose(&mut self, tokens: &[u32], k: usize, out: &mut Vec<u32>) {
        match self {
            SequenceProposer::Ngram(p) => p.propose(tokens, k, out),
            SequenceProposer::DraftModel(p) => p.propose(tokens, k, out),
        }
    }
}

/// Whether a commit may accept `token` where `proposed` was proposed.
pub fn accepts(proposed: u32, token: u32) -> bool {
    proposed == DRAFTED_BY_BACKEND || proposed == token
}

/// Prompt lookup: the most recent earlier occurrence of the sequence's last `n` tokens
/// (longest `n` first, from `max_n` down to `min_n`) in its own prompt and output proposes
/// the tokens that followed it. One map per `n` from the n-gram to the position after its
/// latest occurrence, updated as tokens arrive.
#[derive(Debug, Clone)]
pub struct NgramProposer {
    min_n: usize,
    max_n: usize,
    /// `maps[n - min_n]`: hash of an n-gram -> the position just after its latest
    /// occurrence that has a token after it.
    maps: Vec<HashMap<u64, u32>>,
    /// Tokens `0..seen` are indexed (the n-grams ending before `seen - 1`).
    seen: usize,
}

fn ngram_hash(gram: &[u32]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &t in gram {
        h = (h ^ u64::from(t)).wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

impl NgramProposer {
    /// Panics unless `1 <= min_n <= max_n`.
    pub fn new(min_n: usize, max_n: usize) -> Self {
        assert!(1 <= min_n && min_n <= max_n, "need 1 <= min_n <= max_n");
        NgramProposer {
            min_n,
            max_n,
            maps: vec![HashMap::new(); max_n - min_n + 1],
            seen: 0,
        }
    }

    /// Tokens indexed so far.
    pub fn num_seen(&self) -> usize {
        self.seen
    }

    /// Index `tokens` past what was seen before (`propose` does it first).
    pub fn observe(&mut self, tokens: &[u32]) {
        // An n-gram ending at `e` is indexed once the token at `e + 1` exists, so that a
        // match always has a continuation (and the sequence's own suffix never matches
        // itself).
        let len = tokens.len();
        for next in self.seen.max(1)..len {
            for n in self.min_n..=self.max_n.min(next) {
                let gram = &tokens[next - n..next];
                self.maps[n - self.min_n].insert(ngram_hash(gram), next as u32);
            }
        }
        self.seen = self.seen.max(len);
    }
}

impl Proposer for NgramProposer {
    fn propose(&mut self, tokens: &[u32], k: usize, out: &mut Vec<u32>) {
        if k == 0 {
            // Nothing to propose (a step with no rows left for proposals): the index
            // catches up the next time it is asked for tokens, so a sequence that never
            // gets proposal rows never pays for its index.
            return;
        }
        self.observe(tokens);
        let len = tokens.len();
        for n in (self.min_n..=self.max_n.min(len)).rev() {
            let suffix = &tokens[len - n..];
            let Some(&at) = self.maps[n - self.min_n].get(&ngram_hash(suffix)) else {
                continue;
            };
            let at = at as usize;
            // A hash collision proposes nothing rather than a guess from elsewhere.
            if tokens[at - n..at] != *suffix {
                continue;
            }
            out.extend_from_slice(&tokens[at..len.min(at + k)]);
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn propose(p: &mut NgramProposer, tokens: &[u32], k: usize) -> Vec<u32> {
        let mut out = Vec::new();
        p.propose(tokens, k, &mut out);
        out
    }

    #[test]
    fn the_longest_recent_match_proposes_what_followed_it() {
        let mut p = NgramProposer::new(1, 3);
        // "5 6 7" occurred followed by 8 9; "7" alone last occurred followed by 1.
        let t = [5, 6, 7, 8, 9, 7, 1, 5, 6, 7];
        assert_eq!(propose(&mut p, &t, 2), [8, 9]);
        assert_eq!(propose(&mut p, &t, 5), [8, 9, 7, 1, 5]);
        // Only the 1-gram matches: its latest occurrence (position 5) wins.
        let t = [3, 7, 2, 7, 4, 9, 7];
        assert_eq!(propose(&mut NgramProposer::new(1, 3), &t, 2), [4, 9]);
    }

    #[test]
    fn no_match_and_k_zero_propose_nothing() {
        let mut p = NgramProposer::new(2, 3);
        assert!(propose(&mut p, &[1, 2, 3, 4], 4).is_empty());
        assert!(propose(&mut p, &[1, 2, 1, 2], 0).is_empty());
        assert!(propose(&mut p, &[1], 3).is_empty());
    }

    #[test]
    fn a_proposal_stops_at_the_end_of_the_sequence() {
        // The match's continuation runs into the suffix itself: what exists is proposed.
        let mut p = NgramProposer::new(1, 2);
        assert_eq!(propose(&mut p, &[4, 4, 4], 5), [4]);
    }

    #[test]
    fn observing_in_pieces_indexes_like_observing_at_once() {
        let t: Vec<u32> = (0..200).map(|i| (i * 7 % 13) as u32).collect();
        let mut whole = NgramProposer::new(1, 4);
        whole.observe(&t);
        let mut pieces = NgramProposer::new(1, 4);
        for end in 1..=t.len() {
            pieces.observe(&t[..end]);
        }
        assert_eq!(pieces.num_seen(), t.len());
        assert_eq!(pieces.maps, whole.maps);
        for k in 1..6 {
            assert_eq!(propose(&mut pieces, &t, k), propose(&mut whole, &t, k));
        }
    }

    #[test]
    fn asking_for_no_tokens_defers_the_index_and_changes_no_proposal() {
        let t: Vec<u32> = (0..120).map(|i| (i * 5 % 11) as u32).collect();
        let mut lazy = NgramProposer::new(2, 4);
        for end in 1..=t.len() {
            assert!(propose(&mut lazy, &t[..end], 0).is_empty());
        }
        assert_eq!(lazy.num_seen(), 0);
        let mut eager = NgramProposer::new(2, 4);
        eager.observe(&t);
        assert_eq!(propose(&mut lazy, &t, 3), propose(&mut eager, &t, 3));
        assert_eq!(lazy.maps, eager.maps);
    }

    #[test]
    fn a_draft_model_reserves_k_rows_for_the_backend_to_fill() {
        let mut p = SequenceProposer::DraftModel(DraftModelProposer);
        let mut out = vec![7];
        p.propose(&[1, 2, 3], 3, &mut out);
        assert_eq!(
            out,
            [
                7,
                DRAFTED_BY_BACKEND,
                DRAFTED_BY_BACKEND,
                DRAFTED_BY_BACKEND
            ]
        );
        assert!(accepts(DRAFTED_BY_BACKEND, 42));
        assert!(accepts(5, 5));
        assert!(!accepts(5, 6));
    }

    #[test]
    #[should_panic(expected = "need 1 <= min_n <= max_n")]
    fn an_empty_range_of_n_is_refused() {
        NgramProposer::new(3, 2);
    }
}
