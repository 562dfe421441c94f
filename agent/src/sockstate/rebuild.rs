//! Destination side: every connection rebuilt in repair mode, in one
//! batch, before CRIU restores the process around them.

use std::net::SocketAddr;
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};

use nix::sys::socket::{SockaddrIn, SockaddrIn6, connect};

use super::spread;
use super::stage::{Staged, StagedSocket, open_bound};
use super::sys::{self, RepairOpt};
use super::{SockStateError, TcpConnectionState};

struct RebuiltConnection {
    inode: u64,
    name: String,
    fd: OwnedFd,
    /// Bytes the source never sent: queued, and so sent, once repair is off.
    unsent: Vec<u8>,
    reuseaddr: bool,
    /// Carried by ferryd instead of CRIU: set by [`Rebuilt::apply_options`].
    options: Option<ferry_proto::v1::TcpSocketOptions>,
    ipv6: bool,
    /// In repair mode still: until [`Rebuilt::leave_repair_early`] or
    /// [`Rebuilt::resume`] turns it off.
    repairing: AtomicBool,
}

fn table_err(op: &'static str) -> impl Fn(std::io::Error) -> SockStateError {
    move |source| SockStateError::Sys {
        op,
        conn: "the connection table".into(),
        source,
    }
}

/// A new, empty file for [`Rebuilt::write_connection_table`] (a memfd).
pub fn empty_connection_table() -> Result<OwnedFd, SockStateError> {
    // SAFETY: memfd_create reads a NUL-terminated name and returns a new
    // descriptor (or -1); nothing else is touched.
    let raw = unsafe { libc::memfd_create(c"ferry-tcp-table".as_ptr(), libc::MFD_CLOEXEC) };
    if raw < 0 {
        return Err(table_err("memfd_create")(std::io::Error::last_os_error()));
    }
    // SAFETY: `raw` was just returned by memfd_create and is owned by
    // nothing else.
    Ok(unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(raw) })
}

/// The inherit-fd key of [`Rebuilt::connection_table`].
pub const CONNECTION_TABLE_KEY: &str = "ferry-tcp-table";
/// The connection table's magic number: "FTT1" read as a native-endian
/// 32-bit word on little-endian machines.
const CONNECTION_TABLE_MAGIC: u32 = 0x3154_5446;

/// How the rebuilt connections reach CRIU's restore, by what this node's
/// CRIU build can take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Handover {
    /// One inherited descriptor each, `socket:[<ino>]`, through CRIU's
    /// fdstore.
    Fdstore,
    /// One inherited descriptor each, `ferry-tcp:[<ino>]`, kept in CRIU's
    /// process and taken from it by pidfd.
    ByPidfd,
    /// One table ([`Rebuilt::connection_table`]); the connections stay in
    /// ferryd and are taken from it by pidfd.
    Table,
}

/// Connections rebuilt in this node's network namespace, in repair mode
/// (nothing is sent on their behalf) until [`Rebuilt::leave_repair_early`]
/// or [`Rebuilt::resume`]. Dropping it closes ferryd's descriptors. Before
/// [`Rebuilt::resume`] (an abort) that closes nothing the restored process
/// holds, and a socket only ferryd holds closes silently: the drop turns
/// repair on again where it was off, since closing a connection out of
/// repair mode sends the peer a FIN or a RST.
pub struct Rebuilt {
    conns: Vec<RebuiltConnection>,
    /// [`Rebuilt::resume`] ran: the sockets are the process's.
    resumed: bool,
    /// Of `conns`, those finished on a socket opened ahead
    /// ([`super::stage`]).
    staged: usize,
}

impl Drop for Rebuilt {
    fn drop(&mut self) {
        if self.resumed {
            return;
        }
        for c in &self.conns {
            if c.repairing.load(Ordering::SeqCst) {
                continue;
            }
            if let Err(e) =
                sys::set_int(c.fd.as_fd(), libc::SOL_TCP, sys::TCP_REPAIR, sys::REPAIR_ON)
            {
                tracing::error!(conn = %c.name, error = %e, "turning repair on again to close silently");
            }
        }
    }
}

impl std::fmt::Debug for Rebuilt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rebuilt")
            .field("connections", &self.conns.len())
            .finish()
    }
}

fn connect_to(fd: &OwnedFd, a: SocketAddr) -> nix::Result<()> {
    match a {
        SocketAddr::V4(v4) => connect(fd.as_raw_fd(), &SockaddrIn::from(v4)),
        SocketAddr::V6(v6) => connect(fd.as_raw_fd(), &SockaddrIn6::from(v6)),
    }
}

/// Rebuilds every connection of `states` in the caller's network
/// namespace, each on the socket `staged` holds for it if any (opened
/// before the freeze, [`super::stage`]). All or nothing: on an error, the
/// ones already built are closed (silently, in repair mode). The staged
/// sockets no connection took are closed.
pub fn rebuild(
    states: &[TcpConnectionState],
    staged: Option<Staged>,
) -> Result<Rebuilt, SockStateError> {
    let mut staged = staged.unwrap_or_default();
    let mut work: Vec<(&TcpConnectionState, Option<StagedSocket>)> = states
        .iter()
        .map(|c| (c, staged.take(c.inode, c.local, c.remote)))
        .collect();
    let taken = work.iter().filter(|(_, fd)| fd.is_some()).count();
    // Spread over the cores (ferryd's threads are in its node's network
    // namespace, where the connections belong), in owned parts: the staged
    // descriptors move into the threads.
    let chunk = spread::chunk_len(work.len());
    let mut parts = Vec::new();
    while !work.is_empty() {
        let rest = work.split_off(chunk.min(work.len()));
        parts.push(std::mem::replace(&mut work, rest));
    }
    let parts = spread::on_threads(parts, "rebuild", |part| {
        part.into_iter()
            .map(|(c, fd)| rebuild_one(c, fd))
            .collect::<Result<Vec<_>, _>>()
    });
    let mut conns = Vec::with_capacity(states.len());
    for part in parts {
        conns.extend(part?);
    }
    Ok(Rebuilt {
        conns,
        resumed: false,
        staged: taken,
    })
}

/// Rebuilds one connection, on `staged` (its socket opened ahead,
/// [`super::stage()`]) or on a new socket.
fn rebuild_one(
    c: &TcpConnectionState,
    staged: Option<StagedSocket>,
) -> Result<RebuiltConnection, SockStateError> {
    let name = c.name();
    let err = |op: &'static str| {
        let conn = name.clone();
        move |source: std::io::Error| SockStateError::Sys { op, conn, source }
    };
    let nix_err = |op: &'static str| {
        let conn = name.clone();
        move |e: nix::Error| SockStateError::Sys {
            op,
            conn,
            source: std::io::Error::from(e),
        }
    };
    // A socket opened ahead has its receive queue selected, and its send
    // buffer sized as the pre-read found it.
    let (fd, recv_selected, sndbuf_set) = match staged {
        Some(s) => (s.fd, true, s.sndbuf),
        None => (open_bound(c.local, &name)?, false, 0),
    };
    let sock = fd.as_fd();
    // The source's send buffer size; CRIU's restore sets the same value
    // afterwards (it restores every socket's buffer sizes). What the source
    // held need not fit in it: the queues go in through `sys::queue_all`.
    if c.sndbuf > 0 && c.sndbuf != sndbuf_set {
        sys::force_sndbuf(sock, c.sndbuf).map_err(err("SO_SNDBUFFORCE"))?;
    }

    // The sequence numbers before the queued bytes: writing the queues
    // below advances them to where they were on the source.
    let recv_start = c.recv_seq.wrapping_sub(c.recv_queue.len() as u32);
    let send_start = c.send_seq.wrapping_sub(c.send_queue.len() as u32);
    if !recv_selected {
        sys::select_repair_queue(sock, sys::TCP_RECV_QUEUE)
            .map_err(err("selecting the receive queue"))?;
    }
    sys::set_int(sock, libc::SOL_TCP, sys::TCP_QUEUE_SEQ, recv_start as i32)
        .map_err(err("setting the receive sequence"))?;
    sys::select_repair_queue(sock, sys::TCP_SEND_QUEUE).map_err(err("selecting the send queue"))?;
    sys::set_int(sock, libc::SOL_TCP, sys::TCP_QUEUE_SEQ, send_start as i32)
        .map_err(err("setting the send sequence"))?;

    // In repair mode connect() sends no SYN: the socket is ESTABLISHED.
    connect_to(&fd, c.remote).map_err(nix_err("connect"))?;

    let mut opts = Vec::with_capacity(4);
    if c.options & sys::TCPI_OPT_SACK != 0 {
        opts.push(RepairOpt {
            code: sys::TCPOPT_SACK_PERM,
            value: 0,
        });
    }
    if c.options & sys::TCPI_OPT_WSCALE != 0 {
        opts.push(RepairOpt {
            code: sys::TCPOPT_WINDOW,
            value: u32::from(c.send_wscale) | (u32::from(c.recv_wscale) << 16),
        });
    }
    if c.options & sys::TCPI_OPT_TIMESTAMPS != 0 {
        opts.push(RepairOpt {
            code: sys::TCPOPT_TIMESTAMP,
            value: 0,
        });
    }
    opts.push(RepairOpt {
        code: sys::TCPOPT_MAXSEG,
        value: c.mss_clamp,
    });
    sys::set_slice(sock, libc::SOL_TCP, sys::TCP_REPAIR_OPTIONS, &opts)
        .map_err(err("TCP_REPAIR_OPTIONS"))?;
    if c.options & sys::TCPI_OPT_TIMESTAMPS != 0 {
        sys::set_int(sock, libc::SOL_TCP, sys::TCP_TIMESTAMP, c.timestamp as i32)
            .map_err(err("TCP_TIMESTAMP"))?;
    }

    if !c.recv_queue.is_empty() {
        sys::select_repair_queue(sock, sys::TCP_RECV_QUEUE)
            .map_err(err("selecting the receive queue"))?;
        sys::send_all(sock, &c.recv_queue, 0).map_err(err("refilling the receive queue"))?;
    }
    let sent = c.send_queue.len() - c.unsent as usize;
    if sent > 0 {
        sys::select_repair_queue(sock, sys::TCP_SEND_QUEUE)
            .map_err(err("selecting the send queue"))?;
        let grown = sys::queue_all(sock, &c.send_queue[..sent], 0)
            .map_err(err("refilling the send queue"))?;
        if let Some(size) = grown {
            tracing::debug!(conn = %name, sent, sndbuf = c.sndbuf, grown_to = size, "send buffer grown for the bytes in flight");
        }
    }
    // A queue stays selected: the selection counts only in repair mode.
    sys::set_struct(sock, libc::SOL_TCP, sys::TCP_REPAIR_WINDOW, &c.window)
        .map_err(err("TCP_REPAIR_WINDOW"))?;

    Ok(RebuiltConnection {
        inode: c.inode,
        name,
        fd,
        unsent: c.send_queue[sent..].to_vec(),
        reuseaddr: c.reuseaddr,
        options: c.socket_options.clone(),
        ipv6: c.local.is_ipv6(),
        repairing: AtomicBool::new(true),
    })
}

impl Rebuilt {
    pub fn len(&self) -> usize {
        self.conns.len()
    }

    /// How many were finished on a socket opened ahead of the freeze.
    pub fn staged(&self) -> usize {
        self.staged
    }

    pub fn is_empty(&self) -> bool {
        self.conns.is_empty()
    }

    /// Whether the connections came with their socket options (ferryd
    /// carries them instead of CRIU).
    pub fn has_options(&self) -> bool {
        self.conns.iter().any(|c| c.options.is_some())
    }

    /// Sets the options that came with the connections. Any time before
    /// the process runs: CRIU's restore leaves them alone (ferry's
    /// tcp-options-by-caller patch), so this runs beside it, on a core the
    /// single-threaded restore leaves idle, instead of before it. The send
    /// buffer was sized when the connection was rebuilt.
    pub fn apply_options(&self) -> Result<(), SockStateError> {
        if !self.has_options() {
            return Ok(());
        }
        // Read here, in this node's namespace, where the connections live.
        let defaults = super::options::NewSocketDefaults::here().unwrap_or_else(|e| {
            tracing::warn!(error = %e, "reading a new socket's options: every keepalive timing and TTL is set");
            super::options::NewSocketDefaults::default()
        });
        for c in &self.conns {
            if let Some(o) = &c.options {
                super::options::apply(c.fd.as_fd(), o, c.ipv6, &defaults).map_err(
                    |(op, source)| SockStateError::Sys {
                        op,
                        conn: c.name.clone(),
                        source,
                    },
                )?;
            }
        }
        Ok(())
    }

    /// ferryd's descriptors of the rebuilt sockets, in the order given,
    /// for a process to take over (a handed-off connection): only after
    /// [`Rebuilt::resume`], since from then on closing them is the
    /// holder's business.
    pub fn into_descriptors(mut self) -> Result<Vec<OwnedFd>, SockStateError> {
        if !self.resumed {
            return Err(SockStateError::NotResumed);
        }
        Ok(std::mem::take(&mut self.conns)
            .into_iter()
            .map(|c| c.fd)
            .collect())
    }

    /// ferryd's descriptors of the rebuilt sockets, in the order given.
    pub fn descriptors(&self) -> impl Iterator<Item = std::os::fd::BorrowedFd<'_>> {
        self.conns.iter().map(|c| c.fd.as_fd())
    }

    /// (key, descriptor) for CRIU's `inherit_fd`, by the socket's inode on
    /// the source. `by_pidfd` (a CRIU with ferry's tcp-by-caller patch):
    /// `ferry-tcp:[<inode>]`, which that CRIU keeps to itself and hands to
    /// the restored task by pidfd, in constant time per connection;
    /// otherwise the name the source's /proc showed, `socket:[<inode>]`,
    /// which goes through CRIU's fdstore (each lookup walks it from the
    /// start: quadratic in the number of connections).
    pub fn inherit_fds(&self, by_pidfd: bool) -> Vec<(String, RawFd)> {
        let prefix = if by_pidfd { "ferry-tcp" } else { "socket" };
        self.conns
            .iter()
            .map(|c| (format!("{prefix}:[{}]", c.inode), c.fd.as_raw_fd()))
            .collect()
    }

    /// The connections as one table for CRIU's restore (a CRIU with
    /// ferry's connections-table patch), inherited as
    /// [`CONNECTION_TABLE_KEY`]: a memfd holding a head (magic "FTT1",
    /// this process's PID, the count, a reserved word) and, per
    /// connection, its inode on the source and ferryd's descriptor number
    /// for it, all native-endian 32-bit. The restored task takes each
    /// connection from this process by `pidfd_getfd()`: ferryd must keep
    /// them open until the restore ends, which [`Rebuilt`] does.
    pub fn connection_table(&self) -> Result<OwnedFd, SockStateError> {
        let fd = empty_connection_table()?;
        self.write_connection_table(fd.as_fd())?;
        Ok(fd)
    }

    /// Writes [`Rebuilt::connection_table`]'s content into `table`, an
    /// [`empty_connection_table`] made earlier (one a CRIU started ahead
    /// of the restore already inherited: it reads the table only once
    /// asked to restore).
    pub fn write_connection_table(
        &self,
        table: std::os::fd::BorrowedFd<'_>,
    ) -> Result<(), SockStateError> {
        use std::os::unix::fs::FileExt;
        let mut bytes = Vec::with_capacity(16 + 8 * self.conns.len());
        bytes.extend_from_slice(&CONNECTION_TABLE_MAGIC.to_ne_bytes());
        bytes.extend_from_slice(&(std::process::id() as i32).to_ne_bytes());
        bytes.extend_from_slice(&(self.conns.len() as u32).to_ne_bytes());
        bytes.extend_from_slice(&0u32.to_ne_bytes());
        for c in &self.conns {
            let inode = u32::try_from(c.inode).map_err(|_| SockStateError::Sys {
                op: "the connection table",
                conn: c.name.clone(),
                source: std::io::Error::other(format!(
                    "inode {} does not fit CRIU's 32-bit inode field",
                    c.inode
                )),
            })?;
            bytes.extend_from_slice(&inode.to_ne_bytes());
            bytes.extend_from_slice(&c.fd.as_raw_fd().to_ne_bytes());
        }
        let file = std::fs::File::from(table.try_clone_to_owned().map_err(table_err("dup"))?);
        file.write_all_at(&bytes, 0)
            .map_err(table_err("writing the connection table"))
    }

    /// Takes out of repair mode, before the commit, every connection
    /// without bytes the source never sent, and gives back its
    /// SO_REUSEADDR. Called once CRIU's restore is done, while the source
    /// translates and commits, so that the commit (inside the freeze) has
    /// only the others left: at 1024 connections that took 4.5-7 ms of it.
    /// Not during the restore: repair mode forces the reuse of the
    /// connections' port, and the restore binds a listening socket on it
    /// (turning repair off and giving SO_REUSEADDR back leaves a moment
    /// without: such a bind failed with EADDRINUSE in 3 of 16 migrations
    /// at 1024 connections when this ran beside the restore).
    ///
    /// Safe before the commit: turning repair off without the window probe
    /// sends nothing; the destination's ports pass no packet out or in
    /// until the commit (the captured ones are replayed then), and the
    /// process is stopped. What a retransmission timer of a connection with
    /// bytes in flight might send in these milliseconds, it sent in repair
    /// mode too. Connections with unsent bytes wait for the commit: those
    /// bytes go out as they are queued, and must not be dropped at the
    /// closed port. A connection whose call fails stays in repair mode for
    /// [`Rebuilt::resume`] to retry; the count taken out is returned.
    pub fn leave_repair_early(&self) -> usize {
        let mut left = 0;
        for c in self.conns.iter().filter(|c| c.unsent.is_empty()) {
            match leave_repair(c) {
                Ok(()) => left += 1,
                Err(e) => {
                    tracing::warn!(error = %e, "leaving repair mode before the commit: left to the commit")
                }
            }
        }
        left
    }

    /// Takes out of repair mode (without the kernel's window probe) the
    /// connections still in it, gives back their SO_REUSEADDR, and queues
    /// the bytes the source never sent: from here on the sockets are the
    /// process's, and dropping this only closes ferryd's descriptors (after
    /// the process resumed: a thousand closes are a millisecond). Every
    /// connection is tried; the first error is returned. Spread over the
    /// cores like the rebuild when many are left: it runs inside the
    /// freeze, before the process resumes (~3 calls per connection; at 1024
    /// connections, 12 commits each, medians 5.6 ms on one thread, 4.5 on
    /// two, when none had left repair mode early).
    pub fn resume(&mut self) -> Result<(), SockStateError> {
        self.resumed = true;
        let busy: Vec<&RebuiltConnection> = self
            .conns
            .iter()
            .filter(|c| c.repairing.load(Ordering::SeqCst) || !c.unsent.is_empty())
            .collect();
        let parts = spread::on_threads(
            busy.chunks(spread::chunk_len(busy.len())),
            "resume",
            |part| {
                let mut first = None;
                for c in part {
                    if let Err(e) = resume_one(c)
                        && first.is_none()
                    {
                        first = Some(e);
                    }
                }
                first.map_or(Ok(()), Err)
            },
        );
        parts.into_iter().find(Result::is_err).unwrap_or(Ok(()))
    }
}

/// Repair off without the window probe (with a thousand connections a
/// probe each is a thousand packets out and a thousand answers captured
/// and replayed, inside the freeze, to tell each peer what it knows
/// already), and the process's SO_REUSEADDR back (repair mode forced it).
fn leave_repair(c: &RebuiltConnection) -> Result<(), SockStateError> {
    let sock = c.fd.as_fd();
    let err = |op: &'static str| {
        let conn = c.name.clone();
        move |source: std::io::Error| SockStateError::Sys { op, conn, source }
    };
    sys::set_int(sock, libc::SOL_TCP, sys::TCP_REPAIR, sys::REPAIR_OFF_NO_WP)
        .map_err(err("turning repair off"))?;
    c.repairing.store(false, Ordering::SeqCst);
    acknowledge_lazily(c);
    // Turning repair off left SO_REUSEADDR off (the kernel's SK_NO_REUSE
    // replaces repair mode's forced reuse): only a connection that had it
    // takes a call.
    if !c.reuseaddr {
        return Ok(());
    }
    sys::set_int(sock, libc::SOL_SOCKET, libc::SO_REUSEADDR, 1)
        .map_err(err("restoring SO_REUSEADDR"))
}

/// Puts `c` in the kernel's delayed-ACK mode ("ping-pong", entered with
/// `TCP_QUICKACK` 0): a segment is acknowledged with the process's answer,
/// or after the delayed-ACK timeout (40 ms at first), instead of at once.
///
/// Why: a rebuilt socket has no ACK history, so the kernel starts it in
/// quick-ACK mode and acknowledges each of its first segments on its own,
/// which the replay pays for: one pure ACK out through the public network
/// and the peer's stack per replayed segment, while the process's answer
/// follows within a millisecond. The source's socket of a
/// request-and-answer connection was in ping-pong mode anyway (the kernel
/// enters it when answers follow what arrives), as CRIU's restore never
/// carries it either. Measured (release, this 2-core VM, 5 migrations
/// each, one run after the other): the replay after the resume took 8.0
/// ms instead of 13.0 at 1024 connections, 53 instead of 104 at 4096.
/// Nothing waits on it beyond that timeout: the kernel leaves ping-pong
/// mode the first time a delayed ACK goes out unanswered, a bulk sender's
/// segments are acknowledged every second full one whatever the mode, and
/// no peer retransmits before 200 ms. A failure costs only that speed.
fn acknowledge_lazily(c: &RebuiltConnection) {
    if let Err(e) = sys::set_int(c.fd.as_fd(), libc::SOL_TCP, libc::TCP_QUICKACK, 0) {
        tracing::debug!(conn = %c.name, error = %e, "left in quick-ACK mode");
    }
}

fn resume_one(c: &RebuiltConnection) -> Result<(), SockStateError> {
    if c.repairing.load(Ordering::SeqCst) {
        leave_repair(c)?;
    }
    if !c.unsent.is_empty() {
        let sock = c.fd.as_fd();
        // Not the process's own send(): its buffer (CRIU restored the
        // source's SO_SNDBUF) may be a little too small for what the source
        // held, and every byte must go in, now, before the replay and the
        // process's next writes (`sys::queue_all`).
        let grown = sys::queue_all(sock, &c.unsent, 0).map_err(|source| SockStateError::Sys {
            op: "queueing the unsent bytes",
            conn: c.name.clone(),
            source,
        })?;
        if let Some(size) = grown {
            tracing::debug!(conn = %c.name, unsent = c.unsent.len(), grown_to = size, "send buffer grown for the unsent bytes");
        }
    }
    Ok(())
}
