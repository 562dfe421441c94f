//! Names of the things the policies talk about.

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// A cluster node, as numbered by membership.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct NodeId(pub u32);

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "node{}", self.0)
    }
}

/// A migratable process on some node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct ProcessId(pub u64);

/// What this node believes about a peer's load: the load the peer exported
/// and how old that belief is (by this node's clock, so it is free of skew).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PeerLoad {
    pub node: NodeId,
    /// The peer's export load, in the units of [`crate::load`].
    pub load: f64,
    pub age: Duration,
}

/// The mean of the local load and the loads of the peers this node knows:
/// its approximation of the cluster average (Gerofi et al. (DVE) §IV).
pub fn approximate_average(local_load: f64, peers: &[PeerLoad]) -> f64 {
    let sum: f64 = local_load + peers.iter().map(|p| p.load).sum::<f64>();
    sum / (peers.len() + 1) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn average_counts_the_local_node_once() {
        let peers = [
            PeerLoad {
                node: NodeId(1),
                load: 1.0,
                age: Duration::ZERO,
            },
            PeerLoad {
                node: NodeId(2),
                load: 2.0,
                age: Duration::ZERO,
            },
        ];
        assert_eq!(approximate_average(3.0, &peers), 2.0);
        assert_eq!(approximate_average(3.0, &[]), 3.0);
    }
}
