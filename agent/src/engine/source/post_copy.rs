//! PostCopy: after the Commit the process runs on the destination while its
//! pages follow (CRIU's lazy-pages daemon there, fed by CRIU's page server
//! here through the page tunnel). The stopped copy here and the page server
//! stay until the destination reports its daemon's end
//! (`Peer.PostCopyStatus`, long polls); then the copy goes. A failed daemon
//! means the destination killed the process: the migration is lost
//! (nothing can bring back what it did since its resume), and the report
//! says so. A destination that cannot be asked: the copy stays while the
//! page server still has a connection, then [`POSTCOPY_UNCONFIRMED`] more,
//! and the migration is reported committed with an error saying it was
//! never confirmed. With pages that follow by ferryd, a destination that
//! cannot be asked once the page stream broke off with pages unsent
//! cannot have them (the stream is not taken up again): the migration is
//! lost (the destination's page filler kills the process there, even
//! with its ferryd gone).
//!
//! Pages that follow by ferryd (protocol 10): no page server; the dump
//! left the private pages in the stopped copy, and the stream opened
//! before the Restore (`crate::engine::pagesender`), which carried only
//! the pages the destination asked for until the Commit, now carries them
//! all, asks first, while this phase waits for the destination's word as
//! above.

use std::time::{Duration, Instant};

use ferry_proto::v1::{PostCopyState, PostCopyStatusRequest, PostCopyStatusResponse};

use super::carry::Waiting;
use super::run::Run;
use super::undo::stop_page_server;
use super::{Phase, Stop};
use crate::engine::EngineError;

/// How long the source keeps a page server whose destination does not
/// answer PostCopyStatus once the page server's connection is gone.
const POSTCOPY_UNCONFIRMED: Duration = Duration::from_secs(30);

pub(super) async fn post_copy(run: &mut Run, w: Waiting) -> Phase {
    let Waiting {
        resumed,
        commit_err,
    } = w;
    let deadline = run.deadline;
    let sender = run.undo.page_sending.take();
    if run.p.pages_follow && sender.is_none() {
        // Nothing was left out: nothing follows, no fill to wait for.
        return Phase::Discard(Stop::Committed(commit_err));
    }
    let mut silent_since: Option<Instant> = None;
    let verdict = loop {
        let ask = run.p.link.post_copy_status(PostCopyStatusRequest {
            migration_id: run.p.migration_id.clone(),
            wait_ms: 2000,
        });
        let why = match tokio::time::timeout(deadline + Duration::from_secs(2), ask).await {
            Ok(Ok(r)) => match PostCopyState::try_from(r.state) {
                Ok(PostCopyState::Running) => {
                    silent_since = None;
                    continue;
                }
                Ok(PostCopyState::Done | PostCopyState::Failed) => break Ok(r),
                _ => format!("post-copy state {} unknown", r.state),
            },
            Ok(Err(s)) => s.message().to_owned(),
            Err(_) => format!("no answer within {} s", deadline.as_secs() + 2),
        };
        // No word from the destination, and pages it will never get: it
        // cannot have gone on with them.
        if sender.as_ref().is_some_and(|s| s.broke_off()) {
            break Err(Unconfirmed::PagesCut(why));
        }
        // No word from the destination. While the page server is still
        // connected the daemon may still need it: keep it. Once it is not,
        // the daemon has ended one way or the other; wait a little for the
        // destination to say which.
        let serving = run
            .undo
            .page_server
            .as_ref()
            .is_some_and(|s| !s.task.is_finished())
            || sender.as_ref().is_some_and(|s| !s.is_finished());
        if !serving {
            let since = *silent_since.get_or_insert_with(Instant::now);
            if since.elapsed() > POSTCOPY_UNCONFIRMED {
                break Err(Unconfirmed::Silent(why));
            }
        }
        tracing::warn!(reason = %why, serving, "post-copy status unknown; asking again");
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    if let Some(task) = sender {
        task.end(matches!(&verdict, Ok(r) if r.state == PostCopyState::Done as i32))
            .await;
    }
    let stop = match verdict {
        Ok(r) if r.state == PostCopyState::Done as i32 => {
            stop_page_server(
                run.undo.page_server.take(),
                run.p.pid,
                Duration::from_secs(10),
            )
            .await;
            take_figures(run, &r);
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
            stop_page_server(run.undo.page_server.take(), run.p.pid, Duration::ZERO).await;
            take_figures(run, &r);
            run.report.post_processing_time_us = resumed.elapsed().as_micros() as u64;
            Stop::Lost(EngineError::Peer {
                node: run.p.destination.name.clone(),
                code: tonic::Code::DataLoss,
                message: format!("post-copy failed after the resume: {}", r.error),
            })
        }
        Err(Unconfirmed::PagesCut(why)) => {
            run.report.post_processing_time_us = resumed.elapsed().as_micros() as u64;
            Stop::Lost(EngineError::Peer {
                node: run.p.destination.name.clone(),
                code: tonic::Code::DataLoss,
                message: format!(
                    "post-copy failed after the resume: the page stream broke off with pages unsent, and the destination does not answer ({why}); its page filler kills the process there"
                ),
            })
        }
        Err(Unconfirmed::Silent(why)) => {
            stop_page_server(
                run.undo.page_server.take(),
                run.p.pid,
                Duration::from_secs(1),
            )
            .await;
            run.report.post_processing_time_us = resumed.elapsed().as_micros() as u64;
            Stop::Committed(Some(EngineError::Internal(format!(
                "post-copy: {} never confirmed that every page arrived ({why}); the source's copy was discarded once the pages had stopped flowing for {} s",
                run.p.destination.name,
                POSTCOPY_UNCONFIRMED.as_secs()
            ))))
        }
    };
    Phase::Discard(stop)
}

/// Why the destination's word on the fill never came.
enum Unconfirmed {
    /// It did not answer for [`POSTCOPY_UNCONFIRMED`] once the pages had
    /// stopped flowing.
    Silent(String),
    /// It does not answer, and the page stream broke off with pages
    /// unsent.
    PagesCut(String),
}

/// What the destination's last word says of the pages after the resume.
fn take_figures(run: &mut Run, r: &PostCopyStatusResponse) {
    let page = crate::memtrack::page_size();
    run.report.postcopy_pages = r.pages;
    run.report.postcopy_local_pages = r.local_pages;
    run.report.postcopy_faults = r.faults;
    run.report.postcopy_fault_wait_us = r.fault_wait_us;
    run.note_destination_peak(r.peak_extra_bytes);
    run.report.bytes_transferred += r.pages.saturating_sub(r.local_pages) * page;
}
