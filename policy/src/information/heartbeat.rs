//! Gerofi et al. (DVE) §IV-D: periodic broadcast of the local load, which is
//! also the heartbeat: a peer not heard from within `failure_timeout` is gone.

use std::collections::BTreeMap;
use std::time::Duration;

use rand::RngCore;

use super::{
    Destination, Held, InformationConfig, InformationError, InformationPolicy, InformationStats,
    LoadMessage, MESSAGE_HEADER_BYTES, OWN_LOAD_ENTRY_BYTES, Outgoing, own_entry,
};
use crate::node::{NodeId, PeerLoad};
use crate::time::Instant;

#[derive(Debug, Clone)]
pub struct Heartbeat {
    local: NodeId,
    failure_timeout: Duration,
    last_heard: BTreeMap<NodeId, Held>,
    stats: InformationStats,
}

impl Heartbeat {
    pub fn new(local: NodeId, config: &InformationConfig) -> Self {
        Heartbeat {
            local,
            failure_timeout: Duration::from_millis(config.failure_timeout_ms),
            last_heard: BTreeMap::new(),
            stats: InformationStats::default(),
        }
    }

    /// Peers once heard from that have been silent too long.
    pub fn failed(&self, now: Instant) -> Vec<NodeId> {
        self.last_heard
            .values()
            .filter(|h| h.age(now) > self.failure_timeout)
            .map(|h| h.entry.node)
            .collect()
    }
}

impl InformationPolicy for Heartbeat {
    fn tick(&mut self, now: Instant, own_load: f64, _rng: &mut dyn RngCore) -> Vec<Outgoing> {
        vec![Outgoing {
            to: Destination::Broadcast,
            message: LoadMessage {
                from: self.local,
                entries: vec![own_entry(self.local, own_load, now)],
            },
            wire_bytes: MESSAGE_HEADER_BYTES + OWN_LOAD_ENTRY_BYTES,
        }]
    }

    fn receive(&mut self, message: &LoadMessage, now: Instant) -> Result<(), InformationError> {
        let own = *message.validate(self.local)?;
        self.stats.messages_received += 1;
        // Straight from the source: its latest word replaces ours.
        self.last_heard.insert(
            own.node,
            Held {
                entry: own,
                received_at: now,
                future_dated: false,
            },
        );
        Ok(())
    }

    fn peers(&self, now: Instant) -> Vec<PeerLoad> {
        self.last_heard
            .values()
            .filter(|h| h.age(now) <= self.failure_timeout)
            .map(|h| h.peer(now))
            .collect()
    }

    fn set_members(&mut self, members: &[NodeId]) {
        self.last_heard.retain(|node, _| members.contains(node));
    }

    fn stats(&self) -> InformationStats {
        self.stats
    }
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    use super::*;

    #[test]
    fn broadcasts_and_detects_silent_peers() {
        let config = InformationConfig::default();
        let mut a = Heartbeat::new(NodeId(0), &config);
        let mut b = Heartbeat::new(NodeId(1), &config);
        let out = b.tick(Instant::from_millis(0), 0.7, &mut StdRng::seed_from_u64(0));
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].to, Destination::Broadcast);
        assert_eq!(out[0].wire_bytes, 40);
        a.receive(&out[0].message, Instant::from_millis(1)).unwrap();
        let peers = a.peers(Instant::from_millis(1_000));
        assert_eq!(peers.len(), 1);
        assert_eq!(peers[0].load, 0.7);
        assert_eq!(peers[0].age, Duration::from_millis(999));
        assert!(a.failed(Instant::from_millis(3_000)).is_empty());
        assert_eq!(a.failed(Instant::from_millis(3_502)), vec![NodeId(1)]);
        assert!(
            a.peers(Instant::from_millis(3_502)).is_empty(),
            "a failed peer is no destination"
        );
    }
}
