//! The source side of a migration: validate, prepare, freeze, dump,
//! transfer, restore remotely, discard, commit, or abort and resume.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use ferry_proto::v1::peer_client::PeerClient;
use ferry_proto::v1::{
    AbortRequest, ArmRequest, CommitRequest, HelloRequest, MigrationEvent, MigrationOutcome,
    MigrationPhase, MigrationProgress, MigrationReport, MigrationStarted, PhaseTiming,
    PrepareRequest, RestoreRequest, TranslationsRequest, cluster_event, migration_event,
};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::sync::mpsc;
use tonic::transport::Channel;
use tracing::Instrument;

use crate::config::PeerConfig;
use crate::criu;
use crate::engine::Engine;
use crate::managed::{Lifecycle, OutStage};
use crate::process::{self, PortKey, SocketSummary};
use crate::sockstate::{self, SocketMigration};

mod outgoing;

pub use outgoing::Outgoing;

use super::precopy::{Convergence, MemoryStrategy, Precopy};
use super::sockettaker::{Incremental, ReadConnections, ReadPlan, SocketTaker, Taken};
use super::{EngineError, images, new_migration_id, pagetunnel, rollback};

/// What a migration request may choose; `None`: the agent's `[migration]`
/// setting.
#[derive(Debug, Clone, Copy, Default)]
pub struct MigrationOptions {
    /// How the TCP connections move.
    pub sockets: Option<SocketMigration>,
    /// How the memory moves.
    pub strategy: Option<MemoryStrategy>,
    /// Pre-copy: the freeze's budget for the pages left.
    pub downtime_budget: Option<Duration>,
    /// Pre-copy: the most rounds.
    pub max_rounds: Option<u32>,
    /// Pre-copy: slow down a process that writes faster than its pages
    /// cross.
    pub throttle: Option<bool>,
    /// Drain before freeze: wait at most this long, with the process
    /// stopped and its packets still flowing, for its send queues to empty.
    pub drain_send_queues: Option<Duration>,
}

/// A migration that passed validation and holds the destination's
/// reservation.
pub struct Prepared {
    pub migration_id: String,
    pub pid: i32,
    pub destination: PeerConfig,
    peer: PeerClient<Channel>,
    /// The peer protocol version `Hello` settled on.
    protocol_version: u32,
    sockets: SocketSummary,
    /// How the TCP connections move, decided before the freeze, and why
    /// not as asked, if so.
    socket_migration: SocketMigration,
    socket_note: Option<String>,
    /// The destination sets the connections' socket options itself
    /// (`PrepareResponse.takes_tcp_options`).
    destination_takes_tcp_options: bool,
    /// The destination's CRIU installs connections kept out of the images
    /// (`PrepareResponse.takes_connections_out`).
    destination_takes_connections_out: bool,
    /// Drain before freeze, and its bound.
    drain_send_queues: Option<Duration>,
    /// How the memory moves, and when pre-copy rounds stop.
    strategy: MemoryStrategy,
    convergence: Convergence,
    started: Instant,
    started_wall: SystemTime,
    /// `Control.CancelMigration`'s switch, and the migration's end.
    pub cancel: Arc<super::cancel::Cancel>,
}

impl std::fmt::Debug for Prepared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Prepared")
            .field("migration_id", &self.migration_id)
            .field("pid", &self.pid)
            .finish()
    }
}

/// Checks everything that can be checked before touching the process, and
/// reserves the destination. Errors here leave no trace anywhere.
pub async fn prepare(
    engine: &Arc<Engine>,
    pid: i32,
    destination: &str,
    options: MigrationOptions,
) -> Result<Prepared, EngineError> {
    let cfg = &engine.config.migration;
    let wanted_sockets = options.sockets.unwrap_or(cfg.sockets);
    let strategy = options.strategy.unwrap_or(cfg.strategy);
    let convergence = Convergence {
        downtime_budget: options
            .downtime_budget
            .unwrap_or(Duration::from_millis(u64::from(cfg.downtime_budget_ms))),
        // Assisted post-copy: one full pass (the second round only scans,
        // and its written pages are left to the post-copy).
        max_rounds: if strategy == MemoryStrategy::AssistedPostCopy {
            1
        } else {
            options.max_rounds.unwrap_or(cfg.max_rounds)
        },
        throttle: options.throttle.unwrap_or(cfg.throttle),
    };
    let started = Instant::now();
    let started_wall = SystemTime::now();
    let node = engine.node().to_owned();
    if destination == node {
        return Err(EngineError::DestinationIsSelf { node });
    }
    let peer_cfg = engine.cluster.peer(destination).ok_or_else(|| {
        let mut known: Vec<String> = vec![engine.node().to_owned()];
        known.extend(engine.cluster.known_peers().into_iter().map(|p| p.name));
        EngineError::UnknownNode {
            name: destination.to_owned(),
            known: known.join(", "),
        }
    })?;
    check_migratable(engine, pid)?;
    let criu_path = engine.config.criu_path.clone();
    tokio::task::spawn_blocking(move || criu::probe_version(&criu_path))
        .await
        .map_err(|e| EngineError::Internal(e.to_string()))??;

    // Claim the process so that no second migration of it can start.
    let migration_id = new_migration_id();
    let (argv, sockets) = {
        let mut reg = engine.processes.registry();
        let p = reg
            .get_mut(pid)
            .ok_or_else(|| not_managed(pid, engine.node()))?;
        if let Lifecycle::MigratingOut { migration_id, .. } = &p.lifecycle {
            return Err(EngineError::AlreadyMigrating {
                pid,
                migration_id: migration_id.clone(),
            });
        }
        p.lifecycle = Lifecycle::MigratingOut {
            migration_id: migration_id.clone(),
            stage: OutStage::Live,
        };
        (p.argv.clone(), p.sockets.clone())
    };
    let release = |engine: &Arc<Engine>| engine.processes.set_lifecycle(pid, Lifecycle::Running);

    let result = async {
        // Fresh socket list: ports opened since the last refresh move too.
        let tree = process::process_tree(pid);
        let sockets = process::sockets_of_tree(&tree).unwrap_or(sockets);
        // What CRIU would refuse to dump (a socket of a family it cannot
        // dump, a Unix socket connected outside the tree, a file lock), or
        // dump into a broken copy (a pipe or terminal shared with the
        // outside): refused now, with the process running. Found after the
        // freeze, it would cost the freeze and a rollback.
        let vetted = tree.clone();
        let vet_started = Instant::now();
        let obstacles =
            tokio::task::spawn_blocking(move || crate::managed::tree_obstacles(&vetted))
                .await
                .map_err(|e| EngineError::Internal(e.to_string()))?
                .map_err(EngineError::Internal)?;
        tracing::info!(
            processes = tree.len(),
            obstacles = obstacles.len(),
            vet_ms = vet_started.elapsed().as_secs_f64() * 1000.0,
            "process tree vetted"
        );
        if !obstacles.is_empty() {
            return Err(EngineError::NotMigratable {
                pid,
                reason: obstacles
                    .iter()
                    .map(|o| o.to_string())
                    .collect::<Vec<_>>()
                    .join("; "),
            });
        }
        // A connection to a process on the destination node would have to
        // become a connection within one host: no rewrite of one end does
        // that. Refused now, before anything is touched.
        if let Some(dest_ip) = engine.cluster.cluster_address_of(&peer_cfg.name)
            && sockets.tcp_peers.contains(&dest_ip)
        {
            return Err(EngineError::NotMigratable {
                pid,
                reason: format!(
                    "it has a TCP connection to {dest_ip}, {} itself: ferry cannot turn it into a connection within one node",
                    peer_cfg.name
                ),
            });
        }
        let mut peer = engine.cluster.peer_client(&peer_cfg).await?;
        let hello = peer
            .hello(HelloRequest {
                node: engine.node().to_owned(),
                protocol_versions: ferry_proto::PEER_PROTOCOL_VERSIONS.to_vec(),
            })
            .await
            .map_err(|s| peer_error(&peer_cfg.name, s))?
            .into_inner();
        if !ferry_proto::PEER_PROTOCOL_VERSIONS.contains(&hello.protocol_version) {
            return Err(EngineError::NoCommonVersion {
                node: peer_cfg.name.clone(),
                theirs: vec![hello.protocol_version],
                ours: ferry_proto::PEER_PROTOCOL_VERSIONS.to_vec(),
            });
        }
        let needed = if strategy.is_postcopy() {
            ferry_proto::PEER_PROTOCOL_POSTCOPY
        } else if strategy.is_precopy() {
            ferry_proto::PEER_PROTOCOL_PRECOPY
        } else {
            0
        };
        if hello.protocol_version < needed {
            return Err(EngineError::NotMigratable {
                pid,
                reason: format!(
                    "{} speaks peer protocol {}; {} needs {needed}",
                    peer_cfg.name,
                    hello.protocol_version,
                    strategy.name(),
                ),
            });
        }
        if strategy.is_postcopy() {
            criu::lazy::check_pipe_max_size()
                .map_err(|e| EngineError::HostSetting(format!("post-copy on {node}: {e}")))?;
        }
        let prepared = peer.prepare(PrepareRequest {
            protocol_version: hello.protocol_version,
            migration_id: migration_id.clone(),
            source_node: engine.node().to_owned(),
            source_pid: pid,
            argv: argv.clone(),
            ports: sockets.ports.iter().map(PortKey::to_pb).collect(),
        })
        .await
        .map_err(|s| peer_error(&peer_cfg.name, s))?
        .into_inner();
        if let Some(p) = engine.processes.registry().get_mut(pid) {
            p.sockets = sockets.clone();
        }
        Ok::<_, EngineError>((
            peer,
            hello.protocol_version,
            sockets,
            prepared,
        ))
    }
    .await;
    match result {
        Ok((peer, protocol_version, sockets, prepared)) => {
            let (socket_migration, socket_note) =
                sockstate::choose(wanted_sockets, sockets.tcp_other, protocol_version);
            if let Some(why) = &socket_note {
                tracing::info!(pid, reason = %why, "TCP connections move one by one (CRIU)");
            }
            Ok(Prepared {
                migration_id,
                pid,
                destination: peer_cfg,
                peer,
                protocol_version,
                sockets,
                socket_migration,
                socket_note,
                destination_takes_tcp_options: prepared.takes_tcp_options,
                destination_takes_connections_out: prepared.takes_connections_out,
                drain_send_queues: options.drain_send_queues,
                strategy,
                convergence,
                started,
                started_wall,
                cancel: Default::default(),
            })
        }
        Err(e) => {
            release(engine);
            Err(e)
        }
    }
}

fn not_managed(pid: i32, node: &str) -> EngineError {
    EngineError::NotMigratable {
        pid,
        reason: format!(
            "it is not managed by ferry on {node} (start it with `ferry run -- CMD`; `ferry ps` lists managed processes)"
        ),
    }
}

fn check_migratable(engine: &Engine, pid: i32) -> Result<(), EngineError> {
    let node = engine.node();
    if pid == std::process::id() as i32 {
        return Err(EngineError::NotMigratable {
            pid,
            reason: format!("it is the ferry engine of {node} itself"),
        });
    }
    if pid == 1 {
        return Err(EngineError::NotMigratable {
            pid,
            reason: "PID 1 is the node's init".into(),
        });
    }
    let info = match process::inspect(pid) {
        Ok(i) => i,
        Err(process::ProcessError::NotFound { .. }) => {
            return Err(EngineError::NoSuchProcess {
                pid,
                node: node.to_owned(),
            });
        }
        Err(e) => return Err(e.into()),
    };
    if info.kernel_thread {
        return Err(EngineError::NotMigratable {
            pid,
            reason: "it is a kernel thread".into(),
        });
    }
    if info.state == 'Z' {
        return Err(EngineError::NotMigratable {
            pid,
            reason: "it has exited (zombie)".into(),
        });
    }
    if engine.processes.registry().get(pid).is_none() {
        return Err(not_managed(pid, node));
    }
    Ok(())
}

pub(super) fn peer_error(node: &str, s: tonic::Status) -> EngineError {
    match s.code() {
        tonic::Code::Unavailable => EngineError::PeerUnavailable {
            node: node.to_owned(),
            address: String::new(),
            reason: s.message().to_owned(),
        },
        code => EngineError::Peer {
            node: node.to_owned(),
            code,
            message: s.message().to_owned(),
        },
    }
}

/// How many more times the source tells an unresponsive destination that a
/// migration is aborted (once a second, each bounded by peer_timeout_secs).
const ABORT_RETRIES: u32 = 300;

pub(super) fn silent(peer: &PeerConfig, step: &str, waited: Duration) -> EngineError {
    EngineError::PeerUnavailable {
        node: peer.name.clone(),
        address: peer.address.to_string(),
        reason: format!(
            "no answer to {step} within {} s (peer_timeout_secs)",
            waited.as_secs()
        ),
    }
}

type Events = mpsc::Sender<Result<MigrationEvent, tonic::Status>>;

struct Run {
    engine: Arc<Engine>,
    p: Prepared,
    events: Events,
    report: MigrationReport,
    last_phase: Instant,
    /// When the process's ports were frozen, if they were.
    freeze_start: Option<Instant>,
    /// Whether packets are captured (here while frozen, and on the
    /// destination from Arm) rather than dropped.
    capture: bool,
    /// Whether a capture session is open here for the migration.
    capturing_here: bool,
    /// Digests of what this node delivered between Arm and the freeze.
    delivered: Vec<u64>,
    /// The UDP datagrams still unread in the stopped process's sockets
    /// (`sockstate::queued_datagrams`).
    unread_datagrams: Vec<sockstate::QueuedDatagram>,
    /// In-cluster connections the peers' nodes translate for this
    /// migration, by node: undone on abort.
    translated: Vec<(String, Vec<ferry_proto::v1::InClusterFlow>)>,
    /// Connections to the nodes at the far end of the process's
    /// connections, which may hold in-cluster peers, opened before the
    /// freeze: translating them inside the freeze then costs no TCP and
    /// TLS handshake. By node; taken by [`translate_in_cluster`].
    peer_links: Vec<(String, PeerLink)>,
    /// The drain of this node's capture ring, running during the transfer:
    /// whoever needs the delivered log or the captured packets next waits
    /// for it first (the ring has one reader at a time).
    draining: Option<tokio::task::JoinHandle<()>>,
    /// Collective socket migration: the process's connections, held by
    /// ferryd in repair mode from the moment CRIU froze the tree (or the
    /// end of the dump, with a CRIU lacking ferry's patch). Turned back on an
    /// abort; closed (silently) after the commit.
    held: Option<Arc<sockstate::Held>>,
    /// Incremental socket migration: the connections read before the
    /// freeze, and the setsockopt watch (detached by the freeze's reader,
    /// or when this is dropped after an earlier abort).
    incremental: Option<Arc<Incremental>>,
    /// Incremental, protocol 9: the connections' fixed parts Arm carried;
    /// the freeze sends those still described by them as packed records.
    armed_fixed: Option<Arc<sockstate::packed::FixedParts>>,
    /// Collective socket migration: the transfer of the connections'
    /// states, started with the dump.
    sockets_sending: Option<tokio::task::JoinHandle<SocketsSent>>,
    /// Pre-copy: dirty tracking on, pages sent. Ended after the dump, or
    /// on an abort before the process resumes.
    precopy: Option<Precopy>,
    /// Post-copy: the lazy dump's CRIU, serving the stopped process's
    /// pages from the moment its images are written until the
    /// destination's lazy-pages daemon closes the connection.
    page_server: Option<PageServer>,
}

/// What a dump's blocking task returns: CRIU's notifications and what was
/// read from the stopped tree's sockets.
type Dumped = (criu::Notifications, Taken);

/// A lazy dump still running as a page server.
struct PageServer {
    task: tokio::task::JoinHandle<Result<Dumped, criu::CriuError>>,
    /// The CRIU child's PID while it runs (0 once it answered).
    criu_pid: Arc<std::sync::atomic::AtomicI32>,
    /// The page tunnel's pump: the page server's connection carried to
    /// the destination inside the peer connection (`pagetunnel.rs`).
    tunnel: Option<tokio::task::JoinHandle<Result<pagetunnel::Moved, EngineError>>>,
}

/// Assisted post-copy: the most ranges `RestoreRequest.local_pages` names
/// (about 20 bytes each, well inside the peer's 16 MiB messages).
const MAX_LOCAL_RANGES: usize = 200_000;

/// How long the source keeps a page server whose destination does not
/// answer PostCopyStatus once the page server's connection is gone.
const POSTCOPY_UNCONFIRMED: Duration = Duration::from_secs(30);

/// How long the source waits before the freeze, new handshakes held, for
/// the process to accept what waits in its listeners' accept queues and
/// for handshakes under way to end. A process that serves its clients
/// accepts within milliseconds; a client answers a SYN-ACK within one
/// round trip.
const PENDING_CONNECTIONS_BOUND: Duration = Duration::from_millis(500);

/// The listening sockets of the tree of `pid`, read before Arm: from
/// then on only their queues are looked at, while new connections wait.
async fn listeners_of(pid: i32) -> Result<process::Listeners, EngineError> {
    tokio::task::spawn_blocking(move || process::Listeners::of_tree(&process::process_tree(pid)))
        .await
        .map_err(|e| EngineError::Internal(e.to_string()))?
        .map_err(EngineError::from)
}

/// Waits (bounded) until no connection waits in the accept queue of one
/// of `listeners` (the tree of `pid`'s) and no handshake is under way on
/// their ports; [`EngineError::NotMigratable`] with what is left if the
/// bound passes.
async fn pending_connections_done(
    pid: i32,
    listeners: process::Listeners,
) -> Result<(), EngineError> {
    if listeners.is_empty() {
        return Ok(());
    }
    tokio::task::spawn_blocking(move || {
        let started = Instant::now();
        loop {
            let pending = listeners.pending()?;
            if pending.is_empty() {
                tracing::debug!(
                    waited_ms = started.elapsed().as_secs_f64() * 1000.0,
                    "no connection pending on the listeners"
                );
                return Ok(());
            }
            if started.elapsed() >= PENDING_CONNECTIONS_BOUND {
                return Err(EngineError::NotMigratable {
                    pid,
                    reason: format!(
                        "{pending}, still {} ms after new connections were held: the process \
                         does not accept them, and CRIU cannot move them",
                        PENDING_CONNECTIONS_BOUND.as_millis()
                    ),
                });
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    })
    .await
    .map_err(|e| EngineError::Internal(e.to_string()))?
}

/// What the socket transfer of a collective migration answers.
struct SentSockets {
    /// The message's size.
    bytes: u64,
    answer: ferry_proto::v1::TransferSocketsResponse,
    /// Incremental: how the connections were read.
    counts: Option<sockstate::ReadCounts>,
    /// Bytes in the connections' send queues.
    send_queued: u64,
}

type SocketsSent = Result<Option<SentSockets>, EngineError>;

/// Sends the connections' states to the destination in one message as
/// soon as the socket reader has them, which is during the dump.
async fn send_sockets(
    mut peer: PeerClient<Channel>,
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
    match tokio::time::timeout(deadline, peer.transfer_sockets(req)).await {
        Ok(Ok(r)) => Ok(Some(SentSockets {
            bytes,
            answer: r.into_inner(),
            counts,
            send_queued,
        })),
        Ok(Err(s)) => Err(peer_error(&destination.name, s)),
        Err(_) => Err(silent(&destination, "the socket transfer", deadline)),
    }
}

/// Opens the page tunnel to the destination for a post-copy's page
/// server, whose connection's other end is `ours`, and starts its pump.
async fn open_page_tunnel(
    run: &Run,
    ours: tokio::net::TcpStream,
) -> Result<tokio::task::JoinHandle<Result<pagetunnel::Moved, EngineError>>, EngineError> {
    use tokio_stream::wrappers::ReceiverStream;
    let (tx, rx) = tokio::sync::mpsc::channel(pagetunnel::DEPTH);
    // The first message names the migration; the channel has room for it.
    let _ = tx
        .send(ferry_proto::v1::TunnelBytes {
            migration_id: run.p.migration_id.clone(),
            data: Vec::new(),
        })
        .await;
    let mut peer = run.p.peer.clone();
    let deadline = Duration::from_secs(run.engine.config.peer_timeout_secs);
    let opened = tokio::time::timeout(deadline, peer.page_tunnel(ReceiverStream::new(rx))).await;
    let inbound = match opened {
        Ok(Ok(r)) => r.into_inner(),
        Ok(Err(s)) => return Err(peer_error(&run.p.destination.name, s)),
        Err(_) => return Err(silent(&run.p.destination, "PageTunnel", deadline)),
    };
    Ok(tokio::spawn(pagetunnel::pump(ours, inbound, tx)))
}

impl Run {
    /// Waits for the capture drain started after the dump, if any.
    async fn finish_drain(&mut self) -> Result<(), EngineError> {
        match self.draining.take() {
            Some(task) => task
                .await
                .map_err(|e| EngineError::Internal(format!("capture drain: {e}"))),
            None => Ok(()),
        }
    }

    async fn phase(&mut self, name: &str) {
        let now = Instant::now();
        if let Some(last) = self.report.phases.last_mut() {
            last.duration_us = (now - self.last_phase).as_micros() as u64;
        }
        self.last_phase = now;
        self.report.phases.push(PhaseTiming {
            phase: name.to_owned(),
            duration_us: 0,
        });
        tracing::info!(phase = name, "migration phase");
        let ev = MigrationEvent {
            event: Some(migration_event::Event::Progress(MigrationProgress {
                phase: name.to_owned(),
                elapsed_us: self.p.started.elapsed().as_micros() as u64,
                bytes_transferred: self.report.bytes_transferred,
            })),
        };
        if let Some(migration_event::Event::Progress(progress)) = &ev.event {
            self.engine
                .events
                .publish(cluster_event::Event::MigrationPhase(MigrationPhase {
                    migration_id: self.p.migration_id.clone(),
                    progress: Some(progress.clone()),
                }));
        }
        // The migration goes on if the caller stopped listening.
        let _ = self.events.send(Ok(ev)).await;
    }

    fn close_phases(&mut self) {
        if let Some(last) = self.report.phases.last_mut() {
            last.duration_us = self.last_phase.elapsed().as_micros() as u64;
        }
    }
}

/// Runs a prepared migration to its end and returns its report. Meant to be
/// spawned: it must finish (commit or roll back) even if the caller goes.
pub async fn run(engine: Arc<Engine>, p: Prepared, events: Events) -> MigrationReport {
    let span = tracing::info_span!("migration", id = %p.migration_id, pid = p.pid, to = %p.destination.name);
    async move {
        let report = MigrationReport {
            migration_id: p.migration_id.clone(),
            strategy: p.strategy.to_pb() as i32,
            memory_tracking: if p.strategy.is_precopy() {
                "uffd-wp-async+pagemap-scan".into()
            } else {
                String::new()
            },
            outcome: MigrationOutcome::Unspecified as i32,
            source_node: engine.node().to_owned(),
            destination_node: p.destination.name.clone(),
            source_pid: p.pid,
            tcp_established: p.sockets.tcp_established,
            tcp_listening: p.sockets.tcp_listening,
            udp_sockets: p.sockets.udp,
            ports: p.sockets.ports.iter().map(PortKey::to_pb).collect(),
            capture: engine.config.dataplane.capture,
            sockets: p.socket_migration.to_pb() as i32,
            sockets_note: p.socket_note.clone().unwrap_or_default(),
            started_at_unix_ms: p
                .started_wall
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_millis() as u64)
                .unwrap_or(0),
            phases: vec![PhaseTiming {
                phase: "prepare".into(),
                duration_us: 0,
            }],
            ..Default::default()
        };
        engine.outgoing.started(&p.migration_id, p.cancel.clone());
        let started = MigrationStarted {
            migration_id: p.migration_id.clone(),
            source_node: engine.node().to_owned(),
            destination_node: p.destination.name.clone(),
            pid: p.pid,
        };
        engine
            .events
            .publish(cluster_event::Event::MigrationStarted(started.clone()));
        let _ = events
            .send(Ok(MigrationEvent {
                event: Some(migration_event::Event::Started(started)),
            }))
            .await;
        let mut run = Run {
            engine: engine.clone(),
            // "prepare" runs from the request to the freeze.
            last_phase: p.started,
            freeze_start: None,
            capture: engine.config.dataplane.capture,
            capturing_here: false,
            delivered: Vec::new(),
            unread_datagrams: Vec::new(),
            draining: None,
            translated: Vec::new(),
            peer_links: Vec::new(),
            held: None,
            incremental: None,
            armed_fixed: None,
            sockets_sending: None,
            precopy: None,
            page_server: None,
            p,
            events,
            report,
        };
        let dir = engine
            .config
            .work_dir
            .join("outgoing")
            .join(&run.p.migration_id);
        let outcome = drive(&mut run, &dir).await;
        finish(&mut run, outcome).await;
        if run.report.outcome != MigrationOutcome::Committed as i32
            || super::keeps_every_log(&engine.config)
        {
            super::keep_logs(&engine.config.work_dir, &dir, &run.p.migration_id);
        }
        if let Err(e) = std::fs::remove_dir_all(&dir)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!(dir = %dir.display(), error = %e, "removing images");
        }
        run.report.total_time_us = run.p.started.elapsed().as_micros() as u64;
        run.close_phases();
        engine.reports.store(run.report.clone());
        engine.processes.departed(&run.report);
        engine
            .events
            .publish(cluster_event::Event::MigrationFinished(run.report.clone()));
        engine.outgoing.finished(&run.p.migration_id);
        run.p.cancel.finish(run.report.clone());
        tracing::info!(
            outcome = run.report.outcome,
            freeze_ms = run.report.freeze_time_us as f64 / 1000.0,
            total_ms = run.report.total_time_us as f64 / 1000.0,
            bytes = run.report.bytes_transferred,
            error = %run.report.error,
            "migration finished"
        );
        run.report
    }
    .instrument(span)
    .await
}

/// Where a migration stopped.
enum Stop {
    /// Failed before the commit point: roll back.
    BeforeCommit(EngineError),
    /// Committed (the source copy is gone); maybe the destination's
    /// confirmation of the resume failed.
    Committed(Option<EngineError>),
    /// Post-copy: committed, then the pages could not all follow; the
    /// destination killed the process and the source's copy is gone too.
    Lost(EngineError),
}

async fn drive(run: &mut Run, dir: &std::path::Path) -> Stop {
    let images = dir.join("images");
    if let Err(e) = std::fs::create_dir_all(&images)
        .map_err(EngineError::io(format!("creating {}", images.display())))
    {
        return Stop::BeforeCommit(e);
    }
    set_private(dir);
    // Cancelled at a phase boundary: the rollback resumes the process.
    macro_rules! honour_cancel {
        () => {
            if let Err(e) = run.p.cancel.check() {
                return Stop::BeforeCommit(e);
            }
        };
    }
    honour_cancel!();
    // perf's scheduler hooks on for CRIU's breakpoints, so that their
    // grace-period wait is not in the freeze (`criu::SchedHooks`); opened
    // beside the steps before the dump, held until the migration ends.
    let sched_hooks = tokio::task::spawn_blocking(criu::SchedHooks::hold);
    run.peer_links = open_peer_links(
        &run.engine,
        &run.p.sockets.tcp_peers,
        &run.p.destination.name,
    );

    // Pre-copy: the memory crosses while the process runs.
    let pid = run.p.pid;
    let deadline = Duration::from_secs(run.engine.config.peer_timeout_secs);
    if run.p.strategy.is_precopy() {
        run.phase("pre-copy").await;
        let started = Instant::now();
        let mut pre = match Precopy::start(pid, run.p.strategy).await {
            Ok(p) => p,
            Err(e) => return Stop::BeforeCommit(e),
        };
        let events = run.events.clone();
        let (migration_start, sent_before) = (run.p.started, run.report.bytes_transferred);
        let link = super::precopy::Link {
            peer: &mut run.p.peer,
            migration_id: &run.p.migration_id,
            destination: &run.p.destination,
            deadline,
            cancel: &run.p.cancel,
        };
        let mut sent = sent_before;
        let result = pre
            .rounds(link, run.p.convergence, |r| {
                sent += r.sent_bytes;
                // The migration goes on if the caller stopped listening.
                let _ = events.try_send(Ok(MigrationEvent {
                    event: Some(migration_event::Event::Progress(MigrationProgress {
                        phase: format!("pre-copy round {}", r.round),
                        elapsed_us: migration_start.elapsed().as_micros() as u64,
                        bytes_transferred: sent,
                    })),
                }));
            })
            .await;
        run.report.rounds = pre.rounds.clone();
        run.report.convergence = pre.convergence.clone();
        run.report.throttled_to_percent = pre.throttled_to;
        run.report.bytes_transferred += pre.bytes_sent;
        run.report.preparation_time_us = started.elapsed().as_micros() as u64;
        run.precopy = Some(pre);
        if let Err(e) = result {
            return Stop::BeforeCommit(e);
        }
    }

    // Incremental: what of the connections does not move is read now,
    // while the process runs, with the setsockopt watch attached first.
    honour_cancel!();
    if run.p.socket_migration == SocketMigration::Incremental {
        run.phase("sockets pre-read").await;
        let with_options = options_by_ferryd(
            true,
            run.p.destination_takes_tcp_options,
            &run.engine.config.criu_path,
        );
        match tokio::task::spawn_blocking(move || preread(pid, with_options)).await {
            Ok(Ok(inc)) => {
                tracing::info!(
                    connections = inc.preread.len(),
                    with_options,
                    "connections read before the freeze; setsockopt watch attached"
                );
                run.incremental = Some(Arc::new(inc));
            }
            Ok(Err(why)) => {
                tracing::warn!(pid, reason = %why, "incremental socket migration unavailable; collective instead");
                run.p.socket_migration = SocketMigration::Collective;
                run.p.socket_note = Some(format!("incremental: {why}; collective instead"));
                run.report.sockets = SocketMigration::Collective.to_pb() as i32;
                run.report.sockets_note = run.p.socket_note.clone().unwrap_or_default();
            }
            Err(e) => return Stop::BeforeCommit(EngineError::Internal(e.to_string())),
        }
    }

    // The listeners whose queues must be empty at the freeze (see below).
    let listeners = match listeners_of(pid).await {
        Ok(l) => l,
        Err(e) => return Stop::BeforeCommit(e),
    };

    // Arm: from here on the destination keeps every packet for the
    // process's ports. Until the freeze this node still serves them, and
    // logs what it delivers, so the destination can skip those.
    let id = run.p.migration_id.clone();
    let ports: Vec<PortKey> = run.p.sockets.ports.iter().copied().collect();
    honour_cancel!();
    if run.capture {
        run.phase("arm").await;
        run.engine
            .dataplane
            .capture
            .open(&id, ports.iter().copied());
        run.capturing_here = true;
        run.engine
            .processes
            .set_lifecycle(pid, out_stage(&id, OutStage::Recording));
        if let Err(e) = run.engine.ports.apply().await {
            return Stop::BeforeCommit(e.into());
        }
        // Protocol 7: the connections read before the freeze, whose
        // sockets the destination opens now instead of inside it; from
        // 9 with what of them the freeze does not change.
        let version = run.p.protocol_version;
        let (connections, fixed) = match &run.incremental {
            Some(inc) if version >= ferry_proto::PEER_PROTOCOL_STAGED_SOCKETS => {
                let fixed: Option<sockstate::packed::FixedParts> = (version
                    >= ferry_proto::PEER_PROTOCOL_PACKED_STATES)
                    .then(|| inc.preread.fixed_parts().collect());
                let connections = inc
                    .preread
                    .connections()
                    .map(|(inode, c)| ferry_proto::v1::StagedConnection {
                        inode,
                        local: c.local.to_string(),
                        remote: c.remote.to_string(),
                        sndbuf: if fixed.is_some() { c.sndbuf } else { 0 },
                        fixed: fixed
                            .as_ref()
                            .and_then(|f| f.get(&inode))
                            .map(sockstate::packed::Fixed::to_pb),
                    })
                    .collect();
                (connections, fixed)
            }
            _ => (Vec::new(), None),
        };
        run.armed_fixed = fixed.map(Arc::new);
        let arm = run.p.peer.arm(ArmRequest {
            migration_id: id.clone(),
            ports: ports.iter().map(PortKey::to_pb).collect(),
            connections,
        });
        match tokio::time::timeout(deadline, arm).await {
            Ok(Ok(_)) => {}
            Ok(Err(s)) => return Stop::BeforeCommit(peer_error(&run.p.destination.name, s)),
            Err(_) => return Stop::BeforeCommit(silent(&run.p.destination, "arm", deadline)),
        }
        // The destination keeps every packet now: new handshakes are left
        // to it.
        run.engine
            .processes
            .set_lifecycle(pid, out_stage(&id, OutStage::Armed));
        if let Err(e) = run.engine.ports.apply().await {
            return Stop::BeforeCommit(e.into());
        }
    }

    // CRIU can move neither a connection waiting in a listener's accept
    // queue nor a handshake half done, and would find them only once the
    // process is stopped. From Arm none starts here (an armed port takes
    // no SYN: the destination replays it to the restored listener);
    // the process accepts what is queued, and handshakes under way end,
    // within a bound, or the migration stops here, the process running.
    honour_cancel!();
    if let Err(e) = pending_connections_done(pid, listeners).await {
        return Stop::BeforeCommit(e);
    }

    // Dump, with the freeze inside it: once CRIU has started and is about
    // to stop the process ("pre-dump"), the process's ports are cut off in
    // the data plane (nothing out, so no RST; what arrives is kept here
    // too, for a resume on abort). CRIU's start-up thus runs while the
    // process still serves its clients.
    honour_cancel!();
    let _sched_hooks = super::held_sched_hooks(sched_hooks).await;
    run.phase("dump").await;
    // Post-copy: the page server's connection, made before the freeze.
    // CRIU gets one end (this process closes its copy once CRIU runs), the
    // page tunnel the other.
    let (lazy, mut tunnel_end) = if run.p.strategy.is_postcopy() {
        match pagetunnel::loopback_pair().await {
            Ok(pair) => (
                Some(criu::LazyDump {
                    ps_socket: Arc::new(std::sync::Mutex::new(Some(pair.criu))),
                    config_file: dir.join("lazy-dump.conf"),
                }),
                Some(pair.ours),
            ),
            Err(e) => return Stop::BeforeCommit(e),
        }
    } else {
        (None, None)
    };
    let criu_pid = Arc::new(std::sync::atomic::AtomicI32::new(0));
    let req = criu::DumpRequest {
        criu: run.engine.config.criu_path.clone(),
        pid,
        images_dir: images.clone(),
        log_dir: dir.to_owned(),
        log_level: run.engine.config.criu_log_level,
        tcp_connections: if run.p.socket_migration.is_collective() {
            criu::TcpConnections::Skip
        } else {
            criu::TcpConnections::Dump
        },
        lazy: lazy.clone(),
        criu_pid: Some(criu_pid.clone()),
        tcp_options_by_caller: false,
        connections_out: false,
    };
    let frozen_at = Arc::new(std::sync::Mutex::new(None::<Instant>));
    // Post-copy: CRIU says "status-ready" once the images are written and
    // its page server listens; the dump itself ends only when the
    // destination has every page.
    let (ready_tx, ready_rx) = tokio::sync::oneshot::channel::<Taken>();
    let capture = run.capture;
    let collective = run.p.socket_migration.is_collective();
    let incremental = run.incremental.clone();
    let drain = run.p.drain_send_queues;
    let drained = Arc::new(std::sync::Mutex::new(None::<sockstate::Flushed>));
    let takes_tcp_options = run.p.destination_takes_tcp_options;
    let takes_connections_out = run.p.destination_takes_connections_out;
    // Collective: the connections' states go to the destination as soon as
    // they are read, which is during the dump (`sockettaker.rs`).
    let (states_to, states_from) = tokio::sync::oneshot::channel();
    let criu_path = run.engine.config.criu_path.clone();
    let mut dump_task = tokio::task::spawn_blocking({
        let (engine, id, frozen_at) = (run.engine.clone(), id.clone(), frozen_at.clone());
        let drained = drained.clone();
        let is_lazy = lazy.is_some();
        let mut ready_tx = Some(ready_tx);
        // Pre-copy's throttle, if the rounds converged with it: on until
        // CRIU is about to freeze the process.
        let mut throttle = run.precopy.as_mut().and_then(|p| p.throttle.take());
        move || {
            // Read once per CRIU binary, before CRIU starts.
            let during_dump = criu::has_patch(&criu_path, criu::DUMP_ROLLBACK_MARK);
            // Collective, and both ends' CRIU can leave the connections'
            // options to ferryd: CRIU's dump records the connections
            // without them and ferryd reads them with their state.
            let mut req = req;
            req.tcp_options_by_caller =
                options_by_ferryd(collective, takes_tcp_options, &criu_path);
            if req.tcp_options_by_caller {
                tracing::info!(
                    "the connections' socket options move with their state, not in CRIU's images"
                );
                // And both ends' CRIU can leave the connections out of the
                // images altogether: the dump never passes them out of the
                // process, the restore installs ferryd's at their numbers.
                req.connections_out =
                    takes_connections_out && criu::has_patch(&criu_path, criu::CONNS_OUT_MARK);
                if req.connections_out {
                    tracing::info!("the connections are kept out of CRIU's images");
                }
            }
            let plan = ReadPlan {
                pid,
                capture,
                collective,
                with_options: req.tcp_options_by_caller,
                incremental,
            };
            let mut taker = Some(SocketTaker::new(
                plan,
                during_dump,
                collective.then_some(states_to),
            ));
            // Drain before freeze: the ports are cut off only once CRIU has
            // stopped the tree and its send queues emptied (or the bound
            // passed). Only with ferry's CRIU, which says query-ext-files
            // as it freezes the tree and network-unlock before it lets a
            // failed dump's tree run again.
            let drain = drain.filter(|_| {
                if !during_dump {
                    tracing::warn!(
                        "drain before freeze needs ferry's patched CRIU (dump rollback notified): not drained"
                    );
                }
                during_dump
            });
            let mut ports_frozen = false;
            let freeze_ports = |ports_frozen: &mut bool| -> Result<(), String> {
                engine
                    .processes
                    .set_lifecycle(pid, out_stage(&id, OutStage::Frozen { capture }));
                *ports_frozen = true;
                engine.ports.apply_now().map_err(|e| e.to_string())?;
                tracing::info!("ports frozen");
                Ok(())
            };
            let dumped = criu::dump(&req, &mut |script| {
                match script {
                    // Sent right after CRIU froze the tree.
                    "query-ext-files" => {
                        let Some(bound) = drain.filter(|_| !ports_frozen) else {
                            if let Some(t) = taker.as_mut() {
                                t.tree_frozen();
                            }
                            return Ok(());
                        };
                        // The tree is stopped, its packets still flow: what
                        // it wrote leaves, the peers' ACKs come back.
                        let take_started = Instant::now();
                        let taken = taker.as_ref().map(|t| t.take_now());
                        tracing::debug!(
                            ms = take_started.elapsed().as_secs_f64() * 1000.0,
                            "the tree's sockets taken for the drain"
                        );
                        match &taken {
                            Some(Ok(sockets)) => {
                                let flushed =
                                    sockstate::flush_send_queues(sockets.tcp_descriptors(), bound);
                                tracing::info!(
                                    bytes_at_start = flushed.bytes_at_start,
                                    bytes_left = flushed.bytes_left,
                                    waited_ms = flushed.waited.as_secs_f64() * 1000.0,
                                    "send queues drained before the freeze"
                                );
                                *crate::sync::lock(&drained) = Some(flushed);
                            }
                            Some(Err(e)) => {
                                tracing::warn!(error = %e, "taking the connections to drain them: not drained")
                            }
                            None => {}
                        }
                        freeze_ports(&mut ports_frozen)?;
                        if let Some(t) = taker.as_mut() {
                            t.tree_frozen_taken(taken.and_then(Result::ok));
                        }
                        return Ok(());
                    }
                    // A failed dump, about to let the tree run again.
                    "network-unlock" => {
                        if let Some(t) = taker.as_mut() {
                            t.tree_thawing();
                        }
                        return Ok(());
                    }
                    "status-ready" => {
                        if let Some(tx) = ready_tx.take() {
                            let taken = taker.take().map(|t| t.finish(false)).unwrap_or_default();
                            let _ = tx.send(taken);
                        }
                        return Ok(());
                    }
                    "pre-dump" => {}
                    _ => return Ok(()),
                }
                // SIGCONT wakes the process at once: CRIU never finds it
                // stopped by the throttle (it would restore it stopped).
                drop(throttle.take());
                // Set before the filter changes: if that fails half-way,
                // the abort still reports the time the process was cut off.
                // The process stops here, also when its ports are cut off
                // later (a drain).
                *crate::sync::lock(&frozen_at) = Some(Instant::now());
                if drain.is_some() {
                    return Ok(());
                }
                freeze_ports(&mut ports_frozen)
            });
            if dumped.is_ok() && !ports_frozen {
                // A drain waited for query-ext-files, which never came.
                return Err(criu::CriuError::Failed {
                    operation: "dump",
                    reason: "CRIU froze the tree without its query-ext-files notification: \
                             the ports were never cut off for the drain before the freeze"
                        .into(),
                });
            }
            let dumped = match dumped {
                Ok(d) => d,
                Err(e) => {
                    // CRIU said network-unlock first if it could; if it
                    // died instead, this is the soonest.
                    if let Some(mut t) = taker.take() {
                        t.tree_thawing();
                    }
                    return Err(e);
                }
            };
            if is_lazy {
                // Handed over at "status-ready", while this dump serves pages.
                return Ok((dumped, Taken::default()));
            }
            let taken = taker.take().map(|t| t.finish(true)).unwrap_or_default();
            Ok::<_, criu::CriuError>((dumped, taken))
        }
    });
    // Spawned, not polled beside the dump: it runs while the dump does,
    // and a rollback waits for it before the destination hears the abort
    // (a socket transfer still in flight would leave the rebuilt copies
    // behind there).
    run.sockets_sending = collective.then(|| {
        tokio::spawn(send_sockets(
            run.p.peer.clone(),
            run.p.migration_id.clone(),
            run.engine.node().to_owned(),
            run.p.destination.clone(),
            Duration::from_secs(run.engine.config.peer_timeout_secs),
            states_from,
            run.armed_fixed.clone(),
        ))
    });
    let dumped = match &lazy {
        None => dump_task.await,
        Some(_) => {
            let no_server = || criu::CriuError::Failed {
                operation: "dump",
                reason:
                    "the lazy dump ended without its page server (no status-ready notification)"
                        .into(),
            };
            // Ready, or the dump's end (the hook is then gone too).
            enum Early {
                Ready(Taken),
                HookGone,
                Ended(Result<Result<Dumped, criu::CriuError>, tokio::task::JoinError>),
            }
            let early = tokio::select! {
                r = ready_rx => match r { Ok(taken) => Early::Ready(taken), Err(_) => Early::HookGone },
                r = &mut dump_task => Early::Ended(r),
            };
            let ended = match early {
                Early::Ready(taken) => Err(taken),
                Early::HookGone => Ok((&mut dump_task).await),
                Early::Ended(r) => Ok(r),
            };
            match ended {
                Err(taken) => {
                    tracing::info!("images written; CRIU serves the pages");
                    // The rollback needs the connections from here on.
                    run.held = taken.held.clone();
                    run.page_server = Some(PageServer {
                        task: dump_task,
                        criu_pid: criu_pid.clone(),
                        tunnel: None,
                    });
                    let ours = tunnel_end
                        .take()
                        .expect("a post-copy dump has a tunnel end");
                    match open_page_tunnel(run, ours).await {
                        Ok(t) => {
                            if let Some(s) = run.page_server.as_mut() {
                                s.tunnel = Some(t);
                            }
                        }
                        Err(e) => return Stop::BeforeCommit(e),
                    }
                    Ok(Ok((Vec::new(), taken)))
                }
                Ok(Ok(Ok(_))) => Ok(Err(no_server())),
                Ok(other) => other,
            }
        }
    };
    run.freeze_start = *crate::sync::lock(&frozen_at);
    if let Some(f) = *crate::sync::lock(&drained) {
        run.report.drain_time_us = f.waited.as_micros() as u64;
        run.report.drain_bytes_at_start = f.bytes_at_start;
        run.report.drain_bytes_left = f.bytes_left;
    }
    let dump_end = Instant::now();
    match dumped {
        Ok(Ok((notes, taken))) => {
            tracing::debug!(?notes, unread_datagrams = taken.unread.len(), "dump done");
            run.unread_datagrams = taken.unread;
            // Held from here: an abort turns repair off again.
            if taken.held.is_some() {
                run.held = taken.held;
            }
        }
        Ok(Err(e)) => return Stop::BeforeCommit(e.into()),
        Err(e) => return Stop::BeforeCommit(EngineError::Internal(e.to_string())),
    };
    let Some(freeze_start) = run.freeze_start else {
        return Stop::BeforeCommit(EngineError::Internal(
            "CRIU dumped without its pre-dump notification: the ports were never frozen".into(),
        ));
    };
    // Pre-copy: with the process stopped, the last scan says which of the
    // pages the destination holds are still current; tracking ends.
    let held_pages = match run.precopy.take() {
        Some(pre) => match tokio::task::spawn_blocking(move || pre.finish()).await {
            Ok(Ok(held)) => held,
            Ok(Err(e)) => return Stop::BeforeCommit(e),
            Err(e) => return Stop::BeforeCommit(EngineError::Internal(e.to_string())),
        },
        None => std::collections::HashMap::new(),
    };
    // Assisted post-copy: those pages the destination serves itself after
    // the resume (the lazy dump left them with CRIU's page server, where
    // only the pages written since the live pass are now fetched).
    let local_pages: Vec<ferry_proto::v1::StoredPages> =
        if run.p.strategy == MemoryStrategy::AssistedPostCopy {
            let mut ranges: Vec<_> = held_pages
                .iter()
                .flat_map(|(vpid, set)| {
                    set.iter().map(|(s, e)| ferry_proto::v1::StoredPages {
                        pid: *vpid,
                        vaddr: s,
                        length: e - s,
                    })
                })
                .collect();
            if ranges.len() > MAX_LOCAL_RANGES {
                // The largest ones fit in the Restore message; the pages
                // of the others come from the source, correct but slower.
                tracing::warn!(
                    ranges = ranges.len(),
                    kept = MAX_LOCAL_RANGES,
                    "the pass's pages are in too many pieces to name them all"
                );
                ranges.sort_unstable_by_key(|r| std::cmp::Reverse(r.length));
                ranges.truncate(MAX_LOCAL_RANGES);
            }
            ranges
        } else {
            Vec::new()
        };
    // The dump is done (a cancel during it waited here): the process is
    // stopped, and resumes on the rollback.
    honour_cancel!();
    run.phase("transfer").await;
    let (tx, rx) = mpsc::channel(8);
    let transfer_start = Instant::now();
    let reader = tokio::task::spawn_blocking({
        let images = images.clone();
        let id = run.p.migration_id.clone();
        let packing = images::Packing::for_version(run.p.protocol_version);
        move || {
            let started = transfer_start.elapsed();
            let read = images::read_images(images, id, packing, &held_pages, tx);
            (read, started, transfer_start.elapsed())
        }
    });
    if run.capture {
        // Everything delivered while recording is in the ring by now. Under
        // load that is megabytes of packets to digest: it runs beside the
        // transfer rather than in front of it (the freeze is on), and
        // starts after the image reader, which the freeze waits for.
        let engine = run.engine.clone();
        run.draining = Some(tokio::task::spawn_blocking(move || {
            engine.dataplane.collect_captured()
        }));
    }
    let mut images_peer = run.p.peer.clone();
    let images_sent = tokio::time::timeout(
        deadline,
        images_peer.transfer_images(tokio_stream::wrappers::ReceiverStream::new(rx)),
    );
    // Beside the images: the connections' states, sent since they were
    // read (during the dump), so the destination rebuilds them meanwhile.
    let sockets_sent = async {
        match run.sockets_sending.take() {
            None => Ok(None),
            Some(task) => task
                .await
                .unwrap_or_else(|e| Err(EngineError::Internal(format!("socket transfer: {e}")))),
        }
    };
    // A cancel cuts the images short, not the connections: a socket
    // transfer in flight is waited for, so that the abort reaches the
    // destination after it.
    let cancel = run.p.cancel.clone();
    let images_sent = async {
        tokio::select! {
            sent = images_sent => Ok(sent),
            e = cancel.requested() => Err(e),
        }
    };
    let (sent, sockets) = tokio::join!(images_sent, sockets_sent);
    let sent = match sent {
        Err(e) => {
            // The reader ends once its channel is gone.
            let _ = reader.await;
            return Stop::BeforeCommit(e);
        }
        Ok(Ok(sent)) => sent,
        Ok(Err(_)) => {
            return Stop::BeforeCommit(silent(&run.p.destination, "the image transfer", deadline));
        }
    };
    let read = reader.await.map(|(read, started, ended)| {
        tracing::debug!(
            reader_started_ms = started.as_secs_f64() * 1000.0,
            read_ms = ended.as_secs_f64() * 1000.0,
            answered_ms = transfer_start.elapsed().as_secs_f64() * 1000.0,
            "images sent"
        );
        read
    });
    let counts = match (read, sent) {
        (Ok(Ok(counts)), Ok(_)) => counts,
        (Ok(Err(e)), _) => return Stop::BeforeCommit(e),
        (Err(e), _) => return Stop::BeforeCommit(EngineError::Internal(e.to_string())),
        (_, Err(s)) => return Stop::BeforeCommit(peer_error(&run.p.destination.name, s)),
    };
    run.report.image_files = counts.files;
    run.report.image_bytes = counts.bytes + counts.stored_bytes;
    run.report.bytes_transferred += counts.bytes;
    if run.p.strategy.is_precopy() {
        let page = crate::memtrack::page_size();
        run.report.dumped_pages = counts.dumped_page_bytes / page;
        run.report.precopied_pages = counts.stored_bytes / page;
        run.report.freeze_pages = run.report.dumped_pages - run.report.precopied_pages;
    }
    match sockets {
        Ok(Some(SentSockets {
            bytes,
            answer,
            counts,
            send_queued,
        })) => {
            run.report.bytes_transferred += bytes;
            run.report.tcp_send_queue_bytes = send_queued;
            if let Some(c) = counts {
                run.report.connections_preread = c.preread;
                run.report.connections_read_in_freeze = c.touched + c.unknown;
            }
            run.report.connections_staged = answer.staged;
            tracing::info!(
                connections = answer.connections,
                staged = answer.staged,
                rebuild_ms = answer.rebuild_us as f64 / 1000.0,
                "destination rebuilt the connections"
            );
        }
        Ok(None) => {}
        Err(e) => return Stop::BeforeCommit(e),
    }

    let transfer_end = Instant::now();
    // The last point a cancel is honoured: from here the destination
    // restores, and the migration commits or rolls back by itself.
    if let Err(e) = run.p.cancel.enter_restore() {
        return Stop::BeforeCommit(e);
    }
    run.phase("restore").await;
    // While the destination restores, the connections the TCP state
    // iterator read without repair mode go into it here: before the
    // Release (the commit point), so that the stopped copy closes them
    // silently whenever it goes, even if this agent does not live to kill
    // it. Off the freeze's critical path: this node only waits meanwhile.
    let repairing_the_rest = run.held.clone().map(|held| {
        tokio::task::spawn_blocking(move || {
            let started = Instant::now();
            let turned = held.repair_the_rest();
            if turned > 0 {
                tracing::debug!(
                    connections = turned,
                    ms = started.elapsed().as_secs_f64() * 1000.0,
                    "repair on beside the restore"
                );
            }
        })
    });
    let restore = run.p.peer.restore(RestoreRequest {
        migration_id: run.p.migration_id.clone(),
        collective_sockets: run.p.socket_migration.is_collective(),
        lazy_pages: run.page_server.is_some(),
        local_pages,
    });
    let restore = tokio::time::timeout(deadline, restore).await;
    // Done before anything else touches the connections (an abort's
    // resume takes repair off again).
    if let Some(task) = repairing_the_rest
        && let Err(e) = task.await
    {
        tracing::error!(error = %e, "turning repair on beside the restore");
    }
    let restored = match restore {
        Ok(Ok(r)) => r.into_inner(),
        Ok(Err(s)) => return Stop::BeforeCommit(peer_error(&run.p.destination.name, s)),
        // The destination may still finish the restore; the abort that
        // follows makes it discard that copy (its ports stay frozen there
        // until the copy is dead).
        Err(_) => return Stop::BeforeCommit(silent(&run.p.destination, "the restore", deadline)),
    };
    run.report.destination_pid = restored.pid;
    let restore_end = Instant::now();
    let (restore_criu_us, criu_startup_us, image_scan_us) = (
        restored.restore_time_us,
        restored.criu_startup_us,
        restored.image_scan_us,
    );

    // The destination restored the in-cluster connections on its own
    // cluster address and holds them: their peers' nodes translate from
    // now on, before this copy goes.
    if !restored.in_cluster.is_empty() {
        run.phase("translate").await;
        if let Err(e) = translate_in_cluster(run, restored.in_cluster, deadline).await {
            return Stop::BeforeCommit(e);
        }
    }

    let translate_end = Instant::now();
    if let Err(e) = run.finish_drain().await {
        // The destination holds a restored copy: go on without the log;
        // the replay then also feeds what the source delivered, and TCP
        // drops those duplicates (a UDP datagram could be doubled).
        tracing::error!(error = %e, "draining the delivered log");
    }
    run.delivered = run.engine.dataplane.capture.take_delivered(&id);
    tracing::debug!(packets = run.delivered.len(), "delivered while recording");

    // Commit point: the destination holds a restored, stopped copy. Ours
    // gives up its ports and stays stopped, its sockets in repair mode
    // (nothing leaves them), until the destination answered the Commit;
    // then it is killed and its sockets close without a word. Killed
    // before the Commit, its exit (a thousand descriptors closed and their
    // /proc entries dropped) took the CPU the destination's commit waited
    // for: measured A/B at 1024 connections (54 migrations each,
    // docs/results.md), the freeze fell by 1.5 ms.
    // Post-copy: ours also backs the page server, and stays until the
    // destination has every page.
    let postcopy = run.p.strategy.is_postcopy();
    run.phase("release").await;
    let released = if postcopy {
        OutStage::PagesOnly
    } else {
        OutStage::Released
    };
    run.engine
        .processes
        .set_lifecycle(pid, out_stage(&id, released));
    if let Err(e) = run.engine.ports.apply().await {
        tracing::error!(error = %e, "releasing the ports of the migrated process");
    }
    if run.capturing_here {
        run.engine.dataplane.capture.close(&id);
        run.capturing_here = false;
    }

    let release_end = Instant::now();
    run.phase("commit").await;
    let unread = super::queued::for_commit(
        run.p.protocol_version,
        std::mem::take(&mut run.unread_datagrams),
    );
    if unread.left_out > 0 {
        tracing::warn!(
            carried = unread.datagrams.len(),
            left_out = unread.left_out,
            budget_bytes = super::queued::COMMIT_PAYLOAD_BUDGET,
            "more unread UDP datagrams than one Commit carries: the newest are lost"
        );
    }
    let mut last_err = None;
    let mut running_for = Duration::ZERO;
    for attempt in 0..5 {
        match run
            .p
            .peer
            .commit(CommitRequest {
                migration_id: run.p.migration_id.clone(),
                delivered_digests: run.delivered.clone(),
                unread_datagrams: unread.keys.clone(),
                queued_datagrams: unread.datagrams.clone(),
            })
            .await
        {
            Ok(r) => {
                let r = r.into_inner();
                run.report.destination_pid = r.pid;
                run.report.replay = r.replay;
                running_for = Duration::from_micros(r.running_for_us);
                last_err = None;
                break;
            }
            // Post-copy: the destination refused to resume the process
            // (its lazy-pages daemon failed first); ours is intact.
            Err(s) if postcopy && s.code() == tonic::Code::FailedPrecondition => {
                return Stop::BeforeCommit(peer_error(&run.p.destination.name, s));
            }
            Err(s) => {
                tracing::warn!(attempt, status = %s, "commit not confirmed; retrying");
                last_err = Some(peer_error(&run.p.destination.name, s));
                tokio::time::sleep(Duration::from_millis(100 << attempt)).await;
            }
        }
    }
    let commit_end = Instant::now();
    if !postcopy {
        run.phase("discard").await;
        discard_source_copy(&run.engine, pid).await;
    }
    // The freeze ends when the process ran again on the destination: what
    // the destination did after its resume (a replay, the answer) is not
    // freeze. The answer's way back still counts, a little too long.
    let resumed = commit_end
        .checked_sub(running_for)
        .unwrap_or(commit_end)
        .max(release_end);
    run.report.freeze_time_us = (resumed - freeze_start).as_micros() as u64;
    let us = |from: Instant, to: Instant| (to - from).as_micros() as u64;
    // Only the part of the replay the process waited for.
    let replay_us = run
        .report
        .replay
        .map(|r| r.replay_time_us)
        .unwrap_or(0)
        .saturating_sub(running_for.as_micros() as u64);
    let restore_rpc_us = us(transfer_end, restore_end);
    run.report.freeze_parts = [
        ("dump (CRIU, process stopped)", us(freeze_start, dump_end)),
        (
            "transfer (and the sockets' state beside it)",
            us(dump_end, transfer_end),
        ),
        ("restore: image scan", image_scan_us),
        ("restore: CRIU start-up", criu_startup_us),
        (
            "restore: CRIU",
            restore_criu_us.saturating_sub(criu_startup_us),
        ),
        (
            "restore: other",
            restore_rpc_us.saturating_sub(restore_criu_us + image_scan_us),
        ),
        ("translate", us(restore_end, translate_end)),
        ("release", us(translate_end, release_end)),
        ("commit: replay", replay_us),
        (
            "commit: other",
            us(release_end, resumed).saturating_sub(replay_us),
        ),
    ]
    .into_iter()
    // A destination whose CRIU sends no notifications (this build's) does
    // not time CRIU's start-up apart: it is in "restore: CRIU".
    .filter(|(phase, us)| !(*phase == "restore: CRIU start-up" && *us == 0))
    .map(|(phase, duration_us)| PhaseTiming {
        phase: phase.to_owned(),
        duration_us,
    })
    .collect();
    if postcopy {
        return postcopy_window(run, commit_end, last_err).await;
    }
    Stop::Committed(last_err)
}

/// Post-copy, after the Commit: the process runs on the destination while
/// its pages follow. The stopped copy here and CRIU's page server stay
/// until the destination reports its lazy-pages daemon's end; then the
/// copy goes. A failed daemon means the destination killed the process:
/// the migration is lost (nothing can bring back what it did since its
/// resume), and the report says so.
async fn postcopy_window(run: &mut Run, resumed: Instant, commit_err: Option<EngineError>) -> Stop {
    use ferry_proto::v1::{PostCopyState, PostCopyStatusRequest};
    run.phase("post-copy").await;
    let pid = run.p.pid;
    let deadline = Duration::from_secs(run.engine.config.peer_timeout_secs);
    let mut silent_since: Option<Instant> = None;
    let verdict = loop {
        let ask = run.p.peer.post_copy_status(PostCopyStatusRequest {
            migration_id: run.p.migration_id.clone(),
            wait_ms: 2000,
        });
        let why = match tokio::time::timeout(deadline + Duration::from_secs(2), ask).await {
            Ok(Ok(r)) => {
                let r = r.into_inner();
                match PostCopyState::try_from(r.state) {
                    Ok(PostCopyState::Running) => {
                        silent_since = None;
                        continue;
                    }
                    Ok(PostCopyState::Done | PostCopyState::Failed) => break Ok(r),
                    _ => format!("post-copy state {} unknown", r.state),
                }
            }
            Ok(Err(s)) => s.message().to_owned(),
            Err(_) => format!("no answer within {} s", deadline.as_secs() + 2),
        };
        // No word from the destination. While the page server is still
        // connected the daemon may still need it: keep it. Once it is not,
        // the daemon has ended one way or the other; wait a little for the
        // destination to say which.
        let serving = run
            .page_server
            .as_ref()
            .is_some_and(|s| !s.task.is_finished());
        if !serving {
            let since = *silent_since.get_or_insert_with(Instant::now);
            if since.elapsed() > POSTCOPY_UNCONFIRMED {
                break Err(why);
            }
        }
        tracing::warn!(reason = %why, serving, "post-copy status unknown; asking again");
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    let page = crate::memtrack::page_size();
    let stop = match verdict {
        Ok(r) if r.state == PostCopyState::Done as i32 => {
            stop_page_server(run, Duration::from_secs(10)).await;
            run.report.postcopy_pages = r.pages;
            run.report.postcopy_local_pages = r.local_pages;
            run.report.postcopy_faults = r.faults;
            run.report.postcopy_fault_wait_us = r.fault_wait_us;
            run.report.bytes_transferred += r.pages.saturating_sub(r.local_pages) * page;
            run.report.post_processing_time_us = r.post_processing_us;
            tracing::info!(
                pages = r.pages,
                of = r.total_pages,
                post_ms = r.post_processing_us as f64 / 1000.0,
                "every page is on the destination"
            );
            Stop::Committed(commit_err)
        }
        Ok(r) => {
            stop_page_server(run, Duration::ZERO).await;
            run.report.postcopy_pages = r.pages;
            run.report.postcopy_local_pages = r.local_pages;
            run.report.postcopy_faults = r.faults;
            run.report.postcopy_fault_wait_us = r.fault_wait_us;
            run.report.bytes_transferred += r.pages.saturating_sub(r.local_pages) * page;
            run.report.post_processing_time_us = resumed.elapsed().as_micros() as u64;
            Stop::Lost(EngineError::Peer {
                node: run.p.destination.name.clone(),
                code: tonic::Code::DataLoss,
                message: format!("post-copy failed after the resume: {}", r.error),
            })
        }
        Err(why) => {
            stop_page_server(run, Duration::from_secs(1)).await;
            run.report.post_processing_time_us = resumed.elapsed().as_micros() as u64;
            Stop::Committed(Some(EngineError::Internal(format!(
                "post-copy: {} never confirmed that every page arrived ({why}); the source's copy was discarded once its page server had no connection for {} s",
                run.p.destination.name,
                POSTCOPY_UNCONFIRMED.as_secs()
            ))))
        }
    };
    run.phase("discard").await;
    discard_source_copy(&run.engine, pid).await;
    stop
}

/// Ends a post-copy dump's page server. `grace`: how long it may take to
/// end by itself (the daemon's close ends it); then, or at once with a
/// zero grace, CRIU is killed, the process kept stopped (SIGSTOP, pending
/// while CRIU holds it, takes effect when CRIU lets go).
async fn stop_page_server(run: &mut Run, grace: Duration) {
    let Some(server) = run.page_server.take() else {
        return;
    };
    end_page_server_criu(run.p.pid, server.task, &server.criu_pid, grace).await;
    // CRIU's end of the tunnel is closed now; the pump passes that on and
    // ends. A tunnel the destination holds open is cut.
    if let Some(mut tunnel) = server.tunnel {
        match tokio::time::timeout(Duration::from_secs(2), &mut tunnel).await {
            Ok(Ok(Ok(moved))) => {
                tracing::info!(out = moved.out, into = moved.into, "page tunnel closed")
            }
            Ok(Ok(Err(e))) => tracing::info!(error = %e, "page tunnel ended"),
            Ok(Err(e)) => tracing::warn!(error = %e, "page tunnel task"),
            Err(_) => {
                tunnel.abort();
                tracing::warn!("page tunnel still open 2 s after the page server ended; cut");
            }
        }
    }
}

async fn end_page_server_criu(
    pid: i32,
    mut task: tokio::task::JoinHandle<Result<Dumped, criu::CriuError>>,
    criu_pid: &std::sync::atomic::AtomicI32,
    grace: Duration,
) {
    let log = |r: Result<Result<Dumped, criu::CriuError>, tokio::task::JoinError>| match r {
        Ok(Ok(_)) => tracing::info!("CRIU's page server ended"),
        Ok(Err(e)) => tracing::info!(error = %e, "CRIU's page server ended"),
        Err(e) => tracing::warn!(error = %e, "CRIU's page server task"),
    };
    if !grace.is_zero() {
        if let Ok(r) = tokio::time::timeout(grace, &mut task).await {
            log(r);
            return;
        }
        tracing::warn!("CRIU's page server still runs; killing it");
    }
    for p in process::process_tree(pid) {
        let _ = kill(Pid::from_raw(p), Signal::SIGSTOP);
    }
    let criu = criu_pid.load(std::sync::atomic::Ordering::SeqCst);
    if criu > 0
        && let Err(e) = kill(Pid::from_raw(criu), Signal::SIGKILL)
    {
        tracing::warn!(pid = criu, error = %e, "killing CRIU's page server");
    }
    match tokio::time::timeout(Duration::from_secs(10), task).await {
        Ok(r) => log(r),
        Err(_) => tracing::error!("CRIU's page server did not end 10 s after SIGKILL"),
    }
}

fn out_stage(migration_id: &str, stage: OutStage) -> Lifecycle {
    Lifecycle::MigratingOut {
        migration_id: migration_id.to_owned(),
        stage,
    }
}

/// Has the node of each in-cluster peer translate its flows; records what
/// was done in `run.translated` for an abort to undo.
async fn translate_in_cluster(
    run: &mut Run,
    flows: Vec<ferry_proto::v1::InClusterFlow>,
    deadline: Duration,
) -> Result<(), EngineError> {
    let mut by_node: Vec<(String, Vec<ferry_proto::v1::InClusterFlow>)> = Vec::new();
    for f in flows {
        let flow = crate::dataplane::translation::InClusterFlow::from_pb(&f)?;
        let ip = *flow.remote.ip();
        let node = if ip == run.engine.config.cluster.address {
            run.engine.node().to_owned()
        } else {
            match run.engine.cluster.peer_at(ip) {
                Some(p) => p.name.clone(),
                None => {
                    return Err(EngineError::Internal(format!(
                        "the destination reported a peer at {ip}, which is no node of this cluster"
                    )));
                }
            }
        };
        match by_node.iter_mut().find(|(n, _)| *n == node) {
            Some((_, v)) => v.push(f),
            None => by_node.push((node, vec![f])),
        }
    }
    for (node, flows) in by_node {
        let req = TranslationsRequest {
            migration_id: run.p.migration_id.clone(),
            flows: flows.clone(),
        };
        // Recorded first: a call that times out may still have landed.
        run.translated.push((node.clone(), flows));
        if node == run.engine.node() {
            let engine = run.engine.clone();
            super::blocking("adding translations", move || {
                engine.dataplane.add_translations(engine.here(), &req)
            })
            .await??;
            continue;
        }
        let peer = run
            .engine
            .cluster
            .peer(&node)
            .ok_or_else(|| EngineError::Internal(format!("no peer config for {node}")))?;
        let mut client = peer_link(run, &peer).await?;
        match tokio::time::timeout(deadline, client.add_translations(req)).await {
            Ok(Ok(r)) => {
                tracing::info!(node = %node, rules = r.into_inner().rules, "in-cluster peers translate")
            }
            Ok(Err(s)) => return Err(peer_error(&node, s)),
            Err(_) => return Err(silent(&peer, "adding translations", deadline)),
        }
    }
    Ok(())
}

/// A peer connection being opened.
type PeerLink = tokio::task::JoinHandle<Result<PeerClient<Channel>, EngineError>>;

/// Starts connecting to every other node of the cluster that the process
/// has a TCP connection to (`tcp_peers`): those are the nodes an in-cluster
/// translation may go to. Not to `destination`, which the migration's own
/// connection reaches.
fn open_peer_links(
    engine: &Arc<Engine>,
    tcp_peers: &std::collections::BTreeSet<std::net::Ipv4Addr>,
    destination: &str,
) -> Vec<(String, PeerLink)> {
    tcp_peers
        .iter()
        .filter(|ip| **ip != engine.config.cluster.address)
        .filter_map(|ip| engine.cluster.peer_at(*ip))
        .filter(|peer| peer.name != destination)
        .map(|peer| {
            let engine = engine.clone();
            let name = peer.name.clone();
            (
                name,
                tokio::spawn(async move { Ok(engine.cluster.peer_client(&peer).await?) }),
            )
        })
        .collect()
}

/// The connection to `peer` opened before the freeze (the migration's own
/// for the destination), or a new one (none was opened, or it failed:
/// connecting again gives the error now).
async fn peer_link(run: &mut Run, peer: &PeerConfig) -> Result<PeerClient<Channel>, EngineError> {
    if peer.name == run.p.destination.name {
        return Ok(run.p.peer.clone());
    }
    if let Some(i) = run.peer_links.iter().position(|(n, _)| *n == peer.name) {
        let (_, link) = run.peer_links.swap_remove(i);
        match link.await {
            Ok(Ok(client)) => return Ok(client),
            Ok(Err(e)) => {
                tracing::debug!(node = %peer.name, error = %e, "peer connection opened before the freeze failed; connecting again")
            }
            Err(e) => {
                tracing::debug!(node = %peer.name, error = %e, "peer connection task failed; connecting again")
            }
        }
    }
    Ok(run.engine.cluster.peer_client(peer).await?)
}

/// Undoes [`translate_in_cluster`] (an abort): best effort, logged.
async fn untranslate_in_cluster(run: &mut Run) {
    for (node, flows) in std::mem::take(&mut run.translated) {
        let req = TranslationsRequest {
            migration_id: run.p.migration_id.clone(),
            flows,
        };
        let result = if node == run.engine.node() {
            let engine = run.engine.clone();
            super::blocking("removing translations", move || {
                engine.dataplane.remove_translations(engine.here(), &req)
            })
            .await
            .and_then(|r| r.map_err(EngineError::from))
            .map(|_| ())
        } else {
            match run.engine.cluster.peer(&node) {
                Some(peer) => match run.engine.cluster.peer_client(&peer).await {
                    Ok(mut c) => c
                        .remove_translations(req)
                        .await
                        .map(|_| ())
                        .map_err(|s| peer_error(&node, s)),
                    Err(e) => Err(e.into()),
                },
                None => Err(EngineError::Internal(format!("no peer config for {node}"))),
            }
        };
        if let Err(e) = result {
            tracing::error!(node = %node, error = %e, "removing the translations of an aborted migration");
        }
    }
}

/// Kills the stopped source copy and forgets it (its ports, released
/// before the Commit, stay released). Waiting for it to die is left to
/// the end of the migration.
async fn discard_source_copy(engine: &Arc<Engine>, pid: i32) {
    // The root is the init of its PID namespace: killing it takes the whole
    // tree with it.
    if let Err(e) = kill(Pid::from_raw(pid), Signal::SIGKILL) {
        tracing::warn!(pid, error = %e, "killing the source copy");
    }
    engine.processes.depart(pid);
    if let Err(e) = engine.ports.apply().await {
        tracing::error!(error = %e, "releasing the ports of the migrated process");
    }
}

async fn finish(run: &mut Run, stop: Stop) {
    match stop {
        Stop::Committed(err) => {
            // The source copy was killed once the destination answered
            // the Commit; by the time the report says "committed" it is
            // dead (a zombie at most, its sockets closed), and this node
            // no longer remembers it.
            super::wait_dead(run.p.pid).await;
            run.engine.processes.persist_soon();
            run.report.outcome = MigrationOutcome::Committed as i32;
            if let Some(e) = err {
                run.report.error = format!(
                    "the process moved, but {} did not confirm it resumed it: {e}",
                    run.p.destination.name
                );
            }
        }
        Stop::Lost(err) => {
            tracing::error!(error = %err, "post-copy failed after the resume: the process is lost");
            super::wait_dead(run.p.pid).await;
            run.engine.processes.persist_soon();
            run.report.outcome = MigrationOutcome::Lost as i32;
            run.report.error = err.to_string();
        }
        Stop::BeforeCommit(err) => {
            tracing::warn!(error = %err, "migration failed; rolling back");
            run.phase("abort").await;
            run.report.outcome = MigrationOutcome::Aborted as i32;
            run.report.error = err.to_string();
            // Resume first: the destination may be the part that failed, and
            // it runs nothing of this migration without a Commit.
            let pid = run.p.pid;
            let id = run.p.migration_id.clone();
            if let Err(e) = run.finish_drain().await {
                tracing::error!(error = %e, "draining the capture ring");
            }
            // Post-copy: CRIU's page server holds the process; it goes
            // first (the destination's copy never ran: nothing needs it).
            stop_page_server(run, Duration::ZERO).await;
            // The in-cluster peers' packets must come here again before
            // the process runs.
            untranslate_in_cluster(run).await;
            // No write protection may outlive the migration.
            if let Some(pre) = run.precopy.take()
                && let Err(e) = tokio::task::spawn_blocking(move || pre.stop()).await
            {
                tracing::error!(error = %e, "ending dirty-page tracking");
            }
            // Connections read for a collective migration leave repair
            // mode, with their own SO_REUSEADDR, before the process runs
            // (resume_on_source would clear any left, without that).
            if let Some(held) = run.held.take()
                && let Err(e) = held.resume()
            {
                tracing::error!(error = %e, "taking the process's connections out of repair mode");
            }
            let resumed = if run.capturing_here {
                // Egress opens, ingress is still kept; the process runs and
                // gets what arrived while it was frozen, in order, before
                // its ports pass packets again.
                run.engine
                    .processes
                    .set_lifecycle(pid, out_stage(&id, OutStage::Resuming));
                if let Err(e) = run.engine.ports.apply().await {
                    tracing::error!(error = %e, "opening the ports of the resumed process");
                }
                let engine = run.engine.clone();
                let r = tokio::task::spawn_blocking(move || {
                    let resumed = rollback::resume_on_source(pid);
                    let replay = engine.dataplane.replay_and_open(&id, &[], &[], &[], || {
                        engine.processes.set_lifecycle(pid, Lifecycle::Running);
                        engine.ports.apply_now()
                    });
                    (resumed, replay)
                })
                .await;
                match r {
                    Ok((resumed, replay)) => {
                        match replay {
                            Ok(stats) => run.report.replay = Some(stats),
                            Err(e) => {
                                tracing::error!(error = %e, "replaying on the source")
                            }
                        }
                        Ok(resumed)
                    }
                    Err(e) => Err(e),
                }
            } else {
                tokio::task::spawn_blocking(move || rollback::resume_on_source(pid)).await
            };
            // Whatever happened above, the process is ours and running.
            run.engine.processes.set_lifecycle(pid, Lifecycle::Running);
            if let Err(e) = run.engine.ports.apply().await {
                tracing::error!(error = %e, "thawing the ports of the resumed process");
            }
            run.engine.dataplane.capture.close(&run.p.migration_id);
            // The process was out of service from the freeze until now.
            if let Some(t) = run.freeze_start {
                run.report.freeze_time_us = t.elapsed().as_micros() as u64;
            }
            match resumed {
                Ok(Ok(())) => run.report.resumed_on_source = true,
                Ok(Err(e)) => {
                    tracing::error!(error = %e, "could not resume the process on the source");
                    run.report
                        .error
                        .push_str(&format!("; resuming on the source failed: {e}"));
                }
                Err(e) => run.report.error.push_str(&format!("; resume task: {e}")),
            }
            // A socket transfer still in flight ends first: the abort must
            // find the rebuilt copies there, to close them.
            if let Some(task) = run.sockets_sending.take()
                && let Ok(Err(e)) = task.await
            {
                tracing::debug!(error = %e, "the socket transfer ended with the migration");
            }
            let abort = AbortRequest {
                migration_id: run.p.migration_id.clone(),
                reason: err.to_string(),
            };
            let deadline = Duration::from_secs(run.engine.config.peer_timeout_secs);
            let first = tokio::time::timeout(deadline, run.p.peer.abort(abort.clone())).await;
            if !matches!(first, Ok(Ok(_))) {
                // The destination must hear it eventually, or it keeps the
                // images and the ports frozen: keep telling it, in the
                // background, without holding up the report.
                tracing::warn!(
                    ?first,
                    "destination did not acknowledge the abort; retrying in the background"
                );
                let mut peer = run.p.peer.clone();
                tokio::spawn(async move {
                    for attempt in 1..=ABORT_RETRIES {
                        tokio::time::sleep(Duration::from_secs(1)).await;
                        match tokio::time::timeout(deadline, peer.abort(abort.clone())).await {
                            Ok(Ok(_)) => {
                                tracing::info!(attempt, migration = %abort.migration_id, "abort acknowledged");
                                return;
                            }
                            other => tracing::debug!(attempt, ?other, "abort not acknowledged yet"),
                        }
                    }
                    tracing::error!(migration = %abort.migration_id, "destination never acknowledged the abort");
                });
            }
        }
    }
}

/// Whether ferryd reads and carries the connections' socket options
/// (collective, the destination takes them, and this node's CRIU leaves
/// them out). The pre-read and the dump must agree on it.
fn options_by_ferryd(collective: bool, destination_takes: bool, criu: &std::path::Path) -> bool {
    collective && destination_takes && criu::has_patch(criu, criu::OPTS_BY_CALLER_MARK)
}

/// Attaches the setsockopt watch to the cgroups of `pid`'s tree, then
/// reads its connections (in that order: a call racing with the read is
/// seen). Blocking. The error says why incremental mode cannot be used.
fn preread(pid: i32, with_options: bool) -> Result<Incremental, String> {
    let started = Instant::now();
    let tree = process::process_tree(pid);
    let cgroups = tree
        .iter()
        .map(|&p| ferry_ebpf::cgroup_v2_dir(p).map_err(|e| format!("process {p}'s cgroup v2: {e}")))
        .collect::<Result<Vec<_>, _>>()?;
    let mut watch = ferry_ebpf::SockoptWatch::attach(&cgroups)
        .map_err(|e| format!("attaching the setsockopt watch: {e}"))?;
    let watched = started.elapsed();
    let mut preread = sockstate::Preread::of_tree(&tree, with_options)
        .map_err(|e| format!("reading the connections: {e}"))?;
    let read = started.elapsed();
    // Enough connections: the freeze then reads them in one pass of the
    // TCP state iterator; a kernel without it (or without BTF) reads each
    // by its calls.
    if let Err(e) = preread.with_state_reader() {
        tracing::warn!(error = %e, "no TCP state iterator: each connection is read by its calls in the freeze");
    }
    tracing::debug!(
        watch_ms = watched.as_secs_f64() * 1000.0,
        read_ms = (read - watched).as_secs_f64() * 1000.0,
        state_reader_ms = (started.elapsed() - read).as_secs_f64() * 1000.0,
        "pre-read steps"
    );
    // Calls elsewhere on the node cost no map update from here on.
    if let Some(netns) = preread.only_netns() {
        watch
            .only_netns(netns)
            .map_err(|e| format!("narrowing the setsockopt watch: {e}"))?;
    }
    Ok(Incremental {
        preread,
        watch: std::sync::Mutex::new(Some(watch)),
    })
}

/// Images and logs hold process memory: root only.
pub fn set_private(dir: &std::path::Path) {
    use std::os::unix::fs::PermissionsExt;
    if let Err(e) = std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)) {
        tracing::warn!(dir = %dir.display(), error = %e, "restricting permissions");
    }
}
