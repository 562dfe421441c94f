//! Arm (skipped with `[dataplane] capture = false`): the source starts
//! logging what it delivers to the process's ports (`Recording`), then
//! `Peer.Arm` makes the destination capture every packet to all of them in
//! one call. From here no packet for the process is lost: the broadcast
//! cluster brings each one to both nodes. Until the freeze this node still
//! serves them, and the log lets the destination skip what it delivered.
//! Incremental, from protocol 7: Arm also names the connections pre-read,
//! and the destination opens their sockets before it answers (repair mode,
//! bound), so that the rebuild in the freeze starts from them; from
//! protocol 9 each comes with what the freeze does not change (its
//! handshake's options, SO_REUSEADDR, its socket options:
//! `StagedConnection.fixed`).

use std::sync::Arc;

use ferry_proto::v1::{ArmRequest, StagedConnection};

use super::Phase;
use super::carry::{Arming, Settling};
use super::run::{Run, out_stage};
use crate::engine::EngineError;
use crate::engine::link::{peer_error, silent};
use crate::engine::sockettaker::Incremental;
use crate::managed::OutStage;
use crate::process::PortKey;
use crate::sockstate::packed::{Fixed, FixedParts};

pub(super) async fn arm(run: &mut Run, a: Arming) -> Result<Phase, EngineError> {
    let (pid, id) = (run.p.pid, run.p.migration_id.clone());
    run.engine
        .dataplane
        .capture
        .open(&id, run.ports.iter().copied());
    run.undo.capturing_here = true;
    run.engine
        .processes
        .set_lifecycle(pid, out_stage(&id, OutStage::Recording));
    run.engine.ports.apply().await?;
    let (connections, fixed) = staged(run.p.protocol_version, a.incremental.as_deref());
    let arm = run.p.link.arm(ArmRequest {
        migration_id: id.clone(),
        ports: run.ports.iter().map(PortKey::to_pb).collect(),
        connections,
    });
    match tokio::time::timeout(run.deadline, arm).await {
        Ok(Ok(_)) => {}
        Ok(Err(s)) => return Err(peer_error(&run.p.destination.name, s)),
        Err(_) => return Err(silent(&run.p.destination, "arm", run.deadline)),
    }
    // The destination keeps every packet now: new handshakes are left to
    // it.
    run.engine
        .processes
        .set_lifecycle(pid, out_stage(&id, OutStage::Armed));
    run.engine.ports.apply().await?;
    Ok(Phase::Settle(Settling {
        listeners: a.listeners,
        incremental: a.incremental,
        armed_fixed: fixed.map(Arc::new),
    }))
}

/// Protocol 7: the connections read before the freeze, whose sockets the
/// destination opens now instead of inside it; from 9 with what of them
/// the freeze does not change.
fn staged(
    version: u32,
    incremental: Option<&Incremental>,
) -> (Vec<StagedConnection>, Option<FixedParts>) {
    let Some(inc) = incremental.filter(|_| version >= ferry_proto::PEER_PROTOCOL_STAGED_SOCKETS)
    else {
        return (Vec::new(), None);
    };
    let fixed: Option<FixedParts> = (version >= ferry_proto::PEER_PROTOCOL_PACKED_STATES)
        .then(|| inc.preread.fixed_parts().collect());
    let connections = inc
        .preread
        .connections()
        .map(|(inode, c)| StagedConnection {
            inode,
            local: c.local.to_string(),
            remote: c.remote.to_string(),
            sndbuf: if fixed.is_some() { c.sndbuf } else { 0 },
            fixed: fixed.as_ref().and_then(|f| f.get(&inode)).map(Fixed::to_pb),
        })
        .collect();
    (connections, fixed)
}
