//! UDP receive queues across a migration.
//!
//! CRIU does not carry a UDP socket's receive queue: the datagrams that
//! reached the source's socket but that the process had not read when it
//! was stopped would be lost. With the process stopped, the source peeks
//! at what is still queued in each of its UDP sockets (`SO_PEEK_OFF` walks
//! a queue without consuming it; `IP_PKTINFO` gives each datagram's
//! destination address) and sends those datagrams, whole, in the Commit
//! (peer protocol 8). The destination hands them to the restored sockets
//! first, rebuilt as the IPv4 or IPv6 packets they arrived as, then replays what it
//! captured and the source did not deliver: every datagram once, in the
//! order it arrived. Nothing is consumed on the source: after an abort the
//! process reads its queue itself.
//!
//! A peer of protocol 4 to 7 gets only a key per queued datagram
//! ([`datagram_key`]) and replays those it captured itself, from Arm on:
//! the ones queued before Arm are lost with such a peer.

use std::collections::HashSet;
use std::io::IoSliceMut;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};

use nix::sys::socket::{
    ControlMessageOwned, MsgFlags, SockaddrStorage, getsockname, getsockopt, recvmsg, setsockopt,
    sockopt,
};

use super::SockStateError;
use super::extract::StoppedSockets;
use super::sys;

/// `SO_PEEK_OFF` (asm-generic/socket.h); UDP supports it since Linux 6.9.
const SO_PEEK_OFF: libc::c_int = 42;

/// A datagram waiting, unread, in a stopped process's UDP socket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueuedDatagram {
    /// Its sender (an IPv4 one as such, also in a dual-stack socket).
    pub peer: SocketAddr,
    /// The address it was sent to (from `IP_PKTINFO` or `IPV6_PKTINFO`:
    /// the IP header's), and the socket's port. Of the peer's family.
    pub local: SocketAddr,
    pub payload: Vec<u8>,
}

impl QueuedDatagram {
    /// Its [`datagram_key`], for a peer of protocol 4 to 7.
    pub fn key(&self) -> u64 {
        datagram_key(self.peer, self.local.port(), &self.payload)
    }
}

/// The key of a datagram from `peer` to local port `port`: over the peer's
/// address (4 or 16 bytes, an IPv4 one as such), port, the local port and
/// the payload.
pub fn datagram_key(peer: SocketAddr, port: u16, payload: &[u8]) -> u64 {
    let mut buf = Vec::with_capacity(20 + payload.len());
    match peer.ip().to_canonical() {
        IpAddr::V4(ip) => buf.extend_from_slice(&ip.octets()),
        IpAddr::V6(ip) => buf.extend_from_slice(&ip.octets()),
    }
    buf.extend_from_slice(&peer.port().to_be_bytes());
    buf.extend_from_slice(&port.to_be_bytes());
    buf.extend_from_slice(payload);
    crate::dataplane::capture::digest(&buf)
}

/// The key of a captured IPv4 or IPv6 packet, if it is a whole UDP
/// datagram (an IPv6 one with UDP right after the fixed header).
pub fn key_of_packet(ip: &[u8]) -> Option<u64> {
    let (src, l4, end): (IpAddr, usize, usize) = match *ip.first()? >> 4 {
        4 => {
            if ip.len() < 20 || ip[9] != libc::IPPROTO_UDP as u8 {
                return None;
            }
            // A fragment is not a datagram the socket saw as such.
            let frag = u16::from_be_bytes([ip[6], ip[7]]);
            if frag & 0x3fff != 0 {
                return None;
            }
            let src: [u8; 4] = ip[12..16].try_into().ok()?;
            let total = usize::from(u16::from_be_bytes([ip[2], ip[3]]));
            (src.into(), usize::from(ip[0] & 0x0f) * 4, total)
        }
        6 => {
            if ip.len() < 40 || ip[6] != libc::IPPROTO_UDP as u8 {
                return None;
            }
            let src: [u8; 16] = ip[8..24].try_into().ok()?;
            (
                src.into(),
                40,
                40 + usize::from(u16::from_be_bytes([ip[4], ip[5]])),
            )
        }
        _ => return None,
    };
    let udp = ip.get(l4..end.min(ip.len()))?;
    if udp.len() < 8 {
        return None;
    }
    let len = usize::from(u16::from_be_bytes([udp[4], udp[5]]));
    let payload = udp.get(8..len.max(8).min(udp.len()))?;
    let sport = u16::from_be_bytes([udp[0], udp[1]]);
    let dport = u16::from_be_bytes([udp[2], udp[3]]);
    Some(datagram_key(SocketAddr::new(src, sport), dport, payload))
}

/// The datagrams waiting, unread, in the UDP sockets of a stopped process
/// tree, oldest first per socket: IPv4 and IPv6 sockets (a dual-stack
/// one's IPv4 datagrams as IPv4). Nothing is consumed, and each socket's
/// options are as they were after.
pub fn queued_datagrams(sockets: &StoppedSockets) -> Result<Vec<QueuedDatagram>, SockStateError> {
    let mut queued = Vec::new();
    for (inode, fd) in sockets.udp() {
        peek_all(*inode, fd.as_fd(), &mut queued)?;
    }
    Ok(queued)
}

/// The family of a UDP socket, as far as peeking is concerned.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Family {
    V4,
    /// IPv6, which receives IPv4 datagrams as IPv4-mapped addresses.
    V6,
}

fn peek_all(
    inode: u64,
    fd: BorrowedFd<'_>,
    queued: &mut Vec<QueuedDatagram>,
) -> Result<(), SockStateError> {
    let err = |op: &'static str| {
        move |source: std::io::Error| SockStateError::Udp {
            op,
            socket: format!("inode {inode}"),
            source,
        }
    };
    let nix_err = |op: &'static str| move |e: nix::Error| err(op)(std::io::Error::from(e));
    let local = getsockname::<SockaddrStorage>(fd.as_raw_fd()).map_err(nix_err("getsockname"))?;
    let (family, bound) = if let Some(a) = local.as_sockaddr_in() {
        (Family::V4, SocketAddr::from(*a))
    } else if let Some(a) = local.as_sockaddr_in6() {
        (Family::V6, crate::inet::canonical(SocketAddr::from(*a)))
    } else {
        return Ok(());
    };
    if sys::inq(fd).map_err(err("SIOCINQ"))? == 0 {
        return Ok(());
    }
    // The destination address of each datagram: the process may not have
    // asked for it, so it is asked for here, and put back after.
    let pktinfo_before = match family {
        Family::V4 => getsockopt(&fd, sockopt::Ipv4PacketInfo),
        Family::V6 => getsockopt(&fd, sockopt::Ipv6RecvPacketInfo),
    }
    .map_err(nix_err("getsockopt(pktinfo)"))?;
    let peek_off_before =
        sys::get_int(fd, libc::SOL_SOCKET, SO_PEEK_OFF).map_err(err("SO_PEEK_OFF"))?;
    let set_pktinfo = |on: bool| match family {
        Family::V4 => setsockopt(&fd, sockopt::Ipv4PacketInfo, &on),
        Family::V6 => setsockopt(&fd, sockopt::Ipv6RecvPacketInfo, &on),
    };
    let result = set_pktinfo(true)
        .map_err(nix_err("setsockopt(pktinfo)"))
        .and_then(|()| {
            sys::set_int(fd, libc::SOL_SOCKET, SO_PEEK_OFF, 0).map_err(err("SO_PEEK_OFF"))
        })
        .and_then(|()| {
            peek_each(fd, family, bound, queued).map_err(nix_err("peeking at the receive queue"))
        });
    let restored = sys::set_int(fd, libc::SOL_SOCKET, SO_PEEK_OFF, peek_off_before)
        .map_err(err("restoring SO_PEEK_OFF"))
        .and(set_pktinfo(pktinfo_before).map_err(nix_err("restoring the pktinfo option")));
    result.and(restored)
}

/// Peeks at every datagram of a socket set up by [`peek_all`].
fn peek_each(
    fd: BorrowedFd<'_>,
    family: Family,
    bound: SocketAddr,
    queued: &mut Vec<QueuedDatagram>,
) -> nix::Result<()> {
    let mut buf = vec![0u8; 65536];
    let mut cmsg = nix::cmsg_space!(libc::in6_pktinfo);
    let flags = MsgFlags::MSG_PEEK | MsgFlags::MSG_DONTWAIT | MsgFlags::MSG_TRUNC;
    loop {
        let (len, peer, dst) = {
            let mut iov = [IoSliceMut::new(&mut buf)];
            let msg = match recvmsg::<SockaddrStorage>(
                fd.as_raw_fd(),
                &mut iov,
                Some(&mut cmsg),
                flags,
            ) {
                Ok(m) => m,
                Err(nix::Error::EAGAIN) => return Ok(()),
                Err(nix::Error::EINTR) => continue,
                Err(e) => return Err(e),
            };
            let peer = msg.address.as_ref().and_then(crate::inet::of_sockaddr);
            let mut dst = None;
            for c in msg.cmsgs()? {
                match c {
                    ControlMessageOwned::Ipv4PacketInfo(i) if family == Family::V4 => {
                        dst = Some(IpAddr::from(u32::from_be(i.ipi_addr.s_addr).to_be_bytes()));
                    }
                    ControlMessageOwned::Ipv6PacketInfo(i) if family == Family::V6 => {
                        dst = Some(IpAddr::from(i.ipi6_addr.s6_addr).to_canonical());
                    }
                    _ => {}
                }
            }
            (msg.bytes, peer, dst)
        };
        let Some(peer) = peer else { continue };
        let dst = dst.unwrap_or(bound.ip());
        queued.push(QueuedDatagram {
            peer,
            local: SocketAddr::new(dst, bound.port()),
            payload: buf[..len.min(buf.len())].to_vec(),
        });
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
    super::descriptors::for_each_socket(tree, |inode, fd| {
        if left.is_empty()
            || super::descriptors::kind_of(fd.as_fd()) != super::descriptors::SocketKind::Udp
            || !seen.insert(inode)
        {
            return Ok(());
        }
        let Some(local) = getsockname::<SockaddrStorage>(fd.as_raw_fd())
            .ok()
            .and_then(super::descriptors::addr)
        else {
            return Ok(());
        };
        let Some(i) = left.iter().position(|(a, _)| *a == local) else {
            return Ok(());
        };
        let (_, size) = left.swap_remove(i);
        let err = |op: &'static str| {
            move |source: std::io::Error| SockStateError::Udp {
                op,
                socket: local.to_string(),
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
