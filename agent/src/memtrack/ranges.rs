//! Sets of address ranges (half-open, merged), for page bookkeeping: which
//! pages the destination holds, which were written, which wait.

use std::collections::BTreeMap;

/// Disjoint, non-adjacent `[start, end)` ranges.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RangeSet {
    /// start -> end.
    ranges: BTreeMap<u64, u64>,
}

impl RangeSet {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn is_empty(&self) -> bool {
        self.ranges.is_empty()
    }

    /// Total length of all ranges.
    pub fn len(&self) -> u64 {
        self.ranges.iter().map(|(s, e)| e - s).sum()
    }

    pub fn iter(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.ranges.iter().map(|(s, e)| (*s, *e))
    }

    pub fn insert(&mut self, mut start: u64, mut end: u64) {
        if start >= end {
            return;
        }
        // Swallow every range that overlaps or touches [start, end).
        let touching: Vec<(u64, u64)> = self
            .ranges
            .range(..=end)
            .rev()
            .take_while(|(_, e)| **e >= start)
            .map(|(s, e)| (*s, *e))
            .collect();
        for (s, e) in touching {
            self.ranges.remove(&s);
            start = start.min(s);
            end = end.max(e);
        }
        self.ranges.insert(start, end);
    }

    pub fn remove(&mut self, start: u64, end: u64) {
        if start >= end {
            return;
        }
        let overlapping: Vec<(u64, u64)> = self
            .ranges
            .range(..end)
            .rev()
            .take_while(|(_, e)| **e > start)
            .map(|(s, e)| (*s, *e))
            .collect();
        for (s, e) in overlapping {
            self.ranges.remove(&s);
            if s < start {
                self.ranges.insert(s, start);
            }
            if e > end {
                self.ranges.insert(end, e);
            }
        }
    }

    pub fn insert_all(&mut self, other: &RangeSet) {
        for (s, e) in other.iter() {
            self.insert(s, e);
        }
    }

    pub fn remove_all(&mut self, other: &RangeSet) {
        for (s, e) in other.iter() {
            self.remove(s, e);
        }
    }

    /// Whether all of `[start, end)` is in the set.
    pub fn contains(&self, start: u64, end: u64) -> bool {
        if start >= end {
            return true;
        }
        match self.ranges.range(..=start).next_back() {
            Some((_, e)) => *e >= end,
            None => false,
        }
    }

    /// The parts of the set inside `[start, end)`.
    pub fn within(&self, start: u64, end: u64) -> RangeSet {
        let mut out = RangeSet::new();
        if start >= end {
            return out;
        }
        let first = self
            .ranges
            .range(..=start)
            .next_back()
            .map(|(s, _)| *s)
            .unwrap_or(start);
        for (s, e) in self.ranges.range(first..end) {
            let (s, e) = ((*s).max(start), (*e).min(end));
            if s < e {
                out.ranges.insert(s, e);
            }
        }
        out
    }

    /// The parts of the set that are also in `other`.
    pub fn intersection(&self, other: &RangeSet) -> RangeSet {
        let mut out = RangeSet::new();
        for (s, e) in other.iter() {
            out.insert_all(&self.within(s, e));
        }
        out
    }

    /// `[start, end)` cut into consecutive pieces, each wholly in the set
    /// (`true`) or wholly outside it (`false`), in address order.
    pub fn split(&self, start: u64, end: u64) -> Vec<(u64, u64, bool)> {
        let mut out = Vec::new();
        let mut at = start;
        for (s, e) in self.within(start, end).iter() {
            if s > at {
                out.push((at, s, false));
            }
            out.push((s, e, true));
            at = e;
        }
        if at < end {
            out.push((at, end, false));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(r: &[(u64, u64)]) -> RangeSet {
        let mut s = RangeSet::new();
        for (a, b) in r {
            s.insert(*a, *b);
        }
        s
    }

    #[test]
    fn inserts_merge_overlapping_and_adjacent_ranges() {
        let s = set(&[(10, 20), (30, 40), (20, 25), (39, 50), (0, 5)]);
        assert_eq!(s.iter().collect::<Vec<_>>(), [(0, 5), (10, 25), (30, 50)]);
        assert_eq!(s.len(), 5 + 15 + 20);
        let s = set(&[(10, 20), (30, 40), (5, 45)]);
        assert_eq!(s.iter().collect::<Vec<_>>(), [(5, 45)]);
    }

    #[test]
    fn removes_cut_ranges() {
        let mut s = set(&[(0, 100)]);
        s.remove(10, 20);
        s.remove(90, 200);
        s.remove(0, 5);
        assert_eq!(s.iter().collect::<Vec<_>>(), [(5, 10), (20, 90)]);
        s.remove(0, 1000);
        assert!(s.is_empty());
    }

    #[test]
    fn contains_within_and_split() {
        let s = set(&[(10, 20), (30, 40)]);
        assert!(s.contains(10, 20));
        assert!(s.contains(12, 15));
        assert!(!s.contains(15, 25));
        assert!(!s.contains(0, 5));
        assert_eq!(
            s.within(15, 35).iter().collect::<Vec<_>>(),
            [(15, 20), (30, 35)]
        );
        assert_eq!(
            s.split(0, 50),
            [
                (0, 10, false),
                (10, 20, true),
                (20, 30, false),
                (30, 40, true),
                (40, 50, false)
            ]
        );
        assert_eq!(s.split(12, 18), [(12, 18, true)]);
        assert_eq!(s.split(22, 28), [(22, 28, false)]);
        let other = set(&[(0, 12), (18, 35)]);
        assert_eq!(
            s.intersection(&other).iter().collect::<Vec<_>>(),
            [(10, 12), (18, 20), (30, 35)]
        );
    }

    /// Against a plain bitmap, over random operations.
    #[test]
    fn agrees_with_a_bitmap() {
        let mut rng = 0x2545_f491_4f6c_dd1du64;
        let mut next = |n: u64| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng % n
        };
        let mut s = RangeSet::new();
        let mut bits = [false; 200];
        for _ in 0..2000 {
            let a = next(200);
            let b = (a + next(30)).min(200);
            if next(2) == 0 {
                s.insert(a, b);
                bits[a as usize..b as usize].fill(true);
            } else {
                s.remove(a, b);
                bits[a as usize..b as usize].fill(false);
            }
            for (i, bit) in bits.iter().enumerate() {
                assert_eq!(s.contains(i as u64, i as u64 + 1), *bit, "at {i}");
            }
            assert_eq!(s.len(), bits.iter().filter(|b| **b).count() as u64);
            // Merged: no two ranges touch.
            let v: Vec<_> = s.iter().collect();
            assert!(v.windows(2).all(|w| w[0].1 < w[1].0));
        }
    }
}
