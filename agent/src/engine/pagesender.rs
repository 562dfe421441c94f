//! Post-copy with pages that follow, the source's side: after the resume,
//! the pages the dump left in the stopped copy are read from it
//! (`process_vm_readv`) and streamed to the destination on
//! `Peer.PostCopyPages`, in address order, except that the pages the
//! destination's faults wait on, which it names on the same stream, go
//! first. The destination's side is `destination::pages_follow`.
//!
//! Little is in flight, so that a fault's pages do not queue behind much
//! background traffic, here, in the connection or in a shaped link's
//! queue: the destination acknowledges what it stored, and the background
//! pages sent and not stored stay under a window that keeps the path full
//! with a queue of 2 ms at most, and much less while faults ask
//! (`super::pagewindow`); the pages asked for pass it. A fault's wait is
//! what the process's users see. Batches are half the window (64 to 256
//! KiB), and the first 16 KiB of an ask, from the faulted page, go on a
//! batch of their own before the rest of it: at 1 GiB and 1 Gb/s the
//! faults' summed wait went from 1.4-1.5 s to 0.95 s.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::mpsc::{RecvTimeoutError, TryRecvError};
use std::time::{Duration, Instant};

use ferry_proto::v1::{PageBatch, PageRun, PageWant};
use futures::StreamExt;
use tokio_stream::wrappers::ReceiverStream;

use super::EngineError;
use super::link::{PeerLink, peer_error};
use super::pagewindow::Window;
use crate::memtrack::{self, RangeSet};

/// Bytes per batch: half the window, so that two batches are in flight,
/// within these bounds. Each batch costs a few thread hops and an
/// acknowledgement on both sides: without a link limit the fill went from
/// ~310 to ~410 MB/s (1 GiB, release build) when batches grew from 64 to
/// 256 KiB, and no further with larger ones; at 1 Gb/s the window, and so
/// the batch, stays small, so that a fault's pages wait behind little.
const MIN_CHUNK: u64 = 64 << 10;
const MAX_CHUNK: u64 = 256 << 10;
const CHUNKS_IN_WINDOW: u64 = 2;
/// The first bytes of an ask, sent as a batch of their own.
const ASK_LEAD: u64 = 16 << 10;
/// Faults ask while one asked within this long: the window then keeps
/// almost no queue, so that the next fault's pages wait behind little.
/// Measured (1 GiB, release build): at 1 Gb/s the faults' summed wait
/// went from 0.95 to 0.68-0.75 s with the fill still at the link's 119
/// MB/s, and a Redis client reading random keys got 24,000-28,000 answers
/// instead of 19,500 in the 10 s window, its longest wait 59-110 ms
/// instead of 127-170.
const FAULTING_FOR: Duration = Duration::from_millis(20);
/// Batches queued for the stream.
const DEPTH: usize = 4;

/// One process's pages to send.
#[derive(Debug, Clone)]
pub struct LeftOut {
    /// Its PID in its namespace (the images', the destination's).
    pub vpid: u32,
    /// Its host PID, stopped, to read from.
    pub pid: i32,
    pub pages: RangeSet,
}

/// What the stream carried.
#[derive(Debug, Clone, Copy, Default)]
pub struct Sent {
    pub bytes: u64,
    /// Asks from the destination's faults, and the bytes sent for them.
    pub asks: u64,
    pub asked_bytes: u64,
    /// The shortest round of a batch, read to stored (the path's delay).
    pub min_rtt: Option<Duration>,
}

/// The pages the dump left out (parent runs of each pagemap image in
/// `images`) of the processes `pids` (PID in its namespace, host PID).
/// Blocking.
pub fn left_out(images: &Path, pids: &[(u32, i32)]) -> Result<Vec<LeftOut>, EngineError> {
    let mut out = Vec::new();
    for &(vpid, pid) in pids {
        let map = ferry_criu_image::pagemap::read_pagemap(images, vpid).map_err(|source| {
            EngineError::Image {
                what: "reading the dump's page map",
                source,
            }
        })?;
        let mut pages = RangeSet::new();
        for r in map.runs.iter().filter(|r| r.in_parent()) {
            pages.insert(r.vaddr, r.vaddr + r.nr_pages * map.page_size);
        }
        if !pages.is_empty() {
            out.push(LeftOut { vpid, pid, pages });
        }
    }
    Ok(out)
}

/// What the sender may send.
const ASKED_ONLY: u8 = 0;
const EVERYTHING: u8 = 1;
const STOP: u8 = 2;

/// A page stream to the destination, open: until [`Sending::release`] (the
/// Commit) only the pages the destination asks for cross, so that the
/// freeze shares nothing with the background traffic; then every page.
/// Dropped, it stops.
pub struct Sending {
    gate: Arc<AtomicU8>,
    /// Set once every page was handed to the stream.
    sent_all: Arc<AtomicBool>,
    /// Taken by [`Sending::end`].
    task: Option<tokio::task::JoinHandle<Result<Sent, EngineError>>>,
}

impl std::fmt::Debug for Sending {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sending").finish()
    }
}

impl Sending {
    /// Opens `Peer.PostCopyPages` to the destination behind `link` (within
    /// `open_within`) for the pages `left`.
    pub async fn open(
        link: Arc<dyn PeerLink>,
        destination: &str,
        migration_id: String,
        left: Vec<LeftOut>,
        open_within: Duration,
    ) -> Result<Sending, EngineError> {
        let (tx, rx) = tokio::sync::mpsc::channel(DEPTH);
        // The first batch names the migration; the channel has room for it.
        let _ = tx
            .send(PageBatch {
                migration_id: migration_id.clone(),
                round: 0,
                runs: Vec::new(),
            })
            .await;
        let mut wants_in =
            match tokio::time::timeout(open_within, link.post_copy_pages(ReceiverStream::new(rx)))
                .await
            {
                Ok(Ok(w)) => w,
                Ok(Err(s)) => return Err(peer_error(destination, s)),
                Err(_) => {
                    return Err(EngineError::PeerUnavailable {
                        node: destination.to_owned(),
                        address: String::new(),
                        reason: format!(
                            "PostCopyPages not answered within {} s",
                            open_within.as_secs()
                        ),
                    });
                }
            };
        let (want_tx, want_rx) = std::sync::mpsc::channel::<PageWant>();
        // Read to the end, even once the reader is done: dropping the
        // answers would reset the stream, and the batches still queued in
        // it would be lost.
        let wants = tokio::spawn(async move {
            while let Some(w) = wants_in.next().await {
                match w {
                    Ok(w) => {
                        let _ = want_tx.send(w);
                    }
                    Err(s) => return Err(s),
                }
            }
            Ok(())
        });
        let gate = Arc::new(AtomicU8::new(ASKED_ONLY));
        let sent_all = Arc::new(AtomicBool::new(false));
        let (g, all, destination) = (gate.clone(), sent_all.clone(), destination.to_owned());
        let task = tokio::spawn(async move {
            let read = tokio::task::spawn_blocking(move || {
                let sent = read_and_send(left, &want_rx, &tx, &migration_id, &g);
                all.store(sent.is_ok(), Ordering::SeqCst);
                sent
            })
            .await
            .map_err(|source| EngineError::Task {
                what: "sending the pages",
                source,
            })?;
            // The destination's word on the stream, if it ended it with an
            // error (a batch it refused): a better reason than a closed
            // stream.
            let said = match tokio::time::timeout(Duration::from_secs(2), wants).await {
                Ok(Ok(Err(s))) => Some(s),
                _ => None,
            };
            match (read, said) {
                (Ok(sent), None) => Ok(sent),
                (_, Some(s)) => Err(peer_error(&destination, s)),
                (Err(e), None) => Err(e),
            }
        });
        Ok(Sending {
            gate,
            sent_all,
            task: Some(task),
        })
    }

    /// The Commit: every page may go now.
    pub fn release(&self) {
        let _ =
            self.gate
                .compare_exchange(ASKED_ONLY, EVERYTHING, Ordering::SeqCst, Ordering::SeqCst);
    }

    pub fn is_finished(&self) -> bool {
        self.task.as_ref().is_none_or(|t| t.is_finished())
    }

    /// The stream ended with pages never sent: the destination cannot
    /// have them all, ever (a stream is not taken up again).
    pub fn broke_off(&self) -> bool {
        self.is_finished() && !self.sent_all.load(Ordering::SeqCst)
    }

    /// Waits for the sender's end (`done`: the destination has every page)
    /// or stops it, and says how it went.
    pub async fn end(mut self, done: bool) {
        if !done {
            self.gate.store(STOP, Ordering::SeqCst);
        }
        let Some(task) = self.task.take() else {
            return;
        };
        match tokio::time::timeout(Duration::from_secs(10), task).await {
            Ok(Ok(Ok(sent))) => tracing::info!(
                mib = sent.bytes >> 20,
                asks = sent.asks,
                asked_kib = sent.asked_bytes >> 10,
                min_rtt_us = sent.min_rtt.map(|d| d.as_micros() as u64),
                "post-copy pages sent"
            ),
            Ok(Ok(Err(e))) if done => tracing::warn!(error = %e, "sending the post-copy pages"),
            Ok(Ok(Err(e))) => tracing::info!(error = %e, "post-copy page sender stopped"),
            Ok(Err(e)) => tracing::warn!(error = %e, "the post-copy page sender"),
            Err(_) => tracing::warn!(
                "the post-copy page sender still runs after the destination's answer"
            ),
        }
    }
}

impl Drop for Sending {
    fn drop(&mut self) {
        self.gate.store(STOP, Ordering::SeqCst);
    }
}

/// The blocking part: reads the pages and queues them, asks first.
fn read_and_send(
    mut left: Vec<LeftOut>,
    wants: &std::sync::mpsc::Receiver<PageWant>,
    tx: &tokio::sync::mpsc::Sender<PageBatch>,
    migration_id: &str,
    gate: &AtomicU8,
) -> Result<Sent, EngineError> {
    let mut sent = Sent::default();
    let mut window = Window::new(Instant::now());
    let mut last_ask: Option<Instant> = None;
    let stopped = || EngineError::StreamClosed("post-copy page (stopped)");
    loop {
        loop {
            let open = window.in_flight(sent.bytes) < window_now(&window, last_ask);
            let w = match gate.load(Ordering::SeqCst) {
                STOP => return Err(stopped()),
                EVERYTHING if open => match wants.try_recv() {
                    Ok(w) => w,
                    Err(TryRecvError::Empty | TryRecvError::Disconnected) => break,
                },
                // Before the Commit (only asks), or the window full: wait
                // for a word from the destination.
                _ => match wants.recv_timeout(Duration::from_millis(5)) {
                    Ok(w) => w,
                    Err(RecvTimeoutError::Timeout) => continue,
                    Err(RecvTimeoutError::Disconnected) => {
                        return Err(EngineError::StreamClosed("post-copy page"));
                    }
                },
            };
            window.stored(w.stored_bytes, Instant::now());
            if w.length == 0 {
                continue;
            }
            let Some(t) = left.iter_mut().find(|t| t.vpid == w.pid) else {
                continue;
            };
            let asked = t.pages.within(w.vaddr, w.vaddr.saturating_add(w.length));
            sent.asks += 1;
            last_ask = Some(Instant::now());
            for (i, (s, e)) in asked.iter().enumerate() {
                // The faulted page leads the ask: on its own small batch,
                // it is stored and installed without waiting for the
                // rest of the ask to cross the link (64 pages take 2 ms
                // at 1 Gb/s).
                let lead = if i == 0 { e.min(s + ASK_LEAD) } else { s };
                let read_at = Instant::now();
                let n = send_range(t, s, lead, ASK_LEAD, tx, migration_id)?
                    + send_range(t, lead, e, MAX_CHUNK, tx, migration_id)?;
                sent.asked_bytes += n;
                sent.bytes += n;
                window.sent(sent.bytes, read_at);
            }
        }
        let Some(t) = left.iter_mut().find(|t| !t.pages.is_empty()) else {
            sent.min_rtt = window.min_rtt();
            return Ok(sent);
        };
        let (s, e) = t.pages.iter().next().expect("not empty");
        let chunk = (window_now(&window, last_ask) / CHUNKS_IN_WINDOW).clamp(MIN_CHUNK, MAX_CHUNK)
            & !(memtrack::page_size() - 1);
        let read_at = Instant::now();
        sent.bytes += send_range(t, s, e.min(s + chunk), chunk, tx, migration_id)?;
        window.sent(sent.bytes, read_at);
    }
}

/// The window for the background pages: the shorter one while faults ask
/// (the last at `last_ask`).
fn window_now(window: &Window, last_ask: Option<Instant>) -> u64 {
    window.limit(last_ask.is_some_and(|t| t.elapsed() < FAULTING_FOR))
}

/// Reads `[s, e)` of `t`'s stopped copy and queues it, in batches of at
/// most `chunk`; the range leaves `t`'s pages. Returns the bytes.
fn send_range(
    t: &mut LeftOut,
    s: u64,
    e: u64,
    chunk: u64,
    tx: &tokio::sync::mpsc::Sender<PageBatch>,
    migration_id: &str,
) -> Result<u64, EngineError> {
    let mut at = s;
    while at < e {
        let len = (e - at).min(chunk);
        let data = memtrack::read_remote_vec(t.pid, at, len as usize).map_err(EngineError::io(
            format!(
                "reading pages {at:#x}+{len} of the stopped copy (PID {})",
                t.pid
            ),
        ))?;
        let n = data.len();
        if n as u64 != len {
            return Err(EngineError::Internal(format!(
                "pages {:#x}+{len} of the stopped copy (PID {}) the dump left out are not all mapped",
                at + n as u64,
                t.pid
            )));
        }
        t.pages.remove(at, at + len);
        tx.blocking_send(PageBatch {
            migration_id: migration_id.to_owned(),
            round: 0,
            runs: vec![PageRun {
                pid: t.vpid,
                vaddr: at,
                data: data.into(),
                ..Default::default()
            }],
        })
        .map_err(|_| EngineError::StreamClosed("post-copy page"))?;
        at += len;
    }
    Ok(e - s)
}
