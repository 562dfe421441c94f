//! Forwarding Control calls to the node they are about, so that any
//! node's agent answers for the whole cluster.
//!
//! The agent that was called checks the caller's role (its own listener's
//! rule), then calls the named node's Control service on that node's peer
//! port, as itself: with `[tls]`, its node certificate, which the peer
//! port requires and which counts as an operator. A forwarded call carries
//! `x-ferry-forwarded-by`; a node that receives one for yet another node
//! refuses it rather than pass it on again (no loops, no hops beyond one).

use std::time::Duration;

use ferry_proto::v1::control_client::ControlClient;
use tonic::transport::Channel;
use tonic::{Request, Status};

use crate::cluster::Cluster;
use crate::config::PeerConfig;
use crate::error_chain::error_chain;

/// The metadata key naming the node that forwarded a call.
pub const FORWARDED_BY: &str = "x-ferry-forwarded-by";

/// Where a call about `node` is answered.
#[derive(Debug)]
pub enum Target {
    Here,
    Peer(PeerConfig),
}

/// Resolves a request's node field (`field` names it in errors): empty or
/// this node's name is here; another node known to this agent is that
/// node; anything else is NOT_FOUND.
pub fn target<T>(
    cluster: &Cluster,
    request: &Request<T>,
    field: &str,
    node: &str,
) -> Result<Target, Status> {
    if node.is_empty() || node == cluster.node() {
        return Ok(Target::Here);
    }
    if let Some(by) = request.metadata().get(FORWARDED_BY) {
        return Err(Status::failed_precondition(format!(
            "{field}: {node:?} is not this node ({}); the call was forwarded here by {:?} and is not forwarded twice",
            cluster.node(),
            by.to_str().unwrap_or("?")
        )));
    }
    match cluster.peer(node) {
        Some(peer) => Ok(Target::Peer(peer)),
        None => {
            let mut known = vec![cluster.node().to_owned()];
            known.extend(cluster.known_peers().into_iter().map(|p| p.name));
            Err(Status::not_found(format!(
                "{field}: no node named {node:?} (known: {})",
                known.join(", ")
            )))
        }
    }
}

/// A Control client on `peer`'s peer port.
pub async fn client(
    cluster: &Cluster,
    peer: &PeerConfig,
) -> Result<ControlClient<Channel>, Status> {
    let unavailable = |reason: String| {
        Status::unavailable(format!(
            "{} unreachable at {} to forward the call: {reason}",
            peer.name, peer.address
        ))
    };
    let channel = cluster
        .peer_endpoint(&peer.name, peer.address)
        .map_err(|e| unavailable(e.to_string()))?
        .connect_timeout(Duration::from_secs(2))
        .tcp_nodelay(true)
        .connect()
        .await
        .map_err(|e| unavailable(error_chain(&e)))?;
    Ok(ControlClient::new(channel)
        .max_decoding_message_size(16 << 20)
        .max_encoding_message_size(16 << 20))
}

/// `message` as a forwarded request from this node.
pub fn request<T>(cluster: &Cluster, message: T) -> Request<T> {
    let mut r = Request::new(message);
    if let Ok(v) = cluster.node().parse() {
        r.metadata_mut().insert(FORWARDED_BY, v);
    }
    r
}

/// A status from the node a call was forwarded to, said to come from it
/// (its code kept).
pub fn from_peer(peer: &PeerConfig, status: Status) -> Status {
    if status.code() == tonic::Code::Unimplemented {
        return Status::unimplemented(format!(
            "{}: its agent does not answer forwarded Control calls (an older ferryd?): {}",
            peer.name,
            status.message()
        ));
    }
    Status::new(
        status.code(),
        format!("{}: {}", peer.name, status.message()),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_from_a_peer_keep_their_code_and_name_the_node() {
        let peer = PeerConfig {
            name: "node2".into(),
            address: "198.18.0.2:7100".parse().unwrap(),
        };
        let s = from_peer(&peer, Status::not_found("pid: no process 7"));
        assert_eq!(s.code(), tonic::Code::NotFound);
        assert_eq!(s.message(), "node2: pid: no process 7");
    }
}
