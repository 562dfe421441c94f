//! Location policy: where a selected process should go (or, for a
//! receiver-initiated transfer, whom to ask for one).
//!
//! A policy ranks candidate nodes best first; the sender offers to the first
//! and moves down the list when a receiver refuses (Meehan & Wynne (openMosix)
//! §3 describe openMosix doing exactly that with its opportunity-cost array).
//!
//! - [`MirrorAverage`], Gerofi et al. (DVE) §IV-B: the node about as far below
//!   the approximated average as the local node is above it, so that both end
//!   near the average. Only nodes on the other side of the average qualify.
//! - [`LeastLoaded`], Meehan & Wynne (openMosix) §3: openMosix's `consider()`
//!   reduced to CPU: the marginal opportunity cost grows with a node's load, so
//!   the least loaded node wins, and the local node itself is a candidate (a
//!   target is only worth it if the move lowers the maximum of the two).
//! - [`RandomLocation`]: any peer, no information used (the baseline of the
//!   load-sharing literature).
//! - [`PowerOfTwo`]: two random peers, the less loaded first.

use std::fmt;

use rand::RngCore;
use rand::seq::SliceRandom;
use serde::{Deserialize, Serialize};

use crate::node::{NodeId, PeerLoad};

/// Whether the local node is pushing a process away or pulling one in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    Push,
    Pull,
}

#[derive(Debug, Clone, Copy)]
pub struct LocationQuery<'a> {
    pub direction: Direction,
    pub local_load: f64,
    /// The approximated cluster average, local node included.
    pub average: f64,
    /// What the process to move adds to a node's load (for a pull, the
    /// typical process the local node hopes to get).
    pub process_load: f64,
    /// Known peers (never the local node).
    pub peers: &'a [PeerLoad],
}

pub trait LocationPolicy: fmt::Debug + Send + Sync {
    /// Candidate nodes, best first; empty if no node qualifies.
    fn rank(&self, query: &LocationQuery<'_>, rng: &mut dyn RngCore) -> Vec<NodeId>;
}

/// Which location policy runs (`location.kind`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LocationKind {
    MirrorAverage,
    LeastLoaded,
    Random,
    PowerOfTwo,
}

/// `[location]` in ferryd's TOML.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LocationConfig {
    pub kind: LocationKind,
}

impl Default for LocationConfig {
    fn default() -> Self {
        LocationConfig {
            kind: LocationKind::MirrorAverage,
        }
    }
}

impl LocationConfig {
    pub fn policy(&self) -> Box<dyn LocationPolicy> {
        match self.kind {
            LocationKind::MirrorAverage => Box::new(MirrorAverage),
            LocationKind::LeastLoaded => Box::new(LeastLoaded),
            LocationKind::Random => Box::new(RandomLocation),
            LocationKind::PowerOfTwo => Box::new(PowerOfTwo),
        }
    }
}

/// Sorts by a key, ties broken by node id so the order is deterministic.
fn sorted_by_key(mut peers: Vec<&PeerLoad>, key: impl Fn(&PeerLoad) -> f64) -> Vec<NodeId> {
    peers.sort_by(|a, b| key(a).total_cmp(&key(b)).then(a.node.cmp(&b.node)));
    peers.into_iter().map(|p| p.node).collect()
}

/// Gerofi et al. (DVE) §IV-B.
#[derive(Debug, Clone, Copy)]
pub struct MirrorAverage;

impl LocationPolicy for MirrorAverage {
    fn rank(&self, q: &LocationQuery<'_>, _rng: &mut dyn RngCore) -> Vec<NodeId> {
        // The ideal partner is the local node's mirror image across the average.
        let mirror = 2.0 * q.average - q.local_load;
        let on_other_side: Vec<&PeerLoad> = q
            .peers
            .iter()
            .filter(|p| match q.direction {
                Direction::Push => p.load < q.average,
                Direction::Pull => p.load > q.average,
            })
            .collect();
        sorted_by_key(on_other_side, |p| (p.load - mirror).abs())
    }
}

/// Meehan & Wynne (openMosix) §3: openMosix's `consider()`, CPU only.
#[derive(Debug, Clone, Copy)]
pub struct LeastLoaded;

impl LocationPolicy for LeastLoaded {
    fn rank(&self, q: &LocationQuery<'_>, _rng: &mut dyn RngCore) -> Vec<NodeId> {
        match q.direction {
            // The local node keeps the process unless the target would still
            // be below the local node's current load after taking it.
            Direction::Push => sorted_by_key(
                q.peers
                    .iter()
                    .filter(|p| p.load + q.process_load < q.local_load)
                    .collect(),
                |p| p.load,
            ),
            Direction::Pull => sorted_by_key(
                q.peers
                    .iter()
                    .filter(|p| p.load - q.process_load > q.local_load)
                    .collect(),
                |p| -p.load,
            ),
        }
    }
}

/// Any peer, in random order: the "no information" baseline.
#[derive(Debug, Clone, Copy)]
pub struct RandomLocation;

impl LocationPolicy for RandomLocation {
    fn rank(&self, q: &LocationQuery<'_>, rng: &mut dyn RngCore) -> Vec<NodeId> {
        let mut nodes: Vec<NodeId> = q.peers.iter().map(|p| p.node).collect();
        nodes.sort();
        nodes.shuffle(rng);
        nodes
    }
}

/// The power of two choices: sample two peers, prefer the less loaded (for a
/// pull, the more loaded); keep only those that would improve the balance.
#[derive(Debug, Clone, Copy)]
pub struct PowerOfTwo;

impl LocationPolicy for PowerOfTwo {
    fn rank(&self, q: &LocationQuery<'_>, rng: &mut dyn RngCore) -> Vec<NodeId> {
        let mut peers: Vec<&PeerLoad> = q.peers.iter().collect();
        peers.sort_by_key(|p| p.node);
        let (sample, _) = peers.partial_shuffle(rng, 2);
        let improving: Vec<&PeerLoad> = sample
            .iter()
            .copied()
            .filter(|p| match q.direction {
                Direction::Push => p.load < q.local_load,
                Direction::Pull => p.load > q.local_load,
            })
            .collect();
        match q.direction {
            Direction::Push => sorted_by_key(improving, |p| p.load),
            Direction::Pull => sorted_by_key(improving, |p| -p.load),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use proptest::prelude::*;
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    use super::*;
    use crate::node::approximate_average;

    fn peers(loads: &[f64]) -> Vec<PeerLoad> {
        loads
            .iter()
            .enumerate()
            .map(|(i, &load)| PeerLoad {
                node: NodeId(i as u32 + 1),
                load,
                age: Duration::ZERO,
            })
            .collect()
    }

    fn push<'a>(local: f64, peers: &'a [PeerLoad]) -> LocationQuery<'a> {
        LocationQuery {
            direction: Direction::Push,
            local_load: local,
            average: approximate_average(local, peers),
            process_load: 0.1,
            peers,
        }
    }

    #[test]
    fn mirror_picks_the_node_as_far_below_as_we_are_above() {
        // Average of 0.9, 0.3, 0.6, 0.5, 0.7 is 0.6; the mirror of 0.9 is 0.3.
        let p = peers(&[0.3, 0.6, 0.5, 0.7]);
        let q = push(0.9, &p);
        let rank = MirrorAverage.rank(&q, &mut StdRng::seed_from_u64(0));
        assert_eq!(
            rank,
            vec![NodeId(1), NodeId(3)],
            "0.3 first, then 0.5; 0.6 and 0.7 are not below the average"
        );
    }

    #[test]
    fn least_loaded_keeps_the_process_when_no_move_helps() {
        let p = peers(&[1.0, 1.05]);
        let q = push(1.1, &p);
        assert!(
            LeastLoaded
                .rank(&q, &mut StdRng::seed_from_u64(0))
                .is_empty()
        );
        let p = peers(&[0.2, 0.9, 0.5]);
        let q = push(1.1, &p);
        assert_eq!(
            LeastLoaded.rank(&q, &mut StdRng::seed_from_u64(0)),
            vec![NodeId(1), NodeId(3), NodeId(2)]
        );
    }

    #[test]
    fn pull_asks_the_heaviest() {
        let p = peers(&[0.2, 0.9, 0.5]);
        let q = LocationQuery {
            direction: Direction::Pull,
            ..push(0.1, &p)
        };
        assert_eq!(
            LeastLoaded.rank(&q, &mut StdRng::seed_from_u64(0))[0],
            NodeId(2)
        );
        // Average 0.425, mirror of 0.1 is 0.75: 0.9 is closer than 0.5.
        assert_eq!(
            MirrorAverage.rank(&q, &mut StdRng::seed_from_u64(0)),
            vec![NodeId(2), NodeId(3)]
        );
    }

    #[test]
    fn power_of_two_returns_at_most_two_lighter_nodes() {
        let p = peers(&[0.1, 0.2, 0.3, 0.4, 2.0]);
        let mut rng = StdRng::seed_from_u64(7);
        for _ in 0..50 {
            let rank = PowerOfTwo.rank(&push(1.0, &p), &mut rng);
            assert!(rank.len() <= 2);
            assert!(!rank.contains(&NodeId(5)));
        }
    }

    fn loads() -> impl Strategy<Value = Vec<f64>> {
        proptest::collection::vec(0.0f64..4.0, 0..20)
    }

    proptest! {
        /// Gerofi et al. (DVE)'s location policy never sends to a node at or
        /// above the average, and ranks candidates by closeness to the mirror
        /// point.
        #[test]
        fn mirror_never_picks_a_node_above_the_average(local in 0.0f64..4.0, loads in loads(), seed: u64) {
            let p = peers(&loads);
            let q = push(local, &p);
            let rank = MirrorAverage.rank(&q, &mut StdRng::seed_from_u64(seed));
            let mirror = 2.0 * q.average - local;
            let mut previous = -1.0;
            for node in &rank {
                let load = p.iter().find(|x| x.node == *node).unwrap().load;
                prop_assert!(load < q.average);
                let distance = (load - mirror).abs();
                prop_assert!(distance >= previous);
                previous = distance;
            }
            prop_assert_eq!(rank.len(), p.iter().filter(|x| x.load < q.average).count());
        }

        /// Every policy only names known peers, each at most once, and the
        /// informed ones never name a node busier than the local one.
        #[test]
        fn policies_name_known_peers_once(local in 0.0f64..4.0, loads in loads(), seed: u64) {
            let p = peers(&loads);
            let q = push(local, &p);
            let policies: [&dyn LocationPolicy; 4] = [&MirrorAverage, &LeastLoaded, &RandomLocation, &PowerOfTwo];
            for (i, policy) in policies.iter().enumerate() {
                let rank = policy.rank(&q, &mut StdRng::seed_from_u64(seed));
                let mut seen = std::collections::HashSet::new();
                for node in &rank {
                    prop_assert!(seen.insert(*node));
                    let load = p.iter().find(|x| x.node == *node).map(|x| x.load);
                    prop_assert!(load.is_some());
                    if i != 2 {
                        prop_assert!(load.unwrap() < local.max(q.average) + 1e-12);
                    }
                }
            }
        }
    }
}
