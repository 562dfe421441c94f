//! The connections' states crossing to the destination in one message
//! (`TransferSockets`), sent by a task the dump starts as soon as the
//! socket reader has them, and awaited by the transfer (or an abort).

use std::sync::Arc;
use std::time::Duration;

use crate::config::PeerConfig;
use crate::engine::EngineError;
use crate::engine::link::{PeerLink, peer_error, silent};
use crate::engine::sockettaker::ReadConnections;
use crate::sockstate;

/// What the socket transfer of a collective migration answers.
pub(super) struct SentSockets {
    /// The message's size.
    pub bytes: u64,
    pub answer: ferry_proto::v1::TransferSocketsResponse,
    /// Incremental: how the connections were read.
    pub counts: Option<sockstate::ReadCounts>,
    /// Bytes in the connections' send queues.
    pub send_queued: u64,
}

pub(super) type SocketsSent = Result<Option<SentSockets>, EngineError>;

/// Sends the connections' states to the destination in one message as
/// soon as the socket reader has them, which is during the dump.
pub(super) async fn send_sockets(
    link: Arc<dyn PeerLink>,
    migration_id: String,
    source_node: String,
    destination: PeerConfig,
    deadline: Duration,
    states_from: tokio::sync::oneshot::Receiver<Result<ReadConnections, sockstate::SockStateError>>,
    armed_fixed: Option<Arc<sockstate::packed::FixedParts>>,
) -> SocketsSent {
    let read = states_from.await.map_err(|_| {
        EngineError::Internal("the dump ended before the connections were read".into())
    })??;
    let states = read.states?;
    let queued: usize = states
        .iter()
        .map(|c| c.send_queue.len() + c.recv_queue.len())
        .sum();
    tracing::info!(
        connections = states.len(),
        held = read.held.len(),
        queued_bytes = queued,
        ms = read.took.as_secs_f64() * 1000.0,
        preread = read.counts.map(|c| c.preread),
        touched = read.counts.map(|c| c.touched),
        unknown = read.counts.map(|c| c.unknown),
        "TCP connections read in one batch"
    );
    let counts = read.counts;
    let send_queued = states.iter().map(|c| c.send_queue.len() as u64).sum();
    let (packed, whole) = match &armed_fixed {
        Some(fixed) => sockstate::packed::pack(&states, fixed),
        None => (Default::default(), states.iter().collect()),
    };
    tracing::debug!(
        packed = packed.records.len() / sockstate::packed::RECORD_LEN,
        whole = whole.len(),
        "connections' states encoded"
    );
    let req = ferry_proto::v1::TransferSocketsRequest {
        migration_id,
        source_node,
        tcp_connections: whole.into_iter().map(|c| c.to_pb()).collect(),
        packed: packed.records,
        packed_queues: packed.queues,
    };
    let bytes = prost::Message::encoded_len(&req) as u64;
    match tokio::time::timeout(deadline, link.transfer_sockets(req)).await {
        Ok(Ok(r)) => Ok(Some(SentSockets {
            bytes,
            answer: r,
            counts,
            send_queued,
        })),
        Ok(Err(s)) => Err(peer_error(&destination.name, s)),
        Err(_) => Err(silent(&destination, "the socket transfer", deadline)),
    }
}
