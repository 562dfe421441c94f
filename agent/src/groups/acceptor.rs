//! The acceptor's side of a handoff: from `HandoffPrepare` its filter
//! captures the connection's packets (nothing of it is delivered or sent
//! here yet), `HandoffTransfer` rebuilds it in repair mode (inert), and
//! `HandoffCommit` resumes it, replays what was captured in arrival order,
//! owns it and hands it to the group's server process. `HandoffAbort` (or
//! a donor that goes silent for [`PENDING_LIMIT`]) drops the rebuilt copy
//! silently and gives the filter's entry back.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_proto::v1 as pb;

use super::{Groups, GroupsError, Outcome, flow_from_pb, local};
use crate::dataplane::{Flow, FlowState};
use crate::sockstate::{Rebuilt, TcpConnectionState, rebuild};
use crate::sync::lock;

/// How long a prepared handoff may wait for its commit before this node
/// drops it (the donor died or was cut off: it gives the connection back
/// to itself on any failure before the commit).
pub const PENDING_LIMIT: Duration = Duration::from_secs(30);

/// A handoff this node accepts.
#[derive(Debug)]
pub struct Incoming {
    flow: Flow,
    donor: String,
    /// How the filter treated the connection before (None: by its port).
    before: Option<FlowState>,
    rebuilt: Option<Rebuilt>,
    app_state: Vec<u8>,
    /// Committed: the connection is this node's; kept until
    /// [`PENDING_LIMIT`] to answer a donor that asks.
    committed: bool,
}

impl Groups {
    fn incoming(&self) -> std::sync::MutexGuard<'_, std::collections::HashMap<String, Incoming>> {
        lock(&self.incoming)
    }

    /// `HandoffPrepare`: capture the connection's packets from now on.
    pub async fn accept_prepare(
        self: &Arc<Self>,
        req: pb::HandoffPrepareRequest,
    ) -> Result<(), GroupsError> {
        let flow = flow_from_pb(req.connection.as_ref())?;
        if req.id.is_empty() {
            return Err(GroupsError::Invalid {
                field: "id",
                reason: "empty".into(),
            });
        }
        if self.group(flow.local_port).is_none() {
            return Err(GroupsError::NoGroup {
                port: flow.local_port,
                node: self.node.clone(),
            });
        }
        if self.servers(flow.local_port).is_empty() {
            return Err(GroupsError::NoServer {
                port: flow.local_port,
                node: self.node.clone(),
            });
        }
        self.begin(flow)?;
        let before = match self.flow_state(flow) {
            Ok(b) => b,
            Err(e) => {
                self.end(flow, Outcome::Failed);
                return Err(e);
            }
        };
        let me = self.clone();
        let id = req.id.clone();
        let captured = tokio::task::spawn_blocking(move || {
            me.dataplane.capture.open_flow(&id, flow);
            me.dataplane.table().set_flow(flow, FlowState::Capturing)
        })
        .await
        .map_err(|e| GroupsError::Internal(e.to_string()))
        .and_then(|r| r.map_err(|e| GroupsError::Internal(e.to_string())));
        if let Err(e) = captured {
            self.dataplane.capture.close(&req.id);
            self.end(flow, Outcome::Failed);
            return Err(e);
        }
        self.dataplane.collect_while_capturing(&req.id);
        self.incoming().insert(
            req.id.clone(),
            Incoming {
                flow,
                donor: req.donor.clone(),
                before,
                rebuilt: None,
                app_state: Vec::new(),
                committed: false,
            },
        );
        // A donor that never comes back must not leave the connection
        // captured here for ever.
        let (me, id) = (self.clone(), req.id.clone());
        tokio::spawn(async move {
            tokio::time::sleep(PENDING_LIMIT).await;
            if me.incoming().get(&id).is_some_and(|i| !i.committed) {
                tracing::warn!(%id, "a handoff waited too long for its commit: dropped");
            }
            me.accept_abort(&id).await;
            me.incoming().remove(&id);
        });
        tracing::info!(id = %req.id, %flow, donor = %req.donor, "accepting a handoff");
        Ok(())
    }

    /// `HandoffTransfer`: rebuild the connection, in repair mode.
    pub async fn accept_transfer(
        &self,
        req: pb::HandoffTransferRequest,
    ) -> Result<u64, GroupsError> {
        let flow = self.pending_flow(&req.id)?;
        let state = req.state.ok_or(GroupsError::Invalid {
            field: "state",
            reason: "missing".into(),
        })?;
        let state = TcpConnectionState::from_pb(0, state).map_err(|e| GroupsError::Invalid {
            field: "state",
            reason: e.to_string(),
        })?;
        // A dual-stack socket's IPv4 client is the flow's IPv4 one.
        if crate::inet::canonical(state.remote) != flow.remote
            || state.local.port() != flow.local_port
        {
            return Err(GroupsError::Invalid {
                field: "state",
                reason: format!(
                    "the state is of {} -> {}, the handoff of {flow}",
                    state.remote, state.local
                ),
            });
        }
        if req.app_state.len() > ferry_handoff::MAX_STATE {
            return Err(GroupsError::Invalid {
                field: "app_state",
                reason: format!(
                    "{} bytes, more than {}",
                    req.app_state.len(),
                    ferry_handoff::MAX_STATE
                ),
            });
        }
        let started = Instant::now();
        let rebuilt = tokio::task::spawn_blocking(move || rebuild(&[state], None))
            .await
            .map_err(|e| GroupsError::Internal(e.to_string()))?
            .map_err(|e| GroupsError::Internal(format!("rebuilding the connection: {e}")))?;
        let rebuild_us = started.elapsed().as_micros() as u64;
        {
            let mut incoming = self.incoming();
            let i = incoming
                .get_mut(&req.id)
                .filter(|i| !i.committed)
                .ok_or_else(|| self.unknown(&req.id))?;
            i.rebuilt = Some(rebuilt);
            i.app_state = req.app_state;
        }
        // Tests: an acceptor that dies holding the rebuilt copy, before
        // the commit.
        crate::engine::fault_point::reached(
            crate::engine::fault_point::Side::Destination,
            "HandoffRebuilt",
        )
        .await;
        Ok(rebuild_us)
    }

    fn unknown(&self, id: &str) -> GroupsError {
        GroupsError::UnknownHandoff {
            id: id.to_owned(),
            node: self.node.clone(),
        }
    }

    fn pending_flow(&self, id: &str) -> Result<Flow, GroupsError> {
        self.incoming()
            .get(id)
            .filter(|i| !i.committed)
            .map(|i| i.flow)
            .ok_or_else(|| self.unknown(id))
    }

    /// `HandoffCommit`: the connection is this node's: resumed, the
    /// captured packets replayed, owned, and handed to a server process.
    pub async fn accept_commit(
        self: &Arc<Self>,
        id: &str,
    ) -> Result<pb::HandoffCommitResponse, GroupsError> {
        let (flow, donor, rebuilt, app_state) = {
            let mut incoming = self.incoming();
            let i = incoming
                .get_mut(id)
                .filter(|i| !i.committed)
                .ok_or_else(|| self.unknown(id))?;
            let Some(rebuilt) = i.rebuilt.take() else {
                return Err(GroupsError::Invalid {
                    field: "id",
                    reason: format!("handoff {id} has no connection yet (HandoffTransfer first)"),
                });
            };
            (
                i.flow,
                i.donor.clone(),
                rebuilt,
                std::mem::take(&mut i.app_state),
            )
        };
        // A server to give it to, chosen before anything is resumed: with
        // none left, the donor keeps the connection.
        let servers = self.servers(flow.local_port);
        if servers.is_empty() {
            if let Some(i) = self.incoming().get_mut(id) {
                i.rebuilt = Some(rebuilt);
            }
            return Err(GroupsError::NoServer {
                port: flow.local_port,
                node: self.node.clone(),
            });
        }
        if let Some(i) = self.incoming().get_mut(id) {
            i.committed = true;
        }
        let me = self.clone();
        let sid = id.to_owned();
        let resumed = tokio::task::spawn_blocking(move || {
            let started = Instant::now();
            let mut rebuilt = rebuilt;
            if let Err(e) = rebuilt.apply_options() {
                tracing::warn!(%flow, error = %e, "a handed-off connection's options");
            }
            rebuilt.resume()?;
            let resume_us = started.elapsed().as_micros() as u64;
            let dp = &me.dataplane;
            dp.table()
                .set_flow(flow, FlowState::Releasing)
                .map_err(|e| GroupsError::Internal(e.to_string()))?;
            let stats = dp.replay_and_open(&sid, &[], &[], &[], || {
                dp.table()
                    .set_flow(flow, FlowState::Owned)
                    .map_err(|e| GroupsError::Internal(e.to_string()))
            })?;
            let fds = rebuilt
                .into_descriptors()
                .map_err(|e| GroupsError::Internal(e.to_string()))?;
            Ok::<_, GroupsError>((fds, resume_us, stats.replayed))
        })
        .await
        .map_err(|e| GroupsError::Internal(e.to_string()))?;
        let (fds, resume_us, replayed) = match resumed {
            Ok(r) => r,
            Err(e) => {
                tracing::error!(%flow, error = %e, "resuming a handed-off connection");
                self.end(flow, Outcome::Failed);
                return Err(e);
            }
        };
        self.end(flow, Outcome::Taken);
        let started = Instant::now();
        let conn = fds
            .into_iter()
            .next()
            .ok_or_else(|| GroupsError::Internal("no connection rebuilt".into()))?;
        let remote = flow.remote.to_string();
        let delivered = servers.iter().find_map(|s| {
            match local::deliver(
                s,
                flow.local_port,
                &remote,
                &donor,
                std::os::fd::AsFd::as_fd(&conn),
                &app_state,
            ) {
                Ok(()) => Some(s.pid),
                Err(e) => {
                    tracing::warn!(pid = s.pid, error = %e, "handing a connection to a server");
                    None
                }
            }
        });
        match delivered {
            Some(pid) => tracing::info!(%id, %flow, pid, replayed, "handoff taken"),
            // Every server went away since the check above: the connection
            // ends as a server's crash would end it.
            None => {
                tracing::error!(%id, %flow, "no server took the handed-off connection: it is closed")
            }
        }
        Ok(pb::HandoffCommitResponse {
            resume_us,
            replayed_packets: replayed,
            deliver_us: started.elapsed().as_micros() as u64,
        })
    }

    /// `HandoffAbort`: drop the handoff; true if it had committed already
    /// (then nothing changes).
    pub async fn accept_abort(&self, id: &str) -> bool {
        let taken = {
            let mut incoming = self.incoming();
            match incoming.get(id) {
                None => return false,
                Some(i) if i.committed => return true,
                Some(_) => incoming.remove(id),
            }
        };
        let Some(i) = taken else { return false };
        let flow = i.flow;
        let dp = self.dataplane.clone();
        let sid = id.to_owned();
        let done = tokio::task::spawn_blocking(move || {
            // The rebuilt copy closes silently (repair mode).
            drop(i.rebuilt);
            dp.capture.close(&sid);
            let mut table = dp.table();
            match i.before {
                Some(s) => table.set_flow(flow, s),
                None => table.remove_flow(flow),
            }
        })
        .await;
        match done {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::error!(%flow, error = %e, "dropping a handoff"),
            Err(e) => tracing::error!(%flow, error = %e, "dropping a handoff"),
        }
        self.end(flow, Outcome::Failed);
        tracing::info!(%id, %flow, "handoff dropped");
        false
    }
}

impl From<crate::sockstate::SockStateError> for GroupsError {
    fn from(e: crate::sockstate::SockStateError) -> Self {
        GroupsError::Internal(e.to_string())
    }
}
