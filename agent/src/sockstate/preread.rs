//! Incremental collective migration: what of a connection can be read
//! before the freeze, read while the process runs (seed 000 §III-C: socket
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
//! buffer sizes the kernel tunes) is read in the freeze as before.
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
use super::extract::{SocketKind, addr, for_each_socket, kind_of};
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
    /// Read when ferryd carries the options.
    pub options: Option<TcpSocketOptions>,
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
}

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
        Ok(Self::of_descriptors(conns, with_options))
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
        Self { by_inode }
    }

    pub fn len(&self) -> usize {
        self.by_inode.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_inode.is_empty()
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
        options: if with_options {
            Some(super::options::read(fd, local.is_ipv6())?)
        } else {
            None
        },
    })
}
