//! The event queue: virtual time in milliseconds; events at the same time
//! run in the order they were scheduled, so runs are reproducible.

use std::cmp::Ordering;
use std::collections::BinaryHeap;
use std::time::Duration;

use crate::time::{Instant, millis};

struct Scheduled<E> {
    at: u64,
    seq: u64,
    event: E,
}

impl<E> PartialEq for Scheduled<E> {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.seq) == (other.at, other.seq)
    }
}

impl<E> Eq for Scheduled<E> {}

impl<E> PartialOrd for Scheduled<E> {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl<E> Ord for Scheduled<E> {
    fn cmp(&self, other: &Self) -> Ordering {
        // BinaryHeap is a max-heap: invert for earliest first.
        (other.at, other.seq).cmp(&(self.at, self.seq))
    }
}

pub struct EventQueue<E> {
    now: u64,
    next_seq: u64,
    heap: BinaryHeap<Scheduled<E>>,
}

impl<E> std::fmt::Debug for EventQueue<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventQueue")
            .field("now", &self.now)
            .field("pending", &self.heap.len())
            .finish()
    }
}

impl<E> Default for EventQueue<E> {
    fn default() -> Self {
        EventQueue {
            now: 0,
            next_seq: 0,
            heap: BinaryHeap::new(),
        }
    }
}

impl<E> EventQueue<E> {
    pub fn now(&self) -> Instant {
        Instant::from_millis(self.now)
    }

    pub fn schedule_at(&mut self, at: Instant, event: E) {
        // Never in the past: an event "at 0 ms from now" runs after the
        // current one.
        let at = at.as_millis().max(self.now);
        self.heap.push(Scheduled {
            at,
            seq: self.next_seq,
            event,
        });
        self.next_seq += 1;
    }

    pub fn schedule_in(&mut self, delay: Duration, event: E) {
        self.schedule_at(
            Instant::from_millis(self.now.saturating_add(millis(delay))),
            event,
        );
    }

    /// The next event, advancing the clock to it.
    pub fn pop(&mut self) -> Option<E> {
        let s = self.heap.pop()?;
        self.now = s.at;
        Some(s.event)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn earliest_first_then_fifo() {
        let mut q = EventQueue::default();
        q.schedule_in(Duration::from_millis(5), "b");
        q.schedule_in(Duration::from_millis(1), "a");
        q.schedule_in(Duration::from_millis(5), "c");
        assert_eq!(q.pop(), Some("a"));
        assert_eq!(q.now(), Instant::from_millis(1));
        q.schedule_at(Instant::ZERO, "now");
        assert_eq!(q.pop(), Some("now"), "the past is clamped to now");
        assert_eq!(q.pop(), Some("b"));
        assert_eq!(q.pop(), Some("c"));
        assert_eq!(q.pop(), None);
    }
}
