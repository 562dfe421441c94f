//! The sockets of a process tree as descriptors of ferryd's own
//! (`pidfd_getfd`), and what kind each is: shared by the read before the
//! freeze (`preread`) and the read inside it (`extract`).

use std::net::SocketAddr;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use nix::sys::socket::SockaddrStorage;

use super::{SockStateError, sys};

/// What kind of socket a descriptor is, from the socket itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum SocketKind {
    /// TCP, neither listening nor closed: a connection (CRIU restores
    /// listening and unconnected ones itself).
    TcpConnected,
    Udp,
    Other,
}

pub(super) fn kind_of(fd: BorrowedFd<'_>) -> SocketKind {
    let domain = sys::get_int(fd, libc::SOL_SOCKET, libc::SO_DOMAIN).unwrap_or(-1);
    if domain != libc::AF_INET && domain != libc::AF_INET6 {
        return SocketKind::Other;
    }
    match sys::get_int(fd, libc::SOL_SOCKET, libc::SO_PROTOCOL) {
        Ok(p) if p == libc::IPPROTO_TCP => match sys::tcp_info_head(fd) {
            Ok(head) if head[0] != sys::TCP_LISTEN && head[0] != sys::TCP_CLOSE => {
                SocketKind::TcpConnected
            }
            _ => SocketKind::Other,
        },
        // A raw socket of protocol UDP is no UDP socket.
        Ok(p)
            if p == libc::IPPROTO_UDP
                && sys::get_int(fd, libc::SOL_SOCKET, libc::SO_TYPE).ok()
                    == Some(libc::SOCK_DGRAM) =>
        {
            SocketKind::Udp
        }
        _ => SocketKind::Other,
    }
}

/// Calls `f` with ferryd's duplicate of every socket descriptor of the
/// tree's processes, and its inode (a socket held by several descriptors
/// comes once per descriptor). Reading the links in /proc/PID/fd costs
/// tens of microseconds each; taking every descriptor and asking it costs
/// a few.
pub(super) fn for_each_socket(
    tree: &[i32],
    mut f: impl FnMut(u64, OwnedFd) -> Result<(), SockStateError>,
) -> Result<(), SockStateError> {
    for &pid in tree {
        let pidfd = crate::process::pidfd::open(pid).map_err(|source| SockStateError::Process {
            op: "pidfd_open",
            pid,
            source,
        })?;
        let dir = format!("/proc/{pid}/fd");
        let entries = std::fs::read_dir(&dir).map_err(|source| SockStateError::Process {
            op: "listing /proc/PID/fd",
            pid,
            source,
        })?;
        for entry in entries.flatten() {
            let Some(fdnum) = entry.file_name().to_str().and_then(|s| s.parse().ok()) else {
                continue;
            };
            let fd = match sys::pidfd_getfd(pidfd.as_fd(), fdnum) {
                Ok(fd) => fd,
                // Closed since the listing (the tree runs still, or it is a
                // descriptor of the listing itself).
                Err(e) if e.raw_os_error() == Some(libc::EBADF) => continue,
                Err(source) => {
                    return Err(SockStateError::Process {
                        op: "pidfd_getfd",
                        pid,
                        source,
                    });
                }
            };
            let Ok(st) = nix::sys::stat::fstat(&fd) else {
                continue;
            };
            if st.st_mode & libc::S_IFMT != libc::S_IFSOCK {
                continue;
            }
            f(st.st_ino, fd)?;
        }
    }
    Ok(())
}

/// A socket address of the IPv4 or IPv6 family.
pub(super) fn addr(s: SockaddrStorage) -> Option<SocketAddr> {
    if let Some(v4) = s.as_sockaddr_in() {
        return Some(SocketAddr::V4((*v4).into()));
    }
    s.as_sockaddr_in6().map(|v6| SocketAddr::V6((*v6).into()))
}
