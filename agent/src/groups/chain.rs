//! The contact node and its backups (the XtreemOS distributed servers'
//! membership protocol): the chain `contact, backup 1, backup 2, ...`.
//!
//! - **Failure detection**: each backup asks the node before it in the
//!   chain every [`HEARTBEAT_EVERY`] whether it lives; one silent for
//!   [`SUSPECT_AFTER`] is taken as failed.
//! - **View change by two-phase commit**: the node that found the failure
//!   proposes the view without the failed node (the first backup becomes
//!   the contact node if the contact node failed) to every other node of
//!   the new chain; each promises not to take an older view; with every
//!   promise (a node that does not answer is left out too, in a next
//!   proposal) the view is committed to the chain and to every other
//!   member. Two proposers for the same epoch cannot both win: each node
//!   promises an epoch once.
//! - **The table of connections**: before its commit point a donor records
//!   who will serve the connection on every node of the chain
//!   ([`Groups::record_on_chain`]), so a backup that becomes the contact
//!   node leaves each connection served elsewhere to its server (its
//!   filter gets an `Elsewhere` entry for it before it takes the port's
//!   new connections). The server of a connection that ended tells the
//!   chain ([`Groups::sweep`]), which forgets it.
//!
//! - **Joining again**: heartbeats carry the asker's epoch, and the answer
//!   brings a newer view; a node that finds itself left out of it (taken
//!   as failed while only slow) or behind it asks the contact node to take
//!   it back ([`super::members`]), the seed's "please join again".

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_proto::v1 as pb;

use super::{Group, Groups, GroupsError, connection_pb};
use crate::dataplane::{Flow, FlowState, PortState};

/// How often a backup asks the node before it in the chain.
pub const HEARTBEAT_EVERY: Duration = Duration::from_millis(100);

/// How long a node may stay silent before its successor takes it as
/// failed: with [`HEARTBEAT_EVERY`] and the commit's round trips, new
/// connections are served again within a second of a contact node's
/// failure.
pub const SUSPECT_AFTER: Duration = Duration::from_millis(500);

/// How long one heartbeat or one step of a view change may take.
const CALL_TIMEOUT: Duration = Duration::from_millis(300);

/// How often a node looks for ended connections among those it serves.
const SWEEP_EVERY: Duration = Duration::from_secs(2);

impl Groups {
    /// The epoch for a view this node proposes: above every one it holds
    /// or promised (a proposal that failed may have left a promise).
    pub(super) fn next_epoch(&self, port: u16) -> Result<u64, GroupsError> {
        self.groups()
            .get(&port)
            .map(|g| g.group.epoch.max(g.promised) + 1)
            .ok_or_else(|| GroupsError::NoGroup {
                port,
                node: self.node.clone(),
            })
    }

    /// Phase one of a view change: promise `group`'s epoch if it is above
    /// every one this node holds or promised. Returns (accepted, the epoch
    /// this node holds or promised).
    pub fn promise(&self, group: &Group, proposer: &str) -> (bool, u64) {
        let mut groups = self.groups();
        let Some(g) = groups.get_mut(&group.port) else {
            // A node joining a running group holds nothing yet: it takes
            // the view at the commit.
            return (group.members.contains(&self.node), 0);
        };
        let known = g.promised.max(g.group.epoch);
        if group.epoch <= known {
            tracing::info!(
                port = group.port,
                proposer,
                epoch = group.epoch,
                known,
                "a view change refused: an equal or newer one is known"
            );
            return (false, known);
        }
        g.promised = group.epoch;
        (true, group.epoch)
    }

    /// Phase two, or a member told of a new view: takes `group` (if newer
    /// than the view held) with the connections the chain knows of. A node
    /// new to the group filters its port; a contact node that is one no
    /// longer keeps its own connections and stops taking new ones; a new
    /// contact node takes over.
    pub async fn apply_view(
        self: &Arc<Self>,
        group: Group,
        table: Vec<(Flow, String)>,
    ) -> Result<(), GroupsError> {
        if !group.members.contains(&self.node) {
            if self
                .group(group.port)
                .is_some_and(|g| g.epoch < group.epoch)
            {
                self.leave(group.port).await;
            }
            return Ok(());
        }
        let (was, now_contact) = {
            let mut groups = self.groups();
            let (g, was) = match groups.get_mut(&group.port) {
                Some(g) => {
                    let was = Some(g.group.contact == self.node);
                    (g, was)
                }
                None => {
                    groups.insert(group.port, super::GroupState::new(group.clone()));
                    (groups.get_mut(&group.port).expect("just inserted"), None)
                }
            };
            if group.epoch < g.group.epoch {
                return Ok(());
            }
            for (flow, node) in table {
                g.connections.entry(flow).or_insert(node);
            }
            g.group = group.clone();
            g.promised = g.promised.max(group.epoch);
            g.predecessor_heard = Instant::now();
            (was, group.contact == self.node)
        };
        self.save_views();
        tracing::info!(port = group.port, epoch = group.epoch, contact = %group.contact, backups = ?group.backups, members = ?group.members, "the group's view changed");
        self.publish(
            group.port,
            "view",
            format!(
                "epoch {}: contact {}, backups [{}], members [{}]",
                group.epoch,
                group.contact,
                group.backups.join(", "),
                group.members.join(", ")
            ),
        );
        match (was, now_contact) {
            (Some(false), true) => self.take_over(group.port).await?,
            (Some(true), false) => self.step_down(group.port).await?,
            (None, _) => self.filter_port(&group).await?,
            _ => {}
        }
        Ok(())
    }

    /// This node becomes the group's contact node: every connection served
    /// elsewhere gets its `Elsewhere` entry first, then the port takes new
    /// connections here.
    pub(super) async fn take_over(self: &Arc<Self>, port: u16) -> Result<(), GroupsError> {
        let started = Instant::now();
        let elsewhere: Vec<Flow> = self
            .groups()
            .get(&port)
            .map(|g| {
                g.connections
                    .iter()
                    .filter(|(_, n)| **n != self.node)
                    .map(|(f, _)| *f)
                    .collect()
            })
            .unwrap_or_default();
        let count = elsewhere.len();
        self.set_flows(elsewhere, FlowState::Elsewhere).await?;
        self.share_port(port, PortState::SharedContact).await?;
        tracing::warn!(
            port,
            served_elsewhere = count,
            took_us = started.elapsed().as_micros() as u64,
            "this node is the group's contact node now"
        );
        self.publish(
            port,
            "contact",
            format!("{count} connections served elsewhere left to their servers"),
        );
        Ok(())
    }

    /// Records on every other node of the chain that `node` serves `flow`
    /// (a donor, before its commit point). A node of the chain that does
    /// not answer is left to failure detection: it is on its way out.
    pub(super) async fn record_on_chain(&self, group: &Group, flow: Flow, node: &str) {
        let targets: Vec<String> = group
            .chain()
            .into_iter()
            .filter(|n| *n != self.node && n != node)
            .collect();
        let calls = targets.iter().map(|target| async move {
            let req = pb::RecordConnectionRequest {
                connection: Some(connection_pb(flow)),
                node: node.to_owned(),
            };
            let r = self
                .call(target, CALL_TIMEOUT, |mut c| async move {
                    c.record_connection(req).await
                })
                .await;
            if let Err(e) = r {
                tracing::warn!(%flow, node = %target, error = %e, "recording a connection on the chain");
            }
        });
        futures::future::join_all(calls).await;
    }

    /// Forgets a connection that ended (its server said so).
    pub async fn forget_connection(&self, flow: Flow) {
        let known = self
            .groups()
            .get_mut(&flow.local_port)
            .and_then(|g| g.connections.remove(&flow))
            .is_some();
        if !known {
            return;
        }
        let dp = self.dataplane.clone();
        let r = tokio::task::spawn_blocking(move || dp.table().remove_flow(flow)).await;
        if let Ok(Err(e)) | Err(e) = r.map_err(|e| crate::dataplane::DataPlaneError(e.to_string()))
        {
            tracing::warn!(%flow, error = %e, "forgetting a connection");
        }
    }

    /// Runs for as long as the agent does: heartbeats to the node before
    /// this one in each group's chain, view changes when it fails, and the
    /// sweep of ended connections.
    pub async fn watch(self: Arc<Self>) {
        let mut ticker = tokio::time::interval(HEARTBEAT_EVERY);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut swept = Instant::now();
        let mut last_round = Instant::now();
        loop {
            ticker.tick().await;
            // A silence measured while this node itself did not run (its
            // agent stopped, the machine overloaded) is not the other
            // node's: start counting again.
            if last_round.elapsed() > SUSPECT_AFTER / 2 {
                tracing::warn!(
                    late_ms = last_round.elapsed().as_millis() as u64,
                    "this node's heartbeats were late: silences are counted again from now"
                );
                for g in self.groups().values_mut() {
                    g.predecessor_heard = Instant::now();
                }
            }
            if !crate::sync::lock(&self.unsynced).is_empty() {
                self.resync_restored().await;
            }
            self.heartbeats().await;
            last_round = Instant::now();
            if swept.elapsed() >= SWEEP_EVERY {
                swept = Instant::now();
                self.sweep().await;
            }
        }
    }

    /// One round of heartbeats. Each backup asks the node before it in the
    /// chain, and proposes a view without it once it was silent for
    /// [`SUSPECT_AFTER`]; the contact node asks its first backup, only to
    /// learn of a view it missed. An answer with a newer view that this
    /// node missed, or that left it out, makes it ask the contact node to
    /// take it back ([`Groups::rejoin`]).
    async fn heartbeats(self: &Arc<Self>) {
        let watched: Vec<(Group, String, bool)> = self
            .groups()
            .values()
            .filter_map(|g| {
                let chain = g.group.chain();
                let i = chain.iter().position(|n| *n == self.node)?;
                if i > 0 {
                    Some((g.group.clone(), chain[i - 1].clone(), true))
                } else {
                    chain.get(1).map(|n| (g.group.clone(), n.clone(), false))
                }
            })
            .collect();
        for (group, asked, watching) in watched {
            let req = pb::HeartbeatRequest {
                port: u32::from(group.port),
                from: self.node.clone(),
                epoch: group.epoch,
            };
            let answer = self
                .call_on(&asked, CALL_TIMEOUT, true, |mut c| async move {
                    c.heartbeat(req).await
                })
                .await;
            let alive = answer.is_ok();
            if let Ok(pb::HeartbeatResponse {
                group: Some(newer), ..
            }) = answer
                && newer.epoch > group.epoch
            {
                match Group::from_pb(&newer) {
                    Ok(newer) => self.start_rejoin(group.clone(), newer),
                    Err(e) => {
                        tracing::warn!(node = %asked, error = %e, "a heartbeat's answer with a view that does not check");
                    }
                }
            }
            if !watching {
                continue;
            }
            let silent_for = {
                let mut groups = self.groups();
                let Some(g) = groups.get_mut(&group.port) else {
                    continue;
                };
                if alive {
                    g.predecessor_heard = Instant::now();
                }
                g.predecessor_heard.elapsed()
            };
            if !alive && silent_for >= SUSPECT_AFTER {
                tracing::warn!(port = group.port, failed = %asked, silent_ms = silent_for.as_millis() as u64, "the node before this one in the chain is silent: proposing a view without it");
                if let Err(e) = self.propose_without(&group, &asked).await {
                    tracing::warn!(port = group.port, error = %e, "a view change failed; tried again at the next heartbeat");
                }
            }
        }
    }

    /// The two-phase commit of the view without `failed`; a node of the
    /// new chain that does not answer is left out too, in a next round.
    async fn propose_without(
        self: &Arc<Self>,
        group: &Group,
        failed: &str,
    ) -> Result<(), GroupsError> {
        let _turn = self.changing.lock().await;
        let mut out: BTreeSet<String> = BTreeSet::from([failed.to_owned()]);
        let mut view = group.clone();
        for _round in 0..4 {
            let mut next = view.clone();
            for n in &out {
                if let Some(v) = next.without(n) {
                    next = v;
                }
            }
            next.epoch = self.next_epoch(group.port)?;
            let silent = self.prepare(&next, &[]).await?;
            if !silent.is_empty() {
                out.extend(silent);
                view = next;
                continue;
            }
            // The nodes left out are not told: one that was only slow finds
            // out from a heartbeat's answer and joins again with the
            // connections it serves ([`Groups::rejoin`]).
            let targets = group
                .members
                .iter()
                .filter(|n| next.members.contains(n))
                .cloned()
                .collect();
            self.commit_view(next, targets, false).await;
            return Ok(());
        }
        Err(GroupsError::Internal(
            "no view change agreed in four rounds".into(),
        ))
    }

    /// Phase one for `next` (its epoch set): this node promises it, then
    /// every other node of its chain and each of `also` (a node joining).
    /// Returns the nodes that did not answer; an error if one refused.
    pub(super) async fn prepare(
        &self,
        next: &Group,
        also: &[String],
    ) -> Result<Vec<String>, GroupsError> {
        let (accepted, known) = self.promise(next, &self.node);
        if !accepted {
            return Err(GroupsError::Refused {
                port: next.port,
                reason: format!(
                    "a view at epoch {} or later is known on {} already (epoch {known})",
                    next.epoch, self.node
                ),
            });
        }
        let mut voters: Vec<String> = next
            .chain()
            .into_iter()
            .filter(|n| *n != self.node)
            .collect();
        for n in also {
            if !voters.contains(n) && *n != self.node {
                voters.push(n.clone());
            }
        }
        let votes = futures::future::join_all(voters.iter().map(|n| {
            let req = pb::ViewPrepareRequest {
                group: Some(next.to_pb()),
                proposer: self.node.clone(),
            };
            async move {
                let r = self
                    .call(
                        n,
                        CALL_TIMEOUT,
                        |mut c| async move { c.view_prepare(req).await },
                    )
                    .await;
                (n.clone(), r)
            }
        }))
        .await;
        let mut silent = Vec::new();
        for (n, vote) in votes {
            match vote {
                Ok(v) if v.accepted => {}
                Ok(v) => {
                    return Err(GroupsError::Refused {
                        port: next.port,
                        reason: format!(
                            "{n} refused the view at epoch {} (it knows epoch {})",
                            next.epoch, v.epoch
                        ),
                    });
                }
                Err(e) => {
                    tracing::warn!(node = %n, error = %e, epoch = next.epoch, "no vote on a view change");
                    silent.push(n);
                }
            }
        }
        Ok(silent)
    }

    /// Phase two: each of `targets` takes the new view with the table of
    /// connections, then this node (first if `here_first`: a contact node
    /// that leaves gives up the port before its successor takes it, so
    /// that two nodes never answer the same new connection).
    pub(super) async fn commit_view(
        self: &Arc<Self>,
        view: Group,
        targets: Vec<String>,
        here_first: bool,
    ) {
        let table = self
            .groups()
            .get(&view.port)
            .map(|g| super::table_pb(&g.connections))
            .unwrap_or_default();
        if here_first && let Err(e) = self.apply_view(view.clone(), Vec::new()).await {
            tracing::error!(error = %e, "taking the new view here");
        }
        let targets: Vec<String> = targets.into_iter().filter(|n| *n != self.node).collect();
        futures::future::join_all(targets.iter().map(|n| {
            let req = pb::ViewCommitRequest {
                group: Some(view.to_pb()),
                connections: table.clone(),
            };
            async move {
                let r = self
                    .call(
                        n,
                        CALL_TIMEOUT,
                        |mut c| async move { c.view_commit(req).await },
                    )
                    .await;
                if let Err(e) = r {
                    tracing::warn!(node = %n, error = %e, "committing a view");
                }
            }
        }))
        .await;
        if !here_first && let Err(e) = self.apply_view(view, Vec::new()).await {
            tracing::error!(error = %e, "taking the new view here");
        }
    }

    /// Forgets the connections handed to this node that ended (no socket
    /// of the connection left in this node's stack), and tells the chain.
    pub async fn sweep(self: &Arc<Self>) {
        let mine: Vec<(Group, Flow)> = self
            .groups()
            .values()
            .flat_map(|g| {
                g.connections
                    .iter()
                    .filter(|(f, n)| **n == self.node && !g.in_flight.contains(f))
                    .map(|(f, _)| (g.group.clone(), *f))
                    .collect::<Vec<_>>()
            })
            .collect();
        if mine.is_empty() {
            return;
        }
        let live = match tokio::task::spawn_blocking(tcp_ends).await {
            Ok(Ok(live)) => live,
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "reading this node's TCP sockets");
                return;
            }
            Err(e) => {
                tracing::warn!(error = %e, "reading this node's TCP sockets");
                return;
            }
        };
        for (group, flow) in mine {
            if live.contains(&(flow.remote, flow.local_port)) {
                continue;
            }
            tracing::debug!(%flow, "a handed-off connection ended");
            self.forget_connection(flow).await;
            for n in group.chain().iter().filter(|n| **n != self.node) {
                let req = pb::ConnectionClosedRequest {
                    connection: Some(connection_pb(flow)),
                };
                let r = self
                    .call(n, CALL_TIMEOUT, |mut c| async move {
                        c.connection_closed(req).await
                    })
                    .await;
                if let Err(e) = r {
                    tracing::debug!(node = %n, error = %e, "telling the chain a connection ended");
                }
            }
        }
    }
}

/// This network namespace's TCP tables, IPv4 and IPv6.
pub(super) const TCP_TABLES: [&str; 2] = ["/proc/self/net/tcp", "/proc/self/net/tcp6"];

/// (remote end, local port) of every TCP socket of this network namespace,
/// IPv4 and IPv6, in any state but listening (a closing connection still
/// owns its packets). An IPv4 client of a dual-stack socket is given by its
/// IPv4 address.
pub(super) fn tcp_ends() -> std::io::Result<BTreeSet<(SocketAddr, u16)>> {
    let mut ends = BTreeSet::new();
    for table in TCP_TABLES {
        match std::fs::read_to_string(table) {
            Ok(text) => ends.extend(parse_proc_net_tcp(&text)),
            // No IPv6 in this kernel: no tcp6 table.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && table.ends_with('6') => {}
            Err(e) => return Err(e),
        }
    }
    Ok(ends)
}

fn parse_proc_net_tcp(text: &str) -> BTreeSet<(SocketAddr, u16)> {
    tcp_entries(text)
        .filter(|e| !e.listening)
        .map(|e| (e.remote, e.local.port()))
        .collect()
}

/// One socket of a /proc/net/tcp or tcp6 text.
pub(super) struct TcpEntry {
    pub local: SocketAddr,
    pub remote: SocketAddr,
    pub listening: bool,
    pub inode: u64,
}

/// The sockets of a /proc/net/tcp or tcp6 text: "sl local_address
/// rem_address st ... inode", addresses as hex ADDR:PORT, the address as
/// 32-bit words each in the kernel's (little-endian) order: one for IPv4,
/// four for IPv6. IPv4-mapped IPv6 addresses are given as IPv4 ones.
pub(super) fn tcp_entries(text: &str) -> impl Iterator<Item = TcpEntry> + '_ {
    let end = crate::inet::of_proc_net;
    text.lines().skip(1).filter_map(move |l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        Some(TcpEntry {
            local: end(f.get(1)?)?,
            remote: end(f.get(2)?)?,
            // 0A: TCP_LISTEN.
            listening: *f.get(3)? == "0A",
            inode: f.get(9)?.parse().ok()?,
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_net_tcp_gives_each_connection_its_client_and_port() {
        let text = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n   \
            0: 00000000:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1 0000000000000000 100 0 0 10 0\n   \
            1: 640012C6:1F90 0B0012C6:9D2C 01 00000000:00000000 00:00000000 00000000     0        0 2 1 0000000000000000 20 4 30 10 -1\n";
        let ends = parse_proc_net_tcp(text);
        assert_eq!(
            ends.into_iter().collect::<Vec<_>>(),
            vec![("198.18.0.11:40236".parse().unwrap(), 8080)]
        );
    }
}
