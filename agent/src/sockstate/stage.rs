//! Destination side, before the freeze: the sockets of the connections an
//! incremental migration will move, opened ahead of their state.
//!
//! Rebuilding a connection starts with `socket()`, repair mode and a bind,
//! none of which needs the connection's state, only its addresses; the
//! rest (sequence numbers, connect, options, queues, window) needs the
//! state the freeze reads. That first part was 3.8 ms of 8.3 for 1024
//! connections on one core here (a C loop of the rebuild's calls), and it
//! ran inside the freeze, on the cores the dump and the image transfer
//! need. The source knows every connection's addresses before the freeze
//! (its pre-read), so it names them at Arm (peer protocol 7) and the
//! destination opens their sockets then; TransferSockets finishes each on
//! the socket opened for it ([`super::rebuild()`]).
//!
//! A socket opened here is in repair mode and never connected: bound, it
//! takes no packet (it neither listens nor has a peer), and closing it
//! sends nothing. It binds as the rebuild's sockets do, with repair mode's
//! forced reuse, and lives from Arm until TransferSockets takes it or the
//! migration ends.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};

use nix::sys::socket::{
    AddressFamily, SockFlag, SockProtocol, SockType, SockaddrIn, SockaddrIn6, bind, socket,
};

use super::{SockStateError, spread, sys};

/// A connection to open ahead: its socket's inode on the source (what
/// TransferSockets names it by) and its two ends, as the source read them,
/// and (protocol 9) its send buffer's size then (SO_SNDBUF, 0: unknown).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ToStage {
    pub inode: u64,
    pub local: SocketAddr,
    pub remote: SocketAddr,
    pub sndbuf: u32,
}

/// A socket opened ahead, as TransferSockets finds it: repair mode on,
/// bound, its receive queue selected for repair, and its send buffer
/// forced to `sndbuf` if that is not 0.
#[derive(Debug)]
pub(super) struct StagedSocket {
    pub fd: OwnedFd,
    pub sndbuf: u32,
}

/// Sockets opened ahead, by the inode of the connection each is for.
/// Dropping it closes those not taken (silently: repair mode, never
/// connected).
#[derive(Default)]
pub struct Staged {
    by_inode: HashMap<u64, (ToStage, OwnedFd)>,
}

impl std::fmt::Debug for Staged {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Staged")
            .field("sockets", &self.by_inode.len())
            .finish()
    }
}

impl Staged {
    pub fn len(&self) -> usize {
        self.by_inode.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_inode.is_empty()
    }

    /// The socket opened for the connection with this inode, if it was
    /// opened for these same ends: a connection the source read again in
    /// the freeze may have been another one by then (its inode reused), and
    /// an in-cluster one is moved to this node's address.
    pub(super) fn take(
        &mut self,
        inode: u64,
        local: SocketAddr,
        remote: SocketAddr,
    ) -> Option<StagedSocket> {
        let (staged, _) = self.by_inode.get(&inode)?;
        if staged.local != local || staged.remote != remote {
            return None;
        }
        self.by_inode.remove(&inode).map(|(c, fd)| StagedSocket {
            fd,
            sndbuf: c.sndbuf,
        })
    }
}

/// Opens `c`'s socket ([`open_bound`]) and does what else needs no state
/// but the pre-read's: the send buffer's size, which the rebuild sets
/// again only if the freeze read another, and the receive queue's
/// selection, which the rebuild's first step would make.
fn open_ahead(c: &ToStage) -> Result<OwnedFd, SockStateError> {
    let conn = super::conn_name(c.local, c.remote);
    let fd = open_bound(c.local, &conn)?;
    let err = |op: &'static str| {
        let conn = conn.clone();
        move |source| SockStateError::Sys { op, conn, source }
    };
    if c.sndbuf > 0 {
        sys::force_sndbuf(fd.as_fd(), c.sndbuf).map_err(err("SO_SNDBUFFORCE"))?;
    }
    sys::select_repair_queue(fd.as_fd(), sys::TCP_RECV_QUEUE)
        .map_err(err("selecting the receive queue"))?;
    Ok(fd)
}

/// Opens a socket for each of `conns`, in this thread's network namespace,
/// spread over the cores: repair mode on, bound to its local end. One that
/// fails is left out (TransferSockets then builds it whole, and says why if
/// it fails again); how many failed is logged once, with the first error.
pub fn stage(conns: &[ToStage]) -> Staged {
    let parts = spread::on_threads(
        conns.chunks(spread::chunk_len(conns.len())),
        "stage",
        |chunk| {
            let mut opened = Vec::with_capacity(chunk.len());
            let mut failed = Vec::new();
            for c in chunk {
                match open_ahead(c) {
                    Ok(fd) => opened.push((*c, fd)),
                    Err(e) => failed.push(e),
                }
            }
            Ok((opened, failed))
        },
    );
    let mut staged = Staged::default();
    let mut failed = Vec::new();
    for part in parts {
        match part {
            Ok((opened, f)) => {
                staged
                    .by_inode
                    .extend(opened.into_iter().map(|(c, fd)| (c.inode, (c, fd))));
                failed.extend(f);
            }
            Err(e) => failed.push(e),
        }
    }
    if let Some(first) = failed.first() {
        tracing::warn!(
            failed = failed.len(),
            of = conns.len(),
            first = %first,
            "sockets not opened ahead of the freeze: TransferSockets builds those whole"
        );
    }
    staged
}

/// A new TCP socket of `local`'s family in repair mode, bound to `local`
/// (repair mode binds even to an address:port in use: SK_FORCE_REUSE).
/// What a rebuild needs before the connection's state; `conn` names it in
/// errors.
pub(super) fn open_bound(local: SocketAddr, conn: &str) -> Result<OwnedFd, SockStateError> {
    let family = if local.is_ipv4() {
        AddressFamily::Inet
    } else {
        AddressFamily::Inet6
    };
    let nix_err = |op: &'static str| {
        move |e: nix::Error| SockStateError::Sys {
            op,
            conn: conn.to_owned(),
            source: std::io::Error::from(e),
        }
    };
    let fd = socket(
        family,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC,
        SockProtocol::Tcp,
    )
    .map_err(nix_err("socket"))?;
    sys::set_int(fd.as_fd(), libc::SOL_TCP, sys::TCP_REPAIR, sys::REPAIR_ON).map_err(|source| {
        SockStateError::Sys {
            op: "turning repair on",
            conn: conn.to_owned(),
            source,
        }
    })?;
    bind_to(&fd, local).map_err(nix_err("bind"))?;
    Ok(fd)
}

fn bind_to(fd: &OwnedFd, a: SocketAddr) -> nix::Result<()> {
    match a {
        SocketAddr::V4(v4) => bind(fd.as_raw_fd(), &SockaddrIn::from(v4)),
        SocketAddr::V6(v6) => bind(fd.as_raw_fd(), &SockaddrIn6::from(v6)),
    }
}
