//! The donor's side of a handoff: one established connection of a group's
//! port, given by a server process of this node to the group's server on
//! another node (protocol in `proto/ferry/v1/groups.proto`).
//!
//! Until the commit point the connection can come back: the donor's socket
//! stays in repair mode (inert: nothing is sent, nothing is lost) and its
//! packets are captured; on any failure repair goes off, the captured
//! packets are replayed, and the filter gives the connection back to this
//! node. After it, the donor's copy is never resumed: the acceptor's is the
//! connection.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_handoff::Phase;
use ferry_proto::v1 as pb;

use super::{Groups, GroupsError, Outcome, connection_pb};
use crate::dataplane::{Flow, FlowState};
use crate::sockstate::{Held, TcpConnectionState, sys};

/// How long the acceptor may take to answer each step.
const STEP_TIMEOUT: Duration = Duration::from_secs(5);

/// How often a drain looks at the send queue.
const DRAIN_POLL: Duration = Duration::from_millis(1);

/// What a successful handoff tells the process.
#[derive(Debug)]
pub struct HandedOff {
    pub acceptor: String,
    pub phases: Vec<Phase>,
    /// The bytes of the connection's queues that crossed.
    pub queued_bytes: u64,
}

/// The connection a process passed, as checked.
#[derive(Debug, Clone, Copy)]
struct Examined {
    flow: Flow,
    inode: u64,
}

/// Checks that `fd` is an established TCP connection to one of the
/// cluster's public addresses, and names it.
fn examine(
    fd: BorrowedFd<'_>,
    public: crate::config::PublicAddresses,
) -> Result<Examined, GroupsError> {
    use nix::sys::socket::{SockaddrStorage, getpeername, getsockname};
    let not = |why: String| GroupsError::NotAConnection(why);
    let st = nix::sys::stat::fstat(fd).map_err(|e| not(format!("fstat: {e}")))?;
    if st.st_mode & libc::S_IFMT != libc::S_IFSOCK {
        return Err(not("the descriptor is not a socket".into()));
    }
    let ty = sys::get_int(fd, libc::SOL_SOCKET, libc::SO_TYPE).map_err(|e| not(e.to_string()))?;
    let proto =
        sys::get_int(fd, libc::SOL_SOCKET, libc::SO_PROTOCOL).map_err(|e| not(e.to_string()))?;
    if ty != libc::SOCK_STREAM || proto != libc::IPPROTO_TCP {
        return Err(not("the socket is not a TCP socket".into()));
    }
    let inet = |a: SockaddrStorage| crate::inet::of_sockaddr(&a);
    let local = getsockname::<SockaddrStorage>(std::os::fd::AsRawFd::as_raw_fd(&fd))
        .ok()
        .and_then(inet)
        .ok_or_else(|| not("the socket is neither IPv4 nor IPv6".into()))?;
    // tcp_info's first byte is the state; the kernel fills what fits.
    let mut info = [0u8; 8];
    sys::get_into(fd, libc::SOL_TCP, libc::TCP_INFO, &mut info)
        .map_err(|e| not(format!("TCP_INFO: {e}")))?;
    // TCP_ESTABLISHED of include/net/tcp_states.h.
    if info[0] != 1 {
        return Err(not(format!(
            "the connection is not established (TCP state {})",
            info[0]
        )));
    }
    let remote = getpeername::<SockaddrStorage>(std::os::fd::AsRawFd::as_raw_fd(&fd))
        .map_err(|e| not(format!("getpeername: {e}")))
        .and_then(|a| inet(a).ok_or_else(|| not("getpeername: not an IP address".into())))?;
    if !public.contains(local.ip()) {
        return Err(not(format!(
            "its local address {} is not the cluster's public one, {public}",
            local.ip()
        )));
    }
    Ok(Examined {
        flow: Flow::new(remote, local.port()),
        inode: st.st_ino,
    })
}

/// Waits up to `limit` for the client to acknowledge everything sent on
/// `fd` (XtreemOS distributed servers, Fig. 2: the state then holds no
/// bytes in flight). Returns whether the queue emptied.
async fn drain(fd: BorrowedFd<'_>, limit: Duration) -> bool {
    let until = Instant::now() + limit;
    loop {
        match sys::outq(fd) {
            Ok(0) => return true,
            Ok(_) if Instant::now() < until => tokio::time::sleep(DRAIN_POLL).await,
            Ok(_) => return false,
            Err(e) => {
                tracing::warn!(error = %e, "reading a send queue to drain it");
                return false;
            }
        }
    }
}

/// The phases' clock.
struct Phases(Vec<Phase>, Instant);

impl Phases {
    fn new() -> Self {
        Self(Vec::new(), Instant::now())
    }
    /// Ends the phase `name` now.
    fn mark(&mut self, name: &str) {
        let now = Instant::now();
        self.0.push(Phase {
            name: name.to_owned(),
            micros: now.duration_since(self.1).as_micros() as u64,
        });
        self.1 = now;
    }
    fn add(&mut self, name: &str, micros: u64) {
        self.0.push(Phase {
            name: name.to_owned(),
            micros,
        });
    }
}

impl Groups {
    /// Hands `conn`, passed by `pid`, to the group's server on `node`.
    pub async fn handoff(
        self: &Arc<Self>,
        pid: i32,
        conn: OwnedFd,
        node: String,
        drain_limit: Duration,
        app_state: Vec<u8>,
    ) -> Result<HandedOff, GroupsError> {
        let examined = examine(conn.as_fd(), self.public)?;
        let flow = examined.flow;
        let group = self.group(flow.local_port).ok_or(GroupsError::NoGroup {
            port: flow.local_port,
            node: self.node.clone(),
        })?;
        self.check_server(pid, flow.local_port)?;
        if node == self.node || !group.members.contains(&node) {
            return Err(GroupsError::NodeNotInGroup {
                node,
                port: group.port,
                members: group.members.join(", "),
            });
        }
        self.begin(flow)?;
        let Ok(_turn) = self.giving.acquire().await else {
            self.end(flow, Outcome::Failed);
            return Err(GroupsError::Internal("the agent is stopping".into()));
        };
        let id = format!("handoff-{}-{}-{}", self.node, flow, rand::random::<u32>());
        tracing::info!(%id, %flow, acceptor = %node, pid, "handing a connection off");
        let r = self
            .give(&id, examined, conn, &node, drain_limit, app_state, &group)
            .await;
        match &r {
            Ok(_) => self.end(flow, Outcome::Given { to: node.clone() }),
            Err(e) => {
                tracing::warn!(%id, %flow, acceptor = %node, error = %e, "handoff failed; the connection stays here");
                self.end(flow, Outcome::Failed);
            }
        }
        r
    }

    #[allow(clippy::too_many_arguments)]
    async fn give(
        self: &Arc<Self>,
        id: &str,
        examined: Examined,
        conn: OwnedFd,
        node: &str,
        drain_limit: Duration,
        app_state: Vec<u8>,
        group: &super::Group,
    ) -> Result<HandedOff, GroupsError> {
        let flow = examined.flow;
        let contact_here = group.contact == self.node;
        let mut phases = Phases::new();
        if !drain_limit.is_zero() {
            let drained = drain(conn.as_fd(), drain_limit).await;
            tracing::debug!(%flow, drained, "drained the send queue");
            phases.mark("drain");
        }
        let req = pb::HandoffPrepareRequest {
            id: id.to_owned(),
            donor: self.node.clone(),
            connection: Some(connection_pb(flow)),
        };
        self.call(node, STEP_TIMEOUT, |mut c| async move {
            c.handoff_prepare(req).await
        })
        .await?;
        phases.mark("prepare");

        // From here on a failure must give the connection back.
        let before = self.flow_state(flow)?;
        let frozen = Frozen::freeze(self.clone(), id, flow, before, examined.inode, conn).await?;
        let state = match frozen.read().await {
            Ok(s) => s,
            Err(e) => {
                frozen.give_back().await;
                self.abort_on(node, id).await;
                return Err(e);
            }
        };
        phases.mark("extract");
        let queued_bytes = (state.send_queue.len() + state.recv_queue.len()) as u64;
        let req = pb::HandoffTransferRequest {
            id: id.to_owned(),
            state: Some(state.to_pb()),
            app_state,
        };
        let transfer = self
            .call(node, STEP_TIMEOUT, |mut c| async move {
                c.handoff_transfer(req).await
            })
            .await;
        let rebuild_us = match transfer {
            Ok(r) => r.rebuild_us,
            Err(e) => {
                frozen.give_back().await;
                self.abort_on(node, id).await;
                return Err(e);
            }
        };
        phases.mark("transfer");
        phases.add("rebuild (acceptor)", rebuild_us);
        // Whoever becomes the contact node must know, before the
        // connection is the acceptor's, to leave it alone.
        self.record_on_chain(group, flow, node).await;
        phases.mark("record");

        // The commit point: the acceptor resumes its copy. Should the
        // answer not come, the acceptor is asked whether it committed; only
        // a "no" (or an acceptor that cannot be reached at all) gives the
        // connection back here.
        let req = pb::HandoffCommitRequest { id: id.to_owned() };
        let committed = match self
            .call(node, STEP_TIMEOUT, |mut c| async move {
                c.handoff_commit(req).await
            })
            .await
        {
            Ok(r) => Some(r),
            Err(e) => {
                tracing::warn!(id, error = %e, "HandoffCommit failed");
                None
            }
        };
        let committed = match committed {
            Some(c) => c,
            None => {
                if self.settle_commit(node, id).await {
                    pb::HandoffCommitResponse::default()
                } else {
                    frozen.give_back().await;
                    return Err(GroupsError::Unreachable {
                        node: node.to_owned(),
                        reason: "it did not take the connection (HandoffCommit failed)".into(),
                    });
                }
            }
        };
        phases.mark("commit");
        phases.add("resume (acceptor)", committed.resume_us);
        phases.add("deliver (acceptor)", committed.deliver_us);
        frozen.release(contact_here).await;
        Ok(HandedOff {
            acceptor: node.to_owned(),
            phases: phases.0,
            queued_bytes,
        })
    }

    /// How this node's filter treats `flow` now (None: by its port).
    pub(super) fn flow_state(&self, flow: Flow) -> Result<Option<FlowState>, GroupsError> {
        self.dataplane
            .table()
            .flow(flow)
            .map_err(|e| GroupsError::Internal(e.to_string()))
    }

    /// After a commit whose answer did not come: whether the acceptor
    /// committed. Asked until it answers: giving the connection back while
    /// the acceptor resumed it would make two owners. An acceptor silent
    /// for as long as it keeps a handoff uncommitted
    /// ([`super::acceptor::PENDING_LIMIT`]) has dropped it if it lives, so
    /// then the connection comes back here.
    async fn settle_commit(&self, node: &str, id: &str) -> bool {
        let until = std::time::Instant::now() + super::acceptor::PENDING_LIMIT;
        loop {
            if let Some(committed) = self.abort_on(node, id).await {
                return committed;
            }
            if std::time::Instant::now() >= until {
                tracing::error!(
                    id,
                    node,
                    "the acceptor never said whether it took the connection: taken back"
                );
                return false;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    /// Asks the acceptor to drop handoff `id`; Some(true) if it had
    /// committed already, None if it could not be asked.
    async fn abort_on(&self, node: &str, id: &str) -> Option<bool> {
        let req = pb::HandoffAbortRequest { id: id.to_owned() };
        let r = self
            .call(node, STEP_TIMEOUT, |mut c| async move {
                c.handoff_abort(req).await
            })
            .await;
        match r {
            Ok(r) => Some(r.committed),
            Err(e) => {
                tracing::warn!(id, node, error = %e, "asking the acceptor to drop a handoff");
                None
            }
        }
    }
}

/// A connection frozen on the donor: its packets captured, its socket in
/// repair mode (held by ferryd as well as the process).
struct Frozen {
    groups: Arc<Groups>,
    id: String,
    flow: Flow,
    /// How the filter treated it before (None: by its port).
    before: Option<FlowState>,
    held: Arc<Held>,
}

impl Frozen {
    /// Captures the connection's packets and stops anything leaving it.
    async fn freeze(
        groups: Arc<Groups>,
        id: &str,
        flow: Flow,
        before: Option<FlowState>,
        inode: u64,
        conn: OwnedFd,
    ) -> Result<Self, GroupsError> {
        let g = groups.clone();
        let (sid, f) = (id.to_owned(), flow);
        tokio::task::spawn_blocking(move || {
            g.dataplane.capture.open_flow(&sid, f);
            g.dataplane.table().set_flow(f, FlowState::Capturing)
        })
        .await
        .map_err(|e| GroupsError::Internal(e.to_string()))?
        .map_err(|e| GroupsError::Internal(e.to_string()))?;
        Ok(Self {
            groups,
            id: id.to_owned(),
            flow,
            before,
            held: Arc::new(Held::from_descriptors(vec![(inode, conn)])),
        })
    }

    /// Turns repair on and reads the connection's state.
    async fn read(&self) -> Result<TcpConnectionState, GroupsError> {
        let held = self.held.clone();
        tokio::task::spawn_blocking(move || held.extract(true))
            .await
            .map_err(|e| GroupsError::Internal(e.to_string()))?
            .map_err(|e| GroupsError::Internal(format!("reading the connection: {e}")))?
            .pop()
            .ok_or_else(|| GroupsError::Internal("no state read".into()))
    }

    /// Before the commit point: the connection is this node's again, the
    /// packets captured meanwhile delivered in order.
    async fn give_back(self) {
        let Self {
            groups,
            id,
            flow,
            before,
            held,
        } = self;
        let done = tokio::task::spawn_blocking(move || {
            if let Err(e) = held.resume() {
                tracing::error!(%flow, error = %e, "taking a connection out of repair mode");
            }
            let dp = &groups.dataplane;
            if let Err(e) = dp.table().set_flow(flow, FlowState::Releasing) {
                tracing::error!(%flow, error = %e, "releasing a connection");
            }
            let replayed = dp.replay_and_open(&id, &[], &[], &[], || {
                let mut table = dp.table();
                match before {
                    Some(s) => table.set_flow(flow, s),
                    None => table.remove_flow(flow),
                }
            });
            match replayed {
                Ok(stats) => tracing::info!(%flow, replayed = stats.replayed, "connection given back to its donor"),
                Err(e) => tracing::error!(%flow, error = %e, "giving a connection back"),
            }
        })
        .await;
        if let Err(e) = done {
            tracing::error!(error = %e, "giving a connection back");
        }
    }

    /// After the commit point: the connection is the acceptor's. The
    /// contact node keeps an entry that drops its packets (its port would
    /// take them); a member forgets it (its port drops them anyway). The
    /// socket closes silently in repair mode once the process closes its
    /// descriptor too.
    async fn release(self, contact_here: bool) {
        let Self {
            groups, id, flow, ..
        } = self;
        let done = tokio::task::spawn_blocking(move || {
            groups.dataplane.capture.close(&id);
            let mut table = groups.dataplane.table();
            if contact_here {
                table.set_flow(flow, FlowState::Elsewhere)
            } else {
                table.remove_flow(flow)
            }
        })
        .await;
        match done {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::error!(%flow, error = %e, "letting a handed-off connection go"),
            Err(e) => tracing::error!(%flow, error = %e, "letting a handed-off connection go"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{Ipv4Addr, Ipv6Addr, TcpListener, TcpStream, UdpSocket};

    fn refusal(r: Result<Examined, GroupsError>) -> String {
        match r {
            Err(GroupsError::NotAConnection(why)) => why,
            other => panic!("expected NotAConnection, got {other:?}"),
        }
    }

    #[test]
    fn only_an_established_tcp_connection_to_the_public_address_is_handed_off() {
        use crate::config::PublicAddresses;
        let lo = PublicAddresses {
            v4: Some(Ipv4Addr::LOCALHOST),
            v6: Some(Ipv6Addr::LOCALHOST),
        };
        let udp = UdpSocket::bind("127.0.0.1:0").unwrap();
        assert!(refusal(examine(udp.as_fd(), lo)).contains("not a TCP socket"));
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        assert!(refusal(examine(listener.as_fd(), lo)).contains("not established"));
        let file = std::fs::File::open("/proc/self/stat").unwrap();
        assert!(refusal(examine(file.as_fd(), lo)).contains("not a socket"));

        // IPv4, IPv6, and an IPv4 client of a dual-stack listener (given by
        // its IPv4 address, as its packets carry it).
        let dual = TcpListener::bind("[::]:0").unwrap();
        for (listener, to) in [
            (&listener, listener.local_addr().unwrap()),
            (
                &dual,
                (Ipv6Addr::LOCALHOST, dual.local_addr().unwrap().port()).into(),
            ),
            (
                &dual,
                (Ipv4Addr::LOCALHOST, dual.local_addr().unwrap().port()).into(),
            ),
        ] {
            let client = TcpStream::connect(to).unwrap();
            let (served, _) = listener.accept().unwrap();
            let e = examine(served.as_fd(), lo).unwrap();
            assert_eq!(e.flow.local_port, to.port());
            assert_eq!(e.flow.remote, client.local_addr().unwrap(), "to {to}");
            let elsewhere = PublicAddresses {
                v4: Some(Ipv4Addr::new(198, 18, 0, 100)),
                v6: Some("2001:2::100".parse().unwrap()),
            };
            assert!(
                refusal(examine(served.as_fd(), elsewhere))
                    .contains("not the cluster's public one")
            );
        }
    }
}
