//! Transfer: the images stream to the destination (`TransferImages`; from
//! protocol 3 small files are packed into few messages), the pre-copied
//! pages named instead of carried (`StoredPages`). Collective: beside them,
//! the connections' states, sent since they were read during the dump
//! (`TransferSockets`; from protocol 9 those whose fixed part crossed at
//! Arm unchanged go as packed records of what moves,
//! [`crate::sockstate::packed`]), so that the destination rebuilds them
//! while images still arrive. The capture ring's packets (what this node
//! delivered while recording) are sorted beside them.

use std::time::Instant;

use tokio::sync::mpsc;

use super::Phase;
use super::carry::{Restoring, Transferring};
use super::run::Run;
use super::sockets::SentSockets;
use crate::engine::link::{peer_error, silent};
use crate::engine::{EngineError, images};

pub(super) async fn transfer(run: &mut Run, t: Transferring) -> Result<Phase, EngineError> {
    let (tx, rx) = mpsc::channel(8);
    let transfer_start = Instant::now();
    let reader = tokio::task::spawn_blocking({
        let images = run.images();
        let id = run.p.migration_id.clone();
        let packing = images::Packing::for_version(run.p.protocol_version);
        let held_pages = t.held_pages;
        let mut compressor = run.p.compression.clone();
        move || {
            let started = transfer_start.elapsed();
            let read = images::read_images(images, id, packing, &held_pages, &mut compressor, tx);
            (read, started, transfer_start.elapsed())
        }
    });
    if run.capture {
        // Everything delivered while recording is in the ring by now. Under
        // load that is megabytes of packets to digest: it runs beside the
        // transfer rather than in front of it (the freeze is on), and
        // starts after the image reader, which the freeze waits for.
        let engine = run.engine.clone();
        run.undo.collecting = Some(tokio::task::spawn_blocking(move || {
            engine.dataplane.collect_captured()
        }));
    }
    let images_sent = tokio::time::timeout(
        run.deadline,
        run.p
            .link
            .transfer_images(tokio_stream::wrappers::ReceiverStream::new(rx)),
    );
    // Beside the images: the connections' states, sent since they were
    // read (during the dump), so the destination rebuilds them meanwhile.
    let sending = run.undo.sockets_sending.take();
    let sockets_sent = async {
        match sending {
            None => Ok(None),
            Some(task) => task.await.unwrap_or_else(|source| {
                Err(EngineError::Task {
                    what: "the socket transfer",
                    source,
                })
            }),
        }
    };
    // A cancel cuts the images short, not the connections: a socket
    // transfer in flight is waited for, so that the abort reaches the
    // destination after it.
    let cancel = run.p.cancel.clone();
    let images_sent = async {
        tokio::select! {
            sent = images_sent => Ok(sent),
            e = cancel.requested() => Err(e),
        }
    };
    let (sent, sockets) = tokio::join!(images_sent, sockets_sent);
    let sent = match sent {
        Err(e) => {
            // The reader ends once its channel is gone.
            let _ = reader.await;
            return Err(e);
        }
        Ok(Ok(sent)) => sent,
        Ok(Err(_)) => {
            return Err(silent(
                &run.p.destination,
                "the image transfer",
                run.deadline,
            ));
        }
    };
    let read = reader.await.map(|(read, started, ended)| {
        tracing::debug!(
            reader_started_ms = started.as_secs_f64() * 1000.0,
            read_ms = ended.as_secs_f64() * 1000.0,
            answered_ms = transfer_start.elapsed().as_secs_f64() * 1000.0,
            "images sent"
        );
        read
    });
    let counts = match (read, sent) {
        (Ok(Ok(counts)), Ok(_)) => counts,
        (Ok(Err(e)), _) => return Err(e),
        (Err(source), _) => {
            return Err(EngineError::Task {
                what: "reading the images",
                source,
            });
        }
        (_, Err(s)) => return Err(peer_error(&run.p.destination.name, s)),
    };
    count_images(run, &counts);
    count_sockets(run, sockets?);
    Ok(Phase::Restore(Restoring {
        freeze_start: t.freeze_start,
        dump_end: t.dump_end,
        transfer_end: Instant::now(),
        local_pages: t.local_pages,
        unread: t.unread,
    }))
}

fn count_images(run: &mut Run, counts: &images::ImageCounts) {
    run.report.image_files = counts.files;
    run.report.image_bytes =
        counts.bytes - counts.lz4_bytes + counts.lz4_raw_bytes + counts.stored_bytes;
    run.report.bytes_transferred += counts.bytes;
    run.report.compressed_page_bytes += counts.lz4_raw_bytes;
    run.report.compressed_to_bytes += counts.lz4_bytes;
    if run.p.strategy.is_precopy() {
        let page = crate::memtrack::page_size();
        // Pages left out of the dump are the process's too, and held.
        run.report.dumped_pages = (counts.dumped_page_bytes + counts.left_out_bytes) / page;
        run.report.precopied_pages = (counts.stored_bytes + counts.left_out_bytes) / page;
        run.report.freeze_pages = run.report.dumped_pages - run.report.precopied_pages;
        run.report.left_out_pages = counts.left_out_bytes / page;
        run.held_left_out = counts.left_out_bytes > 0;
    }
}

fn count_sockets(run: &mut Run, sent: Option<SentSockets>) {
    let Some(SentSockets {
        bytes,
        answer,
        counts,
        send_queued,
    }) = sent
    else {
        return;
    };
    run.report.bytes_transferred += bytes;
    run.report.tcp_send_queue_bytes = send_queued;
    if let Some(c) = counts {
        run.report.connections_preread = c.preread;
        run.report.connections_read_in_freeze = c.touched + c.unknown;
    }
    run.report.connections_staged = answer.staged;
    tracing::info!(
        connections = answer.connections,
        staged = answer.staged,
        rebuild_ms = answer.rebuild_us as f64 / 1000.0,
        "destination rebuilt the connections"
    );
}
