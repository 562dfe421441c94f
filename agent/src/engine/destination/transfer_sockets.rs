//! `Peer.TransferSockets`: the connections' states, checked and rebuilt in
//! repair mode beside the image transfer, kept for the Restore.

use std::sync::Arc;
use std::time::Instant;

use ferry_proto::v1::{self as pb};

use super::{armed_fixed, in_cluster_addresses, take_staged};
use crate::criu;
use crate::dataplane::translation::InClusterFlow;
use crate::engine::{Engine, EngineError};
use crate::sockstate::Handover;

/// Connections rebuilt by TransferSockets, waiting for their Restore.
#[derive(Debug)]
pub struct RebuiltSockets {
    pub migration_id: String,
    pub from: String,
    /// (local, remote) of each, after the move of in-cluster ones.
    pub(super) relocated: Vec<(std::net::SocketAddr, std::net::SocketAddr)>,
    /// The in-cluster ones, as moved: what images that keep the
    /// connections out no longer name.
    pub(super) in_cluster: Vec<InClusterFlow>,
    pub(super) rebuilt: Option<crate::sockstate::Rebuilt>,
    /// How this node's CRIU takes them.
    pub(super) handover: Handover,
}

impl RebuiltSockets {
    pub(super) fn none(migration_id: &str, from: &str) -> Self {
        Self {
            migration_id: migration_id.to_owned(),
            from: from.to_owned(),
            relocated: Vec::new(),
            in_cluster: Vec::new(),
            rebuilt: None,
            handover: Handover::Fdstore,
        }
    }
}

/// Gives the process's connections to other cluster nodes this node's
/// cluster address, by the rule `translation::rewrite_in_cluster` applies
/// to the images: local end on the source's cluster address, remote end on
/// another node (this one is refused). Returns the ones it moved.
pub(super) fn relocate_in_cluster(
    engine: &Engine,
    from: &str,
    states: &mut [crate::sockstate::TcpConnectionState],
) -> Result<Vec<InClusterFlow>, EngineError> {
    use std::net::SocketAddr;
    let here = engine.config.cluster.address;
    let (source, nodes) = in_cluster_addresses(engine, from)?;
    let mut moved = Vec::new();
    for c in states {
        let (local, remote) = (
            crate::inet::canonical(c.local),
            crate::inet::canonical(c.remote),
        );
        if local.ip() != source {
            continue;
        }
        if remote.ip() == here {
            return Err(
                crate::dataplane::translation::FlowError::PeerOnDestination { local, remote }
                    .into(),
            );
        }
        if remote.ip() == source {
            return Err(
                crate::dataplane::translation::FlowError::PeerOnSource { local, remote }.into(),
            );
        }
        if nodes.contains(&remote.ip()) {
            let new_local = SocketAddr::new(here, local.port());
            c.local = new_local;
            moved.push(InClusterFlow {
                protocol: ferry_ebpf::Protocol::Tcp,
                old_local: local,
                new_local,
                remote,
            });
        }
    }
    Ok(moved)
}

/// What TransferSockets checks before it rebuilds anything: the
/// connections, valid, with the in-cluster ones moved to this node's
/// cluster address (and those, as moved). Pure (the fuzz target runs it;
/// the rebuild needs root).
pub fn sockets_to_rebuild(
    engine: &Engine,
    req: &mut pb::TransferSocketsRequest,
) -> Result<
    (
        Vec<crate::sockstate::TcpConnectionState>,
        Vec<InClusterFlow>,
    ),
    EngineError,
> {
    if req.migration_id.is_empty() {
        return Err(EngineError::InvalidField {
            field: "migration_id",
            reason: "empty".into(),
        });
    }
    let mut states = if req.packed.is_empty() && req.packed_queues.is_empty() {
        Vec::new()
    } else {
        let fixed = armed_fixed(engine, &req.migration_id);
        crate::sockstate::packed::unpack(&req.packed, &req.packed_queues, fixed.as_deref())?
    };
    let whole = crate::sockstate::from_pb_batch(std::mem::take(&mut req.tcp_connections))?;
    if !states.is_empty() {
        let packed: std::collections::HashSet<u64> = states.iter().map(|c| c.inode).collect();
        if packed.len() != states.len() {
            return Err(EngineError::InvalidField {
                field: "packed",
                reason: "an inode appears in two records".into(),
            });
        }
        if let Some((i, c)) = whole
            .iter()
            .enumerate()
            .find(|(_, c)| packed.contains(&c.inode))
        {
            return Err(EngineError::InvalidField {
                field: "tcp_connections",
                reason: format!("[{i}].inode: {} is in packed too", c.inode),
            });
        }
    }
    states.extend(whole);
    let in_cluster = relocate_in_cluster(engine, &req.source_node, &mut states)?;
    Ok((states, in_cluster))
}

/// TransferSockets: rebuilds every connection at once, beside the image
/// transfer (which holds the incoming slot meanwhile, so neither this nor
/// the peer API's check of its caller takes that slot, and the result
/// waits in its own), and keeps them for the Restore.
pub async fn transfer_sockets(
    engine: &Arc<Engine>,
    mut req: ferry_proto::v1::TransferSocketsRequest,
) -> Result<ferry_proto::v1::TransferSocketsResponse, EngineError> {
    let arrived = Instant::now();
    let (states, in_cluster) = sockets_to_rebuild(engine, &mut req)?;
    tracing::debug!(
        connections = states.len(),
        whole = states.len() - req.packed.len() / crate::sockstate::packed::RECORD_LEN,
        decoded_us = arrived.elapsed().as_micros() as u64,
        "connections' states arrived"
    );
    // Options carried by ferryd: all connections' or none (the source's
    // CRIU dumped all established connections one way).
    let with_options = states.iter().filter(|c| c.socket_options.is_some()).count();
    if with_options != 0 && with_options != states.len() {
        return Err(EngineError::InvalidField {
            field: "tcp_connections.socket_options",
            reason: format!(
                "{with_options} of {} connections carry their options: all or none must",
                states.len()
            ),
        });
    }
    // Without ferry's patch, CRIU's restore would not take the rebuilt
    // connections and would restore them closed; without the options
    // patch, it would restore options the images lack (the source asked in
    // Prepare, but this node's CRIU may have been swapped since). Refused
    // here, before the restore: the source rolls back and the connections
    // live on there.
    let criu_path = engine.config.criu_path.clone();
    let relocated = states.iter().map(|c| (c.local, c.remote)).collect();
    let staged = take_staged(engine, &req.migration_id);
    // One blocking task for the check and the rebuild: inside the freeze a
    // thread hand-off can wait milliseconds for a core.
    let (handover, rebuilt, took) = tokio::task::spawn_blocking(move || {
        criu::require_patch(&criu_path, criu::INHERITED_TCP_MARK)?;
        if with_options != 0 {
            criu::require_patch(&criu_path, criu::OPTS_BY_CALLER_MARK)?;
        }
        // The table path builds on the pidfd one (its inode table and
        // service fd).
        let by_pidfd = criu::has_patch(&criu_path, criu::TCP_BY_PIDFD_MARK);
        let handover = if by_pidfd && criu::has_patch(&criu_path, criu::TCP_TABLE_MARK) {
            Handover::Table
        } else if by_pidfd {
            Handover::ByPidfd
        } else {
            Handover::Fdstore
        };
        let started = Instant::now();
        tracing::debug!(
            waited_ms = (started - arrived).as_secs_f64() * 1000.0,
            "rebuild started"
        );
        let rebuilt = crate::sockstate::rebuild(&states, staged)?;
        Ok::<_, EngineError>((handover, rebuilt, started.elapsed()))
    })
    .await
    .map_err(|source| EngineError::Task {
        what: "rebuilding the connections",
        source,
    })??;
    let connections = rebuilt.len() as u32;
    let staged = rebuilt.staged() as u32;
    tracing::info!(
        migration = %req.migration_id,
        connections,
        staged,
        ms = took.as_secs_f64() * 1000.0,
        ?handover,
        "TCP connections rebuilt in one batch"
    );
    // Replaces (and so closes, silently) whatever an earlier migration
    // left behind.
    engine.incoming.put_sockets(RebuiltSockets {
        migration_id: req.migration_id,
        from: req.source_node,
        relocated,
        in_cluster,
        rebuilt: Some(rebuilt),
        handover,
    });
    Ok(ferry_proto::v1::TransferSocketsResponse {
        connections,
        rebuild_us: took.as_micros() as u64,
        staged,
    })
}
