//! Standard openMosix (Meehan & Wynne (openMosix) §3): each period a node
//! tells two peers its own load; a receiver keeps the last `vector_size`
//! messages in a circular queue, the oldest overwritten, duplicates of one
//! sender included.

use std::collections::VecDeque;
use std::time::Duration;

use rand::RngCore;

use super::{
    Destination, GossipTargets, Held, InformationConfig, InformationError, InformationPolicy,
    InformationStats, LoadMessage, MESSAGE_HEADER_BYTES, OWN_LOAD_ENTRY_BYTES, Outgoing, own_entry,
};
use crate::node::{NodeId, PeerLoad};
use crate::time::Instant;

#[derive(Debug, Clone)]
pub struct OwnLoadOnly {
    local: NodeId,
    capacity: usize,
    fanout: usize,
    max_age: Duration,
    queue: VecDeque<Held>,
    targets: GossipTargets,
    stats: InformationStats,
}

impl OwnLoadOnly {
    pub fn new(local: NodeId, members: &[NodeId], config: &InformationConfig) -> Self {
        OwnLoadOnly {
            local,
            capacity: config.vector_size.max(1),
            fanout: config.fanout,
            max_age: Duration::from_millis(config.max_age_ms),
            queue: VecDeque::new(),
            targets: GossipTargets::new(
                local,
                members,
                Duration::from_millis(config.recent_contact_ms),
            ),
            stats: InformationStats::default(),
        }
    }
}

impl InformationPolicy for OwnLoadOnly {
    fn tick(&mut self, now: Instant, own_load: f64, rng: &mut dyn RngCore) -> Vec<Outgoing> {
        let message = LoadMessage {
            from: self.local,
            entries: vec![own_entry(self.local, own_load, now)],
        };
        self.targets
            .choose(self.fanout, now, rng)
            .into_iter()
            .map(|to| Outgoing {
                to: Destination::Node(to),
                message: message.clone(),
                wire_bytes: MESSAGE_HEADER_BYTES + OWN_LOAD_ENTRY_BYTES,
            })
            .collect()
    }

    fn receive(&mut self, message: &LoadMessage, now: Instant) -> Result<(), InformationError> {
        let own = *message.validate(self.local)?;
        self.stats.messages_received += 1;
        self.targets.note_contact(message.from, now);
        if self.queue.len() == self.capacity {
            self.queue.pop_front();
        }
        self.queue.push_back(Held {
            entry: own,
            received_at: now,
            future_dated: false,
        });
        Ok(())
    }

    fn peers(&self, now: Instant) -> Vec<PeerLoad> {
        // The queue may hold one sender several times: the newest counts.
        let mut peers: Vec<PeerLoad> = Vec::new();
        for held in self
            .queue
            .iter()
            .rev()
            .filter(|h| h.age(now) <= self.max_age)
        {
            if !peers.iter().any(|p| p.node == held.entry.node) {
                peers.push(held.peer(now));
            }
        }
        peers
    }

    fn set_members(&mut self, members: &[NodeId]) {
        self.targets.set_members(members);
        self.queue.retain(|h| members.contains(&h.entry.node));
    }

    fn stats(&self) -> InformationStats {
        self.stats
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::information::LoadEntry;

    fn msg(from: u32, load: f64) -> LoadMessage {
        LoadMessage {
            from: NodeId(from),
            entries: vec![LoadEntry {
                node: NodeId(from),
                load,
                stamped_at: Instant::ZERO,
                age: Duration::ZERO,
            }],
        }
    }

    #[test]
    fn circular_queue_keeps_the_last_messages_newest_per_sender() {
        let config = InformationConfig {
            vector_size: 3,
            ..InformationConfig::default()
        };
        let members: Vec<NodeId> = (0..10).map(NodeId).collect();
        let mut p = OwnLoadOnly::new(NodeId(0), &members, &config);
        let t = Instant::from_millis;
        p.receive(&msg(1, 1.0), t(0)).unwrap();
        p.receive(&msg(2, 2.0), t(1)).unwrap();
        p.receive(&msg(1, 1.5), t(2)).unwrap();
        p.receive(&msg(3, 3.0), t(3)).unwrap();
        let mut peers = p.peers(t(4));
        peers.sort_by_key(|p| p.node);
        let loads: Vec<(u32, f64)> = peers.iter().map(|p| (p.node.0, p.load)).collect();
        assert_eq!(loads, vec![(1, 1.5), (2, 2.0), (3, 3.0)]);
        p.receive(&msg(4, 4.0), t(5)).unwrap();
        assert!(
            !p.peers(t(5)).iter().any(|p| p.node == NodeId(2)),
            "oldest overwritten"
        );
    }
}
