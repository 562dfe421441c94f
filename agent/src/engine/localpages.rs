//! Assisted post-copy on the destination: the lazy-pages daemon's requests
//! for pages that the live pass brought (and that stayed current) are
//! answered here, from the pre-copy store; only the others cross the page
//! tunnel to the source's page server.
//!
//! # CRIU's page-server protocol, as the lazy-pages daemon speaks it
//!
//! Read in CRIU 4.2's `criu/page-xfer.c` and `criu/pagemap.c`. The daemon
//! sends 32-byte requests, `struct page_server_iov` in the host's byte
//! order: `u32 cmd`, 4 bytes of padding, `u64 nr_pages`, `u64 vaddr`,
//! `u64 dst_id`. It sends two kinds:
//!
//! - `PS_IOV_GET` (7): `nr_pages` pages from `vaddr` of the process whose
//!   PID in its namespace is `dst_id` (`request_remote_pages` puts the
//!   plain image id there, unlike the dump side's `encode_pm`). The server
//!   answers with the same header, `cmd` = `PS_IOV_ADD_F` (6) with
//!   `PE_PRESENT` in the upper 16 bits and `nr_pages` possibly smaller than
//!   asked, then the pages.
//! - `PS_IOV_CLOSE` / `PS_IOV_FORCE_CLOSE` (0x1023 / 0x1024): the server
//!   answers with a 4-byte status and ends.
//!
//! The daemon matches answers to requests strictly in order (a list of
//! pending reads, first in first out), and takes a short answer by asking
//! again for the rest later (`uffd_io_complete`). So each GET here is
//! answered with the longest prefix of one kind: if its first page is held
//! here, the held pages from there on come from the store; otherwise a GET
//! for the pages from there on that are not held goes to the source. The
//! answers leave in request order whatever their origin.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use ferry_proto::v1::TunnelBytes;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio_stream::{Stream, StreamExt};

use super::EngineError;
use super::pagestore::PageStore;
use crate::memtrack::{self, RangeSet};

const HEADER: usize = 32;
const PS_IOV_ADD_F: u32 = 6;
const PS_IOV_GET: u32 = 7;
const PS_IOV_CLOSE: u32 = 0x1023;
const PS_IOV_FORCE_CLOSE: u32 = 0x1024;
const PS_CMD_MASK: u32 = 0xffff;
const PE_PRESENT: u32 = 1 << 2;
/// The close answer: an `int32_t` status.
const STATUS: usize = 4;

/// Pages answered from the store per request at most: a short answer is
/// fine (the daemon asks again), and it bounds the buffer.
const LOCAL_ANSWER_PAGES: u64 = 256;

/// One request header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Iov {
    cmd: u32,
    nr_pages: u64,
    vaddr: u64,
    dst_id: u64,
}

impl Iov {
    fn parse(b: &[u8; HEADER]) -> Self {
        let u64_at = |i: usize| u64::from_ne_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        Iov {
            cmd: u32::from_ne_bytes(b[0..4].try_into().expect("4 bytes")),
            nr_pages: u64_at(8),
            vaddr: u64_at(16),
            dst_id: u64_at(24),
        }
    }

    fn bytes(&self) -> [u8; HEADER] {
        let mut b = [0u8; HEADER];
        b[0..4].copy_from_slice(&self.cmd.to_ne_bytes());
        b[8..16].copy_from_slice(&self.nr_pages.to_ne_bytes());
        b[16..24].copy_from_slice(&self.vaddr.to_ne_bytes());
        b[24..32].copy_from_slice(&self.dst_id.to_ne_bytes());
        b
    }
}

/// The pages this node answers itself: per PID in the process's namespace,
/// the held ranges, and the store they are in.
#[derive(Debug)]
pub struct LocalPages {
    pub held: HashMap<u32, RangeSet>,
    pub store: Arc<Mutex<PageStore>>,
}

/// Counts of a session, for the report.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Served {
    /// Pages answered from the store.
    pub local_pages: u64,
    /// Pages the source's page server answered.
    pub remote_pages: u64,
    /// Page requests from the daemon, answered here and by the source.
    pub local_requests: u64,
    pub remote_requests: u64,
}

/// How one request is answered, in request order.
#[derive(Debug)]
enum Answer {
    /// Ready: header and pages from the store.
    Local(Vec<u8>),
    /// The source's page server answers this GET (header, then pages).
    RemotePages(Iov),
    /// The source's page server answers a close (a status).
    RemoteStatus,
}

/// Where one request from the daemon is answered.
#[derive(Debug, PartialEq, Eq)]
enum Route {
    /// Forwarded to the source, which answers.
    Source(Iov),
    /// From the store: `nr` pages of process `pid` from the request's
    /// address.
    Store { iov: Iov, pid: u32, nr: u64 },
}

/// Where to answer one request (cheap: no I/O).
fn route(iov: Iov, local: Option<&LocalPages>, page: u64) -> Result<Route, EngineError> {
    match iov.cmd & PS_CMD_MASK {
        PS_IOV_GET => {}
        PS_IOV_CLOSE | PS_IOV_FORCE_CLOSE => return Ok(Route::Source(iov)),
        other => {
            return Err(EngineError::LazyPages(format!(
                "the daemon sent page-server command {other:#x}, which it never sends"
            )));
        }
    }
    if iov.nr_pages == 0 {
        return Err(EngineError::LazyPages(
            "the daemon asked for no pages".into(),
        ));
    }
    let end = iov
        .vaddr
        .checked_add(iov.nr_pages.saturating_mul(page))
        .ok_or_else(|| EngineError::LazyPages("a request beyond 2^64".into()))?;
    let held = local.and_then(|l| {
        u32::try_from(iov.dst_id)
            .ok()
            .and_then(|pid| l.held.get(&pid).map(|h| (pid, h)))
    });
    let Some((pid, held)) = held else {
        return Ok(Route::Source(iov));
    };
    let Some(&(s, e, is_held)) = held.split(iov.vaddr, end).first() else {
        return Ok(Route::Source(iov));
    };
    debug_assert_eq!(s, iov.vaddr);
    if !is_held {
        return Ok(Route::Source(Iov {
            nr_pages: (e - s) / page,
            ..iov
        }));
    }
    Ok(Route::Store {
        iov,
        pid,
        nr: ((e - s) / page).min(LOCAL_ANSWER_PAGES),
    })
}

/// The answer to a request routed to the store: header and pages.
/// Blocking (file reads).
fn answer_from_store(
    store: &Mutex<PageStore>,
    iov: Iov,
    pid: u32,
    nr: u64,
    page: u64,
) -> Result<Vec<u8>, EngineError> {
    let mut out = Iov {
        cmd: PE_PRESENT << 16 | PS_IOV_ADD_F,
        nr_pages: nr,
        ..iov
    }
    .bytes()
    .to_vec();
    let data = crate::sync::lock(store).read(pid, iov.vaddr, nr * page)?;
    out.extend_from_slice(&data);
    Ok(out)
}

/// Carries the session between the lazy-pages daemon (`daemon`) and the
/// page tunnel (`inbound` from the source, `outbound` to it), answering
/// from `local` what it can once Restore has set it. Ends when both sides
/// have ended; a protocol violation or a broken tunnel ends it at once,
/// and the daemon sees its connection close.
pub async fn serve<S>(
    daemon: TcpStream,
    mut inbound: S,
    outbound: mpsc::Sender<Result<TunnelBytes, tonic::Status>>,
    local: Arc<OnceLock<LocalPages>>,
    served_locally: Arc<std::sync::atomic::AtomicU64>,
) -> Result<Served, EngineError>
where
    S: Stream<Item = Result<TunnelBytes, tonic::Status>> + Unpin,
{
    let page = memtrack::page_size();
    let (mut from_daemon, mut to_daemon) = daemon.into_split();
    // Answers in request order; the remote ones are read from the tunnel
    // when their turn comes.
    let (answers_tx, mut answers_rx) = mpsc::unbounded_channel::<Answer>();
    let counter = served_locally.clone();
    let requests = async move {
        let mut buf = [0u8; HEADER];
        let (mut local_requests, mut remote_requests) = (0u64, 0u64);
        loop {
            match from_daemon.read_exact(&mut buf).await {
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                    return Ok::<_, EngineError>((local_requests, remote_requests));
                }
                Err(e) => return Err(EngineError::io("lazy pages: reading the daemon")(e)),
            }
            let iov = Iov::parse(&buf);
            let answer = match route(iov, local.get(), page)? {
                Route::Source(forward) => {
                    let sent = outbound
                        .send(Ok(TunnelBytes {
                            migration_id: String::new(),
                            data: forward.bytes().to_vec(),
                        }))
                        .await;
                    if sent.is_err() {
                        return Err(EngineError::LazyPages("the page tunnel closed".into()));
                    }
                    if forward.cmd & PS_CMD_MASK == PS_IOV_GET {
                        remote_requests += 1;
                        Answer::RemotePages(forward)
                    } else {
                        Answer::RemoteStatus
                    }
                }
                Route::Store { iov, pid, nr } => {
                    // Store reads are blocking file reads (at most
                    // LOCAL_ANSWER_PAGES, from tmpfs).
                    let local = local.clone();
                    let bytes = tokio::task::spawn_blocking(move || {
                        let store = &local.get().expect("routed to a store that is set").store;
                        answer_from_store(store, iov, pid, nr, page)
                    })
                    .await
                    .map_err(|source| EngineError::Task {
                        what: "reading pages from the store",
                        source,
                    })??;
                    local_requests += 1;
                    counter.fetch_add(nr, std::sync::atomic::Ordering::Relaxed);
                    Answer::Local(bytes)
                }
            };
            if answers_tx.send(answer).is_err() {
                return Err(EngineError::LazyPages("the answering side stopped".into()));
            }
        }
    };
    let answers = async move {
        let mut reader = TunnelReader {
            inbound: &mut inbound,
            current: Vec::new(),
            at: 0,
        };
        let mut remote_pages = 0u64;
        while let Some(answer) = answers_rx.recv().await {
            match answer {
                Answer::Local(b) => to_daemon
                    .write_all(&b)
                    .await
                    .map_err(EngineError::io("lazy pages: writing to the daemon"))?,
                Answer::RemotePages(asked) => {
                    let mut header = [0u8; HEADER];
                    reader.read_exact(&mut header).await?;
                    let iov = Iov::parse(&header);
                    // The daemon reads as many pages as the header says,
                    // into a buffer sized for what it asked: more, or
                    // another address, would corrupt what follows.
                    if iov.vaddr != asked.vaddr
                        || iov.dst_id != asked.dst_id
                        || iov.nr_pages == 0
                        || iov.nr_pages > asked.nr_pages
                    {
                        return Err(EngineError::LazyPages(format!(
                            "the page server answered {} pages at {:#x} of pid {} to a request for {} at {:#x} of pid {}",
                            iov.nr_pages,
                            iov.vaddr,
                            iov.dst_id,
                            asked.nr_pages,
                            asked.vaddr,
                            asked.dst_id
                        )));
                    }
                    to_daemon
                        .write_all(&header)
                        .await
                        .map_err(EngineError::io("lazy pages: writing to the daemon"))?;
                    let len = iov.nr_pages.saturating_mul(page);
                    reader.copy(len, &mut to_daemon).await?;
                    remote_pages += iov.nr_pages;
                }
                Answer::RemoteStatus => {
                    let mut status = [0u8; STATUS];
                    reader.read_exact(&mut status).await?;
                    to_daemon
                        .write_all(&status)
                        .await
                        .map_err(EngineError::io("lazy pages: writing to the daemon"))?;
                }
            }
        }
        // The daemon is done asking: whatever else the source sends
        // would answer nothing.
        if reader.has_more().await? {
            return Err(EngineError::LazyPages(
                "the page server sent more than was asked".into(),
            ));
        }
        to_daemon.shutdown().await.map_err(EngineError::io(
            "lazy pages: shutting down the daemon's input",
        ))?;
        Ok::<u64, EngineError>(remote_pages)
    };
    let ((local_requests, remote_requests), remote_pages) = tokio::try_join!(requests, answers)?;
    Ok(Served {
        local_pages: served_locally.load(std::sync::atomic::Ordering::Relaxed),
        remote_pages,
        local_requests,
        remote_requests,
    })
}

/// Bytes of the tunnel's inbound stream, read as a byte stream.
struct TunnelReader<'a, S> {
    inbound: &'a mut S,
    /// The message being read, and how far.
    current: Vec<u8>,
    at: usize,
}

impl<S> TunnelReader<'_, S>
where
    S: Stream<Item = Result<TunnelBytes, tonic::Status>> + Unpin,
{
    /// What is left of the current message, refilled if it is used up;
    /// empty at the stream's end.
    async fn available(&mut self) -> Result<&[u8], EngineError> {
        while self.at == self.current.len() {
            match self.inbound.next().await {
                Some(Ok(m)) => {
                    self.current = m.data;
                    self.at = 0;
                }
                Some(Err(s)) => {
                    return Err(EngineError::Internal(format!(
                        "page tunnel broke: {}",
                        s.message()
                    )));
                }
                None => return Ok(&[]),
            }
        }
        Ok(&self.current[self.at..])
    }

    async fn read_exact(&mut self, out: &mut [u8]) -> Result<(), EngineError> {
        let mut done = 0;
        while done < out.len() {
            let have = self.available().await?;
            if have.is_empty() {
                return Err(EngineError::LazyPages(
                    "the page server's answer was cut short".into(),
                ));
            }
            let n = (out.len() - done).min(have.len());
            out[done..done + n].copy_from_slice(&have[..n]);
            self.at += n;
            done += n;
        }
        Ok(())
    }

    /// Copies `len` bytes to `to` as they arrive.
    async fn copy(
        &mut self,
        mut len: u64,
        to: &mut tokio::net::tcp::OwnedWriteHalf,
    ) -> Result<(), EngineError> {
        while len > 0 {
            let have = self.available().await?;
            if have.is_empty() {
                return Err(EngineError::LazyPages(
                    "the page server's pages were cut short".into(),
                ));
            }
            let n = (len as usize).min(have.len());
            to.write_all(&have[..n])
                .await
                .map_err(EngineError::io("lazy pages: writing to the daemon"))?;
            self.at += n;
            len -= n as u64;
        }
        Ok(())
    }

    async fn has_more(&mut self) -> Result<bool, EngineError> {
        Ok(!self.available().await?.is_empty())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    use ferry_proto::v1::{PageBatch, PageRun};
    use tokio_stream::wrappers::ReceiverStream;

    const PID: u32 = 7;
    const BASE: u64 = 0x7f00_0000_0000;

    fn page() -> u64 {
        memtrack::page_size()
    }

    /// The content of page `i` (from BASE): on the destination's store
    /// (`b'L'`) or on the source (`b'R'`).
    fn content(i: u64, origin: u8) -> Vec<u8> {
        let mut p = vec![origin; page() as usize];
        p[..8].copy_from_slice(&i.to_ne_bytes());
        p
    }

    fn get(vaddr: u64, nr: u64) -> Iov {
        Iov {
            cmd: PS_IOV_GET,
            nr_pages: nr,
            vaddr,
            dst_id: u64::from(PID),
        }
    }

    /// The daemon's side: reads one GET answer (header and pages).
    fn read_answer(s: &mut std::net::TcpStream) -> (Iov, Vec<u8>) {
        let mut h = [0u8; HEADER];
        s.read_exact(&mut h).expect("answer header");
        let iov = Iov::parse(&h);
        let mut data = vec![0u8; (iov.nr_pages * page()) as usize];
        s.read_exact(&mut data).expect("answer pages");
        (iov, data)
    }

    /// Pages 0..4 and 8..10 held here; the source (a task answering the
    /// forwarded requests from its own copy) has them all.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn held_pages_are_answered_here_the_rest_by_the_source_in_order() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut store = PageStore::new(dir.path());
        let mut held = RangeSet::new();
        for (from, to) in [(0u64, 4u64), (8, 10)] {
            let data: Vec<u8> = (from..to).flat_map(|i| content(i, b'L')).collect();
            store
                .write(&PageBatch {
                    migration_id: "m".into(),
                    round: 1,
                    runs: vec![PageRun {
                        pid: PID,
                        vaddr: BASE + from * page(),
                        data: data.into(),
                        ..Default::default()
                    }],
                })
                .expect("store");
            held.insert(BASE + from * page(), BASE + to * page());
        }
        let local = Arc::new(OnceLock::new());
        local
            .set(LocalPages {
                held: [(PID, held)].into(),
                store: Arc::new(Mutex::new(store)),
            })
            .expect("set");
        let counter = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let pair = super::super::pagetunnel::loopback_pair()
            .await
            .expect("pair");
        let (to_source, mut at_source) = mpsc::channel::<Result<TunnelBytes, tonic::Status>>(64);
        let (from_source, inbound) = mpsc::channel::<Result<TunnelBytes, tonic::Status>>(64);
        let served = tokio::spawn(serve(
            pair.ours,
            ReceiverStream::new(inbound),
            to_source,
            local,
            counter.clone(),
        ));
        // The source: answers each forwarded GET in full, and a close with
        // status 0; records what it was asked.
        let source = tokio::spawn(async move {
            let mut asked = Vec::new();
            let mut buf = Vec::new();
            while let Some(m) = at_source.recv().await {
                buf.extend(m.expect("the destination sends no errors").data);
                while buf.len() >= HEADER {
                    let h: [u8; HEADER] = buf[..HEADER].try_into().expect("header");
                    buf.drain(..HEADER);
                    let iov = Iov::parse(&h);
                    asked.push(iov);
                    let mut answer = Vec::new();
                    if iov.cmd == PS_IOV_FORCE_CLOSE {
                        answer.extend(0i32.to_ne_bytes());
                    } else {
                        answer.extend(
                            Iov {
                                cmd: PE_PRESENT << 16 | PS_IOV_ADD_F,
                                ..iov
                            }
                            .bytes(),
                        );
                        let first = (iov.vaddr - BASE) / page();
                        for i in first..first + iov.nr_pages {
                            answer.extend(content(i, b'R'));
                        }
                    }
                    // Cut into odd pieces, as a tunnel may deliver them.
                    for piece in answer.chunks(1000) {
                        from_source
                            .send(Ok(TunnelBytes {
                                migration_id: String::new(),
                                data: piece.to_vec(),
                            }))
                            .await
                            .expect("to the tunnel");
                    }
                }
            }
            asked
        });
        let mut daemon = std::net::TcpStream::from(pair.criu);
        let answers = tokio::task::spawn_blocking(move || {
            // 1: pages 2..6 (2, 3 held); 2: pages 4..8 (none held);
            // 3: pages 8..9 (held); then the close.
            for iov in [
                get(BASE + 2 * page(), 4),
                get(BASE + 4 * page(), 4),
                get(BASE + 8 * page(), 1),
            ] {
                daemon.write_all(&iov.bytes()).expect("request");
            }
            let answers: Vec<_> = (0..3).map(|_| read_answer(&mut daemon)).collect();
            daemon
                .write_all(
                    &Iov {
                        cmd: PS_IOV_FORCE_CLOSE,
                        nr_pages: 0,
                        vaddr: 0,
                        dst_id: 0,
                    }
                    .bytes(),
                )
                .expect("close");
            let mut status = [0u8; STATUS];
            daemon.read_exact(&mut status).expect("status");
            assert_eq!(i32::from_ne_bytes(status), 0);
            daemon
                .shutdown(std::net::Shutdown::Write)
                .expect("shutdown");
            let mut rest = Vec::new();
            daemon.read_to_end(&mut rest).expect("end");
            assert!(rest.is_empty(), "{} bytes after the close", rest.len());
            answers
        })
        .await
        .expect("daemon");
        let expect = |first: u64, n: u64, origin: u8| -> Vec<u8> {
            (first..first + n)
                .flat_map(|i| content(i, origin))
                .collect()
        };
        // A short answer from here (the held prefix), all from the store.
        assert_eq!(answers[0].0.vaddr, BASE + 2 * page());
        assert_eq!(answers[0].0.nr_pages, 2);
        assert_eq!(answers[0].0.cmd, PE_PRESENT << 16 | PS_IOV_ADD_F);
        assert_eq!(answers[0].1, expect(2, 2, b'L'));
        // The source's answer for the pages not held, in its turn.
        assert_eq!(answers[1].0.nr_pages, 4);
        assert_eq!(answers[1].1, expect(4, 4, b'R'));
        assert_eq!(answers[2].0.nr_pages, 1);
        assert_eq!(answers[2].1, expect(8, 1, b'L'));
        let asked = source.await.expect("source");
        assert_eq!(
            asked
                .iter()
                .map(|i| (i.cmd, i.vaddr, i.nr_pages))
                .collect::<Vec<_>>(),
            vec![
                (PS_IOV_GET, BASE + 4 * page(), 4),
                (PS_IOV_FORCE_CLOSE, 0, 0)
            ],
            "only what is not held goes to the source"
        );
        let served = served.await.expect("join").expect("serve");
        assert_eq!(
            served,
            Served {
                local_pages: 3,
                remote_pages: 4,
                local_requests: 2,
                remote_requests: 1
            }
        );
        assert_eq!(counter.load(std::sync::atomic::Ordering::Relaxed), 3);
    }

    /// A request the daemon never sends ends the session.
    #[test]
    fn unknown_commands_are_refused() {
        let iov = Iov {
            cmd: 3,
            nr_pages: 1,
            vaddr: BASE,
            dst_id: 1,
        };
        assert!(route(iov, None, page()).is_err());
        assert!(route(get(BASE, 0), None, page()).is_err());
        assert_eq!(
            route(get(BASE, 3), None, page()).expect("route"),
            Route::Source(get(BASE, 3))
        );
    }

    #[test]
    fn headers_round_trip() {
        let iov = Iov {
            cmd: PE_PRESENT << 16 | PS_IOV_ADD_F,
            nr_pages: 12,
            vaddr: BASE,
            dst_id: 99,
        };
        assert_eq!(Iov::parse(&iov.bytes()), iov);
    }
}
