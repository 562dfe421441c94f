//! Commit: carries the source's delivered log and the UDP datagrams the
//! process left unread (whole from protocol 8, see
//! `crate::engine::queued`; as keys from 4); the destination resumes the
//! process and replays what it captured, and answers how long the process
//! had been running, which comes off the freeze. Retried a few times: the
//! copy here is released, the destination holds the process. A
//! destination that cannot resume the process refuses (FAILED_PRECONDITION:
//! post-copy's lazy-pages daemon, or the page filler of pages left out of
//! the dump, already failed), and the migration rolls back to the intact
//! copy here. A refusal can only be that: after a Commit that resumed the
//! process (its answer lost) the destination no longer holds the
//! migration, and a retry finds NOT_FOUND. Then, or when no answer came
//! at all, the source asks the destination what it decided
//! (`Peer.Abort`, whose answer says whether it had committed: protocol
//! 11), as long as it takes: committed, the migration goes on; not, the
//! destination's copy is gone and the migration rolls back here. Until
//! the answer the copy here stays stopped ("in doubt"). The journal
//! says released from before the first Commit, so that a restart of
//! this agent asks the same question ([`crate::engine::recover`]).
//!
//! The report's freeze is cut into its parts here (`freeze_parts`: CRIU's
//! dump, the transfer, the destination's image scan, CRIU's start-up and
//! restore, translation, release, replay, and what the calls around them
//! cost), which add up to the freeze time.

use std::time::{Duration, Instant};

use ferry_proto::v1::{AbortRequest, CommitRequest, PhaseTiming};

use super::carry::{Committing, Waiting};
use super::run::{Run, out_stage};
use super::{Phase, Stop};
use crate::engine::EngineError;
use crate::engine::fault_point::{self, Side};
use crate::engine::journal::OutgoingStage;
use crate::engine::link::peer_error;
use crate::engine::queued;
use crate::managed::OutStage;

/// How many times the Commit is sent before the migration is reported
/// committed without the destination's confirmation.
const COMMIT_ATTEMPTS: u32 = 5;

/// How long between two questions to a destination that did not say
/// whether it committed.
const ASK_AGAIN: Duration = Duration::from_secs(1);

pub(super) async fn commit(run: &mut Run, mut c: Committing) -> Result<Phase, EngineError> {
    // From the first Commit sent only the destination knows whether the
    // process resumed there: a restart of this agent must ask it, not
    // resume the copy here (`crate::engine::recover`).
    run.record(OutgoingStage::Released)?;
    fault_point::reached(Side::Source, "Committing").await;
    let postcopy = run.p.strategy.is_postcopy();
    let unread = queued::for_commit(
        run.p.protocol_version,
        std::mem::take(&mut c.restored.unread),
    );
    if unread.left_out > 0 {
        tracing::warn!(
            carried = unread.datagrams.len(),
            left_out = unread.left_out,
            budget_bytes = queued::COMMIT_PAYLOAD_BUDGET,
            "more unread UDP datagrams than one Commit carries: the newest are lost"
        );
    }
    let mut last_err = None;
    let mut running_for = Duration::ZERO;
    // The destination remembers what it committed, and says so.
    let decided = run.p.protocol_version >= ferry_proto::PEER_PROTOCOL_DECIDED;
    for attempt in 0..COMMIT_ATTEMPTS {
        let req = CommitRequest {
            migration_id: run.p.migration_id.clone(),
            delivered_digests: c.delivered.clone(),
            unread_datagrams: unread.keys.clone(),
            queued_datagrams: unread.datagrams.clone(),
        };
        match run.p.link.commit(req).await {
            Ok(r) => {
                run.report.destination_pid = r.pid;
                run.report.replay = r.replay;
                run.note_destination_peak(r.peak_extra_bytes);
                running_for = Duration::from_micros(r.running_for_us);
                last_err = None;
                break;
            }
            // The destination refused to resume the process (its pages
            // could not all be installed); ours is intact.
            Err(s) if s.code() == tonic::Code::FailedPrecondition => {
                return Err(peer_error(&run.p.destination.name, s));
            }
            // A Commit that resumed the process (its answer lost) left
            // nothing for a retry to find.
            Err(s) if s.code() == tonic::Code::NotFound && decided => {
                last_err = Some(peer_error(&run.p.destination.name, s));
                break;
            }
            Err(s) => {
                tracing::warn!(attempt, status = %s, "commit not confirmed; retrying");
                // Whether the destination resumed the process is unknown
                // from here until it answers.
                if decided && attempt == 0 {
                    run.engine.processes.set_lifecycle(
                        run.p.pid,
                        out_stage(&run.p.migration_id, OutStage::InDoubt),
                    );
                }
                last_err = Some(peer_error(&run.p.destination.name, s));
                tokio::time::sleep(Duration::from_millis(100 << attempt)).await;
            }
        }
    }
    // Not confirmed: the destination says what it decided, however long
    // that takes; until then the copy here stays stopped (resuming it
    // could run the process twice, killing it could lose it).
    if let Some(e) = last_err.take_if(|_| decided) {
        tracing::warn!(error = %e, "the Commit's answer not heard: asking the destination what it decided");
        if !ask_until_decided(run).await {
            return Err(EngineError::Peer {
                node: run.p.destination.name.clone(),
                code: tonic::Code::Aborted,
                message: format!(
                    "the Commit was not confirmed ({e}), and the destination had not resumed the process: it aborted its copy"
                ),
            });
        }
    }
    let commit_end = Instant::now();
    // Pages that follow: all of them now, not only those asked for.
    if let Some(s) = &run.undo.page_sending {
        s.release();
    }
    cut_the_freeze(run, &c, commit_end, running_for);
    Ok(if postcopy {
        Phase::PostCopy(Waiting {
            resumed: commit_end,
            commit_err: last_err,
        })
    } else {
        Phase::Discard(Stop::Committed(last_err))
    })
}

/// Asks the destination (`Peer.Abort`, answered with whether it had
/// committed) until it answers; the process here is in doubt meanwhile.
/// True if the destination had committed.
async fn ask_until_decided(run: &mut Run) -> bool {
    let req = AbortRequest {
        migration_id: run.p.migration_id.clone(),
        reason: "the source did not hear the Commit's answer".into(),
    };
    run.engine
        .processes
        .set_lifecycle(run.p.pid, out_stage(&run.p.migration_id, OutStage::InDoubt));
    let mut attempt = 0u32;
    loop {
        attempt += 1;
        match tokio::time::timeout(run.deadline, run.p.link.abort(req.clone())).await {
            Ok(Ok(r)) => {
                tracing::info!(
                    committed = r.committed,
                    attempt,
                    "the destination said what it decided"
                );
                return r.committed;
            }
            other => {
                if attempt == 1 || attempt.is_multiple_of(30) {
                    tracing::warn!(attempt, answer = ?other.map(|r| r.map(drop)), "the destination does not say what it decided; asking again");
                }
            }
        }
        tokio::time::sleep(ASK_AGAIN).await;
    }
}

/// The freeze and its parts, in the report. The freeze ends when the
/// process ran again on the destination: what the destination did after
/// its resume (a replay, the answer) is not freeze. The answer's way back
/// still counts, a little too long.
fn cut_the_freeze(run: &mut Run, c: &Committing, commit_end: Instant, running_for: Duration) {
    let r = &c.restored;
    let resumed = commit_end
        .checked_sub(running_for)
        .unwrap_or(commit_end)
        .max(c.release_end);
    run.report.freeze_time_us = (resumed - r.freeze_start).as_micros() as u64;
    let us = |from: Instant, to: Instant| (to - from).as_micros() as u64;
    // Only the part of the replay the process waited for.
    let replay_us = run
        .report
        .replay
        .map(|r| r.replay_time_us)
        .unwrap_or(0)
        .saturating_sub(running_for.as_micros() as u64);
    let restore_rpc_us = us(r.transfer_end, r.restore_end);
    run.report.freeze_parts = [
        (
            "dump (CRIU, process stopped)",
            us(r.freeze_start, r.dump_end),
        ),
        (
            "transfer (and the sockets' state beside it)",
            us(r.dump_end, r.transfer_end),
        ),
        ("restore: image scan", r.image_scan_us),
        ("restore: CRIU start-up", r.criu_startup_us),
        (
            "restore: CRIU",
            r.restore_criu_us.saturating_sub(r.criu_startup_us),
        ),
        (
            "restore: other",
            restore_rpc_us.saturating_sub(r.restore_criu_us + r.image_scan_us),
        ),
        ("translate", us(r.restore_end, c.translate_end)),
        ("release", us(c.translate_end, c.release_end)),
        ("commit: replay", replay_us),
        (
            "commit: other",
            us(c.release_end, resumed).saturating_sub(replay_us),
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
}
