//! Transfer: the images stream to the destination (`TransferImages`; from
//! protocol 3 small files are packed into few messages), the pre-copied
//! pages named instead of carried (`StoredPages`). Collective: beside them,
//! the connections' states, sent since they were read during the dump
//! (`TransferSockets`; from protocol 9 those whose fixed part crossed at
//! Arm unchanged go as packed records of what moves,
//! [`crate::sockstate::packed`]), so that the destination rebuilds them
//! while images still arrive. The capture ring's packets (what this node
//! delivered while recording) are sorted beside them.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::mpsc;

use super::Phase;
use super::restore::Restoring;
use super::run::Run;
use crate::config::PeerConfig;
use crate::engine::link::{PeerLink, peer_error, silent};
use crate::engine::sockettaker::ReadConnections;
use crate::engine::{EngineError, images};
use crate::memtrack::RangeSet;
use crate::sockstate;

/// Transfer's input.
pub(super) struct Transferring {
    pub freeze_start: Instant,
    pub dump_end: Instant,
    /// Pre-copy: the pages the destination holds that are still current.
    pub held_pages: HashMap<u32, RangeSet>,
    /// Assisted post-copy: those the destination serves itself.
    pub local_pages: Vec<ferry_proto::v1::StoredPages>,
    /// The UDP datagrams the stopped process's sockets hold unread.
    pub unread: Vec<sockstate::QueuedDatagram>,
}

/// What the socket transfer of a collective migration answers.
pub(super) struct SentSockets {
    /// The message's size.
    bytes: u64,
    answer: ferry_proto::v1::TransferSocketsResponse,
    /// Incremental: how the connections were read.
    counts: Option<sockstate::ReadCounts>,
    /// Bytes in the connections' send queues.
    send_queued: u64,
}

pub(super) type SocketsSent = Result<Option<SentSockets>, EngineError>;

pub(super) async fn transfer(run: &mut Run, t: Transferring) -> Result<Phase, EngineError> {
    let (tx, rx) = mpsc::channel(8);
    let transfer_start = Instant::now();
    let reader = tokio::task::spawn_blocking({
        let images = run.images();
        let id = run.p.migration_id.clone();
        let packing = images::Packing::for_version(run.p.protocol_version);
        let held_pages = t.held_pages;
        move || {
            let started = transfer_start.elapsed();
            let read = images::read_images(images, id, packing, &held_pages, tx);
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
    run.report.image_bytes = counts.bytes + counts.stored_bytes;
    run.report.bytes_transferred += counts.bytes;
    if run.p.strategy.is_precopy() {
        let page = crate::memtrack::page_size();
        run.report.dumped_pages = counts.dumped_page_bytes / page;
        run.report.precopied_pages = counts.stored_bytes / page;
        run.report.freeze_pages = run.report.dumped_pages - run.report.precopied_pages;
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

/// Sends the connections' states to the destination in one message as
/// soon as the socket reader has them, which is during the dump.
pub(super) async fn send_sockets(
    link: Arc<dyn PeerLink>,
    migration_id: String,
    source_node: String,
    destination: PeerConfig,
    deadline: Duration,
    states_from: tokio::sync::oneshot::Receiver<Result<ReadConnections, sockstate::SockStateError>>,
    armed_fixed: Option<Arc<sockstate::packed::FixedParts>>,
) -> SocketsSent {
    let read = states_from.await.map_err(|_| {
        EngineError::Internal("the dump ended before the connections were read".into())
    })??;
    let states = read.states?;
    let queued: usize = states
        .iter()
        .map(|c| c.send_queue.len() + c.recv_queue.len())
        .sum();
    tracing::info!(
        connections = states.len(),
        held = read.held.len(),
        queued_bytes = queued,
        ms = read.took.as_secs_f64() * 1000.0,
        preread = read.counts.map(|c| c.preread),
        touched = read.counts.map(|c| c.touched),
        unknown = read.counts.map(|c| c.unknown),
        "TCP connections read in one batch"
    );
    let counts = read.counts;
    let send_queued = states.iter().map(|c| c.send_queue.len() as u64).sum();
    let (packed, whole) = match &armed_fixed {
        Some(fixed) => sockstate::packed::pack(&states, fixed),
        None => (Default::default(), states.iter().collect()),
    };
    tracing::debug!(
        packed = packed.records.len() / sockstate::packed::RECORD_LEN,
        whole = whole.len(),
        "connections' states encoded"
    );
    let req = ferry_proto::v1::TransferSocketsRequest {
        migration_id,
        source_node,
        tcp_connections: whole.into_iter().map(|c| c.to_pb()).collect(),
        packed: packed.records,
        packed_queues: packed.queues,
    };
    let bytes = prost::Message::encoded_len(&req) as u64;
    match tokio::time::timeout(deadline, link.transfer_sockets(req)).await {
        Ok(Ok(r)) => Ok(Some(SentSockets {
            bytes,
            answer: r,
            counts,
            send_queued,
        })),
        Ok(Err(s)) => Err(peer_error(&destination.name, s)),
        Err(_) => Err(silent(&destination, "the socket transfer", deadline)),
    }
}
