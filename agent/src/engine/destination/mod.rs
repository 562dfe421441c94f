//! The destination side of a migration, behind `Peer`.
//!
//! States of the one incoming slot:
//! `Reserved` (Prepare; Arm keeps it there and starts the capture) ─>
//! `Received` (TransferImages) ─> `Restored` (Restore: process rebuilt,
//! stopped) ─> gone (Commit: process resumed, captured packets replayed,
//! managed here; or Abort: every trace removed). Post-copy: Restore starts
//! CRIU's lazy-pages daemon first; Commit hands it to a watcher which kills
//! the process if the daemon fails, and answers `PostCopyStatus`.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_proto::v1::{
    self as pb, AbortRequest, ArmRequest, CommitRequest, CommitResponse, ImageChunk,
    PrepareRequest, PrepareResponse, RestoreRequest, RestoreResponse, TransferImagesResponse,
};
use futures::StreamExt;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use std::collections::HashMap;

use crate::criu;
use crate::dataplane::PortState;
use crate::dataplane::translation::{self, InClusterFlow};
use crate::engine::Engine;
use crate::managed::{Lifecycle, ManagedProcess, Origin};
use crate::memtrack::RangeSet;
use crate::process::{self, PortKey, SocketSummary, Transport};
use crate::sockstate::Handover;
use crate::sockstate::packed::FixedParts;

mod slot;

pub use slot::IncomingSlot;

use super::localpages::LocalPages;
use super::pagestore::PageStore;
use super::{EngineError, images::ImageWriter, set_private};

/// The receive buffer a migrated process's UDP sockets get for the replay
/// and the catch-up after it, and for how long.
const UDP_CATCH_UP_BUFFER: i32 = 8 << 20;
const UDP_CATCH_UP: Duration = Duration::from_secs(2);

/// How long a lazy-pages daemon may take to listen for the restore.
const LAZY_DAEMON_START: Duration = Duration::from_secs(10);

/// How long a finished post-copy's status stays answerable.
const POSTCOPY_STATUS_KEPT: Duration = Duration::from_secs(600);

/// Post-copy migrations committed here, by migration id: the node they
/// came from, and their status, updated once by the watcher of their
/// lazy-pages daemon.
#[derive(Debug, Default)]
pub struct PostCopies(std::sync::Mutex<HashMap<String, PostCopyEntry>>);

type PostCopyEntry = (
    String,
    tokio::sync::watch::Receiver<pb::PostCopyStatusResponse>,
);

impl PostCopies {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, PostCopyEntry>> {
        crate::sync::lock(&self.0)
    }
}

/// The connection a post-copy Restore's lazy-pages daemon gets: the end of
/// the page tunnel the source opened for this migration.
fn lazy_tunnel_end(engine: &Engine, inc: &mut Incoming) -> Result<OwnedFd, EngineError> {
    if inc.protocol_version < ferry_proto::PEER_PROTOCOL_POSTCOPY {
        return Err(EngineError::WrongState {
            migration_id: inc.migration_id.clone(),
            state: "prepared with a protocol without post-copy",
            step: "post-copy restore",
        });
    }
    criu::lazy::check_pipe_max_size()
        .map_err(|e| EngineError::HostSetting(format!("post-copy on {}: {e}", engine.node())))?;
    inc.tunnel
        .as_mut()
        .and_then(|t| t.daemon_end.take())
        .ok_or_else(|| EngineError::WrongState {
            migration_id: inc.migration_id.clone(),
            state: "without an open page tunnel",
            step: "post-copy restore",
        })
}

/// Assisted post-copy: the pages Restore says this node holds current,
/// answered from the store from now on. Each must be in the store.
fn set_local_pages(inc: &mut Incoming, req: &RestoreRequest) -> Result<(), EngineError> {
    let bad = |reason: String| EngineError::InvalidField {
        field: "local_pages",
        reason,
    };
    if !req.lazy_pages {
        return Err(bad(
            "only a lazy (post-copy) restore answers pages itself".into()
        ));
    }
    let Some(tunnel) = inc.tunnel.as_ref() else {
        return Err(EngineError::WrongState {
            migration_id: inc.migration_id.clone(),
            state: "without an open page tunnel",
            step: "post-copy restore",
        });
    };
    let mut held: HashMap<u32, RangeSet> = HashMap::new();
    {
        let store = crate::sync::lock(&inc.pages);
        for (i, p) in req.local_pages.iter().enumerate() {
            if p.length == 0 {
                return Err(bad(format!("[{i}]: an empty range")));
            }
            if let Some(addr) = store.first_missing(p) {
                return Err(bad(format!(
                    "[{i}]: page {addr:#x} of pid {} was never pre-copied here",
                    p.pid
                )));
            }
            held.entry(p.pid)
                .or_default()
                .insert(p.vaddr, p.vaddr + p.length);
        }
    }
    let pages: u64 = held.values().map(RangeSet::len).sum::<u64>() / crate::memtrack::page_size();
    tunnel
        .local
        .set(LocalPages {
            held,
            store: inc.pages.clone(),
        })
        .map_err(|_| bad("already set for this migration".into()))?;
    tracing::info!(migration = %inc.migration_id, pages, "pages of the live pass answered here");
    Ok(())
}

/// A post-copy's page tunnel on the destination: the pump between the
/// tunnel and a loopback connection, whose other end waits here for the
/// lazy-pages daemon.
#[derive(Debug)]
struct IncomingTunnel {
    daemon_end: Option<OwnedFd>,
    pump: tokio::task::AbortHandle,
    /// Assisted post-copy: the pages answered here (set by Restore).
    local: Arc<std::sync::OnceLock<LocalPages>>,
    /// Pages answered from the store so far.
    served_locally: Arc<std::sync::atomic::AtomicU64>,
}

/// The stream a PageTunnel answers with: the daemon's bytes.
pub type TunnelOut = tokio_stream::wrappers::ReceiverStream<Result<pb::TunnelBytes, tonic::Status>>;

/// `Peer.PageTunnel`: the source's page server, carried in the peer
/// connection. Opened once per post-copy migration, by the node that
/// prepared it, before Restore; the daemon that Restore starts gets the
/// loopback end. `caller`: the node the peer's certificate names (`None`
/// without TLS).
pub async fn page_tunnel(
    engine: &Arc<Engine>,
    caller: Option<String>,
    mut stream: tonic::Streaming<pb::TunnelBytes>,
) -> Result<TunnelOut, EngineError> {
    let first = stream
        .next()
        .await
        .ok_or_else(|| EngineError::InvalidField {
            field: "migration_id",
            reason: "the page tunnel ended before its first message".into(),
        })?
        .map_err(|s| EngineError::BadImage(format!("page tunnel broke: {}", s.message())))?;
    let mut slot = engine.incoming.lock().await;
    let inc = expect(
        &mut slot,
        &first.migration_id,
        &["reserved", "received"],
        "page tunnel",
    )?;
    check_source(inc, caller.as_deref())?;
    if inc.protocol_version < ferry_proto::PEER_PROTOCOL_POSTCOPY {
        return Err(EngineError::WrongState {
            migration_id: inc.migration_id.clone(),
            state: "prepared with a protocol without post-copy",
            step: "page tunnel",
        });
    }
    if inc.tunnel.is_some() {
        return Err(EngineError::WrongState {
            migration_id: inc.migration_id.clone(),
            state: "already tunnelling pages",
            step: "page tunnel",
        });
    }
    let pair = super::pagetunnel::loopback_pair().await?;
    let (tx, rx) = tokio::sync::mpsc::channel(super::pagetunnel::DEPTH);
    if !first.data.is_empty() {
        return Err(EngineError::InvalidField {
            field: "data",
            reason: "the page tunnel's first message only names the migration".into(),
        });
    }
    let id = inc.migration_id.clone();
    let local = Arc::new(std::sync::OnceLock::new());
    let served_locally = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let pump = tokio::spawn({
        let (local, counter) = (local.clone(), served_locally.clone());
        async move {
            match super::localpages::serve(pair.ours, stream, tx, local, counter).await {
                Ok(served) => {
                    tracing::info!(
                        migration = %id,
                        local_pages = served.local_pages,
                        local_requests = served.local_requests,
                        remote_pages = served.remote_pages,
                        remote_requests = served.remote_requests,
                        "page tunnel closed"
                    )
                }
                Err(e) => tracing::warn!(migration = %id, error = %e, "page tunnel ended"),
            }
        }
    });
    inc.tunnel = Some(IncomingTunnel {
        daemon_end: Some(pair.criu),
        pump: pump.abort_handle(),
        local,
        served_locally,
    });
    Ok(tokio_stream::wrappers::ReceiverStream::new(rx))
}

/// A streamed request about an incoming migration must come from the node
/// that prepared it (unary ones are checked in `api/peer.rs`).
fn check_source(inc: &Incoming, caller: Option<&str>) -> Result<(), EngineError> {
    match caller {
        Some(node) if node != inc.from => Err(EngineError::NotItsSource {
            migration_id: inc.migration_id.clone(),
            from: inc.from.clone(),
            caller: node.to_owned(),
        }),
        _ => Ok(()),
    }
}

/// A committed post-copy, handed from Commit to its watcher.
struct PostCopyWatch {
    migration_id: String,
    /// The node the migration came from (the only one that may ask).
    from: String,
    /// The restored process, running.
    pid: i32,
    daemon: criu::lazy::Daemon,
    /// The migration's directory, removed when the daemon ends.
    dir: PathBuf,
    resumed_at: Instant,
    done_before_resume: bool,
    /// Assisted post-copy: pages answered from the store.
    served_locally: Arc<std::sync::atomic::AtomicU64>,
}

/// Watches a committed post-copy's lazy-pages daemon: exit 0 means every
/// page is in; anything else means the running process would read zeros
/// where its missing pages are, so it is killed at once. Either way the
/// status is published for `PostCopyStatus` and the images go.
fn watch_postcopy(engine: &Arc<Engine>, watched: PostCopyWatch) {
    let PostCopyWatch {
        migration_id,
        from,
        pid,
        mut daemon,
        dir,
        resumed_at,
        done_before_resume,
        served_locally,
    } = watched;
    let (tx, rx) = tokio::sync::watch::channel(pb::PostCopyStatusResponse {
        state: pb::PostCopyState::Running as i32,
        ..Default::default()
    });
    engine
        .incoming
        .postcopies
        .lock()
        .insert(migration_id.clone(), (from, rx));
    let engine = engine.clone();
    tokio::spawn(async move {
        let status = daemon.child.wait().await;
        let ended = Instant::now();
        let log = daemon.work_dir.join(criu::lazy::LOG);
        // The faults that count are the resumed process's, not the
        // restorer's.
        let since_resume = resumed_at
            .saturating_duration_since(daemon.started)
            .as_secs_f64();
        let ((pages, total_pages), delay) = {
            let log = log.clone();
            tokio::task::spawn_blocking(move || {
                (
                    criu::lazy::transferred_pages(&log),
                    criu::lazy::fault_delay(&log, since_resume),
                )
            })
            .await
            .unwrap_or_default()
        };
        let answer = match status {
            Ok(s) if s.success() => {
                let post = if done_before_resume {
                    Duration::ZERO
                } else {
                    ended.saturating_duration_since(resumed_at)
                };
                tracing::info!(migration = %migration_id, pid, pages, total_pages, post_ms = post.as_secs_f64() * 1000.0, "post-copy done: every page is here");
                pb::PostCopyStatusResponse {
                    state: pb::PostCopyState::Done as i32,
                    pages,
                    total_pages,
                    post_processing_us: post.as_micros() as u64,
                    error: String::new(),
                    local_pages: served_locally.load(std::sync::atomic::Ordering::Relaxed),
                    faults: delay.faults,
                    fault_wait_us: delay.waited_us,
                }
            }
            other => {
                if let Err(e) = kill(Pid::from_raw(pid), Signal::SIGKILL)
                    && e != nix::errno::Errno::ESRCH
                {
                    tracing::error!(pid, error = %e, "killing a process whose pages are lost");
                }
                let how = match other {
                    Ok(s) => s.to_string(),
                    Err(e) => format!("could not be waited for ({e})"),
                };
                // The daemon logs its counts only for tasks it finished.
                let counted = if total_pages > 0 {
                    format!(" with {pages} of {total_pages} pages in")
                } else {
                    String::new()
                };
                let error = format!(
                    "CRIU's lazy-pages daemon ended ({how}){counted}; the process (PID {pid}) was killed here: {}",
                    criu::lazy::log_tail(&log)
                );
                tracing::error!(migration = %migration_id, %error, "post-copy failed after the resume");
                super::keep_logs(&engine.config.work_dir, &dir, &migration_id);
                pb::PostCopyStatusResponse {
                    state: pb::PostCopyState::Failed as i32,
                    pages,
                    total_pages,
                    post_processing_us: ended.saturating_duration_since(resumed_at).as_micros()
                        as u64,
                    error,
                    local_pages: served_locally.load(std::sync::atomic::Ordering::Relaxed),
                    faults: delay.faults,
                    fault_wait_us: delay.waited_us,
                }
            }
        };
        let removed = tokio::task::spawn_blocking(move || std::fs::remove_dir_all(&dir)).await;
        if let Ok(Err(e)) = removed {
            tracing::warn!(error = %e, "removing a post-copy's images");
        }
        let _ = tx.send(answer);
        tokio::time::sleep(POSTCOPY_STATUS_KEPT).await;
        engine.incoming.postcopies.lock().remove(&migration_id);
    });
}

/// `Peer.PostCopyStatus`: how a committed post-copy's pages are doing;
/// waits up to `wait_ms` for its end.
/// Only the node the migration came from may ask (`caller`: the node its
/// certificate names, `None` without TLS).
pub async fn post_copy_status(
    engine: &Arc<Engine>,
    caller: Option<String>,
    req: pb::PostCopyStatusRequest,
) -> Result<pb::PostCopyStatusResponse, EngineError> {
    let Some((from, mut rx)) = engine
        .incoming
        .postcopies
        .lock()
        .get(&req.migration_id)
        .cloned()
    else {
        return Err(EngineError::UnknownMigration {
            migration_id: req.migration_id,
        });
    };
    if let Some(node) = caller
        && node != from
    {
        return Err(EngineError::NotItsSource {
            migration_id: req.migration_id,
            from,
            caller: node,
        });
    }
    let wait = Duration::from_millis(u64::from(req.wait_ms.min(10_000)));
    let running = rx.borrow().state == pb::PostCopyState::Running as i32;
    if running {
        let _ = tokio::time::timeout(wait, rx.changed()).await;
    }
    let answer = rx.borrow().clone();
    Ok(answer)
}

/// A reservation left without news this long is taken to be abandoned by a
/// source that died, and a new Prepare may replace it.
const STALE_RESERVATION: Duration = Duration::from_secs(120);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IncomingState {
    Reserved,
    Received,
    Restored { pid: i32 },
}

impl IncomingState {
    fn name(&self) -> &'static str {
        match self {
            IncomingState::Reserved => "reserved",
            IncomingState::Received => "received",
            IncomingState::Restored { .. } => "restored",
        }
    }
}

#[derive(Debug)]
pub struct Incoming {
    pub migration_id: String,
    pub from: String,
    pub protocol_version: u32,
    pub argv: Vec<String>,
    pub ports: Vec<PortKey>,
    /// Whether Arm started a capture for the ports.
    armed: bool,
    /// In-cluster connections found in the images, and held here (nothing
    /// in or out) from before the restore to Commit or abort.
    in_cluster: Vec<InClusterFlow>,
    /// Set (under its lock) when the slot is discarded: the image writer
    /// checks it, under the same lock, before each write. A transfer whose
    /// handler was dropped (the source cancelled the stream) leaves its
    /// writer thread draining what it had; it must not write into a
    /// directory being removed.
    discarded: Arc<std::sync::Mutex<bool>>,
    /// Collective socket migration, from a successful Restore to the
    /// commit: the connections ferryd rebuilt, leaving repair mode on a
    /// thread of their own (`Rebuilt::leave_repair_early`); the commit
    /// takes them back and turns the rest out. Dropped unjoined (an
    /// abort), the thread ends and drops them, which closes them silently.
    leaving: Option<std::thread::JoinHandle<crate::sockstate::Rebuilt>>,
    /// The CRIU that will restore, started at Prepare with the connection
    /// table (still empty) inherited, so that its start is not in the
    /// freeze. Dropped unused, it exits.
    restore_worker: Option<RestoreWorker>,
    /// perf's scheduler hooks, held from Prepare until the slot ends, so
    /// that the restore's breakpoints do not wait for a grace period.
    _sched_hooks: Option<criu::SchedHooks>,
    /// Incremental (protocol 7): the connections' sockets opened at Arm,
    /// until TransferSockets takes them; they close with the slot. The
    /// `IncomingSlot` points TransferSockets here without keeping them.
    staged: Arc<StagedSlot>,
    /// The UDP sockets whose receive buffer the images were given for the
    /// replay and catch-up (`UDP_CATCH_UP_BUFFER`), with their own size,
    /// given back `UDP_CATCH_UP` after the resume. `None` until the restore
    /// raised them (once: a raised image has nothing left to raise).
    udp_buffers: Option<Vec<(std::net::SocketAddr, i32)>>,
    /// Pre-copy (protocol 5): the pages received while the process still
    /// ran on the source.
    pages: Arc<std::sync::Mutex<PageStore>>,
    /// Post-copy (protocol 6): CRIU's lazy-pages daemon, from just before
    /// the restore until Commit hands it to a watcher (or an abort kills
    /// it).
    lazy: Option<criu::lazy::Daemon>,
    /// Post-copy: the page tunnel, from PageTunnel until the daemon's end
    /// (the pump outlives the slot after Commit) or an abort.
    tunnel: Option<IncomingTunnel>,
    dir: PathBuf,
    state: IncomingState,
    last_activity: Instant,
}

impl Incoming {
    fn images(&self) -> PathBuf {
        self.dir.join("images")
    }
}

/// Removes a slot's traces: a restored copy (killed; it never ran) and the
/// image directory, then releases the reserved ports. The ports stay frozen
/// until the copy is dead, so its closing sockets cannot reach the peers.
async fn discard(engine: &Arc<Engine>, incoming: &Incoming) {
    // Post-copy: the daemon goes with the copy it fed (dropping the slot
    // reaps it).
    if let Some(d) = &incoming.lazy
        && d.pid > 0
        && let Err(e) = kill(Pid::from_raw(d.pid), Signal::SIGKILL)
        && e != nix::errno::Errno::ESRCH
    {
        tracing::warn!(pid = d.pid, error = %e, "killing the lazy-pages daemon");
    }
    if let Some(t) = &incoming.tunnel {
        t.pump.abort();
    }
    if let IncomingState::Restored { pid } = incoming.state {
        if let Err(e) = kill(Pid::from_raw(pid), Signal::SIGKILL) {
            tracing::warn!(pid, error = %e, "killing the restored copy");
        }
        super::wait_dead(pid).await;
    }
    super::keep_logs(
        &engine.config.work_dir,
        &incoming.dir,
        &incoming.migration_id,
    );
    {
        let mut discarded = crate::sync::lock(&incoming.discarded);
        *discarded = true;
        if let Err(e) = std::fs::remove_dir_all(&incoming.dir)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!(dir = %incoming.dir.display(), error = %e, "removing images");
        }
    }
    engine.dataplane.capture.close(&incoming.migration_id);
    release_holds(engine, &incoming.in_cluster).await;
    engine.ports.release(&incoming.ports);
    if let Err(e) = engine.ports.refresh().await {
        tracing::warn!(error = %e, "releasing reserved ports");
    }
}

/// Removes the holds on a migration's in-cluster connections.
async fn release_holds(engine: &Arc<Engine>, flows: &[InClusterFlow]) {
    if flows.is_empty() {
        return;
    }
    let (engine, flows) = (engine.clone(), flows.to_vec());
    let removed = tokio::task::spawn_blocking(move || {
        let mut rules = engine.dataplane.flows();
        for f in &flows {
            if let Err(e) = rules.remove(&f.hold()) {
                tracing::error!(rule = %f.hold(), error = %e, "removing a hold");
            }
        }
    })
    .await;
    if let Err(e) = removed {
        tracing::error!(error = %e, "hold removal task");
    }
}

/// The cluster address of the source node `from`, and those of the other
/// nodes a migrated process's connection may lead to (peers on the source
/// node itself count: that node translates too). One list for the images'
/// rewrite and the rebuilt connections' relocation, which must agree.
fn in_cluster_addresses(
    engine: &Engine,
    from: &str,
) -> Result<(std::net::Ipv4Addr, Vec<std::net::Ipv4Addr>), EngineError> {
    let here = engine.config.cluster.address;
    let peers = engine.cluster.known_peers();
    let source =
        engine
            .cluster
            .cluster_address_of(from)
            .ok_or_else(|| EngineError::UnknownNode {
                name: from.to_owned(),
                known: peers
                    .iter()
                    .map(|p| p.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", "),
            })?;
    let nodes = peers
        .iter()
        .filter_map(|p| engine.cluster.cluster_address_of(&p.name))
        .filter(|ip| *ip != here)
        .collect();
    Ok((source, nodes))
}

/// Finds the process's connections to other cluster nodes in its images,
/// gives them this node's cluster address and holds them (blocking). All
/// holds or none.
fn take_in_cluster(
    engine: &Engine,
    images: &std::path::Path,
    from: &str,
) -> Result<Vec<InClusterFlow>, EngineError> {
    let here = engine.config.cluster.address;
    let (source, nodes) = in_cluster_addresses(engine, from)?;
    let flows = translation::rewrite_in_cluster(images, source, here, &nodes)?;
    hold_in_cluster(engine, flows)
}

/// Holds `flows` until the commit (blocking: BPF map updates). All holds
/// or none.
fn hold_in_cluster(
    engine: &Engine,
    flows: Vec<InClusterFlow>,
) -> Result<Vec<InClusterFlow>, EngineError> {
    let mut rules = engine.dataplane.flows();
    for (i, f) in flows.iter().enumerate() {
        if let Err(e) = rules.add(f.hold()) {
            for done in &flows[..i] {
                let _ = rules.remove(&done.hold());
            }
            return Err(e.into());
        }
        tracing::info!(rule = %f.hold(), "in-cluster connection held until commit");
    }
    Ok(flows)
}

/// Whether the images keep connections out (ferry's connections-out
/// patch: `ferry-conns-<files id>.img` lists their descriptors).
fn images_keep_connections_out(images: &std::path::Path) -> Result<bool, EngineError> {
    let entries = std::fs::read_dir(images)
        .map_err(EngineError::io(format!("listing {}", images.display())))?;
    Ok(entries.flatten().any(|e| {
        e.file_name()
            .to_str()
            .is_some_and(|n| n.starts_with(criu::CONNS_OUT_IMAGE_PREFIX))
    }))
}

/// Reserves this node for the migration. Answers what this node's CRIU
/// restores: images whose connections were dumped without their socket
/// options (`PrepareResponse.takes_tcp_options`), or kept out of them
/// altogether (`takes_connections_out`).
pub async fn prepare(
    engine: &Arc<Engine>,
    req: PrepareRequest,
) -> Result<PrepareResponse, EngineError> {
    if !ferry_proto::PEER_PROTOCOL_VERSIONS.contains(&req.protocol_version) {
        return Err(EngineError::NoCommonVersion {
            node: req.source_node.clone(),
            theirs: vec![req.protocol_version],
            ours: ferry_proto::PEER_PROTOCOL_VERSIONS.to_vec(),
        });
    }
    if req.migration_id.is_empty() || !super::valid_image_name(&req.migration_id) {
        return Err(EngineError::InvalidField {
            field: "migration_id",
            reason: format!("{:?} is not a valid id", req.migration_id),
        });
    }
    let ports = req
        .ports
        .iter()
        .map(PortKey::from_pb)
        .collect::<Result<Vec<_>, _>>()?;
    engine.cordon.refuse_if_on()?;
    let criu_path = engine.config.criu_path.clone();
    let takes = tokio::task::spawn_blocking(move || {
        criu::probe_version(&criu_path).map(|_| {
            let takes_tcp_options = criu::has_patch(&criu_path, criu::OPTS_BY_CALLER_MARK);
            PrepareResponse {
                takes_tcp_options,
                // It builds on the options patch and on the table (the
                // connections it installs come from ferryd's table).
                takes_connections_out: takes_tcp_options
                    && criu::has_patch(&criu_path, criu::TCP_BY_PIDFD_MARK)
                    && criu::has_patch(&criu_path, criu::TCP_TABLE_MARK)
                    && criu::has_patch(&criu_path, criu::CONNS_OUT_MARK),
            }
        })
    })
    .await
    .map_err(|e| EngineError::Internal(e.to_string()))??;

    let mut slot = engine.incoming.lock().await;
    if let Some(cur) = slot.as_ref() {
        let stale = cur.last_activity.elapsed() > STALE_RESERVATION
            && !matches!(cur.state, IncomingState::Restored { .. });
        if !stale {
            return Err(EngineError::DestinationBusy {
                node: engine.node().to_owned(),
                migration_id: cur.migration_id.clone(),
                from: cur.from.clone(),
            });
        }
        tracing::warn!(migration = %cur.migration_id, "dropping an abandoned reservation");
        discard(engine, cur).await;
        *slot = None;
    }
    engine.ports.refuse_owned(&ports, &[])?;
    let dir = engine
        .config
        .work_dir
        .join("incoming")
        .join(&req.migration_id);
    std::fs::create_dir_all(dir.join("images"))
        .map_err(EngineError::io(format!("creating {}", dir.display())))?;
    set_private(&dir);
    // perf's scheduler hooks on for the restore's breakpoints
    // (`criu::SchedHooks`), beside CRIU's start.
    let sched_hooks = tokio::task::spawn_blocking(criu::SchedHooks::hold);
    // The CRIU that will restore, started now, well before the freeze:
    // its fork and exec then neither lengthen the freeze nor crowd the
    // cores just before it.
    let restore_worker = {
        let (criu, images, log_dir) = (
            engine.config.criu_path.clone(),
            dir.join("images"),
            dir.clone(),
        );
        let started =
            tokio::task::spawn_blocking(move || RestoreWorker::start(&criu, &images, &log_dir))
                .await
                .map_err(|e| EngineError::Internal(e.to_string()))?;
        // Without it the restore starts its own CRIU, as before.
        started
            .inspect_err(|e| tracing::warn!(error = %e, "starting CRIU ahead of the restore"))
            .ok()
    };
    let sched_hooks = super::held_sched_hooks(sched_hooks).await;
    engine.ports.reserve(&ports, PortState::Frozen);
    if let Err(e) = engine.ports.refresh().await {
        engine.ports.release(&ports);
        return Err(e.into());
    }
    tracing::info!(migration = %req.migration_id, from = %req.source_node, pid = req.source_pid, "incoming migration reserved");
    engine
        .incoming
        .prepared(&req.migration_id, &req.source_node);
    *slot = Some(Incoming {
        migration_id: req.migration_id,
        from: req.source_node,
        protocol_version: req.protocol_version,
        argv: req.argv,
        ports,
        armed: false,
        in_cluster: Vec::new(),
        discarded: Arc::new(std::sync::Mutex::new(false)),
        leaving: None,
        restore_worker,
        _sched_hooks: sched_hooks,
        staged: Arc::default(),
        udp_buffers: None,
        pages: Arc::new(std::sync::Mutex::new(PageStore::new(&dir.join("precopy")))),
        lazy: None,
        tunnel: None,
        dir,
        state: IncomingState::Reserved,
        last_activity: Instant::now(),
    });
    Ok(takes)
}

/// What Arm left for TransferSockets: the sockets opened ahead, once
/// [`stage`] has opened them, and (protocol 9) the connections' fixed
/// parts, which packed records are joined with.
#[derive(Debug, Default)]
pub struct StagedSlot {
    sockets: std::sync::Mutex<Option<crate::sockstate::Staged>>,
    fixed: std::sync::Mutex<Option<Arc<FixedParts>>>,
}

/// The connections Arm named, checked, and the slot their sockets go to:
/// [`stage`] opens them (the peer API runs it after [`arm`]; the fuzz
/// target, which must not touch the system, does not).
#[derive(Debug)]
pub struct Staging {
    migration_id: String,
    conns: Vec<crate::sockstate::ToStage>,
    into: Arc<StagedSlot>,
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
fn take_staged(engine: &Engine, migration_id: &str) -> Option<crate::sockstate::Staged> {
    let slot = engine.incoming.staged_for(migration_id)?;
    crate::sync::lock(&slot.sockets).take()
}

/// The connections' fixed parts Arm carried for migration `migration_id`.
fn armed_fixed(engine: &Engine, migration_id: &str) -> Option<Arc<FixedParts>> {
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
    let inc = expect(&mut slot, &req.migration_id, &["reserved"], "arm")?;
    engine.ports.refuse_owned(&ports, &inc.ports)?;
    if let Some(source) = engine.cluster.cluster_address_of(&inc.from) {
        conns.retain(|c| c.local.ip() != std::net::IpAddr::V4(source));
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
    Ok(Staging {
        migration_id: inc.migration_id.clone(),
        conns,
        into: inc.staged.clone(),
    })
}

/// A CRIU started ahead of a restore (at Prepare), and the connection table
/// it inherited, empty until the restore writes it.
#[derive(Debug)]
struct RestoreWorker {
    worker: criu::Worker,
    table: OwnedFd,
}

impl RestoreWorker {
    /// Blocking: a fork and an exec.
    fn start(
        criu: &std::path::Path,
        images: &std::path::Path,
        log_dir: &std::path::Path,
    ) -> Result<Self, EngineError> {
        let table = crate::sockstate::empty_connection_table()?;
        let worker = criu::start_restore_worker(criu, images, log_dir, &[table.as_raw_fd()])?;
        Ok(Self { worker, table })
    }
}

fn expect<'a>(
    slot: &'a mut Option<Incoming>,
    migration_id: &str,
    want: &[&'static str],
    step: &'static str,
) -> Result<&'a mut Incoming, EngineError> {
    let Some(inc) = slot.as_mut().filter(|i| i.migration_id == migration_id) else {
        return Err(EngineError::UnknownMigration {
            migration_id: migration_id.to_owned(),
        });
    };
    if !want.contains(&inc.state.name()) {
        return Err(EngineError::WrongState {
            migration_id: migration_id.to_owned(),
            state: inc.state.name(),
            step,
        });
    }
    inc.last_activity = Instant::now();
    Ok(inc)
}

/// The blocking thread writing received images, and the channel feeding it.
type ImageWriterTask = (
    tokio::sync::mpsc::Sender<ImageChunk>,
    tokio::task::JoinHandle<Result<ImageWriter, EngineError>>,
);

pub async fn transfer_images(
    engine: &Arc<Engine>,
    caller: Option<String>,
    mut stream: tonic::Streaming<ImageChunk>,
) -> Result<TransferImagesResponse, EngineError> {
    let entered = Instant::now();
    let mut slot = engine.incoming.lock().await;
    let slot_waited = entered.elapsed();
    // The files are written by a blocking thread, fed through a channel:
    // a thousand small images would otherwise cost a thread-pool round trip
    // per open, write and close.
    let mut writer: Option<ImageWriterTask> = None;
    let mut id = String::new();
    let mut first_chunk_at = None;
    let fed: Result<(), EngineError> = async {
        while let Some(chunk) = stream.next().await {
            let chunk = chunk
                .map_err(|s| EngineError::BadImage(format!("stream broke: {}", s.message())))?;
            if writer.is_none() {
                first_chunk_at = Some(Instant::now());
                let inc = expect(
                    &mut slot,
                    &chunk.migration_id,
                    &["reserved"],
                    "image transfer",
                )?;
                check_source(inc, caller.as_deref())?;
                id = chunk.migration_id.clone();
                let (tx, mut rx) = tokio::sync::mpsc::channel::<ImageChunk>(64);
                let dir = inc.images();
                let discarded = inc.discarded.clone();
                let store = inc.pages.clone();
                let task = tokio::task::spawn_blocking(move || {
                    let gone = || EngineError::BadImage("the migration was discarded".into());
                    let mut w = ImageWriter::new(&dir).with_store(store);
                    while let Some(c) = rx.blocking_recv() {
                        let d = crate::sync::lock(&discarded);
                        if *d {
                            return Err(gone());
                        }
                        w.write(&c)?;
                    }
                    let d = crate::sync::lock(&discarded);
                    if *d {
                        return Err(gone());
                    }
                    w.finish_file()?;
                    Ok(w)
                });
                writer = Some((tx, task));
            } else if chunk.migration_id != id {
                return Err(EngineError::BadImage(format!(
                    "migration_id changed from {id} to {} mid-stream",
                    chunk.migration_id
                )));
            }
            if let Some((tx, _)) = writer.as_ref()
                && tx.send(chunk).await.is_err()
            {
                // The writer stopped on an error: its result says which.
                break;
            }
        }
        Ok(())
    }
    .await;
    let Some((tx, task)) = writer else {
        fed?;
        return Err(EngineError::BadImage("no image chunk received".into()));
    };
    let streamed = first_chunk_at.map(|t| t.elapsed());
    // The writer finishes before the slot's lock goes, whatever happened:
    // an abort waiting for that lock removes the image directory, and must
    // not race a thread still writing into it.
    drop(tx);
    let written = task
        .await
        .map_err(|e| EngineError::Internal(format!("image writer: {e}")));
    fed?;
    let w = written??;
    let inc = expect(&mut slot, &id, &["reserved"], "image transfer")?;
    inc.state = IncomingState::Received;
    tracing::info!(
        migration = %id,
        files = w.files,
        bytes = w.bytes,
        stored_bytes = w.stored_bytes,
        slot_waited_ms = slot_waited.as_secs_f64() * 1000.0,
        first_chunk_ms = first_chunk_at.map(|t| (t - entered).as_secs_f64() * 1000.0),
        streamed_ms = streamed.map(|d| d.as_secs_f64() * 1000.0),
        written_ms = first_chunk_at.map(|t| t.elapsed().as_secs_f64() * 1000.0),
        "images received"
    );
    Ok(TransferImagesResponse {
        files: w.files,
        bytes: w.bytes,
    })
}

/// One pre-copy round's pages (protocol 5), stored for the image transfer.
pub async fn transfer_pages(
    engine: &Arc<Engine>,
    caller: Option<String>,
    mut stream: tonic::Streaming<ferry_proto::v1::PageBatch>,
) -> Result<ferry_proto::v1::TransferPagesResponse, EngineError> {
    let mut id: Option<String> = None;
    let (mut pages, mut bytes) = (0u64, 0u64);
    while let Some(batch) = stream.next().await {
        let batch = batch
            .map_err(|s| EngineError::BadImage(format!("page stream broke: {}", s.message())))?;
        if let Some(id) = &id
            && *id != batch.migration_id
        {
            return Err(EngineError::BadImage(format!(
                "migration_id changed from {id} to {} mid-stream",
                batch.migration_id
            )));
        }
        // The slot per batch, not for the whole round: a round on a slow
        // link is long, and an abort must not wait for it.
        let (store, discarded) = {
            let mut slot = engine.incoming.lock().await;
            let inc = expect(&mut slot, &batch.migration_id, &["reserved"], "pre-copy")?;
            check_source(inc, caller.as_deref())?;
            if inc.protocol_version < ferry_proto::PEER_PROTOCOL_PRECOPY {
                return Err(EngineError::WrongState {
                    migration_id: batch.migration_id.clone(),
                    state: "prepared with a protocol without pre-copy",
                    step: "pre-copy",
                });
            }
            (inc.pages.clone(), inc.discarded.clone())
        };
        id.get_or_insert_with(|| batch.migration_id.clone());
        let (p, b) = tokio::task::spawn_blocking(move || {
            // Under the discard flag's lock, as the image writer does.
            let d = crate::sync::lock(&discarded);
            if *d {
                return Err(EngineError::BadImage("the migration was discarded".into()));
            }
            let mut s = crate::sync::lock(&store);
            let before = (s.pages, s.bytes);
            s.write(&batch)?;
            Ok((s.pages - before.0, s.bytes - before.1))
        })
        .await
        .map_err(|e| EngineError::Internal(format!("page store: {e}")))??;
        pages += p;
        bytes += b;
    }
    if id.is_none() {
        return Err(EngineError::BadImage("no page batch received".into()));
    }
    tracing::debug!(pages, bytes, "pre-copied pages received");
    Ok(ferry_proto::v1::TransferPagesResponse { pages, bytes })
}

pub async fn restore(
    engine: &Arc<Engine>,
    req: RestoreRequest,
) -> Result<RestoreResponse, EngineError> {
    let mut slot = engine.incoming.lock().await;
    let inc = expect(&mut slot, &req.migration_id, &["received"], "restore")?;
    if !req.local_pages.is_empty() {
        set_local_pages(inc, &req)?;
    }
    let lazy_from = if req.lazy_pages {
        Some(lazy_tunnel_end(engine, inc)?)
    } else {
        None
    };
    let scan_started = Instant::now();
    if inc.in_cluster.is_empty() {
        let (a, images, from) = (engine.clone(), inc.images(), inc.from.clone());
        inc.in_cluster = tokio::task::spawn_blocking(move || take_in_cluster(&a, &images, &from))
            .await
            .map_err(|e| EngineError::Internal(e.to_string()))??;
    }
    // UDP sockets come back with room for the replay and the catch-up
    // (see `sockstate::give_back_udp_buffers`). After the in-cluster
    // rewrite: the addresses recorded are the ones they are restored on.
    let has_udp = inc.ports.iter().any(|p| p.transport == Transport::Udp);
    if has_udp && inc.udp_buffers.is_none() {
        let images = inc.images();
        let raised = tokio::task::spawn_blocking(move || {
            ferry_criu_image::raise_receive_buffers(
                &images,
                ferry_criu_image::IPPROTO_UDP,
                UDP_CATCH_UP_BUFFER as u32,
            )
        })
        .await
        .map_err(|e| EngineError::Internal(e.to_string()))?
        .map_err(|e| EngineError::BadImage(format!("raising the UDP receive buffers: {e}")))?;
        inc.udp_buffers = Some(
            raised
                .into_iter()
                .map(|r| (r.socket.local, r.before as i32))
                .collect(),
        );
    }
    let image_scan = scan_started.elapsed();

    // Collective sockets: the connections TransferSockets rebuilt (on
    // this node's cluster address where they were in-cluster ones, which
    // must be the ones the images name) are handed to CRIU.
    // The table of a collective restore's connections (a CRIU with ferry's
    // connections-table patch): open until CRIU has read it.
    let mut connection_table: Option<OwnedFd> = None;
    // The CRIU started at Prepare, when the restore can use it.
    let mut worker: Option<criu::Worker> = None;
    // The connections TransferSockets rebuilt, in repair mode.
    let mut rebuilt: Option<crate::sockstate::Rebuilt> = None;
    let inherited_tcp = if req.collective_sockets {
        let taken = engine.incoming.take_sockets();
        let sockets = match taken {
            Some(s) if s.migration_id == inc.migration_id && s.from == inc.from => s,
            Some(s) => {
                return Err(EngineError::InvalidField {
                    field: "collective_sockets",
                    reason: format!(
                        "the connections rebuilt here are migration {}'s, not this one's",
                        s.migration_id
                    ),
                });
            }
            // A process without connections sends none (and no
            // TransferSockets): nothing to inherit.
            None => RebuiltSockets::none(&inc.migration_id, &inc.from),
        };
        for f in &inc.in_cluster {
            let moved = sockets.relocated.iter().any(|(local, remote)| {
                *local == std::net::SocketAddr::V4(f.new_local)
                    && *remote == std::net::SocketAddr::V4(f.remote)
            });
            if !moved {
                return Err(EngineError::Internal(format!(
                    "in-cluster connection {} -> {} is in the images but was not rebuilt on {}",
                    f.old_local, f.remote, f.new_local
                )));
            }
        }
        // Connections kept out of the images: this node's CRIU installs
        // them from the table, and the in-cluster ones among them are
        // known from the rebuild alone.
        if images_keep_connections_out(&inc.images())? {
            if sockets.handover != Handover::Table
                || !criu::has_patch(&engine.config.criu_path, criu::CONNS_OUT_MARK)
            {
                return Err(criu::CriuError::Unpatched {
                    path: engine.config.criu_path.clone(),
                    what: "connections kept out of the images",
                }
                .into());
            }
            let fresh: Vec<_> = sockets
                .in_cluster
                .iter()
                .filter(|f| !inc.in_cluster.contains(f))
                .cloned()
                .collect();
            let held = hold_in_cluster(engine, fresh)?;
            inc.in_cluster.extend(held);
        }
        let fds = match (&sockets.rebuilt, sockets.handover) {
            (None, _) => Vec::new(),
            (Some(r), Handover::Table) => {
                // Into the table the CRIU started at Prepare inherited, if
                // there is one (not for a post-copy, whose restore waits
                // for its lazy-pages daemon first).
                let table = match inc.restore_worker.take().filter(|_| lazy_from.is_none()) {
                    Some(w) => {
                        r.write_connection_table(w.table.as_fd())?;
                        worker = Some(w.worker);
                        w.table
                    }
                    None => r.connection_table()?,
                };
                let fds = vec![(
                    crate::sockstate::CONNECTION_TABLE_KEY.to_owned(),
                    table.as_raw_fd(),
                )];
                connection_table = Some(table);
                fds
            }
            (Some(r), h) => r.inherit_fds(h == Handover::ByPidfd),
        };
        rebuilt = sockets.rebuilt;
        Some(fds)
    } else {
        None
    };
    let creq = criu::RestoreRequest {
        criu: engine.config.criu_path.clone(),
        images_dir: inc.images(),
        log_dir: inc.dir.clone(),
        log_level: engine.config.criu_log_level,
        inherited_tcp,
        lazy_pages: lazy_from.is_some(),
    };
    let started = Instant::now();
    // Post-copy: the daemon must listen (and reach the page server) before
    // the restore starts: the restorer itself faults on lazy pages.
    if let Some(tunnel_end) = lazy_from {
        let daemon = criu::lazy::start(
            &engine.config.criu_path,
            &inc.images(),
            &inc.dir,
            tunnel_end,
            engine.config.criu_log_level,
            LAZY_DAEMON_START,
        )
        .await;
        match daemon {
            Ok(d) => {
                tracing::info!(
                    pid = d.pid,
                    "lazy-pages daemon listening, on the page tunnel"
                );
                inc.lazy = Some(d);
            }
            Err(e) => return Err(e.into()),
        }
    }
    // Options ferryd carries go onto the connections beside CRIU's restore
    // (`Rebuilt::apply_options`); both end before the answer.
    let (restored, options_set, rebuilt) = tokio::task::spawn_blocking(move || {
        let (restored, options_set) = std::thread::scope(|s| {
            // On the core CRIU's restore leaves idle.
            let options = rebuilt
                .as_ref()
                .filter(|r| r.has_options())
                .map(|r| s.spawn(move || r.apply_options()));
            let restored = criu::restore(&creq, worker);
            let options_set = options.map_or(Ok(()), |h| {
                h.join().unwrap_or_else(|_| {
                    Err(crate::sockstate::SockStateError::Sys {
                        op: "setting socket options",
                        conn: "?".into(),
                        source: std::io::Error::other("the thread panicked"),
                    })
                })
            });
            (restored, options_set)
        });
        (restored, options_set, rebuilt)
    })
    .await
    .map_err(|e| EngineError::Internal(e.to_string()))?;
    drop(connection_table);
    let outcome = match restored {
        Ok(r) => {
            // Out of repair mode before the commit, while the source
            // translates and commits: not beside the restore, whose binds
            // (a listening socket on the connections' port) need them in
            // it (repair mode forces the port's reuse; taking it out and
            // giving SO_REUSEADDR back leaves a moment without).
            inc.leaving = rebuilt.map(|r| {
                std::thread::spawn(move || {
                    let started = Instant::now();
                    let left = r.leave_repair_early();
                    tracing::debug!(
                        connections = left,
                        of = r.len(),
                        ms = started.elapsed().as_secs_f64() * 1000.0,
                        "out of repair mode before the commit"
                    );
                    r
                })
            });
            r
        }
        Err(e) => {
            // Closed in repair mode: nothing reaches the peers.
            drop(rebuilt);
            if let Some(mut d) = inc.lazy.take() {
                let _ = d.child.kill().await;
                tracing::warn!(log = %criu::lazy::log_tail(&d.work_dir.join(criu::lazy::LOG)), "restore failed; lazy-pages daemon killed");
            }
            return Err(e.into());
        }
    };
    let restore_time = started.elapsed();
    tracing::info!(
        pid = outcome.pid,
        ms = restore_time.as_secs_f64() * 1000.0,
        "restored (stopped)"
    );
    // CRIU made it our child (rst_sibling): reap it whenever it ends.
    engine.supervisor.watch_exit(outcome.pid, "restored");
    inc.state = IncomingState::Restored { pid: outcome.pid };
    // Restored, so the source's Abort kills this copy.
    options_set?;
    Ok(RestoreResponse {
        pid: outcome.pid,
        restore_time_us: restore_time.as_micros() as u64,
        in_cluster: inc.in_cluster.iter().map(|f| f.to_pb()).collect(),
        // CRIU restores without notifications ([`criu::restore`]): its
        // start-up is not timed apart.
        criu_startup_us: 0,
        image_scan_us: image_scan.as_micros() as u64,
    })
}

pub async fn commit(
    engine: &Arc<Engine>,
    req: CommitRequest,
) -> Result<CommitResponse, EngineError> {
    let entered = Instant::now();
    // The datagrams the process left unread on the source, as the packets
    // they arrived as: checked before anything happens.
    let carried = super::queued::packets_from_commit(
        &req.queued_datagrams,
        super::queued::LocalAddresses {
            public: engine.config.public.address,
            cluster: engine.config.cluster.address,
        },
    )?;
    let mut slot = engine.incoming.lock().await;
    let us = move || entered.elapsed().as_micros() as u64;
    tracing::debug!(us = us(), "commit: slot taken");
    let inc = expect(&mut slot, &req.migration_id, &["restored"], "commit")?;
    let IncomingState::Restored { pid } = inc.state else {
        return Err(EngineError::Internal("restored slot without a PID".into()));
    };
    // Post-copy: a daemon that already failed means missing pages; the
    // process must not run. Refused (FAILED_PRECONDITION): the source still
    // holds an intact copy, resumes it and aborts this one.
    let mut done_before_resume = false;
    if let Some(d) = inc.lazy.as_mut() {
        match d.child.try_wait() {
            Ok(None) => {}
            Ok(Some(s)) if s.success() => done_before_resume = true,
            other => {
                return Err(EngineError::PostCopy(format!(
                    "the lazy-pages daemon ended ({other:?}) before the resume: {}",
                    criu::lazy::log_tail(&d.work_dir.join(criu::lazy::LOG))
                )));
            }
        }
    }
    // The ports are the ones announced in Prepare (read on the source
    // before the freeze); the socket counts follow at the next refresh.
    // Reading them from procfs here would cost milliseconds of freeze.
    let sockets = SocketSummary {
        ports: inc.ports.iter().copied().collect(),
        ..Default::default()
    };
    engine.processes.adopt(ManagedProcess {
        pid,
        argv: inc.argv.clone(),
        origin: Origin::MigratedIn {
            migration_id: inc.migration_id.clone(),
            from: inc.from.clone(),
        },
        lifecycle: Lifecycle::Running,
        sockets,
    });
    // The source had the peers' nodes translate before it sent Commit: the
    // in-cluster connections may flow from here on.
    release_holds(engine, &inc.in_cluster).await;
    tracing::debug!(us = us(), "commit: in-cluster holds released");
    // Open egress first: the ACKs (and window updates) the stack sends for
    // replayed segments must get out. Ingress stays captured while the
    // packets captured so far are replayed, so none is overtaken; then the
    // ports pass packets like any owned port. The process resumes before
    // the replay, not after it: measured A/B at 1024 connections (26
    // migrations each, docs/results.md), the freeze fell by 22 ms (the
    // replay's whole length) and the median client's gap by 20 ms, since
    // the process answers the first replayed requests while the rest go
    // in, with no retransmission timeout either way. Whatever fails here,
    // the process was restored and is ours: it runs.
    // Connections rebuilt by ferryd with bytes the source never sent leave
    // repair mode once egress is open (those bytes go out as they are
    // queued), and before the process and the replay use them; the others
    // left it after the restore, on a thread of their own
    // (`Incoming::leaving`, joined here).
    let mut leaving = inc.leaving.take();
    // UDP sockets were restored with room for what the replay pours into
    // them; their own size comes back after the catch-up.
    let udp_buffers = inc.udp_buffers.take().filter(|b| !b.is_empty());
    let mut resumed_early = None;
    let replay = if inc.armed {
        engine.ports.reserve(&inc.ports, PortState::Releasing);
        let replayed = match engine.ports.apply().await {
            Ok(()) => {
                let (a, id, ports) = (engine.clone(), inc.migration_id.clone(), inc.ports.clone());
                let delivered = req.delivered_digests;
                let unread = req.unread_datagrams;
                let leaving = leaving.take();
                tracing::debug!(us = us(), "commit: ports opened for egress");
                let resumed = tokio::task::spawn_blocking(move || {
                    let mut rebuilt = joined(leaving);
                    resume_rebuilt(&mut rebuilt);
                    tracing::debug!(us = us(), "commit: rebuilt connections out of repair mode");
                    resume(pid);
                    let resumed_at = Instant::now();
                    tracing::debug!(us = us(), "commit: process resumed");
                    // ferryd's descriptors close after the freeze.
                    drop(rebuilt);
                    let r = a
                        .dataplane
                        .replay_and_open(&id, &carried, &delivered, &unread, || {
                            a.ports.release(&ports);
                            a.ports.apply_now()
                        });
                    (r, resumed_at)
                })
                .await;
                match resumed {
                    Ok((r, at)) => {
                        resumed_early = Some(at);
                        r.map_err(EngineError::from)
                    }
                    // The task died before or after the resume; resuming
                    // twice is harmless.
                    Err(source) => Err(EngineError::Task {
                        what: "the replay",
                        source,
                    }),
                }
            }
            Err(e) => Err(e.into()),
        };
        if resumed_early.is_none() {
            // Still here if the ports did not open; gone with the task if
            // it died (it resumed them or dropped them).
            let mut rebuilt = joined(leaving.take());
            resume_rebuilt(&mut rebuilt);
            resume(pid);
        }
        let stats = replayed?;
        tracing::info!(
            captured = stats.captured,
            replayed = stats.replayed,
            skipped = stats.skipped_delivered,
            failed = stats.failed,
            us = stats.replay_time_us,
            "captured packets replayed"
        );
        Some(stats)
    } else {
        engine.ports.release(&inc.ports);
        let opened = engine.ports.apply().await;
        let mut rebuilt = joined(leaving.take());
        resume_rebuilt(&mut rebuilt);
        resume(pid);
        opened?;
        None
    };
    let resumed_at = resumed_early.unwrap_or_else(Instant::now);
    let running_for = || resumed_at.elapsed().as_micros() as u64;
    if let Some(before) = udp_buffers {
        tokio::spawn(async move {
            tokio::time::sleep(UDP_CATCH_UP).await;
            let given = tokio::task::spawn_blocking(move || {
                crate::sockstate::give_back_udp_buffers(
                    &process::process_tree(pid),
                    UDP_CATCH_UP_BUFFER,
                    &before,
                )
            })
            .await;
            match given {
                Ok(Ok(n)) => tracing::debug!(pid, sockets = n, "UDP receive buffers given back"),
                Ok(Err(e)) => {
                    tracing::warn!(pid, error = %e, "giving back the UDP receive buffers")
                }
                Err(e) => tracing::warn!(pid, error = %e, "UDP buffer task"),
            }
        });
    }
    // Remembered for a restart of this agent, now the freeze is over.
    engine.processes.persist_soon();
    // The images go after the answer: a thousand files to unlink would
    // otherwise hold up the source's confirmation (the process runs
    // already). The directory is the migration's own; the next migration
    // gets another.
    if let Some(mut inc) = slot.take() {
        // Post-copy: the daemon still feeds the running process; the
        // directory (its socket, its log) goes when it ends.
        if let Some(daemon) = inc.lazy.take() {
            watch_postcopy(
                engine,
                PostCopyWatch {
                    migration_id: inc.migration_id.clone(),
                    from: inc.from.clone(),
                    pid,
                    daemon,
                    dir: inc.dir.clone(),
                    resumed_at,
                    done_before_resume,
                    served_locally: inc
                        .tunnel
                        .as_ref()
                        .map(|t| t.served_locally.clone())
                        .unwrap_or_default(),
                },
            );
            tracing::info!(pid, migration = %req.migration_id, "migration committed; process runs here, its pages follow");
            return Ok(CommitResponse {
                pid,
                replay,
                running_for_us: running_for(),
            });
        }
        let keep_logs = super::keeps_every_log(&engine.config)
            .then(|| (engine.config.work_dir.clone(), req.migration_id.clone()));
        tokio::task::spawn_blocking(move || {
            if let Some((work_dir, id)) = keep_logs {
                super::keep_logs(&work_dir, &inc.dir, &id);
            }
            if let Err(e) = std::fs::remove_dir_all(&inc.dir) {
                tracing::warn!(dir = %inc.dir.display(), error = %e, "removing images");
            }
        });
    }
    tracing::info!(pid, migration = %req.migration_id, "migration committed; process runs here");
    Ok(CommitResponse {
        pid,
        replay,
        running_for_us: running_for(),
    })
}

/// Connections rebuilt by TransferSockets, waiting for their Restore.
#[derive(Debug)]
pub struct RebuiltSockets {
    pub migration_id: String,
    pub from: String,
    /// (local, remote) of each, after the move of in-cluster ones.
    relocated: Vec<(std::net::SocketAddr, std::net::SocketAddr)>,
    /// The in-cluster ones, as moved: what images that keep the
    /// connections out no longer name.
    in_cluster: Vec<InClusterFlow>,
    rebuilt: Option<crate::sockstate::Rebuilt>,
    /// How this node's CRIU takes them.
    handover: Handover,
}

impl RebuiltSockets {
    fn none(migration_id: &str, from: &str) -> Self {
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
fn relocate_in_cluster(
    engine: &Engine,
    from: &str,
    states: &mut [crate::sockstate::TcpConnectionState],
) -> Result<Vec<InClusterFlow>, EngineError> {
    use std::net::{IpAddr, SocketAddr};
    let here = engine.config.cluster.address;
    let (source, nodes) = in_cluster_addresses(engine, from)?;
    let mut moved = Vec::new();
    for c in states {
        let (SocketAddr::V4(local), SocketAddr::V4(remote)) = (c.local, c.remote) else {
            continue;
        };
        if *local.ip() != source {
            continue;
        }
        if *remote.ip() == here {
            return Err(
                crate::dataplane::translation::FlowError::PeerOnDestination { local, remote }
                    .into(),
            );
        }
        if nodes.contains(remote.ip()) {
            let new_local = std::net::SocketAddrV4::new(here, local.port());
            c.local = SocketAddr::new(IpAddr::V4(here), local.port());
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
    .map_err(|e| EngineError::Internal(e.to_string()))??;
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

/// The connections a [`Incoming::leaving`] thread took out of repair mode
/// (blocking until it is done: ~2 ms for a thousand, started at the end of
/// the restore).
fn joined(
    leaving: Option<std::thread::JoinHandle<crate::sockstate::Rebuilt>>,
) -> Option<crate::sockstate::Rebuilt> {
    match leaving?.join() {
        Ok(r) => Some(r),
        Err(_) => {
            tracing::error!("the thread taking the connections out of repair mode panicked");
            None
        }
    }
}

/// Hands ferryd's rebuilt connections to the process: those still in
/// repair mode leave it ([`crate::sockstate::Rebuilt::resume`]; blocking,
/// milliseconds for a thousand). Dropping them afterwards only closes
/// ferryd's descriptors.
fn resume_rebuilt(rebuilt: &mut Option<crate::sockstate::Rebuilt>) {
    if let Some(r) = rebuilt.as_mut()
        && let Err(e) = r.resume()
    {
        tracing::error!(error = %e, "taking the rebuilt connections out of repair mode");
    }
}

/// SIGCONT to every process of the restored tree.
fn resume(pid: i32) {
    for p in process::process_tree(pid) {
        if let Err(e) = kill(Pid::from_raw(p), Signal::SIGCONT) {
            tracing::warn!(pid = p, error = %e, "SIGCONT");
        }
    }
}

pub async fn abort(engine: &Arc<Engine>, req: AbortRequest) -> Result<(), EngineError> {
    // Closed in repair mode: nothing reaches the peers.
    engine.incoming.drop_sockets_of(&req.migration_id);
    let mut slot = engine.incoming.lock().await;
    match slot.as_ref() {
        Some(inc) if inc.migration_id == req.migration_id => {
            tracing::warn!(migration = %req.migration_id, reason = %req.reason, state = inc.state.name(), "migration aborted by the source");
            discard(engine, inc).await;
            *slot = None;
        }
        // Idempotent: an abort for something we do not hold (never reached
        // us, or already aborted) has nothing to undo.
        _ => tracing::info!(migration = %req.migration_id, "abort for a migration not held here"),
    }
    Ok(())
}

/// The agent the destination's unit tests and the peer-protocol fuzz
/// target (`fuzz/`, through `crate::fuzzing`) drive: a recording fake for
/// the eBPF filter, the replayer and the flow rules, and a "CRIU" that
/// only answers `--version` (Prepare checks it; any restore fails), so no
/// step touches the system outside its temporary directory.
#[cfg(any(test, feature = "fuzzing"))]
pub mod fixture {
    use std::sync::Arc;

    use crate::config::Config;
    use crate::criu::InstalledCriu;
    use crate::dataplane::filter::fake::FakeFilter;
    use crate::dataplane::replay::fake::FakeReplayer;
    use crate::dataplane::translation::fake::FakeFlowRules;
    use crate::engine::Engine;
    use crate::node::{Node, NodeParts};

    pub struct Fixture {
        pub node: Arc<Node>,
        pub engine: Arc<Engine>,
        pub filter: FakeFilter,
        pub replayed: FakeReplayer,
        pub flows: FakeFlowRules,
        pub dir: tempfile::TempDir,
    }

    /// The state of an incoming slot, by name.
    pub fn state_name(inc: &super::Incoming) -> &'static str {
        inc.state.name()
    }

    impl Fixture {
        /// Node "node2" (cluster address 198.19.0.2), knowing `peers`
        /// (name, cluster address) by configuration. With peers, nothing
        /// may make the agent call them: they are not there.
        pub fn new(peers: &[(&str, &str)]) -> Fixture {
            Self::with(peers, |_| None, None)
        }

        /// [`Fixture::new`], with the source's CRIU and Peer links given:
        /// `criu` gets the fake CRIU binary's path and may return another
        /// (`None`: that binary, which only answers `--version`).
        pub fn with(
            peers: &[(&str, &str)],
            source_criu: impl FnOnce(&std::path::Path) -> Option<Arc<dyn crate::criu::Checkpointer>>,
            links: Option<Arc<dyn crate::engine::link::Connector>>,
        ) -> Fixture {
            let dir = tempfile::tempdir().unwrap();
            let criu = dir.path().join("criu");
            std::fs::write(&criu, "#!/bin/sh\necho 'Version: 4.2.1'\n").unwrap();
            std::fs::set_permissions(&criu, std::os::unix::fs::PermissionsExt::from_mode(0o755))
                .unwrap();
            let mut toml = format!(
                r#"node = "node2"
work_dir = "{}"
criu_path = "{}"
[public]
interface = "pub0"
address = "198.18.0.100"
[cluster]
interface = "clu0"
address = "198.19.0.2"
peer_listen = "198.19.0.2:7100"
"#,
                dir.path().join("work").display(),
                criu.display()
            );
            for (name, address) in peers {
                toml.push_str(&format!(
                    "[[peers]]\nname = \"{name}\"\naddress = \"{address}:7100\"\n"
                ));
            }
            let config = Config::parse(&toml, std::path::Path::new("test.toml")).unwrap();
            let filter = FakeFilter::default();
            let replayed = FakeReplayer::default();
            let flows = FakeFlowRules::default();
            let source_criu =
                source_criu(&criu).unwrap_or_else(|| Arc::new(InstalledCriu(criu.clone())));
            let node = Node::build(NodeParts {
                config,
                filter: Box::new(filter.clone()),
                replayer: Box::new(replayed.clone()),
                flows: Box::new(flows.clone()),
                tls: None,
                membership: None,
                criu: source_criu,
                links,
            });
            Fixture {
                engine: node.engine.clone(),
                node,
                filter,
                replayed,
                flows,
                dir,
            }
        }

        /// Registers a process that runs here (started by `ferry run`)
        /// holding `ports`.
        pub fn adopt_local(&self, pid: i32, ports: &[crate::process::PortKey]) {
            use crate::managed::{Lifecycle, ManagedProcess, Origin};
            self.engine.processes.adopt(ManagedProcess {
                pid,
                argv: vec!["local".into()],
                origin: Origin::Run,
                lifecycle: Lifecycle::Running,
                sockets: crate::process::SocketSummary {
                    ports: ports.iter().copied().collect(),
                    ..Default::default()
                },
            });
        }
    }
}

#[cfg(test)]
mod tests {

    use super::fixture::Fixture;
    use super::*;
    use crate::dataplane::capture::digest;
    use ferry_ebpf::{CaptureKind, CapturedPacket, Protocol};

    fn fixture() -> Fixture {
        Fixture::new(&[])
    }

    /// The source's Abort of migration `id`, which must succeed.
    async fn abort_test_migration(engine: &Arc<Engine>, id: &str) {
        abort(
            engine,
            AbortRequest {
                migration_id: id.into(),
                reason: "test".into(),
            },
        )
        .await
        .unwrap();
    }

    fn prepare_req(id: &str, port: u32) -> PrepareRequest {
        PrepareRequest {
            protocol_version: ferry_proto::PEER_PROTOCOL_VERSION,
            migration_id: id.into(),
            source_node: "node1".into(),
            source_pid: 42,
            argv: vec!["server".into()],
            ports: vec![pb::Port {
                protocol: pb::Protocol::Tcp as i32,
                port,
            }],
        }
    }

    #[tokio::test]
    async fn one_incoming_migration_at_a_time_with_its_ports_frozen() {
        let f = fixture();
        prepare(&f.engine, prepare_req("aaaa", 7000)).await.unwrap();
        assert_eq!(*f.filter.0.lock().unwrap(), vec!["set 7000/tcp Frozen"]);
        let err = prepare(&f.engine, prepare_req("bbbb", 7001))
            .await
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::ResourceExhausted, "{err}");
        assert!(err.to_string().contains("aaaa"), "{err}");
        let dir = f.engine.config.work_dir.join("incoming/aaaa");
        assert!(dir.is_dir());

        abort_test_migration(&f.engine, "aaaa").await;
        assert!(!dir.exists(), "images directory left behind");
        assert_eq!(
            f.filter.0.lock().unwrap().last().unwrap(),
            "remove 7000/tcp"
        );
        // Idempotent, and the slot is free again.
        abort(
            &f.engine,
            AbortRequest {
                migration_id: "aaaa".into(),
                reason: "again".into(),
            },
        )
        .await
        .unwrap();
        prepare(&f.engine, prepare_req("bbbb", 7001)).await.unwrap();
    }

    #[tokio::test]
    async fn steps_out_of_order_are_refused() {
        let f = fixture();
        let err = restore(
            &f.engine,
            RestoreRequest {
                migration_id: "nope".into(),
                ..Default::default()
            },
        )
        .await
        .unwrap_err();
        assert_eq!(err.code(), tonic::Code::NotFound, "{err}");
        prepare(&f.engine, prepare_req("aaaa", 7000)).await.unwrap();
        let err = restore(
            &f.engine,
            RestoreRequest {
                migration_id: "aaaa".into(),
                ..Default::default()
            },
        )
        .await
        .unwrap_err();
        assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err}");
        assert!(err.to_string().contains("reserved"), "{err}");
        let err = commit(
            &f.engine,
            CommitRequest {
                migration_id: "aaaa".into(),
                ..Default::default()
            },
        )
        .await
        .unwrap_err();
        assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err}");
    }

    #[tokio::test]
    async fn bad_prepare_requests_name_the_field() {
        let f = fixture();
        let mut r = prepare_req("aaaa", 7000);
        r.protocol_version = 99;
        let err = prepare(&f.engine, r).await.unwrap_err();
        assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err}");
        let err = prepare(&f.engine, prepare_req("../etc", 7000))
            .await
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err}");
        assert!(err.to_string().contains("migration_id"), "{err}");
        let err = prepare(&f.engine, prepare_req("aaaa", 70000))
            .await
            .unwrap_err();
        assert!(err.to_string().contains("ports"), "{err}");
        // None of these reserved anything.
        assert!(f.engine.incoming.lock().await.is_none());
        assert!(f.filter.0.lock().unwrap().is_empty());
    }

    #[tokio::test]
    async fn a_port_owned_here_is_not_taken_by_an_incoming_process() {
        let f = fixture();
        let port = PortKey {
            transport: Transport::Tcp,
            port: 7000,
        };
        f.adopt_local(4242, &[port]);
        // No peer owns it (none answers here): owned.
        f.engine.ports.check_claims(vec![port]).await;
        f.engine.ports.apply().await.unwrap();
        assert_eq!(f.engine.ports.owned(), [port].into());
        let err = prepare(&f.engine, prepare_req("aaaa", 7000))
            .await
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err}");
        assert!(err.to_string().contains("4242"), "{err}");
    }

    fn captured(port: u16, data: &[u8]) -> CapturedPacket {
        CapturedPacket {
            kind: CaptureKind::Captured,
            protocol: Protocol::Tcp,
            port,
            // Taken after any session of the test opened.
            ktime_ns: u64::MAX,
            data: data.to_vec(),
        }
    }

    /// Arm's connections (protocol 7): a bad entry is refused with the
    /// entry and field named, before anything is armed; good ones come back
    /// to be opened, but those on the source's cluster address, which the
    /// rebuild moves to this node's, are left out.
    #[tokio::test]
    async fn arm_checks_the_connections_it_names_and_leaves_the_in_cluster_ones_out() {
        let f = Fixture::new(&[("node1", "198.19.0.1"), ("node3", "198.19.0.3")]);
        prepare(&f.engine, prepare_req("aaaa", 7000)).await.unwrap();
        let conn = |inode: u64, local: &str, remote: &str| pb::StagedConnection {
            inode,
            local: local.into(),
            remote: remote.into(),
            fixed: None,
            sndbuf: 0,
        };
        let with_fixed =
            |c: pb::StagedConnection, f: pb::TcpConnectionFixed| pb::StagedConnection {
                fixed: Some(f),
                ..c
            };
        let good = conn(11, "198.18.0.100:7000", "198.18.1.2:40000");
        let arm_with = |connections: Vec<pb::StagedConnection>| ArmRequest {
            migration_id: "aaaa".into(),
            ports: vec![pb::Port {
                protocol: pb::Protocol::Tcp as i32,
                port: 7000,
            }],
            connections,
        };
        for (bad, names) in [
            (conn(12, "198.18.0.100", "198.18.1.2:1"), "[1].local"),
            (conn(12, "198.18.0.100:7000", "[::1]:1"), "[1].remote"),
            (conn(0, "198.18.0.100:7000", "198.18.1.2:1"), "[1].inode"),
            (conn(11, "198.18.0.100:7000", "198.18.1.2:1"), "[1].inode"),
            (
                with_fixed(
                    conn(12, "198.18.0.100:7000", "198.18.1.2:1"),
                    pb::TcpConnectionFixed {
                        send_wscale: 15,
                        ..Default::default()
                    },
                ),
                "[1].fixed.send_wscale",
            ),
            (
                with_fixed(
                    conn(12, "198.18.0.100:7000", "198.18.1.2:1"),
                    pb::TcpConnectionFixed {
                        options: 0x80,
                        ..Default::default()
                    },
                ),
                "[1].fixed.options",
            ),
        ] {
            let err = arm(&f.engine, arm_with(vec![good.clone(), bad]))
                .await
                .unwrap_err();
            assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err}");
            assert!(
                err.to_string()
                    .starts_with(&format!("connections: {names}")),
                "{err}"
            );
        }
        assert!(
            !f.filter
                .0
                .lock()
                .unwrap()
                .iter()
                .any(|r| r.contains("Capturing")),
            "a refused Arm armed a capture"
        );
        let in_cluster = conn(13, "198.19.0.1:5000", "198.19.0.3:5432");
        let staging = arm(&f.engine, arm_with(vec![good, in_cluster]))
            .await
            .unwrap();
        assert_eq!(
            staging.conns,
            vec![crate::sockstate::ToStage {
                inode: 11,
                local: "198.18.0.100:7000".parse().unwrap(),
                remote: "198.18.1.2:40000".parse().unwrap(),
                sndbuf: 0,
            }]
        );
        // What the agent points TransferSockets at: the slot's place.
        let pointed = || f.engine.incoming.staged_for("aaaa");
        assert!(Arc::ptr_eq(&staging.into, &pointed().unwrap()));
        // The slot's end drops what was opened for it.
        drop(staging);
        abort_test_migration(&f.engine, "aaaa").await;
        assert!(take_staged(&f.engine, "aaaa").is_none());
        assert!(
            pointed().is_none(),
            "the aborted slot's place for staged sockets outlived it"
        );
    }

    /// Protocol 9: TransferSockets' packed records are joined with the
    /// fixed parts Arm carried, the in-cluster ones (which Arm opens no
    /// socket for) moved to this node's address like whole ones; a record
    /// for a connection Arm did not describe, or one also sent whole, is
    /// refused with the field named.
    #[tokio::test]
    async fn packed_connections_join_what_arm_carried() {
        use crate::sockstate::packed::{Fixed, pack};
        let f = Fixture::new(&[("node1", "198.19.0.1"), ("node3", "198.19.0.3")]);
        prepare(&f.engine, prepare_req("aaaa", 7000)).await.unwrap();
        let state = |inode: u64, local: &str, remote: &str| crate::sockstate::TcpConnectionState {
            inode,
            local: local.parse().unwrap(),
            remote: remote.parse().unwrap(),
            send_seq: 1000 + inode as u32,
            recv_seq: 2000,
            send_queue: b"queued".to_vec(),
            unsent: 2,
            recv_queue: Vec::new(),
            mss_clamp: 1460,
            options: 0,
            send_wscale: 0,
            recv_wscale: 0,
            timestamp: 0,
            window: Default::default(),
            reuseaddr: true,
            sndbuf: 4096,
            socket_options: Some(pb::TcpSocketOptions {
                rcvbuf: 8192,
                ..Default::default()
            }),
        };
        let states = vec![
            state(11, "198.18.0.100:7000", "198.18.1.2:40000"),
            state(13, "198.19.0.1:5000", "198.19.0.3:5432"),
        ];
        let fixed: FixedParts = states.iter().map(|c| (c.inode, Fixed::of(c))).collect();
        let staging = arm(
            &f.engine,
            ArmRequest {
                migration_id: "aaaa".into(),
                ports: vec![pb::Port {
                    protocol: pb::Protocol::Tcp as i32,
                    port: 7000,
                }],
                connections: states
                    .iter()
                    .map(|c| pb::StagedConnection {
                        inode: c.inode,
                        local: c.local.to_string(),
                        remote: c.remote.to_string(),
                        fixed: Some(fixed[&c.inode].to_pb()),
                        sndbuf: c.sndbuf,
                    })
                    .collect(),
            },
        )
        .await
        .unwrap();
        assert_eq!(staging.conns.len(), 1, "no socket for the in-cluster one");
        let (packed, whole) = pack(&states, &fixed);
        assert!(whole.is_empty());
        let request = |packed: &crate::sockstate::packed::Packed| pb::TransferSocketsRequest {
            migration_id: "aaaa".into(),
            source_node: "node1".into(),
            tcp_connections: Vec::new(),
            packed: packed.records.clone(),
            packed_queues: packed.queues.clone(),
        };
        let (got, in_cluster) = sockets_to_rebuild(&f.engine, &mut request(&packed)).unwrap();
        let mut want = states.clone();
        want[1].local = "198.19.0.2:5000".parse().unwrap();
        assert_eq!(got, want);
        assert_eq!(in_cluster.len(), 1);
        assert_eq!(in_cluster[0].new_local.to_string(), "198.19.0.2:5000");

        // Sent twice: packed and whole.
        let mut twice = request(&packed);
        twice.tcp_connections = vec![states[0].to_pb()];
        let err = sockets_to_rebuild(&f.engine, &mut twice).unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err}");
        assert!(err.to_string().contains("tcp_connections"), "{err}");
        assert!(
            err.to_string().contains("[0].inode: 11 is in packed too"),
            "{err}"
        );

        // One connection in two records.
        let (doubled, _) = pack(&[states[0].clone(), states[0].clone()], &fixed);
        let err = sockets_to_rebuild(&f.engine, &mut request(&doubled)).unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err}");
        assert!(err.to_string().contains("packed"), "{err}");
        assert!(err.to_string().contains("in two records"), "{err}");

        // A record for a connection Arm did not describe.
        let mut unknown = states[0].clone();
        unknown.inode = 99;
        let mut more = fixed.clone();
        more.insert(99, fixed[&11].clone());
        let (stray, _) = pack(std::slice::from_ref(&unknown), &more);
        let err = sockets_to_rebuild(&f.engine, &mut request(&stray)).unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err}");
        assert!(
            err.to_string()
                .contains("packed[0].inode: 99 was not named"),
            "{err}"
        );
        drop(staging);
        abort_test_migration(&f.engine, "aaaa").await;
    }

    #[tokio::test]
    async fn arm_captures_every_port_in_one_call_and_abort_drops_the_capture() {
        let f = fixture();
        prepare(&f.engine, prepare_req("aaaa", 7000)).await.unwrap();
        f.filter.0.lock().unwrap().clear();
        // Ports opened since Prepare are armed too.
        arm(
            &f.engine,
            ArmRequest {
                migration_id: "aaaa".into(),
                ports: vec![
                    pb::Port {
                        protocol: pb::Protocol::Tcp as i32,
                        port: 7000,
                    },
                    pb::Port {
                        protocol: pb::Protocol::Udp as i32,
                        port: 7001,
                    },
                ],
                connections: vec![],
            },
        )
        .await
        .unwrap();
        assert_eq!(
            *f.filter.0.lock().unwrap(),
            vec!["set 7000/tcp Capturing", "set 7001/udp Capturing"]
        );
        // Arm twice, or out of order, is refused.
        let err = arm(
            &f.engine,
            ArmRequest {
                migration_id: "bbbb".into(),
                ports: vec![],
                connections: vec![],
            },
        )
        .await
        .unwrap_err();
        assert_eq!(err.code(), tonic::Code::NotFound, "{err}");

        f.filter.1.lock().unwrap().push(captured(7000, b"kept"));
        abort_test_migration(&f.engine, "aaaa").await;
        let calls = f.filter.0.lock().unwrap().clone();
        assert!(
            calls.ends_with(&["remove 7000/tcp".into(), "remove 7001/udp".into()]),
            "{calls:?}"
        );
        f.engine.dataplane.collect_captured();
        assert!(f.engine.dataplane.capture.take_captured("aaaa").is_empty());
        assert!(
            f.replayed.0.lock().unwrap().is_empty(),
            "nothing replayed on abort"
        );
    }

    const TCP_7000: PortKey = PortKey {
        transport: Transport::Tcp,
        port: 7000,
    };

    /// The destination drains the ring in the background while it
    /// captures, and the commit drains too: whoever drains, packets reach
    /// their session in ring order, and the background drain alone takes
    /// everything in.
    #[test]
    fn packets_drained_in_the_background_keep_their_order() {
        const PACKETS: usize = 20_000;
        let f = fixture();
        f.engine.dataplane.capture.open("m", [TCP_7000]);
        f.engine.dataplane.collect_while_capturing("m");
        let ring = f.filter.1.clone();
        let producer = std::thread::spawn(move || {
            for chunk in (0..PACKETS).collect::<Vec<_>>().chunks(7) {
                let mut r = ring.lock().unwrap();
                r.extend(chunk.iter().map(|i| captured(7000, &i.to_le_bytes())));
            }
        });
        // Foreground drains race the background thread meanwhile.
        while !producer.is_finished() {
            f.engine.dataplane.collect_captured();
        }
        producer.join().unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while !f.filter.1.lock().unwrap().is_empty() {
            assert!(Instant::now() < deadline, "the background drain stopped");
            std::thread::sleep(Duration::from_millis(1));
        }
        let got: Vec<usize> = f
            .engine
            .dataplane
            .capture
            .take_captured("m")
            .iter()
            .map(|p| usize::from_le_bytes(p.data.as_slice().try_into().unwrap()))
            .collect();
        assert_eq!(got.len(), PACKETS);
        assert!(
            got.windows(2).all(|w| w[0] + 1 == w[1]),
            "packets out of ring order"
        );
        f.engine.dataplane.capture.close("m");
    }

    /// A batch large enough to be replayed on several threads: every
    /// segment once, each connection's in its order.
    #[test]
    fn a_large_replay_keeps_each_connections_order() {
        const CONNECTIONS: u16 = 300;
        const EACH: u32 = 4;
        let f = fixture();
        f.engine.dataplane.capture.open("m", [TCP_7000]);
        {
            let mut ring = f.filter.1.lock().unwrap();
            for ack in 0..EACH {
                for c in 0..CONNECTIONS {
                    ring.push(captured(
                        7000,
                        &crate::dataplane::capture::tests::tcp_ack(20_000 + c, ack),
                    ));
                }
            }
        }
        let stats = f
            .engine
            .dataplane
            .replay_and_open("m", &[], &[], &[], || Ok::<(), EngineError>(()))
            .unwrap();
        let total = u64::from(CONNECTIONS) * u64::from(EACH);
        assert_eq!(
            (stats.replayed, stats.replayed_segments, stats.failed),
            (total, total, 0)
        );
        let replayed = f.replayed.0.lock().unwrap();
        assert_eq!(replayed.len() as u64, total);
        let mut next = std::collections::HashMap::new();
        for p in replayed.iter() {
            let conn = u16::from_be_bytes([p[20], p[21]]);
            let ack = u32::from_be_bytes([p[28], p[29], p[30], p[31]]);
            let want = next.entry(conn).or_insert(0u32);
            assert_eq!(ack, *want, "connection {conn} out of order");
            *want += 1;
        }
        assert!(next.values().all(|&n| n == EACH));
    }

    /// And the datagrams the source's sockets held unread come first.
    #[test]
    fn replay_skips_what_the_source_delivered_and_opens_between_batches() {
        let f = fixture();
        f.engine.dataplane.capture.open("m", [TCP_7000]);
        f.filter.1.lock().unwrap().extend([
            captured(7000, b"p1"),
            captured(7000, b"p2"),
            captured(7000, b"p3"),
            captured(9999, b"not ours"),
        ]);
        // The source delivered p0..p2 after the destination armed at p1.
        let delivered = [digest(b"p0"), digest(b"p1"), digest(b"p2")];
        let ring = f.filter.1.clone();
        let replayed = f.replayed.clone();
        let carried = [b"q0".to_vec(), b"q1".to_vec()];
        let stats = f
            .engine
            .dataplane
            .replay_and_open("m", &carried, &delivered, &[], || {
                // By the time the ports open, the backlog is replayed; a
                // packet that arrives now is replayed after it.
                assert_eq!(replayed.0.lock().unwrap().len(), 3);
                ring.lock().unwrap().push(captured(7000, b"p4"));
                Ok::<(), EngineError>(())
            })
            .unwrap();
        assert_eq!(
            *f.replayed.0.lock().unwrap(),
            vec![
                b"q0".to_vec(),
                b"q1".to_vec(),
                b"p3".to_vec(),
                b"p4".to_vec()
            ]
        );
        assert_eq!(stats.carried, 2);
        assert_eq!(stats.captured, 4);
        assert_eq!(stats.skipped_delivered, 2);
        assert_eq!(stats.replayed, 2);
        assert_eq!(stats.failed, 0);
        // The session is closed: later packets for the port are strays.
        assert_eq!(
            f.engine
                .dataplane
                .capture
                .route(vec![captured(7000, b"late")]),
            1
        );
    }
}
