//! Picking gossip targets the openMosix way (Meehan & Wynne (openMosix) §3):
//! one node from those that contacted us recently, the others from all
//! nodes, so that load flows back to who asked and still reaches everyone
//! eventually.

use std::collections::BTreeMap;
use std::time::Duration;

use rand::RngCore;
use rand::seq::IndexedRandom;

use crate::node::NodeId;
use crate::time::Instant;

#[derive(Debug, Clone)]
pub struct GossipTargets {
    local: NodeId,
    members: Vec<NodeId>,
    last_contact: BTreeMap<NodeId, Instant>,
    recent_window: Duration,
}

impl GossipTargets {
    pub fn new(local: NodeId, members: &[NodeId], recent_window: Duration) -> Self {
        let mut t = GossipTargets {
            local,
            members: Vec::new(),
            last_contact: BTreeMap::new(),
            recent_window,
        };
        t.set_members(members);
        t
    }

    pub fn set_members(&mut self, members: &[NodeId]) {
        let mut members: Vec<NodeId> = members
            .iter()
            .copied()
            .filter(|&m| m != self.local)
            .collect();
        members.sort();
        members.dedup();
        self.last_contact
            .retain(|node, _| members.binary_search(node).is_ok());
        self.members = members;
    }

    pub fn note_contact(&mut self, from: NodeId, now: Instant) {
        if self.members.binary_search(&from).is_ok() {
            self.last_contact.insert(from, now);
        }
    }

    /// Up to `fanout` distinct peers: the first from the recent group when
    /// it is not empty, the rest from all members.
    pub fn choose(&self, fanout: usize, now: Instant, rng: &mut dyn RngCore) -> Vec<NodeId> {
        let mut chosen = Vec::with_capacity(fanout);
        let recent: Vec<NodeId> = self
            .last_contact
            .iter()
            .filter(|&(_, &at)| now.saturating_duration_since(at) <= self.recent_window)
            .map(|(&node, _)| node)
            .collect();
        if fanout > 0
            && let Some(&node) = recent.choose(rng)
        {
            chosen.push(node);
        }
        while chosen.len() < fanout.min(self.members.len()) {
            let rest: Vec<NodeId> = self
                .members
                .iter()
                .copied()
                .filter(|m| !chosen.contains(m))
                .collect();
            match rest.choose(rng) {
                Some(&node) => chosen.push(node),
                None => break,
            }
        }
        chosen
    }
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    use super::*;

    #[test]
    fn one_target_comes_from_recent_contacts() {
        let members: Vec<NodeId> = (0..20).map(NodeId).collect();
        let mut t = GossipTargets::new(NodeId(0), &members, Duration::from_secs(5));
        t.note_contact(NodeId(7), Instant::from_millis(1_000));
        let mut rng = StdRng::seed_from_u64(3);
        for _ in 0..20 {
            let c = t.choose(2, Instant::from_millis(2_000), &mut rng);
            assert_eq!(c.len(), 2);
            assert_eq!(c[0], NodeId(7));
            assert_ne!(c[1], NodeId(7), "targets are distinct");
            assert!(!c.contains(&NodeId(0)), "never ourselves");
        }
        // Once the contact is old, both come from all members.
        let c = t.choose(2, Instant::from_millis(60_000), &mut rng);
        assert_eq!(c.len(), 2);
    }

    #[test]
    fn small_clusters_get_fewer_targets() {
        let t = GossipTargets::new(NodeId(0), &[NodeId(0), NodeId(1)], Duration::from_secs(5));
        let c = t.choose(2, Instant::ZERO, &mut StdRng::seed_from_u64(0));
        assert_eq!(c, vec![NodeId(1)]);
    }
}
