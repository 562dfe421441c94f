//! Which Unix socket is connected to which: the kernel's sock_diag dump of
//! AF_UNIX sockets with their peers (what `ss -x` shows), in ferryd's
//! network namespace. procfs lists Unix sockets but not their peers, and a
//! peer outside the process tree is what CRIU refuses to dump.

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// include/uapi/linux/sock_diag.h
const SOCK_DIAG_BY_FAMILY: u16 = 20;
/// include/uapi/linux/unix_diag.h
const UDIAG_SHOW_PEER: u32 = 0x0000_0004;
const UNIX_DIAG_PEER: u16 = 2;
const NLMSG_HDR_LEN: usize = 16;
/// struct unix_diag_msg: family, type, state, pad (u8 each), ino (u32),
/// cookie (2 × u32).
const UNIX_DIAG_MSG_LEN: usize = 16;

/// Every Unix socket of this network namespace that has a peer, as (inode,
/// peer's inode). Blocking (a netlink dump).
pub fn unix_peers() -> io::Result<HashMap<u64, u64>> {
    // SAFETY: socket(2) takes no pointers; the descriptor it returns is
    // owned by the OwnedFd at once.
    let raw = unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            libc::NETLINK_SOCK_DIAG,
        )
    };
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `raw` is a new descriptor nobody else owns.
    let sock = unsafe { OwnedFd::from_raw_fd(raw) };

    let request = dump_request();
    // SAFETY: sends `request.len()` bytes from a live buffer; the kernel is
    // the default destination of a netlink socket.
    let sent = unsafe { libc::send(sock.as_raw_fd(), request.as_ptr().cast(), request.len(), 0) };
    if sent < 0 {
        return Err(io::Error::last_os_error());
    }

    let mut peers = HashMap::new();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        // SAFETY: receives at most `buf.len()` bytes into a live buffer.
        let n = unsafe { libc::recv(sock.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if parse_messages(&buf[..n as usize], &mut peers)? {
            return Ok(peers);
        }
    }
}

/// An nlmsghdr and a unix_diag_req asking for every socket, with peers.
fn dump_request() -> Vec<u8> {
    let mut req = Vec::with_capacity(NLMSG_HDR_LEN + 24);
    let len = (NLMSG_HDR_LEN + 24) as u32;
    req.extend_from_slice(&len.to_ne_bytes());
    req.extend_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
    let flags = (libc::NLM_F_REQUEST | libc::NLM_F_DUMP) as u16;
    req.extend_from_slice(&flags.to_ne_bytes());
    req.extend_from_slice(&1u32.to_ne_bytes()); // sequence
    req.extend_from_slice(&0u32.to_ne_bytes()); // port id: the kernel's
    // struct unix_diag_req
    req.push(libc::AF_UNIX as u8); // sdiag_family
    req.push(0); // sdiag_protocol
    req.extend_from_slice(&0u16.to_ne_bytes()); // pad
    req.extend_from_slice(&u32::MAX.to_ne_bytes()); // udiag_states: all
    req.extend_from_slice(&0u32.to_ne_bytes()); // udiag_ino
    req.extend_from_slice(&UDIAG_SHOW_PEER.to_ne_bytes());
    req.extend_from_slice(&[0xff; 8]); // udiag_cookie: none (INET_DIAG_NOCOOKIE)
    req
}

fn u16_at(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_ne_bytes(b.get(at..at + 2)?.try_into().ok()?))
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_ne_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

fn malformed(what: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("sock_diag answer: {what}"),
    )
}

/// Reads one datagram of the dump into `peers`; true once the dump is done.
fn parse_messages(mut b: &[u8], peers: &mut HashMap<u64, u64>) -> io::Result<bool> {
    while b.len() >= NLMSG_HDR_LEN {
        let len = u32_at(b, 0).ok_or_else(|| malformed("short header"))? as usize;
        let kind = u16_at(b, 4).ok_or_else(|| malformed("short header"))?;
        if len < NLMSG_HDR_LEN || len > b.len() {
            return Err(malformed("message length out of bounds"));
        }
        let body = &b[NLMSG_HDR_LEN..len];
        match kind as i32 {
            libc::NLMSG_DONE => return Ok(true),
            libc::NLMSG_ERROR => {
                let errno = u32_at(body, 0).ok_or_else(|| malformed("short error"))? as i32;
                if errno != 0 {
                    return Err(io::Error::from_raw_os_error(-errno));
                }
            }
            _ if kind == SOCK_DIAG_BY_FAMILY => {
                let ino = u32_at(body, 4).ok_or_else(|| malformed("short unix_diag_msg"))?;
                let mut attrs = body.get(UNIX_DIAG_MSG_LEN..).unwrap_or(&[]);
                while attrs.len() >= 4 {
                    let alen = u16_at(attrs, 0).unwrap_or(0) as usize;
                    let atype = u16_at(attrs, 2).unwrap_or(0);
                    if alen < 4 || alen > attrs.len() {
                        return Err(malformed("attribute length out of bounds"));
                    }
                    if atype == UNIX_DIAG_PEER
                        && let Some(peer) = u32_at(attrs, 4)
                        && peer != 0
                    {
                        peers.insert(u64::from(ino), u64::from(peer));
                    }
                    let step = (alen + 3) & !3;
                    attrs = attrs.get(step..).unwrap_or(&[]);
                }
            }
            _ => {}
        }
        let step = (len + 3) & !3;
        b = b.get(step..).unwrap_or(&[]);
    }
    Ok(false)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;
    use std::os::unix::net::UnixStream;

    fn inode(s: &UnixStream) -> u64 {
        std::fs::metadata(format!("/proc/self/fd/{}", s.as_raw_fd()))
            .unwrap()
            .ino()
    }

    #[test]
    fn a_socket_pair_names_each_other_as_peers() {
        let (a, b) = UnixStream::pair().unwrap();
        let peers = unix_peers().unwrap();
        assert_eq!(peers.get(&inode(&a)), Some(&inode(&b)));
        assert_eq!(peers.get(&inode(&b)), Some(&inode(&a)));
    }

    #[test]
    fn truncated_answers_are_errors_not_panics() {
        let mut peers = HashMap::new();
        // A header claiming more bytes than the datagram holds.
        let mut msg = vec![0u8; 16];
        msg[..4].copy_from_slice(&64u32.to_ne_bytes());
        msg[4..6].copy_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
        assert!(parse_messages(&msg, &mut peers).is_err());
        // A message with an attribute running past its end.
        let mut msg = vec![0u8; 36];
        msg[..4].copy_from_slice(&36u32.to_ne_bytes());
        msg[4..6].copy_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
        msg[32..34].copy_from_slice(&40u16.to_ne_bytes());
        assert!(parse_messages(&msg, &mut peers).is_err());
        assert!(peers.is_empty());
    }
}
