//! What a commit reports: one `StepEvent` per accepted token (or per request that ended
//! without one), and the same events as columns, the form the Python bindings hand out as
//! numpy arrays so that a caller touches no per-event object.

use crate::sequence::FinishReason;

/// What happened to one request in a step. `Scheduler::request_id(slot)` names the request
/// until the next `schedule` (slots are reused only from then on).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepEvent {
    pub slot: usize,
    pub token: Option<u32>,
    pub finish: Option<FinishReason>,
}

/// A step's events as columns: event `i` is row `i` of each. Dtypes are those numpy gets.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepEvents {
    /// The slot of each event's request (`StepEvent::slot`).
    pub slots: Vec<i64>,
    /// The accepted token, or `NO_TOKEN` for an event without one.
    pub token_ids: Vec<i64>,
    /// `FinishReason::code` of an event that ends its request, `NOT_FINISHED` otherwise.
    pub finish_reasons: Vec<u8>,
    /// Events that end their request (rows whose finish reason is not `NOT_FINISHED`).
    pub num_finished: usize,
}

impl StepEvents {
    /// `token_ids` of an event without a token (token ids are `u32` below `u32::MAX`).
    pub const NO_TOKEN: i64 = -1;
    /// `finish_reasons` of an event whose request goes on.
    pub const NOT_FINISHED: u8 = 0;

    pub fn with_capacity(n: usize) -> Self {
        StepEvents {
            slots: Vec::with_capacity(n),
            token_ids: Vec::with_capacity(n),
            finish_reasons: Vec::with_capacity(n),
            num_finished: 0,
        }
    }

    pub fn push(&mut self, e: StepEvent) {
        self.slots.push(e.slot as i64);
        self.token_ids
            .push(e.token.map_or(Self::NO_TOKEN, i64::from));
        self.finish_reasons
            .push(e.finish.map_or(Self::NOT_FINISHED, FinishReason::code));
        self.num_finished += usize::from(e.finish.is_some());
    }

    pub fn len(&self) -> usize {
        self.slots.len()
    }
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// Event `i` as a row (panics past `len`).
    pub fn get(&self, i: usize) -> StepEvent {
        StepEvent {
            slot: self.slots[i] as usize,
            token: u32::try_from(self.token_ids[i]).ok(),
            finish: FinishReason::from_code(self.finish_reasons[i]),
        }
    }

    pub fn iter(&self) -> impl ExactSizeIterator<Item = StepEvent> + '_ {
        (0..self.len()).map(|i| self.get(i))
    }
}

impl From<&[StepEvent]> for StepEvents {
    fn from(events: &[StepEvent]) -> Self {
        let mut out = StepEvents::with_capacity(events.len());
        for &e in events {
            out.push(e);
        }
        out
    }
}

impl FromIterator<StepEvent> for StepEvents {
    fn from_iter<I: IntoIterator<Item = StepEvent>>(iter: I) -> Self {
        let iter = iter.into_iter();
        let mut out = StepEvents::with_capacity(iter.size_hint().0);
        for e in iter {
            out.push(e);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ROWS: [StepEvent; 4] = [
        StepEvent {
            slot: 3,
            token: None,
            finish: Some(FinishReason::Length),
        },
        StepEvent {
            slot: 0,
            token: Some(0),
            finish: None,
        },
        StepEvent {
            slot: 7,
            token: Some(u32::MAX - 1),
            finish: Some(FinishReason::Stop),
        },
        StepEvent {
            slot: 1,
            token: Some(5),
            finish: Some(FinishReason::Abort),
        },
    ];

    #[test]
    fn columns_hold_every_field_and_give_the_rows_back() {
        let cols = StepEvents::from(&ROWS[..]);
        assert_eq!(cols.slots, [3, 0, 7, 1]);
        assert_eq!(cols.token_ids, [-1, 0, i64::from(u32::MAX - 1), 5]);
        assert_eq!(cols.finish_reasons, [1, 0, 2, 3]);
        assert_eq!(cols.num_finished, 3);
        assert_eq!(cols.len(), 4);
        assert!(!cols.is_empty());
        assert_eq!(cols.iter().collect::<Vec<_>>(), ROWS);
        assert_eq!(ROWS.iter().copied().collect::<StepEvents>(), cols);
        assert!(StepEvents::default().is_empty());
    }

    #[test]
    fn with_capacity_reserves_every_column() {
        let cols = StepEvents::with_capacity(8);
        assert!(cols.is_empty());
        assert!(cols.slots.capacity() >= 8);
        assert!(cols.token_ids.capacity() >= 8);
        assert!(cols.finish_reasons.capacity() >= 8);
    }

    #[test]
    fn finish_reason_codes_round_trip_and_zero_means_not_finished() {
        for r in [
            FinishReason::Length,
            FinishReason::Stop,
            FinishReason::Abort,
        ] {
            assert_ne!(r.code(), StepEvents::NOT_FINISHED);
            assert_eq!(FinishReason::from_code(r.code()), Some(r));
        }
        assert_eq!(FinishReason::from_code(StepEvents::NOT_FINISHED), None);
        assert_eq!(FinishReason::from_code(4), None);
    }
}
