//! `Peer.Arm`: capture of every packet to the process's ports, in one call
//! just before the freeze; the connections pre-read on the source get their
//! sockets opened here ahead of it (`stage`).

use std::sync::Arc;
use std::time::Instant;

use ferry_proto::v1::ArmRequest;

use super::{Step, expect};
use crate::dataplane::PortState;
use crate::engine::{Engine, EngineError};
use crate::process::PortKey;
use crate::sockstate::packed::FixedParts;

/// What Arm left for TransferSockets: the sockets opened ahead, once
/// [`stage`] has opened them, and (protocol 9) the connections' fixed
/// parts, which packed records are joined with.
#[derive(Debug, Default)]
pub struct StagedSlot {
    pub(super) sockets: std::sync::Mutex<Option<crate::sockstate::Staged>>,
    pub(super) fixed: std::sync::Mutex<Option<Arc<FixedParts>>>,
}

/// The connections Arm named, checked, and the slot their sockets go to:
/// [`stage`] opens them (the peer API runs it after [`arm`]; the fuzz
/// target, which must not touch the system, does not).
#[derive(Debug)]
pub struct Staging {
    pub(super) migration_id: String,
    pub(super) conns: Vec<crate::sockstate::ToStage>,
    pub(super) into: Arc<StagedSlot>,
}

/// Checks `ArmRequest.connections`: every entry's addresses, one family
/// per connection, a non-zero inode, none twice, and (protocol 9) each
/// fixed part. The errors name the entry and the field. Returns the
/// connections and the fixed parts of those that carry one.
pub fn connections_to_stage(
    connections: &[ferry_proto::v1::StagedConnection],
) -> Result<(Vec<crate::sockstate::ToStage>, FixedParts), EngineError> {
    let mut seen = std::collections::HashSet::with_capacity(connections.len());
    let mut fixed = FixedParts::new();
    let conns = connections
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let bad = |what: &str, reason: String| EngineError::InvalidField {
                field: "connections",
                reason: format!("[{i}].{what}: {reason}"),
            };
            let (local, remote) = crate::sockstate::ends_from_pb(&c.local, &c.remote)
                .map_err(|(what, reason)| bad(what, reason))?;
            if c.inode == 0 {
                return Err(bad("inode", "must not be 0".into()));
            }
            if !seen.insert(c.inode) {
                return Err(bad("inode", format!("{} appears twice", c.inode)));
            }
            if let Some(f) = &c.fixed {
                let f = crate::sockstate::packed::Fixed::from_pb(local, remote, f)
                    .map_err(|(what, reason)| bad(what, reason))?;
                fixed.insert(c.inode, f);
            }
            Ok(crate::sockstate::ToStage {
                inode: c.inode,
                local,
                remote,
                sndbuf: c.sndbuf,
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok((conns, fixed))
}

/// Opens the sockets of the connections Arm named (blocking work, off the
/// runtime), before the freeze. Never fails the migration: a socket not
/// opened here is built whole by TransferSockets.
pub async fn stage(staging: Staging) {
    let Staging {
        migration_id,
        conns,
        into,
    } = staging;
    if conns.is_empty() {
        return;
    }
    let started = Instant::now();
    let staged = match tokio::task::spawn_blocking(move || crate::sockstate::stage(&conns)).await {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(error = %e, "opening the connections' sockets ahead of the freeze");
            return;
        }
    };
    tracing::info!(
        migration = %migration_id,
        sockets = staged.len(),
        ms = started.elapsed().as_secs_f64() * 1000.0,
        "connections' sockets opened ahead of the freeze"
    );
    // A slot that ended meanwhile is held only here: the sockets close
    // with it below.
    *crate::sync::lock(&into.sockets) = Some(staged);
}

/// The sockets opened at Arm for migration `migration_id`, if its slot
/// still holds them (taken: a second TransferSockets builds whole).
pub(super) fn take_staged(engine: &Engine, migration_id: &str) -> Option<crate::sockstate::Staged> {
    let slot = engine.incoming.staged_for(migration_id)?;
    crate::sync::lock(&slot.sockets).take()
}

/// The connections' fixed parts Arm carried for migration `migration_id`.
pub(super) fn armed_fixed(engine: &Engine, migration_id: &str) -> Option<Arc<FixedParts>> {
    let slot = engine.incoming.staged_for(migration_id)?;
    crate::sync::lock(&slot.fixed).clone()
}

/// Starts capturing every packet to the migrating process's ports, all in
/// this one call, just before the source freezes the process. Returns the
/// connections to open ahead of the freeze ([`stage`]), checked; those
/// whose local end is the source's cluster address are left out (the
/// rebuild moves them to this node's).
pub async fn arm(engine: &Arc<Engine>, req: ArmRequest) -> Result<Staging, EngineError> {
    let ports = req
        .ports
        .iter()
        .map(PortKey::from_pb)
        .collect::<Result<Vec<_>, _>>()?;
    let (mut conns, fixed) = connections_to_stage(&req.connections)?;
    let mut slot = engine.incoming.lock().await;
    let inc = expect(&mut slot, &req.migration_id, Step::Arm)?;
    engine.ports.refuse_owned(&ports, &inc.ports)?;
    if let Some(source) = engine.cluster.cluster_address_of(&inc.from) {
        conns.retain(|c| c.local.ip() != source);
    }
    for p in &ports {
        if !inc.ports.contains(p) {
            inc.ports.push(*p);
        }
    }
    engine
        .dataplane
        .capture
        .open(&inc.migration_id, inc.ports.iter().copied());
    engine.dataplane.collect_while_capturing(&inc.migration_id);
    engine.ports.reserve(&inc.ports, PortState::Capturing);
    inc.armed = true;
    // No procfs read here: this is on the path to the freeze.
    engine.ports.apply().await?;
    tracing::info!(migration = %req.migration_id, ports = inc.ports.len(), "capture armed");
    engine.incoming.point_staged(&inc.migration_id, &inc.staged);
    *crate::sync::lock(&inc.staged.fixed) = (!fixed.is_empty()).then(|| Arc::new(fixed));
    let staging = Staging {
        migration_id: inc.migration_id.clone(),
        conns,
        into: inc.staged.clone(),
    };
    drop(slot);
    crate::engine::fault_point::reached(crate::engine::fault_point::Side::Destination, "Armed")
        .await;
    Ok(staging)
}
