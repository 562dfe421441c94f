//! The pages of one restored process still to install: ranges of its
//! addresses, each with the offset in the page store its content is at.
//!
//! The two start equal (the store keeps a page at the offset of the address
//! it had when it was dumped); an `mremap` of the process moves a range's
//! addresses and not its offset.

use std::collections::BTreeMap;

/// A piece to install: `len` bytes at `dst` in the process, from `src` in
/// the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chunk {
    pub dst: u64,
    pub src: u64,
    pub len: u64,
}

impl Chunk {
    pub fn end(&self) -> u64 {
        self.dst + self.len
    }

    /// The part of the chunk from `dst + skip` on.
    pub fn after(&self, skip: u64) -> Chunk {
        Chunk {
            dst: self.dst + skip,
            src: self.src + skip,
            len: self.len - skip,
        }
    }
}

/// Disjoint ranges, by start address: start -> (end, store offset).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Pending {
    ranges: BTreeMap<u64, (u64, u64)>,
}

impl Pending {
    /// Ranges whose content is at the offset of their address.
    pub fn new(runs: impl IntoIterator<Item = (u64, u64)>) -> Self {
        let mut p = Pending::default();
        for (start, end) in runs {
            if start < end {
                p.remove(start, end);
                p.ranges.insert(start, (end, start));
            }
        }
        p
    }

    pub fn is_empty(&self) -> bool {
        self.ranges.is_empty()
    }

    /// Bytes still to install.
    pub fn bytes(&self) -> u64 {
        self.ranges.iter().map(|(s, (e, _))| e - s).sum()
    }

    /// Takes up to `max` bytes from the lowest range.
    pub fn take_first(&mut self, max: u64) -> Option<Chunk> {
        let (&start, &(end, src)) = self.ranges.iter().next()?;
        Some(self.cut(start, end, src, start, max))
    }

    /// Takes up to `max` bytes from `addr` (a page address) on, if `addr`
    /// is pending.
    pub fn take_at(&mut self, addr: u64, max: u64) -> Option<Chunk> {
        let (&start, &(end, src)) = self.ranges.range(..=addr).next_back()?;
        (addr < end).then(|| self.cut(start, end, src, addr, max))
    }

    /// Removes `[at, at + max)` (bounded by the range's end) from the range
    /// `[start, end)` at `src`, and returns it.
    fn cut(&mut self, start: u64, end: u64, src: u64, at: u64, max: u64) -> Chunk {
        let len = (end - at).min(max);
        self.ranges.remove(&start);
        if start < at {
            self.ranges.insert(start, (at, src));
        }
        if at + len < end {
            self.ranges
                .insert(at + len, (end, src + (at + len - start)));
        }
        Chunk {
            dst: at,
            src: src + (at - start),
            len,
        }
    }

    /// Puts a chunk (or what is left of one) back.
    pub fn put_back(&mut self, c: Chunk) {
        if c.len > 0 {
            self.remove(c.dst, c.end());
            self.ranges.insert(c.dst, (c.end(), c.src));
        }
    }

    /// Drops whatever is pending in `[start, end)` (unmapped, or dropped
    /// by the process).
    pub fn remove(&mut self, start: u64, end: u64) {
        self.extract(start, end);
    }

    /// Takes out the parts in `[start, end)`, in address order.
    fn extract(&mut self, start: u64, end: u64) -> Vec<Chunk> {
        if start >= end {
            return Vec::new();
        }
        let first = self
            .ranges
            .range(..start)
            .next_back()
            .filter(|(_, (e, _))| *e > start)
            .map_or(start, |(s, _)| *s);
        let hit: Vec<(u64, u64, u64)> = self
            .ranges
            .range(first..end)
            .map(|(s, (e, src))| (*s, *e, *src))
            .collect();
        let mut out = Vec::new();
        for (s, e, src) in hit {
            self.ranges.remove(&s);
            if s < start {
                self.ranges.insert(s, (start, src));
            }
            if e > end {
                self.ranges.insert(end, (e, src + (end - s)));
            }
            let (a, b) = (s.max(start), e.min(end));
            out.push(Chunk {
                dst: a,
                src: src + (a - s),
                len: b - a,
            });
        }
        out
    }

    /// `mremap` moved `[from, from + len)` to `to`: what was pending there
    /// is now pending at the new addresses (from the same store offsets),
    /// and whatever was pending where it landed is gone (the move replaced
    /// it).
    pub fn remap(&mut self, from: u64, to: u64, len: u64) {
        let moved = self.extract(from, from + len);
        self.remove(to, to + len);
        for c in moved {
            let dst = c.dst - from + to;
            self.ranges.insert(dst, (dst + c.len, c.src));
        }
    }

    /// Takes out every part whose content is at store offsets in `[a, b)`
    /// (pages that just arrived in the store), in address order. Where no
    /// `mremap` moved anything the offsets are the addresses and the
    /// lookup is by address; otherwise every range is looked at.
    pub fn extract_stored(&mut self, a: u64, b: u64) -> Vec<Chunk> {
        if a >= b {
            return Vec::new();
        }
        let mut out = Vec::new();
        let moved: Vec<(u64, u64, u64)> = self
            .ranges
            .iter()
            .filter(|(s, (_, src))| *s != src)
            .map(|(s, (e, src))| (*s, *e, *src))
            .collect();
        if moved.is_empty() {
            return self.extract(a, b);
        }
        for (s, e, src) in self
            .ranges
            .iter()
            .map(|(s, (e, src))| (*s, *e, *src))
            .filter(|(s, e, src)| *src < b && a < src + (e - s))
            .collect::<Vec<_>>()
        {
            // The part of [s, e) whose offsets are in [a, b).
            let from = s + a.saturating_sub(src);
            let to = e.min(s + (b - src));
            out.extend(self.extract(from, to));
        }
        out.sort_unstable_by_key(|c| c.dst);
        out
    }

    /// Whether the page at `addr` is pending.
    pub fn contains(&self, addr: u64) -> bool {
        self.ranges
            .range(..=addr)
            .next_back()
            .is_some_and(|(_, (e, _))| addr < *e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn list(p: &Pending) -> Vec<(u64, u64, u64)> {
        p.ranges
            .iter()
            .map(|(s, (e, src))| (*s, *e, *src))
            .collect()
    }

    #[test]
    fn takes_in_chunks_from_the_lowest_range() {
        let mut p = Pending::new([(0x10000, 0x13000), (0x1000, 0x2000)]);
        assert_eq!(p.bytes(), 0x4000);
        assert_eq!(
            p.take_first(0x2000),
            Some(Chunk {
                dst: 0x1000,
                src: 0x1000,
                len: 0x1000
            })
        );
        assert_eq!(
            p.take_first(0x2000),
            Some(Chunk {
                dst: 0x10000,
                src: 0x10000,
                len: 0x2000
            })
        );
        assert_eq!(list(&p), [(0x12000, 0x13000, 0x12000)]);
        p.take_first(0x2000);
        assert!(p.is_empty());
        assert_eq!(p.take_first(0x1000), None);
    }

    #[test]
    fn takes_at_a_fault_and_leaves_both_sides() {
        let mut p = Pending::new([(0x10000, 0x20000)]);
        assert_eq!(p.take_at(0x30000, 0x1000), None);
        let c = p.take_at(0x14000, 0x2000).unwrap();
        assert_eq!((c.dst, c.src, c.len), (0x14000, 0x14000, 0x2000));
        assert_eq!(
            list(&p),
            [(0x10000, 0x14000, 0x10000), (0x16000, 0x20000, 0x16000)]
        );
        assert!(!p.contains(0x15000));
        assert!(p.contains(0x16000));
        // Near the end: bounded by the range.
        let c = p.take_at(0x1f000, 0x4000).unwrap();
        assert_eq!(c.len, 0x1000);
        p.put_back(c);
        assert!(p.contains(0x1f000));
    }

    #[test]
    fn removal_cuts_ranges_it_overlaps() {
        let mut p = Pending::new([(0x1000, 0x5000), (0x8000, 0x9000)]);
        p.remove(0x2000, 0x8800);
        assert_eq!(
            list(&p),
            [(0x1000, 0x2000, 0x1000), (0x8800, 0x9000, 0x8800)]
        );
        p.remove(0, u64::MAX);
        assert!(p.is_empty());
    }

    #[test]
    fn what_arrived_in_the_store_is_found_by_offset_even_after_a_move() {
        let mut p = Pending::new([(0x1000, 0x5000), (0x8000, 0x9000)]);
        let got = p.extract_stored(0x2000, 0x8800);
        assert_eq!(
            got.iter()
                .map(|c| (c.dst, c.src, c.len))
                .collect::<Vec<_>>(),
            [(0x2000, 0x2000, 0x3000), (0x8000, 0x8000, 0x800)]
        );
        assert_eq!(
            list(&p),
            [(0x1000, 0x2000, 0x1000), (0x8800, 0x9000, 0x8800)]
        );
        // Moved: the content of offset 0x1000 now sits at 0x40000.
        p.remap(0x1000, 0x40000, 0x1000);
        let got = p.extract_stored(0x1000, 0x1800);
        assert_eq!(
            got.iter()
                .map(|c| (c.dst, c.src, c.len))
                .collect::<Vec<_>>(),
            [(0x40000, 0x1000, 0x800)]
        );
        assert_eq!(
            list(&p),
            [(0x8800, 0x9000, 0x8800), (0x40800, 0x41000, 0x1800)]
        );
        assert!(p.extract_stored(0x20000, 0x30000).is_empty());
    }

    #[test]
    fn a_remap_moves_addresses_not_store_offsets() {
        let mut p = Pending::new([(0x1000, 0x4000), (0x20000, 0x21000)]);
        // Move the middle page of the first range onto the second's.
        p.remap(0x2000, 0x20000, 0x1000);
        assert_eq!(
            list(&p),
            [
                (0x1000, 0x2000, 0x1000),
                (0x3000, 0x4000, 0x3000),
                (0x20000, 0x21000, 0x2000)
            ]
        );
        let c = p.take_at(0x20000, 0x1000).unwrap();
        assert_eq!((c.dst, c.src), (0x20000, 0x2000));
        assert_eq!(c.after(0).end(), 0x21000);
    }
}
