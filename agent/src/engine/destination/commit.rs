//! `Peer.Commit`: the holds go, egress opens, the rebuilt connections leave
//! repair mode, the process resumes and the captured packets are replayed;
//! then the ports pass packets and the process is managed here.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_proto::v1::{CommitRequest, CommitResponse};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use super::fill::{FillWatch, watch_fill};
use super::{
    Incoming, IncomingState, PostCopyWatch, Step, UDP_CATCH_UP_BUFFER, expect, record,
    release_holds, watch_postcopy,
};
use crate::criu;
use crate::dataplane::PortState;
use crate::engine::fault_point::{self, Side};
use crate::engine::journal::IncomingStage;
use crate::engine::{Engine, EngineError};
use crate::managed::{Lifecycle, ManagedProcess, Origin};
use crate::process::{self, SocketSummary};

pub(super) const UDP_CATCH_UP: Duration = Duration::from_secs(2);

pub async fn commit(
    engine: &Arc<Engine>,
    req: CommitRequest,
) -> Result<CommitResponse, EngineError> {
    let entered = Instant::now();
    // The datagrams the process left unread on the source, as the packets
    // they arrived as: checked before anything happens.
    let carried = crate::engine::queued::packets_from_commit(
        &req.queued_datagrams,
        crate::engine::queued::LocalAddresses {
            public: engine.config.public.addresses(),
            cluster: engine.config.cluster.address,
        },
    )?;
    let mut slot = engine.incoming.lock().await;
    let us = move || entered.elapsed().as_micros() as u64;
    tracing::debug!(us = us(), "commit: slot taken");
    let inc = expect(&mut slot, &req.migration_id, Step::Commit)?;
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
    // Pages left out: a filler that already failed means missing pages,
    // refused likewise (FAILED_PRECONDITION: the source resumes its copy);
    // one already done filled them all.
    let mut filled_before_resume = None;
    if let Some(f) = inc.filler.as_mut() {
        match f.early_end() {
            None => {}
            Some(Ok(stats)) => filled_before_resume = Some(stats),
            Some(Err(why)) => {
                return Err(EngineError::NotResumed(format!(
                    "its page filler failed before the resume: {why}"
                )));
            }
        }
    }
    decide(engine, inc, pid).await?;
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
    // UDP sockets were restored with room for what the replay pours into
    // them; their own size comes back after the catch-up.
    let udp_buffers = inc.udp_buffers.take().filter(|b| !b.is_empty());
    let handed = Replaying {
        delivered: req.delivered_digests,
        unread: req.unread_datagrams,
        carried,
        entered,
    };
    let (replay, resumed_early) = resume_and_replay(engine, inc, pid, handed).await?;
    filler_may_install(inc);
    let resumed_at = resumed_early.unwrap_or_else(Instant::now);
    let running_for = || resumed_at.elapsed().as_micros() as u64;
    if let Some(before) = udp_buffers {
        give_back_udp_buffers_later(pid, before);
    }
    // Remembered for a restart of this agent, now the freeze is over.
    engine.processes.persist_soon();
    prune_journal(engine);
    // The images go after the answer: a thousand files to unlink would
    // otherwise hold up the source's confirmation (the process runs
    // already). The directory is the migration's own; the next migration
    // gets another.
    let mut peak_extra_bytes = 0;
    if let Some(mut inc) = slot.take() {
        peak_extra_bytes = inc.peak.peak();
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
                    peak: inc.peak.clone(),
                },
            );
            tracing::info!(pid, migration = %req.migration_id, "migration committed; process runs here, its pages follow");
            return Ok(CommitResponse {
                pid,
                replay,
                running_for_us: running_for(),
                peak_extra_bytes: inc.peak.peak(),
            });
        }
        // Pages left out of the dump: the filler still installs them; the
        // directory (the plan, the socket, the log) goes when it ends.
        if let Some(filler) = inc.filler.take() {
            // Pages that follow: the source's stream may open now.
            let follows = inc.following.take().map(|f| {
                super::pages_follow::await_pages(f);
                inc.migration_id.clone()
            });
            watch_fill(
                engine,
                FillWatch {
                    follows,
                    migration_id: inc.migration_id.clone(),
                    from: inc.from.clone(),
                    pid,
                    filler,
                    dir: inc.dir.clone(),
                    resumed_at,
                    filled_before_resume,
                    peak: inc.peak.clone(),
                },
            );
            tracing::info!(pid, migration = %req.migration_id, "migration committed; process runs here, its held pages go in");
            return Ok(CommitResponse {
                pid,
                replay,
                running_for_us: running_for(),
                peak_extra_bytes: inc.peak.peak(),
            });
        }
        let keep_logs = crate::engine::keeps_every_log(&engine.config)
            .then(|| (engine.config.work_dir.clone(), req.migration_id.clone()));
        tokio::task::spawn_blocking(move || {
            if let Some((work_dir, id)) = keep_logs {
                crate::engine::keep_logs(&work_dir, &inc.dir, &id);
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
        peak_extra_bytes,
    })
}

/// The connections a [`Incoming::leaving`] thread took out of repair mode
/// (blocking until it is done: ~2 ms for a thousand, started at the end of
/// the restore).
pub(super) fn joined(
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
pub(super) fn resume_rebuilt(rebuilt: &mut Option<crate::sockstate::Rebuilt>) {
    if let Some(r) = rebuilt.as_mut()
        && let Err(e) = r.resume()
    {
        tracing::error!(error = %e, "taking the rebuilt connections out of repair mode");
    }
}

/// The process runs: the page filler's background installs start (in the
/// freeze they would have taken the CPUs from it).
fn filler_may_install(inc: &Incoming) {
    if let Some(f) = inc.filler.as_ref()
        && let Err(e) = f.resumed()
    {
        tracing::warn!(error = %e, "telling the page filler the process resumed");
    }
}

/// SIGCONT to every process of the restored tree.
pub(super) fn resume(pid: i32) {
    for p in process::process_tree(pid) {
        if let Err(e) = kill(Pid::from_raw(p), Signal::SIGCONT) {
            tracing::warn!(pid = p, error = %e, "SIGCONT");
        }
    }
}

/// What the Commit hands the replay.
struct Replaying {
    /// Digests of what the source delivered between Arm and the freeze.
    delivered: Vec<u64>,
    /// Keys of the UDP datagrams the source delivered but left unread.
    unread: Vec<u64>,
    /// Those datagrams, whole, as the packets they arrived as.
    carried: Vec<Vec<u8>>,
    /// When the Commit arrived, for the debug log's timings.
    entered: Instant,
}

/// Resumes the restored process, with what it missed: egress opens first,
/// so that the ACKs (and window updates) the stack sends for replayed
/// segments get out; ingress stays captured while the packets captured so
/// far are replayed, so none is overtaken; then the ports pass packets like
/// any owned port. Returns the replay's figures and when the process
/// resumed (if it did).
async fn resume_and_replay(
    engine: &Arc<Engine>,
    inc: &mut Incoming,
    pid: i32,
    handed: Replaying,
) -> Result<(Option<ferry_proto::v1::ReplayStats>, Option<Instant>), EngineError> {
    // Open egress first: the ACKs (and window updates) the stack sends for
    // replayed segments must get out. Ingress stays captured while the
    // packets captured so far are replayed, so none is overtaken; then the
    // ports pass packets like any owned port. The process resumes before
    // the replay, not after it: measured A/B at 1024 connections (26
    // migrations each, commit a142dcf), the freeze fell by 22 ms (the
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
    let mut resumed_early = None;
    let replay = if inc.armed {
        engine.ports.reserve(&inc.ports, PortState::Releasing);
        let replayed = match engine.ports.apply().await {
            Ok(()) => {
                let (a, id, ports) = (engine.clone(), inc.migration_id.clone(), inc.ports.clone());
                let Replaying {
                    delivered,
                    unread,
                    carried,
                    entered,
                } = handed;
                let us = move || entered.elapsed().as_micros() as u64;
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
            segments = stats.replayed_segments,
            input_backlog_drops = stats.input_backlog_drops,
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
    Ok((replay, resumed_early))
}

/// The UDP sockets' own receive buffers, given back once the catch-up after
/// the replay is over.
fn give_back_udp_buffers_later(pid: i32, before: Vec<(std::net::SocketAddr, i32)>) {
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

/// The decision, recorded before the process runs: from here the process
/// is this node's, also for a restart of this agent, and the source's
/// question (an Abort) is answered "committed".
async fn decide(engine: &Arc<Engine>, inc: &Incoming, pid: i32) -> Result<(), EngineError> {
    record(engine, inc, pid, IncomingStage::Committed)?;
    fault_point::reached(Side::Destination, "Committed").await;
    Ok(())
}

/// Keeps the journal's committed records to the last
/// [`COMMITTED_KEPT`](crate::engine::journal::COMMITTED_KEPT), off the
/// runtime and after the answer's way.
fn prune_journal(engine: &Arc<Engine>) {
    let journal = engine.journal.clone();
    tokio::task::spawn_blocking(move || {
        journal.prune_committed(crate::engine::journal::COMMITTED_KEPT)
    });
}
