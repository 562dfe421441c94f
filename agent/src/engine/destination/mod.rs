//! The destination side of a migration, behind `Peer`: one file per Peer
//! step, each on the one incoming slot ([`IncomingSlot`]).
//!
//! ```text
//! (none) ─Prepare─> Reserved ─TransferImages─> Received ─Restore─> Restored ─Commit─> (none: the process runs here)
//!                    │ Arm, TransferPages,      │ PageTunnel          │
//!                    │ PageTunnel               │                     │
//!                    └──────────────────────────┴─────────────────────┴─Abort─> (none: every trace removed)
//! ```
//!
//! | step | file | accepted in | leaves the slot |
//! |---|---|---|---|
//! | Prepare | `prepare.rs` | - | Reserved |
//! | Arm | `arm.rs` | Reserved | Reserved |
//! | TransferPages | `transfer_pages.rs` | Reserved | Reserved |
//! | PageTunnel | `page_tunnel.rs` | Reserved, Received | unchanged |
//! | TransferImages | `transfer_images.rs` | Reserved | Received |
//! | Restore | `restore.rs` | Received | Restored |
//! | Commit | `commit.rs` | Restored | - |
//! | Abort | `abort.rs` | Reserved, Received, Restored | - |
//!
//! Prepare takes an empty slot (or one abandoned for
//! [`prepare`]'s `STALE_RESERVATION`). TransferSockets (`transfer_sockets.rs`)
//! runs beside TransferImages, which holds the slot for its whole stream:
//! it checks its caller against the migration last prepared here and
//! leaves the rebuilt connections beside the slot for the Restore. Abort
//! takes any state, and a migration it does not hold (idempotent).
//! Post-copy: Restore starts CRIU's lazy-pages daemon first; Commit hands
//! it to a watcher which kills the process if the daemon fails, and answers
//! `PostCopyStatus` (`post_copy.rs`). Post-copy with pages that follow
//! (protocol 10): Restore gives the page filler an empty store; after
//! Commit the source's `PostCopyPages` fills it (`pages_follow.rs`). `steps_and_the_table_agree` checks the
//! table against [`IncomingState::accepts`] and [`IncomingState::after`].

use std::os::fd::{AsRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use crate::criu;
use crate::dataplane::translation::InClusterFlow;
use crate::engine::Engine;
use crate::engine::journal::{IncomingStage, Record};
use crate::process::PortKey;

mod abort;
mod arm;
mod capacity;
mod commit;
mod fill;
#[cfg(any(test, feature = "fuzzing"))]
pub mod fixture;
mod page_tunnel;
mod pages_follow;
mod peak;
mod post_copy;
mod prepare;
mod restore;
mod slot;
#[cfg(test)]
mod tests;
mod transfer_images;
mod transfer_pages;
mod transfer_sockets;

pub use abort::abort;
pub use arm::{StagedSlot, Staging, arm, connections_to_stage, stage};
use arm::{armed_fixed, take_staged};
pub use commit::commit;
use page_tunnel::IncomingTunnel;
pub use page_tunnel::{TunnelOut, page_tunnel};
pub use pages_follow::{Follows, WantsOut, post_copy_pages};
pub use post_copy::{PostCopies, post_copy_status};
use post_copy::{PostCopyWatch, watch_postcopy};
pub use prepare::prepare;
pub use restore::restore;
pub use slot::IncomingSlot;
pub use transfer_images::transfer_images;
pub use transfer_pages::transfer_pages;
pub use transfer_sockets::{RebuiltSockets, sockets_to_rebuild, transfer_sockets};

use super::EngineError;
use super::pagestore::PageStore;

/// The receive buffer a migrated process's UDP sockets get for the replay
/// and the catch-up after it, and for how long.
pub(super) const UDP_CATCH_UP_BUFFER: i32 = 8 << 20;

/// A streamed request about an incoming migration must come from the node
/// that prepared it (unary ones are checked in `api/peer.rs`).
pub(super) fn check_source(inc: &Incoming, caller: Option<&str>) -> Result<(), EngineError> {
    match caller {
        Some(node) if node != inc.from => Err(EngineError::NotItsSource {
            migration_id: inc.migration_id.clone(),
            from: inc.from.clone(),
            caller: node.to_owned(),
        }),
        _ => Ok(()),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IncomingState {
    Reserved,
    Received,
    Restored { pid: i32 },
}

/// A Peer step on the incoming slot, for its guards.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    Arm,
    TransferPages,
    PageTunnel,
    TransferImages,
    Restore,
    Commit,
    Abort,
}

impl Step {
    pub const ALL: [Step; 7] = [
        Step::Arm,
        Step::TransferPages,
        Step::PageTunnel,
        Step::TransferImages,
        Step::Restore,
        Step::Commit,
        Step::Abort,
    ];

    /// As the table names it.
    pub fn as_str(self) -> &'static str {
        match self {
            Step::Arm => "Arm",
            Step::TransferPages => "TransferPages",
            Step::PageTunnel => "PageTunnel",
            Step::TransferImages => "TransferImages",
            Step::Restore => "Restore",
            Step::Commit => "Commit",
            Step::Abort => "Abort",
        }
    }

    /// As errors name it ("migration m is received, not ready for arm").
    fn what(self) -> &'static str {
        match self {
            Step::Arm => "arm",
            Step::TransferPages => "pre-copy",
            Step::PageTunnel => "page tunnel",
            Step::TransferImages => "image transfer",
            Step::Restore => "restore",
            Step::Commit => "commit",
            Step::Abort => "abort",
        }
    }
}

impl IncomingState {
    fn name(&self) -> &'static str {
        match self {
            IncomingState::Reserved => "reserved",
            IncomingState::Received => "received",
            IncomingState::Restored { .. } => "restored",
        }
    }

    /// Whether `step` may run on a slot in this state.
    pub fn accepts(&self, step: Step) -> bool {
        use IncomingState::*;
        match step {
            Step::Arm | Step::TransferPages | Step::TransferImages => matches!(self, Reserved),
            Step::PageTunnel => matches!(self, Reserved | Received),
            Step::Restore => matches!(self, Received),
            Step::Commit => matches!(self, Restored { .. }),
            Step::Abort => true,
        }
    }

    /// The state `step` leaves the slot in when it succeeds (`None`: the
    /// slot is empty again), given the restored process's PID.
    pub fn after(&self, step: Step, restored_pid: i32) -> Option<IncomingState> {
        match step {
            Step::Arm | Step::TransferPages | Step::PageTunnel => Some(*self),
            Step::TransferImages => Some(IncomingState::Received),
            Step::Restore => Some(IncomingState::Restored { pid: restored_pid }),
            Step::Commit | Step::Abort => None,
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
    /// When it was prepared (ticks since boot, as its journal record says):
    /// a copy CRIU restored for it started later.
    pub(super) prepared_ticks: u64,
    /// Whether Arm started a capture for the ports.
    pub(super) armed: bool,
    /// In-cluster connections found in the images, and held here (nothing
    /// in or out) from before the restore to Commit or abort.
    pub(super) in_cluster: Vec<InClusterFlow>,
    /// Set (under its lock) when the slot is discarded: the image writer
    /// checks it, under the same lock, before each write. A transfer whose
    /// handler was dropped (the source cancelled the stream) leaves its
    /// writer thread writing what it had; it must not write into a
    /// directory being removed.
    pub(super) discarded: Arc<std::sync::Mutex<bool>>,
    /// Collective socket migration, from a successful Restore to the
    /// commit: the connections ferryd rebuilt, leaving repair mode on a
    /// thread of their own (`Rebuilt::leave_repair_early`); the commit
    /// takes them back and turns the rest out. Dropped unjoined (an
    /// abort), the thread ends and drops them, which closes them silently.
    pub(super) leaving: Option<std::thread::JoinHandle<crate::sockstate::Rebuilt>>,
    /// The CRIU that will restore, started at Prepare with the connection
    /// table (still empty) inherited, so that its start is not in the
    /// freeze. Dropped unused, it exits.
    pub(super) restore_worker: Option<RestoreWorker>,
    /// perf's scheduler hooks, held from Prepare until the slot ends, so
    /// that the restore's breakpoints do not wait for a grace period.
    pub(super) _sched_hooks: Option<criu::SchedHooks>,
    /// Incremental (protocol 7): the connections' sockets opened at Arm,
    /// until TransferSockets takes them; they close with the slot. The
    /// `IncomingSlot` points TransferSockets here without keeping them.
    pub(super) staged: Arc<StagedSlot>,
    /// The UDP sockets whose receive buffer the images were given for the
    /// replay and catch-up (`UDP_CATCH_UP_BUFFER`), with their own size,
    /// given back `UDP_CATCH_UP` after the resume. `None` until the restore
    /// raised them (once: a raised image has nothing left to raise).
    pub(super) udp_buffers: Option<Vec<(std::net::SocketAddr, i32)>>,
    /// Pre-copy (protocol 5): the pages received while the process still
    /// ran on the source.
    pub(super) pages: Arc<std::sync::Mutex<PageStore>>,
    /// Post-copy (protocol 6): CRIU's lazy-pages daemon, from just before
    /// the restore until Commit hands it to a watcher (or an abort kills
    /// it).
    pub(super) lazy: Option<criu::lazy::Daemon>,
    /// Pre-copy with pages left out of the dump: the page filler that
    /// installs them from the store, from just before the restore until
    /// Commit hands it to a watcher (or an abort kills it).
    pub(super) filler: Option<crate::fill::handle::Filler>,
    /// Post-copy with pages that follow (protocol 10): what the source's
    /// page stream feeds, from the Restore until Commit registers it.
    pub(super) following: Option<Arc<pages_follow::Following>>,
    /// Pre-copy: a filler process started after the first round, waiting
    /// for the plan the restore gives it (dropped unused: killed).
    pub(super) filler_ahead: Option<crate::fill::handle::Spawned>,
    /// Post-copy: the page tunnel, from PageTunnel until the daemon's end
    /// (the pump outlives the slot after Commit) or an abort.
    pub(super) tunnel: Option<IncomingTunnel>,
    /// What Prepare was told of the process's size, for the re-checks as
    /// its pre-copied pages arrive.
    pub(super) announced: capacity::Announced,
    /// What the migration takes of this node's memory, sampled from
    /// Prepare to the end of the work after the resume.
    pub(super) peak: Arc<peak::PeakMeter>,
    pub(super) dir: PathBuf,
    pub(super) state: IncomingState,
    pub(super) last_activity: Instant,
}

impl Incoming {
    /// The slot's state once `step` succeeded on it (`pid`: the restored
    /// process, for Restore). Commit and Abort empty the slot instead.
    fn advance(&mut self, step: Step, pid: i32) {
        if let Some(next) = self.state.after(step, pid) {
            self.state = next;
        }
    }
    fn images(&self) -> PathBuf {
        self.dir.join("images")
    }
}

/// Removes a slot's traces: a restored copy (killed; it never ran) and the
/// image directory, then releases the reserved ports. The ports stay frozen
/// until the copy is dead, so its closing sockets cannot reach the peers.
pub(super) async fn discard(engine: &Arc<Engine>, incoming: &Incoming) {
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
    // The filler goes with the copy it fed (dropping the slot reaps it),
    // and pages that follow are no longer taken.
    if let Some(f) = &incoming.filler {
        f.signal_kill();
    }
    if let Some(f) = &incoming.following {
        engine.incoming.follows.remove(&f.migration_id);
    }
    if let IncomingState::Restored { pid } = incoming.state {
        if let Err(e) = kill(Pid::from_raw(pid), Signal::SIGKILL) {
            tracing::warn!(pid, error = %e, "killing the restored copy");
        }
        crate::engine::wait_dead(pid).await;
        // The restore's CRIU may still hold the connections handed to it.
        crate::engine::settle_criu_exits().await;
    }
    // Nothing restored, or gone: a restart has nothing to kill.
    if let Err(e) = engine.journal.remove_incoming(&incoming.migration_id) {
        tracing::error!(error = %e, "removing the migration's journal record");
    }
    crate::engine::keep_logs(
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

/// Kills the copies of migration `migration_id`'s process (prepared at
/// `since`, ticks since boot) that no record names: a restore CRIU
/// finished for an agent that died before recording it, or the tasks of
/// a CRIU that died in the restore, which run on
/// ([`crate::process::unrecorded_copies`], in any state). Each goes with
/// its PID namespace, reaped by the supervisor when it is this agent's
/// child. Returns how many.
pub(crate) async fn kill_unrecorded_copies(
    engine: &Arc<Engine>,
    migration_id: &str,
    since: u64,
    argv: &[String],
) -> usize {
    let managed: Vec<i32> = engine.processes.registry().iter().map(|p| p.pid).collect();
    let argv = argv.to_vec();
    let copies = crate::engine::blocking("looking for copies no record names", move || {
        crate::process::unrecorded_copies(since, &argv, &managed, crate::process::CopyState::Any)
    })
    .await
    .unwrap_or_default();
    for &pid in &copies {
        tracing::warn!(pid, migration = %migration_id, "killing a copy no record names (CRIU restored it for an agent that died, or died in the restore); it never ran as the process");
        engine
            .supervisor
            .watch_exit(pid, "left by a restore no one recorded");
        if let Err(e) = kill(Pid::from_raw(pid), Signal::SIGKILL) {
            tracing::warn!(pid, error = %e, "killing a copy no record names");
        }
        crate::engine::wait_dead(pid).await;
    }
    copies.len()
}

/// Records incoming migration `inc` (its process `pid` here) at `stage`
/// in the journal, for a restart of this agent
/// ([`crate::engine::journal`]).
pub(super) fn record(
    engine: &Engine,
    inc: &Incoming,
    pid: i32,
    stage: IncomingStage,
) -> Result<(), EngineError> {
    let start_ticks = crate::process::inspect(pid)?.start_ticks;
    engine.journal.write(&Record::Incoming {
        migration_id: inc.migration_id.clone(),
        pid,
        start_ticks,
        argv: inc.argv.clone(),
        from: inc.from.clone(),
        stage,
    })?;
    Ok(())
}

/// Removes the holds on a migration's in-cluster connections.
pub(super) async fn release_holds(engine: &Arc<Engine>, flows: &[InClusterFlow]) {
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
pub(super) fn in_cluster_addresses(
    engine: &Engine,
    from: &str,
) -> Result<(std::net::IpAddr, Vec<std::net::IpAddr>), EngineError> {
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

/// Holds `flows` until the commit (blocking: BPF map updates). All holds
/// or none.
pub(super) fn hold_in_cluster(
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

/// A CRIU started ahead of a restore (at Prepare), and the connection table
/// it inherited, empty until the restore writes it.
#[derive(Debug)]
pub(super) struct RestoreWorker {
    pub(super) worker: criu::Worker,
    pub(super) table: OwnedFd,
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

pub(super) fn expect<'a>(
    slot: &'a mut Option<Incoming>,
    migration_id: &str,
    step: Step,
) -> Result<&'a mut Incoming, EngineError> {
    let Some(inc) = slot.as_mut().filter(|i| i.migration_id == migration_id) else {
        return Err(EngineError::UnknownMigration {
            migration_id: migration_id.to_owned(),
        });
    };
    if !inc.state.accepts(step) {
        return Err(EngineError::WrongState {
            migration_id: migration_id.to_owned(),
            state: inc.state.name(),
            step: step.what(),
        });
    }
    inc.last_activity = Instant::now();
    Ok(inc)
}
