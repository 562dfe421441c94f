//! Pre-copy with pages left out of the dump, committed here: the watcher of
//! each one's page filler. Its outcome answers `Peer.PostCopyStatus` like a
//! post-copy's, for the source's report; the process needs nothing from the
//! source meanwhile.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use ferry_proto::v1 as pb;

use super::post_copy::{POSTCOPY_STATUS_KEPT, publish_running};
use crate::engine::Engine;
use crate::fill::FillStats;
use crate::fill::handle::Filler;

use super::peak::PeakMeter;

/// A committed fill, handed from Commit to its watcher.
pub(super) struct FillWatch {
    pub(super) migration_id: String,
    /// The node the migration came from (the only one that may ask).
    pub(super) from: String,
    /// The restored process, running.
    pub(super) pid: i32,
    pub(super) filler: Filler,
    /// The migration's directory, removed when the filler ends.
    pub(super) dir: PathBuf,
    pub(super) resumed_at: Instant,
    /// The filler's report, if it was done before the resume.
    pub(super) filled_before_resume: Option<FillStats>,
    /// Post-copy with pages that follow: its entry in the engine's
    /// follows, removed when the fill ends.
    pub(super) follows: Option<String>,
    pub(super) peak: Arc<PeakMeter>,
}

/// Watches a committed fill: done means every held page is in; a failure
/// means the running process would read zeros where pages are missing
/// (or wait forever: ferryd holds their userfaultfds), so it is killed at
/// once and reported lost.
pub(super) fn watch_fill(engine: &Arc<Engine>, w: FillWatch) {
    let tx = publish_running(engine, &w.migration_id, w.from.clone());
    let engine = engine.clone();
    tokio::spawn(async move {
        let FillWatch {
            migration_id,
            pid,
            filler,
            dir,
            resumed_at,
            filled_before_resume,
            peak,
            follows,
            ..
        } = w;
        let outcome = filler.finish().await;
        if let Some(id) = &follows {
            engine.incoming.follows.remove(id);
        }
        let window = if filled_before_resume.is_some() {
            0
        } else {
            resumed_at.elapsed().as_micros() as u64
        };
        let mut answer = match outcome {
            Ok(stats) => {
                tracing::info!(
                    migration = %migration_id,
                    pid,
                    pages = stats.pages,
                    faults = stats.faults,
                    fault_wait_ms = stats.fault_wait_us as f64 / 1000.0,
                    gate_wait_ms = stats.gate_wait_us as f64 / 1000.0,
                    inline_pages = stats.inline_pages,
                    fill_ms = stats.fill_us as f64 / 1000.0,
                    since_resume_ms = window as f64 / 1000.0,
                    "every held page is in"
                );
                pb::PostCopyStatusResponse {
                    state: pb::PostCopyState::Done as i32,
                    pages: stats.pages,
                    total_pages: stats.pages + stats.dropped_pages,
                    post_processing_us: window,
                    error: String::new(),
                    // Pages that follow came from the source; held
                    // pages from this node's store.
                    local_pages: if follows.is_some() { 0 } else { stats.pages },
                    faults: stats.faults,
                    fault_wait_us: stats.fault_wait_us,
                    peak_extra_bytes: 0,
                }
            }
            Err(e) => {
                if let Err(k) = crate::process::pidfd::kill_tree(pid) {
                    tracing::error!(pid, error = %k, "killing a process whose pages are lost");
                }
                let error =
                    format!("the page filler failed; the process (PID {pid}) was killed here: {e}");
                tracing::error!(migration = %migration_id, %error, "fill failed after the resume");
                crate::engine::keep_logs(&engine.config.work_dir, &dir, &migration_id);
                pb::PostCopyStatusResponse {
                    state: pb::PostCopyState::Failed as i32,
                    post_processing_us: window,
                    error,
                    ..Default::default()
                }
            }
        };
        answer.peak_extra_bytes = peak.peak();
        drop(peak);
        if crate::engine::keeps_every_log(&engine.config) {
            crate::engine::keep_logs(&engine.config.work_dir, &dir, &migration_id);
        }
        let removed = tokio::task::spawn_blocking(move || std::fs::remove_dir_all(&dir)).await;
        if let Ok(Err(e)) = removed {
            tracing::warn!(error = %e, "removing a fill's images");
        }
        let _ = tx.send(answer);
        tokio::time::sleep(POSTCOPY_STATUS_KEPT).await;
        engine.incoming.postcopies.lock().remove(&migration_id);
    });
}
