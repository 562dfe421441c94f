//! Incremental collective migration: what of a connection can be read
//! before the freeze, read while the process runs (Gerofi et al. (DVE) §III-C: socket
//! state tracked during pre-copy, so the freeze carries only what changed).
//!
//! Of the ~45 system calls a connection costs in the freeze
//! ([`Held::extract`](super::Held::extract)), ~30 read what does not move
//! while a connection lives, or moves only when the process says so: its
//! addresses, SO_REUSEADDR and the ~30 socket options ferryd carries. The
//! source reads them here, before the freeze, with a setsockopt watch
//! attached first (`ferry_ebpf::SockoptWatch`); inside the freeze it reads
//! them again only for connections the watch saw a setsockopt call on, and
//! for connections it did not know then. What keeps moving (queues,
//! sequence numbers, windows, timestamps, the connection's state, and
//! buffer sizes the kernel tunes) is read in the freeze: for the
//! connections known here, in one pass of the TCP state iterator
//! (`ferry_ebpf::TcpStateReader`, asked for them here, before the freeze),
//! with repair mode on and TCP_TIMESTAMP the only calls left per
//! connection; for the others by their calls. What the handshake settled
//! (timestamps, SACK, window scales) is read here too: it never changes.
//!
//! A connection is known by its inode, checked against its socket cookie
//! (unique for the boot: an inode number is only unique among live
//! inodes). ferryd keeps no descriptor of the connections between the
//! pre-read and the freeze: a close by the process must still close them.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};

use ferry_ebpf::WatchedConnection;
use ferry_proto::v1::TcpSocketOptions;
use nix::sys::socket::{SockaddrStorage, getpeername, getsockname};

use super::SockStateError;
use super::descriptors::{SocketKind, addr, for_each_socket, kind_of};
use super::sys;

const SO_COOKIE: libc::c_int = 57;
const SO_NETNS_COOKIE: libc::c_int = 71;

/// What the freeze need not read again of one connection, unless it was
/// touched since.
#[derive(Debug, Clone)]
pub struct PrereadConnection {
    /// The socket's cookie: the inode is its key, the cookie proves it is
    /// the same socket.
    pub cookie: u64,
    /// Its network namespace's cookie: the watch tells namespaces apart.
    pub netns: u64,
    pub local: SocketAddr,
    pub remote: SocketAddr,
    pub reuseaddr: bool,
    /// SO_SNDBUF then: the destination sizes the socket it opens ahead to
    /// it (it may have changed by the freeze, which reads it again).
    pub sndbuf: u32,
    /// Read when ferryd carries the options.
    pub options: Option<TcpSocketOptions>,
    /// What the handshake settled, which never changes after it.
    pub handshake: Handshake,
}

/// A connection's options agreed at the handshake, from TCP_INFO: which of
/// timestamps, SACK and window scaling (`tcpi_options`, masked to those),
/// both window scales, and whether its timestamps count microseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Handshake {
    pub options: u8,
    pub send_wscale: u8,
    pub recv_wscale: u8,
    /// TCPI_OPT_USEC_TS (Linux 6.7+): TCP_TIMESTAMP counts microseconds.
    pub usec_ts: bool,
}

impl Handshake {
    /// From the first bytes of `struct tcp_info`.
    pub(super) fn from_tcp_info(head: &[u8; 8]) -> Self {
        let options =
            head[5] & (sys::TCPI_OPT_TIMESTAMPS | sys::TCPI_OPT_SACK | sys::TCPI_OPT_WSCALE);
        let (send_wscale, recv_wscale) = if options & sys::TCPI_OPT_WSCALE != 0 {
            (head[6] & 0x0f, head[6] >> 4)
        } else {
            (0, 0)
        };
        Self {
            options,
            send_wscale,
            recv_wscale,
            usec_ts: head[5] & sys::TCPI_OPT_USEC_TS != 0,
        }
    }
}

impl PrereadConnection {
    /// The connection as the setsockopt watch records it.
    pub fn watched(&self) -> WatchedConnection {
        WatchedConnection::new(self.netns, self.local, self.remote)
    }
}

/// The connections of a process tree, read before its freeze.
#[derive(Debug, Default)]
pub struct Preread {
    by_inode: HashMap<u64, PrereadConnection>,
    /// The TCP state iterator, asked for these connections
    /// ([`Preread::with_state_reader`]).
    state_reader: Option<std::sync::Mutex<ferry_ebpf::TcpStateReader>>,
    /// The processes read ([`Preread::of_tree`]), root first: the
    /// iterator's per-process pass reads their descriptors.
    tree: Vec<i32>,
}

/// The TCP state reader goes back for the next migration: loading one
/// costs tens of milliseconds of CPU right before a freeze.
impl Drop for Preread {
    fn drop(&mut self) {
        if let Some(reader) = self.state_reader.take() {
            reader
                .into_inner()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .give_back();
        }
    }
}

/// The fewest connections read by the iterator's per-process pass. The
/// pass itself took 0.1 ms for 17 connections here, but the whole read
/// did not get faster than by the calls (medians 1.55 and 1.3 ms, 12
/// migrations each, within the noise); at 1025 it took 1.7-4.4 ms against
/// 4.0-17.3 for the namespace's pass. 64 is chosen, not measured: there
/// each connection costs ~11 µs by its calls against 1-6 µs by repair on
/// and TCP_TIMESTAMP (measured at 1025, when the pass still needed them;
/// it now needs no call for a connection with empty queues) plus its
/// share of a ~0.1 ms pass, a clear lead for the pass; below, the calls.
pub const PER_PROCESS_PASS_FROM: usize = 64;

impl Preread {
    /// Reads every established connection of the running tree `tree`. A
    /// connection that closes meanwhile is left out (the freeze reads
    /// whatever it finds whole). Blocking; run it with the setsockopt
    /// watch already attached.
    pub fn of_tree(tree: &[i32], with_options: bool) -> Result<Self, SockStateError> {
        let mut conns = Vec::new();
        for_each_socket(tree, |inode, fd| {
            if kind_of(fd.as_fd()) == SocketKind::TcpConnected {
                conns.push((inode, fd));
            }
            Ok(())
        })?;
        let mut read = Self::of_descriptors(conns, with_options);
        read.tree = tree.to_vec();
        Ok(read)
    }

    /// Reads these connections (ferryd's descriptors of them, closed
    /// here).
    pub fn of_descriptors(conns: Vec<(u64, OwnedFd)>, with_options: bool) -> Self {
        let mut by_inode = HashMap::with_capacity(conns.len());
        for (inode, fd) in conns {
            match read_one(fd.as_fd(), with_options) {
                Ok(c) => {
                    by_inode.insert(inode, c);
                }
                Err(e) => {
                    tracing::debug!(inode, error = %e, "left out of the pre-read (read in the freeze)")
                }
            }
        }
        Self {
            by_inode,
            state_reader: None,
            tree: Vec::new(),
        }
    }

    /// Whether one pass of the TCP state iterator reads these connections
    /// faster than their calls: the pass walks the namespace's whole TCP
    /// hash table (its empty buckets too), the calls cost per connection.
    /// Measured here (262,144 buckets, two cores): the pass 4-5 ms with 17
    /// connections and 4-8 ms with 1025; the calls ~11 µs per connection,
    /// so even at ~370 connections. Taken from one connection per 512
    /// buckets, clear of that.
    pub fn one_pass_pays(&self) -> bool {
        // Since Linux 6.1; negative when the namespace shares the initial
        // one's table. Older kernels do not say: this machine's size is
        // assumed.
        let buckets = std::fs::read_to_string("/proc/sys/net/ipv4/tcp_ehash_entries")
            .ok()
            .and_then(|s| s.trim().parse::<i64>().ok())
            .map_or(262_144, i64::unsigned_abs);
        self.by_inode.len() as u64 >= (buckets / 512).max(64)
    }

    /// Loads the TCP state iterator and asks it for these connections, so
    /// that the freeze reads them in one pass (blocking: the verifier runs
    /// and each connection costs a map update, before the freeze), if a
    /// pass pays: the per-process one (over the tree's descriptors) from
    /// [`PER_PROCESS_PASS_FROM`] connections, else the namespace's from
    /// [`Preread::one_pass_pays`]. The calling thread's network namespace
    /// must be theirs, as it is for the freeze's read. Ok(false): no pass
    /// pays, each connection is read by its calls.
    pub fn with_state_reader(&mut self) -> Result<bool, ferry_ebpf::DataPlaneError> {
        if self.by_inode.len() < PER_PROCESS_PASS_FROM {
            return Ok(false);
        }
        let reader = ferry_ebpf::TcpStateReader::take()?;
        if !(self.read_by_process(&reader) || self.one_pass_pays()) {
            reader.give_back();
            return Ok(false);
        }
        self.keep_state_reader(reader)?;
        Ok(true)
    }

    /// Asks `reader` for these connections and keeps it for the freeze's
    /// read, whatever their number.
    pub(super) fn keep_state_reader(
        &mut self,
        mut reader: ferry_ebpf::TcpStateReader,
    ) -> Result<(), ferry_ebpf::DataPlaneError> {
        reader.want(self.by_inode.values().map(|c| c.cookie))?;
        self.state_reader = Some(std::sync::Mutex::new(reader));
        Ok(())
    }

    /// These connections as held by the processes `tree` (a test's own).
    #[cfg(test)]
    pub(super) fn held_by(mut self, tree: Vec<i32>) -> Self {
        self.tree = tree;
        self
    }

    /// The processes read, root first (none for [`Preread::of_descriptors`]).
    pub(super) fn tree(&self) -> &[i32] {
        &self.tree
    }

    /// Whether `reader` reads these connections by process (over the
    /// tree's descriptors) rather than over the namespace's table.
    pub(super) fn read_by_process(&self, reader: &ferry_ebpf::TcpStateReader) -> bool {
        reader.reads_by_process() && !self.tree.is_empty()
    }

    pub(super) fn state_reader(&self) -> Option<&std::sync::Mutex<ferry_ebpf::TcpStateReader>> {
        self.state_reader.as_ref()
    }

    pub fn len(&self) -> usize {
        self.by_inode.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_inode.is_empty()
    }

    /// Every connection read, by inode: what the destination opens ahead
    /// of the freeze ([`super::stage`]).
    pub fn connections(&self) -> impl Iterator<Item = (u64, &PrereadConnection)> {
        self.by_inode.iter().map(|(inode, c)| (*inode, c))
    }

    /// Every connection's fixed part, by inode, as Arm carries it
    /// (protocol 9).
    pub fn fixed_parts(&self) -> impl Iterator<Item = (u64, super::packed::Fixed)> {
        self.by_inode.iter().map(|(inode, c)| {
            (
                *inode,
                super::packed::Fixed {
                    local: c.local,
                    remote: c.remote,
                    options: c.handshake.options,
                    send_wscale: c.handshake.send_wscale,
                    recv_wscale: c.handshake.recv_wscale,
                    reuseaddr: c.reuseaddr,
                    socket_options: c.options.clone(),
                },
            )
        })
    }

    /// The network namespace (cookie) of every connection read, when they
    /// share one.
    pub fn only_netns(&self) -> Option<u64> {
        let mut all = self.by_inode.values().map(|c| c.netns);
        let first = all.next()?;
        all.all(|n| n == first).then_some(first)
    }

    /// The connection with inode `inode`, if `fd` is the very socket read
    /// then (one getsockopt).
    pub(super) fn known(&self, inode: u64, fd: BorrowedFd<'_>) -> Option<&PrereadConnection> {
        let c = self.by_inode.get(&inode)?;
        (cookie(fd, SO_COOKIE).ok()? == c.cookie).then_some(c)
    }

    pub(super) fn get(&self, inode: u64) -> Option<&PrereadConnection> {
        self.by_inode.get(&inode)
    }
}

fn cookie(fd: BorrowedFd<'_>, opt: libc::c_int) -> std::io::Result<u64> {
    let mut v = 0u64;
    sys::get_into(fd, libc::SOL_SOCKET, opt, &mut v)?;
    Ok(v)
}

fn read_one(fd: BorrowedFd<'_>, with_options: bool) -> Result<PrereadConnection, std::io::Error> {
    let raw = fd.as_raw_fd();
    let not_inet = || std::io::Error::other("not an IPv4/IPv6 connection");
    let local = getsockname::<SockaddrStorage>(raw)
        .map_err(std::io::Error::from)
        .and_then(|s| addr(s).ok_or_else(not_inet))?;
    let remote = getpeername::<SockaddrStorage>(raw)
        .map_err(std::io::Error::from)
        .and_then(|s| addr(s).ok_or_else(not_inet))?;
    Ok(PrereadConnection {
        cookie: cookie(fd, SO_COOKIE)?,
        netns: cookie(fd, SO_NETNS_COOKIE)?,
        local,
        remote,
        reuseaddr: sys::get_int(fd, libc::SOL_SOCKET, libc::SO_REUSEADDR)? != 0,
        sndbuf: sys::get_int(fd, libc::SOL_SOCKET, libc::SO_SNDBUF)?.max(0) as u32,
        options: if with_options {
            Some(super::options::read(fd, local.is_ipv6())?)
        } else {
            None
        },
        handshake: Handshake::from_tcp_info(&sys::tcp_info_head(fd)?),
    })
}
