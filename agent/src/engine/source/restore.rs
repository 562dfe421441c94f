//! Restore: the destination restores the process, left stopped, as a child
//! of its agent (collective: with the rebuilt connections handed to CRIU).
//! Its success is the destination's confirmation. Before that it rewrites
//! the process's connections to other cluster nodes to its own cluster
//! address and holds them (nothing in or out); the answer lists them. From
//! here a cancel is refused: the migration commits or rolls back by itself.

use std::time::Instant;

use ferry_proto::v1::RestoreRequest;

use super::Phase;
use super::carry::{Releasing, Restored, Restoring, Translating};
use super::run::Run;
use crate::engine::link::{peer_error, silent};
use crate::engine::{EngineError, blocking, pagesender};

pub(super) async fn restore(run: &mut Run, r: Restoring) -> Result<Phase, EngineError> {
    // While the destination restores, the connections the TCP state
    // iterator read without repair mode go into it here: before the
    // Release (the commit point), so that the stopped copy closes them
    // silently whenever it goes, even if this agent does not live to kill
    // it. Off the freeze's critical path: this node only waits meanwhile.
    let repairing_the_rest = run.undo.held.clone().map(|held| {
        tokio::task::spawn_blocking(move || {
            let started = Instant::now();
            let turned = held.repair_the_rest();
            if turned > 0 {
                tracing::debug!(
                    connections = turned,
                    ms = started.elapsed().as_secs_f64() * 1000.0,
                    "repair on beside the restore"
                );
            }
        })
    });
    if run.p.pages_follow {
        open_page_stream(run).await?;
    }
    let restore = run.p.link.restore(RestoreRequest {
        migration_id: run.p.migration_id.clone(),
        collective_sockets: run.p.socket_migration.is_collective(),
        lazy_pages: run.undo.page_server.is_some(),
        local_pages: r.local_pages,
        pages_follow: run.p.pages_follow,
    });
    let restore = tokio::time::timeout(run.deadline, restore).await;
    // Done before anything else touches the connections (an abort's
    // resume takes repair off again).
    if let Some(task) = repairing_the_rest
        && let Err(e) = task.await
    {
        tracing::error!(error = %e, "turning repair on beside the restore");
    }
    let answer = match restore {
        Ok(Ok(r)) => r,
        Err(_) => {
            // The destination may still finish the restore; the abort
            // that follows makes it discard that copy (its ports stay
            // frozen there until the copy is dead).
            return Err(silent(&run.p.destination, "the restore", run.deadline));
        }
        Ok(Err(s)) => return Err(peer_error(&run.p.destination.name, s)),
    };
    run.report.destination_pid = answer.pid;
    run.report.restored_from_store_pages = answer.held_pages_restored;
    let restored = Restored {
        freeze_start: r.freeze_start,
        dump_end: r.dump_end,
        transfer_end: r.transfer_end,
        restore_end: Instant::now(),
        restore_criu_us: answer.restore_time_us,
        criu_startup_us: answer.criu_startup_us,
        image_scan_us: answer.image_scan_us,
        unread: r.unread,
    };
    // The destination restored the in-cluster connections on its own
    // cluster address and holds them: their peers' nodes translate from
    // now on, before this copy goes.
    Ok(if answer.in_cluster.is_empty() {
        let translate_end = restored.restore_end;
        let delivered = run.delivered_log().await;
        Phase::Release(Releasing {
            restored,
            translate_end,
            delivered,
        })
    } else {
        Phase::Translate(Translating {
            restored,
            in_cluster: answer.in_cluster,
        })
    })
}

/// Post-copy whose pages follow by ferryd: the pages the dump left in the
/// stopped copy, read from its page maps, and the stream that will carry
/// them, opened before the Restore (whose restorer faults on some). None
/// left out: no stream.
async fn open_page_stream(run: &mut Run) -> Result<(), EngineError> {
    let (images, pids) = (run.images(), run.pages_follow_from.clone());
    let left = blocking("listing the pages left out of the dump", move || {
        pagesender::left_out(&images, &pids)
    })
    .await??;
    if left.is_empty() {
        return Ok(());
    }
    let bytes: u64 = left.iter().map(|l| l.pages.len()).sum();
    tracing::info!(
        mib = bytes >> 20,
        "the pages left out of the dump follow after the commit"
    );
    run.undo.page_sending = Some(
        pagesender::Sending::open(
            run.p.link.clone(),
            &run.p.destination.name,
            run.p.migration_id.clone(),
            left,
            run.deadline,
        )
        .await?,
    );
    Ok(())
}
