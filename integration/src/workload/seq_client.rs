//! A client that keeps N echo connections busy and checks every byte that
//! comes back: the observer of "nobody's connection drops".
//!
//! All connections live on one dedicated thread that enters the client's
//! network namespace before it creates any socket, and run there on a
//! single-threaded Tokio runtime (one task per connection). One thread
//! scales to the thousand connections of the seed's figures, and within a
//! single-threaded runtime "bytes sent" is always updated before the echo of
//! those bytes can be read, so the accounting is exact.

use std::cell::{Cell, RefCell};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::{Notify, watch};
use tokio::task::JoinSet;
use tokio::time::MissedTickBehavior;

use super::pattern::{self, HEADER_LEN, Verifier};
use super::probe::{self, ProbeConnection};
use super::report::{ConnReport, Gap, SeqReport, StreamError, StreamErrorKind};
use crate::netns::{NetNsError, NetNsGuard};

/// How long `stop` waits for the echoes of everything sent.
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum SeqError {
    #[error("invalid parameters: {0}")]
    Invalid(String),
    #[error(transparent)]
    NetNs(#[from] NetNsError),
    #[error("starting the client thread: {0}")]
    Thread(std::io::Error),
    #[error("building the client runtime: {0}")]
    Runtime(std::io::Error),
    #[error("connection {conn} to {target}: {source}")]
    Connect {
        conn: usize,
        target: SocketAddr,
        source: std::io::Error,
    },
    #[error("connection {conn} to {target}: no answer within {timeout:?}")]
    ConnectTimeout {
        conn: usize,
        target: SocketAddr,
        timeout: Duration,
    },
    #[error("probe of {target}: {what}: {source}")]
    Probe {
        target: SocketAddr,
        what: &'static str,
        source: std::io::Error,
    },
    #[error("probe of {target}: echo differs from what was sent at byte {offset}")]
    ProbeMismatch { target: SocketAddr, offset: u64 },
    #[error("the client thread panicked")]
    Panicked,
    #[error("connection {conn} ({local}) failed: {error}")]
    ConnectionFailed {
        conn: usize,
        local: SocketAddr,
        error: String,
    },
    #[error(
        "{what}: not reached within {timeout:?}; verified messages per connection: {verified:?}"
    )]
    Stalled {
        what: String,
        timeout: Duration,
        verified: Vec<u64>,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Running,
    /// Stop sending, wait this long at most for the outstanding echoes.
    Drain(Duration),
    /// Stop everything now.
    Abort,
}

/// Live counters of one connection, readable while the client runs.
#[derive(Debug, Default)]
struct Live {
    sent: AtomicU64,
    verified: AtomicU64,
    max_gap_us: AtomicU64,
    failed: AtomicBool,
    first_error: std::sync::Mutex<Option<String>>,
}

/// A moment's view of a running client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeqSnapshot {
    pub sent_bytes: u64,
    pub verified_bytes: u64,
    /// The fewest messages verified on any one connection.
    pub min_verified_messages: u64,
    pub failed_connections: usize,
    pub max_gap: Duration,
}

/// Parameters of a [`SeqClient`].
#[derive(Debug, Clone)]
struct Params {
    netns: PathBuf,
    target: SocketAddr,
    connections: usize,
    interval: Duration,
    message_len: usize,
}

/// N connections sending sequence-numbered messages to an echo server and
/// verifying the echo byte for byte. See the module docs.
#[derive(Debug)]
pub struct SeqClient {
    params: Params,
    phase: Arc<watch::Sender<Phase>>,
    live: Arc<Vec<Live>>,
    locals: Vec<SocketAddr>,
    started: Instant,
    thread: Option<JoinHandle<Vec<ConnReport>>>,
}

impl SeqClient {
    /// Connects `connections` connections from the namespace at `netns` to
    /// `target` (all are established when this returns), then sends one
    /// `message_len`-byte message per connection every `interval` (zero:
    /// as fast as the connection takes them).
    pub fn start(
        netns: impl AsRef<Path>,
        target: impl Into<SocketAddr>,
        connections: usize,
        interval: Duration,
        message_len: usize,
    ) -> Result<Self, SeqError> {
        let target = target.into();
        if connections == 0 {
            return Err(SeqError::Invalid("at least one connection".into()));
        }
        if message_len < HEADER_LEN {
            return Err(SeqError::Invalid(format!(
                "message_len must be at least {HEADER_LEN}, not {message_len}"
            )));
        }
        let params = Params {
            netns: netns.as_ref().to_owned(),
            target,
            connections,
            interval,
            message_len,
        };
        let (phase, _) = watch::channel(Phase::Running);
        let phase = Arc::new(phase);
        let live: Arc<Vec<Live>> = Arc::new((0..connections).map(|_| Live::default()).collect());
        let started = Instant::now();
        let (ready_tx, ready_rx) = mpsc::channel();
        let thread = {
            let (params, phase, live) = (params.clone(), phase.clone(), live.clone());
            std::thread::Builder::new()
                .name("seq-client".into())
                .spawn(move || drive(params, phase, live, started, ready_tx))
                .map_err(SeqError::Thread)?
        };
        match ready_rx.recv() {
            Ok(Ok(locals)) => Ok(Self {
                params,
                phase,
                live,
                locals,
                started,
                thread: Some(thread),
            }),
            Ok(Err(e)) => {
                let _ = thread.join();
                Err(e)
            }
            Err(_) => {
                let _ = thread.join();
                Err(SeqError::Panicked)
            }
        }
    }

    /// `connections` connections with the seed's DVE traffic (one 256-byte
    /// message per connection every 50 ms, 20/s), returned once every
    /// connection has had an answer (bounded by 10 s).
    pub fn dve(
        netns: impl AsRef<Path>,
        target: impl Into<SocketAddr>,
        connections: usize,
    ) -> Result<Self, SeqError> {
        let target = target.into();
        let client = Self::start(netns, target, connections, Duration::from_millis(50), 256)?;
        client.wait_until_flowing(Duration::from_secs(10))?;
        Ok(client)
    }

    /// Connects once, round-trips one message and keeps the connection open
    /// in the returned [`ProbeConnection`] (its local address identifies the socket on
    /// whichever node holds it).
    pub fn probe_once(
        netns: impl AsRef<Path>,
        target: impl Into<SocketAddr>,
    ) -> Result<ProbeConnection, SeqError> {
        let target = target.into();
        probe::probe_once(netns.as_ref(), target, CONNECT_TIMEOUT)
    }

    pub fn target(&self) -> SocketAddr {
        self.params.target
    }

    /// The client side addresses of the connections, by connection id.
    pub fn local_addrs(&self) -> &[SocketAddr] {
        &self.locals
    }

    pub fn started(&self) -> Instant {
        self.started
    }

    pub fn snapshot(&self) -> SeqSnapshot {
        let len = self.params.message_len as u64;
        SeqSnapshot {
            sent_bytes: self
                .live
                .iter()
                .map(|l| l.sent.load(Ordering::Relaxed))
                .sum(),
            verified_bytes: self
                .live
                .iter()
                .map(|l| l.verified.load(Ordering::Relaxed))
                .sum(),
            min_verified_messages: self
                .live
                .iter()
                .map(|l| l.verified.load(Ordering::Relaxed) / len)
                .min()
                .unwrap_or(0),
            failed_connections: self
                .live
                .iter()
                .filter(|l| l.failed.load(Ordering::Relaxed))
                .count(),
            max_gap: Duration::from_micros(
                self.live
                    .iter()
                    .map(|l| l.max_gap_us.load(Ordering::Relaxed))
                    .max()
                    .unwrap_or(0),
            ),
        }
    }

    /// Whole messages verified so far, by connection id: a mark for
    /// [`SeqClient::wait_until_each_passes`].
    pub fn verified_per_connection(&self) -> Vec<u64> {
        let len = self.params.message_len as u64;
        self.live
            .iter()
            .map(|l| l.verified.load(Ordering::Relaxed) / len)
            .collect()
    }

    /// Waits until every connection has had at least one echo verified.
    pub fn wait_until_flowing(&self, timeout: Duration) -> Result<(), SeqError> {
        self.wait_each(
            vec![1; self.live.len()],
            timeout,
            "every connection verifying echoes".into(),
        )
    }

    /// Waits until every connection `i` has verified `n` messages more than
    /// `mark[i]` (from [`SeqClient::verified_per_connection`]). Fails early
    /// when a connection fails.
    pub fn wait_until_each_passes(
        &self,
        mark: &[u64],
        n: u64,
        timeout: Duration,
    ) -> Result<(), SeqError> {
        assert_eq!(mark.len(), self.live.len(), "mark of another client");
        self.wait_each(
            mark.iter().map(|m| m + n).collect(),
            timeout,
            format!("every connection verifying {n} more messages"),
        )
    }

    fn wait_each(&self, want: Vec<u64>, timeout: Duration, what: String) -> Result<(), SeqError> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(conn) = self
                .live
                .iter()
                .position(|l| l.failed.load(Ordering::Relaxed))
            {
                let error = self.live[conn]
                    .first_error
                    .lock()
                    .map(|e| e.clone().unwrap_or_default())
                    .unwrap_or_default();
                return Err(SeqError::ConnectionFailed {
                    conn,
                    local: self.locals[conn],
                    error,
                });
            }
            let verified = self.verified_per_connection();
            if verified.iter().zip(&want).all(|(v, w)| v >= w) {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(SeqError::Stalled {
                    what,
                    timeout,
                    verified,
                });
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Stops sending, waits up to [`DRAIN_TIMEOUT`] for every sent byte to
    /// come back, closes the connections and reports.
    pub fn stop(self) -> SeqReport {
        self.stop_within(DRAIN_TIMEOUT)
    }

    /// [`SeqClient::stop`] with another drain period.
    pub fn stop_within(mut self, drain: Duration) -> SeqReport {
        // The driver switches to Abort itself when the drain period ends.
        self.phase.send_replace(Phase::Drain(drain));
        let thread = self.thread.take().expect("thread present until stopped");
        let connections = thread
            .join()
            .unwrap_or_else(|p| std::panic::resume_unwind(p));
        SeqReport {
            target: self.params.target,
            started: self.started,
            stopped: Instant::now(),
            connections,
        }
    }
}

impl Drop for SeqClient {
    fn drop(&mut self) {
        if let Some(thread) = self.thread.take() {
            self.phase.send_replace(Phase::Abort);
            let _ = thread.join();
        }
    }
}

type Ready = Result<Vec<SocketAddr>, SeqError>;

/// The client thread: enter the namespace, connect, run until stopped.
fn drive(
    params: Params,
    phase: Arc<watch::Sender<Phase>>,
    live: Arc<Vec<Live>>,
    started: Instant,
    ready: mpsc::Sender<Ready>,
) -> Vec<ConnReport> {
    // For the thread's whole life: every socket must be created inside.
    let _netns = match NetNsGuard::enter(&params.netns) {
        Ok(g) => g,
        Err(e) => {
            let _ = ready.send(Err(e.into()));
            return Vec::new();
        }
    };
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            let _ = ready.send(Err(SeqError::Runtime(e)));
            return Vec::new();
        }
    };
    // Connection futures share `Cell`s between their reader and writer
    // halves, so they are !Send and run on a LocalSet.
    let local = tokio::task::LocalSet::new();
    local.block_on(&runtime, async move {
        // Subscribed before `ready` is sent, so no stop can be missed.
        let mut phase_rx = phase.subscribe();
        let streams = match connect_all(&params).await {
            Ok(s) => s,
            Err(e) => {
                let _ = ready.send(Err(e));
                return Vec::new();
            }
        };
        let locals: Vec<SocketAddr> = streams.iter().map(|(_, a)| *a).collect();
        if ready.send(Ok(locals.clone())).is_err() {
            return Vec::new();
        }

        let mut tasks = JoinSet::new();
        let count = streams.len().max(1) as u32;
        for (id, (stream, local)) in streams.into_iter().enumerate() {
            let conn = Conn {
                id,
                local,
                message_len: params.message_len,
                interval: params.interval,
                // Spread over one interval, as independent clients are:
                // started together, every connection would send in the
                // same instant, and a freeze shorter than the interval
                // could fall between two bursts and see no packet at all.
                first_after: params.interval * id as u32 / count,
                started,
                live: live.clone(),
            };
            tasks.spawn_local(conn.run(stream, phase.subscribe()));
        }
        let mut reports: Vec<Option<ConnReport>> = vec![None; locals.len()];
        let mut drain_deadline: Option<tokio::time::Instant> = None;
        loop {
            tokio::select! {
                joined = tasks.join_next() => match joined {
                    None => break,
                    Some(Ok(r)) => {
                        let id = r.id;
                        reports[id] = Some(r);
                    }
                    Some(Err(_)) => {}
                },
                changed = phase_rx.changed(), if drain_deadline.is_none() => {
                    if changed.is_err() {
                        // The client is gone without stopping: abort.
                        phase.send_replace(Phase::Abort);
                    } else if let Phase::Drain(d) = *phase_rx.borrow_and_update() {
                        drain_deadline = Some(tokio::time::Instant::now() + d);
                    }
                }
                _ = sleep_until_opt(drain_deadline) => {
                    phase.send_replace(Phase::Abort);
                    drain_deadline = None;
                }
            }
        }
        // A task that panicked (a bug here) still gets a row, from its
        // live counters.
        reports
            .into_iter()
            .enumerate()
            .map(|(id, r)| {
                r.unwrap_or_else(|| {
                    let l = &live[id];
                    ConnReport {
                        id,
                        local: locals[id],
                        sent_bytes: l.sent.load(Ordering::Relaxed),
                        verified_bytes: l.verified.load(Ordering::Relaxed),
                        message_len: params.message_len,
                        error: Some(StreamError {
                            kind: StreamErrorKind::Io {
                                kind: std::io::ErrorKind::Other,
                                message: "connection task panicked".into(),
                            },
                            after: started.elapsed(),
                            verified: l.verified.load(Ordering::Relaxed),
                        }),
                        max_gap: None,
                    }
                })
            })
            .collect()
    })
}

/// Connects one after another: a burst of SYNs could overflow the server's
/// accept backlog, which is not what the tests are about.
async fn connect_all(params: &Params) -> Result<Vec<(TcpStream, SocketAddr)>, SeqError> {
    let mut out = Vec::with_capacity(params.connections);
    for conn in 0..params.connections {
        let target = params.target;
        let stream = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(target))
            .await
            .map_err(|_| SeqError::ConnectTimeout {
                conn,
                target,
                timeout: CONNECT_TIMEOUT,
            })?
            .map_err(|source| SeqError::Connect {
                conn,
                target,
                source,
            })?;
        // Each message leaves at once: Nagle would batch them and blur gaps.
        stream
            .set_nodelay(true)
            .map_err(|source| SeqError::Connect {
                conn,
                target,
                source,
            })?;
        let local = match stream.local_addr() {
            Ok(a) => a,
            Err(source) => {
                return Err(SeqError::Connect {
                    conn,
                    target,
                    source,
                });
            }
        };
        out.push((stream, local));
    }
    Ok(out)
}

struct Conn {
    id: usize,
    local: SocketAddr,
    message_len: usize,
    interval: Duration,
    /// When its first message leaves, after the writers start.
    first_after: Duration,
    started: Instant,
    live: Arc<Vec<Live>>,
}

/// State shared by a connection's writer and reader, which run as two
/// futures of the same task.
struct ConnState {
    sent: Cell<u64>,
    writer_done: Cell<bool>,
    writer_wake: Notify,
    error: RefCell<Option<StreamError>>,
}

impl Conn {
    fn live(&self) -> &Live {
        &self.live[self.id]
    }

    fn fail(&self, state: &ConnState, kind: StreamErrorKind, verified: u64) {
        let mut slot = state.error.borrow_mut();
        if slot.is_none() {
            let error = StreamError {
                kind,
                after: self.started.elapsed(),
                verified,
            };
            if let Ok(mut first) = self.live().first_error.lock() {
                *first = Some(error.to_string());
            }
            self.live().failed.store(true, Ordering::Relaxed);
            *slot = Some(error);
        }
    }

    async fn run(self, stream: TcpStream, phase: watch::Receiver<Phase>) -> ConnReport {
        let (rd, wr) = stream.into_split();
        let state = ConnState {
            sent: Cell::new(0),
            writer_done: Cell::new(false),
            writer_wake: Notify::new(),
            error: RefCell::new(None),
        };
        let verified = Cell::new(0u64);
        // The writer hands its half back instead of dropping it: that would
        // send a FIN, and the server would close before the last echoes.
        let (_write_half, max_gap) = tokio::join!(
            self.write_loop(wr, &state, &verified, phase.clone()),
            self.read_loop(rd, &state, &verified, phase),
        );
        let sent = state.sent.get();
        let verified = verified.get();
        if sent != verified {
            self.fail(
                &state,
                StreamErrorKind::Missing { sent, verified },
                verified,
            );
        }
        ConnReport {
            id: self.id,
            local: self.local,
            sent_bytes: sent,
            verified_bytes: verified,
            message_len: self.message_len,
            error: state.error.into_inner(),
            max_gap,
        }
    }

    async fn write_loop(
        &self,
        mut wr: OwnedWriteHalf,
        state: &ConnState,
        verified: &Cell<u64>,
        mut phase: watch::Receiver<Phase>,
    ) -> OwnedWriteHalf {
        let mut ticker = (!self.interval.is_zero()).then(|| {
            let mut t = tokio::time::interval_at(
                tokio::time::Instant::now() + self.first_after,
                self.interval,
            );
            // After a stall (a frozen server filling the send buffer) keep
            // the pace instead of bursting to catch up.
            t.set_missed_tick_behavior(MissedTickBehavior::Delay);
            t
        });
        let mut buf = vec![0; self.message_len];
        let mut seq = 0u64;
        'messages: while *phase.borrow() == Phase::Running && state.error.borrow().is_none() {
            match ticker.as_mut() {
                Some(t) => {
                    tokio::select! {
                        _ = t.tick() => {}
                        _ = phase.changed() => continue,
                    }
                }
                None => tokio::task::yield_now().await,
            }
            if *phase.borrow() != Phase::Running {
                break;
            }
            pattern::fill(&mut buf, self.id as u32, seq);
            let mut off = 0;
            while off < buf.len() {
                // A cancelled `write` wrote nothing, so `sent` stays exact
                // even when an abort interrupts it.
                tokio::select! {
                    r = wr.write(&buf[off..]) => match r {
                        Ok(0) => {
                            self.fail(state, StreamErrorKind::Eof, verified.get());
                            break 'messages;
                        }
                        Ok(n) => {
                            off += n;
                            state.sent.set(state.sent.get() + n as u64);
                            self.live().sent.store(state.sent.get(), Ordering::Relaxed);
                        }
                        Err(e) => {
                            self.fail(state, StreamErrorKind::from_io(&e), verified.get());
                            break 'messages;
                        }
                    },
                    _ = wait_for(&mut phase, Phase::Abort) => break 'messages,
                }
            }
            seq += 1;
        }
        state.writer_done.set(true);
        state.writer_wake.notify_one();
        wr
    }

    async fn read_loop(
        &self,
        mut rd: OwnedReadHalf,
        state: &ConnState,
        verified_out: &Cell<u64>,
        mut phase: watch::Receiver<Phase>,
    ) -> Option<Gap> {
        let mut verifier = Verifier::new(self.id as u32, self.message_len);
        let mut buf = vec![0; 64 * 1024];
        let mut last_echo: Option<Instant> = None;
        let mut max_gap: Option<Gap> = None;
        loop {
            if state.error.borrow().is_some() {
                break;
            }
            if state.writer_done.get() && verifier.verified() == state.sent.get() {
                break;
            }
            tokio::select! {
                r = rd.read(&mut buf) => match r {
                    Ok(0) => {
                        self.fail(state, StreamErrorKind::Eof, verifier.verified());
                        break;
                    }
                    Ok(n) => {
                        let now = Instant::now();
                        if let Some(prev) = last_echo {
                            let d = now - prev;
                            if max_gap.is_none_or(|g| d > g.duration) {
                                max_gap = Some(Gap { connection: self.id, duration: d, from: prev, to: now });
                                self.live().max_gap_us.store(d.as_micros() as u64, Ordering::Relaxed);
                            }
                        }
                        last_echo = Some(now);
                        if let Err(m) = verifier.check(&buf[..n]) {
                            self.fail(state, StreamErrorKind::Mismatch(m), verifier.verified());
                            break;
                        }
                        let sent = state.sent.get();
                        if verifier.verified() > sent {
                            self.fail(state, StreamErrorKind::Excess { sent, received: verifier.verified() }, sent);
                            break;
                        }
                        verified_out.set(verifier.verified());
                        self.live().verified.store(verifier.verified(), Ordering::Relaxed);
                    }
                    Err(e) => {
                        self.fail(state, StreamErrorKind::from_io(&e), verifier.verified());
                        break;
                    }
                },
                _ = state.writer_wake.notified() => {}
                _ = wait_for(&mut phase, Phase::Abort) => break,
            }
        }
        verified_out.set(verifier.verified());
        max_gap
    }
}

/// Never resolves for `None`.
async fn sleep_until_opt(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

/// Resolves once the phase is `want` (or the sender is gone).
async fn wait_for(phase: &mut watch::Receiver<Phase>, want: Phase) {
    let _ = phase.wait_for(|p| *p == want).await;
}
