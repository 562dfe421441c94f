//! Distributed servers (the XtreemOS distributed servers, rebuilt on
//! ferry's single-IP cluster): a group of server processes on several nodes
//! that clients see as one port of the cluster's address.
//!
//! - Each group has a **contact node**, which takes every new connection
//!   (its filter owns the port: `PortState::SharedContact`), and members
//!   that serve only the connections handed to them
//!   (`PortState::SharedMember`). Which node serves an established
//!   connection is decided per connection, beside the port, in the same
//!   eBPF filter (`ferry_ebpf::FlowState`): so the original's Mobile IPv6
//!   route optimisation, which every client had to support, is not needed:
//!   any client works.
//! - A serving process hands one established TCP connection to another
//!   member's serving process ([`local`]: the `ferry-handoff` library over
//!   a Unix socket, the descriptor passed by `SCM_RIGHTS`). The donor's
//!   ferryd freezes the connection in its filter, reads it with TCP repair
//!   and ships it ([`donor`]); the acceptor's ferryd captures its packets
//!   meanwhile, rebuilds it, replays them and hands it to its process
//!   ([`acceptor`]), with the same guarantees as a migration: no packet
//!   lost, no reset, never two owners, and until the commit point a failure
//!   leaves the connection with the donor.
//! - Groups are created through the Control API on any node, which asks
//!   every member to join ([`Groups::create`]); a running group's members
//!   change through its contact node ([`members`]), and a restarted agent
//!   serves its groups again ([`saved`]).
//!
//! - The contact node has backups ([`chain`]): each watches the node
//!   before it, and a failure changes the group's view by two-phase commit
//!   among the contact node and backups; when the contact node fails, its
//!   first backup takes new connections. Every node of the chain keeps the
//!   table of connections served elsewhere, so the new contact node leaves
//!   them alone: no established connection is lost with the contact node
//!   (but those it served itself).
//!
//! - New connections are placed by a policy of the policy crate
//!   ([`Groups::place`]); an operator can hand off any connection
//!   ([`operator`]).

pub mod acceptor;
pub mod chain;
pub mod donor;
mod group;
pub mod local;
pub mod members;
pub mod operator;
mod saved;
pub mod service;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex, MutexGuard};

use ferry_handoff::ErrorKind;
use ferry_proto::v1 as pb;
use tonic::Status;

use crate::cluster::Cluster;
use crate::dataplane::{DataPlane, Flow, FlowState, PortState};
use crate::managed::Processes;
use crate::ports::Ports;
use crate::sync::lock;

pub use group::Group;

/// How many handoffs a node gives at once (more wait their turn).
const GIVING_AT_ONCE: usize = 16;

/// How long a member may take to join or leave a group.
const JOIN_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// What went wrong, for the Control and Peer APIs (a gRPC status) and for
/// a process on the handoff socket (an [`ErrorKind`]).
#[derive(Debug, thiserror::Error)]
pub enum GroupsError {
    #[error("{field}: {reason}")]
    Invalid { field: &'static str, reason: String },
    #[error("node {node} is not known to {here} (not a configured peer, not found by membership)")]
    UnknownNode { node: String, here: String },
    #[error("no group serves port {port} on {node}")]
    NoGroup { port: u16, node: String },
    #[error("port {port} already has a group on {node}, with other members: {existing}")]
    Conflict {
        port: u16,
        node: String,
        existing: String,
    },
    #[error("PID {pid} is not a server of the group on port {port} on {node}: {reason}")]
    NotMember {
        pid: i32,
        port: u16,
        node: String,
        reason: String,
    },
    #[error("not an established TCP connection of a group's port: {0}")]
    NotAConnection(String),
    #[error("{node} is not a member of the group on port {port} (members: {members})")]
    NodeNotInGroup {
        node: String,
        port: u16,
        members: String,
    },
    #[error("a handoff of {flow} is under way already")]
    Busy { flow: Flow },
    #[error("no process serves the group on port {port} on {node}")]
    NoServer { port: u16, node: String },
    #[error("no handoff {id} is under way on {node}")]
    UnknownHandoff { id: String, node: String },
    #[error("{node}: {status}")]
    Peer { node: String, status: Status },
    #[error("{node} unreachable: {reason}")]
    Unreachable { node: String, reason: String },
    #[error("{node} is not the contact node of the group on port {port}: {contact} is")]
    NotContact {
        port: u16,
        node: String,
        contact: String,
    },
    #[error("the group on port {port}: {reason}")]
    Refused { port: u16, reason: String },
    #[error("{0}")]
    Internal(String),
}

impl GroupsError {
    /// The kind a process sees on the handoff socket.
    pub fn kind(&self) -> ErrorKind {
        match self {
            GroupsError::Invalid { .. } => ErrorKind::BadRequest,
            GroupsError::NoGroup { .. }
            | GroupsError::NodeNotInGroup { .. }
            | GroupsError::UnknownNode { .. } => ErrorKind::NotInGroup,
            GroupsError::NotMember { .. } => ErrorKind::NotMember,
            GroupsError::NotAConnection(_) => ErrorKind::NotAConnection,
            GroupsError::Busy { .. } => ErrorKind::Busy,
            GroupsError::NoServer { .. }
            | GroupsError::Conflict { .. }
            | GroupsError::NotContact { .. }
            | GroupsError::Refused { .. } => ErrorKind::Refused,
            GroupsError::Peer { status, .. } => match status.code() {
                tonic::Code::FailedPrecondition
                | tonic::Code::NotFound
                | tonic::Code::AlreadyExists
                | tonic::Code::InvalidArgument => ErrorKind::Refused,
                _ => ErrorKind::Unavailable,
            },
            GroupsError::Unreachable { .. } | GroupsError::UnknownHandoff { .. } => {
                ErrorKind::Unavailable
            }
            GroupsError::Internal(_) => ErrorKind::Internal,
        }
    }
}

impl From<GroupsError> for Status {
    fn from(e: GroupsError) -> Self {
        let m = e.to_string();
        match e {
            GroupsError::Invalid { .. } | GroupsError::UnknownNode { .. } => {
                Status::invalid_argument(m)
            }
            GroupsError::NoGroup { .. } | GroupsError::UnknownHandoff { .. } => {
                Status::not_found(m)
            }
            GroupsError::Conflict { .. } => Status::already_exists(m),
            GroupsError::NotMember { .. } => Status::permission_denied(m),
            GroupsError::NotAConnection(_)
            | GroupsError::NodeNotInGroup { .. }
            | GroupsError::Busy { .. }
            | GroupsError::NoServer { .. }
            | GroupsError::NotContact { .. }
            | GroupsError::Refused { .. } => Status::failed_precondition(m),
            GroupsError::Peer { status, .. } => Status::new(status.code(), m),
            GroupsError::Unreachable { .. } => Status::unavailable(m),
            GroupsError::Internal(_) => Status::internal(m),
        }
    }
}

/// A process registered as a server of a group on this node.
#[derive(Debug, Clone)]
pub struct ServerChannel {
    pub pid: i32,
    /// The process's end of the handoff socket is the other side: the
    /// connections handed to it are sent here.
    pub channel: Arc<OwnedFd>,
}

/// Handoff counts of a group on this node.
#[derive(Debug, Clone, Copy, Default)]
pub struct HandoffCounts {
    pub given: u64,
    pub taken: u64,
    pub failed: u64,
}

/// One group as this node holds it.
#[derive(Debug)]
struct GroupState {
    group: Group,
    servers: Vec<ServerChannel>,
    /// Connections decided one by one, with who serves each (this node's
    /// view: on a member those handed to it; on the contact node also
    /// every one handed elsewhere).
    connections: BTreeMap<Flow, String>,
    /// Connections a handoff from or to this node is moving.
    in_flight: BTreeSet<Flow>,
    counts: HandoffCounts,
    /// The highest view this node accepted in a two-phase commit's first
    /// phase ([`chain`]).
    promised: u64,
    /// When the node before this one in the chain last answered.
    predecessor_heard: std::time::Instant,
    /// This node is asking the contact node to take it back (or to send
    /// the view it missed): one such call at a time ([`members`]).
    rejoining: bool,
    /// Where new connections go ([`Groups::place`]).
    placer: ferry_policy::placement::Placer,
}

impl GroupState {
    fn new(group: Group) -> Self {
        Self {
            promised: group.epoch,
            servers: Vec::new(),
            connections: BTreeMap::new(),
            in_flight: BTreeSet::new(),
            counts: HandoffCounts::default(),
            predecessor_heard: std::time::Instant::now(),
            rejoining: false,
            placer: ferry_policy::placement::Placer::new(group.placement),
            group,
        }
    }
}

/// This node's distributed servers.
#[derive(Debug)]
pub struct Groups {
    node: String,
    /// The cluster's public addresses (the connections' local address).
    public: crate::config::PublicAddresses,
    ports: Arc<Ports>,
    dataplane: Arc<DataPlane>,
    cluster: Arc<Cluster>,
    processes: Arc<Processes>,
    events: Arc<crate::events::EventBus>,
    groups: Mutex<BTreeMap<u16, GroupState>>,
    /// Handoffs this node accepts, by id ([`acceptor`]).
    incoming: Mutex<HashMap<String, acceptor::Incoming>>,
    /// A channel per peer, kept: heartbeats go out ten times a second and
    /// a contact node hands off thousands of connections, each in five
    /// calls; a TLS handshake per call would cost more than the calls (a
    /// thousand handoffs at once timed out on handshakes). One HTTP/2
    /// connection per peer carries them all.
    channels: Mutex<HashMap<String, tonic::transport::Channel>>,
    /// Bounds the handoffs this node gives at once: each holds a
    /// connection frozen, and under a burst (a contact node placing
    /// thousands of new connections) a queue is better than steps timing
    /// out on a saturated acceptor.
    giving: tokio::sync::Semaphore,
    /// One view change proposed by this node at a time (a failure found by
    /// a heartbeat, an operator's or a node's change of members): two would
    /// both ask for the next epoch and one would be refused.
    changing: tokio::sync::Mutex<()>,
    /// Where the views are saved for a restarted agent ([`saved`]).
    saved: Option<Arc<saved::ViewsFile>>,
    /// Groups restored at start and not yet confirmed by their chain, with
    /// when they were restored.
    unsynced: Mutex<BTreeMap<u16, std::time::Instant>>,
}

impl Groups {
    pub fn new(
        node: &str,
        public: crate::config::PublicAddresses,
        ports: Arc<Ports>,
        dataplane: Arc<DataPlane>,
        cluster: Arc<Cluster>,
        processes: Arc<Processes>,
        events: Arc<crate::events::EventBus>,
    ) -> Self {
        Self {
            node: node.to_owned(),
            public,
            ports,
            dataplane,
            cluster,
            processes,
            events,
            groups: Mutex::new(BTreeMap::new()),
            incoming: Mutex::new(HashMap::new()),
            channels: Mutex::new(HashMap::new()),
            giving: tokio::sync::Semaphore::new(GIVING_AT_ONCE),
            changing: tokio::sync::Mutex::new(()),
            saved: None,
            unsynced: Mutex::new(BTreeMap::new()),
        }
    }

    /// The views are saved in `path` at each change, and a restarted agent
    /// serves the groups again ([`Self::restore`]).
    pub fn saved_in(mut self, path: std::path::PathBuf) -> Self {
        self.saved = Some(Arc::new(saved::ViewsFile::new(path)));
        self
    }

    pub fn node(&self) -> &str {
        &self.node
    }

    /// Tells `WatchEvents`' watchers.
    fn publish(&self, port: u16, what: &str, detail: String) {
        self.events
            .publish(ferry_proto::v1::cluster_event::Event::Group(
                pb::GroupEvent {
                    port: u32::from(port),
                    what: what.to_owned(),
                    detail,
                },
            ));
    }

    fn groups(&self) -> MutexGuard<'_, BTreeMap<u16, GroupState>> {
        lock(&self.groups)
    }

    /// The state of the group on `port`, in `groups` (this node's lock).
    fn state_in<'a>(
        &self,
        groups: &'a mut BTreeMap<u16, GroupState>,
        port: u16,
    ) -> Result<&'a mut GroupState, GroupsError> {
        groups.get_mut(&port).ok_or_else(|| GroupsError::NoGroup {
            port,
            node: self.node.clone(),
        })
    }

    /// The group on `port`, if this node is in one.
    pub fn group(&self, port: u16) -> Option<Group> {
        self.groups().get(&port).map(|g| g.group.clone())
    }

    /// Creates `group`: every member joins it (this node too, if it is
    /// one), all or none: on a member's refusal the ones that joined leave
    /// again, and the error names the member.
    pub async fn create(self: &Arc<Self>, group: Group) -> Result<Group, GroupsError> {
        for m in &group.members {
            if *m != self.node && self.cluster.peer(m).is_none() {
                return Err(GroupsError::UnknownNode {
                    node: m.clone(),
                    here: self.node.clone(),
                });
            }
        }
        let mut joined = Vec::new();
        for m in &group.members {
            let r = if *m == self.node {
                self.join(group.clone()).await
            } else {
                self.peer_join(m, &group).await
            };
            match r {
                Ok(()) => joined.push(m.clone()),
                Err(e) => {
                    for j in joined {
                        self.leave_on(&j, group.port).await;
                    }
                    return Err(e);
                }
            }
        }
        tracing::info!(port = group.port, contact = %group.contact, members = ?group.members, "group created");
        Ok(group)
    }

    /// Deletes the group on `port` on every member this node knows of.
    pub async fn delete(self: &Arc<Self>, port: u16) -> Result<(), GroupsError> {
        let group = self.group(port).ok_or_else(|| GroupsError::NoGroup {
            port,
            node: self.node.clone(),
        })?;
        for m in &group.members {
            self.leave_on(m, port).await;
        }
        Ok(())
    }

    async fn leave_on(self: &Arc<Self>, node: &str, port: u16) {
        if node == self.node {
            self.leave(port).await;
            return;
        }
        let r = self
            .call(node, JOIN_TIMEOUT, |mut c| async move {
                c.leave(pb::LeaveGroupRequest {
                    port: u32::from(port),
                })
                .await
            })
            .await;
        if let Err(e) = r {
            tracing::warn!(node, port, error = %e, "asking a member to leave its group");
        }
    }

    async fn peer_join(&self, node: &str, group: &Group) -> Result<(), GroupsError> {
        let req = pb::JoinGroupRequest {
            group: Some(group.to_pb()),
        };
        self.call(node, JOIN_TIMEOUT, |mut c| async move { c.join(req).await })
            .await
            .map(|_| ())
    }

    /// This node joins `group`: its filter takes the port as the group
    /// says (the contact node owns new connections, a member none). Joining
    /// the same group again is no error; another group on the port is.
    pub async fn join(self: &Arc<Self>, group: Group) -> Result<(), GroupsError> {
        if !group.members.contains(&self.node) {
            return Err(GroupsError::NodeNotInGroup {
                node: self.node.clone(),
                port: group.port,
                members: group.members.join(", "),
            });
        }
        {
            let mut groups = self.groups();
            match groups.get(&group.port) {
                Some(g) if g.group == group => return Ok(()),
                Some(g) => {
                    return Err(GroupsError::Conflict {
                        port: group.port,
                        node: self.node.clone(),
                        existing: format!(
                            "contact {}, members {}",
                            g.group.contact,
                            g.group.members.join(", ")
                        ),
                    });
                }
                None => {}
            }
            groups.insert(group.port, GroupState::new(group.clone()));
        }
        self.save_views();
        self.filter_port(&group).await?;
        self.publish(
            group.port,
            "joined",
            format!(
                "contact {}, backups [{}], members [{}]",
                group.contact,
                group.backups.join(", "),
                group.members.join(", ")
            ),
        );
        Ok(())
    }

    /// This node's filter takes the group's port as its view says: the
    /// contact node owns new connections, a member none.
    async fn filter_port(&self, group: &Group) -> Result<(), GroupsError> {
        let state = if group.contact == self.node {
            PortState::SharedContact
        } else {
            PortState::SharedMember
        };
        self.share_port(group.port, state).await?;
        tracing::info!(port = group.port, role = ?state, "joined a group");
        Ok(())
    }

    /// The group's port in `state` (`SharedContact` or `SharedMember`) in
    /// this node's filter.
    async fn share_port(&self, port: u16, state: PortState) -> Result<(), GroupsError> {
        self.ports.share(
            crate::process::PortKey {
                transport: crate::process::Transport::Tcp,
                port,
            },
            state,
        );
        self.ports
            .apply()
            .await
            .map_err(|e| GroupsError::Internal(format!("filtering port {port}: {e}")))
    }

    /// Entries in `state` for `flows` in this node's filter (off the
    /// runtime: BPF map updates).
    async fn set_flows(&self, flows: Vec<Flow>, state: FlowState) -> Result<(), GroupsError> {
        let dp = self.dataplane.clone();
        tokio::task::spawn_blocking(move || {
            let mut table = dp.table();
            for f in flows {
                table.set_flow(f, state)?;
            }
            Ok::<_, crate::dataplane::DataPlaneError>(())
        })
        .await
        .map_err(|e| GroupsError::Internal(e.to_string()))?
        .map_err(|e| GroupsError::Internal(e.to_string()))
    }

    /// This node leaves the group on `port`: the port is the registry's
    /// again, and the connections it decided one by one are forgotten.
    pub async fn leave(&self, port: u16) {
        let Some(g) = self.groups().remove(&port) else {
            return;
        };
        self.save_views();
        crate::sync::lock(&self.unsynced).remove(&port);
        let me = Arc::clone(&self.dataplane);
        let flows: Vec<Flow> = g.connections.keys().copied().collect();
        let forgot = tokio::task::spawn_blocking(move || {
            let mut table = me.table();
            for f in flows {
                if let Err(e) = table.remove_flow(f) {
                    tracing::warn!(flow = %f, error = %e, "forgetting a connection");
                }
            }
        })
        .await;
        if let Err(e) = forgot {
            tracing::warn!(error = %e, "forgetting a group's connections");
        }
        self.ports.unshare(g.group.port_key());
        if let Err(e) = self.ports.apply().await {
            tracing::warn!(port, error = %e, "giving a group's port back");
        }
        tracing::info!(port, "left a group");
        self.publish(port, "left", String::new());
    }

    /// The groups as this node sees them.
    pub fn views(&self) -> Vec<pb::GroupView> {
        let mut groups = self.groups();
        groups
            .values_mut()
            .map(|g| {
                g.servers.retain(|s| local::is_open(&s.channel));
                pb::GroupView {
                    group: Some(g.group.to_pb()),
                    role: if g.group.contact == self.node {
                        "contact".into()
                    } else if g.group.backups.contains(&self.node) {
                        "backup".into()
                    } else {
                        "member".into()
                    },
                    server_pids: g.servers.iter().map(|s| s.pid).collect(),
                    connections: table_pb(&g.connections),
                    handoffs_given: g.counts.given,
                    handoffs_taken: g.counts.taken,
                    handoffs_failed: g.counts.failed,
                }
            })
            .collect()
    }

    /// A Groups client for `node`'s Peer port; `keep`: on the channel kept
    /// for it.
    async fn client(
        &self,
        node: &str,
        keep: bool,
    ) -> Result<pb::groups_client::GroupsClient<tonic::transport::Channel>, GroupsError> {
        if keep && let Some(c) = lock(&self.channels).get(node) {
            return Ok(pb::groups_client::GroupsClient::new(c.clone()));
        }
        let peer = self
            .cluster
            .peer(node)
            .ok_or_else(|| GroupsError::UnknownNode {
                node: node.to_owned(),
                here: self.node.clone(),
            })?;
        let channel =
            self.cluster
                .peer_channel(&peer)
                .await
                .map_err(|e| GroupsError::Unreachable {
                    node: node.to_owned(),
                    reason: e.reason,
                })?;
        if keep {
            lock(&self.channels).insert(node.to_owned(), channel.clone());
        }
        Ok(pb::groups_client::GroupsClient::new(channel))
    }

    /// `call` on `node`'s Groups service within `limit`, connecting
    /// included (a node whose link is gone does not refuse: it stays
    /// silent); the kept channel of a node that failed or stayed silent is
    /// dropped.
    async fn call<T, F, Fut>(
        &self,
        node: &str,
        limit: std::time::Duration,
        call: F,
    ) -> Result<T, GroupsError>
    where
        F: FnOnce(pb::groups_client::GroupsClient<tonic::transport::Channel>) -> Fut,
        Fut: std::future::Future<Output = Result<tonic::Response<T>, Status>>,
    {
        self.call_on(node, limit, true, call).await
    }

    /// [`Self::call`] on the channel kept for `node` if `keep`.
    async fn call_on<T, F, Fut>(
        &self,
        node: &str,
        limit: std::time::Duration,
        keep: bool,
        call: F,
    ) -> Result<T, GroupsError>
    where
        F: FnOnce(pb::groups_client::GroupsClient<tonic::transport::Channel>) -> Fut,
        Fut: std::future::Future<Output = Result<tonic::Response<T>, Status>>,
    {
        let r = tokio::time::timeout(limit, async {
            let c = self.client(node, keep).await?;
            call(c)
                .await
                .map(tonic::Response::into_inner)
                .map_err(|status| GroupsError::Peer {
                    node: node.to_owned(),
                    status,
                })
        })
        .await;
        match r {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => {
                let gone = match &e {
                    GroupsError::Unreachable { .. } => true,
                    GroupsError::Peer { status, .. } => status.code() == tonic::Code::Unavailable,
                    _ => false,
                };
                if gone {
                    self.drop_channel(node);
                }
                Err(e)
            }
            Err(_) => {
                self.drop_channel(node);
                Err(GroupsError::Unreachable {
                    node: node.to_owned(),
                    reason: format!("no answer within {limit:?}"),
                })
            }
        }
    }

    /// Forgets the kept channel to `node` (it failed): the next call opens
    /// a new one.
    fn drop_channel(&self, node: &str) {
        lock(&self.channels).remove(node);
    }

    /// Registers `pid` as a server of the group on `port`: it must be a
    /// process ferryd manages, or a descendant of one.
    pub fn register_server(
        &self,
        pid: i32,
        port: u16,
        channel: OwnedFd,
    ) -> Result<(), GroupsError> {
        let running = self.processes.registry().running();
        let Some(root) = managed_root(&running, pid) else {
            return Err(GroupsError::NotMember {
                pid,
                port,
                node: self.node.clone(),
                reason:
                    "not a process ferryd manages (start it with `ferry run`) nor a child of one"
                        .into(),
            });
        };
        let mut groups = self.groups();
        let g = self.state_in(&mut groups, port)?;
        g.servers.retain(|s| local::is_open(&s.channel));
        let channel = Arc::new(channel);
        g.servers.push(ServerChannel {
            pid,
            channel: Arc::clone(&channel),
        });
        drop(groups);
        // Its connections move one by one; the process with them would
        // leave the group without a server here and take connections the
        // other members' filters do not expect.
        self.processes.pin(
            root,
            format!(
                "it serves the distributed server on port {port} (ferry group list): its connections move one by one (ferry handoff), not with the process"
            ),
            Box::new(move || local::is_open(&channel)),
        );
        tracing::info!(pid, port, "a server of the group registered");
        Ok(())
    }

    /// Checks that `pid` (or a process it descends from) serves the group
    /// on `port`.
    fn check_server(&self, pid: i32, port: u16) -> Result<(), GroupsError> {
        let mut groups = self.groups();
        let g = self.state_in(&mut groups, port)?;
        g.servers.retain(|s| local::is_open(&s.channel));
        let servers: Vec<i32> = g.servers.iter().map(|s| s.pid).collect();
        if managed_root(&servers, pid).is_some() {
            Ok(())
        } else {
            Err(GroupsError::NotMember {
                pid,
                port,
                node: self.node.clone(),
                reason: "it did not register (ferry_serve) and descends from no process that did"
                    .into(),
            })
        }
    }

    /// The live servers of the group on `port`, first registered first.
    fn servers(&self, port: u16) -> Vec<ServerChannel> {
        let mut groups = self.groups();
        let Some(g) = groups.get_mut(&port) else {
            return Vec::new();
        };
        g.servers.retain(|s| local::is_open(&s.channel));
        g.servers.clone()
    }

    /// Marks `flow` as moving; refused if it is already.
    fn begin(&self, flow: Flow) -> Result<(), GroupsError> {
        let mut groups = self.groups();
        let g = self.state_in(&mut groups, flow.local_port)?;
        if !g.in_flight.insert(flow) {
            return Err(GroupsError::Busy { flow });
        }
        Ok(())
    }

    /// Ends a handoff of `flow`: `served_by` is who serves it now if it
    /// moved, and the counts follow.
    fn end(&self, flow: Flow, outcome: Outcome) {
        let mut groups = self.groups();
        let Some(g) = groups.get_mut(&flow.local_port) else {
            return;
        };
        g.in_flight.remove(&flow);
        let (what, detail) = match outcome {
            Outcome::Given { to } => {
                g.counts.given += 1;
                let detail = format!("{} to {to}", flow.remote);
                g.connections.insert(flow, to);
                ("handoff-given", detail)
            }
            Outcome::Taken => {
                g.counts.taken += 1;
                g.connections.insert(flow, self.node.clone());
                ("handoff-taken", flow.remote.to_string())
            }
            Outcome::Failed => {
                g.counts.failed += 1;
                ("handoff-failed", flow.remote.to_string())
            }
        };
        drop(groups);
        self.publish(flow.local_port, what, detail);
    }

    /// The member that should serve a new connection of the group on
    /// `port`, by its placement policy, for a server process `pid` of it.
    /// What each member serves: the connections this node knows to be
    /// served elsewhere, and its own live ones on the port.
    pub async fn place(&self, pid: i32, port: u16) -> Result<(String, bool), GroupsError> {
        self.check_server(pid, port)?;
        let live = tokio::task::spawn_blocking(chain::tcp_ends)
            .await
            .map_err(|e| GroupsError::Internal(e.to_string()))?
            .map_err(|e| GroupsError::Internal(format!("reading this node's sockets: {e}")))?;
        let mut groups = self.groups();
        let g = self.state_in(&mut groups, port)?;
        let mut serving: BTreeMap<String, u64> = BTreeMap::new();
        for node in g.connections.values() {
            *serving.entry(node.clone()).or_default() += 1;
        }
        let here = live
            .iter()
            .filter(|(remote, p)| {
                *p == port
                    && g.connections
                        .get(&Flow::new(*remote, port))
                        .is_none_or(|n| *n == self.node)
            })
            .count() as u64;
        serving.insert(self.node.clone(), here);
        let members = g.group.members.clone();
        let node = g
            .placer
            .place(&members, &serving)
            .ok_or_else(|| GroupsError::Internal("a group without members".into()))?;
        let here = node == self.node;
        Ok((node, here))
    }

    /// The contact node or a backup records who serves a connection.
    pub fn record_connection(&self, flow: Flow, node: &str) -> Result<(), GroupsError> {
        let mut groups = self.groups();
        let g = self.state_in(&mut groups, flow.local_port)?;
        g.connections.insert(flow, node.to_owned());
        Ok(())
    }
}

/// How a handoff ended, for [`Groups::end`].
enum Outcome {
    Given { to: String },
    Taken,
    Failed,
}

/// The first of `roots` that is `pid` or one of its ancestors.
fn managed_root(roots: &[i32], pid: i32) -> Option<i32> {
    let mut p = pid;
    // A process tree is shallow; the bound only guards against a loop read
    // from a racing /proc.
    for _ in 0..64 {
        if roots.contains(&p) {
            return Some(p);
        }
        if p <= 1 {
            return None;
        }
        p = crate::process::inspect(p).ok()?.ppid;
    }
    None
}

/// A group's table of connections, with who serves each, for the APIs.
pub(crate) fn table_pb(connections: &BTreeMap<Flow, String>) -> Vec<pb::ServedConnection> {
    connections
        .iter()
        .map(|(f, node)| pb::ServedConnection {
            connection: Some(connection_pb(*f)),
            node: node.clone(),
        })
        .collect()
}

pub(crate) fn connection_pb(f: Flow) -> pb::GroupConnection {
    pb::GroupConnection {
        remote: f.remote.to_string(),
        port: u32::from(f.local_port),
    }
}

/// A connection from the API: the error names the field.
pub(crate) fn flow_from_pb(c: Option<&pb::GroupConnection>) -> Result<Flow, GroupsError> {
    let c = c.ok_or(GroupsError::Invalid {
        field: "connection",
        reason: "missing".into(),
    })?;
    let remote = c.remote.parse().map_err(|e| GroupsError::Invalid {
        field: "connection.remote",
        reason: format!(
            "{:?}: {e} (an address and port: a.b.c.d:p or [v6]:p)",
            c.remote
        ),
    })?;
    let local_port = u16::try_from(c.port)
        .ok()
        .filter(|p| *p != 0)
        .ok_or_else(|| GroupsError::Invalid {
            field: "connection.port",
            reason: format!("{} is not a TCP port", c.port),
        })?;
    Ok(Flow::new(remote, local_port))
}

#[cfg(test)]
mod tests;
