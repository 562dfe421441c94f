//! Cutting one node off the cluster network, apart from the cluster (for
//! a task that cuts it at the right moment).

use super::{Cluster, topology};
use crate::cmd;

impl Cluster {
    /// Cuts `node` off the cluster network, or joins it again (`cut:
    /// false`): its port on the router's cluster bridge leaves the bridge,
    /// so that every frame either way is dropped without a word (no
    /// carrier change, no reset, no ICMP), as when a cable or a switch
    /// port fails. Panics if `ip` fails.
    pub fn cut_cluster_link(&self, node: &str, cut: bool) {
        self.link_cutter(node).cut(cut);
    }

    /// What [`Self::cut_cluster_link`] does for `node`, apart from the
    /// cluster.
    pub fn link_cutter(&self, node: &str) -> LinkCutter {
        LinkCutter {
            node: node.to_owned(),
            router: self.router.as_ref().map(|r| r.name().to_owned()),
            port: format!("n{}c", self.node_index(node) + 1),
        }
    }
}

/// Cuts one node off the cluster network, or joins it again
/// ([`Cluster::link_cutter`]).
#[derive(Debug, Clone)]
pub struct LinkCutter {
    node: String,
    router: Option<String>,
    port: String,
}

impl LinkCutter {
    /// As [`Cluster::cut_cluster_link`]. Panics if `ip` fails.
    pub fn cut(&self, cut: bool) {
        let port = &self.port;
        let line = if cut {
            format!("link set {port} nomaster")
        } else {
            format!("link set {port} master {} up", topology::CLUSTER_BRIDGE)
        };
        cmd::ip_batch(self.router.as_deref(), &[line]).unwrap_or_else(|e| {
            panic!("cutting {} off the cluster network ({cut}): {e}", self.node)
        });
    }
}
