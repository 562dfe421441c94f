//! Links to the nodes at the far end of the process's connections, opened
//! at Start: those nodes translate in-cluster connections inside the
//! freeze, which then costs no TCP and TLS handshake (`translate.rs`).

use std::sync::Arc;

use crate::engine::link::PeerLink;
use crate::engine::{Engine, EngineError};

/// A Peer link being opened.
pub(super) type PendingLink = tokio::task::JoinHandle<Result<Arc<dyn PeerLink>, EngineError>>;

/// Starts connecting to every other node of the cluster that the process
/// has a TCP connection to (`tcp_peers`): those are the nodes an in-cluster
/// translation may go to, and translating inside the freeze then costs no
/// TCP and TLS handshake. Not to `destination`, which the migration's own
/// link reaches.
pub(super) fn open_peer_links(
    engine: &Arc<Engine>,
    tcp_peers: &std::collections::BTreeSet<std::net::IpAddr>,
    destination: &str,
) -> Vec<(String, PendingLink)> {
    tcp_peers
        .iter()
        .filter(|ip| **ip != engine.config.cluster.address)
        .filter_map(|ip| engine.cluster.peer_at(*ip))
        .filter(|peer| peer.name != destination)
        .map(|peer| {
            let engine = engine.clone();
            let name = peer.name.clone();
            (
                name,
                tokio::spawn(async move { Ok(engine.links.connect(&peer).await?) }),
            )
        })
        .collect()
}
