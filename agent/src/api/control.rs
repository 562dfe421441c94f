use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use ferry_proto::v1::control_server::Control;
use ferry_proto::v1::{
    self as pb, DataPlane, DataPlaneCounters, GetDataPlaneRequest, GetMigrationRequest,
    ListNodesRequest, ListNodesResponse, ListProcessesRequest, ListProcessesResponse,
    ManagedProcess, MigrateRequest, MigrationEvent, MigrationReport, Node, RunProcessRequest,
    RunProcessResponse, migration_event,
};
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

use super::forward::{self, Target};
use super::groups;
use super::migrate_request::{drain_options, migrate_options};
use crate::engine::source;
use crate::error_chain::error_chain;
use crate::managed::{Lifecycle, OutStage};
use crate::node::Node as AgentNode;
use crate::process::PortKey;

#[derive(Debug, Clone)]
pub struct ControlService {
    node: Arc<AgentNode>,
}

impl ControlService {
    pub fn new(node: Arc<AgentNode>) -> Self {
        Self { node }
    }
}

type EventStream = Pin<Box<dyn Stream<Item = Result<MigrationEvent, Status>> + Send>>;
type DrainStream = Pin<Box<dyn Stream<Item = Result<pb::DrainEvent, Status>> + Send>>;
type ClusterEventStream = Pin<Box<dyn Stream<Item = Result<pb::ClusterEvent, Status>> + Send>>;
type ProcessUpdateStream = Pin<Box<dyn Stream<Item = Result<pb::ProcessUpdate, Status>> + Send>>;

/// Who made a call, for reports and events: the authenticated caller on
/// TCP, the forwarding node, or root on the Unix socket.
fn who<T>(request: &Request<T>) -> String {
    if let Some(c) = request.extensions().get::<crate::security::authz::Caller>() {
        return format!("{} ({})", c.name, c.role);
    }
    if let Some(by) = request.metadata().get(forward::FORWARDED_BY) {
        return format!("{} (forwarded)", by.to_str().unwrap_or("?"));
    }
    "root on the control socket".into()
}

/// A managed process as the API shows it; `conflicts` are the ports this
/// node refuses to own, with the node that owns each.
fn process_to_pb(
    p: &crate::managed::ManagedProcess,
    node: &str,
    conflicts: &std::collections::BTreeMap<crate::process::PortKey, String>,
) -> ManagedProcess {
    ManagedProcess {
        pid: p.pid,
        argv: p.argv.clone(),
        ports: p.sockets.ports.iter().map(PortKey::to_pb).collect(),
        tcp_listening: p.sockets.tcp_listening,
        tcp_established: p.sockets.tcp_established,
        udp_sockets: p.sockets.udp,
        state: match p.lifecycle {
            // What the kernel says, not what ferryd last did: a process
            // left stopped (a freeze whose agent died, a SIGSTOP) is not
            // running.
            Lifecycle::Running => match crate::process::state_of(p.pid) {
                Some('T' | 't') => "stopped",
                _ => "running",
            },
            Lifecycle::MigratingOut {
                stage: OutStage::InDoubt,
                ..
            } => "stopped",
            Lifecycle::MigratingOut { .. } => "migrating",
        }
        .into(),
        note: match &p.lifecycle {
            Lifecycle::MigratingOut {
                migration_id,
                stage: OutStage::InDoubt,
            } => format!(
                "in doubt: migration {migration_id} passed its commit point and its destination has not said whether it resumed the process there; stopped here until it does"
            ),
            _ => String::new(),
        },
        origin: p.origin.name().into(),
        port_conflicts: p
            .sockets
            .ports
            .iter()
            .filter_map(|port| {
                conflicts
                    .get(port)
                    .map(|node| format!("{port} is owned by {node}"))
            })
            .collect(),
        node: node.to_owned(),
    }
}

/// A forwarded server stream, with the peer's statuses said to be its.
fn relay<T: Send + 'static>(
    peer: crate::config::PeerConfig,
    stream: tonic::Streaming<T>,
) -> Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>> {
    Box::pin(tokio_stream::StreamExt::map(stream, move |item| {
        item.map_err(|s| forward::from_peer(&peer, s))
    }))
}

/// Calls `$method` on the node `$peer` with `$message`, as a forwarded
/// request, and answers with its response.
macro_rules! forward_unary {
    ($self:ident, $peer:expr, $method:ident, $message:expr) => {{
        let peer = $peer;
        let mut client = forward::client(&$self.node.cluster, &peer).await?;
        client
            .$method(forward::request(&$self.node.cluster, $message))
            .await
            .map_err(|s| forward::from_peer(&peer, s))
    }};
}

#[tonic::async_trait]
impl Control for ControlService {
    async fn create_group(
        &self,
        request: Request<pb::CreateGroupRequest>,
    ) -> Result<Response<pb::Group>, Status> {
        groups::create(&self.node, request.into_inner())
            .await
            .map(Response::new)
    }

    async fn delete_group(
        &self,
        request: Request<pb::DeleteGroupRequest>,
    ) -> Result<Response<pb::DeleteGroupResponse>, Status> {
        groups::delete(&self.node, request.into_inner())
            .await
            .map(Response::new)
    }

    async fn handoff_connection(
        &self,
        request: Request<pb::HandoffConnectionRequest>,
    ) -> Result<Response<pb::HandoffConnectionResponse>, Status> {
        let node = request.get_ref().node.clone();
        if let Target::Peer(peer) = forward::target(&self.node.cluster, &request, "node", &node)? {
            return forward_unary!(self, peer, handoff_connection, request.into_inner());
        }
        groups::handoff(&self.node, request.into_inner())
            .await
            .map(Response::new)
    }

    async fn add_group_member(
        &self,
        request: Request<pb::AddGroupMemberRequest>,
    ) -> Result<Response<pb::Group>, Status> {
        groups::add_member(&self.node, request.into_inner())
            .await
            .map(Response::new)
    }

    async fn remove_group_member(
        &self,
        request: Request<pb::RemoveGroupMemberRequest>,
    ) -> Result<Response<pb::Group>, Status> {
        groups::remove_member(&self.node, request.into_inner())
            .await
            .map(Response::new)
    }

    async fn list_groups(
        &self,
        _request: Request<pb::ListGroupsRequest>,
    ) -> Result<Response<pb::ListGroupsResponse>, Status> {
        Ok(Response::new(pb::ListGroupsResponse {
            groups: self.node.groups.views(),
        }))
    }

    async fn list_nodes(
        &self,
        _: Request<ListNodesRequest>,
    ) -> Result<Response<ListNodesResponse>, Status> {
        let me = &self.node;
        let host = crate::host_features::host_off_runtime(&me.config.features_off)
            .await
            .map_err(|e| Status::internal(e.to_string()))?;
        let mut nodes = vec![Node {
            name: me.node().to_owned(),
            kernel: host.kernel.clone(),
            features: host.to_pb(),
            peer_address: me.config.cluster.peer_listen.to_string(),
            public_addresses: me.config.public.addresses().to_strings(),
            is_self: true,
            reachable: true,
            peer_protocol_version: ferry_proto::PEER_PROTOCOL_VERSION,
            error: String::new(),
            managed_processes: me.processes.registry().len() as u32,
            cordoned: me.cordon.is_on(),
            membership_state: if me.cluster.membership().is_some() {
                "alive".into()
            } else {
                "static".into()
            },
            has_load: me.conductor.is_some(),
            load: me.conductor.as_ref().map_or(0.0, |c| c.local_load()),
            ..Default::default()
        }];
        let probes = me.cluster.configured_peers().iter().map(|peer| async move {
            let mut node = Node {
                name: peer.name.clone(),
                peer_address: peer.address.to_string(),
                ..Default::default()
            };
            match me.cluster.hello(peer).await {
                Ok(h) => {
                    node.reachable = true;
                    node.peer_protocol_version = h.protocol_version;
                    node.managed_processes = h.managed_processes;
                    node.cordoned = h.cordoned;
                    node.kernel = h.kernel;
                    node.features = h.features;
                    node.public_addresses = h.public_addresses;
                }
                Err(e) => node.error = e.to_string(),
            }
            node
        });
        nodes.extend(futures::future::join_all(probes).await);
        for n in nodes.iter_mut().skip(1) {
            n.membership_state = "static".into();
        }
        if let Some(m) = me.cluster.membership() {
            let candidates = me
                .conductor
                .as_ref()
                .map(|c| c.candidate_names())
                .unwrap_or_default();
            for member in m.members() {
                let i = match nodes.iter().position(|n| n.name == member.ident.name) {
                    Some(i) => i,
                    None => {
                        // Discovered, not configured: no Hello probe, SWIM
                        // says whether it answers.
                        nodes.push(Node {
                            name: member.ident.name.clone(),
                            peer_address: member.ident.peer.to_string(),
                            reachable: member.state != crate::membership::MemberState::Down,
                            ..Default::default()
                        });
                        nodes.len() - 1
                    }
                };
                let n = &mut nodes[i];
                n.membership_state = member.state.as_str().into();
                if let Some((b, at)) = &member.load {
                    n.has_load = true;
                    n.load = b.own_load().unwrap_or(0.0);
                    n.load_age_ms = at.elapsed().as_millis() as u64;
                    if !n.reachable {
                        n.managed_processes = b.managed;
                    }
                }
                n.candidate = candidates.contains(&n.name);
                if let Some((b, _)) = &member.load
                    && !b.capacity_unknown.is_empty()
                {
                    n.not_candidate =
                        format!("its CPU capacity is unknown: {}", b.capacity_unknown);
                }
            }
        }
        Ok(Response::new(ListNodesResponse { nodes }))
    }

    async fn list_processes(
        &self,
        request: Request<ListProcessesRequest>,
    ) -> Result<Response<ListProcessesResponse>, Status> {
        if request.get_ref().all_nodes {
            return Ok(Response::new(self.list_all_processes().await?));
        }
        let node = request.get_ref().node.clone();
        match forward::target(&self.node.cluster, &request, "node", &node)? {
            Target::Here => Ok(Response::new(self.local_processes().await?)),
            Target::Peer(peer) => forward_unary!(
                self,
                peer,
                list_processes,
                ListProcessesRequest {
                    node,
                    all_nodes: false
                }
            ),
        }
    }

    async fn run_process(
        &self,
        request: Request<RunProcessRequest>,
    ) -> Result<Response<RunProcessResponse>, Status> {
        let node = request.get_ref().node.clone();
        if let Target::Peer(peer) = forward::target(&self.node.cluster, &request, "node", &node)? {
            return forward_unary!(self, peer, run_process, request.into_inner());
        }
        let RunProcessRequest {
            argv,
            ipc_namespace,
            user,
            ..
        } = request.into_inner();
        if argv.first().map(|a| a.is_empty()).unwrap_or(true) {
            return Err(Status::invalid_argument(
                "argv: give the program to run (argv[0] is empty)",
            ));
        }
        self.node
            .cordon
            .refuse_if_on()
            .map_err(crate::engine::EngineError::from)?;
        let user = if user.is_empty() {
            None
        } else {
            // The user database may ask NSS (files, LDAP): off the runtime.
            let found = tokio::task::spawn_blocking(move || crate::managed::RunAs::lookup(&user))
                .await
                .map_err(|e| Status::internal(e.to_string()))?;
            Some(found.map_err(|e| Status::invalid_argument(e.to_string()))?)
        };
        let options = crate::managed::SpawnOptions {
            own_ipc: ipc_namespace,
            user,
            env: vec![(
                ferry_handoff::SOCKET_ENV.to_owned(),
                self.node
                    .config
                    .handoff_socket
                    .to_string_lossy()
                    .into_owned(),
            )],
        };
        let pid = self
            .node
            .supervisor
            .run(argv, options)
            .await
            .map_err(|e| match e {
                crate::managed::SpawnError::EmptyArgv => {
                    Status::invalid_argument(format!("argv: {e}"))
                }
                crate::managed::SpawnError::NulByte { .. } => {
                    Status::invalid_argument(e.to_string())
                }
                e => Status::failed_precondition(error_chain(&e)),
            })?;
        Ok(Response::new(RunProcessResponse {
            pid,
            node: self.node.node().to_owned(),
        }))
    }

    type MigrateStream = EventStream;

    async fn migrate(
        &self,
        request: Request<MigrateRequest>,
    ) -> Result<Response<Self::MigrateStream>, Status> {
        let node = request.get_ref().source_node.clone();
        if let Target::Peer(peer) =
            forward::target(&self.node.cluster, &request, "source_node", &node)?
        {
            let mut client = forward::client(&self.node.cluster, &peer).await?;
            let stream = client
                .migrate(forward::request(&self.node.cluster, request.into_inner()))
                .await
                .map_err(|s| forward::from_peer(&peer, s))?
                .into_inner();
            return Ok(Response::new(relay(peer, stream)));
        }
        let req = request.into_inner();
        let (pid, destination, options) = migrate_options(&req)?;
        let prepared = source::prepare(&self.node.engine, pid, &destination, options).await?;
        let (tx, rx) = tokio::sync::mpsc::channel(32);
        let engine = self.node.engine.clone();
        // Spawned: the migration finishes, or rolls back, whether or not the
        // caller keeps listening.
        tokio::spawn(async move {
            let report = source::run(engine, prepared, tx.clone()).await;
            let end = final_status(&report);
            let _ = tx
                .send(Ok(MigrationEvent {
                    event: Some(migration_event::Event::Report(report)),
                }))
                .await;
            if let Some(status) = end {
                let _ = tx.send(Err(status)).await;
            }
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }

    async fn get_migration(
        &self,
        request: Request<GetMigrationRequest>,
    ) -> Result<Response<MigrationReport>, Status> {
        let node = request.get_ref().node.clone();
        if let Target::Peer(peer) = forward::target(&self.node.cluster, &request, "node", &node)? {
            return forward_unary!(self, peer, get_migration, request.into_inner());
        }
        let id = request.into_inner().migration_id;
        self.node
            .reports
            .get(&id)
            .map(Response::new)
            .ok_or_else(|| {
                Status::not_found(format!(
                    "migration_id: no migration {id:?} ran from {}",
                    self.node.node()
                ))
            })
    }

    async fn get_balancer(
        &self,
        request: Request<pb::GetBalancerRequest>,
    ) -> Result<Response<pb::Balancer>, Status> {
        let node = request.get_ref().node.clone();
        if let Target::Peer(peer) = forward::target(&self.node.cluster, &request, "node", &node)? {
            return forward_unary!(self, peer, get_balancer, request.into_inner());
        }
        match self.node.conductor.as_ref() {
            Some(c) => Ok(Response::new(c.report())),
            None => Ok(Response::new(pb::Balancer {
                node: self.node.node().to_owned(),
                enabled: false,
                policy_toml: toml::to_string(&self.node.config.policy).unwrap_or_default(),
                last_decision: "membership is off: no balancer".into(),
                ..Default::default()
            })),
        }
    }

    async fn set_balancer(
        &self,
        request: Request<pb::SetBalancerRequest>,
    ) -> Result<Response<pb::Balancer>, Status> {
        let node = request.get_ref().node.clone();
        if let Target::Peer(peer) = forward::target(&self.node.cluster, &request, "node", &node)? {
            return forward_unary!(self, peer, set_balancer, request.into_inner());
        }
        let req = request.into_inner();
        let c = self.conductor()?;
        let policy = apply_settings(&c.settings().policy, &req.settings)?;
        c.set(req.enabled, policy).map_err(|e| match e {
            crate::conductor::SetError::Invalid { field, reason } => {
                Status::invalid_argument(format!("{field}: {reason}"))
            }
            e @ crate::conductor::SetError::Busy => Status::failed_precondition(e.to_string()),
        })?;
        Ok(Response::new(c.report()))
    }

    async fn get_data_plane(
        &self,
        request: Request<GetDataPlaneRequest>,
    ) -> Result<Response<DataPlane>, Status> {
        let node = request.get_ref().node.clone();
        if let Target::Peer(peer) = forward::target(&self.node.cluster, &request, "node", &node)? {
            return forward_unary!(self, peer, get_data_plane, request.into_inner());
        }
        self.local_data_plane().await.map(Response::new)
    }

    async fn cancel_migration(
        &self,
        request: Request<pb::CancelMigrationRequest>,
    ) -> Result<Response<MigrationReport>, Status> {
        let node = request.get_ref().node.clone();
        if let Target::Peer(peer) = forward::target(&self.node.cluster, &request, "node", &node)? {
            return forward_unary!(self, peer, cancel_migration, request.into_inner());
        }
        let by = who(&request);
        let id = request.into_inner().migration_id;
        if id.is_empty() {
            return Err(Status::invalid_argument(
                "migration_id: name the migration to cancel",
            ));
        }
        let Some(cancel) = self.node.engine.outgoing.cancel_switch(&id) else {
            return Err(match self.node.reports.get(&id) {
                Some(r) => Status::failed_precondition(format!(
                    "migration_id: migration {id} has ended already ({})",
                    pb::MigrationOutcome::try_from(r.outcome)
                        .map(|o| o.as_str_name())
                        .unwrap_or("?")
                )),
                None => Status::not_found(format!(
                    "migration_id: no migration {id:?} runs from {}",
                    self.node.node()
                )),
            });
        };
        cancel.request(&by).map_err(|e| {
            Status::failed_precondition(format!("migration {id} cannot be cancelled: {e}"))
        })?;
        tracing::info!(migration = %id, %by, "migration cancel requested");
        Ok(Response::new(cancel.finished().await))
    }

    type DrainNodeStream = DrainStream;

    async fn drain_node(
        &self,
        request: Request<pb::DrainNodeRequest>,
    ) -> Result<Response<Self::DrainNodeStream>, Status> {
        let node = request.get_ref().node.clone();
        if let Target::Peer(peer) = forward::target(&self.node.cluster, &request, "node", &node)? {
            let mut client = forward::client(&self.node.cluster, &peer).await?;
            let stream = client
                .drain_node(forward::request(&self.node.cluster, request.into_inner()))
                .await
                .map_err(|s| forward::from_peer(&peer, s))?
                .into_inner();
            return Ok(Response::new(relay(peer, stream)));
        }
        let by = who(&request);
        let req = request.into_inner();
        let options = drain_options(&req)?;
        let rx = crate::drain::start(
            self.node.engine.clone(),
            self.node.drains.clone(),
            options,
            by,
        )?;
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }

    async fn cancel_drain(
        &self,
        request: Request<pb::CancelDrainRequest>,
    ) -> Result<Response<pb::DrainFinished>, Status> {
        let node = request.get_ref().node.clone();
        if let Target::Peer(peer) = forward::target(&self.node.cluster, &request, "node", &node)? {
            return forward_unary!(self, peer, cancel_drain, request.into_inner());
        }
        let by = who(&request);
        let drain = self.node.drains.running().ok_or_else(|| {
            Status::failed_precondition(format!("node: no drain runs on {}", self.node.node()))
        })?;
        tracing::info!(%by, "drain cancel requested");
        drain.cancel(&by);
        Ok(Response::new(drain.finished().await))
    }

    async fn set_cordon(
        &self,
        request: Request<pb::SetCordonRequest>,
    ) -> Result<Response<pb::SetCordonResponse>, Status> {
        let node = request.get_ref().node.clone();
        if let Target::Peer(peer) = forward::target(&self.node.cluster, &request, "node", &node)? {
            return forward_unary!(self, peer, set_cordon, request.into_inner());
        }
        let by = format!("operator {}", who(&request));
        let cordoned = request.into_inner().cordoned;
        self.node
            .cordon
            .set(cordoned, &by)
            .map_err(|e| Status::internal(e.to_string()))?;
        Ok(Response::new(pb::SetCordonResponse {
            node: self.node.node().to_owned(),
            cordoned,
        }))
    }

    type WatchEventsStream = ClusterEventStream;

    async fn watch_events(
        &self,
        request: Request<pb::WatchEventsRequest>,
    ) -> Result<Response<Self::WatchEventsStream>, Status> {
        let this_node_only = request.get_ref().this_node_only;
        let rx = super::watch::start(self.node.engine.clone(), !this_node_only);
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }

    async fn adopt_process(
        &self,
        request: Request<pb::AdoptProcessRequest>,
    ) -> Result<Response<ManagedProcess>, Status> {
        let node = request.get_ref().node.clone();
        if let Target::Peer(peer) = forward::target(&self.node.cluster, &request, "node", &node)? {
            return forward_unary!(self, peer, adopt_process, request.into_inner());
        }
        let pid = request.get_ref().pid;
        if pid <= 0 {
            return Err(Status::invalid_argument(format!(
                "pid: {pid} is not a process ID"
            )));
        }
        let by = who(&request);
        let p = self.node.supervisor.adopt(pid).await.map_err(|e| {
            use crate::managed::AdoptError;
            let message = error_chain(&e);
            match e {
                AdoptError::NotFound { .. } => Status::not_found(message),
                AdoptError::AlreadyManaged { .. } => Status::already_exists(message),
                AdoptError::Agent { .. } | AdoptError::Obstacles { .. } => {
                    Status::failed_precondition(message)
                }
                AdoptError::Process { .. } | AdoptError::Sockets { .. } => {
                    Status::internal(message)
                }
            }
        })?;
        tracing::info!(pid, by = %by, argv = ?p.argv, "process adopted");
        let conflicts = self.node.ports.conflicts();
        Ok(Response::new(process_to_pb(
            &p,
            self.node.node(),
            &conflicts,
        )))
    }

    type WaitProcessStream = ProcessUpdateStream;

    async fn wait_process(
        &self,
        request: Request<pb::WaitProcessRequest>,
    ) -> Result<Response<Self::WaitProcessStream>, Status> {
        let node = request.get_ref().node.clone();
        if let Target::Peer(peer) = forward::target(&self.node.cluster, &request, "node", &node)? {
            // That node answers for where the process is now; this agent
            // follows it on from there.
            let rx =
                super::follow::start_at(self.node.engine.clone(), peer.name, request.get_ref().pid)
                    .await?;
            return Ok(Response::new(Box::pin(
                tokio_stream::wrappers::ReceiverStream::new(rx),
            )));
        }
        let forwarded = request.metadata().get(forward::FORWARDED_BY).is_some();
        let rx = super::follow::start(self.node.engine.clone(), request.get_ref().pid, !forwarded)?;
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }

    async fn signal_process(
        &self,
        request: Request<pb::SignalProcessRequest>,
    ) -> Result<Response<pb::SignalProcessResponse>, Status> {
        let node = request.get_ref().node.clone();
        if let Target::Peer(peer) = forward::target(&self.node.cluster, &request, "node", &node)? {
            return forward_unary!(self, peer, signal_process, request.into_inner());
        }
        let by = who(&request);
        let pb::SignalProcessRequest { pid, signal, .. } = request.into_inner();
        let signal = crate::managed::signal_to_send(signal).map_err(Status::invalid_argument)?;
        {
            let reg = self.node.processes.registry();
            let p = reg.get(pid).ok_or_else(|| {
                Status::not_found(format!("pid: {pid} is not managed by {}", self.node.node()))
            })?;
            if let Lifecycle::MigratingOut { migration_id, .. } = &p.lifecycle {
                return Err(Status::unavailable(format!(
                    "pid: {pid} is being migrated (migration {migration_id}); send the signal again once the migration ended"
                )));
            }
            crate::managed::signal_reaches(pid, signal).map_err(Status::failed_precondition)?;
            // Sent under the registry's lock: a migration cannot claim the
            // process between the check and the signal.
            nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), signal)
                .map_err(|e| Status::failed_precondition(format!("pid: signalling {pid}: {e}")))?;
        }
        tracing::info!(pid, signal = %signal, by = %by, "signal sent");
        Ok(Response::new(pb::SignalProcessResponse {
            node: self.node.node().to_owned(),
        }))
    }
}

impl ControlService {
    /// Every node's processes: this node's, and each peer's through a
    /// forwarded call, side by side.
    async fn list_all_processes(&self) -> Result<ListProcessesResponse, Status> {
        let here = self.local_processes();
        let peers = self.node.cluster.known_peers();
        let there = peers.iter().map(|peer| async move {
            let call = async {
                let mut client = forward::client(&self.node.cluster, peer).await?;
                client
                    .list_processes(forward::request(
                        &self.node.cluster,
                        ListProcessesRequest {
                            node: peer.name.clone(),
                            all_nodes: false,
                        },
                    ))
                    .await
                    .map(|r| r.into_inner())
                    .map_err(|s| forward::from_peer(peer, s))
            };
            match tokio::time::timeout(Duration::from_secs(2), call).await {
                Ok(r) => r,
                Err(_) => Err(Status::unavailable(format!(
                    "{}: no answer within 2 s",
                    peer.name
                ))),
            }
        });
        let (here, there) = tokio::join!(here, futures::future::join_all(there));
        let mut all = here?;
        for answer in there {
            match answer {
                Ok(mut r) => all.processes.append(&mut r.processes),
                Err(s) => all.unreachable.push(s.message().to_owned()),
            }
        }
        Ok(all)
    }

    async fn local_processes(&self) -> Result<ListProcessesResponse, Status> {
        // Refresh first, so that a port the caller sees listed is one the
        // filter already passes.
        self.node
            .ports
            .refresh()
            .await
            .map_err(crate::engine::EngineError::from)?;
        let conflicts = self.node.ports.conflicts();
        let node = self.node.node().to_owned();
        let processes = self
            .node
            .processes
            .registry()
            .iter()
            .map(|p| process_to_pb(p, &node, &conflicts))
            .collect();
        Ok(ListProcessesResponse {
            node,
            processes,
            unreachable: Vec::new(),
        })
    }

    async fn local_data_plane(&self) -> Result<DataPlane, Status> {
        let dataplane = self.node.dataplane.clone();
        // BPF map reads block: off the runtime.
        let (counters, totals, ports, iface, xlate) = tokio::task::spawn_blocking(move || {
            let (c, t) = dataplane.counters()?;
            let ports: Vec<_>;
            let iface;
            {
                let own = dataplane.table();
                ports = own.current().iter().map(|(k, s)| (*k, *s)).collect();
                iface = own.interface().to_owned();
            }
            let flows = dataplane.flows();
            let xlate = (
                flows.counters()?,
                flows.rules()?,
                flows.interface().to_owned(),
            );
            Ok::<_, crate::engine::EngineError>((c, t, ports, iface, xlate))
        })
        .await
        .map_err(|e| Status::internal(format!("data plane task: {e}")))??;
        Ok(DataPlane {
            node: self.node.node().to_owned(),
            interface: iface,
            counters: Some(DataPlaneCounters {
                passed: counters.passed,
                dropped_not_owned: counters.dropped_not_owned,
                dropped_frozen: counters.dropped_frozen,
                passed_other: counters.passed_other,
                egress_blocked: counters.egress_blocked,
                captured: counters.captured,
                capture_lost: counters.capture_lost,
                recorded: counters.recorded,
                replayed: totals.replayed,
                skipped_delivered: totals.skipped_delivered,
                replay_failed: totals.failed,
                translated: xlate.0.translated_egress + xlate.0.translated_ingress,
                held: xlate.0.held,
            }),
            ports: ports
                .iter()
                .map(|(k, s)| pb::PortState {
                    port: Some(k.to_pb()),
                    state: port_state_name(*s).to_owned(),
                })
                .collect(),
            cluster_interface: xlate.2,
            translations: xlate.1.iter().map(|r| r.to_string()).collect(),
        })
    }
}

impl ControlService {
    fn conductor(&self) -> Result<&Arc<crate::conductor::Conductor>, Status> {
        self.node.conductor.as_ref().ok_or_else(|| {
            Status::failed_precondition(
                "the balancer needs membership: set [membership] enabled = true in ferryd's config",
            )
        })
    }
}

/// Applies `key = value` settings to a policy configuration; the error
/// names the key.
pub fn apply_settings(
    policy: &ferry_policy::Config,
    settings: &[pb::PolicySetting],
) -> Result<ferry_policy::Config, Status> {
    let mut root = toml::Table::try_from(policy)
        .map_err(|e| Status::internal(format!("policy as TOML: {e}")))?;
    for s in settings {
        let key = s.key.strip_prefix("policy.").unwrap_or(&s.key);
        let path: Vec<&str> = key.split('.').collect();
        if path.iter().any(|p| p.is_empty()) {
            return Err(Status::invalid_argument(format!(
                "{}: not a dotted policy key such as transfer.threshold",
                s.key
            )));
        }
        let value = toml::from_str::<toml::Table>(&format!("v = {}", s.value))
            .ok()
            .and_then(|mut t| t.remove("v"))
            .ok_or_else(|| {
                Status::invalid_argument(format!("{key}: {:?} is not a TOML value", s.value))
            })?;
        let mut table = &mut root;
        for part in &path[..path.len() - 1] {
            table = table
                .get_mut(*part)
                .and_then(|v| v.as_table_mut())
                .ok_or_else(|| {
                    Status::invalid_argument(format!("{key}: no such policy section {part:?}"))
                })?;
        }
        let leaf = path[path.len() - 1];
        if !table.contains_key(leaf) {
            return Err(Status::invalid_argument(format!(
                "{key}: no such policy field"
            )));
        }
        table.insert(leaf.to_owned(), value);
    }
    root.try_into::<ferry_policy::Config>().map_err(|e| {
        Status::invalid_argument(format!(
            "{}: {e}",
            settings
                .iter()
                .map(|s| s.key.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        ))
    })
}

fn port_state_name(s: crate::dataplane::PortState) -> &'static str {
    use crate::dataplane::PortState;
    match s {
        PortState::Owned => "owned",
        PortState::Recording => "recording",
        PortState::Armed => "armed",
        PortState::Frozen => "frozen",
        PortState::Capturing => "capturing",
        PortState::Releasing => "releasing",
        PortState::SharedContact => "shared, contact node",
        PortState::SharedMember => "shared, member",
    }
}

/// How a Migrate stream ends after its report: nothing when committed.
fn final_status(report: &MigrationReport) -> Option<Status> {
    let reason = &report.error;
    match pb::MigrationOutcome::try_from(report.outcome)
        .unwrap_or(pb::MigrationOutcome::Unspecified)
    {
        pb::MigrationOutcome::Committed => None,
        // Post-copy's window failed: the process runs nowhere.
        pb::MigrationOutcome::Lost => Some(Status::data_loss(format!(
            "the process resumed on the destination but not all of its memory followed; it was killed there and runs nowhere: {reason}"
        ))),
        _ if reason.starts_with("cancelled by") => Some(Status::cancelled(format!(
            "migration {reason}; the process still runs on the source"
        ))),
        // No room on the destination: another node may have some.
        _ if report.error_code == tonic::Code::ResourceExhausted as i32 => {
            Some(Status::resource_exhausted(format!(
                "migration aborted, the process still runs on the source: {reason}"
            )))
        }
        _ => Some(Status::aborted(format!(
            "migration aborted, the process still runs on the source: {reason}"
        ))),
    }
}
