//! A bounded window of recently seen content hashes, for dropping duplicates.

use std::collections::VecDeque;

use crate::hash::{ContentHash, HashSetOfHashes};

/// Remembers the last `capacity` distinct hashes; the oldest is forgotten first.
#[derive(Debug, Clone)]
pub struct HashWindow {
    capacity: usize,
    set: HashSetOfHashes,
    order: VecDeque<ContentHash>,
}

impl HashWindow {
    pub fn new(capacity: usize) -> HashWindow {
        HashWindow {
            capacity,
            set: HashSetOfHashes::default(),
            order: VecDeque::new(),
        }
    }

    /// Records `hash`; returns `false` if it was already in the window (a duplicate).
    pub fn insert(&mut self, hash: ContentHash) -> bool {
        if self.capacity == 0 {
            return true;
        }
        if !self.set.insert(hash) {
            return false;
        }
        self.order.push_back(hash);
        if self.order.len() > self.capacity
            && let Some(old) = self.order.pop_front()
        {
            self.set.remove(&old);
        }
        true
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn contains(&self, hash: &ContentHash) -> bool {
        self.set.contains(hash)
    }

    pub fn len(&self) -> usize {
        self.order.len()
    }

    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(i: u8) -> ContentHash {
        ContentHash([i; 32])
    }

    #[test]
    fn evicts_oldest_first() {
        let mut w = HashWindow::new(2);
        assert!(w.insert(h(1)));
        assert!(!w.insert(h(1)));
        assert!(w.insert(h(2)));
        assert!(w.insert(h(3)));
        assert!(!w.contains(&h(1)));
        assert!(w.contains(&h(2)) && w.contains(&h(3)));
        assert!(w.insert(h(1)));
        assert_eq!(w.len(), 2);
        let mut off = HashWindow::new(0);
        assert!(off.insert(h(1)) && off.insert(h(1)));
    }
}
