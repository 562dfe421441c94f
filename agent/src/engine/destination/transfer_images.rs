//! `Peer.TransferImages`: the images, written by a thread of their own.

use std::sync::Arc;
use std::time::Instant;

use ferry_proto::v1::{ImageChunk, TransferImagesResponse};
use futures::StreamExt;

use super::{Step, check_source, expect};
use crate::engine::fault_point::{self, Side};
use crate::engine::{Engine, EngineError, images::ImageWriter};

/// The blocking thread writing received images, and the channel feeding it.
pub(super) type ImageWriterTask = (
    tokio::sync::mpsc::Sender<ImageChunk>,
    tokio::task::JoinHandle<Result<ImageWriter, EngineError>>,
);

pub async fn transfer_images(
    engine: &Arc<Engine>,
    caller: Option<String>,
    mut stream: tonic::Streaming<ImageChunk>,
) -> Result<TransferImagesResponse, EngineError> {
    let entered = Instant::now();
    let mut slot = engine.incoming.lock().await;
    let slot_waited = entered.elapsed();
    // The files are written by a blocking thread, fed through a channel:
    // a thousand small images would otherwise cost a thread-pool round trip
    // per open, write and close.
    let mut writer: Option<ImageWriterTask> = None;
    let mut id = String::new();
    let mut first_chunk_at = None;
    let fed: Result<(), EngineError> = async {
        while let Some(chunk) = stream.next().await {
            let chunk = chunk
                .map_err(|s| EngineError::BadImage(format!("stream broke: {}", s.message())))?;
            if writer.is_none() {
                first_chunk_at = Some(Instant::now());
                let inc = expect(&mut slot, &chunk.migration_id, Step::TransferImages)?;
                check_source(inc, caller.as_deref())?;
                id = chunk.migration_id.clone();
                let (tx, mut rx) = tokio::sync::mpsc::channel::<ImageChunk>(64);
                let dir = inc.images();
                let discarded = inc.discarded.clone();
                let store = inc.pages.clone();
                let task = tokio::task::spawn_blocking(move || {
                    let gone = || EngineError::BadImage("the migration was discarded".into());
                    let mut w = ImageWriter::new(&dir).with_store(store);
                    while let Some(c) = rx.blocking_recv() {
                        let d = crate::sync::lock(&discarded);
                        if *d {
                            return Err(gone());
                        }
                        w.write(&c)?;
                    }
                    let d = crate::sync::lock(&discarded);
                    if *d {
                        return Err(gone());
                    }
                    w.finish_file()?;
                    Ok(w)
                });
                writer = Some((tx, task));
            } else if chunk.migration_id != id {
                return Err(EngineError::BadImage(format!(
                    "migration_id changed from {id} to {} mid-stream",
                    chunk.migration_id
                )));
            }
            if let Some((tx, _)) = writer.as_ref()
                && tx.send(chunk).await.is_err()
            {
                // The writer stopped on an error: its result says which.
                break;
            }
        }
        Ok(())
    }
    .await;
    let Some((tx, task)) = writer else {
        fed?;
        return Err(EngineError::BadImage("no image chunk received".into()));
    };
    let streamed = first_chunk_at.map(|t| t.elapsed());
    // The writer finishes before the slot's lock goes, whatever happened:
    // an abort waiting for that lock removes the image directory, and must
    // not race a thread still writing into it.
    drop(tx);
    let written = task.await.map_err(|source| EngineError::Task {
        what: "the image writer",
        source,
    });
    fed?;
    let w = written??;
    let inc = expect(&mut slot, &id, Step::TransferImages)?;
    inc.advance(Step::TransferImages, 0);
    // Held with the slot: an Abort that comes meanwhile waits, as it
    // would for a slow disk.
    fault_point::reached(Side::Destination, "Received").await;
    tracing::info!(
        migration = %id,
        files = w.files,
        bytes = w.bytes,
        stored_bytes = w.stored_bytes,
        slot_waited_ms = slot_waited.as_secs_f64() * 1000.0,
        first_chunk_ms = first_chunk_at.map(|t| (t - entered).as_secs_f64() * 1000.0),
        streamed_ms = streamed.map(|d| d.as_secs_f64() * 1000.0),
        written_ms = first_chunk_at.map(|t| t.elapsed().as_secs_f64() * 1000.0),
        "images received"
    );
    Ok(TransferImagesResponse {
        files: w.files,
        bytes: w.bytes,
    })
}
