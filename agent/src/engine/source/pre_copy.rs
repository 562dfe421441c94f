//! PreCopy (strategies `pre-copy`, `queued-pre-copy` and the live pass of
//! `assisted-post-copy`): dirty tracking starts on every process of the
//! tree, and rounds stream the private memory to the destination while the
//! process runs, until the convergence predicate says freeze
//! ([`crate::engine::precopy`]). Tracking stays on until the dump is done
//! (or an abort ends it before the process resumes).

use std::time::Instant;

use ferry_proto::v1::{MigrationEvent, migration_event};

use super::Phase;
use super::run::Run;
use crate::engine::EngineError;
use crate::engine::precopy::{Link, Precopy};

pub(super) async fn pre_copy(run: &mut Run) -> Result<Phase, EngineError> {
    let started = Instant::now();
    let mut pre = Precopy::start(run.p.pid, run.p.strategy).await?;
    pre.compressor = run.p.compression.clone();
    let events = run.events();
    let mut sent = run.report.bytes_transferred;
    let link = Link {
        peer: run.p.link.as_ref(),
        migration_id: &run.p.migration_id,
        destination: &run.p.destination,
        deadline: run.deadline,
        cancel: &run.p.cancel,
    };
    let mut progress = run.progress(String::new());
    let result = pre
        .rounds(link, run.p.convergence, |r| {
            sent += r.sent_bytes;
            progress.phase = format!("pre-copy round {}", r.round);
            progress.elapsed_us = run.p.started.elapsed().as_micros() as u64;
            progress.bytes_transferred = sent;
            // The migration goes on if the caller stopped listening.
            let _ = events.try_send(Ok(MigrationEvent {
                event: Some(migration_event::Event::Progress(progress.clone())),
            }));
        })
        .await;
    run.report.rounds = pre.rounds.clone();
    run.report.convergence = pre.convergence.clone();
    run.report.throttled_to_percent = pre.throttled_to;
    // What crossed: compressed pages count at their size on the wire.
    run.report.bytes_transferred += pre.bytes_sent - pre.lz4_raw_bytes + pre.lz4_bytes;
    run.report.compressed_page_bytes += pre.lz4_raw_bytes;
    run.report.compressed_to_bytes += pre.lz4_bytes;
    // The freeze's pages images start where the rounds left off.
    run.p.compression = pre.compressor.clone();
    run.report.preparation_time_us = started.elapsed().as_micros() as u64;
    // Tracking is on until the dump: an abort from here on ends it.
    run.undo.precopy = Some(pre);
    result?;
    Ok(run.after_pre_copy())
}
