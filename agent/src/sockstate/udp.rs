//! UDP receive queues across a migration.
//!
//! CRIU does not carry a UDP socket's receive queue: datagrams that reached
//! the source's socket but that the process had not read when it was
//! stopped were lost. ferry's data plane already holds them, though: the
//! destination captured every packet since Arm, and skips at the commit
//! those the source delivered. The source therefore peeks, with the
//! process stopped, at what is still queued in each of its UDP sockets
//! (`SO_PEEK_OFF` walks a queue without consuming it), and names those
//! datagrams in the Commit; the destination replays them after all,
//! in their arrival order, although the source's stack did deliver them.
//!
//! A datagram is named by a key both ends can compute: the source from
//! `recvfrom` (peer address, payload) and its socket's port, the
//! destination from the captured IPv4 packet.

use std::collections::HashSet;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};

use nix::sys::socket::{SockaddrStorage, getsockname};

use super::SockStateError;
use super::extract::StoppedSockets;
use super::sys;

/// `SO_PEEK_OFF` (asm-generic/socket.h); UDP supports it since Linux 6.9.
const SO_PEEK_OFF: libc::c_int = 42;

/// The key of a datagram from `peer` to local port `port`.
pub fn datagram_key(peer: SocketAddrV4, port: u16, payload: &[u8]) -> u64 {
    let mut buf = Vec::with_capacity(8 + payload.len());
    buf.extend_from_slice(&peer.ip().octets());
    buf.extend_from_slice(&peer.port().to_be_bytes());
    buf.extend_from_slice(&port.to_be_bytes());
    buf.extend_from_slice(payload);
    crate::capture::digest(&buf)
}

/// The key of a captured IPv4 packet, if it is a whole UDP datagram.
pub fn key_of_packet(ip: &[u8]) -> Option<u64> {
    if ip.len() < 20 || ip[0] >> 4 != 4 || ip[9] != libc::IPPROTO_UDP as u8 {
        return None;
    }
    // A fragment is not a datagram the socket saw as such.
    let frag = u16::from_be_bytes([ip[6], ip[7]]);
    if frag & 0x3fff != 0 {
        return None;
    }
    let ihl = usize::from(ip[0] & 0x0f) * 4;
    let total = usize::from(u16::from_be_bytes([ip[2], ip[3]])).min(ip.len());
    let udp = ip.get(ihl..total)?;
    if udp.len() < 8 {
        return None;
    }
    let len = usize::from(u16::from_be_bytes([udp[4], udp[5]]));
    let payload = udp.get(8..len.max(8).min(udp.len()))?;
    let src = Ipv4Addr::new(ip[12], ip[13], ip[14], ip[15]);
    let sport = u16::from_be_bytes([udp[0], udp[1]]);
    let dport = u16::from_be_bytes([udp[2], udp[3]]);
    Some(datagram_key(SocketAddrV4::new(src, sport), dport, payload))
}

/// The keys of the datagrams waiting, unread, in the IPv4 UDP sockets of
/// a stopped process tree, oldest first per socket. Nothing is consumed:
/// on an abort the process reads them itself.
pub fn unread_datagrams(sockets: &StoppedSockets) -> Result<Vec<u64>, SockStateError> {
    let mut keys = Vec::new();
    for (inode, fd) in sockets.udp() {
        peek_all(*inode, fd.as_fd(), &mut keys)?;
    }
    Ok(keys)
}

fn peek_all(inode: u64, fd: BorrowedFd<'_>, keys: &mut Vec<u64>) -> Result<(), SockStateError> {
    let err = |op: &'static str| {
        move |source: std::io::Error| SockStateError::Sys {
            op,
            conn: format!("UDP socket inode {inode}"),
            source,
        }
    };
    let port = match getsockname::<SockaddrStorage>(fd.as_raw_fd())
        .ok()
        .and_then(|s| s.as_sockaddr_in().map(|a| SocketAddrV4::from(*a)))
    {
        Some(a) => a.port(),
        // Not IPv4: the data plane captures IPv4 only.
        None => return Ok(()),
    };
    if sys::inq(fd).map_err(err("SIOCINQ"))? == 0 {
        return Ok(());
    }
    let before = sys::get_int(fd, libc::SOL_SOCKET, SO_PEEK_OFF).map_err(err("SO_PEEK_OFF"))?;
    sys::set_int(fd, libc::SOL_SOCKET, SO_PEEK_OFF, 0).map_err(err("SO_PEEK_OFF"))?;
    let mut buf = vec![0u8; 65536];
    let result = loop {
        let mut addr: libc::sockaddr_in = empty_sockaddr_in();
        let mut alen = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
        // SAFETY: `buf` and `addr` are writable for the lengths given;
        // recvfrom writes at most that much and updates `alen`.
        let n = unsafe {
            libc::recvfrom(
                fd.as_raw_fd(),
                buf.as_mut_ptr().cast(),
                buf.len(),
                libc::MSG_PEEK | libc::MSG_DONTWAIT | libc::MSG_TRUNC,
                (&mut addr as *mut libc::sockaddr_in).cast(),
                &mut alen,
            )
        };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::WouldBlock {
                break Ok(());
            }
            break Err(err("peeking at the receive queue")(e));
        }
        let n = (n as usize).min(buf.len());
        let peer = SocketAddrV4::new(
            Ipv4Addr::from(u32::from_be(addr.sin_addr.s_addr)),
            u16::from_be(addr.sin_port),
        );
        keys.push(datagram_key(peer, port, &buf[..n]));
    };
    let restored = sys::set_int(fd, libc::SOL_SOCKET, SO_PEEK_OFF, before)
        .map_err(err("restoring SO_PEEK_OFF"));
    result.and(restored)
}

fn empty_sockaddr_in() -> libc::sockaddr_in {
    libc::sockaddr_in {
        sin_family: 0,
        sin_port: 0,
        sin_addr: libc::in_addr { s_addr: 0 },
        sin_zero: [0; 8],
    }
}

/// Gives the UDP sockets of a restored tree their own receive buffer back
/// after the catch-up that followed the replay. The destination restored
/// them wider: it raised `so_rcvbuf` in the images before CRIU's restore
/// (`ferry_criu_image::raise_receive_buffers`), because the replay pours
/// every datagram of the freeze into a socket whose process is still
/// stopped, and the process then reads slower than its clients send for a
/// moment. A socket left at the default holds ~160 small datagrams: 8 ms of
/// 1024 players at 20 Hz. Done in the images, this costs nothing in the
/// freeze; a scan of the tree's descriptors at the commit took ~10 ms at a
/// thousand connections.
///
/// `before` holds each raised socket's local address and its size as the
/// images had it (what `getsockopt(SO_RCVBUF)` reports). A socket whose
/// buffer is no longer `widened` was resized by its process since: it keeps
/// that. Returns how many sockets got their size back.
pub fn give_back_udp_buffers(
    tree: &[i32],
    widened: i32,
    before: &[(SocketAddr, i32)],
) -> Result<usize, SockStateError> {
    let mut left: Vec<(SocketAddr, i32)> = before.to_vec();
    let mut seen = HashSet::new();
    let mut given_back = 0;
    super::extract::for_each_socket(tree, |inode, fd| {
        if left.is_empty()
            || super::extract::kind_of(fd.as_fd()) != super::extract::SocketKind::Udp
            || !seen.insert(inode)
        {
            return Ok(());
        }
        let Some(local) = getsockname::<SockaddrStorage>(fd.as_raw_fd())
            .ok()
            .and_then(super::extract::addr)
        else {
            return Ok(());
        };
        let Some(i) = left.iter().position(|(a, _)| *a == local) else {
            return Ok(());
        };
        let (_, size) = left.swap_remove(i);
        let err = |op: &'static str| {
            move |source: std::io::Error| SockStateError::Sys {
                op,
                conn: format!("UDP socket {local}"),
                source,
            }
        };
        let now = sys::get_int(fd.as_fd(), libc::SOL_SOCKET, libc::SO_RCVBUF)
            .map_err(err("SO_RCVBUF"))?;
        if now == widened {
            // getsockopt reports twice what setsockopt takes.
            sys::set_int(fd.as_fd(), libc::SOL_SOCKET, libc::SO_RCVBUFFORCE, size / 2)
                .map_err(err("SO_RCVBUFFORCE"))?;
            given_back += 1;
        }
        Ok(())
    })?;
    Ok(given_back)
}
