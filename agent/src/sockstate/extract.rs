//! Source side: the connections of a stopped process tree, taken into
//! ferryd and read in one batch.

use std::collections::HashSet;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};

use nix::sys::socket::{SockaddrStorage, getpeername, getsockname};

use ferry_ebpf::Touched;

use super::descriptors::{SocketKind, addr, for_each_socket, kind_of};
use super::preread::{Handshake, Preread, PrereadConnection};
use super::sys::{self, RepairWindow};
use super::{SockStateError, TcpConnectionState, state_name};

/// One connection: ferryd's duplicate of the process's socket.
struct HeldConnection {
    inode: u64,
    fd: OwnedFd,
    /// Whether repair mode is on (so must be turned off on a resume).
    repairing: AtomicBool,
    /// SO_REUSEADDR as the process had it: turning repair off resets it.
    reuseaddr: AtomicBool,
}

/// The established TCP connections of a process tree, held by ferryd.
///
/// Dropping it closes ferryd's duplicates. After [`Held::extract`] (and
/// [`Held::repair_the_rest`] for those a pass of the iterator read) the
/// sockets are in repair mode, in which a close sends nothing (no FIN, no
/// RST): that is what happens on the commit, after the source's copy was
/// killed. On an abort, [`Held::resume`] must run before the process does.
pub struct Held {
    conns: Vec<HeldConnection>,
}

impl std::fmt::Debug for Held {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Held")
            .field("connections", &self.conns.len())
            .finish()
    }
}

/// The sockets of `tree` whose family CRIU cannot migrate, as (inode,
/// family): all but IPv4, IPv6, Unix, netlink and packet sockets (vsock,
/// AF_XDP, ...). Asked of each socket itself (SO_DOMAIN), so that an
/// unbound socket, which no /proc/net table lists, is judged right. Run
/// before the freeze: such a socket would fail CRIU's dump with the
/// process already stopped.
pub fn unsupported_sockets(tree: &[i32]) -> Result<Vec<(u64, i32)>, SockStateError> {
    let mut found = Vec::new();
    let mut seen = HashSet::new();
    for_each_socket(tree, |inode, fd| {
        let domain = sys::get_int(fd.as_fd(), libc::SOL_SOCKET, libc::SO_DOMAIN).unwrap_or(-1);
        let supported = [
            libc::AF_INET,
            libc::AF_INET6,
            libc::AF_UNIX,
            libc::AF_NETLINK,
            libc::AF_PACKET,
        ]
        .contains(&domain);
        if !supported && seen.insert(inode) {
            found.push((inode, domain));
        }
        Ok(())
    })?;
    Ok(found)
}

/// The TCP connections and UDP sockets of a stopped process tree, taken
/// into ferryd in one pass over its descriptor tables (inside the freeze,
/// a second pass over a thousand descriptors would cost milliseconds).
pub struct StoppedSockets {
    tcp: Vec<(u64, OwnedFd)>,
    udp: Vec<(u64, OwnedFd)>,
    /// Found in the iterator's list of the tree's sockets, not in /proc.
    listed: bool,
}

/// Takes every connected TCP socket and every UDP socket of the process
/// tree `tree` (root first) into ferryd with `pidfd_getfd`. Call it with
/// the tree stopped: the descriptor tables must not change under it. A
/// socket shared by several processes of the tree is taken once.
/// `preread`: connections read before the freeze, each told by one call
/// (its TCP state) instead of three.
pub fn take_sockets(
    tree: &[i32],
    preread: Option<&Preread>,
) -> Result<StoppedSockets, SockStateError> {
    if let Some(reader) = preread.and_then(Preread::state_reader) {
        let listed = {
            let mut reader = crate::sync::lock(reader);
            reader.reads_by_process().then(|| {
                tree.iter()
                    .map(|&pid| reader.list_sockets(pid).map(|sockets| (pid, sockets)))
                    .collect::<Result<Vec<_>, _>>()
            })
        };
        match listed {
            Some(Ok(listed)) => return take_listed(&listed),
            // /proc says the same, slower.
            Some(Err(e)) => {
                tracing::debug!(error = %e, "listing the tree's sockets failed; /proc is read")
            }
            None => {}
        }
    }
    let mut taken = StoppedSockets {
        tcp: Vec::new(),
        udp: Vec::new(),
        listed: false,
    };
    let mut seen = HashSet::new();
    for_each_socket(tree, |inode, fd| {
        let known = preread
            .and_then(|p| p.get(inode))
            .and_then(|_| sys::tcp_info_head(fd.as_fd()).ok());
        let kind = match known {
            // A socket that is no TCP one (its inode number was reused)
            // fails TCP_INFO and is asked in full.
            Some(head) if head[0] != sys::TCP_LISTEN && head[0] != sys::TCP_CLOSE => {
                SocketKind::TcpConnected
            }
            Some(_) => SocketKind::Other,
            None => kind_of(fd.as_fd()),
        };
        let list = match kind {
            SocketKind::TcpConnected => &mut taken.tcp,
            SocketKind::Udp => &mut taken.udp,
            SocketKind::Other => return Ok(()),
        };
        if seen.insert(inode) {
            list.push((inode, fd));
        }
        Ok(())
    })?;
    Ok(taken)
}

/// What kind of socket the per-process iterator listed. Only a stream
/// socket of protocol TCP and a datagram one of protocol UDP count: a raw
/// socket of either protocol is neither.
fn kind_listed(s: &ferry_ebpf::TaskSocket) -> SocketKind {
    let family = i32::from(s.family);
    if family != libc::AF_INET && family != libc::AF_INET6 {
        return SocketKind::Other;
    }
    match (i32::from(s.kind), i32::from(s.protocol)) {
        (libc::SOCK_STREAM, libc::IPPROTO_TCP)
            if s.state != sys::TCP_LISTEN && s.state != sys::TCP_CLOSE =>
        {
            SocketKind::TcpConnected
        }
        (libc::SOCK_DGRAM, libc::IPPROTO_UDP) => SocketKind::Udp,
        _ => SocketKind::Other,
    }
}

/// [`take_sockets`] from the iterator's list of each process's sockets
/// (`listed`, root first): only the connections and UDP sockets are taken,
/// one `pidfd_getfd` each, with no listing of /proc/PID/fd and no call
/// asking a descriptor what it is. The tree is stopped, so the
/// descriptors are still the ones listed.
fn take_listed(
    listed: &[(i32, Vec<ferry_ebpf::TaskSocket>)],
) -> Result<StoppedSockets, SockStateError> {
    let mut taken = StoppedSockets {
        tcp: Vec::new(),
        udp: Vec::new(),
        listed: true,
    };
    let mut seen = HashSet::new();
    for (pid, sockets) in listed {
        let pid = *pid;
        let mut pidfd = None;
        for s in sockets {
            let list = match kind_listed(s) {
                SocketKind::TcpConnected => &mut taken.tcp,
                SocketKind::Udp => &mut taken.udp,
                SocketKind::Other => continue,
            };
            if !seen.insert(s.inode) {
                continue;
            }
            let pidfd = match &pidfd {
                Some(p) => p,
                None => pidfd.insert(crate::process::pidfd::open(pid).map_err(|source| {
                    SockStateError::Process {
                        op: "pidfd_open",
                        pid,
                        source,
                    }
                })?),
            };
            let fd = match sys::pidfd_getfd(pidfd.as_fd(), s.fd as i32) {
                Ok(fd) => fd,
                // Closed since the list (as in the /proc path; a stopped
                // tree closes nothing): another holder may still be taken.
                Err(e) if e.raw_os_error() == Some(libc::EBADF) => {
                    seen.remove(&s.inode);
                    continue;
                }
                Err(source) => {
                    return Err(SockStateError::Process {
                        op: "pidfd_getfd",
                        pid,
                        source,
                    });
                }
            };
            list.push((s.inode, fd));
        }
    }
    tracing::debug!(
        tcp = taken.tcp.len(),
        udp = taken.udp.len(),
        "sockets taken from the iterator's list"
    );
    Ok(taken)
}

impl StoppedSockets {
    /// The connections (TCP, neither listening nor closed).
    pub fn tcp_descriptors(&self) -> impl Iterator<Item = BorrowedFd<'_>> {
        self.tcp.iter().map(|(_, fd)| fd.as_fd())
    }

    /// The UDP sockets, for `udp::unread_datagrams`.
    pub(super) fn udp(&self) -> &[(u64, OwnedFd)] {
        &self.udp
    }

    /// Whether they were found in the iterator's list of the tree's
    /// sockets (else by listing /proc/PID/fd).
    pub fn from_list(&self) -> bool {
        self.listed
    }

    /// The connections, held for a collective migration.
    pub fn into_held(self) -> Held {
        Held::from_descriptors(self.tcp)
    }
}

impl Held {
    /// Connections ferryd already holds descriptors of, keyed by inode.
    pub fn from_descriptors(fds: Vec<(u64, OwnedFd)>) -> Self {
        Self {
            conns: fds
                .into_iter()
                .map(|(inode, fd)| HeldConnection {
                    inode,
                    fd,
                    repairing: AtomicBool::new(false),
                    reuseaddr: AtomicBool::new(false),
                })
                .collect(),
        }
    }

    pub fn len(&self) -> usize {
        self.conns.len()
    }

    pub fn is_empty(&self) -> bool {
        self.conns.is_empty()
    }

    /// Turns repair on for every connection and reads its state, spread
    /// over the machine's cores. The process must be stopped and its
    /// packets held (the data plane's freeze): nothing may change a queue
    /// between its size and its bytes being read.
    /// `with_options`: their socket options too ([`super::options`]).
    pub fn extract(&self, with_options: bool) -> Result<Vec<TcpConnectionState>, SockStateError> {
        self.extract_incremental(with_options, None)
            .map(|(states, _)| states)
    }

    /// [`Held::extract`], taking what `preread` holds of a connection
    /// instead of reading it again, unless `touched` says a setsockopt call
    /// was made on it since ([`super::preread`]).
    pub fn extract_incremental(
        &self,
        with_options: bool,
        preread: Option<(&Preread, &Touched)>,
    ) -> Result<(Vec<TcpConnectionState>, ReadCounts), SockStateError> {
        if let Some((p, touched)) = preread
            && let Some(reader) = p.state_reader()
        {
            match self.extract_in_one_pass(with_options, p, touched, reader) {
                Ok(r) => return Ok(r),
                // Nothing was read: every connection is read by its calls.
                Err(e) => {
                    tracing::warn!(error = %e, "the TCP state iterator failed; reading each connection by its calls")
                }
            }
        }
        let chunks = self
            .conns
            .chunks(super::spread::chunk_len(self.conns.len()));
        let parts = super::spread::on_threads(chunks, "extract", |chunk| {
            let mut counts = ReadCounts::default();
            let states = chunk
                .iter()
                .map(|c| {
                    let pre = preread
                        .and_then(|(p, touched)| usable(p, touched, c, with_options, &mut counts));
                    extract_one(c, with_options, pre)
                })
                .collect::<Result<Vec<_>, _>>()?;
            Ok((states, counts))
        });
        let mut all = Vec::with_capacity(self.conns.len());
        let mut counts = ReadCounts::default();
        for part in parts {
            let (states, c) = part?;
            all.extend(states);
            counts += c;
        }
        Ok((all, counts))
    }

    /// Turns repair off again (an abort: the process resumes on the
    /// source), and gives each socket its SO_REUSEADDR back. Every socket
    /// is tried; the first error is returned.
    pub fn resume(&self) -> Result<(), SockStateError> {
        let mut first = None;
        for c in &self.conns {
            if !c.repairing.swap(false, Ordering::SeqCst) {
                continue;
            }
            let fd = c.fd.as_fd();
            let r =
                sys::set_int(fd, libc::SOL_TCP, sys::TCP_REPAIR, sys::REPAIR_OFF).and_then(|()| {
                    sys::set_int(
                        fd,
                        libc::SOL_SOCKET,
                        libc::SO_REUSEADDR,
                        i32::from(c.reuseaddr.load(Ordering::SeqCst)),
                    )
                });
            if let Err(source) = r
                && first.is_none()
            {
                first = Some(SockStateError::Sys {
                    op: "turning repair off",
                    conn: format!("inode {}", c.inode),
                    source,
                });
            }
        }
        first.map_or(Ok(()), Err)
    }
}

/// One connection in [`Held::extract_in_one_pass`]: its pre-read, while
/// the pass may still read it.
struct OnePass<'a> {
    conn: &'a HeldConnection,
    pre: Option<&'a PrereadConnection>,
}

impl Held {
    /// The connections' state in one pass of the TCP state iterator
    /// (`ferry_ebpf::TcpStateReader`), for those the pre-read knows and no
    /// setsockopt call touched since: no call at all for a connection
    /// whose queues are empty, repair mode and a peek for a queue that
    /// holds bytes, instead of ~14 calls. The pass needs no repair mode:
    /// the process is stopped and its packets held, so nothing moves; the
    /// others go into it during the restore ([`Held::repair_the_rest`]).
    /// An abort before that has nothing to undo for them. Those the pass does not report as an
    /// established connection without urgent data, and the others, are
    /// read by their calls as before. Err only if the pass itself failed,
    /// before any state was taken from it.
    fn extract_in_one_pass(
        &self,
        with_options: bool,
        preread: &Preread,
        touched: &Touched,
        reader: &std::sync::Mutex<ferry_ebpf::TcpStateReader>,
    ) -> Result<(Vec<TcpConnectionState>, ReadCounts), String> {
        let mut counts = ReadCounts::default();
        let plan: Vec<OnePass<'_>> = self
            .conns
            .iter()
            .map(|c| {
                let pre = preread.get(c.inode).filter(|p| {
                    !(touched.may_have_changed(&p.watched()) || with_options && p.options.is_none())
                });
                if let Some(p) = pre {
                    c.reuseaddr.store(p.reuseaddr, Ordering::SeqCst);
                }
                OnePass { conn: c, pre }
            })
            .collect();
        let started = std::time::Instant::now();
        let records: std::collections::HashMap<u64, ferry_ebpf::TcpKernelState> = {
            let mut reader = crate::sync::lock(reader);
            let by_process = preread
                .read_by_process(&reader)
                .then(|| reader.read_processes(preread.tree()));
            match by_process {
                Some(Ok(records)) => records,
                // The namespace's pass reads the same, slower.
                Some(Err(e)) => {
                    tracing::debug!(error = %e, "per-process pass failed; the namespace's is read");
                    reader.read().map_err(|e| e.to_string())?
                }
                None => reader.read().map_err(|e| e.to_string())?,
            }
        }
        .into_iter()
        .map(|r| (r.cookie, r))
        .collect();
        // Read once, right after the pass: each connection's timestamp is
        // this clock plus its offset, what TCP_TIMESTAMP would read now.
        let clock = ferry_ebpf::TcpClock::now().map_err(|e| format!("the TCP clock: {e}"))?;
        let passed = started.elapsed();
        let chunk = super::spread::chunk_len(plan.len());
        let parts = super::spread::on_threads(plan.chunks(chunk), "extract", |part| {
            let mut counts = ReadCounts::default();
            let states = part
                .iter()
                .map(|one| {
                    let from_pass = one.pre.and_then(|pre| {
                        let r = records.get(&pre.cookie)?;
                        (u32::from(sys::TCP_ESTABLISHED) == r.state && r.urg_data == 0)
                            .then_some((pre, r))
                    });
                    match from_pass {
                        Some((pre, r)) => {
                            counts.preread += 1;
                            from_record(one.conn, pre, r, clock, with_options)
                        }
                        None => {
                            let pre = usable(preread, touched, one.conn, with_options, &mut counts);
                            extract_one(one.conn, with_options, pre)
                        }
                    }
                })
                .collect::<Result<Vec<_>, _>>()?;
            Ok((states, counts))
        });
        let mut all = Vec::with_capacity(self.conns.len());
        for part in parts {
            let (states, c) = part.map_err(|e| e.to_string())?;
            all.extend(states);
            counts += c;
        }
        tracing::debug!(
            pass_ms = passed.as_secs_f64() * 1000.0,
            states_ms = (started.elapsed() - passed).as_secs_f64() * 1000.0,
            reported = records.len(),
            "connections read in one pass of the TCP state iterator"
        );
        Ok((all, counts))
    }

    /// Turns repair on for every connection not in it yet: those a pass
    /// of the iterator read without it ([`Held::extract_in_one_pass`]).
    /// Called while the destination restores, before the Release (beside
    /// CRIU's dump its ~1,000 calls took the dump's cores): from here a
    /// close sends nothing. One that fails is logged and left. Returns how
    /// many went into repair mode.
    pub fn repair_the_rest(&self) -> usize {
        let mut turned = 0;
        for c in self
            .conns
            .iter()
            .filter(|c| !c.repairing.load(Ordering::SeqCst))
        {
            match repair_on(c) {
                Ok(()) => turned += 1,
                Err(e) => {
                    tracing::error!(inode = c.inode, error = %e, "turning repair on after the read: the source's copy may send a FIN or an RST as it closes")
                }
            }
        }
        turned
    }
}

/// Repair mode on for `c`, and marked so for a resume.
fn repair_on(c: &HeldConnection) -> std::io::Result<()> {
    sys::set_int(c.fd.as_fd(), libc::SOL_TCP, sys::TCP_REPAIR, sys::REPAIR_ON)?;
    c.repairing.store(true, Ordering::SeqCst);
    Ok(())
}

/// A connection's state from the iterator's record of it and its
/// pre-read, its timestamp at `clock`; only a queue that holds bytes is
/// read (repair mode on, then peeked).
fn from_record(
    c: &HeldConnection,
    pre: &PrereadConnection,
    r: &ferry_ebpf::TcpKernelState,
    clock: ferry_ebpf::TcpClock,
    with_options: bool,
) -> Result<TcpConnectionState, SockStateError> {
    let fd = c.fd.as_fd();
    let err = |op: &'static str| {
        let conn = format!("{} -> {}", pre.local, pre.remote);
        move |source| SockStateError::Sys { op, conn, source }
    };
    let outq = r.outq();
    let inq = r.inq();
    if (outq > 0 || inq > 0) && !c.repairing.load(Ordering::SeqCst) {
        repair_on(c).map_err(err("turning repair on"))?;
    }
    let recv_queue = repair_queue_bytes(fd, sys::TCP_RECV_QUEUE, inq)
        .map_err(err("reading the receive queue"))?;
    let send_queue =
        repair_queue_bytes(fd, sys::TCP_SEND_QUEUE, outq).map_err(err("reading the send queue"))?;
    let socket_options = match (with_options, &pre.options) {
        (true, Some(o)) => {
            let mut o = o.clone();
            if o.buf_lock & super::options::RCVBUF_LOCKED == 0 {
                o.rcvbuf = r.rcvbuf.max(0) as u32;
            }
            Some(o)
        }
        _ => None,
    };
    let options = pre.handshake.options;
    let timestamp = if options & sys::TCPI_OPT_TIMESTAMPS != 0 {
        r.timestamp(clock, pre.handshake.usec_ts)
    } else {
        0
    };
    Ok(TcpConnectionState {
        inode: c.inode,
        local: pre.local,
        remote: pre.remote,
        send_seq: r.write_seq,
        recv_seq: r.rcv_nxt,
        send_queue,
        unsent: r.unsent().min(outq),
        recv_queue,
        mss_clamp: r.mss_clamp,
        options,
        send_wscale: pre.handshake.send_wscale,
        recv_wscale: pre.handshake.recv_wscale,
        timestamp,
        window: RepairWindow {
            snd_wl1: r.snd_wl1,
            snd_wnd: r.snd_wnd,
            max_window: r.max_window,
            rcv_wnd: r.rcv_wnd,
            rcv_wup: r.rcv_wup,
        },
        reuseaddr: pre.reuseaddr,
        sndbuf: r.sndbuf.max(0) as u32,
        socket_options,
    })
}

/// The `len` bytes of repair queue `queue` (selected, then peeked), or
/// none without a call when it is empty.
fn repair_queue_bytes(fd: BorrowedFd<'_>, queue: i32, len: u32) -> std::io::Result<Vec<u8>> {
    if len == 0 {
        return Ok(Vec::new());
    }
    sys::select_repair_queue(fd, queue)?;
    sys::peek_queue(fd, len)
}

/// How an incremental extraction read the connections.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReadCounts {
    /// Taken from the pre-read.
    pub preread: u32,
    /// Pre-read, but touched by a setsockopt call since: read whole.
    pub touched: u32,
    /// Not pre-read (opened since, or left out): read whole.
    pub unknown: u32,
}

impl std::ops::AddAssign for ReadCounts {
    fn add_assign(&mut self, o: Self) {
        self.preread += o.preread;
        self.touched += o.touched;
        self.unknown += o.unknown;
    }
}

/// What the pre-read holds of `c`, if it can stand for a read now.
fn usable<'p>(
    preread: &'p Preread,
    touched: &Touched,
    c: &HeldConnection,
    with_options: bool,
    counts: &mut ReadCounts,
) -> Option<&'p PrereadConnection> {
    match preread.known(c.inode, c.fd.as_fd()) {
        Some(p) if with_options && p.options.is_none() => {
            counts.unknown += 1;
            None
        }
        Some(p) if touched.may_have_changed(&p.watched()) => {
            counts.touched += 1;
            None
        }
        Some(p) => {
            counts.preread += 1;
            Some(p)
        }
        None => {
            counts.unknown += 1;
            None
        }
    }
}

/// Reads one connection; `pre`: what need not be read again.
fn extract_one(
    c: &HeldConnection,
    with_options: bool,
    pre: Option<&PrereadConnection>,
) -> Result<TcpConnectionState, SockStateError> {
    let fd = c.fd.as_fd();
    let (local, remote) = match pre {
        Some(p) => (Some(p.local), Some(p.remote)),
        None => (
            getsockname::<SockaddrStorage>(std::os::fd::AsRawFd::as_raw_fd(&fd))
                .ok()
                .and_then(addr),
            getpeername::<SockaddrStorage>(std::os::fd::AsRawFd::as_raw_fd(&fd))
                .ok()
                .and_then(addr),
        ),
    };
    let conn = match (local, remote) {
        (Some(l), Some(r)) => format!("{l} -> {r}"),
        _ => format!("inode {}", c.inode),
    };
    let err = |op: &'static str| {
        let conn = conn.clone();
        move |source| SockStateError::Sys { op, conn, source }
    };
    let (Some(local), Some(remote)) = (local, remote) else {
        return Err(SockStateError::Sys {
            op: "getsockname/getpeername",
            conn,
            source: std::io::Error::other("not an IPv4/IPv6 connection"),
        });
    };
    let reuseaddr = match pre {
        Some(p) => p.reuseaddr,
        None => {
            sys::get_int(fd, libc::SOL_SOCKET, libc::SO_REUSEADDR)
                .map_err(err("reading SO_REUSEADDR"))?
                != 0
        }
    };
    c.reuseaddr.store(reuseaddr, Ordering::SeqCst);
    // The kernel tunes a buffer whose size the process did not set.
    let sndbuf =
        sys::get_int(fd, libc::SOL_SOCKET, libc::SO_SNDBUF).map_err(err("reading SO_SNDBUF"))?;
    // Before repair goes on: TCP_REPAIR is no option of the process's.
    let socket_options = match (with_options, pre.and_then(|p| p.options.as_ref())) {
        (false, _) => None,
        (true, Some(o)) => {
            let mut o = o.clone();
            if o.buf_lock & super::options::RCVBUF_LOCKED == 0 {
                o.rcvbuf = sys::get_int(fd, libc::SOL_SOCKET, libc::SO_RCVBUF)
                    .map_err(err("reading SO_RCVBUF"))? as u32;
            }
            Some(o)
        }
        (true, None) => Some(
            super::options::read(fd, local.is_ipv6()).map_err(err("reading the socket options"))?,
        ),
    };

    sys::set_int(fd, libc::SOL_TCP, sys::TCP_REPAIR, sys::REPAIR_ON)
        .map_err(err("turning repair on"))?;
    c.repairing.store(true, Ordering::SeqCst);

    let head = sys::tcp_info_head(fd).map_err(err("TCP_INFO"))?;
    if head[0] != sys::TCP_ESTABLISHED {
        return Err(SockStateError::NotEstablished {
            conn,
            state: state_name(head[0]),
        });
    }
    let Handshake {
        options,
        send_wscale,
        recv_wscale,
        ..
    } = Handshake::from_tcp_info(&head);
    let outq = sys::outq(fd).map_err(err("SIOCOUTQ"))?;
    let unsent = sys::outq_unsent(fd).map_err(err("SIOCOUTQNSD"))?;
    let inq = sys::inq(fd).map_err(err("SIOCINQ"))?;
    let mss_clamp =
        sys::get_int(fd, libc::SOL_TCP, libc::TCP_MAXSEG).map_err(err("TCP_MAXSEG"))? as u32;
    let timestamp = if options & sys::TCPI_OPT_TIMESTAMPS != 0 {
        sys::get_int(fd, libc::SOL_TCP, sys::TCP_TIMESTAMP).map_err(err("TCP_TIMESTAMP"))? as u32
    } else {
        0
    };
    let mut window = RepairWindow::default();
    sys::get_into(fd, libc::SOL_TCP, sys::TCP_REPAIR_WINDOW, &mut window)
        .map_err(err("TCP_REPAIR_WINDOW"))?;

    sys::select_repair_queue(fd, sys::TCP_RECV_QUEUE)
        .map_err(err("selecting the receive queue"))?;
    let recv_seq =
        sys::get_int(fd, libc::SOL_TCP, sys::TCP_QUEUE_SEQ).map_err(err("TCP_QUEUE_SEQ"))? as u32;
    let recv_queue = sys::peek_queue(fd, inq).map_err(err("reading the receive queue"))?;
    sys::select_repair_queue(fd, sys::TCP_SEND_QUEUE).map_err(err("selecting the send queue"))?;
    let send_seq =
        sys::get_int(fd, libc::SOL_TCP, sys::TCP_QUEUE_SEQ).map_err(err("TCP_QUEUE_SEQ"))? as u32;
    let send_queue = sys::peek_queue(fd, outq).map_err(err("reading the send queue"))?;
    // The send queue stays selected: a selection counts only in repair
    // mode, and the next reader (a later migration) selects its own.

    Ok(TcpConnectionState {
        inode: c.inode,
        local,
        remote,
        send_seq,
        recv_seq,
        send_queue,
        unsent: unsent.min(outq),
        recv_queue,
        mss_clamp,
        options,
        send_wscale,
        recv_wscale,
        timestamp,
        window,
        reuseaddr,
        sndbuf: sndbuf.max(0) as u32,
        socket_options,
    })
}
