//! `Peer.TransferPages`: one pre-copy round's pages, kept for the images.

use std::sync::Arc;

use futures::StreamExt;

use super::capacity::Room;
use super::{Step, check_source, expect};
use crate::engine::{Engine, EngineError};

/// One pre-copy round's pages (protocol 5), stored for the image transfer.
pub async fn transfer_pages(
    engine: &Arc<Engine>,
    caller: Option<String>,
    mut stream: tonic::Streaming<ferry_proto::v1::PageBatch>,
) -> Result<ferry_proto::v1::TransferPagesResponse, EngineError> {
    let mut id: Option<String> = None;
    let (mut pages, mut bytes) = (0u64, 0u64);
    // Where the next re-check of this node's room is due, should the
    // process grow past what Prepare was told.
    let mut next_check = 0u64;
    let (node, work_dir, limit) = (
        engine.node().to_owned(),
        engine.config.work_dir.clone(),
        engine.config.migration.incoming_memory_limit_mib,
    );
    while let Some(batch) = stream.next().await {
        let batch = batch
            .map_err(|s| EngineError::BadImage(format!("page stream broke: {}", s.message())))?;
        if let Some(id) = &id
            && *id != batch.migration_id
        {
            return Err(EngineError::BadImage(format!(
                "migration_id changed from {id} to {} mid-stream",
                batch.migration_id
            )));
        }
        // The slot per batch, not for the whole round: a round on a slow
        // link is long, and an abort must not wait for it.
        let (store, discarded, announced) = {
            let mut slot = engine.incoming.lock().await;
            let inc = expect(&mut slot, &batch.migration_id, Step::TransferPages)?;
            check_source(inc, caller.as_deref())?;
            if inc.protocol_version < ferry_proto::PEER_PROTOCOL_PRECOPY {
                return Err(EngineError::WrongState {
                    migration_id: batch.migration_id.clone(),
                    state: "prepared with a protocol without pre-copy",
                    step: "pre-copy",
                });
            }
            (inc.pages.clone(), inc.discarded.clone(), inc.announced)
        };
        id.get_or_insert_with(|| batch.migration_id.clone());
        let (node, work_dir) = (node.clone(), work_dir.clone());
        let (p, b, checked) = tokio::task::spawn_blocking(move || {
            // Under the discard flag's lock, as the image writer does.
            let d = crate::sync::lock(&discarded);
            if *d {
                return Err(EngineError::BadImage("the migration was discarded".into()));
            }
            let mut s = crate::sync::lock(&store);
            let before = (s.pages, s.bytes);
            s.write(&batch)?;
            let (p, b) = (s.pages - before.0, s.bytes - before.1);
            // Pages counted as they came bound the distinct ones held:
            // within what was announced, nothing to add up.
            let mut next = next_check;
            if s.bytes > announced.dumped {
                let held = s.held_bytes();
                drop(s);
                if announced.grown_past(held, &mut next) {
                    Room::read(&work_dir, limit)?.recheck(&node, &announced, held)?;
                }
            }
            Ok((p, b, next))
        })
        .await
        .map_err(|source| EngineError::Task {
            what: "the page store",
            source,
        })??;
        next_check = checked;
        pages += p;
        bytes += b;
    }
    let Some(id) = id else {
        return Err(EngineError::BadImage("no page batch received".into()));
    };
    tracing::debug!(pages, bytes, "pre-copied pages received");
    start_filler_ahead(engine, &id).await;
    Ok(ferry_proto::v1::TransferPagesResponse { pages, bytes })
}

/// After the first round: the page filler that may install these pages
/// after the resume, started now, so that its fork and exec cost the
/// freeze nothing (the restore hands it its plan). Without it the restore
/// starts one itself.
async fn start_filler_ahead(engine: &Arc<Engine>, id: &str) {
    let dir = {
        let slot = engine.incoming.lock().await;
        match slot.as_ref() {
            Some(inc) if inc.migration_id == id && inc.filler_ahead.is_none() => inc.dir.clone(),
            _ => return,
        }
    };
    if !crate::fill::available(&engine.config.features_off) {
        return;
    }
    let spawned = tokio::task::spawn_blocking(move || {
        let exe = std::env::current_exe()
            .map_err(crate::fill::FillError::io("finding ferryd's own binary"))?;
        crate::fill::handle::Spawned::spawn(&exe, &dir)
    })
    .await;
    match spawned {
        Ok(Ok(s)) => {
            let mut slot = engine.incoming.lock().await;
            if let Some(inc) = slot.as_mut()
                && inc.migration_id == id
                && inc.filler_ahead.is_none()
            {
                tracing::debug!(pid = s.pid(), "page filler started ahead of the freeze");
                inc.filler_ahead = Some(s);
            }
            // Otherwise the migration ended meanwhile: dropped, killed.
        }
        Ok(Err(e)) => tracing::warn!(error = %e, "starting the page filler ahead"),
        Err(e) => tracing::warn!(error = %e, "starting the page filler ahead"),
    }
}
