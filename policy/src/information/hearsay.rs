//! Hearsay gossip (Meehan & Wynne (openMosix) §4): a fixed-size vector of
//! timestamped load entries, the whole of it sent to two peers every period.
//!
//! Slot 0 is the sender's own load. A remote node `k` maps to slot
//! `1 + k mod (n - 1)`, so with more nodes than slots several nodes share a
//! slot, and the fresher entry takes it whichever node it is about, as in
//! Meehan & Wynne (openMosix). A smaller vector therefore holds fewer nodes
//! but fresher news; a larger one more nodes, each renewed only by news of
//! that very node.
//!
//! Freshness, and why it is not the paper's bare timestamp comparison:
//! Meehan & Wynne (openMosix) order entries by their origin timestamps and
//! rely on NTP to make those comparable. Clock skew between nodes is
//! normal, and with bare timestamps a node whose clock runs ahead wins every
//! slot it maps to, for as long as its clock is ahead: its stale load would
//! shadow fresh news.
//! Here:
//! - entries about the same node are ordered by their origin timestamps
//!   (one clock, so the order is exact), except that the node's own word
//!   (the sender's slot 0) always wins;
//! - entries about different nodes are ordered by age: every holder adds
//!   the time it held the entry, on its own clock, so no two clocks are
//!   ever compared;
//! - an entry whose timestamp lies further ahead than `max_clock_skew`
//!   allows is counted as future-dated and from then on ordered by age only,
//!   so it cannot defend its slot by timestamp;
//! - an entry older than `max_age` is dropped on arrival and forgotten when
//!   held that long, so nothing, however dated, wins forever.

use std::time::Duration;

use rand::RngCore;

use super::{
    Destination, GossipTargets, HEARSAY_SLOT_BYTES, Held, InformationConfig, InformationError,
    InformationPolicy, InformationStats, LoadEntry, LoadMessage, MESSAGE_HEADER_BYTES, Outgoing,
    is_future_dated, own_entry,
};
use crate::node::{NodeId, PeerLoad};
use crate::time::Instant;

#[derive(Debug, Clone)]
pub struct Hearsay {
    local: NodeId,
    /// Slots 1..n of the vector (slot 0, the own load, is not stored).
    slots: Vec<Option<Held>>,
    fanout: usize,
    max_age: Duration,
    max_skew: Duration,
    targets: GossipTargets,
    stats: InformationStats,
}

impl Hearsay {
    /// `config.vector_size` counts the own slot, as in
    /// Meehan & Wynne (openMosix).
    pub fn new(local: NodeId, members: &[NodeId], config: &InformationConfig) -> Self {
        Hearsay {
            local,
            slots: vec![None; config.vector_size.max(2) - 1],
            fanout: config.fanout,
            max_age: Duration::from_millis(config.max_age_ms),
            max_skew: Duration::from_millis(config.max_clock_skew_ms),
            targets: GossipTargets::new(
                local,
                members,
                Duration::from_millis(config.recent_contact_ms),
            ),
            stats: InformationStats::default(),
        }
    }

    /// The vector size, own slot included.
    pub fn vector_size(&self) -> usize {
        self.slots.len() + 1
    }

    fn slot_of(&self, node: NodeId) -> usize {
        node.0 as usize % self.slots.len()
    }

    /// Wire size of one message: the whole vector goes, empty slots too.
    pub fn message_bytes(&self) -> usize {
        MESSAGE_HEADER_BYTES + HEARSAY_SLOT_BYTES * self.vector_size()
    }

    fn consider(&mut self, entry: LoadEntry, firsthand: bool, now: Instant) {
        if entry.node == self.local {
            return;
        }
        if entry.age > self.max_age {
            self.stats.stale_dropped += 1;
            return;
        }
        let future_dated = is_future_dated(&entry, now, self.max_skew);
        if future_dated {
            self.stats.future_dated += 1;
        }
        let incoming = Held {
            entry,
            received_at: now,
            future_dated,
        };
        let slot = self.slot_of(entry.node);
        let replace = match &self.slots[slot] {
            None => true,
            Some(held) if held.age(now) > self.max_age => true,
            Some(held) if held.entry.node == entry.node => {
                if firsthand {
                    true
                } else if held.future_dated || future_dated {
                    entry.age < held.age(now)
                } else {
                    entry.stamped_at > held.entry.stamped_at
                }
            }
            Some(held) => entry.age < held.age(now),
        };
        if replace {
            self.slots[slot] = Some(incoming);
        }
    }
}

impl InformationPolicy for Hearsay {
    fn tick(&mut self, now: Instant, own_load: f64, rng: &mut dyn RngCore) -> Vec<Outgoing> {
        let mut entries = vec![own_entry(self.local, own_load, now)];
        entries.extend(
            self.slots
                .iter()
                .flatten()
                .filter(|h| h.age(now) <= self.max_age)
                .map(|h| h.relayed(now)),
        );
        let message = LoadMessage {
            from: self.local,
            entries,
        };
        let wire_bytes = self.message_bytes();
        self.targets
            .choose(self.fanout, now, rng)
            .into_iter()
            .map(|to| Outgoing {
                to: Destination::Node(to),
                message: message.clone(),
                wire_bytes,
            })
            .collect()
    }

    fn receive(&mut self, message: &LoadMessage, now: Instant) -> Result<(), InformationError> {
        message.validate(self.local)?;
        self.stats.messages_received += 1;
        self.targets.note_contact(message.from, now);
        for (i, entry) in message.entries.iter().enumerate() {
            self.consider(*entry, i == 0, now);
        }
        Ok(())
    }

    fn peers(&self, now: Instant) -> Vec<PeerLoad> {
        self.slots
            .iter()
            .flatten()
            .filter(|h| h.age(now) <= self.max_age)
            .map(|h| h.peer(now))
            .collect()
    }

    fn set_members(&mut self, members: &[NodeId]) {
        self.targets.set_members(members);
        for slot in &mut self.slots {
            if slot.is_some_and(|h| !members.contains(&h.entry.node)) {
                *slot = None;
            }
        }
    }

    fn stats(&self) -> InformationStats {
        self.stats
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    use super::*;

    fn config(vector_size: usize) -> InformationConfig {
        InformationConfig {
            kind: super::super::InformationKind::Hearsay,
            vector_size,
            max_age_ms: 10_000,
            max_clock_skew_ms: 500,
            ..InformationConfig::default()
        }
    }

    fn members(n: u32) -> Vec<NodeId> {
        (0..n).map(NodeId).collect()
    }

    fn entry(node: u32, load: f64, stamped_ms: u64, age_ms: u64) -> LoadEntry {
        LoadEntry {
            node: NodeId(node),
            load,
            stamped_at: Instant::from_millis(stamped_ms),
            age: Duration::from_millis(age_ms),
        }
    }

    /// A message from `from` (own entry first) carrying `hearsay`.
    fn msg(from: u32, now_ms: u64, hearsay: Vec<LoadEntry>) -> LoadMessage {
        let mut entries = vec![entry(from, 1.0, now_ms, 0)];
        entries.extend(hearsay);
        LoadMessage {
            from: NodeId(from),
            entries,
        }
    }

    #[test]
    fn whole_vector_is_sent_with_the_seed_sizes() {
        let mut h = Hearsay::new(NodeId(0), &members(20), &config(8));
        let out = h.tick(Instant::from_millis(0), 2.0, &mut StdRng::seed_from_u64(0));
        assert_eq!(out.len(), 2);
        assert!(out.iter().all(|o| o.wire_bytes == 300));
        assert_eq!(
            Hearsay::new(NodeId(0), &members(20), &config(20)).message_bytes(),
            732
        );
    }

    #[test]
    fn fresher_news_takes_a_shared_slot_whichever_node_it_is_about() {
        // Vector of 3: two remote slots; nodes 1 and 3 share slot 1.
        let mut h = Hearsay::new(NodeId(0), &members(5), &config(3));
        let t = Instant::from_millis(10_000);
        h.receive(&msg(2, 10_000, vec![entry(1, 5.0, 9_000, 1_000)]), t)
            .unwrap();
        assert!(h.peers(t).iter().any(|p| p.node == NodeId(1)));
        // Older news of node 3 does not displace node 1.
        h.receive(&msg(2, 10_000, vec![entry(3, 7.0, 8_000, 2_000)]), t)
            .unwrap();
        assert!(h.peers(t).iter().any(|p| p.node == NodeId(1)));
        // Fresher news of node 3 does.
        h.receive(&msg(2, 10_000, vec![entry(3, 7.0, 9_800, 200)]), t)
            .unwrap();
        let peers = h.peers(t);
        assert!(peers.iter().any(|p| p.node == NodeId(3) && p.load == 7.0));
        assert!(!peers.iter().any(|p| p.node == NodeId(1)));
    }

    #[test]
    fn relayed_entries_age_on_each_holder() {
        let mut a = Hearsay::new(NodeId(0), &members(4), &config(4));
        a.receive(
            &msg(1, 0, vec![entry(2, 3.0, 0, 400)]),
            Instant::from_millis(1_000),
        )
        .unwrap();
        let out = a.tick(
            Instant::from_millis(1_600),
            0.0,
            &mut StdRng::seed_from_u64(0),
        );
        let relayed = out[0]
            .message
            .entries
            .iter()
            .find(|e| e.node == NodeId(2))
            .unwrap();
        assert_eq!(
            relayed.age,
            Duration::from_millis(1_000),
            "400 ms old on arrival, held 600 ms"
        );
        assert_eq!(
            relayed.stamped_at,
            Instant::ZERO,
            "the origin stamp travels unchanged"
        );
    }

    #[test]
    fn a_future_dated_entry_is_displaced_by_fresher_news() {
        let mut h = Hearsay::new(NodeId(0), &members(4), &config(4));
        let t0 = 100_000;
        // Node 2's clock is an hour ahead: its entry, relayed, claims a
        // timestamp far beyond anything the skew allows.
        h.receive(
            &msg(1, t0, vec![entry(2, 9.0, t0 + 3_600_000, 100)]),
            Instant::from_millis(t0),
        )
        .unwrap();
        assert_eq!(h.stats().future_dated, 1);
        // Node 2's clock is stepped back; its next entry has a smaller stamp
        // but is fresher: it must win, by age.
        h.receive(
            &msg(3, t0 + 2_000, vec![entry(2, 1.0, t0 + 1_900, 100)]),
            Instant::from_millis(t0 + 2_000),
        )
        .unwrap();
        let p = h.peers(Instant::from_millis(t0 + 2_000));
        assert_eq!(
            p.iter().find(|p| p.node == NodeId(2)).map(|p| p.load),
            Some(1.0)
        );
    }

    #[test]
    fn stale_news_is_dropped_and_old_beliefs_expire() {
        let mut h = Hearsay::new(NodeId(0), &members(4), &config(4));
        h.receive(
            &msg(1, 0, vec![entry(2, 3.0, 0, 10_001)]),
            Instant::from_millis(0),
        )
        .unwrap();
        assert_eq!(h.stats().stale_dropped, 1);
        assert_eq!(h.peers(Instant::from_millis(0)).len(), 1, "only the sender");
        assert!(
            h.peers(Instant::from_millis(10_001)).is_empty(),
            "the sender's word expired too"
        );
    }

    #[test]
    fn entries_about_ourselves_are_ignored() {
        let mut h = Hearsay::new(NodeId(0), &members(4), &config(4));
        h.receive(
            &msg(1, 0, vec![entry(0, 9.0, 0, 10)]),
            Instant::from_millis(0),
        )
        .unwrap();
        assert!(
            h.peers(Instant::from_millis(0))
                .iter()
                .all(|p| p.node != NodeId(0))
        );
    }

    fn arbitrary_entry() -> impl Strategy<Value = (u32, u64, u64, u64)> {
        // node, stamp offset (some far in the future), age, delay before arrival
        (1u32..30, 0u64..200_000, 0u64..15_000, 0u64..3_000)
    }

    proptest! {
        /// Whatever arrives, the vector never holds more entries than its
        /// size allows, never the local node, each node at most once, and
        /// nothing older than max_age.
        #[test]
        fn vector_stays_bounded_and_fresh(size in 2usize..24, news in proptest::collection::vec(arbitrary_entry(), 1..200)) {
            let mut h = Hearsay::new(NodeId(0), &members(30), &config(size));
            let mut now = 0u64;
            for (node, stamp, age, delay) in news {
                now += delay;
                let sender = if node == 29 { 28 } else { 29 };
                let m = msg(sender, now, vec![entry(node, node as f64, stamp, age)]);
                h.receive(&m, Instant::from_millis(now)).unwrap();
                let peers = h.peers(Instant::from_millis(now));
                prop_assert!(peers.len() < size);
                let mut nodes: Vec<NodeId> = peers.iter().map(|p| p.node).collect();
                nodes.sort();
                nodes.dedup();
                prop_assert_eq!(nodes.len(), peers.len());
                prop_assert!(peers.iter().all(|p| p.node != NodeId(0) && p.age <= Duration::from_millis(10_000)));
            }
        }

        /// Of two entries about nodes sharing a slot, the one with the
        /// smaller age (the fresher by the local clock) is kept, whatever
        /// their origin timestamps say.
        #[test]
        fn keeps_the_freshest_of_a_shared_slot(stamp_a in 0u64..10_000_000, stamp_b in 0u64..10_000_000, age_a in 0u64..9_000, age_b in 0u64..9_000) {
            prop_assume!(age_a != age_b);
            // Vector of 3: nodes 1 and 3 share slot 1.
            let mut h = Hearsay::new(NodeId(0), &members(4), &config(3));
            let now = Instant::from_millis(5_000_000);
            h.receive(&msg(2, 0, vec![entry(1, 1.0, stamp_a, age_a), entry(3, 3.0, stamp_b, age_b)]), now).unwrap();
            let held: Vec<NodeId> = h.peers(now).iter().map(|p| p.node).filter(|&n| n != NodeId(2)).collect();
            let fresher = if age_a < age_b { NodeId(1) } else { NodeId(3) };
            prop_assert_eq!(held, vec![fresher]);
        }

        /// A future-dated entry cannot defend its slot by its timestamp:
        /// any fresher news of the same node displaces it at once, even with
        /// a much smaller (honest) stamp.
        #[test]
        fn future_dated_entries_do_not_win_forever(ahead in 501u64..100_000_000, later in 0u64..20_000) {
            let mut h = Hearsay::new(NodeId(0), &members(4), &config(4));
            let t0 = 1_000_000u64;
            h.receive(&msg(1, t0, vec![entry(2, 9.0, t0 + ahead, 0)]), Instant::from_millis(t0)).unwrap();
            let t1 = t0 + 1 + later;
            h.receive(&msg(3, t1, vec![entry(2, 1.0, t1, 0)]), Instant::from_millis(t1)).unwrap();
            let load = h.peers(Instant::from_millis(t1)).iter().find(|p| p.node == NodeId(2)).map(|p| p.load);
            prop_assert_eq!(load, Some(1.0));
        }

        /// Without skew, entries about one node are ordered by its own
        /// timestamps (Meehan & Wynne (openMosix)), the older never displacing
        /// the newer.
        #[test]
        fn same_node_entries_follow_origin_timestamps(stamp_a in 0u64..400, stamp_b in 0u64..400, age_a in 0u64..5_000, age_b in 0u64..5_000) {
            prop_assume!(stamp_a != stamp_b);
            let mut h = Hearsay::new(NodeId(0), &members(4), &config(4));
            let now = 10_000u64;
            h.receive(&msg(1, now, vec![entry(2, 1.0, now - 5_000 + stamp_a, age_a)]), Instant::from_millis(now)).unwrap();
            h.receive(&msg(3, now, vec![entry(2, 2.0, now - 5_000 + stamp_b, age_b)]), Instant::from_millis(now)).unwrap();
            let load = h.peers(Instant::from_millis(now)).iter().find(|p| p.node == NodeId(2)).map(|p| p.load);
            prop_assert_eq!(load, Some(if stamp_b > stamp_a { 2.0 } else { 1.0 }));
        }
    }
}
