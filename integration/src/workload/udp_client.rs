//! UDP clients that send sequence-numbered datagrams at a fixed rate to an
//! echo server and account for every echo: the seed's OpenArena setup (24
//! players at 20 Hz) as an observer of "no datagram lost".
//!
//! Each client has its own socket, connected to the server (so only the
//! server's echoes reach it). All clients run on one thread inside the
//! client's network namespace, paced by `poll(2)`.

use std::net::{SocketAddr, UdpSocket};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::netns::NetNsGuard;

/// Bytes of a datagram's header: client id (u32) and sequence number (u64),
/// big-endian.
pub const UDP_HEADER: usize = 12;

#[derive(Debug, thiserror::Error)]
pub enum UdpClientError {
    #[error("invalid parameters: {0}")]
    Invalid(String),
    #[error("starting the UDP client thread: {0}")]
    Thread(std::io::Error),
    #[error("UDP client setup: {0}")]
    Setup(String),
    #[error("the UDP client thread panicked")]
    Panicked,
}

/// What one client saw.
#[derive(Debug, Clone, Default)]
pub struct UdpClientReport {
    pub id: u32,
    pub sent: u64,
    /// Distinct sequence numbers echoed.
    pub received: u64,
    /// Echoes of a sequence number seen before.
    pub duplicates: u64,
    /// Echoes that arrived after a higher sequence number.
    pub reordered: u64,
    /// Sequence numbers sent and never echoed.
    pub lost: Vec<u64>,
    /// Longest time between two echoes.
    pub max_gap: Duration,
    /// When (since the start) that gap began.
    pub max_gap_at: Duration,
    /// Echoes whose content differs from what was sent.
    pub corrupt: u64,
}

/// What all clients saw.
#[derive(Debug, Clone)]
pub struct UdpReport {
    pub target: SocketAddr,
    pub duration: Duration,
    pub clients: Vec<UdpClientReport>,
}

impl UdpReport {
    pub fn sent(&self) -> u64 {
        self.clients.iter().map(|c| c.sent).sum()
    }
    pub fn received(&self) -> u64 {
        self.clients.iter().map(|c| c.received).sum()
    }
    pub fn lost(&self) -> u64 {
        self.clients.iter().map(|c| c.lost.len() as u64).sum()
    }
    pub fn duplicates(&self) -> u64 {
        self.clients.iter().map(|c| c.duplicates).sum()
    }
    pub fn corrupt(&self) -> u64 {
        self.clients.iter().map(|c| c.corrupt).sum()
    }
    /// The longest gap between echoes on any client.
    pub fn max_gap(&self) -> Duration {
        self.clients
            .iter()
            .map(|c| c.max_gap)
            .max()
            .unwrap_or_default()
    }
}

impl std::fmt::Display for UdpReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} UDP clients to {} over {:.3}s: {} sent, {} echoed, {} lost, {} duplicated, {} corrupt; max gap {:.3} ms",
            self.clients.len(),
            self.target,
            self.duration.as_secs_f64(),
            self.sent(),
            self.received(),
            self.lost(),
            self.duplicates(),
            self.corrupt(),
            self.max_gap().as_secs_f64() * 1e3
        )?;
        for c in self.clients.iter().filter(|c| !c.lost.is_empty()) {
            write!(f, "\n  client {} lost {:?}", c.id, c.lost)?;
        }
        Ok(())
    }
}

/// Running UDP clients; see the module docs.
#[derive(Debug)]
pub struct UdpClients {
    stop: Arc<AtomicBool>,
    echoed: Arc<AtomicU64>,
    thread: Option<JoinHandle<UdpReport>>,
}

struct Client {
    id: u32,
    socket: UdpSocket,
    sent: u64,
    seen: Vec<bool>,
    highest: Option<u64>,
    duplicates: u64,
    reordered: u64,
    corrupt: u64,
    last_echo: Option<Instant>,
    max_gap: Duration,
    max_gap_at: Duration,
}

impl UdpClients {
    /// Starts `clients` clients in the namespace at `netns`, each sending a
    /// `len`-byte datagram to `target` every `interval`.
    pub fn start(
        netns: impl AsRef<Path>,
        target: impl Into<SocketAddr>,
        clients: usize,
        interval: Duration,
        len: usize,
    ) -> Result<Self, UdpClientError> {
        let target = target.into();
        if clients == 0 || interval.is_zero() || !(UDP_HEADER..=1400).contains(&len) {
            return Err(UdpClientError::Invalid(format!(
                "clients {clients} (>0), interval {interval:?} (>0), len {len} ({UDP_HEADER}..=1400)"
            )));
        }
        let netns: PathBuf = netns.as_ref().to_owned();
        let stop = Arc::new(AtomicBool::new(false));
        let echoed = Arc::new(AtomicU64::new(0));
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let thread = {
            let (stop, echoed) = (stop.clone(), echoed.clone());
            std::thread::Builder::new()
                .name("udp-clients".into())
                .spawn(move || {
                    let setup = || -> Result<(NetNsGuard, Vec<Client>), String> {
                        let guard = NetNsGuard::enter(&netns).map_err(|e| e.to_string())?;
                        let mut v = Vec::new();
                        for id in 0..clients as u32 {
                            let any = if target.is_ipv4() {
                                "0.0.0.0:0"
                            } else {
                                "[::]:0"
                            };
                            let s = UdpSocket::bind(any).map_err(|e| e.to_string())?;
                            s.connect(target).map_err(|e| e.to_string())?;
                            s.set_nonblocking(true).map_err(|e| e.to_string())?;
                            v.push(Client {
                                id,
                                socket: s,
                                sent: 0,
                                seen: Vec::new(),
                                highest: None,
                                duplicates: 0,
                                reordered: 0,
                                corrupt: 0,
                                last_echo: None,
                                max_gap: Duration::ZERO,
                                max_gap_at: Duration::ZERO,
                            });
                        }
                        Ok((guard, v))
                    };
                    match setup() {
                        Ok((_guard, v)) => {
                            let _ = ready_tx.send(Ok(()));
                            run(v, target, interval, len, &stop, &echoed)
                        }
                        Err(e) => {
                            let _ = ready_tx.send(Err(e));
                            UdpReport {
                                target,
                                duration: Duration::ZERO,
                                clients: vec![],
                            }
                        }
                    }
                })
                .map_err(UdpClientError::Thread)?
        };
        match ready_rx.recv() {
            Ok(Ok(())) => Ok(Self {
                stop,
                echoed,
                thread: Some(thread),
            }),
            Ok(Err(e)) => {
                let _ = thread.join();
                Err(UdpClientError::Setup(e))
            }
            Err(_) => {
                let _ = thread.join();
                Err(UdpClientError::Panicked)
            }
        }
    }

    /// Echoes received so far, over all clients.
    pub fn echoed(&self) -> u64 {
        self.echoed.load(Ordering::Relaxed)
    }

    /// Waits (bounded) until at least `n` echoes have come back.
    pub fn wait_for_echoes(&self, n: u64, timeout: Duration) -> Result<(), String> {
        let deadline = Instant::now() + timeout;
        while self.echoed() < n {
            if Instant::now() > deadline {
                return Err(format!(
                    "only {} of {n} echoes within {timeout:?}",
                    self.echoed()
                ));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        Ok(())
    }

    /// Stops sending, waits up to a second for the last echoes, reports.
    pub fn stop(mut self) -> Result<UdpReport, UdpClientError> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread
            .take()
            .expect("joined once")
            .join()
            .map_err(|_| UdpClientError::Panicked)
    }
}

impl Drop for UdpClients {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// How long after the stop the clients keep listening for echoes.
const DRAIN: Duration = Duration::from_secs(1);

fn payload(id: u32, seq: u64, len: usize) -> Vec<u8> {
    let mut d = Vec::with_capacity(len);
    d.extend_from_slice(&id.to_be_bytes());
    d.extend_from_slice(&seq.to_be_bytes());
    // Filler derived from both, so a corrupted or misdelivered datagram
    // shows.
    d.extend(
        (0..len - UDP_HEADER).map(|i| (seq as u8).wrapping_add(id as u8).wrapping_add(i as u8)),
    );
    d
}

fn run(
    mut clients: Vec<Client>,
    target: SocketAddr,
    interval: Duration,
    len: usize,
    stop: &AtomicBool,
    echoed: &AtomicU64,
) -> UdpReport {
    let started = Instant::now();
    // The players send in slots spread over the interval (at most one slot
    // per 5 ms), as independent players do: all at once, a thousand
    // datagrams would land in the server's socket in one burst every
    // interval, more than its default buffer holds.
    let slots = (interval.as_millis() / 5).clamp(1, clients.len().max(1) as u128) as u32;
    let due = |tick: u64| {
        started
            + interval * (tick / u64::from(slots)) as u32
            + interval * (tick % u64::from(slots)) as u32 / slots
    };
    let mut tick = 0u64;
    let mut next = started;
    let mut stopped_at: Option<Instant> = None;
    let mut buf = vec![0u8; 2048];
    let mut fds: Vec<libc::pollfd> = clients
        .iter()
        .map(|c| libc::pollfd {
            fd: c.socket.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    loop {
        let now = Instant::now();
        if stopped_at.is_none() && stop.load(Ordering::Relaxed) {
            stopped_at = Some(now);
        }
        match stopped_at {
            Some(t) => {
                let all_back = clients
                    .iter()
                    .all(|c| c.seen.iter().filter(|s| **s).count() as u64 == c.sent);
                if all_back || now - t > DRAIN {
                    break;
                }
            }
            None if now >= next => {
                let slot = (tick % u64::from(slots)) as usize;
                for c in clients.iter_mut().skip(slot).step_by(slots as usize) {
                    let d = payload(c.id, c.sent, len);
                    // A send the kernel refuses (buffer full) is counted as
                    // sent: it shows up as lost.
                    let _ = c.socket.send(&d);
                    c.sent += 1;
                    c.seen.push(false);
                }
                tick += 1;
                next = due(tick);
            }
            None => {}
        }
        let wait = if stopped_at.is_some() {
            Duration::from_millis(10)
        } else {
            next.saturating_duration_since(Instant::now())
        };
        for f in &mut fds {
            f.revents = 0;
        }
        // To the nanosecond: poll(2)'s milliseconds would round the wait
        // for the next slot down, to 0 in its last millisecond, and the
        // players would spin on the cores the nodes run on.
        let wait = wait.min(Duration::from_secs(1));
        let timeout = libc::timespec {
            tv_sec: wait.as_secs() as libc::time_t,
            tv_nsec: wait.subsec_nanos() as libc::c_long,
        };
        // SAFETY: fds is a valid array of fds.len() pollfd structs that the
        // kernel may write revents into during the call; timeout is a valid
        // timespec it only reads; a null signal mask leaves the mask as is.
        unsafe {
            libc::ppoll(
                fds.as_mut_ptr(),
                fds.len() as libc::nfds_t,
                &timeout,
                std::ptr::null(),
            )
        };
        for (i, f) in fds.iter().enumerate() {
            if f.revents == 0 {
                continue;
            }
            let c = &mut clients[i];
            while let Ok(n) = c.socket.recv(&mut buf) {
                let now = Instant::now();
                echoed.fetch_add(1, Ordering::Relaxed);
                if let Some(last) = c.last_echo {
                    let gap = now - last;
                    if gap > c.max_gap {
                        c.max_gap = gap;
                        c.max_gap_at = last - started;
                    }
                }
                c.last_echo = Some(now);
                let d = &buf[..n];
                if n < UDP_HEADER {
                    c.corrupt += 1;
                    continue;
                }
                let id = u32::from_be_bytes(d[..4].try_into().unwrap());
                let seq = u64::from_be_bytes(d[4..12].try_into().unwrap());
                if id != c.id || seq >= c.sent || d != payload(id, seq, len).as_slice() {
                    c.corrupt += 1;
                    continue;
                }
                let slot = &mut c.seen[seq as usize];
                if *slot {
                    c.duplicates += 1;
                } else {
                    *slot = true;
                }
                match c.highest {
                    Some(h) if seq < h => c.reordered += 1,
                    _ => c.highest = Some(seq),
                }
            }
        }
    }
    UdpReport {
        target,
        duration: started.elapsed(),
        clients: clients
            .into_iter()
            .map(|c| UdpClientReport {
                id: c.id,
                sent: c.sent,
                received: c.seen.iter().filter(|s| **s).count() as u64,
                duplicates: c.duplicates,
                reordered: c.reordered,
                lost: (0..c.sent).filter(|s| !c.seen[*s as usize]).collect(),
                max_gap: c.max_gap,
                max_gap_at: c.max_gap_at,
                corrupt: c.corrupt,
            })
            .collect(),
    }
}
