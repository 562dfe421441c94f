//! Post-copy migrations committed here: the watcher of each one's lazy-pages
//! daemon, and `Peer.PostCopyStatus`.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_proto::v1::{self as pb};

use crate::criu;
use crate::engine::{Engine, EngineError};

/// How long a finished post-copy's status stays answerable.
pub(super) const POSTCOPY_STATUS_KEPT: Duration = Duration::from_secs(600);

/// Post-copy migrations committed here, by migration id: the node they
/// came from, and their status, updated once by the watcher of their
/// lazy-pages daemon.
#[derive(Debug, Default)]
pub struct PostCopies(std::sync::Mutex<HashMap<String, PostCopyEntry>>);

pub(super) type PostCopyEntry = (
    String,
    tokio::sync::watch::Receiver<pb::PostCopyStatusResponse>,
);

impl PostCopies {
    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, PostCopyEntry>> {
        crate::sync::lock(&self.0)
    }
}

/// A committed post-copy, handed from Commit to its watcher.
pub(super) struct PostCopyWatch {
    pub(super) migration_id: String,
    /// The node the migration came from (the only one that may ask).
    pub(super) from: String,
    /// The restored process, running.
    pub(super) pid: i32,
    pub(super) daemon: criu::lazy::Daemon,
    /// The migration's directory, removed when the daemon ends.
    pub(super) dir: PathBuf,
    pub(super) resumed_at: Instant,
    pub(super) done_before_resume: bool,
    /// Assisted post-copy: pages answered from the store.
    pub(super) served_locally: Arc<std::sync::atomic::AtomicU64>,
    pub(super) peak: Arc<super::peak::PeakMeter>,
}

/// Publishes a migration's work after the resume (a post-copy, a fill) as
/// running, for `PostCopyStatus`; the sender updates it.
pub(super) fn publish_running(
    engine: &Engine,
    migration_id: &str,
    from: String,
) -> tokio::sync::watch::Sender<pb::PostCopyStatusResponse> {
    let (tx, rx) = tokio::sync::watch::channel(pb::PostCopyStatusResponse {
        state: pb::PostCopyState::Running as i32,
        ..Default::default()
    });
    engine
        .incoming
        .postcopies
        .lock()
        .insert(migration_id.to_owned(), (from, rx));
    tx
}

/// Watches a committed post-copy's lazy-pages daemon: exit 0 means every
/// page is in; anything else means the running process would read zeros
/// where its missing pages are, so it is killed at once. Either way the
/// status is published for `PostCopyStatus` and the images go.
pub(super) fn watch_postcopy(engine: &Arc<Engine>, watched: PostCopyWatch) {
    let PostCopyWatch {
        migration_id,
        from,
        pid,
        mut daemon,
        dir,
        resumed_at,
        done_before_resume,
        served_locally,
        peak,
    } = watched;
    let tx = publish_running(engine, &migration_id, from);
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
        let mut answer = match status {
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
                    peak_extra_bytes: 0,
                }
            }
            other => {
                if let Err(e) = crate::process::pidfd::kill_tree(pid) {
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
                crate::engine::keep_logs(&engine.config.work_dir, &dir, &migration_id);
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
                    peak_extra_bytes: 0,
                }
            }
        };
        answer.peak_extra_bytes = peak.peak();
        drop(peak);
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
