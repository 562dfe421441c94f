//! Fill: the dump left out pages the destination held (pre-copied, not
//! written since); the destination installs them from its store after the
//! resume, by itself: the source's copy is gone already and nothing waits
//! on it. This phase only asks how that went, for the report
//! (`Peer.PostCopyStatus`, which answers for a fill too). A failed fill
//! means the destination killed the process: the migration is lost. No
//! answer within [`FILL_REPORT_WAIT`]: the migration stays committed, and
//! the report says the fill was not confirmed.

use std::time::{Duration, Instant};

use ferry_proto::v1::{PostCopyState, PostCopyStatusRequest};

use super::run::Run;
use super::{Phase, Stop};
use crate::engine::EngineError;

/// How long the source asks before it reports the fill unconfirmed.
const FILL_REPORT_WAIT: Duration = Duration::from_secs(60);

pub(super) async fn fill(run: &mut Run, stop: Stop) -> Phase {
    let started = Instant::now();
    let last = loop {
        let ask = run.p.link.post_copy_status(PostCopyStatusRequest {
            migration_id: run.p.migration_id.clone(),
            wait_ms: 2000,
        });
        let why = match tokio::time::timeout(run.deadline + Duration::from_secs(2), ask).await {
            Ok(Ok(r)) => match PostCopyState::try_from(r.state) {
                Ok(PostCopyState::Done | PostCopyState::Failed) => break Ok(r),
                Ok(PostCopyState::Running) => String::from("still filling"),
                _ => format!("fill state {} unknown", r.state),
            },
            Ok(Err(s)) => s.message().to_owned(),
            Err(_) => format!("no answer within {} s", run.deadline.as_secs() + 2),
        };
        if started.elapsed() > FILL_REPORT_WAIT {
            break Err(why);
        }
        if why != "still filling" {
            tracing::warn!(reason = %why, "fill status unknown; asking again");
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    };
    match last {
        Ok(r) => {
            run.report.filled_pages = r.pages;
            run.report.fill_time_us = r.post_processing_us;
            run.report.fill_faults = r.faults;
            run.report.fill_fault_wait_us = r.fault_wait_us;
            run.note_destination_peak(r.peak_extra_bytes);
            if r.state == PostCopyState::Failed as i32 {
                return Phase::Done(Stop::Lost(EngineError::Peer {
                    node: run.p.destination.name.clone(),
                    code: tonic::Code::DataLoss,
                    message: format!(
                        "filling the held pages failed after the resume: {}",
                        r.error
                    ),
                }));
            }
            tracing::info!(
                pages = r.pages,
                fill_ms = r.post_processing_us as f64 / 1000.0,
                faults = r.faults,
                "the destination filled the held pages"
            );
            Phase::Done(stop)
        }
        Err(why) => {
            tracing::warn!(reason = %why, "the destination did not confirm its fill");
            match stop {
                Stop::Committed(None) => {
                    Phase::Done(Stop::Committed(Some(EngineError::Internal(format!(
                        "{} did not confirm that it filled the held pages within {} s ({why})",
                        run.p.destination.name,
                        FILL_REPORT_WAIT.as_secs()
                    )))))
                }
                other => Phase::Done(other),
            }
        }
    }
}
