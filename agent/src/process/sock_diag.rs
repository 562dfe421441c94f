//! The kernel's sock_diag netlink dumps (what `ss` reads), in ferryd's
//! network namespace: one request, the answers read until the dump is
//! done. The callers say which sockets they want; a state filter here
//! spares the kernel the printing of every socket that procfs does.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// include/uapi/linux/sock_diag.h
pub(super) const SOCK_DIAG_BY_FAMILY: u16 = 20;
pub(super) const NLMSG_HDR_LEN: usize = 16;

/// Sends one dump request (`body`: the family's request struct) and hands
/// the body of every answer to `each`, until the kernel says done.
/// Blocking.
pub(super) fn dump(body: &[u8], mut each: impl FnMut(&[u8]) -> io::Result<()>) -> io::Result<()> {
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

    let request = request(body);
    // SAFETY: sends `request.len()` bytes from a live buffer; the kernel is
    // the default destination of a netlink socket.
    let sent = unsafe { libc::send(sock.as_raw_fd(), request.as_ptr().cast(), request.len(), 0) };
    if sent < 0 {
        return Err(io::Error::last_os_error());
    }
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
        if parse_messages(&buf[..n as usize], &mut each)? {
            return Ok(());
        }
    }
}

/// An nlmsghdr asking for a dump, and `body`.
fn request(body: &[u8]) -> Vec<u8> {
    let len = (NLMSG_HDR_LEN + body.len()) as u32;
    let mut req = Vec::with_capacity(len as usize);
    req.extend_from_slice(&len.to_ne_bytes());
    req.extend_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
    let flags = (libc::NLM_F_REQUEST | libc::NLM_F_DUMP) as u16;
    req.extend_from_slice(&flags.to_ne_bytes());
    req.extend_from_slice(&1u32.to_ne_bytes()); // sequence
    req.extend_from_slice(&0u32.to_ne_bytes()); // port id: the kernel's
    req.extend_from_slice(body);
    req
}

pub(super) fn u16_at(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_ne_bytes(b.get(at..at + 2)?.try_into().ok()?))
}

pub(super) fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_ne_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

pub(super) fn malformed(what: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("sock_diag answer: {what}"),
    )
}

/// Hands each answer of one datagram of the dump to `each`; true once the
/// dump is done.
pub(super) fn parse_messages(
    mut b: &[u8],
    each: &mut impl FnMut(&[u8]) -> io::Result<()>,
) -> io::Result<bool> {
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
            _ if kind == SOCK_DIAG_BY_FAMILY => each(body)?,
            _ => {}
        }
        let step = (len + 3) & !3;
        b = b.get(step..).unwrap_or(&[]);
    }
    Ok(false)
}

/// A TCP or UDP socket as inet_diag gives it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct InetDiagEntry {
    /// The TCP state number (a UDP socket: 7, close, or 1 once connected).
    pub state: u8,
    pub local_port: u16,
    /// The peer's address (unspecified when unconnected; an IPv4-mapped
    /// one as IPv4).
    pub remote: Option<std::net::IpAddr>,
    /// A listener's accept queue; a connection's unread bytes.
    pub rqueue: u32,
    /// 0 for a handshake under way (a request socket) or a TIME_WAIT one.
    pub inode: u32,
}

/// struct inet_diag_req_v2: family, protocol, ext, pad (u8 each), states
/// (u32), then a zeroed inet_diag_sockid (48 bytes, no cookie).
const INET_DIAG_REQ_V2_LEN: usize = 56;
/// struct inet_diag_msg up to and including idiag_inode.
const INET_DIAG_MSG_LEN: usize = 72;

/// Every state: what procfs's tables list.
pub(super) const ALL_STATES: u32 = u32::MAX;

/// The sockets of one address family (`libc::AF_INET` or `AF_INET6`) and
/// protocol (`libc::IPPROTO_TCP` or `IPPROTO_UDP`) in the states of
/// `states` (a bit per TCP state number). A TCP request for SYN_RECV also
/// gets the handshakes under way, reported as SYN_RECV.
pub(super) fn inet_sockets(
    family: i32,
    protocol: i32,
    states: u32,
) -> io::Result<Vec<InetDiagEntry>> {
    let mut body = vec![0u8; INET_DIAG_REQ_V2_LEN];
    body[0] = family as u8;
    body[1] = protocol as u8;
    body[4..8].copy_from_slice(&states.to_ne_bytes());
    // No cookie to match: INET_DIAG_NOCOOKIE.
    body[48..56].copy_from_slice(&[0xff; 8]);
    let mut out = Vec::new();
    dump(&body, |m| {
        if m.len() < INET_DIAG_MSG_LEN {
            return Err(malformed("short inet_diag_msg"));
        }
        // inet_diag_sockid from byte 4: the ports (network order), then
        // the source and destination addresses, 16 bytes each.
        let remote = match i32::from(m[0]) {
            libc::AF_INET => Some(std::net::Ipv4Addr::new(m[24], m[25], m[26], m[27]).into()),
            libc::AF_INET6 => {
                let ip: [u8; 16] = m[24..40].try_into().expect("16 bytes");
                Some(std::net::IpAddr::from(ip).to_canonical())
            }
            _ => None,
        };
        out.push(InetDiagEntry {
            state: m[1],
            local_port: u16::from_be_bytes([m[4], m[5]]),
            remote,
            rqueue: u32_at(m, 56).unwrap_or(0),
            inode: u32_at(m, 68).unwrap_or(0),
        });
        Ok(())
    })?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    #[test]
    fn a_listener_and_its_waiting_connection_are_dumped() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let inode = std::fs::metadata(format!("/proc/self/fd/{}", l.as_raw_fd()))
            .unwrap()
            .ino();
        let listening = |e: &&InetDiagEntry| e.local_port == port && e.state == 10;
        let tcp_sockets = |states| inet_sockets(libc::AF_INET, libc::IPPROTO_TCP, states);
        let found = tcp_sockets(1 << 10).unwrap();
        let mine = found.iter().find(listening).expect("the listener");
        assert_eq!((u64::from(mine.inode), mine.rqueue), (inode, 0));
        // Only what was asked for: no established connection.
        let _client = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let found = tcp_sockets(1 << 10).unwrap();
        assert!(found.iter().all(|e| e.state == 10), "{found:?}");
        assert_eq!(found.iter().find(listening).unwrap().rqueue, 1);
        let established = tcp_sockets(1 << 1).unwrap();
        let accepted = established
            .iter()
            .find(|e| e.local_port == port)
            .unwrap_or_else(|| panic!("{established:?}"));
        assert_eq!(
            accepted.remote,
            Some(std::net::Ipv4Addr::LOCALHOST.into()),
            "the peer's address"
        );
    }

    #[test]
    fn truncated_answers_are_errors_not_panics() {
        let mut seen = 0;
        let mut count = |_: &[u8]| {
            seen += 1;
            Ok(())
        };
        // A header claiming more bytes than the datagram holds.
        let mut msg = vec![0u8; 16];
        msg[..4].copy_from_slice(&64u32.to_ne_bytes());
        msg[4..6].copy_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
        assert!(parse_messages(&msg, &mut count).is_err());
        assert_eq!(seen, 0);
    }
}
