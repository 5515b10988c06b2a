//! Intrusive doubly linked list over block ids: O(1) push to the back, pop from the front
//! and removal of any member (reviving a cached block that sits in the free queue).

const NIL: u32 = u32::MAX;

#[derive(Debug, Clone)]
pub struct FreeList {
    prev: Vec<u32>,
    next: Vec<u32>,
    member: Vec<bool>,
    head: u32,
    tail: u32,
    len: usize,
}

impl FreeList {
    /// A list holding every id `0..n` in ascending order.
    pub fn full(n: usize) -> Self {
        assert!(n < NIL as usize, "too many blocks");
        let mut list = FreeList {
            prev: vec![NIL; n],
            next: vec![NIL; n],
            member: vec![false; n],
            head: NIL,
            tail: NIL,
            len: 0,
        };
        for id in 0..n as u32 {
            list.push_back(id);
        }
        list
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn push_back(&mut self, id: u32) {
        debug_assert!(!self.member[id as usize]);
        let i = id as usize;
        self.prev[i] = self.tail;
        self.next[i] = NIL;
        if self.tail == NIL {
            self.head = id;
        } else {
            self.next[self.tail as usize] = id;
        }
        self.tail = id;
        self.member[i] = true;
        self.len += 1;
    }

    pub fn push_front(&mut self, id: u32) {
        debug_assert!(!self.member[id as usize]);
        let i = id as usize;
        self.prev[i] = NIL;
        self.next[i] = self.head;
        if self.head == NIL {
            self.tail = id;
        } else {
            self.prev[self.head as usize] = id;
        }
        self.head = id;
        self.member[i] = true;
        self.len += 1;
    }

    pub fn pop_front(&mut self) -> Option<u32> {
        if self.head == NIL {
            return None;
        }
        let id = self.head;
        self.remove(id);
        Some(id)
    }

    /// Unlink `id`, which must be a member.
    pub fn remove(&mut self, id: u32) {
        let i = id as usize;
        debug_assert!(self.member[i]);
        let (p, n) = (self.prev[i], self.next[i]);
        if p == NIL {
            self.head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            self.tail = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.prev[i] = NIL;
        self.next[i] = NIL;
        self.member[i] = false;
        self.len -= 1;
    }

    /// Ids from front (next to be reused) to back.
    pub fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        let mut cur = self.head;
        std::iter::from_fn(move || {
            if cur == NIL {
                None
            } else {
                let id = cur;
                cur = self.next[cur as usize];
                Some(id)
            }
        })
    }
}

/// Ways to break the list on purpose, so that tests can check that the allocator's
/// invariant check notices.
#[cfg(test)]
impl FreeList {
    /// Point `id`'s next link at `next` (a cycle if `next` is earlier in the list).
    pub(crate) fn corrupt_next(&mut self, id: u32, next: u32) {
        self.next[id as usize] = next;
    }

    /// Claim a length the links do not have.
    pub(crate) fn corrupt_len(&mut self, len: usize) {
        self.len = len;
    }
}

#[cfg(test)]
mod tests {
    use super::FreeList;

    #[test]
    fn push_pop_and_remove_keep_the_order_of_the_rest() {
        let mut l = FreeList::full(4);
        assert_eq!(l.iter().collect::<Vec<_>>(), [0, 1, 2, 3]);
        // Remove the head, a middle member and the tail; the rest keep their order.
        l.remove(0);
        l.remove(2);
        l.remove(3);
        assert_eq!(l.iter().collect::<Vec<_>>(), [1]);
        assert_eq!(l.len(), 1);
        l.push_back(3);
        l.push_back(0);
        assert_eq!(l.iter().collect::<Vec<_>>(), [1, 3, 0]);
        assert_eq!(l.pop_front(), Some(1));
        assert_eq!(l.pop_front(), Some(3));
        assert_eq!(l.pop_front(), Some(0));
        assert_eq!(l.pop_front(), None);
        assert_eq!(l.len(), 0);
        assert_eq!(l.iter().count(), 0);
        // An emptied list takes members again from scratch.
        l.push_back(2);
        assert_eq!(l.iter().collect::<Vec<_>>(), [2]);
        assert_eq!(l.pop_front(), Some(2));
        // The front too, on an empty list and before others.
        l.push_front(1);
        l.push_front(3);
        l.push_back(0);
        assert_eq!(l.iter().collect::<Vec<_>>(), [3, 1, 0]);
        l.remove(0);
        l.push_front(2);
        assert_eq!(l.iter().collect::<Vec<_>>(), [2, 3, 1]);
        assert_eq!(
            (l.pop_front(), l.pop_front(), l.pop_front()),
            (Some(2), Some(3), Some(1))
        );
        assert_eq!(l.len(), 0);
    }
}
