//! Abort, from any phase before the commit point (and a Commit the
//! destination refused or, asked, says it never committed):
//! the process resumes here, then the destination hears it (`Peer.Abort`)
//! and drops images, captured packets and any restored copy. Nothing is
//! lost: the source resumed first, in case the destination is what failed.
//!
//! The undo ledger says what to undo: the page server (post-copy) goes,
//! the peers' translations are removed (their packets must come here
//! again), dirty tracking ends (no write protection outlives a migration),
//! connections ferryd held in repair mode leave it with their own
//! SO_REUSEADDR, the process resumes with every TCP socket out of repair
//! mode, and what arrived while it was frozen is replayed in order before
//! its ports pass packets again.

use std::time::Duration;

use ferry_proto::v1::{AbortRequest, MigrationOutcome};

use super::run::{Run, out_stage};
use super::undo::{stop_page_server, untranslate_in_cluster};
use super::{Phase, Stop};
use crate::engine::{EngineError, rollback};
use crate::managed::{Lifecycle, OutStage};

/// How many more times the source tells an unresponsive destination that a
/// migration is aborted (once a second, each bounded by peer_timeout_secs).
const ABORT_RETRIES: u32 = 300;

pub(super) async fn abort(run: &mut Run, err: EngineError) -> Phase {
    tracing::warn!(error = %err, "migration failed; rolling back");
    run.report.outcome = MigrationOutcome::Aborted as i32;
    run.report.error = err.to_string();
    run.report.error_code = err.code() as i32;
    if let Err(e) = run.finish_collecting().await {
        tracing::error!(error = %e, "collecting the capture ring");
    }
    // Post-copy: CRIU's page server holds the process; it goes first (the
    // destination's copy never ran: nothing needs it).
    stop_page_server(run.undo.page_server.take(), run.p.pid, Duration::ZERO).await;
    // Pages that follow: the stream stops (the destination discards what
    // it received with its copy).
    run.undo.page_sending = None;
    // The in-cluster peers' packets must come here again before the
    // process runs.
    let translated = std::mem::take(&mut run.undo.translated);
    untranslate_in_cluster(&run.engine, &run.p.migration_id, translated).await;
    // No write protection may outlive the migration.
    if let Some(pre) = run.undo.precopy.take()
        && let Err(e) = tokio::task::spawn_blocking(move || pre.stop()).await
    {
        tracing::error!(error = %e, "ending dirty-page tracking");
    }
    // Connections read for a collective migration leave repair mode, with
    // their own SO_REUSEADDR, before the process runs (resume_on_source
    // would clear any left, without that).
    if let Some(held) = run.undo.held.take()
        && let Err(e) = held.resume()
    {
        tracing::error!(error = %e, "taking the process's connections out of repair mode");
    }
    let resumed = resume_here(run).await;
    // Whatever happened above, the process is ours and running.
    let pid = run.p.pid;
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
        Ok(()) => run.report.resumed_on_source = true,
        Err(e) => {
            tracing::error!(error = %e, "could not resume the process on the source");
            run.report
                .error
                .push_str(&format!("; resuming on the source failed: {e}"));
        }
    }
    // A socket transfer still in flight ends first: the abort must find
    // the rebuilt copies there, to close them.
    if let Some(task) = run.undo.sockets_sending.take()
        && let Ok(Err(e)) = task.await
    {
        tracing::debug!(error = %e, "the socket transfer ended with the migration");
    }
    tell_destination(run, &err).await;
    // Ports released at the commit point (a Commit the destination
    // refused) come back by the peers' word, the destination's reservation
    // gone with the Abort: asked now rather than at the next periodic
    // pass, meanwhile every node drops their packets.
    if let Err(e) = run.engine.ports.refresh().await {
        tracing::error!(error = %e, "claiming the resumed process's ports again");
    }
    Phase::Done(Stop::Aborted)
}

/// Resumes the stopped process, sockets out of repair mode; with a capture
/// here, egress opens first and what arrived while it was frozen is
/// replayed, in order, before its ports pass packets again.
async fn resume_here(run: &mut Run) -> Result<(), EngineError> {
    let (pid, id) = (run.p.pid, run.p.migration_id.clone());
    if !run.undo.capturing_here {
        return crate::engine::blocking("resuming on the source", move || {
            rollback::resume_on_source(pid)
        })
        .await?;
    }
    // Egress opens, ingress is still kept; the process runs and gets what
    // arrived while it was frozen, in order, before its ports pass packets
    // again.
    run.engine
        .processes
        .set_lifecycle(pid, out_stage(&id, OutStage::Resuming));
    if let Err(e) = run.engine.ports.apply().await {
        tracing::error!(error = %e, "opening the ports of the resumed process");
    }
    let engine = run.engine.clone();
    let (resumed, replay) = crate::engine::blocking("resuming on the source", move || {
        let resumed = rollback::resume_on_source(pid);
        let replay = engine.dataplane.replay_and_open(&id, &[], &[], &[], || {
            engine.processes.set_lifecycle(pid, Lifecycle::Running);
            engine.ports.apply_now()
        });
        (resumed, replay)
    })
    .await?;
    match replay {
        Ok(stats) => run.report.replay = Some(stats),
        Err(e) => tracing::error!(error = %e, "replaying on the source"),
    }
    resumed
}

/// Tells the destination the migration is aborted; one that does not
/// acknowledge at once is told again in the background: it must hear it
/// eventually, or it keeps the images and the ports frozen.
async fn tell_destination(run: &Run, err: &EngineError) {
    let abort = AbortRequest {
        migration_id: run.p.migration_id.clone(),
        reason: err.to_string(),
    };
    let deadline = run.deadline;
    let first = tokio::time::timeout(deadline, run.p.link.abort(abort.clone())).await;
    if matches!(first, Ok(Ok(_))) {
        return;
    }
    tracing::warn!(
        ?first,
        "destination did not acknowledge the abort; retrying in the background"
    );
    keep_telling(run.p.link.clone(), abort, deadline, Duration::from_secs(1));
}

/// Tells the destination, in the background, that a migration is
/// aborted (after `first_after`, then once a second, [`ABORT_RETRIES`]
/// times, each bounded by `deadline`) until it acknowledges: it must hear
/// it eventually, or it keeps the images and the ports frozen.
pub(super) fn keep_telling(
    link: std::sync::Arc<dyn crate::engine::link::PeerLink>,
    abort: AbortRequest,
    deadline: Duration,
    first_after: Duration,
) {
    tokio::spawn(async move {
        for attempt in 1..=ABORT_RETRIES {
            let wait = if attempt == 1 {
                first_after
            } else {
                Duration::from_secs(1)
            };
            tokio::time::sleep(wait).await;
            match tokio::time::timeout(deadline, link.abort(abort.clone())).await {
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
