//! Post-copy with pages that follow (protocol 10): after the Commit, the
//! source sends the pages its dump left out on `Peer.PostCopyPages`; each
//! batch lands in the page store and the page filler hears that it
//! arrived, and the pages the filler's faults wait on go back to the
//! source, which sends them next.
//!
//! # Why not CRIU's lazy pages
//!
//! CRIU's lazy dump moves every page of the process into pipes inside the
//! freeze (at 4 GiB, ~130 ms of splicing and ~33 ms of bookkeeping), and
//! its lazy-pages daemon keeps one request in flight and installs from a
//! single thread (300-345 MB/s here without a link limit). Here the dump
//! leaves the pages where they are (the held-pages patch, as if the
//! destination held them all), the source reads them from its stopped
//! copy after the resume, and the filler installs them with several
//! threads, faults first.
//!
//! # Lifetime
//!
//! Restore makes the [`Following`] beside the filler and registers it here
//! by migration id, for the source's stream, which opens before the
//! restore starts (the restore itself faults on some pages: CRIU's
//! restorer writes into the task's memory). Until the Commit the source
//! sends only the pages asked for, so that the freeze is not shared with
//! the background traffic. A Commit gives the source [`OPEN_WITHIN`] more
//! to have opened it; an abort removes the entry, and the entry goes when
//! the fill ends. A stream
//! that ends or breaks before every page arrived tells the filler the rest
//! is lost: it fails, and the fill's watcher kills the process (a missing
//! page would otherwise read as zeros or wait forever).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ferry_proto::v1::{self as pb, PageBatch};
use futures::StreamExt;

use crate::engine::pagestore::PageStore;
use crate::engine::{Engine, EngineError};
use crate::fill::handle::{Arrivals, Want};
use crate::memtrack::RangeSet;
use crate::sync::lock;

/// How long the source has, from the Commit, to open its page stream.
pub(super) const OPEN_WITHIN: Duration = Duration::from_secs(30);

/// Wants waiting for the source, at most, before the filler's asks wait.
const WANTS_IN_FLIGHT: usize = 256;

/// The post-copies committed here whose pages still follow, by migration
/// id.
#[derive(Debug, Default)]
pub struct Follows {
    by_id: Mutex<HashMap<String, Arc<Following>>>,
    /// Woken at each insert: a stream opened before its Restore waits.
    inserted: tokio::sync::Notify,
}

impl Follows {
    pub(super) fn insert(&self, f: Arc<Following>) {
        lock(&self.by_id).insert(f.migration_id.clone(), f);
        self.inserted.notify_waiters();
    }

    /// Migration `migration_id`'s pages, once its Restore registered
    /// them; `None` after `within`.
    async fn wait_for(&self, migration_id: &str, within: Duration) -> Option<Arc<Following>> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let inserted = self.inserted.notified();
            if let Some(f) = self.get(migration_id) {
                return Some(f);
            }
            if tokio::time::timeout_at(deadline, inserted).await.is_err() {
                return self.get(migration_id);
            }
        }
    }

    pub(super) fn remove(&self, migration_id: &str) {
        lock(&self.by_id).remove(migration_id);
    }

    fn get(&self, migration_id: &str) -> Option<Arc<Following>> {
        lock(&self.by_id).get(migration_id).cloned()
    }
}

/// One migration's pages still to come.
pub(in crate::engine) struct Following {
    pub(super) migration_id: String,
    /// The node it came from, the only one that may send them.
    pub(super) from: String,
    store: Arc<Mutex<PageStore>>,
    arrivals: Arrivals,
    /// The filler's asks; taken by the stream (it is opened once).
    wants: Mutex<Option<tokio::sync::mpsc::UnboundedReceiver<Want>>>,
    /// Per process (PID in its namespace), the pages not arrived yet.
    remaining: Mutex<HashMap<u32, RangeSet>>,
}

impl std::fmt::Debug for Following {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Following")
            .field("migration_id", &self.migration_id)
            .field("from", &self.from)
            .finish()
    }
}

impl Following {
    /// `expected`: per process, the pages the filler waits for (the runs
    /// of its plan, at their dump-time addresses).
    pub(super) fn new(
        migration_id: &str,
        from: &str,
        store: Arc<Mutex<PageStore>>,
        arrivals: Arrivals,
        wants: tokio::sync::mpsc::UnboundedReceiver<Want>,
        expected: HashMap<u32, RangeSet>,
    ) -> Following {
        Following {
            migration_id: migration_id.to_owned(),
            from: from.to_owned(),
            store,
            arrivals,
            wants: Mutex::new(Some(wants)),
            remaining: Mutex::new(expected),
        }
    }

    /// Pages still to come.
    fn remaining_bytes(&self) -> u64 {
        lock(&self.remaining).values().map(RangeSet::len).sum()
    }

    /// Tells the filler the rest is lost, if anything is still to come.
    fn give_up(&self, why: &str) {
        let left = self.remaining_bytes();
        if left == 0 {
            return;
        }
        let why = format!(
            "{why}, with {} pages still to come",
            left / crate::memtrack::page_size()
        );
        tracing::error!(migration = %self.migration_id, reason = %why, "post-copy pages lost");
        if let Err(e) = self.arrivals.lost(&why) {
            tracing::warn!(error = %e, "telling the page filler its pages are lost");
        }
    }

    /// Stores a batch and tells the filler what arrived. Each run must be
    /// pages the dump left out that did not arrive yet (nor earlier in the
    /// batch): a page stored twice after the filler installed it would
    /// stay in the store. Pages count as arrived once stored: a batch that
    /// cannot be stored leaves them still to come. Blocking (one stream
    /// at a time calls it).
    fn take(&self, batch: &PageBatch) -> Result<u64, EngineError> {
        let page = crate::memtrack::page_size();
        let mut arrived: HashMap<u32, RangeSet> = HashMap::new();
        {
            let remaining = lock(&self.remaining);
            for (i, run) in batch.runs.iter().enumerate() {
                if !run.lz4.is_empty() {
                    return Err(EngineError::InvalidField {
                        field: "runs.lz4",
                        reason: format!("runs[{i}]: pages that follow are not compressed"),
                    });
                }
                let end = run.vaddr.checked_add(run.data.len() as u64);
                let fits = end.zip(remaining.get(&run.pid)).is_some_and(|(end, set)| {
                    run.vaddr % page == 0
                        && end % page == 0
                        && set.contains(run.vaddr, end)
                        && arrived
                            .get(&run.pid)
                            .is_none_or(|a| a.within(run.vaddr, end).is_empty())
                });
                if !fits {
                    return Err(EngineError::InvalidField {
                        field: "runs",
                        reason: format!(
                            "runs[{i}]: {} bytes at {:#x} of pid {} are not pages the dump left out, or arrived already",
                            run.data.len(),
                            run.vaddr,
                            run.pid
                        ),
                    });
                }
                arrived
                    .entry(run.pid)
                    .or_default()
                    .insert(run.vaddr, run.vaddr + run.data.len() as u64);
            }
        }
        lock(&self.store).write(batch)?;
        let mut remaining = lock(&self.remaining);
        for (pid, ranges) in &arrived {
            if let Some(set) = remaining.get_mut(pid) {
                set.remove_all(ranges);
            }
        }
        drop(remaining);
        for (pid, ranges) in arrived {
            let ranges: Vec<(u64, u64)> = ranges.iter().collect();
            self.arrivals
                .arrived(pid, &ranges)
                .map_err(|e| EngineError::Internal(format!("telling the page filler: {e}")))?;
        }
        Ok(batch.runs.iter().map(|r| r.data.len() as u64).sum())
    }
}

/// A committed post-copy's pages: given up on if the source's stream is
/// not open within [`OPEN_WITHIN`].
pub(super) fn await_pages(f: Arc<Following>) {
    // Weak: the timer must not keep the store (and its pages) past the
    // fill's end.
    let f = Arc::downgrade(&f);
    tokio::spawn(async move {
        tokio::time::sleep(OPEN_WITHIN).await;
        let Some(f) = f.upgrade() else {
            return;
        };
        if lock(&f.wants).is_some() {
            f.give_up(&format!(
                "{} did not send the pages within {} s of the commit",
                f.from,
                OPEN_WITHIN.as_secs()
            ));
        }
    });
}

/// The stream a PostCopyPages answers with: the pages faults wait on.
pub type WantsOut = tokio_stream::wrappers::ReceiverStream<Result<pb::PageWant, tonic::Status>>;

/// `Peer.PostCopyPages`: the pages of a post-copy restored here, from the
/// node it came from (`caller`, as its certificate names it; `None`
/// without TLS).
pub async fn post_copy_pages(
    engine: &Arc<Engine>,
    caller: Option<String>,
    mut stream: tonic::Streaming<PageBatch>,
) -> Result<WantsOut, EngineError> {
    let first = stream
        .next()
        .await
        .ok_or_else(|| EngineError::InvalidField {
            field: "migration_id",
            reason: "the page stream ended before its first batch".into(),
        })?
        .map_err(|s| EngineError::BadImage(format!("page stream broke: {}", s.message())))?;
    // Opened before the Restore registers the pages (the source opens it
    // first, for the restore's own faults): only by the node that
    // prepared the migration here.
    let id = first.migration_id.clone();
    let from = match engine.incoming.follows.get(&id) {
        Some(f) => f.from.clone(),
        None => engine
            .incoming
            .source_of(&id)
            .ok_or_else(|| EngineError::UnknownMigration {
                migration_id: id.clone(),
            })?,
    };
    if let Some(node) = caller
        && node != from
    {
        return Err(EngineError::NotItsSource {
            migration_id: id,
            from,
            caller: node,
        });
    }
    let (tx, rx) = tokio::sync::mpsc::channel(WANTS_IN_FLIGHT);
    let engine = engine.clone();
    tokio::spawn(async move {
        let Some(f) = engine.incoming.follows.wait_for(&id, OPEN_WITHIN).await else {
            let why = format!("migration {id} restored no pages that follow here");
            let _ = tx.send(Err(tonic::Status::failed_precondition(why))).await;
            return;
        };
        let Some(wants) = lock(&f.wants).take() else {
            let why = format!("migration {id} already receives its pages");
            let _ = tx.send(Err(tonic::Status::failed_precondition(why))).await;
            return;
        };
        take_pages(f, first, stream, wants, tx).await;
    });
    Ok(tokio_stream::wrappers::ReceiverStream::new(rx))
}

/// Stores what the source sends, and passes the filler's asks on, until
/// the stream ends; pages still to come then are lost.
async fn take_pages(
    f: Arc<Following>,
    first: PageBatch,
    mut stream: tonic::Streaming<PageBatch>,
    mut wants: tokio::sync::mpsc::UnboundedReceiver<Want>,
    tx: tokio::sync::mpsc::Sender<Result<pb::PageWant, tonic::Status>>,
) {
    {
        let mut next = Some(Ok(first));
        let mut bytes = 0u64;
        let outcome: Result<(), String> = loop {
            let batch = match next.take() {
                Some(b) => Some(b),
                None => tokio::select! {
                    b = stream.next() => b,
                    Some(w) = wants.recv() => {
                        let want = pb::PageWant {
                            pid: w.vpid,
                            vaddr: w.start,
                            length: w.end - w.start,
                            stored_bytes: bytes,
                        };
                        // A source that stopped reading: the stream's end
                        // says how it went.
                        let _ = tx.send(Ok(want)).await;
                        continue;
                    }
                },
            };
            let batch = match batch {
                None => break Ok(()),
                Some(Err(s)) => break Err(format!("the page stream broke: {}", s.message())),
                Some(Ok(b)) => b,
            };
            if batch.migration_id != f.migration_id && !batch.migration_id.is_empty() {
                break Err(format!(
                    "migration_id changed from {} to {} mid-stream",
                    f.migration_id, batch.migration_id
                ));
            }
            let taker = f.clone();
            match tokio::task::spawn_blocking(move || taker.take(&batch)).await {
                Ok(Ok(0)) => {}
                Ok(Ok(n)) => {
                    bytes += n;
                    // The source's window moves on.
                    let ack = pb::PageWant {
                        stored_bytes: bytes,
                        ..Default::default()
                    };
                    let _ = tx.send(Ok(ack)).await;
                }
                Ok(Err(e)) => break Err(e.to_string()),
                Err(e) => break Err(format!("storing pages: {e}")),
            }
        };
        match outcome {
            Ok(()) => {
                f.give_up(&format!("{} ended the page stream", f.from));
                tracing::info!(migration = %f.migration_id, mib = bytes >> 20, "post-copy pages received");
            }
            Err(why) => {
                let _ = tx
                    .send(Err(tonic::Status::invalid_argument(why.clone())))
                    .await;
                f.give_up(&why);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fill::control::{self, ToFiller};
    use ferry_proto::v1::PageRun;
    use std::os::fd::AsFd;

    fn batch(runs: &[(u32, u64, usize)]) -> PageBatch {
        PageBatch {
            migration_id: "m".into(),
            round: 0,
            runs: runs
                .iter()
                .map(|&(pid, vaddr, pages)| PageRun {
                    pid,
                    vaddr,
                    data: vec![0xab; pages * 4096].into(),
                    ..Default::default()
                })
                .collect(),
        }
    }

    #[test]
    fn each_page_left_out_is_taken_once_and_the_filler_hears_of_it() {
        if crate::memtrack::page_size() != 4096 {
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(Mutex::new(PageStore::new(dir.path())));
        let (ours, filler_end) = control::pair().unwrap();
        let (_wants_tx, wants) = tokio::sync::mpsc::unbounded_channel();
        let mut expected = RangeSet::new();
        expected.insert(0x10000, 0x14000);
        let f = Following::new(
            "m",
            "node1",
            store.clone(),
            Arrivals::on(ours),
            wants,
            HashMap::from([(7, expected)]),
        );
        assert_eq!(f.take(&batch(&[(7, 0x10000, 2)])).unwrap(), 8192);
        match control::recv_in_filler(filler_end.as_fd()).unwrap() {
            Some(ToFiller::Arrived { vpid: 7, ranges }) => {
                assert_eq!(ranges, [(0x10000, 0x12000)]);
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(f.remaining_bytes(), 0x2000);
        assert!(
            crate::sync::lock(&store)
                .first_missing(&ferry_proto::v1::StoredPages {
                    pid: 7,
                    vaddr: 0x10000,
                    length: 0x2000
                })
                .is_none()
        );
        // Again, outside what was left out, another process, or twice in
        // one batch: refused, and nothing counts as arrived.
        for bad in [
            batch(&[(7, 0x10000, 1)]),
            batch(&[(7, 0x14000, 1)]),
            batch(&[(8, 0x12000, 1)]),
            batch(&[(7, 0x12000, 1), (7, 0x12000, 1)]),
        ] {
            let e = f.take(&bad).unwrap_err();
            assert!(
                matches!(e, EngineError::InvalidField { field: "runs", .. }),
                "{e}"
            );
        }
        assert_eq!(f.remaining_bytes(), 0x2000);
        // The stream ends with pages still to come: the filler hears they
        // are lost, naming how many.
        f.give_up("the source ended the page stream");
        match control::recv_in_filler(filler_end.as_fd()).unwrap() {
            Some(ToFiller::Lost { why }) => assert!(why.contains("2 pages still to come"), "{why}"),
            other => panic!("{other:?}"),
        }
    }
}
